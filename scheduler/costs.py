"""What speculation costs the whole tick: the fused tick's verdict, per request and batch.

In the fused tick the slot holder's verify rides in the classic batch's forward, so
speculating costs the tick its extra verify tokens and the drafting, and pays the
holder's accepted drafts. With b other rows in the batch:

    with the slot:     (b + 1 + accepted) tokens in  fused[b] + draft  seconds
    without it:        (b + 1) tokens            in  decode[b + 1]     seconds

`speculation_pays` compares the two rates. The costs belong to the machine and model
(`TickCosts`, measured by the runner at load); the acceptance belongs to the request
(`AcceptanceTracker`: each request's own recent rounds; a request without rounds is
taken optimistically so that it can show what it accepts), so one kind of traffic
never switches speculation off for another.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple

EMA_WEIGHT = 0.3  # weight of the newest round in a request's acceptance estimate
# ... where only running rounds shows what a stream accepts (a draft model: no shadow rounds).
# One round accepts 0 to K drafts, so a fast average often dips below break-even by chance,
# and each dip parks the stream for HOLD_TURNS tokens or more that nothing measures: one
# SmolLM2 chat stream with its draft (K 2) speculated on 28 % of its ticks at 0.3, where
# always speculating ran 1.12x (docs/benchmarks.md, "SmolLM2 with its draft").
UNSHADOWED_EMA_WEIGHT = 0.1
# Speculating beside a batch must beat decoding by this factor: what the tick times do
# not show (rows moving in and out of the batch, and streams that finish apart, so
# their successors' prefills no longer batch) costs about this much on the CPU runs of
# scripts/bench/concurrency.py (docs/benchmarks.md, scenario 6).
BATCH_MARGIN = 1.1
RELAX_WEIGHT = 0.05  # how far each turn-away moves an estimate back toward all-accepted
# A stream the gate parked because speculating cost more than it returned waits this
# many turn-aways (one a tick while the slot is free: about one of its tokens each)
# before its estimate starts to relax, twice as many after each further such park, at
# most `HOLD_MAX` times as many (a park because the batch grew is undone by the batch
# shrinking: `pays` then admits the same estimate, held or not):
# a stream that accepts nothing (sampled text with no repeats) stops paying a grant and
# a park every few tokens, while one whose text turns repetitive is still tried again.
HOLD_TURNS = 16
HOLD_MAX = 16


@dataclass(frozen=True)
class TickCosts:
    """Seconds of one model forward on this replica: `decode[b]` is a decode step of
    b rows, `fused[b]` the same b rows plus one verify of 1 + K tokens (`fused[0]`: the
    verify alone), `draft` proposing K tokens, `all_verify[b]` (optional) b rows each
    verifying 1 + K tokens (every row drafting), `one_draft[b]` (optional) b rows of
    which one brings a draft (a step's first draft), `half_one[b]` (optional) b rows
    of which b // 2 bring one draft each. Sizes in between interpolate
    linearly; past the largest measured size, the last two extrapolate.
    >>> TickCosts({1: 2.0, 3: 4.0}, {0: 3.0, 2: 5.0}, 0.5).decode_s(2)
    3.0
    """

    decode: dict[int, float]
    fused: dict[int, float]
    draft: float
    all_verify: dict[int, float] = field(default_factory=dict)
    one_draft: dict[int, float] = field(default_factory=dict)
    half_one: dict[int, float] = field(default_factory=dict)

    def decode_s(self, num_rows: int) -> float:
        return _interpolate(self.decode, num_rows)

    def fused_s(self, num_rows: int) -> float:
        return _interpolate(self.fused, num_rows)

    def to_json(self) -> dict:
        """Seconds by table, for `from_json` (JSON's keys are strings).
        >>> import json
        >>> costs = TickCosts({1: 2.0, 3: 4.0}, {0: 3.0}, 0.5, one_draft={1: 2.5})
        >>> TickCosts.from_json(json.loads(json.dumps(costs.to_json()))) == costs
        True
        """
        return {
            f.name: {str(b): s for b, s in value.items()} if isinstance(value, dict) else value
            for f in dataclasses.fields(self)
            for value in (getattr(self, f.name),)
        }

    @classmethod
    def from_json(cls, data: dict) -> "TickCosts":
        """Raises ValueError, TypeError or AttributeError on anything `to_json` did not write."""
        return cls(
            **{
                f.name: float(data[f.name])
                if f.name == "draft"
                else {int(b): float(s) for b, s in data[f.name].items()}
                for f in dataclasses.fields(cls)
                if f.name in data
            }
        )

    def to_dict(self) -> dict:
        return {
            "decode_ms": {b: round(s * 1e3, 3) for b, s in sorted(self.decode.items())},
            "fused_ms": {b: round(s * 1e3, 3) for b, s in sorted(self.fused.items())},
            "all_verify_ms": {b: round(s * 1e3, 3) for b, s in sorted(self.all_verify.items())},
            "one_draft_ms": {b: round(s * 1e3, 3) for b, s in sorted(self.one_draft.items())},
            "half_one_ms": {b: round(s * 1e3, 3) for b, s in sorted(self.half_one.items())},
            "draft_ms": round(self.draft * 1e3, 3),
        }


def _interpolate(table: dict[int, float], x: int) -> float:
    if not table:
        raise ValueError("empty cost table")
    if x in table:
        return table[x]
    sizes = sorted(table)
    if len(sizes) == 1:
        return table[sizes[0]]
    if x < sizes[0]:
        lo, hi = sizes[0], sizes[1]
    elif x > sizes[-1]:
        lo, hi = sizes[-2], sizes[-1]
    else:
        lo, hi = max(s for s in sizes if s < x), min(s for s in sizes if s > x)
    return max(table[lo] + (table[hi] - table[lo]) / (hi - lo) * (x - lo), 0.0)


def speculation_pays(num_rows: int, accepted_per_round: float, costs: TickCosts) -> bool:
    """Whether the holder verifying in a tick with `num_rows` other rows yields more
    tokens per second than the holder decoding as one more row.
    >>> costs = TickCosts({1: 5.0, 2: 5.5, 4: 6.0}, {0: 6.0, 1: 8.0, 3: 11.0}, 0.0)
    >>> speculation_pays(0, 2.0, costs), speculation_pays(3, 2.0, costs)
    (True, False)
    """
    return _faster_with_slot(
        num_rows, accepted_per_round, costs.fused_s(num_rows) + costs.draft, costs.decode_s(num_rows + 1)
    )


def _faster_with_slot(
    num_rows: int, accepted: float, fused_tick_s: float, decode_tick_s: float, margin: float = 1.0
) -> bool:
    """(rows + holder's tokens) per second of a fused tick beat `margin` times those of
    a decode step in which the holder is one more row."""
    return (num_rows + 1 + accepted) / fused_tick_s > margin * (num_rows + 1) / decode_tick_s


@dataclass
class AcceptanceTracker:
    """Accepted drafts per round, an EMA per request. A request with no rounds yet is
    taken at the replica's EMA over every round of its kind (`replica`: greedy or
    sampled, whose acceptance differs by nature: a verify at T > 0 accepts a draft with
    the probability the target gives it; `optimistic`, all K drafts, before the kind's
    first round); its own rounds then decide, so a stream is judged by what it accepts.
    Each newcomer the gate turns away moves its kind's EMA a little back toward
    `optimistic`, so a replica never stops trying speculation for good."""

    optimistic: float
    weight: float = EMA_WEIGHT  # of a request's newest round in its own estimate
    replica: dict[bool, float] = field(default_factory=dict)  # by kind (greedy: True)
    _per_request: dict[str, float] = field(default_factory=dict)
    _holds: dict[str, int] = field(default_factory=dict)  # turn-aways left before relaxing
    _cost_parks: dict[str, int] = field(default_factory=dict)
    _measured: set[str] = field(default_factory=set)  # estimates kept current by shadow rounds

    def estimate(self, request_id: str, greedy: bool = True) -> float:
        """The request's own EMA, else its kind's (`greedy`) on this replica."""
        return self._per_request.get(request_id, self.replica.get(greedy, self.optimistic))

    def record(self, request_id: str, num_accepted: int, greedy: bool = True) -> None:
        own = self.estimate(request_id, greedy)
        self._per_request[request_id] = (1 - self.weight) * own + self.weight * num_accepted
        old = self.replica.get(greedy, num_accepted)
        self.replica[greedy] = (1 - EMA_WEIGHT / 4) * old + (EMA_WEIGHT / 4) * num_accepted

    def record_shadow(self, request_id: str, num_matched: int, greedy: bool = True) -> None:
        """A shadow round of a classic row (`scheduler.shadow`): counted as a round, and
        from now on the stream's estimate is measured, not relaxed. The first one
        replaces the prior (rounds come every token or few, not once a grant)."""
        self._measured.add(request_id)
        self._per_request.setdefault(request_id, float(num_matched))
        self.record(request_id, num_matched, greedy)

    def relax(self, request_id: str | None = None, greedy: bool = True) -> None:
        """A stream was turned away on its estimate (None: a newcomer of kind `greedy`,
        judged by its kind's EMA): forget a little of it, so that it is tried again
        before long (a stream parked for its acceptance, once its hold is over:
        `parked_for_cost`). A stream whose shadow rounds keep its estimate current is
        left as measured (its hold still counts down: `held`)."""

        def relaxed(value: float) -> float:
            return value + RELAX_WEIGHT * (self.optimistic - value)

        if request_id is None:
            if greedy in self.replica:
                self.replica[greedy] = relaxed(self.replica[greedy])
        elif self._holds.get(request_id, 0) > 0:
            self._holds[request_id] -= 1
        elif request_id in self._per_request and request_id not in self._measured:
            self._per_request[request_id] = relaxed(self._per_request[request_id])

    def held(self, request_id: str) -> bool:
        """A shadow-measured stream waits out its hold after a cost park whatever its
        estimate says: its estimate moves every few tokens, and a lucky run of matches
        right after the park (the rounds that follow a good run match less often) would
        grant it again at once. An unmeasured stream's estimate does not move while it
        is held, so `pays` keeps it out by itself (and admits it where the batch shrank)."""
        return request_id in self._measured and self._holds.get(request_id, 0) > 0

    def parked_for_cost(self, request_id: str) -> None:
        """The gate parked this stream where speculating cost more than it returned:
        its estimate relaxes only after `HOLD_TURNS` turn-aways, doubled per such park."""
        parks = self._cost_parks[request_id] = self._cost_parks.get(request_id, 0) + 1
        self._holds[request_id] = HOLD_TURNS * min(1 << (parks - 1), HOLD_MAX)

    def forget(self, request_id: str) -> None:
        self._per_request.pop(request_id, None)
        self._holds.pop(request_id, None)
        self._cost_parks.pop(request_id, None)
        self._measured.discard(request_id)


class LiveCosts:
    """`TickCosts` plus what a tick adds to its bare forward (sampling, the drafter's
    host work, the scheduler's own bookkeeping): per kind of tick ("decode", "fused"),
    an EMA of observed minus predicted time. Each residual is clipped to [0, the
    predicted time], so one slow tick (a first use, a row moving in) cannot swing
    the verdict for long."""

    def __init__(self, costs: TickCosts, weight: float = 0.1, num_draft_tokens: int = 0) -> None:
        self.costs = costs
        self.weight = weight
        self.extra: dict[str, float] = {"decode": 0.0, "fused": 0.0}
        self.num_observed: dict[str, int] = {"decode": 0, "fused": 0}
        # K the tables were measured with, and an EMA of the drafts slot rounds verify,
        # where a drafter's rounds stop early (`observe_width`); None: every round K.
        self.num_draft_tokens = num_draft_tokens
        self.width: float | None = None

    def observe_width(self, num_drafted: int) -> None:
        """A slot round verified `num_drafted` drafts (of a drafter that may stop early)."""
        if self.width is None:
            self.width = float(num_drafted)
        else:
            self.width = (1 - self.weight) * self.width + self.weight * num_drafted

    def _predicted(self, kind: str, num_rows: int) -> float:
        if kind == "decode":
            return self.costs.decode_s(num_rows)
        fused = self.costs.fused_s(num_rows)
        k = self.num_draft_tokens
        if self.width is None or k <= 0 or self.width >= k:
            return fused + self.costs.draft
        # Rounds verify `width` drafts on average, not K: the verify positions past a
        # decode step of one more row, and the draft steps (one past the last kept draft
        # where a round stops), cost in proportion.
        decode = self.costs.decode_s(num_rows + 1)
        per_position = max(fused - decode, 0.0) / k
        return decode + per_position * self.width + self.costs.draft * min(self.width + 1, k) / k

    def observe(self, kind: str, num_rows: int, seconds: float) -> None:
        """A tick of `kind` ("decode": `num_rows` rows; "fused": a round beside
        `num_rows` rows, 0 = alone) took `seconds`."""
        if seconds <= 0.0 or (kind == "decode" and num_rows == 0):  # a clock that does not move (tests)
            return
        predicted = self._predicted(kind, num_rows)
        residual = min(max(seconds - predicted, 0.0), predicted)
        self.extra[kind] = (1 - self.weight) * self.extra[kind] + self.weight * residual
        self.num_observed[kind] += 1

    def tick_s(self, kind: str, num_rows: int) -> float:
        return self._predicted(kind, num_rows) + self.extra[kind]

    def pays(self, num_rows: int, accepted_per_round: float) -> bool:
        """Rows + holder tokens per second with the holder verifying, against the same
        rows and the holder decoding as one more row (by `BATCH_MARGIN` beside rows)."""
        return _faster_with_slot(
            num_rows,
            accepted_per_round,
            self.tick_s("fused", num_rows),
            self.tick_s("decode", num_rows + 1),
            BATCH_MARGIN if num_rows > 0 else 1.0,
        )

    def snapshot(self) -> dict:
        return {
            **self.costs.to_dict(),
            "tick_extra_ms": {kind: round(s * 1e3, 3) for kind, s in self.extra.items()},
            "ticks_observed": dict(self.num_observed),
            **({"drafts_per_round": round(self.width, 3)} if self.width is not None else {}),
        }


# Row drafts (`models.batch.slab_batch`): every classic row may verify its own n-gram drafts
# in the batch's forward. A draft token is worth its verify position when the chance
# it is accepted beats what that position costs at the tick's current yield.
ROW_PRIOR_ALPHA = 0.8  # a row's per-draft acceptance before its first verify
ROW_RELAX = 0.02  # each step a row drafts nothing, its estimate moves this far back to the prior


@dataclass
class RowAcceptance:
    """A row's per-draft acceptance probability `alpha`, from an EMA of accepted drafts
    (successes) and first rejections (failures): verifying d drafts and accepting a
    counts a successes and, when a < d, one failure (the geometric model's estimate)."""

    successes: float = ROW_PRIOR_ALPHA
    failures: float = 1.0 - ROW_PRIOR_ALPHA

    @property
    def alpha(self) -> float:
        return self.successes / max(self.successes + self.failures, 1e-9)

    def record(self, num_drafted: int, num_accepted: int, weight: float = EMA_WEIGHT) -> None:
        """One verify of `num_drafted` drafts, `num_accepted` kept, at EMA `weight`."""
        if num_drafted == 0:
            return
        w = weight
        self.successes = (1 - w) * self.successes + w * num_accepted
        self.failures = (1 - w) * self.failures + w * float(num_accepted < num_drafted)

    def relax(self, prior: float = ROW_PRIOR_ALPHA, rate: float = ROW_RELAX) -> None:
        """One step without drafts: the estimate moves `rate` of the way back to `prior`,
        so a row that stopped drafting is tried again."""
        shift = rate * (prior - self.alpha)
        self.successes += shift
        self.failures = max(self.failures - shift, 1e-3)


REPLICA_EMA_WEIGHT = 0.05  # weight of one verify in the replica's acceptance of a kind of row


@dataclass
class ReplicaAcceptance:
    """The per-draft acceptance of one kind of row (greedy, or sampled) over the
    replica's recent verifies: where a new row of that kind starts, and where a row
    that stopped drafting drifts back to. Rows of a workload whose drafts rarely land
    (sampled text that does not repeat) then start pessimistic instead of paying a
    few failed verifies each; the estimate itself drifts back toward
    `ROW_PRIOR_ALPHA` in steps where no row of the kind drafts, so a workload that
    changes is noticed.
    >>> replica = ReplicaAcceptance()
    >>> for _ in range(40):
    ...     replica.record(2, 0)
    >>> round(replica.alpha, 2), round(replica.start().alpha, 2)
    (0.1, 0.1)
    >>> for _ in range(200):
    ...     replica.relax()
    >>> round(replica.alpha, 2)
    0.79
    """

    estimate: RowAcceptance = field(default_factory=RowAcceptance)

    @property
    def alpha(self) -> float:
        return self.estimate.alpha

    def start(self) -> RowAcceptance:
        """A new row's estimate: the replica's, at a row's weight."""
        return RowAcceptance(self.alpha, 1.0 - self.alpha)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.estimate.record(num_drafted, num_accepted, REPLICA_EMA_WEIGHT)

    def relax(self) -> None:
        self.estimate.relax()


MATCH_WEIGHT = 0.1  # weight of one verify in the acceptance of drafts from one kind of match
MATCH_MIN_VERIFIES = 8  # verifies of a kind of match before its estimate replaces a row's own
MATCH_RELAX = 0.001  # each step its record keeps rows from a kind's drafts, it moves this far back to the prior


# A kind of match's acceptance before its record has MATCH_MIN_VERIFIES verifies, at most:
# on SmolLM2 a row's own one-token matches landed 0.27 (chat) to 0.40 (code) of their
# drafts and three-token ones 0.61 to 0.74, so a fresh replica need not learn it verify by verify.
OWN_MATCH_PRIORS = (0.0, 0.35, 0.5, 0.7)  # by suffix length 0..3; longer: ROW_PRIOR_ALPHA


def match_prior(key) -> float:
    """The highest acceptance a row's drafts from a kind of match (`MatchAcceptance`'s key)
    are priced at until the kind has its own record: by how long a suffix of the row's
    own tokens matched; a match in the replica's outputs (four or more tokens) is not capped.

    >>> [match_prior(("own", n)) for n in (1, 3, 5)], match_prior(("replica", 4))
    ([0.35, 0.7, 0.8], 0.8)
    """
    source, length = key
    if source == "own" and length < len(OWN_MATCH_PRIORS):
        return OWN_MATCH_PRIORS[length]
    return ROW_PRIOR_ALPHA


@dataclass
class MatchAcceptance:
    """Per-draft acceptance of drafts by what their lookup matched (`key`: where the drafts
    came from and how many tokens of the row's suffix matched there), over the replica's
    recent verifies. A long match says a row is copying; a one-token match in prose says
    little. A row's drafts are then judged by the record of their kind of match once it
    has `MATCH_MIN_VERIFIES` verifies (`alpha`), not by the row's own recent rounds, so a
    stream whose first drafts missed still drafts once it starts copying, and rows of
    prose stop paying for the short matches every stream of prose keeps finding. A kind
    whose record keeps rows from drafting drifts back toward the prior (`relax`), so a
    replica whose traffic changes tries it again.
    >>> match = MatchAcceptance()
    >>> for _ in range(20):
    ...     match.record(("own", 1), 3, 0)
    ...     match.record(("own", 3), 3, 3)
    >>> round(match.alpha(("own", 1)), 2), round(match.alpha(("own", 3)), 2), match.alpha(("own", 2))
    (0.1, 0.99, None)
    >>> for _ in range(500):
    ...     match.relax(("own", 1))
    >>> round(match.alpha(("own", 1)), 2)
    0.37
    """

    estimates: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)

    def alpha(self, key) -> float | None:
        """The estimate for drafts of `key`'s kind (None: too few verifies yet)."""
        if self.counts.get(key, 0) < MATCH_MIN_VERIFIES:
            return None
        return self.estimates[key].alpha

    def record(self, key, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.estimates.setdefault(key, RowAcceptance()).record(num_drafted, num_accepted, MATCH_WEIGHT)
        self.counts[key] = self.counts.get(key, 0) + 1

    def relax(self, key) -> None:
        """A step in which rows were kept from drafts of `key`'s kind: its estimate moves
        `MATCH_RELAX` of the way back to `ROW_PRIOR_ALPHA`."""
        if key in self.estimates:
            self.estimates[key].relax(rate=MATCH_RELAX)


class DraftFit(NamedTuple):
    """What a step's drafts cost, in seconds (`verify_costs`): a step of b rows costs
    `per_forward + per_token * b`; each drafting row adds `per_row` and each draft
    position `per_draft`, and a step with any draft also pays `first_draft` once (on a
    CPU the packed forward runs one attention call per multi-token row, and the first
    one costs the most; on a GPU grid all of it is small)."""

    per_forward: float
    per_token: float
    per_draft: float
    first_draft: float = 0.0
    per_row: float = 0.0
    # A lone row's plain step and first draft as measured, where they are off the line
    # (0: on it). On a CPU a one-row step's products run as matrix-vector products and any
    # draft turns them into matrix ones (models/platform/sgemm_rows.c): SmolLM2's one-row
    # step took 55 ms, with one draft 76, where the fit over 1-16 rows put them at 57 and 71.
    lone_step: float = 0.0
    lone_first: float = 0.0

    def step_s(self, num_rows: int) -> float:
        """Seconds of a plain step of `num_rows` rows."""
        if num_rows == 1 and self.lone_step > 0:
            return self.lone_step
        return self.per_forward + self.per_token * num_rows

    def rate(self, num_rows: int) -> float:
        """Tokens per second of a plain step of `num_rows` rows."""
        return num_rows / max(self.step_s(num_rows), 1e-9)

    def first_s(self, num_rows: int) -> float:
        """What a step of `num_rows` rows pays once when any of them drafts."""
        return self.lone_first if num_rows == 1 and self.lone_step > 0 else self.first_draft


def verify_costs(costs: TickCosts, num_draft_tokens: int) -> DraftFit:
    """The `DraftFit` of the measured tables, by medians over batch sizes (one noisy
    measurement does not swing them): a decode step of b rows carries b tokens.
    - With `one_draft` and `half_one`: one row bringing one draft adds `first`; each
      further row bringing one draft adds `per_row + per_draft` (`half_one`); b rows each verifying
      K drafts (`all_verify`) add `first` plus the other b - 1 rows and b * K - 1
      drafts, which separates the two; `first_draft` is what `first` exceeds a
      further row's cost by.
    - With `one_draft` only: the same without rows (`per_row` 0).
    - Without either: a draft costs what b rows each verifying K drafts add over their
      decode step, per draft (`all_verify`), or without that table what one verify row
      adds beside b rows (`fused`), attention call included.
    >>> costs = TickCosts({1: 4.0, 2: 4.5, 4: 5.5}, {0: 6.5, 1: 7.0, 4: 8.5}, 0.0)
    >>> tuple(verify_costs(costs, 4))
    (3.5, 0.5, 0.625, 0.0, 0.0, 0.0, 0.0)
    >>> [round(x, 3) for x in verify_costs(TickCosts(costs.decode, costs.fused, 0.0, {2: 6.1, 4: 8.7}), 4)]
    [3.5, 0.5, 0.2, 0.0, 0.0, 0.0, 0.0]
    >>> [round(x, 3) for x in verify_costs(TickCosts(costs.decode, costs.fused, 0.0, {2: 7.2, 4: 9.0},
    ...                                              {1: 6.0, 2: 6.5, 4: 7.5}), 4)]
    [3.5, 0.5, 0.1, 1.9, 0.0, 4.0, 1.9]
    >>> # first draft 2.0, a further row 0.3 + a further draft 0.2
    >>> all_verify = {2: 4.5 + 2.0 + 0.3 + 7 * 0.2, 4: 5.5 + 2.0 + 3 * 0.3 + 15 * 0.2}
    >>> half_one = {4: 5.5 + 2.0 + 0.5, 8: 7.5 + 2.0 + 3 * 0.5}
    >>> [round(x, 3) for x in verify_costs(TickCosts(costs.decode, costs.fused, 0.0, all_verify,
    ...                                              {1: 6.0, 4: 7.5}, half_one), 4)]
    [3.5, 0.5, 0.2, 1.5, 0.3, 4.0, 1.5]
    """
    sizes = sorted(costs.decode)
    slopes = [(costs.decode[b] - costs.decode[a]) / (b - a) for i, a in enumerate(sizes) for b in sizes[i + 1 :]]
    per_token = max(statistics.median(slopes), 0.0) if slopes else 0.0
    per_forward = statistics.median(costs.decode[b] - per_token * b for b in sizes)
    k = num_draft_tokens
    if not costs.one_draft:
        if costs.all_verify:
            per_draft = statistics.median((costs.all_verify[b] - costs.decode_s(b)) / (b * k) for b in costs.all_verify)
        else:
            per_draft = statistics.median((costs.fused[b] - costs.decode_s(b + 1)) / k for b in costs.fused)
        return DraftFit(per_forward, per_token, max(per_draft, 0.0))

    def first(b: int) -> float:
        return max(_interpolate(costs.one_draft, b) - costs.decode_s(b), 0.0)

    if costs.half_one and costs.all_verify and k > 1:
        further = max(
            statistics.median(
                (costs.half_one[b] - costs.decode_s(b) - first(b)) / (b // 2 - 1) for b in costs.half_one if b >= 4
            ),
            0.0,
        )
        per_draft = statistics.median(
            (costs.all_verify[b] - costs.decode_s(b) - first(b) - (b - 1) * further) / (b * k - b)
            for b in costs.all_verify
        )
        per_draft = min(max(per_draft, 0.0), further)
        per_row = further - per_draft
    else:
        per_row = 0.0
        if costs.all_verify:
            per_draft = statistics.median(
                (costs.all_verify[b] - costs.decode_s(b) - first(b)) / (b * k - 1) for b in costs.all_verify
            )
        else:
            per_draft = statistics.median(
                (costs.fused[b] - costs.decode_s(b + 1) - first(b + 1)) / (k - 1 or 1) for b in costs.fused
            )
        per_draft = max(per_draft, 0.0)
    first_draft = max(statistics.median(first(b) for b in costs.one_draft) - per_row - per_draft, 0.0)
    lone_step = lone_first = 0.0
    if 1 in costs.decode and 1 in costs.one_draft:
        lone_step = costs.decode[1]
        lone_first = max(first(1) - per_row - per_draft, 0.0)
    return DraftFit(per_forward, per_token, per_draft, first_draft, per_row, lone_step, lone_first)


# `LiveDraftFit`: how fast its record follows the steps, how far a step's time may be off
# the prediction before it is clipped, the drafting steps it waits for before it reprices,
# and how far each plain step moves the drafts' price back toward the measured one.
LIVE_WEIGHT = 0.1
LIVE_CLIP = 3.0
LIVE_MIN_DRAFTING = 8
LIVE_RELAX = 0.001


@dataclass
class LiveDraftFit:
    """A `DraftFit` kept true to the steps the batch runs. The fit comes from forwards
    timed at load over a short synthetic context; a served step also samples and moves
    tokens, and attends over longer rows, where a drafting row's own attention call
    costs more (SmolLM2 on 2 cores, four chat rows: steps with drafts took 35 % more
    than the fit said). Plain steps correct the fixed cost (`per_forward`: what an
    accepted draft saves), drafting steps scale the drafts' costs (`first_draft`,
    `per_row`, `per_draft`) by what they took beyond a plain step over what the fit
    said they would. Each plain step moves that scale a little back toward 1, so a
    verdict from one stretch of traffic fades once rows stop drafting (slowly: most steps
    of prose draft nothing, and a fast fade would undo the scale between drafting steps).
    >>> live = LiveDraftFit(DraftFit(0.070, 0.005, 0.001, 0.009, 0.004))
    >>> for _ in range(40):
    ...     live.observe(4, 0, 0, 0.095)          # plain steps 5 ms slower than the fit
    ...     live.observe(4, 1, 1, 0.095 + 0.028)  # drafting ones 2x the fit's 14 ms
    >>> round(live.fit().per_forward, 3), round(live.scale(), 1)
    (0.075, 2.0)
    """

    base: DraftFit
    plain_extra: float = 0.0  # EMA: a plain step's seconds beyond the fit's
    drafts_taken: float = 0.0  # EMA: what drafting steps took beyond a plain step
    drafts_priced: float = 0.0  # EMA: what the fit said they would
    num_plain: int = 0
    num_drafting: int = 0
    _fit: DraftFit | None = None

    def plain_s(self, num_rows: int) -> float:
        return self.base.step_s(num_rows)

    def observe(self, num_rows: int, drafting_rows: int, num_drafts: int, seconds: float) -> None:
        """A step of `num_rows` rows, `drafting_rows` of which verified `num_drafts`
        drafts in all, took `seconds` (forward and sampling)."""
        if num_rows <= 0 or seconds <= 0.0:
            return
        plain = self.plain_s(num_rows)
        if not num_drafts:
            residual = min(max(seconds - plain, -plain / 2), LIVE_CLIP * plain)
            self.plain_extra += LIVE_WEIGHT * (residual - self.plain_extra)
            self.drafts_taken += LIVE_RELAX * (self.drafts_priced - self.drafts_taken)
            self.num_plain += 1
        else:
            base = self.base
            priced = base.first_s(num_rows) + base.per_row * drafting_rows + base.per_draft * num_drafts
            taken = min(max(seconds - plain - self.plain_extra, 0.0), LIVE_CLIP * max(priced, 1e-4))
            self.drafts_taken += LIVE_WEIGHT * (taken - self.drafts_taken)
            self.drafts_priced += LIVE_WEIGHT * (priced - self.drafts_priced)
            self.num_drafting += 1
        self._fit = None

    def scale(self) -> float:
        """What the drafts' measured costs are multiplied by now (1 until the batch has
        run `LIVE_MIN_DRAFTING` drafting steps)."""
        if self.num_drafting < LIVE_MIN_DRAFTING or self.drafts_priced <= 0.0:
            return 1.0
        return min(max(self.drafts_taken / self.drafts_priced, 1 / LIVE_CLIP), LIVE_CLIP)

    def fit(self) -> DraftFit:
        if self._fit is None:
            s, base = self.scale(), self.base
            self._fit = DraftFit(
                max(base.per_forward + self.plain_extra, 0.0),
                base.per_token,
                base.per_draft * s,
                base.first_draft * s,
                base.per_row * s,
                max(base.lone_step + self.plain_extra, 0.0) if base.lone_step > 0 else 0.0,
                base.lone_first * s,
            )
        return self._fit

    def snapshot(self) -> dict:
        return {
            "plain_extra_ms": round(self.plain_extra * 1e3, 3),
            "draft_cost_scale": round(self.scale(), 3),
            "plain_steps": self.num_plain,
            "drafting_steps": self.num_drafting,
        }


def expected_accepted(alpha: float, k: int) -> float:
    """Drafts a row with per-draft acceptance `alpha` expects to keep of k:
    alpha + alpha^2 + ... + alpha^k."""
    total, p = 0.0, 1.0
    for _ in range(k):
        p *= alpha
        total += p
    return total


def draft_net(alpha: float, k: int, num_rows: int, fit: DraftFit) -> float:
    """Tokens a row's k drafts gain a step of `num_rows` rows beyond what they cost
    (the row's `per_row` and k draft positions, at the step's plain rate), the step's
    first-draft cost aside."""
    if k <= 0:
        return 0.0
    return expected_accepted(alpha, k) - fit.rate(num_rows) * (fit.per_row + fit.per_draft * k)


def row_draft_budget(alpha: float, num_rows: int, costs: TickCosts | DraftFit, num_draft_tokens: int) -> int:
    """Drafts (0..K) a row with per-draft acceptance `alpha` should verify this step:
    the one whose expected accepted drafts (alpha + ... + alpha^k) most exceed what
    its verify positions cost, at the tokens per second a step of `num_rows` rows
    yields (the step's first-draft cost is the step's to weigh: `drafts_pay`).
    `costs`: the measured tables, or their `verify_costs` fit (what a caller asking
    every step passes, fitted once).
    >>> costs = TickCosts({1: 4.0, 2: 4.5, 4: 5.5}, {0: 6.5, 1: 7.0, 4: 8.5}, 0.0)
    >>> [row_draft_budget(a, 4, costs, 4) for a in (0.4, 0.75, 0.9)]
    [0, 2, 4]
    """
    fit = verify_costs(costs, num_draft_tokens) if isinstance(costs, TickCosts) else costs
    best, best_k = 0.0, 0
    for k in range(1, num_draft_tokens + 1):
        net = draft_net(alpha, k, num_rows, fit)
        if net > best:
            best, best_k = net, k
    return best_k


def drafts_pay(nets: list[float], num_rows: int, fit: DraftFit) -> bool:
    """Whether the rows' drafts, gaining `nets` tokens each (`draft_net`), together pay
    for the step's first-draft cost.
    >>> fit = DraftFit(3.0, 0.25, 0.1, 1.0)   # 4 rows: 1 token per second, a 1 s first draft
    >>> drafts_pay([0.4, 0.3], 4, fit), drafts_pay([0.4, 0.3, 0.4], 4, fit)
    (False, True)
    """
    return sum(nets) > fit.rate(num_rows) * fit.first_s(num_rows)


def step_draft_budget(num_rows: int, fit: DraftFit | tuple[float, ...], share: float) -> int | None:
    """Draft tokens a step of `num_rows` rows may verify in all: as many as add at most
    `share` of the step's time without them, by the `verify_costs` fit (None: a draft
    position costs nothing measurable, so there is no limit). The runner's
    `draft_step_share`; the budget lanes compete for (`share_drafts`).
    >>> step_draft_budget(4, (3.5, 0.5, 0.625), 0.5)
    4
    >>> step_draft_budget(16, (20.0, 0.45, 0.35), 0.5), step_draft_budget(8, (10.0, 0.5, 0.0), 0.5)
    (38, None)
    """
    per_forward, per_token, per_draft = fit[:3]
    if per_draft <= 0:
        return None
    return int(share * (per_forward + per_token * num_rows) / per_draft)


def share_drafts(
    wants: list[int], lanes: list[int], skipped: list[int], budget: int | None, skip_cap: int
) -> list[int]:
    """Each row's drafts when a step may verify `budget` in all (None: every row gets
    what it wants). Rows are served in the grants' order: a row denied drafts
    `skip_cap` steps running goes first (the most denied first), then by lane (a lower
    value first), then in row order, which is the order rows joined the batch. A row
    gets what it wants or what is left.
    >>> share_drafts([4, 4, 4], [1, 0, 2], [0, 0, 0], 6, 2)
    [2, 4, 0]
    >>> share_drafts([4, 4, 4], [1, 0, 2], [0, 0, 2], 6, 2)
    [0, 2, 4]
    >>> share_drafts([3, 0, 4], [2, 0, 1], [0, 5, 1], None, 2)
    [3, 0, 4]
    """
    if budget is None:
        return list(wants)

    def rank(i: int) -> tuple:
        overdue = skipped[i] >= skip_cap
        return (not overdue, -skipped[i] if overdue else 0, lanes[i], i)

    order = sorted(range(len(wants)), key=rank)
    out = [0] * len(wants)
    for i in order:
        out[i] = min(wants[i], budget)
        budget -= out[i]
    return out
