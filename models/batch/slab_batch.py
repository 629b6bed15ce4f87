"""Classic continuous batching over a `models.forward.slab.Slab`: the fused tick's batch.

The same contract as `models.batch.generator_batch.GeneratorBatch` (prefill, decode with an
optional rider, extract, adopt, remove), over rows that each keep their own length. A row is
a slab row plus its sampler, stop ids, budget and pending token (emitted, not yet fed).
`decode` feeds every row's pending token, the rider's verify tokens and the rows' own n-gram
drafts (`row_drafts`, budgeted per step by `scheduler.costs`) in one `Slab.forward`. Classic
rows fill the slab's first slots, sessions the slots after them, so `extract` and `adopt`
move no keys: the row changes hands. Output position p is always drawn with p's key, and a
grid slab's queued (pipelined) step is taken back before anything else touches the batch,
so what a seeded stream emits depends neither on drafts nor on the pipeline. Only rows that
asked read logprobs, from the distribution their sampler drew from.
See docs/CONTINUOUS_BATCHING.md, "The fused tick".
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from models.batch.generator_batch import LiveRow, check_admissible, check_adoptable
from models.batch.prefix_cache import PrefixCache
from models.forward.ragged import Rider
from models.forward.slab import Row, RowView, Slab
from models.sampling.grammar import Grammars
from models.sampling.samplers import LogprobArrays, RequestSampler, draw_plain, greedy, stop_token_ids
from models.speculative.drafters import NgramIndex
from models.speculative.replica_index import ReplicaIndex
from models.speculative.round_math import accept_count, clip_tokens, draft_budget
from scheduler.costs import (
    DraftFit,
    LiveDraftFit,
    MatchAcceptance,
    ReplicaAcceptance,
    RowAcceptance,
    TickCosts,
    draft_net,
    drafts_pay,
    match_prior,
    row_draft_budget,
    share_drafts,
    step_draft_budget,
    verify_costs,
)
from scheduler.model_api import Interrupted, TokenBatch
from scheduler.request import Request, TokenLogprob

PREFILL_CHUNK = 512  # prompt positions per row per prefill forward, with every row of a group running
MAX_PREFILL_CHUNK = 2048  # a row's positions in one forward once fewer rows are left
CLEAR_CACHE_EVERY = 256  # decode steps between releases of MLX's buffer cache


@dataclass(eq=False)
class _Stream:
    request_id: str
    row: Row
    sampler: RequestSampler
    stop_ids: frozenset
    max_tokens: int
    num_emitted: int
    pending: int
    index: NgramIndex | None = None  # prompt + emitted tokens (the last is `pending`)
    acceptance: RowAcceptance | None = None
    token_ids: list[int] | None = None  # prompt + emitted (the last is `pending`), for the prefix cache
    lane: int = 1  # the request's lane (`scheduler.request.Lane`): its place in the step's draft budget
    denied: int = 0  # steps running in which this row had drafts and the budget gave it none
    withheld: bool = False  # this step the row's estimate kept it from drafts its index had
    match: tuple = ("own", 0)  # where the row's last proposal came from, and its match's length


@dataclass(eq=False)
class _Ahead:
    """A plain step queued on the device: each stream fed its pending token (its row is
    already one longer), `tokens` the next tokens drawn (lazy; each at the position
    after its sampler's next one, `ahead=1`) and `logprobs` their reports (lazy; None
    for a row that did not ask)."""

    streams: list[_Stream]
    tokens: mx.array
    logprobs: list[LogprobArrays | None]


class SlabBatch:
    """Rows of classic decode, keyed by request id, in one slab with the sessions
    (`models.batch.protocol.ClassicRows`)."""

    shares_slab = True

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_ids: Sequence[int],
        max_batch_size: int = 16,
        prefill_batch_size: int = 8,
        solo_burst_s: float = 0.0,
        row_drafts: bool = False,
        num_draft_tokens: int = 4,
        prefix_cache: PrefixCache | None = None,
        grid: bool | None = None,
        grammars: Grammars | None = None,
    ):
        """`row_drafts`: rows verify their own n-gram drafts, up to `num_draft_tokens`
        each, as `costs` (set by the runner once measured) says they pay; without
        costs a row drafts whatever its estimate allows at zero cost. `prefix_cache`:
        where new rows look up their prompt's prefix and leaving rows store theirs.
        `grid`: the slab's layout (None: on a GPU); plain steps are pipelined on a grid
        slab while `pipeline` is on (the default)."""
        if solo_burst_s < 0:
            raise ValueError("solo_burst_s must be >= 0")
        self.row_drafts = row_drafts
        self.num_draft_tokens = num_draft_tokens
        self._costs: TickCosts | None = None
        self._live: LiveDraftFit | None = None  # the fit of `costs`, corrected by the steps run
        # Whether packed steps correct that fit (the runner turns it on; tests that fix the
        # costs leave it off, so which rows draft does not depend on the machine's load).
        self.price_by_steps = False
        self._model = model
        self._eos_token_ids = tuple(eos_token_ids)
        self._grammars = grammars
        self._prefill_batch_size = max(1, prefill_batch_size)
        self._solo_burst_s = solo_burst_s
        self.slab = Slab(model, rows=max_batch_size + 2, grid=grid)
        self.pipeline = True
        # Steps a row with drafts may be left out of the step's draft budget before it
        # goes first (the scheduler sets its `skip_cap`, as for grants).
        self.skip_cap = 2
        # The share of a plain step's time the rows' drafts may add (0: no limit).
        self.draft_step_share = 0.0
        # Rows at temperature > 0 draft too (their draws are keyed by position); else greedy ones only.
        self.sampled_drafts = False
        # Past outputs of this batch's rows to draft from (`models.speculative.replica_index`; None: off).
        self.replica_index: ReplicaIndex | None = None
        # Where new rows' acceptance estimates start, by kind (greedy: True).
        self.replica_acceptance = {True: ReplicaAcceptance(), False: ReplicaAcceptance()}
        # Acceptance by the kind of lookup match a row's drafts came from, by kind of row.
        self.match_acceptance = {True: MatchAcceptance(), False: MatchAcceptance()}
        self.num_steps = 0  # decode steps (a verify riding included)
        self.num_pipelined = 0  # steps whose tokens a queued step had drawn
        self._streams: dict[str, _Stream] = {}  # classic rows, in slots 0..len-1
        self._sessions: set[int] = set()  # ids of rows handed out as session caches
        self._finished: set[str] = set()  # finished rows not yet removed
        self._steps = 0
        self._ahead: _Ahead | None = None  # the queued plain step (grid slabs)
        self._stores: list[tuple[Row, list[int]]] = []  # prompts prefilled, not yet stored (`_flush_stores`)
        self.prefix_cache = prefix_cache

    @property
    def costs(self) -> TickCosts | None:
        return self._costs

    @costs.setter
    def costs(self, costs: TickCosts | None) -> None:
        """The measured forward costs the rows' draft budgets are judged by (fitted once)."""
        self._costs = costs
        self._live = None if costs is None else LiveDraftFit(verify_costs(costs, self.num_draft_tokens))

    @property
    def _fit(self) -> DraftFit | None:
        """What the rows' drafts are priced by: the measured costs' fit, kept true to the
        packed steps this batch has timed (`scheduler.costs.LiveDraftFit`)."""
        return None if self._live is None else self._live.fit()

    # -- bookkeeping ------------------------------------------------------------------
    def num_rows(self) -> int:
        return len(self.request_ids())

    def request_ids(self) -> list[str]:
        return list(self._streams) + sorted(self._finished)

    def _to_classic_region(self, row: Row) -> None:
        """Move `row` to slot len(streams) (the first slot after the classic rows)."""
        self.slab.swap(row, self.slab.rows[len(self._streams)])

    def _to_session_region(self, row: Row, freeing: bool = False) -> None:
        """Move a classic row to slot len(streams) - 1, which leaves the classic region
        once its stream is deleted (classic rows stay in slots 0..len-1). `freeing`: the
        row is freed next, so only the row that takes its slot is copied."""
        self.slab.swap(row, self.slab.rows[len(self._streams) - 1], discard=row if freeing else None)

    def new_session_cache(self, prompt_ids: Sequence[int] = ()) -> list[RowView]:
        """A row for a speculative session (after the classic rows), holding the longest
        cached prefix of `prompt_ids` (its offsets say how long; 0: empty)."""
        self._take_back()
        row = self.slab.add()
        self._sessions.add(id(row))
        self._reuse_prefix(row, prompt_ids)
        return row.cache

    def release(self, cache: list, token_ids: Sequence[int] | None = None) -> None:
        """Free a session's row (idempotent; a cache that is not a session row is ignored).
        `token_ids`: the stream's tokens, the last one not in the row (prompt + emitted),
        to store the row's KV in the prefix cache first."""
        self._take_back()
        row = _row_of(cache)
        if row is not None and id(row) in self._sessions and not row.freed:
            if token_ids is not None:
                self._store_prefix(row, token_ids)
            self._sessions.discard(id(row))
            self.slab.free(row)
            self.slab.shrink()

    def keep_prompt(self, cache: list, prompt_ids: Sequence[int]) -> None:
        """Store a session's prompt KV once its prefill has run, at the batch's next
        operation as a prefill group's (`_flush_stores`: after the session's first token
        went out; a cache that is not a live session row is ignored)."""
        row = _row_of(cache)
        if row is not None and id(row) in self._sessions and not row.freed and self.prefix_cache is not None:
            self._stores.append((row, list(prompt_ids)))

    # -- the prefix cache ---------------------------------------------------------------
    def _reuse_prefix(self, row: Row, prompt_ids: Sequence[int]) -> int:
        """Copy the longest cached prefix of `prompt_ids` into the empty `row`; returns its length."""
        hit = self.prefix_cache.lookup(prompt_ids) if self.prefix_cache is not None and prompt_ids else None
        if hit is None:
            return 0
        self.slab.write_prefix(row, hit.keys, hit.values, hit.num_tokens)
        return hit.num_tokens

    def prefill_tokens(self, prompt_ids: Sequence[int]) -> int:
        """The positions a prefill of `prompt_ids` would compute now: those past the
        longest cached prefix a new row would start from (nothing counted as a lookup)."""
        cached = self.prefix_cache.cached_length(prompt_ids) if self.prefix_cache is not None and prompt_ids else 0
        return len(prompt_ids) - cached

    def prefill_fits(self, prompt_ids: Sequence[int], piece: int) -> bool:
        """Whether a prefill of `prompt_ids` now runs in one forward of `piece` positions
        (a grid's forwards are never shorter than `PREFILL_CHUNK`: `prefill`)."""
        return self.prefill_tokens(prompt_ids) <= (max(piece, PREFILL_CHUNK) if self.slab.grid else piece)

    def _flush_stores(self) -> None:
        """Store the prompts a prefill group or a session's prefill left (`keep_prompt`):
        a row's prompt positions stay as they are while it lives, and a row that ended
        since stored its whole stream, the prompt included, when it left (`_drop`,
        `release`)."""
        stores, self._stores = self._stores, []
        for row, prompt_ids in stores:
            if not row.freed:
                self._store_prefix(row, prompt_ids)

    def _store_prefix(self, row: Row, token_ids: Sequence[int]) -> None:
        """Store the KV of `token_ids` but the last (the pending token, never fed). A row
        may hold more (accepted drafts cut short by a stop token): those are left out."""
        n = len(token_ids) - 1
        if self.prefix_cache is None or n < 1 or n > row.length:  # n > length: not these tokens' row
            return
        self.prefix_cache.store(token_ids[:n], n * self.slab.bytes_per_position, lambda: self.slab.copy_prefix(row, n))

    # -- admission ----------------------------------------------------------------------
    def step_stats(self) -> dict:
        stats = {"steps": self.num_steps, "pipelined": self.num_pipelined}
        if self._live is not None and self._live.num_plain + self._live.num_drafting:
            stats["draft_costs"] = self._live.snapshot()
        return stats

    def drafts_rows_of(self, greedy: bool) -> bool:
        """Whether rows of this kind (greedy, or sampled) verify their own drafts."""
        return self.row_drafts and (greedy or self.sampled_drafts)

    def _add_stream(
        self,
        request_id: str,
        row: Row,
        sampler: RequestSampler,
        stop_ids,
        max_tokens: int,
        num_emitted: int,
        pending: int,
        history: Sequence[int] | None,
        lane: int,
    ) -> _Stream:
        """`history`: the stream's tokens before `pending` (None: unknown, no drafts)."""
        self._to_classic_region(row)
        stream = _Stream(request_id, row, sampler, frozenset(stop_ids), max_tokens, num_emitted, pending, lane=lane)
        if self.prefix_cache is not None and history is not None:
            stream.token_ids = [*history, pending]
        if history is not None and self.drafts_rows_of(sampler.is_greedy):
            stream.index = NgramIndex([*history, pending])
            stream.acceptance = self.replica_acceptance[sampler.is_greedy].start()
        self._streams[request_id] = stream
        self._finished.discard(request_id)
        return stream

    def prefill(
        self, requests: Sequence[Request], between: Callable[[], None] | None = None, piece: int = 0
    ) -> list[TokenBatch]:
        """Admit `requests` and emit each one's first token. A row starts from its
        prompt's longest cached prefix (setting the request's `num_cached_tokens`); the
        other prompt tokens run in chunked forwards whose logits are computed at each
        row's last prompt token only, and are stored in the prefix cache (all but the
        last token) at the batch's next operation, once the first tokens are out, so
        requests that share the prompt and come while this one runs start from it.

        Existing rows do not advance, unless `between` is given with `piece` > 0: then
        `between()` is called after each forward that leaves prompt tokens to run, and
        on a packed slab (a CPU) the forwards take at most `piece` positions a row while
        existing rows are there (`PREFILL_CHUNK` while none are: as fast as one whole
        forward there); a grid slab (a GPU) keeps its chunks (up to
        `MAX_PREFILL_CHUNK` positions a row), which shorter forwards would slow.
        The caller steps the existing rows
        there (`decode`, a verify riding or not) and may admit other requests
        (`prefill`, whose rows become streams before these: these are not streams
        until their prompts are in)."""
        if not requests:
            return []
        check_admissible(requests, self.request_ids())
        self._take_back()
        if piece < 1:
            between = None
        out: list[TokenBatch] = []
        for start in range(0, len(requests), self._prefill_batch_size):
            out += self._prefill_group(requests[start : start + self._prefill_batch_size], between, piece)
        return out

    def _prefill_group(
        self, requests: Sequence[Request], between: Callable[[], None] | None, piece: int
    ) -> list[TokenBatch]:
        """Requests with the same prompt (the choices of an `n` > 1 request) prefill it
        once: the first one's row runs it, the others copy its keys and values and draw
        their first tokens from its logits. A row's last prompt token joins its last
        chunk (when the chunk has room for it) and the head runs on that position alone
        (`Slab.forward(last_only=True)`), so a prompt costs no forward of its own for
        its first token."""
        rows = [self.slab.add() for _ in requests]
        # the classic rows, then these (each where its stream's `_add_stream` wants it),
        # then the session rows: the session rows move once, not once per new row
        classic, new = self.slab.rows[: len(self._streams)], {id(row) for row in rows}
        self.slab.arrange(classic + rows + [r for r in self.slab.rows[len(classic) :] if id(r) not in new])
        try:
            return self._run_group(requests, rows, between, piece)
        except BaseException:
            self._abandon(requests, rows)
            raise

    def _abandon(self, requests: Sequence[Request], rows: list[Row]) -> None:
        """Undo a prefill group that failed part way (a device error surfaces at the
        next evaluation): its streams go without storing anything in the prefix cache
        (their keys may never have been computed) and its rows are freed."""
        for r in requests:
            self._streams.pop(r.request_id, None)
        for row in sorted(rows, key=lambda row: -row.slot):  # the last first: fewer rows move
            self.slab.free(row)

    def _run_group(
        self, requests: Sequence[Request], rows: list[Row], between: Callable[[], None] | None, piece: int
    ) -> list[TokenBatch]:
        first_of: dict[tuple[int, ...], int] = {}
        leader = [first_of.setdefault(tuple(r.prompt_ids), i) for i, r in enumerate(requests)]
        for i, (r, row) in enumerate(zip(requests, rows)):
            if leader[i] == i:
                r.num_cached_tokens = self._reuse_prefix(row, r.prompt_ids)
        todo = [
            list(r.prompt_ids[row.length :]) if leader[i] == i else [] for i, (r, row) in enumerate(zip(requests, rows))
        ]
        computed = [len(t) > 1 for t in todo]  # more than the last token ran: store the prompt
        logits: list[mx.array | None] = [None] * len(requests)
        budget = PREFILL_CHUNK * self._prefill_batch_size  # positions per forward
        while any(todo):
            # A row's remaining tokens run whole when they fit its chunk, else a chunk of
            # them; rows left alone by shorter prompts take the finished rows' share.
            owners = [i for i, t in enumerate(todo) if t]
            width = prefill_width(budget, len(owners))
            if between is not None and not self.slab.grid:  # shorter forwards while others wait
                width = min(width, piece if self._streams else max(piece, PREFILL_CHUNK))
            chunks = [todo[i][:width] for i in owners]
            out = self.slab.forward(self._model, [(rows[i], c) for i, c in zip(owners, chunks)], last_only=True)
            for i, c, x in zip(owners, chunks, out):
                todo[i] = todo[i][len(c) :]
                if not todo[i]:
                    logits[i] = x
            # queued, not waited for: the next chunk's graph (and after the last one the
            # streams' samplers and n-gram indexes) is built while the device runs this one
            mx.async_eval(self.slab.arrays())
            if between is not None and any(todo):
                between()  # rows step (`decode`), requests join (`prefill`); these are not streams yet
        streams = []
        for r, row in zip(requests, rows):  # each already in the slot `_add_stream` moves it to
            stream = self._add_stream(
                r.request_id,
                row,
                RequestSampler(r.sampling, r.prompt_ids, self._grammars),
                stop_token_ids(self._eos_token_ids, r.sampling),
                r.sampling.max_tokens,
                0,
                r.prompt_ids[-1],
                r.prompt_ids[:-1],
                int(r.lane),
            )
            streams.append(stream)
        # Stored at the batch's next operation (`_flush_stores`), once these first tokens
        # are out: the copy (a prompt's keys and values, every layer) is not on their path.
        if self.prefix_cache is not None:
            self._stores += [(row, list(r.prompt_ids)) for r, row, stored in zip(requests, rows, computed) if stored]
        for i, (r, row) in enumerate(zip(requests, rows)):
            source = rows[leader[i]]
            if source is not row:
                self.slab.write_prefix(row, *self.slab.copy_prefix(source, source.length), source.length)
                r.num_cached_tokens = source.length - 1  # none of it computed for this row
                logits[i] = logits[leader[i]]
        none: list[list[int]] = [[] for _ in streams]
        verified, reports = self._sample(streams, logits, none)
        return self._apply(streams, none, verified, False, reports)

    def adopt(
        self,
        request_id: str,
        cache: list,
        sampler: RequestSampler,
        pending_token: int,
        *,
        max_tokens: int,
        num_emitted: int,
        stop_ids: Sequence[int],
        history: Sequence[int] | None = None,
        lane: int = 1,
    ) -> list[TokenBatch]:
        """Take over a live stream (a speculative session) as a row: `cache` holds every
        token but `pending_token`, the last one emitted (`history`: the tokens before
        it, for the row's drafts; `lane`: the request's). A session row of this slab
        changes hands; another cache is copied into a new row. Emits nothing."""
        check_adoptable(request_id, self.request_ids(), num_emitted, max_tokens)
        self._take_back()
        row = _row_of(cache)
        if row is not None and id(row) in self._sessions and not row.freed:
            self._sessions.discard(id(row))
        else:
            row = self.slab.add_from(cache)
        self._add_stream(request_id, row, sampler, stop_ids, max_tokens, num_emitted, pending_token, history, lane)
        return []

    # -- decode -------------------------------------------------------------------------
    def decode(
        self, rider: Rider | None = None, drafts: bool = False, interrupt: Callable[[], bool] | None = None
    ) -> list[TokenBatch]:
        """One step: one token for every row (more for a row whose drafts land, with
        `drafts` and `row_drafts`), the rider's verify in the same forward (its logits
        in `rider.extra_logits`). A lone row without a rider keeps stepping within
        `solo_burst_s`, until `interrupt` returns True.

        `interrupt` (a step without a rider, on a packed slab): asked between the
        forward's layers; where it returns True the step stops and raises
        `Interrupted`, every row as it was (its drafts' budget too: the step's next run
        proposes them again)."""
        streams = list(self._streams.values())
        drafts = drafts and self.row_drafts
        if rider is not None:
            return self._step(streams, rider, drafts)
        if not streams:
            return []
        pipeline = self.pipeline and self.slab.grid
        if self.slab.grid:
            interrupt = None
        tic = time.perf_counter()
        batches = self._step(streams, None, drafts, pipeline, interrupt)
        while (
            len(streams) == 1
            and batches[0].finish_reason is None
            and time.perf_counter() - tic < self._solo_burst_s
            and not (interrupt and interrupt())
        ):
            batches[0].extend(self._step(streams, None, drafts, pipeline)[0])
        return batches

    def _step(
        self,
        streams: list[_Stream],
        rider: Rider | None,
        drafts: bool = False,
        pipeline: bool = False,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[TokenBatch]:
        wanted = drafts
        denied = [s.denied for s in streams]  # restored where the step is interrupted
        index = self.replica_index
        proposals = None if index is None else (index.num_proposals, index.num_hits)
        drafts = self._drafts(streams) if drafts else [[] for _ in streams]
        if pipeline and rider is None and not any(drafts):
            self.num_steps += 1
            return self._plain_step(streams, wanted)
        self._take_back()
        entries = [(s.row, [s.pending, *d]) for s, d in zip(streams, drafts)]
        if rider is not None:
            row = _row_of(rider.extra.cache)
            if row is None:  # a row of another slab: `Slab.forward` refuses it
                raise ValueError("the rider's cache is not a slab row")
            if self.slab.grid and row.slot != len(self._streams):
                self._to_classic_region(row)  # next to the rows: one grid, no gap rows
            entries.append((row, rider.extra.tokens.tolist()))
        tic = time.perf_counter()
        try:
            logits = self.slab.forward(self._model, entries, interrupt=interrupt)
        except Interrupted:
            for s, n in zip(streams, denied):
                s.denied = n
            if proposals is not None:
                index.num_proposals, index.num_hits = proposals
            raise
        self.num_steps += 1
        if rider is not None:
            rider.extra_logits = logits[-1]
        verified, reports = self._sample(streams, logits[: len(streams)], drafts)
        # A grid's steps overlap, and a rider's forward is not the rows' own.
        if rider is None and self._live is not None and self.price_by_steps and not self.slab.grid:
            seconds = time.perf_counter() - tic
            self._live.observe(len(streams), sum(1 for d in drafts if d), sum(map(len, drafts)), seconds)
        return self._apply(streams, drafts, verified, wanted, reports)

    def _apply(
        self,
        streams: list[_Stream],
        drafts: list[list[int]],
        verified: list[list[int]],
        wanted: bool,
        reports: list[list[TokenLogprob] | None],
    ) -> list[TokenBatch]:
        """Accept each row's drafts, emit, drop finished rows. `wanted`: drafts were
        asked for this step (a row that drafted nothing relaxes its estimate);
        `reports`: each row's logprobs at every verified position (None: not asked)."""
        # Kinds (greedy or not) of rows that did draft, and that were kept from drafts they
        # had; the kinds of match whose drafts rows were kept from.
        out, drafted, withheld, matches_withheld = [], set(), set(), set()
        for stream, draft, target, report in zip(streams, drafts, verified, reports):
            num_accepted = accept_count(draft, target)
            if len(draft) > num_accepted:  # rejected drafts leave the row
                for view in stream.row.cache:
                    view.trim(len(draft) - num_accepted)
            tokens, reason = clip_tokens(
                target[: num_accepted + 1], stream.max_tokens - stream.num_emitted, stream.stop_ids
            )
            stream.num_emitted += len(tokens)
            stream.pending = tokens[-1]
            if stream.token_ids is not None:
                stream.token_ids += tokens
            stream.sampler.accept(tokens)
            if stream.index is not None:
                stream.index.extend(tokens)
                kind = self.replica_acceptance[stream.sampler.is_greedy]
                if draft:
                    stream.acceptance.record(len(draft), num_accepted)
                    kind.record(len(draft), num_accepted)
                    self.match_acceptance[stream.sampler.is_greedy].record(stream.match, len(draft), num_accepted)
                    drafted.add(stream.sampler.is_greedy)
                elif wanted and stream.withheld:
                    stream.acceptance.relax(kind.alpha)
                    withheld.add(stream.sampler.is_greedy)
                    matches_withheld.add((stream.sampler.is_greedy, stream.match))
            out.append(
                TokenBatch(
                    stream.request_id,
                    tokens,
                    reason,
                    len(draft),
                    num_accepted if draft else 0,
                    "ngram" if draft else "",
                    None if report is None else report[: len(tokens)],
                )
            )
            if reason is not None:
                self._finished.add(stream.request_id)
                self._drop(stream)
        if wanted:  # a kind of row kept from its drafts, none of which drafted, drifts back toward the prior
            for greedy in withheld - drafted:
                self.replica_acceptance[greedy].relax()
            for greedy, match in matches_withheld:
                self.match_acceptance[greedy].relax(match)
        self._steps += 1
        if self._steps % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        return out

    # -- the pipeline (grid slabs) --------------------------------------------------------
    def _plain_step(self, streams: list[_Stream], wanted: bool) -> list[TokenBatch]:
        """One token for every row, no drafts: the queued step if it is this one, and the
        next step queued before this one's tokens are read."""
        queued = self._queued_tokens(streams)
        if queued is None:
            self._take_back()
            queued = self._draw(streams, [(s.row, [s.pending]) for s in streams])
        tokens, logprobs = queued
        # Queue the next step unless a row may draft in it, or its processors must first
        # read this step's token (penalties count what was emitted).
        if not (wanted and self._may_draft(streams)) and not any(s.sampler.has_processors for s in streams):
            nxt, nxt_logprobs = self._draw(streams, [(s.row, [0]) for s in streams], values=tokens, ahead=1)
            mx.async_eval(nxt, *_arrays(nxt_logprobs))
            self._ahead = _Ahead(streams, nxt, nxt_logprobs)
        mx.eval(tokens, *_arrays(logprobs))
        values = tokens.tolist()
        reports = [None if lp is None else lp.tolist() for lp in logprobs]
        return self._apply(streams, [[] for _ in streams], [[v] for v in values], wanted, reports)

    def _queued_tokens(self, streams: list[_Stream]) -> tuple[mx.array, list[LogprobArrays | None]] | None:
        """The queued step's tokens and reports for `streams` if it fed exactly them
        (rows that finished since are left out of it), else None."""
        ahead = self._ahead
        if ahead is None:
            return None
        live = [i for i, s in enumerate(ahead.streams) if self._streams.get(s.request_id) is s]
        if [ahead.streams[i] for i in live] != streams:
            return None
        self._ahead = None
        self.num_pipelined += 1
        logprobs = [ahead.logprobs[i] for i in live]
        if len(live) == len(ahead.streams):
            return ahead.tokens, logprobs
        return ahead.tokens[mx.array(live)], logprobs

    def _take_back(self) -> None:
        """Undo the queued step: its rows are one shorter again (its draws changed no
        sampler: they are dropped). Every operation that changes the batch other than a
        pipelined step starts here, so the prompt stores a prefill deferred run here too."""
        self._flush_stores()
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        for stream in ahead.streams:
            if not stream.row.freed:
                for view in stream.row.cache:
                    view.trim(1)

    def _draw(
        self, streams: list[_Stream], entries, values: mx.array | None = None, ahead: int = 0
    ) -> tuple[mx.array, list[LogprobArrays | None]]:
        """(lazy) each row's next token from a forward of `entries`, and its report;
        `ahead`: tokens each row has drawn and not yet accepted (the queued step's 1)."""
        logits = self.slab.forward(self._model, entries, values=values)
        drawn, logprobs = self._draws(streams, logits, [[] for _ in streams], ahead)
        return mx.concatenate(drawn).astype(mx.int32), logprobs

    def _nobody_pays(self, num_rows: int) -> bool:
        """Whether at this batch size even a row accepting every draft would not pay
        (budgets only grow with acceptance, so no row drafts)."""
        fit, k = self._fit, self.num_draft_tokens
        return fit is not None and (
            row_draft_budget(1.0, num_rows, fit, k) == 0
            or not drafts_pay([draft_net(1.0, k, num_rows, fit)] * num_rows, num_rows, fit)
        )

    def _budget(self, alpha: float, num_rows: int, remaining: int) -> int:
        """Drafts a drafting row with acceptance `alpha` and `remaining` tokens left to
        emit may verify in a step of `num_rows` rows."""
        k = draft_budget(self.num_draft_tokens, remaining)
        if self._fit is not None and k:
            k = min(k, row_draft_budget(alpha, num_rows, self._fit, self.num_draft_tokens))
        return k

    def _may_draft(self, streams: list[_Stream]) -> bool:
        """Whether a row may draft in the next step: its budget allows drafts at its
        acceptance as `_apply` leaves it after a step without drafts (or higher)."""
        if self._nobody_pays(len(streams)):
            return False
        alphas = []
        for s in streams:
            if s.index is not None:
                relaxed = copy.copy(s.acceptance)
                relaxed.relax(self.replica_acceptance[s.sampler.is_greedy].alpha)
                alphas.append(max(s.acceptance.alpha, relaxed.alpha))
            else:
                alphas.append(None)
        return self._step_pays(alphas, self._row_budgets(streams, alphas, ahead=1), len(streams))

    def _row_budgets(self, streams: list[_Stream], alphas: list[float | None], ahead: int = 0) -> list[int]:
        """Each row's own draft budget at acceptance `alphas` (None: the row does not
        draft, 0), `ahead` of its tokens left out of what it may still emit."""
        return [
            0 if a is None else self._budget(a, len(streams), s.max_tokens - s.num_emitted - ahead)
            for a, s in zip(alphas, streams)
        ]

    def _step_pays(self, alphas: list[float | None], wants: list[int], num_rows: int) -> bool:
        """Whether rows drafting `wants` at acceptances `alphas` gain the step more than
        its first draft costs (`scheduler.costs.drafts_pay`; without costs: any draft)."""
        if not any(wants):
            return False
        if self._fit is None:
            return True
        return drafts_pay(
            [draft_net(a, k, num_rows, self._fit) for a, k in zip(alphas, wants) if k], num_rows, self._fit
        )

    def _drafts(self, streams: list[_Stream]) -> list[list[int]]:
        """Each row's drafts for this step (empty where it drafts nothing): what its own
        budget allows and its index proposes, within the step's draft budget, which
        rows share in lane order (`scheduler.costs.share_drafts`)."""
        for s in streams:
            s.withheld = False
        if self._nobody_pays(len(streams)):
            return [[] for _ in streams]
        # What each row's lookup proposes, so that its drafts are priced by the record of
        # their kind of match where there is one (`_alpha`); a row drafts a prefix of it.
        peeks = [[] if s.index is None else self._propose(s, self.num_draft_tokens) for s in streams]
        alphas = [None if s.index is None else self._alpha(s) for s in streams]
        budgets = self._row_budgets(streams, alphas)
        if self.replica_index is not None:
            for s, k in zip(streams, budgets):
                if k:
                    self.replica_index.count(s.match[0] == "replica")
        out = [s.sampler.allowed_drafts(peek[:k]) if k else [] for s, k, peek in zip(streams, budgets, peeks)]
        # Only a row kept from drafts it had relaxes its estimate: steps in which prose
        # offers no n-gram say nothing about how its next drafts will fare.
        for s, k, peek in zip(streams, budgets, peeks):
            s.withheld = s.index is not None and not k and bool(peek)
        # Priced by what the rows proposed (a row whose n-grams found nothing adds nothing).
        if not self._step_pays(alphas, [len(d) for d in out], len(streams)):
            return [[] for _ in streams]
        budget = (
            step_draft_budget(len(streams), self._live.base, self.draft_step_share)  # by the measured costs
            if self._live is not None and self.draft_step_share > 0
            else None
        )
        if budget is None or sum(map(len, out)) <= budget:
            for s, d in zip(streams, out):
                s.denied = 0 if d else s.denied
            return out
        given = share_drafts(
            [len(d) for d in out], [s.lane for s in streams], [s.denied for s in streams], budget, self.skip_cap
        )
        for s, d, n in zip(streams, out, given):
            s.denied = 0 if n or not d else s.denied + 1
        return [d[:n] for d, n in zip(out, given)]

    def _propose(self, stream: _Stream, k: int) -> list[int]:
        """A row's k drafts: from the replica's past outputs where its last tokens match
        one at least `replica_index.min_ngram` long, else from its own prompt and output.
        Sets the row's `match` (where they came from, and how long a suffix matched).
        Uncounted in the replica index's stats: `_drafts` counts the ones rows use."""
        if self.replica_index is not None:
            drafts = self.replica_index.propose(stream.index.history, k, count=False)
            if drafts:
                stream.match = ("replica", self.replica_index.last_match)
                return drafts
        drafts = stream.index.propose(k)
        stream.match = ("own", stream.index.last_match)
        return drafts

    def _alpha(self, stream: _Stream) -> float:
        """The per-draft acceptance a row's drafts are priced at: the record of drafts from
        the kind of match its last proposal found, once that has enough verifies, else
        the row's own estimate, capped by what such a match is expected to land
        (`scheduler.costs.match_prior`)."""
        by_match = self.match_acceptance[stream.sampler.is_greedy].alpha(stream.match)
        return min(stream.acceptance.alpha, match_prior(stream.match)) if by_match is None else by_match

    def _sample(
        self, streams: list[_Stream], logits: list[mx.array], drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """Every verify position of every row, drawn from the row's sampler, position i
        after the row's drafts[:i] (greedy rows without processors: one argmax over
        all of them), and the row's logprobs there (None: not asked)."""
        if not streams:
            mx.eval(self.slab.arrays())
            return [], []
        drawn, logprobs = self._draws(streams, logits, drafts)
        flat = mx.concatenate(drawn)
        mx.eval(flat, *_arrays(logprobs), self.slab.arrays())
        values, out, start = flat.tolist(), [], 0
        for d in drawn:
            n = d.shape[0]
            out.append(values[start : start + n])
            start += n
        return out, [None if lp is None else lp.tolist() for lp in logprobs]

    def _draws(
        self, streams: list[_Stream], logits: list[mx.array], drafts: list[list[int]], ahead: int = 0
    ) -> tuple[list[mx.array], list[LogprobArrays | None]]:
        """(lazy) every verify position of every row, drawn from the row's sampler,
        position i after the row's drafts[:i] (greedy rows without processors and
        without logprobs: one argmax over all of them; sampled ones: one draw per set of
        filters, `draw_plain`), and each row's report."""
        drawn: list[mx.array | None] = [None] * len(streams)
        reports: list[LogprobArrays | None] = [None] * len(streams)
        # Rows without processors or logprobs: greedy ones in one argmax, sampled ones in
        # one draw per set of filters.
        plain: dict[tuple | None, list[int]] = {}
        for i, s in enumerate(streams):
            if not (s.sampler.has_processors or s.sampler.wants_logprobs):
                plain.setdefault(None if s.sampler.is_greedy else s.sampler.filter_key, []).append(i)
        for key, rows in plain.items():
            if key is not None and len(rows) < 2:
                continue
            stacked = mx.concatenate([logits[i] for i in rows]) if len(rows) > 1 else logits[rows[0]]
            counts = [logits[i].shape[0] for i in rows]
            if key is None:
                picks = greedy(stacked)
            else:
                picks = draw_plain([streams[i].sampler for i in rows], stacked, counts, ahead)
            start = 0
            for i, n in zip(rows, counts):
                drawn[i] = picks[start : start + n]
                start += n
        for i, s in enumerate(streams):
            if drawn[i] is None:
                drawn[i], reports[i] = s.sampler.sample_with_logprobs(logits[i], drafts[i], ahead)
        return drawn, reports

    # -- leaving ------------------------------------------------------------------------
    def extract(self, request_id: str) -> tuple[TokenBatch, LiveRow | None]:
        """Take a row out for a speculative session: its cache (every token but the
        pending one, already emitted) becomes a session row; nothing is emitted."""
        self._take_back()
        stream = self._streams.get(request_id)
        if stream is None:
            raise ValueError(f"request {request_id!r} is not a decoding classic row")
        row = stream.row
        self._to_session_region(row)
        del self._streams[request_id]
        self._sessions.add(id(row))
        return TokenBatch(request_id, []), LiveRow(row.cache, stream.sampler)

    def _drop(self, stream: _Stream) -> None:
        if stream.token_ids is not None:
            self._store_prefix(stream.row, stream.token_ids)
        if self.replica_index is not None and stream.index is not None and stream.num_emitted:
            self.replica_index.add(stream.index.history[-stream.num_emitted :])
        self._to_session_region(stream.row, freeing=True)  # the last classic row takes its slot
        self.slab.free(stream.row)  # and the last row of the slab this one's
        del self._streams[stream.request_id]
        self.slab.shrink()

    def remove(self, request_id: str) -> None:
        """Drop a row (finished rows are already out of the slab). Idempotent. A row
        that finished is only forgotten: the step queued after it (a grid slab's
        pipeline, which leaves finished rows out of its tokens) stays queued."""
        self._finished.discard(request_id)
        stream = self._streams.get(request_id)
        if stream is not None:
            self._take_back()
            self._drop(stream)

    def close(self) -> None:
        self._ahead = None
        self._streams.clear()
        self._finished.clear()


def prefill_width(budget: int, num_rows: int) -> int:
    """Prompt positions per row in a prefill forward of `num_rows` rows: `PREFILL_CHUNK`
    while the group's rows fill `budget`, more as rows finish (a long prompt among short
    ones runs in fewer forwards), at most `MAX_PREFILL_CHUNK` (its attention scores). A
    power of two: a GPU's grid pads a chunk's width up to one (`slab_forward.grid_width`),
    so 4,096 / 3 = 1,365 positions per row would compute 2,048.

    >>> [prefill_width(4096, n) for n in (8, 5, 3, 2, 1)], prefill_width(512, 1)
    ([512, 512, 1024, 2048, 2048], 512)
    """
    share = max(PREFILL_CHUNK, budget // max(1, num_rows))
    return min(MAX_PREFILL_CHUNK, 1 << (share.bit_length() - 1))


def _arrays(reports: list[LogprobArrays | None]) -> list[mx.array]:
    return [a for r in reports if r is not None for a in r.arrays()]


def _row_of(cache: list) -> Row | None:
    first = cache[0] if cache else None
    return first.row if isinstance(first, RowView) else None
