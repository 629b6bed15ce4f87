"""Per-request samplers: the request's logit processors, filters and seeded random stream.

Each request owns its keys (mlx-lm's `make_sampler` draws from MLX's global random state,
which interleaved requests would perturb): output position p (0: the first generated token)
is drawn with the key of p alone (`position_keys`, a hash of the seed and p), however many
positions a call draws, so under the equality rule (`models.speculative.round_math`) a seeded
stream is the same with speculation on or off; an unseeded request gets a random seed once.
Every path turns logits into tokens through `penalized_logits`, then the pick: greedy's
argmax (`greedy`), or `log_probs`, the filters and one seeded draw. The processors (the
grammar last) read the stream's tokens (`accept`) plus, at a verify position, the drafts
before it: what classic decode would read there. Logprobs (`sample_with_logprobs`) are the
log-probabilities of the processed logits the pick reads, before temperature and the
filters, on every path.
See docs/configuration.md, "Sampling".
"""

from __future__ import annotations

import math
import secrets
from typing import Callable, NamedTuple, Sequence, Union

import mlx.core as mx

from models.platform import cpu_math
from models.sampling.grammar import GrammarMatcher, Grammars
from scheduler.request import SamplingParams, TokenLogprob

Sampler = Callable[[mx.array], mx.array]  # logprobs (..., V) -> token ids (...)
Tokens = Union[Sequence[int], mx.array]


def log_probs(logits: mx.array) -> mx.array:
    """Logits normalised to log-probabilities over the last axis: what every sampling
    path of ours draws from and reports (on an x86-64 CPU through `cpu_math`'s `exp`:
    MLX's there costs ~1 ms for one position of a 49k vocabulary)."""
    return logits - cpu_math.row_logsumexp(logits)


def greedy(processed: mx.array) -> mx.array:
    """The greedy token of each position of processed logits (..., V): their argmax,
    which is that of their log-probabilities (a shift per position), without
    normalising. Every greedy pick of ours (the sampler, rows, the compiled heads) is
    this one."""
    return mx.argmax(processed, axis=-1)


class LogprobArrays(NamedTuple):
    """(lazy) what a request reports for n positions: `chosen` (n,) the emitted tokens'
    log-probabilities, `top_ids` / `top_values` (n, k) the k most likely, best first."""

    chosen: mx.array
    top_ids: mx.array
    top_values: mx.array

    def arrays(self) -> list[mx.array]:
        return [self.chosen, self.top_ids, self.top_values]

    def take(self, index) -> "LogprobArrays":
        return LogprobArrays(self.chosen[index], self.top_ids[index], self.top_values[index])

    def tolist(self) -> list[TokenLogprob]:
        """Evaluated, one `TokenLogprob` per position."""
        chosen, ids, values = self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        return [TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen, ids, values)]


