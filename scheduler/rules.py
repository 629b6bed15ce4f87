"""Pure scheduling rules: env parsing, grant expiry, backlog admission, grant order,
tick arbitration.

Every function here takes plain data and returns plain data, so each rule is tested by
a table (tests/unit/test_rules.py). The stateful code (`core`, `slot`, `backlog`)
only gathers the inputs and carries out the result.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import NamedTuple, Sequence

DEFAULT_GRANT_ROUNDS = 8
_UNSIGNED_INT = re.compile(r"\d+")
_TRUE_WORDS = {"1", "true", "yes", "on"}
_FALSE_WORDS = {"0", "false", "no", "off"}


def parse_grant_budget(raw: str | None, default: int = DEFAULT_GRANT_ROUNDS) -> int:
    """Grant budget (slices per grant) from an env value.

    Whitespace is trimmed; only a plain unsigned integer counts, anything else
    (missing, empty, negative, fractional, words) falls back to `default`. `0` is
    valid and disables rotation.
    >>> parse_grant_budget(" 12 "), parse_grant_budget("0"), parse_grant_budget("8.5")
    (12, 0, 8)
    """
    if raw is None:
        return default
    text = raw.strip()
    if not _UNSIGNED_INT.fullmatch(text):
        return default
    return int(text)


def parse_tick_slice(raw: str | None, default: bool = True) -> bool:
    """Tick-slice gate from an env value: `0` (or false/no/off) disables, `1`
    (or true/yes/on) enables, anything else keeps `default`."""
    if raw is None:
        return default
    text = raw.strip().lower()
    if text in _FALSE_WORDS:
        return False
    if text in _TRUE_WORDS:
        return True
    return default


def grant_expired(slices_run: int, budget: int, backlog_nonempty: bool) -> bool:
    """Whether the active job must park at this boundary.

    Only under contention (someone waits in the backlog); budget 0 never expires.
    >>> grant_expired(8, 8, True), grant_expired(7, 8, True), grant_expired(100, 8, False)
    (True, False, False)
    """
    return budget > 0 and backlog_nonempty and slices_run >= budget


def can_join_backlog(backlog_len: int, cap: int, budget: int) -> bool:
    """Whether a speculative-eligible request may wait in the grant backlog.

    Below the cap only; budget 0 (no rotation) admits nobody, which keeps the legacy
    classic fallback for requests arriving while the slot is held.
    """
    return budget > 0 and backlog_len < cap


def batch_allows_speculation(num_others: int, disable_by_batch_size: int) -> bool:
    """Whether a request that has not started speculating may still take the slot or
    join the ring, given `num_others` other unfinished requests (classic rows, queued,
    slot holder, ring entries, arrivals not yet routed).

    The slot runs its own forward passes beside the classic batch, so every other live
    request makes it dearer: with `disable_by_batch_size` N > 0 the request goes
    classic once N or more others are live (1 = only a lone request speculates);
    0 never disables.
    >>> batch_allows_speculation(0, 1), batch_allows_speculation(1, 1), batch_allows_speculation(9, 0)
    (True, False, True)
    """
    return disable_by_batch_size == 0 or num_others < disable_by_batch_size


def should_demote(num_others: int, disable_by_batch_size: int, num_rows: int, max_rows: int) -> bool:
    """Whether a started speculative session (the slot holder at a slice boundary, or
    a parked job at its promotion) moves into the classic batch.

    The batch-size rule applied to a request that already speculates: with
    `disable_by_batch_size` N > 0 and N or more other live requests it demotes, if the
    batch has a free row (at `max_rows` it keeps speculating rather than stall).
    0 never demotes.
    >>> should_demote(1, 1, 1, 16), should_demote(0, 1, 0, 16), should_demote(3, 0, 3, 16)
    (True, False, False)
    >>> should_demote(2, 1, 16, 16)
    False
    """
    return not batch_allows_speculation(num_others, disable_by_batch_size) and num_rows < max_rows


class GrantView(NamedTuple):
    """What grant order looks at for one backlog entry.

    `arrival_seq` is the order in which the entry joined the ring (a parked job rejoins
    at the back), so FIFO within a lane is ring order.
    """

    lane: int
    arrival_seq: int
    skipped_grants: int


def overdue_indices(entries: Sequence[GrantView], skip_cap: int) -> list[int]:
    """Entries skipped `skip_cap` or more times: the anti-starvation floor."""
    return [i for i, e in enumerate(entries) if e.skipped_grants >= skip_cap]


def next_grant_index(entries: Sequence[GrantView], skip_cap: int) -> int:
    """Index of the entry that gets the slot next.

    Any overdue entry wins over lanes: the most-skipped one, the earliest on ties.
    Otherwise the highest lane (lowest `Lane` value) wins, FIFO within a lane.
    >>> next_grant_index([GrantView(1, 0, 2), GrantView(0, 1, 0)], skip_cap=2)
    0
    >>> next_grant_index([GrantView(1, 0, 1), GrantView(0, 1, 0)], skip_cap=2)
    1
    """
    if not entries:
        raise ValueError("next_grant_index needs at least one entry")
    overdue = overdue_indices(entries, skip_cap)
    if overdue:
        return min(overdue, key=lambda i: (-entries[i].skipped_grants, entries[i].arrival_seq))
    return min(range(len(entries)), key=lambda i: (entries[i].lane, entries[i].arrival_seq))


def slice_takes_tick(yielded_last: bool, others_have_work: bool) -> bool:
    """Whether pending speculative work takes this tick.

    Strict alternation under contention (a speculative action never follows another
    while classic work waits); with no classic work the slice takes every tick.
    """
    return not others_have_work or not yielded_last


def num_to_admit(num_queued: int, num_rows: int, max_rows: int, prefill_batch: int) -> int:
    """How many queued classic requests one prefill admits: bounded by free rows and
    the prefill batch size."""
    return max(0, min(num_queued, max_rows - num_rows, prefill_batch))


class Action(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    SPECULATIVE = "speculative"
    IDLE = "idle"


class SpecStep(enum.Enum):
    """Which speculative action the slot state calls for."""

    BEGIN = "begin"  # the installed job's slice 0 (prefill + first token)
    ROUND = "round"  # one round of the active job
    PROMOTE = "promote"  # slot empty, backlog non-empty: grant the next entry


@dataclass(frozen=True)
class Decision:
    """The one model action of a tick, as plain data."""

    action: Action
    spec_step: SpecStep | None = None
    num_prefill: int = 0


def decide(
    *,
    spec_step: SpecStep | None,
    yielded_last: bool,
    num_queued: int,
    num_rows: int,
    max_rows: int,
    prefill_batch: int,
    fused: bool = False,
) -> Decision:
    """Tick arbitration: speculative work (if any) per `slice_takes_tick`; otherwise a
    classic prefill when queued requests fit, otherwise a decode step over the rows.

    `spec_step` is None when no speculative work is pending (no active job and an
    empty backlog). Prefill goes before decode so new rows join the batch promptly;
    it is bounded by free rows, so decode cannot starve. With `fused`, a round's
    forward also decodes every classic row, so rows do not count as waiting work
    against a ROUND or a PROMOTE (whose round they ride); prefill still alternates
    with them.
    >>> decide(spec_step=SpecStep.ROUND, yielded_last=True, num_queued=0, num_rows=3,
    ...        max_rows=8, prefill_batch=4, fused=True).action
    <Action.SPECULATIVE: 'speculative'>
    >>> decide(spec_step=SpecStep.ROUND, yielded_last=True, num_queued=0, num_rows=3,
    ...        max_rows=8, prefill_batch=4).action
    <Action.DECODE: 'decode'>
    """
    num_prefill = num_to_admit(num_queued, num_rows, max_rows, prefill_batch)
    rows_ride_along = fused and spec_step in (SpecStep.ROUND, SpecStep.PROMOTE)
    others_have_work = num_prefill > 0 or (num_rows > 0 and not rows_ride_along)
    if spec_step is not None and slice_takes_tick(yielded_last, others_have_work):
        return Decision(Action.SPECULATIVE, spec_step=spec_step)
    if num_prefill > 0:
        return Decision(Action.PREFILL, num_prefill=num_prefill)
    if num_rows > 0:
        return Decision(Action.DECODE)
    return Decision(Action.IDLE)
