"""Requests as the scheduler sees them: ids, lanes, status, stop conditions, stats.

Plain data only. The serve layer builds a `Request` from an HTTP body; the scheduler
moves it through its life (`RequestStatus`) and the model runner reads its prompt and
sampling parameters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple


class Lane(enum.IntEnum):
    """Priority lane; a lower value is served first."""

    HIGH = 0
    NORMAL = 1
    LOW = 2


def parse_priority(header_value: str | None) -> Lane:
    """Lane from an `X-Priority` header value.

    Trimmed and case-insensitive; a missing header or anything unknown is `NORMAL`
    (the header is unauthenticated, so it never produces an error).
    >>> parse_priority("  High "), parse_priority("urgent"), parse_priority(None)
    (<Lane.HIGH: 0>, <Lane.NORMAL: 1>, <Lane.NORMAL: 1>)
    """
    if header_value is None:
        return Lane.NORMAL
    try:
        return Lane[header_value.strip().upper()]
    except KeyError:
        return Lane.NORMAL


class RequestStatus(enum.Enum):
    QUEUED = "queued"  # in the classic admission queue
    CLASSIC = "classic"  # a row of the classic batch
    WAITING = "waiting"  # in the grant backlog, not started
    ACTIVE = "active"  # owns the speculative slot
    PARKED = "parked"  # in the grant backlog with a saved session
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)

    @property
    def is_running(self) -> bool:
        """In a model forward each step (a classic row or the slot owner); the other
        unfinished statuses wait (queued, in the backlog, parked)."""
        return self in (RequestStatus.CLASSIC, RequestStatus.ACTIVE)


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability and the `SamplingParams.logprobs` most likely
    tokens at its position, most likely first, as (token id, log-probability) pairs.
    Log-probabilities are of the sampler's processed distribution
    (`models.sampling.samplers.RequestSampler.log_probs`: after logit bias, penalties and the
    grammar mask, before temperature and the top-p / min-p / top-k filters); a token
    the grammar forbids has -inf."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


REPETITION_CONTEXT_SIZE = 20  # mlx-lm's default window for its repetition penalty


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stop conditions, in tokens.

    `stop_token_ids` end the stream and are emitted (like EOS in mlx-lm); text stop
    sequences are the serve layer's job. The logit processors (applied to the raw
    logits, in this order; `models.sampling.samplers.penalized_logits`):
    - `logit_bias`: (token id, bias) pairs added to the logits;
    - `repetition_penalty`: mlx-lm's (and Hugging Face's) sign-aware penalty on every
      token among the last `repetition_context_size` tokens of prompt + output
      (a positive logit is divided by it, a negative one multiplied; 1 = off);
    - `presence_penalty`, `frequency_penalty`: OpenAI's, over the output tokens only:
      logit -= presence * (count > 0) + frequency * count.
    - `grammar`: an llguidance grammar (`models.sampling.grammar`); tokens it forbids after the
      stream so far get -inf, and a draft it forbids ends the draft.
    Then the filters on the log-probabilities (mlx-lm's order: top_p, min_p, top_k;
    0 = off for top_k and min_p) and the draw at `temperature` (0 = argmax).
    `logprobs`: report each emitted token's `TokenLogprob` with this many alternatives
    (None: report nothing, and compute nothing).
    """

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_context_size: int = REPETITION_CONTEXT_SIZE
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        """Whether any logit processor changes the logits (each token then depends on
        the tokens before it, not only on the model)."""
        return (
            bool(self.logit_bias)
            or self.repetition_penalty != 1.0
            or self.has_output_penalties
            or self.grammar is not None
        )

    @property
    def has_output_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class SpecStats:
    """Per-request speculative counters, reported in the response's `usage`.

    `num_rounds` counts every verify: the slot holder's rounds and the classic row's
    own verifies of its n-gram drafts (`num_row_rounds` of them). `drafters` splits
    rounds, drafted and accepted tokens by drafter kind."""

    num_rounds: int = 0
    num_probe_rounds: int = 0
    num_row_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_grants: int = 0
    num_parks: int = 0
    num_drafts: int = 0  # verifies that checked at least one draft (slot rounds and row verifies)
    # accepted_by_position[i]: verifies whose draft at position i (0-based) was accepted
    accepted_by_position: list[int] = field(default_factory=list)
    # drafter kind -> [rounds, drafted, accepted]
    drafters: dict[str, list[int]] = field(default_factory=dict)

    def as_usage(self) -> dict:
        """The `usage.speculative` object of a response (docs/configuration.md)."""
        return {
            "rounds": self.num_rounds,
            "probe_rounds": self.num_probe_rounds,
            "row_rounds": self.num_row_rounds,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "grants": self.num_grants,
            "parks": self.num_parks,
            "acceptance_length": round(self.num_accepted / self.num_rounds + 1, 4) if self.num_rounds else None,
            "drafters": {
                kind: {"rounds": r, "drafted": d, "accepted": a} for kind, (r, d, a) in sorted(self.drafters.items())
            },
        }

    @property
    def num_slot_rounds(self) -> int:
        """Full rounds the slot ran for this request (neither probes nor row verifies)."""
        return self.num_rounds - self.num_probe_rounds - self.num_row_rounds

    def record_round(
        self, num_drafted: int, num_accepted: int, probe: bool = False, *, row: bool = False, drafter: str = ""
    ) -> None:
        """One round that checked `num_drafted` drafts and accepted the first
        `num_accepted`: the slot holder's (a probe drafts nothing), or with `row` a
        classic row's own verify. `drafter` names the drafts' kind."""
        self.num_rounds += 1
        self.num_probe_rounds += int(probe)
        self.num_row_rounds += int(row)
        self.num_drafted += num_drafted
        self.num_accepted += num_accepted
        if num_drafted == 0:
            return
        per = self.drafters.setdefault(drafter or "unknown", [0, 0, 0])
        per[0] += 1
        per[1] += num_drafted
        per[2] += num_accepted
        self.num_drafts += 1
        if len(self.accepted_by_position) < num_accepted:
            self.accepted_by_position += [0] * (num_accepted - len(self.accepted_by_position))
        for i in range(num_accepted):
            self.accepted_by_position[i] += 1


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    lane: Lane = Lane.NORMAL
    arrival_seq: int = 0  # assigned by the scheduler: FIFO order across lanes
    arrival_time: float = 0.0
    status: RequestStatus = RequestStatus.QUEUED
    cancel_requested: bool = False
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    spec: SpecStats = field(default_factory=SpecStats)
    # Leading prompt tokens whose KV came from the prefix cache (set by the runner at admission).
    num_cached_tokens: int = 0
    # Scheduler clock: first scheduled (classic prefill or slot slice 0), first and last token.
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def mark_scheduled(self, now: float) -> None:
        """The first scheduling counts; a request moved between the slot and the
        classic batch later keeps it."""
        if self.scheduled_time is None:
            self.scheduled_time = now