def logprob_arrays(logprobs: mx.array, tokens: mx.array, k: int) -> LogprobArrays:
    """(lazy) the log-probabilities (n, V) read at `tokens` (n,), and the k largest.
    Example: log-probs [[-0.1, -2.5, -3.0]], token 1, k 2: chosen [-2.5], top ids
    [[0, 1]], values [[-0.1, -2.5]]."""
    logprobs = logprobs.astype(mx.float32)
    chosen = mx.take_along_axis(logprobs, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
    k = min(k, logprobs.shape[-1])
    if k == 0:
        empty = mx.zeros((logprobs.shape[0], 0), mx.int32)
        return LogprobArrays(chosen, empty, empty.astype(mx.float32))
    ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    return LogprobArrays(
        chosen, mx.take_along_axis(ids, order, axis=-1).astype(mx.int32), mx.take_along_axis(values, order, axis=-1)
    )


def penalized_logits(
    logits: mx.array, params: SamplingParams, recent: mx.array | None, counts: mx.array | None, drafts: Tokens = ()
) -> mx.array:
    """The logits (n, V) of n consecutive positions after the request's processors
    (`SamplingParams`: logit_bias, then the repetition penalty, then presence and
    frequency penalties).

    Position 0 follows the stream so far: `recent` (int32) holds its last
    `repetition_context_size` tokens of prompt + output (None without a repetition
    penalty), `counts` (V,) how often each token occurs in the output (None without
    presence / frequency penalties). Position i > 0 follows `drafts[:i]` as well (a
    verify: the tokens fed at positions 1..i), counted as output tokens.
    Example: stream output [7, 7], drafts [7, 9]: position 0 sees token 7 twice,
    position 1 three times, position 2 three times and token 9 once.
    """
    if not params.has_processors:
        return logits
    n, vocab = logits.shape
    draft_ids = _token_array(drafts)[: n - 1] if n > 1 else None
    if draft_ids is not None and draft_ids.shape[0] != n - 1:
        raise ValueError(f"{n} positions need {n - 1} drafts, got {draft_ids.shape[0]}")
    if params.logit_bias:
        logits = logits + bias_vector(params.logit_bias, vocab)
    if params.repetition_penalty != 1.0:
        logits = _repetition_penalty(
            logits, params.repetition_penalty, params.repetition_context_size, recent, draft_ids
        )
    if params.has_output_penalties:
        seen = counts[None]
        if draft_ids is not None:  # row i adds the drafts before position i
            one_hot = (draft_ids[:, None] == mx.arange(vocab)[None]).astype(counts.dtype)
            seen = seen + mx.concatenate([mx.zeros((1, vocab), counts.dtype), mx.cumsum(one_hot, axis=0)])
        logits = logits - params.frequency_penalty * seen - params.presence_penalty * (seen > 0)
    return logits


def bias_vector(logit_bias: Sequence[tuple[int, float]], vocab: int) -> mx.array:
    """(V,) float32: the bias of each token; ids outside the logits are ignored (the
    serve layer refuses ids outside the tokenizer's vocabulary)."""
    pairs = [(t, b) for t, b in logit_bias if 0 <= t < vocab]
    bias = mx.zeros((vocab,), mx.float32)
    if not pairs:
        return bias
    ids, values = zip(*pairs)
    return bias.at[mx.array(ids, mx.int32)].add(mx.array(values, mx.float32))


def _repetition_penalty(
    logits: mx.array, penalty: float, window: int, recent: mx.array, draft_ids: mx.array | None
) -> mx.array:
    """mlx-lm's `make_repetition_penalty`, per position: each token among the position's
    last `window` tokens has its logit divided by `penalty` (positive) or multiplied."""
    n = logits.shape[0]
    full = recent if draft_ids is None else mx.concatenate([recent, draft_ids.astype(recent.dtype)])
    before = recent.shape[0]  # tokens before position 0
    width = min(window, before + n - 1)
    # Position i's window is full[max(0, before + i - window) : before + i]; an index
    # clipped to 0 repeats full[0], which lies in that window whenever it is clipped.
    idx = before - width + mx.arange(n)[:, None] + mx.arange(width)[None, :]
    tokens = full[mx.maximum(idx, 0)]
    picked = mx.take_along_axis(logits, tokens, axis=-1)
    picked = mx.where(picked < 0, picked * penalty, picked / penalty)
    return mx.put_along_axis(logits, tokens, picked, axis=-1)


def _token_array(tokens: Tokens) -> mx.array:
    if isinstance(tokens, mx.array):
        return tokens.reshape(-1).astype(mx.int32)
    return mx.array(list(tokens), dtype=mx.int32)


# The request's independent key streams (`RequestSampler.keys`): the target's draws,
# a draft model's sampled drafts, and a rejection-sampled round's uniforms and residual.
DRAWS, DRAFTS, ROUNDS = range(3)


def position_keys(key: mx.array, start: int, n: int) -> mx.array:
    """(n, 2) uint32: the keys of output positions start .. start + n - 1 of the stream
    whose key is `key` (2,). Position p's key is a hash (one threefry split) of `key`
    with p folded into its second word, so it depends on (key, p) alone and keys of
    different positions are independent streams.
    Example: position_keys(k, 0, 4)[3] == position_keys(k, 3, 1)[0]."""
    return _fold_positions(key[None], mx.arange(start, start + n, dtype=mx.uint32))


def _fold_positions(keys: mx.array, positions: mx.array) -> mx.array:
    """(n, 2) uint32: row i is the key of position `positions[i]` of the stream whose
    key is `keys[i]` (or `keys[0]` for every row when `keys` is (1, 2))."""
    words = keys ^ mx.stack([mx.zeros_like(positions), positions], axis=1)
    return mx.vmap(lambda k: mx.random.split(k)[0])(words)


def stacked_keys(
    samplers: Sequence["RequestSampler"], counts: Sequence[int], ahead: int = 0, stream: int = DRAWS
) -> mx.array:
    """(sum(counts), 2): `samplers[j].keys(counts[j], ahead, stream)` stacked, made in
    one pass over every row instead of one per sampler (the same keys)."""
    rows, positions = [], []
    for j, (sampler, n) in enumerate(zip(samplers, counts)):
        start = sampler.position + ahead
        rows.extend([j] * n)
        positions.extend(range(start, start + n))
    base = mx.stack([s._stream_keys[stream] for s in samplers])
    return _fold_positions(base[mx.array(rows, dtype=mx.int32)], mx.array(positions, dtype=mx.uint32))


class RequestSampler:
    """A request's sampling state: its seed's key streams and the tokens its
    processors read.

    `sample(logits, drafts)` turns the logits of one position, or of a verify's
    positions, into tokens without changing the state: row i is output position
    `position + i`, drawn with that position's key; `accept(tokens)` adds emitted
    tokens to the stream (and advances `position` past them). Pipelined paths, which
    emit every token they draw, use `next_token` (sample, then accept). Greedy
    (temperature 0) is the argmax of the processed logits (`greedy`) and uses no
    randomness.
    """

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), grammars: Grammars | None = None):
        """`prompt_ids`: the request's prompt (the repetition penalty's window starts in it);
        `grammars`: the model's grammar compiler (needed when `params.grammar` is set)."""
        self.params = params
        self.temperature = params.temperature
        self.top_p = params.top_p
        seed = params.seed if params.seed is not None else secrets.randbits(31)
        self._stream_keys = mx.random.split(mx.random.key(seed), 3)  # DRAWS, DRAFTS, ROUNDS
        self.position = 0  # output tokens accepted: the position the next draw is for
        # The processors' view of the stream; arrays are replaced, never mutated, so a
        # copy of the sampler is an independent stream.
        self._recent: mx.array | None = None
        if params.repetition_penalty != 1.0:
            if not prompt_ids:
                raise ValueError("a repetition penalty needs the prompt")
            self._recent = mx.array(list(prompt_ids[-params.repetition_context_size :]), dtype=mx.int32)
        self._counts: mx.array | None = None  # (V,), made at the first draw
        self._unfolded: tuple[mx.array, ...] = ()  # output accepted before the first draw
        self.grammar: GrammarMatcher | None = None
        if params.grammar is not None:
            if grammars is None:
                raise ValueError("a grammar-constrained request needs the model's Grammars")
            self.grammar = grammars.matcher(params.grammar)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filter_key(self) -> tuple[float, float, float, int]:
        """What `scaled` depends on: samplers with equal keys draw alike."""
        p = self.params
        return (self.temperature, p.top_p, p.min_p, p.top_k)

    @property
    def has_processors(self) -> bool:
        return self.params.has_processors

    @property
    def wants_logprobs(self) -> bool:
        return self.params.logprobs is not None

    def keys(self, n: int, ahead: int = 0, stream: int = DRAWS) -> mx.array:
        """(n, 2): `stream`'s keys of the n output positions from `position + ahead`
        (`ahead`: tokens drawn but not yet accepted, on a pipelined path)."""
        return position_keys(self._stream_keys[stream], self.position + ahead, n)

    # -- the stream ---------------------------------------------------------------------
    def accept(self, tokens: Tokens) -> None:
        """Emitted output tokens (a list, or a lazy array: pipelined paths accept a draw
        before it is evaluated) join what the processors read. The grammar reads them
        at once (a lazy draw is evaluated here: constrained rows are never pipelined)."""
        self.position += tokens.size if isinstance(tokens, mx.array) else len(tokens)
        if self.grammar is not None:
            self.grammar.accept(_token_array(tokens).tolist())
        if self._recent is None and not self.params.has_output_penalties:
            return
        ids = _token_array(tokens)
        if self._recent is not None:
            self._recent = mx.concatenate([self._recent, ids])[-self.params.repetition_context_size :]
        if self.params.has_output_penalties:
            if self._counts is None:
                self._unfolded += (ids,)
            else:
                self._counts = self._counts.at[ids].add(1.0)

    def _output_counts(self, vocab: int) -> mx.array | None:
        if not self.params.has_output_penalties:
            return None
        if self._counts is None:
            self._counts = mx.zeros((vocab,), mx.float32)
            for ids in self._unfolded:
                self._counts = self._counts.at[ids].add(1.0)
            self._unfolded = ()
        return self._counts

    # -- logits to tokens ---------------------------------------------------------------
    def penalized(self, logits: mx.array, drafts: Tokens = ()) -> mx.array:
        """`penalized_logits` with this stream's state: (n, V) logits of n positions,
        `drafts` the n - 1 tokens fed after the first."""
        if not self.params.has_processors:
            return logits
        logits = penalized_logits(logits, self.params, self._recent, self._output_counts(logits.shape[-1]), drafts)
        if self.grammar is not None:
            allowed = self.grammar.masks(logits.shape[0], _token_array(drafts).tolist(), logits.shape[-1])
            logits = mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))
        return logits

    def allowed_drafts(self, drafts: list[int]) -> list[int]:
        """`drafts` cut at the first token the request's grammar forbids (all of them
        without a grammar)."""
        return drafts if self.grammar is None or not drafts else self.grammar.allowed_prefix(drafts)

    def log_probs(self, logits: mx.array, drafts: Tokens = ()) -> mx.array:
        return log_probs(self.penalized(logits, drafts))

    def sample(self, logits: mx.array, drafts: Tokens = ()) -> mx.array:
        """Tokens (n,) for the raw logits (n, V) of n consecutive positions; the stream
        is unchanged (the caller accepts what it emits)."""
        tokens, _ = self._pick(logits, drafts, 0, False)
        return tokens

    def sample_with_logprobs(
        self, logits: mx.array, drafts: Tokens = (), ahead: int = 0
    ) -> tuple[mx.array, LogprobArrays | None]:
        """`sample`, and (lazy) the positions' `LogprobArrays` from the same processed
        log-probabilities where the request asked for them (else None). `ahead`: the
        first position is `ahead` past the next one (`keys`)."""
        tokens, logprobs = self._pick(logits, drafts, ahead, self.wants_logprobs)
        return tokens, None if logprobs is None else self.report(logprobs, tokens)

    def _pick(
        self, logits: mx.array, drafts: Tokens, ahead: int, with_logprobs: bool
    ) -> tuple[mx.array, mx.array | None]:
        """(lazy) the tokens, and the processed log-probabilities: those a draw reads, and
        for greedy (which picks from the processed logits) only `with_logprobs`."""
        processed = self.penalized(logits, drafts)
        if self.is_greedy:
            return greedy(processed), log_probs(processed) if with_logprobs else None
        logprobs = log_probs(processed)
        return self(logprobs, ahead), logprobs

    def report(self, logprobs: mx.array, tokens: mx.array) -> LogprobArrays | None:
        """(lazy) what the request reports for `tokens` drawn from the processed
        `logprobs` (n, V); None when it did not ask."""
        if self.params.logprobs is None:
            return None
        return logprob_arrays(logprobs, tokens, self.params.logprobs)

    def next_token(self, logits: mx.array) -> mx.array:
        """The next token for one position's logits (1, V), accepted at once: for paths
        that emit every token they draw (`models.batch.solo`, `BatchGenerator` rows)."""
        token, _ = self.next_token_with_logprobs(logits)
        return token

    def next_token_with_logprobs(self, logits: mx.array) -> tuple[mx.array, LogprobArrays | None]:
        """`next_token`, and its (lazy) logprobs where the request asked for them."""
        token, logprobs = self.sample_with_logprobs(logits)
        self.accept(token)
        return token, logprobs

    def __call__(self, logprobs: mx.array, ahead: int = 0) -> mx.array:
        """Pick from processed log-probabilities (n, V) of consecutive positions: argmax,
        or top_p, min_p, top_k (mlx-lm's `make_sampler` order) and one draw per row,
        row i with the key of position `position + ahead + i`."""
        if self.is_greedy:
            return greedy(logprobs)
        return draw_rows(self.scaled(logprobs), self.keys(logprobs.shape[0], ahead))

    def scaled(self, logprobs: mx.array) -> mx.array:
        """The unnormalised log-probabilities a draw at temperature > 0 samples from:
        the filters, then 1 / temperature."""
        p = self.params
        if 0.0 < p.top_p < 1.0:
            logprobs = top_p_filter(logprobs, p.top_p)
        if p.min_p > 0.0:
            logprobs = min_p_filter(logprobs, p.min_p)
        if 0 < p.top_k < logprobs.shape[-1]:
            logprobs = top_k_filter(logprobs, p.top_k)
        return logprobs * (1.0 / self.temperature)

    def probs(self, logprobs: mx.array) -> mx.array:
        """(n, V): the distribution a draw at temperature > 0 samples each of n positions
        from, given their processed `logprobs` (`log_probs`), for speculative rejection
        sampling (`models.speculative.rejection`)."""
        return cpu_math.row_softmax(self.scaled(logprobs))

    def draft_logits(self, logits: mx.array, drafts: Tokens = ()) -> mx.array:
        """A draft model's logits (1, V) at the position after the stream plus `drafts`,
        through the request's processors but not its grammar (a draft the grammar
        forbids is cut afterwards, `allowed_drafts`): the draft samples from what the
        target would, had it the draft's logits."""
        if not self.params.has_processors:
            return logits
        recent, counts = self._recent, self._output_counts(logits.shape[-1])
        ids = _token_array(drafts)
        if ids.size:
            if recent is not None:
                recent = mx.concatenate([recent, ids])[-self.params.repetition_context_size :]
            if counts is not None:
                counts = counts.at[ids].add(1.0)
        return penalized_logits(logits, self.params, recent, counts)


