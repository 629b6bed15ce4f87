"""The adaptive B=1 policy: should a request take the speculative slot at all?

In `auto` mode the first speculative requests per (target, drafter, hardware, K)
profile the slot: a few *probe rounds* (a short burst of classic decode, pipelined like
a lone classic row) give the classic time per token; real rounds give the round time
and the acceptance. Then

    speedup = (accepted per round + 1) * classic step time / round time

and the verdict is: decline at <= 1.0, enable at >= 1.5, the configured default in
between. The measurement persists under `cache_dir` (versioned JSON, atomic replace)
so a restart reuses it. `on` / `off` skip profiling.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable

from scheduler.json_store import KeyedStore
from scheduler.model_api import RoundOutcome

if TYPE_CHECKING:
    from scheduler.config import SchedulerConfig

log = logging.getLogger(__name__)

DECLINE_AT = 1.0
ENABLE_AT = 1.5
CACHE_VERSION = 1
CACHE_FILE = "b1_policy.json"


def estimate_speedup(accepted_per_round: float, classic_step_s: float, round_s: float) -> float:
    """Tokens per second of the slot relative to classic B=1 decode."""
    if round_s <= 0.0:
        return float("inf")
    return (accepted_per_round + 1.0) * classic_step_s / round_s


def verdict_enabled(speedup: float, default_enabled: bool) -> bool:
    """<= 1.0 declines, >= 1.5 enables, anything in between is the configured default."""
    if speedup <= DECLINE_AT:
        return False
    if speedup >= ENABLE_AT:
        return True
    return default_enabled


@dataclass
class Measurement:
    classic_step_s: float
    round_s: float
    accepted_per_round: float
    num_requests: int
    speedup: float
    measured_at: float


class PolicyStore(KeyedStore):
    """Verdicts on disk: `{"version": 1, "verdicts": {key: Measurement}}`; an unreadable,
    corrupt or other-version file reads as empty (re-profile), never as an error."""

    def __init__(self, cache_dir: str) -> None:
        super().__init__(os.path.join(cache_dir, CACHE_FILE), CACHE_VERSION, "verdicts")

    def load(self, key: str) -> Measurement | None:
        raw = super().load(key)
        try:
            return Measurement(**raw) if raw is not None else None
        except TypeError:
            return None

    def save(self, key: str, measurement: Measurement) -> None:
        super().save(key, asdict(measurement))


class B1Policy:
    def __init__(
        self,
        mode: str,
        key: str,
        *,
        default_enabled: bool = True,
        profile_requests: int = 3,
        probe_rounds: int = 2,
        cache_dir: str | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.mode = mode
        self.key = key
        self.default_enabled = default_enabled
        self.profile_requests = profile_requests
        self.probe_rounds = probe_rounds
        self._clock = clock or (lambda: 0.0)
        self._store = PolicyStore(cache_dir) if cache_dir else None
        self.measurement = self._store.load(key) if (self._store and mode == "auto") else None
        self.loaded_from_cache = self.measurement is not None
        self._probe_seconds = 0.0
        self._num_probes = 0
        self._round_seconds = 0.0
        self._num_rounds = 0
        self._num_accepted = 0
        self._num_profiled = 0

    @classmethod
    def from_config(cls, config: "SchedulerConfig", key: str, clock: Callable[[], float] | None = None) -> "B1Policy":
        """The policy `config` describes: mode, default verdict, profiling sizes and
        where verdicts persist, for the runner profile `key`."""
        return cls(
            config.b1_policy,
            key,
            default_enabled=config.b1_default_enabled,
            profile_requests=config.b1_profile_requests,
            probe_rounds=config.b1_probe_rounds,
            cache_dir=config.policy_cache_dir,
            clock=clock,
        )

    @property
    def settled(self) -> bool:
        return self.mode != "auto" or self.measurement is not None

    def should_run(self) -> bool:
        """Whether a request may take the slot now (admission, backlog admission and
        waiter promotion all ask). While profiling the answer is yes: the slot has to
        run to be measured."""
        if self.mode == "on":
            return True
        if self.mode == "off":
            return False
        if self.measurement is None:
            return True
        return verdict_enabled(self.measurement.speedup, self.default_enabled)

    def wants_probe(self, probes_done: int) -> bool:
        """Whether a session's next round should be a probe round."""
        return not self.settled and probes_done < self.probe_rounds

    def record_round(self, outcome: RoundOutcome) -> None:
        if self.settled or outcome.fused:  # a fused round's time is the whole batch's
            return
        if outcome.probe:
            self._num_probes += 1
            per_token = outcome.seconds_per_token
            if per_token is None:
                per_token = outcome.seconds / max(len(outcome.token_ids), 1)
            self._probe_seconds += per_token
        else:
            self._num_rounds += 1
            self._round_seconds += outcome.seconds
            self._num_accepted += outcome.num_accepted

    def session_done(self, num_real_rounds: int) -> None:
        """A session ended; it counts as profiled if it ran real rounds. Settles the
        verdict once enough sessions are profiled."""
        if self.settled or num_real_rounds <= 0:
            return
        self._num_profiled += 1
        if self._num_profiled < self.profile_requests or not self._num_probes or not self._num_rounds:
            return
        classic_step_s = self._probe_seconds / self._num_probes
        round_s = self._round_seconds / self._num_rounds
        accepted_per_round = self._num_accepted / self._num_rounds
        self.measurement = Measurement(
            classic_step_s=classic_step_s,
            round_s=round_s,
            accepted_per_round=accepted_per_round,
            num_requests=self._num_profiled,
            speedup=estimate_speedup(accepted_per_round, classic_step_s, round_s),
            measured_at=self._clock(),
        )
        if self._store is not None:
            try:
                self._store.save(self.key, self.measurement)
            except OSError as exc:  # serving goes on with the in-memory verdict
                log.warning("could not persist the B=1 verdict to %s: %s", self._store.path, exc)

    def snapshot(self) -> dict:
        return {
            "mode": self.mode,
            "key": self.key,
            "settled": self.settled,
            "enabled": self.should_run(),
            "loaded_from_cache": self.loaded_from_cache,
            "measurement": asdict(self.measurement) if self.measurement else None,
            "profiling": {
                "sessions_profiled": self._num_profiled,
                "probe_rounds": self._num_probes,
                "real_rounds": self._num_rounds,
            },
        }
