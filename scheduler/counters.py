"""Scheduler counters for metrics and the internal status endpoint.

Monotonic totals plus gauges with their peaks, and bounded windows of recent latency
samples (queue wait and time to first token, per lane). Owned by one scheduler and
mutated on the engine thread only; `to_dict()` is the JSON-able view.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from scheduler.request import Lane, RequestStatus, SpecStats
from scheduler.rules import Action

SAMPLE_WINDOW = 1024  # recent samples kept per lane and kind

# Why a request the slot could serve went to the classic batch instead:
#   policy_declined          - the B=1 policy (or the fused tick's gate) said no at routing
#   batch_size               - `speculative_disable_by_batch_size`: too many live requests
#   slot_busy                - the slot was taken and there is no backlog (tick slicing off)
#   backlog_full             - the slot was taken and the grant backlog was full
#   declined_at_promotion    - a fused-tick ring entry whose grant the gate declined
#   batch_size_at_promotion  - likewise, stopped by the batch-size rule
FALLBACK_REASONS = (
    "policy_declined",
    "batch_size",
    "slot_busy",
    "backlog_full",
    "declined_at_promotion",
    "batch_size_at_promotion",
)
# Ticks by the action they ran; "fused" counts speculative ticks whose round also
# decoded the classic rows (so it overlaps "speculative").
TICK_ACTIONS = tuple(action.value for action in Action) + ("fused",)

# Where a request was when its cancellation took effect:
#   inbox   - submitted, cancelled before the scheduler routed it
#   queued  - in the classic admission queue
#   prefill - its prefill was running (the cancel arrived during the tick that prefilled
#             it) or it held the slot with slice 0 not yet run
#   classic - a decoding classic row
#   waiting - a not-yet-started backlog entry
#   parked  - a backlog entry with a saved session
#   active  - the started owner of the speculative slot
CANCEL_PHASES = ("inbox", "queued", "prefill", "classic", "waiting", "parked", "active")
_PHASE_OF_STATUS = {
    RequestStatus.QUEUED: "queued",
    RequestStatus.CLASSIC: "classic",
    RequestStatus.WAITING: "waiting",
    RequestStatus.PARKED: "parked",
    RequestStatus.ACTIVE: "active",
}


def cancel_phase(status: RequestStatus, override: str | None = None) -> str:
    """The phase a cancellation is counted under: `override` (a phase the caller knows,
    e.g. "prefill") else the request's status at cancellation.

    >>> cancel_phase(RequestStatus.PARKED), cancel_phase(RequestStatus.CLASSIC, "prefill")
    ('parked', 'prefill')
    """
    if override is not None:
        if override not in CANCEL_PHASES:
            raise ValueError(f"unknown cancel phase {override!r}")
        return override
    return _PHASE_OF_STATUS.get(status, "inbox")


def _lane_windows() -> dict[str, deque]:
    return {lane.name.lower(): deque(maxlen=SAMPLE_WINDOW) for lane in Lane}


@dataclass
class LatencySamples:
    """Count and sum over all time plus a window of recent values, per lane."""

    count: Counter = field(default_factory=Counter)
    total: Counter = field(default_factory=Counter)
    recent: dict[str, deque] = field(default_factory=_lane_windows)

    def record(self, lane: Lane, seconds: float) -> None:
        name = lane.name.lower()
        self.count[name] += 1
        self.total[name] += seconds
        self.recent[name].append(seconds)

    def to_dict(self) -> dict:
        return {
            name: {
                "count": self.count[name],
                "sum_s": self.total[name],
                "recent_s": list(window),
            }
            for name, window in self.recent.items()
        }


@dataclass
class Counters:
    grants: int = 0  # installs + promotions that ran a slice
    parks: int = 0
    promotions: int = 0  # backlog entries granted the slot (parked resumes + waiters)
    skip_escalations: int = 0  # grant decisions the skip cap decided
    backlog_aborts: int = 0  # cancelled entries dropped from the backlog
    demotions: int = 0  # started sessions moved into the classic batch (batch-size rule)
    cost_parks: int = 0  # fused tick: holders parked because speculating no longer paid
    decode_interrupts: int = 0  # decode steps an arrival stopped part-way (`interrupt_decode`)
    prefill_yields: int = 0  # steps (holder's rounds, rows' decode) between two forwards of a prefill
    prefill_overtakes: int = 0  # requests prefilled between two forwards of another prefill
    backlog_depth: int = 0
    backlog_peak: int = 0
    live_sessions: int = 0
    live_sessions_peak: int = 0
    spec_rounds: int = 0  # the slot holder's rounds
    row_rounds: int = 0  # classic rows verifying their own drafts (`models.batch.slab_batch`)
    probe_rounds: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    classic_fallbacks: Counter = field(default_factory=Counter)  # by reason
    cancelled_by_phase: Counter = field(default_factory=Counter)  # CANCEL_PHASES
    actions: Counter = field(default_factory=Counter)  # ticks by action
    tick_seconds: Counter = field(default_factory=Counter)  # their wall time by action, summed
    queue_wait: LatencySamples = field(default_factory=LatencySamples)
    ttft: LatencySamples = field(default_factory=LatencySamples)

    def observe_backlog(self, depth: int) -> None:
        self.backlog_depth = depth
        self.backlog_peak = max(self.backlog_peak, depth)

    def observe_sessions(self, live: int) -> None:
        self.live_sessions = live
        self.live_sessions_peak = max(self.live_sessions_peak, live)

    def record_round(
        self,
        spec: SpecStats,
        num_drafted: int,
        num_accepted: int,
        *,
        probe: bool = False,
        row: bool = False,
        drafter: str = "",
    ) -> None:
        """One verify round, counted once for the request (`spec`) and the replica: the
        slot holder's (`probe`: it measured classic decode) or, with `row`, a classic
        row's check of its own drafts. `drafter` names the drafts' kind."""
        spec.record_round(num_drafted, num_accepted, probe, row=row, drafter=drafter)
        if row:
            self.row_rounds += 1
        else:
            self.spec_rounds += 1
            self.probe_rounds += int(probe)
        self.drafted_tokens += num_drafted
        self.accepted_tokens += num_accepted

    def record_tick(self, action: str, seconds: float, *, fused: bool = False) -> None:
        """One tick that ran `action` (a `TICK_ACTIONS` value) in `seconds` of wall time,
        drain to events; a `fused` speculative tick counts under "fused" as well."""
        self.actions[action] += 1
        self.tick_seconds[action] += seconds
        if fused:
            self.actions["fused"] += 1
            self.tick_seconds["fused"] += seconds

    def record_fallback(self, reason: str) -> None:
        if reason not in FALLBACK_REASONS:
            raise ValueError(f"unknown classic fallback reason {reason!r}")
        self.classic_fallbacks[reason] += 1

    def record_queue_wait(self, lane: Lane, seconds: float) -> None:
        self.queue_wait.record(lane, seconds)

    def record_ttft(self, lane: Lane, seconds: float) -> None:
        self.ttft.record(lane, seconds)

    def to_dict(self) -> dict:
        plain = {
            name: getattr(self, name)
            for name in (
                "grants",
                "parks",
                "promotions",
                "skip_escalations",
                "backlog_aborts",
                "demotions",
                "cost_parks",
                "decode_interrupts",
                "prefill_yields",
                "prefill_overtakes",
                "backlog_depth",
                "backlog_peak",
                "live_sessions",
                "live_sessions_peak",
                "spec_rounds",
                "row_rounds",
                "probe_rounds",
                "drafted_tokens",
                "accepted_tokens",
            )
        }
        # Every declared key, zero or not: readers (the /metrics families) see the same
        # keys from the first snapshot on.
        plain["classic_fallbacks"] = {r: self.classic_fallbacks[r] for r in FALLBACK_REASONS}
        plain["classic_fallbacks_total"] = sum(self.classic_fallbacks.values())
        plain["cancelled_by_phase"] = {p: self.cancelled_by_phase[p] for p in CANCEL_PHASES}
        plain["actions"] = {a: self.actions[a] for a in TICK_ACTIONS}
        plain["tick_seconds"] = {a: self.tick_seconds[a] for a in TICK_ACTIONS}
        plain["queue_wait"] = self.queue_wait.to_dict()
        plain["ttft"] = self.ttft.to_dict()
        return plain
