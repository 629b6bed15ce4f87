"""The scheduler's typed configuration (frozen, validated on construction).

Each field is a `knob` (scheduler.knobs): its default, range and description live here
only; the deployment args, the live `user_config` and docs/configuration.md are derived
from them. Env overrides are resolved once, where a config is built (`env_defaults`),
never in decision code. Live changes go through `SchedulerConfig.replace`, restricted to
the `RECONFIGURABLE` (live) fields; the scheduler reads them at the next grant.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from scheduler import knobs
from scheduler.knobs import knob
from scheduler.rules import DEFAULT_GRANT_ROUNDS, parse_grant_budget, parse_tick_slice

ENV_GRANT_ROUNDS = "SPECSLOT_SLICE_GRANT_ROUNDS"
ENV_TICK_SLICE = "SPECSLOT_TICK_SLICE"
B1_POLICY_MODES = ("auto", "on", "off")
TICK_MODES = ("fused", "alternate")


@dataclass(frozen=True)
class SchedulerConfig:
    tick_slice: bool = knob(
        True,
        "One speculative slice per tick; false = legacy burst (whole generation in one tick).",
        live=True,
        env=ENV_TICK_SLICE,
        parse_env=parse_tick_slice,
    )
    tick_mode: str = knob(
        "fused",
        "`fused`: the slot holder's verify rides in the classic batch's decode forward (one forward "
        "per tick; ring entries decode as classic rows while they wait; with `b1_policy: auto` a "
        "measured-cost gate decides per request and tick whether speculating pays, see "
        'docs/CONTINUOUS_BATCHING.md "The fused tick"); `alternate`: the seed\'s strict alternation '
        "of rounds and decode steps. Models the slab cannot serve, and `fast_verify`, run `alternate` "
        "whatever this says (logged at load).",
        choices=TICK_MODES,
        live=True,
    )
    row_drafts: bool = knob(
        True,
        "Every greedy classic row (sampled ones too with `sampled_row_drafts`) also verifies its own n-gram "
        "(prompt lookup) drafts in its decode "
        "step, as many (0–`num_draft_tokens`) as its running acceptance pays for at the current batch "
        "size, judged against the forward costs measured at load; a request of a kind such rows draft "
        "for (greedy; sampled too with `sampled_row_drafts`) never takes an n-gram slot, alone or beside "
        "rows: it speculates as a row (the slot is then for a draft model, and for sampled streams where "
        "rows do not draft them and the cost gate says speculating pays). "
        "Needs the slab batch (models the packed forward serves, on the plain verify path; "
        "`fuse_blocker` in `/v1/internal/scheduler`), a configured drafter, and `b1_policy` other "
        'than `off`. See docs/CONTINUOUS_BATCHING.md "Rows that draft".',
        live=True,
    )
    shadow_rounds: bool = knob(
        True,
        "With an n-gram drafter and `b1_policy: auto` in the fused tick, the cost gate reads each "
        "classic row's acceptance off the tokens it emits anyway: it opens a round where the slot "
        "would, drafts as the slot's drafter does and counts how many drafts the row's next tokens "
        "match (at T > 0 too: the verify accepts a draft with the probability the row samples it). "
        "A row is then granted the slot when its measured acceptance pays, not again and again to "
        "find out that it accepts nothing; false: an unmeasured row's estimate drifts back toward "
        "all-accepted with every turn-away and it is tried again. See docs/CONTINUOUS_BATCHING.md "
        '"Shadow rounds".',
    )
    grant_rounds: int = knob(
        DEFAULT_GRANT_ROUNDS,
        "Slices per slot grant; **0 disables rotation** (whole-generation hold, concurrent requests "
        "fall back to classic).",
        ge=0,
        le=1_000_000,
        live=True,
        env=ENV_GRANT_ROUNDS,
        parse_env=parse_grant_budget,
    )
    skip_cap: int = knob(2, "Grant decisions an entry may be skipped before it must win.", ge=1, le=1000, live=True)
    backlog_cap: int = knob(
        2, "Grant-backlog entries (parked + waiting); peak live sessions = 1 + cap.", ge=0, le=64, live=True
    )
    speculative_disable_by_batch_size: int = knob(
        0,
        "A new request skips the speculative slot and its ring (classic decode) when this many "
        "*other* requests are live (classic rows, queued, slot holder, ring entries, same-drain "
        "arrivals); also checked when a waiter is promoted, and for the slot holder at each slice "
        "boundary and a parked job at promotion: a live session that fails it is moved into the "
        "classic batch (`demotions` counter; nothing recomputed, see docs/CONTINUOUS_BATCHING.md); "
        "**0 = never** (every concurrent request may rotate through the slot). `configs/local.yaml` "
        "leaves it at 0: the fused tick's cost gate keeps the default at or above plain batching at "
        "every concurrency without it (docs/benchmarks.md, scenario 6).",
        ge=0,
        le=1_000_000,
    )
    num_draft_tokens: int = knob(4, "K, tokens drafted per speculative round.", ge=1, le=16)
    b1_policy: str = knob(
        "auto",
        "In the fused tick, `auto` is the cost gate (measured forward costs, per-request "
        "acceptance) and the B=1 profile below is not used; in the alternating tick, `auto` "
        "profiles the first requests and persists a verdict. `on` always speculates, `off` never.",
        choices=B1_POLICY_MODES,
    )
    b1_default_enabled: bool = knob(True, "Verdict when the measured speedup is between 1.0 and 1.5.")
    b1_profile_requests: int = knob(3, "Speculative requests `auto` profiles before its verdict.", ge=1, le=1000)
    b1_probe_rounds: int = knob(
        2,
        "Probe rounds (bursts of up to 8 pipelined classic steps: the classic time per token) per profiled request.",
        ge=1,
        le=100,
    )
    max_batch_size: int = knob(16, "Classic continuous-batching rows.", ge=1, le=1024)
    interrupt_decode: bool = knob(
        True,
        "A request that arrives while a classic decode step runs, and that the batch has a row "
        "for, stops that step between two of its layers: its prefill runs at once and the step "
        "runs again at the next tick (at most every other decode step is stopped, so the rows "
        "always progress). A CPU's packed forward only (a GPU's grid forward runs whole). See "
        'docs/CONTINUOUS_BATCHING.md "Arrivals stop a decode step".',
        live=True,
    )
    prefill_batch_size: int = knob(8, "Requests prefilled in one classic prefill.", ge=1, le=1024)
    prefill_yield_tokens: int = knob(
        256,
        "While other classic rows decode, a prefill computes at most this many prompt positions "
        "a row per forward (512 while none do), and between two of its forwards the requests "
        "that arrived are admitted if they are of a higher lane than every prompt in flight or "
        "have at most this many positions to compute (a cached prefix aside; on a GPU one chunk, "
        "512), their first tokens "
        "sent at once, and the slot's holder takes a round and the rows a decode step: a long "
        "prompt no longer stops every stream, nor a short or urgent request, until it is in "
        "(each extra forward costs its fixed part). 0: a prefill "
        "runs its forwards back to back (up to 2,048 positions a row each) and arrivals wait "
        "for it. On a GPU the prefill keeps its own chunks (512-2,048 positions a row: shorter "
        "forwards cost there) and the steps and admissions happen between them. See "
        'docs/CONTINUOUS_BATCHING.md "The fused tick" (its prefill).',
        ge=0,
        le=1_000_000,
        live=True,
    )
    max_queue_depth: int = knob(
        256, "Unfinished requests per replica; beyond it 503 + `Retry-After`.", ge=1, le=1_000_000
    )
    policy_cache_dir: str | None = knob(
        None,
        "Directory for adaptive-policy verdicts and the measured tick costs (persisted across "
        "restarts); unset = profile and measure after every start. Both are keyed by model content (a "
        "hash of config.json and the weight index or weight file names and sizes) and the machine, so "
        "a copied or renamed model keeps its verdict and a changed one is profiled again; the tick "
        "costs also by the runner's knobs and MLX's version (`tick_costs.json`: delete it to measure "
        "again). A start that reads tick costs times one one-row step first, and measures them all "
        "again where that step now runs over 15 % faster than the table says (the table was measured "
        "on a busy machine).",
    )

    @property
    def rows_draft(self) -> bool:
        """Whether classic rows verify their own drafts: `row_drafts`, unless every
        speculation is off (`b1_policy` "off")."""
        return self.row_drafts and self.b1_policy != "off"

    def __post_init__(self) -> None:
        knobs.check_knobs(self)

    def replace(self, **changes: Any) -> "SchedulerConfig":
        """A copy with live-reconfigurable fields changed (validated)."""
        unknown = set(changes) - RECONFIGURABLE
        if unknown:
            raise ValueError(f"not reconfigurable at runtime: {sorted(unknown)}; allowed: {sorted(RECONFIGURABLE)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


RECONFIGURABLE = frozenset(f.name for f in knobs.knob_fields(SchedulerConfig).values() if f.knob.live)


def env_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    """Process-wide defaults from the environment, with the seed's semantics: garbage
    falls back to the built-in default, `0` disables. Use them only for fields the
    deployment config leaves unset."""
    return knobs.env_defaults(SchedulerConfig, environ)