def draw_plain(
    samplers: Sequence["RequestSampler"], logits: mx.array, counts: Sequence[int], ahead: int = 0
) -> mx.array:
    """What `samplers[j].sample` (with `ahead`) draws for its `counts[j]` rows of the
    stacked raw `logits` (sum(counts), V), as one draw over every row, for samplers at
    temperature > 0 without processors that share their filters (`filter_key`): a
    row's token depends on its own logits and key only, so the tokens (sum(counts),)
    are those of one draw per sampler."""
    return draw_rows(samplers[0].scaled(log_probs(logits)), stacked_keys(samplers, counts, ahead))


def draw_rows(scaled: mx.array, keys: mx.array) -> mx.array:
    """One categorical draw per row of the unnormalised log-probabilities `scaled`
    (n, V), row i with `keys[i]`: a row's token depends on its own logits and key only."""
    return mx.vmap(lambda row, key: mx.random.categorical(row, key=key))(scaled, keys)


# `top_p_filter` on a CPU: candidates for the nucleus's floor (a top-k is ~10x cheaper than a sort there)
TOP_P_CANDIDATES = 2048


def _neg_inf(dtype: mx.Dtype) -> mx.array:
    return mx.array(-mx.inf, dtype)


# The filters: mlx-lm's `apply_top_p`, `apply_min_p` and `apply_top_k`, token for token,
# with the request's value as data: mlx-lm compiles them per value, so each new top_p or
# min_p value built a kernel inside the engine's tick (up to seconds) while every stream waited.


