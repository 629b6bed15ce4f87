"""Per-request samplers with their own seeded random stream.

mlx-lm's `make_sampler` draws from MLX's global random state, so two requests
interleaved in one process would perturb each other's streams. Here each request owns
a key: a request with a seed is reproducible however it is scheduled (classic or
speculative, alone or batched), and an unseeded request gets a fresh random seed.
"""

from __future__ import annotations

import secrets
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

from scheduler.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]  # logprobs (..., V) -> token ids (...)


class RequestSampler:
    """Samples rows of log-probabilities at the request's temperature / top_p.

    Greedy (temperature 0) is argmax and uses no randomness. Otherwise each call
    splits a fresh subkey from the request's key; rows of one call are independent
    draws (one per verify position).
    """

    def __init__(self, params: SamplingParams):
        self.temperature = params.temperature
        self.top_p = params.top_p
        seed = params.seed if params.seed is not None else secrets.randbits(31)
        self._key = mx.random.key(seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def key(self) -> mx.array:
        """The random state a later draw splits (restore it to undo draws)."""
        return self._key

    @key.setter
    def key(self, key: mx.array) -> None:
        self._key = key

    def from_logits(self, logits: mx.array) -> mx.array:
        """Sample from raw logits: normalised to log-probabilities first, as mlx-lm's
        samplers expect (and as every path of ours samples, so greedy ties break alike)."""
        return self(log_probs(logits))

    def __call__(self, logprobs: mx.array) -> mx.array:
        if self.is_greedy:
            return mx.argmax(logprobs, axis=-1)
        if 0.0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        self._key, subkey = mx.random.split(self._key)
        return mx.random.categorical(logprobs * (1.0 / self.temperature), key=subkey)


def log_probs(logits: mx.array) -> mx.array:
    """Logits normalised to log-probabilities over the last axis: what every sampling
    path of ours (the sampler and the compiled greedy heads) takes its argmax or draw of."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def supports_sampling(params: SamplingParams) -> bool:
    """Options both paths implement (temperature >= 0, 0 < top_p <= 1, max_tokens > 0)."""
    return params.temperature >= 0.0 and 0.0 < params.top_p <= 1.0 and params.max_tokens > 0


def stop_token_ids(eos_token_ids: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
    """Tokens that end a request on either path: the model's EOS ids, then the
    request's own stop ids (emitted, like EOS), without repeats."""
    return tuple(dict.fromkeys((*eos_token_ids, *params.stop_token_ids)))
