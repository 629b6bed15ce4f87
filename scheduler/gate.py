"""The fused tick's cost gate as the slot uses it: who may speculate beside the batch.

Holds the runner's measured tick costs (read once, `LiveCosts`) and the acceptance
estimates (`AcceptanceTracker`), and answers `pays(request, num_rows)`. The arithmetic
lives in `scheduler.costs`; this class only keeps the state and knows the policy mode:
`b1_policy: auto` gates, `on` lets every request speculate, `off` none.
"""

from __future__ import annotations

from typing import Callable

from scheduler.config import SchedulerConfig
from scheduler.costs import EMA_WEIGHT, UNSHADOWED_EMA_WEIGHT, AcceptanceTracker, LiveCosts
from scheduler.model_api import ModelRunner, RoundOutcome
from scheduler.request import Request


class CostGate:
    def __init__(self, runner: ModelRunner, config: Callable[[], SchedulerConfig]) -> None:
        self._runner = runner
        self._config = config
        # Without shadow rounds (a draft model) a stream's estimate moves only with its own rounds.
        shadowed = runner.shadow_index(()) is not None
        self.acceptance = AcceptanceTracker(
            optimistic=float(config().num_draft_tokens), weight=EMA_WEIGHT if shadowed else UNSHADOWED_EMA_WEIGHT
        )
        self._costs: LiveCosts | None = None
        self._costs_read = False

    @property
    def costs(self) -> LiveCosts | None:
        """The runner's measured tick costs, read once (None: it cannot fuse)."""
        if not self._costs_read:
            self._costs_read = True
            measured = self._runner.tick_costs()
            if measured is not None:
                # Priced by the drafts rounds verify where the drafter stops rounds early.
                k = self._config().num_draft_tokens if self._runner.slot_drafts_vary() else 0
                self._costs = LiveCosts(measured, num_draft_tokens=k)
        return self._costs

    @property
    def policy_allows(self) -> bool:
        """In the fused tick the B=1 policy's profile is not consulted: `off` keeps every
        request classic, `on` lets every one speculate, `auto` asks `pays` per request
        and tick. True unless the mode is `off`."""
        return self._config().b1_policy != "off"

    def pays(self, request: Request, num_rows: int) -> bool:
        """Whether this request speculating beside `num_rows` classic rows beats it
        decoding as one more row (`scheduler.costs`); always True unless the B=1 policy
        is `auto` and the runner measured its costs. Where classic rows of the request's
        kind verify drafts of the slot's own kind (greedy n-gram rows beside an n-gram
        slot), the slot buys it nothing, alone or beside rows: it speculates as a row,
        whose draft budget follows its own acceptance (docs/CONTINUOUS_BATCHING.md, "The
        fused tick"). A sampled request beside rows that do not draft sampled streams (the
        default) is priced like any other."""
        if self._config().b1_policy != "auto" or self.costs is None:
            return True
        if self._config().rows_draft and self._runner.rows_draft_like_slot(request.sampling.is_greedy):
            return False  # as a row it drafts and verifies the same way, without the slot
        return self.costs.pays(num_rows, self.acceptance.estimate(request.request_id, request.sampling.is_greedy))

    def admits_newcomer(self, request: Request, num_rows: int) -> bool:
        """`pays` for a request that has not speculated yet; a turn-away relaxes the
        replica's estimate a little (so newcomers are tried again before long)."""
        if self.pays(request, num_rows):
            return True
        self.acceptance.relax(greedy=request.sampling.is_greedy)
        return False

    def admits_row(self, request: Request, num_rows: int) -> bool:
        """`pays` for a ring row at a promotion, unless it waits out a hold after a cost
        park (`AcceptanceTracker.held`); a turn-away relaxes its own estimate."""
        if not self.acceptance.held(request.request_id) and self.pays(request, num_rows):
            return True
        self.acceptance.relax(request.request_id)
        return False

    def parked_for_cost(self, request_id: str) -> None:
        """`pays` said no to the holder: hold off relaxing its estimate (`AcceptanceTracker`)."""
        self.acceptance.parked_for_cost(request_id)

    def record(self, request: Request, outcome: RoundOutcome) -> None:
        # A round with nothing to draft gained nothing, and it was not free: where the
        # lookup rarely finds a draft (sampled text that does not repeat) the rounds
        # that find one may accept well, yet the stream holds the slot for little.
        if not outcome.probe:
            self.acceptance.record(outcome.request_id, outcome.num_accepted, request.sampling.is_greedy)
            if self._costs is not None and self._costs.num_draft_tokens:
                self._costs.observe_width(outcome.num_drafted)

    def record_shadow(self, request: Request, num_matched: int) -> None:
        """A classic row's shadow round (`scheduler.shadow`): what it would have accepted."""
        self.acceptance.record_shadow(request.request_id, num_matched, request.sampling.is_greedy)

    def forget(self, request_id: str) -> None:
        self.acceptance.forget(request_id)

    def snapshot(self) -> dict:
        replica = self.acceptance.replica
        return {
            "tick_costs": self._costs.snapshot() if self._costs is not None else None,
            "acceptance_per_round": {
                "greedy" if greedy else "sampled": round(value, 3)
                for greedy, value in sorted(replica.items(), reverse=True)
            }
            or None,
        }
