"""The scheduler's typed configuration (frozen, validated on construction).

Env overrides are resolved once, where a config is built (`env_defaults`), never in
decision code. Live changes go through `SchedulerConfig.replace`, restricted to the
`RECONFIGURABLE` fields; the scheduler reads them at the next grant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from scheduler.policy import DEFAULT_GRANT_ROUNDS, parse_grant_budget, parse_tick_slice

ENV_GRANT_ROUNDS = "SPECSLOT_SLICE_GRANT_ROUNDS"
ENV_TICK_SLICE = "SPECSLOT_TICK_SLICE"
B1_POLICY_MODES = ("auto", "on", "off")
TICK_MODES = ("fused", "alternate")
RECONFIGURABLE = frozenset({"grant_rounds", "skip_cap", "tick_slice", "backlog_cap", "tick_mode", "row_drafts"})


@dataclass(frozen=True)
class SchedulerConfig:
    tick_slice: bool = True  # one speculative slice per tick (off = legacy burst)
    # "fused": the slot holder's verify rides in the classic batch's decode forward (one
    # forward per tick); "alternate": the seed's strict alternation of the two.
    tick_mode: str = "fused"
    # Classic rows verify their own n-gram drafts in their decode steps where the runner
    # can (`ModelRunner.classic_decode(drafts=...)`); off with b1_policy "off" too.
    row_drafts: bool = True
    grant_rounds: int = DEFAULT_GRANT_ROUNDS  # slices per grant; 0 = no rotation
    skip_cap: int = 2  # grant decisions an entry may be skipped before it is overdue
    backlog_cap: int = 2  # grant ring entries (parked jobs + waiters)
    # A new request goes classic when this many other requests are live; 0 = never
    # (see policy.batch_allows_speculation).
    speculative_disable_by_batch_size: int = 0
    num_draft_tokens: int = 4
    b1_policy: str = "auto"  # "auto" | "on" | "off"
    b1_default_enabled: bool = True  # verdict when the speedup is between 1.0 and 1.5
    b1_profile_requests: int = 3
    b1_probe_rounds: int = 2
    max_batch_size: int = 16  # classic rows
    prefill_batch_size: int = 8
    max_queue_depth: int = 256  # unfinished requests per engine
    policy_cache_dir: str | None = None  # None = verdicts are not persisted

    @property
    def rows_draft(self) -> bool:
        """Whether classic rows verify their own drafts: `row_drafts`, unless every
        speculation is off (`b1_policy` "off")."""
        return self.row_drafts and self.b1_policy != "off"

    def __post_init__(self) -> None:
        for name in ("tick_slice", "b1_default_enabled", "row_drafts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        minimums = {
            "grant_rounds": 0,
            "skip_cap": 1,
            "backlog_cap": 0,
            "speculative_disable_by_batch_size": 0,
            "num_draft_tokens": 1,
            "b1_profile_requests": 1,
            "b1_probe_rounds": 1,
            "max_batch_size": 1,
            "prefill_batch_size": 1,
            "max_queue_depth": 1,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        if self.tick_mode not in TICK_MODES:
            raise ValueError(f"tick_mode must be one of {TICK_MODES}, got {self.tick_mode!r}")
        if self.b1_policy not in B1_POLICY_MODES:
            raise ValueError(f"b1_policy must be one of {B1_POLICY_MODES}, got {self.b1_policy!r}")
        if self.policy_cache_dir is not None and not isinstance(self.policy_cache_dir, str):
            raise ValueError(f"policy_cache_dir must be a path string or None, got {self.policy_cache_dir!r}")

    def replace(self, **changes: Any) -> "SchedulerConfig":
        """A copy with live-reconfigurable fields changed (validated)."""
        unknown = set(changes) - RECONFIGURABLE
        if unknown:
            raise ValueError(f"not reconfigurable at runtime: {sorted(unknown)}; allowed: {sorted(RECONFIGURABLE)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def env_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """Process-wide defaults from the environment, with the seed's semantics: garbage
    falls back to the built-in default, `0` disables. Use them only for fields the
    deployment config leaves unset."""
    return {
        "grant_rounds": parse_grant_budget(environ.get(ENV_GRANT_ROUNDS)),
        "tick_slice": parse_tick_slice(environ.get(ENV_TICK_SLICE)),
    }