def top_p_filter(logprobs: mx.array, top_p: float) -> mx.array:
    """(n, V) with every token outside the nucleus at -inf: the most likely tokens
    whose probabilities sum to `top_p` of the row's total (ties at the boundary kept).
    Example: probabilities [0.5, 0.3, 0.2] with top_p 0.8 keep tokens 0 and 1.
    Where sorting a whole row is slow (`cpu_math` installed: an x86-64 CPU, 3 ms a row of
    49k), the floor is found among the `TOP_P_CANDIDATES` most likely tokens, and the
    rows whose candidates do not reach `top_p` are sorted whole (a sync to decide)."""
    threshold = mx.array(top_p, mx.float32)
    if cpu_math.installed() and logprobs.shape[-1] > TOP_P_CANDIDATES:
        candidates = mx.sort(mx.topk(logprobs, TOP_P_CANDIDATES, axis=-1), axis=-1)
        total = mx.exp(cpu_math.row_logsumexp(logprobs.astype(mx.float32)))
        covered, floor = _nucleus_floor(candidates, threshold, total)
        short = [i for i, ok in enumerate(covered.reshape(-1).tolist()) if not ok]
        if short:  # rows whose nucleus is wider than the candidates: sorted whole
            rows = mx.array(short)
            _, wide = _nucleus_floor(mx.sort(logprobs[rows], axis=-1), threshold)
            floor[rows] = wide
    else:
        _, floor = _nucleus_floor(mx.sort(logprobs, axis=-1), threshold)
    return mx.where(logprobs < floor, _neg_inf(logprobs.dtype), logprobs)


def _nucleus_floor(ascending: mx.array, top_p: mx.array, total: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """For the ascending `ascending` (n, k), the most likely k of each row's tokens
    (all of them when `total`, the row's whole mass, is None): whether they reach
    `top_p` of the total (n, 1), and the nucleus's floor, the least likely value kept (n, 1)."""
    probs = mx.exp(ascending.astype(mx.float32))
    # the mass of the tokens more likely than each one
    above = mx.cumsum(probs, axis=-1, reverse=True, inclusive=False)
    mass = above[..., :1] + probs[..., :1]
    target = top_p * (mass if total is None else total)
    num_dropped = (above >= target).sum(axis=-1, keepdims=True)
    return mass >= target, mx.take_along_axis(ascending, num_dropped, axis=-1)


def min_p_filter(logprobs: mx.array, min_p: float) -> mx.array:
    """(n, V) with every token less likely than `min_p` times the row's most likely
    one at -inf (0 < min_p <= 1)."""
    floor = mx.max(logprobs, axis=-1, keepdims=True) + mx.array(math.log(min_p), logprobs.dtype)
    return mx.where(logprobs < floor, _neg_inf(logprobs.dtype), logprobs)


def top_k_filter(logprobs: mx.array, top_k: int) -> mx.array:
    """(n, V) with all but the `top_k` most likely tokens of each row at -inf
    (0 < top_k < V)."""
    dropped = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    return mx.put_along_axis(logprobs, dropped, _neg_inf(logprobs.dtype), axis=-1)


def supports_sampling(params: SamplingParams) -> bool:
    """Options every path implements (temperature >= 0, 0 < top_p <= 1, top_k >= 0,
    0 <= min_p <= 1, repetition_penalty > 0 over a window of at least one token,
    max_tokens > 0)."""
    return (
        params.temperature >= 0.0
        and 0.0 < params.top_p <= 1.0
        and params.top_k >= 0
        and 0.0 <= params.min_p <= 1.0
        and params.repetition_penalty > 0.0
        and params.repetition_context_size >= 1
        and params.max_tokens > 0
    )


def stop_token_ids(eos_token_ids: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
    """Tokens that end a request on either path: the model's EOS ids, then the
    request's own stop ids (emitted, like EOS), without repeats."""
    return tuple(dict.fromkeys((*eos_token_ids, *params.stop_token_ids)))
