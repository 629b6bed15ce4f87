"""`ClassicRows`: what the runner asks of a classic batch, whichever backend holds the rows.

Two backends implement it: `models.batch.slab_batch.SlabBatch` (rows and speculative
sessions in one slab; rows may verify their own drafts) and
`models.batch.generator_batch.GeneratorBatch` (mlx-lm's `BatchGenerator`, for a model the
slab cannot serve). What only the slab can do is a member the other answers plainly
(`shares_slab` False, `row_drafts` False, `prefix_cache` None), so the runner never asks
which one it holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from scheduler.model_api import TokenBatch
from scheduler.request import Request

if TYPE_CHECKING:
    from models.batch.generator_batch import LiveRow
    from models.batch.prefix_cache import PrefixCache
    from models.forward.ragged import Rider
    from models.sampling.samplers import RequestSampler
    from models.speculative.replica_index import ReplicaIndex
    from scheduler.costs import TickCosts


class ClassicRows(Protocol):
    # Sessions take rows of this batch's KV store (`new_session_cache`), so moving a stream
    # between a session and a row moves no keys; False: sessions own their caches.
    shares_slab: bool
    # Rows verify their own n-gram drafts; the three below only act where this is True.
    row_drafts: bool
    draft_step_share: float  # the share of a plain step's time rows' drafts may add (0: no limit)
    sampled_drafts: bool  # rows at temperature > 0 draft too
    replica_index: ReplicaIndex | None  # past outputs rows draft from (None: off)
    costs: TickCosts | None  # measured forward costs rows' draft budgets are judged by
    skip_cap: int  # steps a drafting row may be left out of a step's draft budget
    prefix_cache: PrefixCache | None  # where new rows find their prompt's prefix (None: none)

    def prefill(
        self, requests: Sequence[Request], between: Callable[[], None] | None = None, piece: int = 0
    ) -> list[TokenBatch]:
        """Admit `requests` and emit each one's first token; `between` runs between
        prefill forwards of at most `piece` positions (0: whole) where the backend chunks."""

    def prefill_fits(self, prompt_ids: Sequence[int], piece: int) -> bool:
        """Whether a prefill of `prompt_ids` now runs in one forward of `piece` positions."""

    def decode(
        self, rider: Rider | None = None, drafts: bool = False, interrupt: Callable[[], bool] | None = None
    ) -> list[TokenBatch]:
        """One step of every row, `rider`'s verify in the same forward; `interrupt` may
        stop a step between layers where the backend can."""

    def extract(self, request_id: str) -> tuple[TokenBatch, LiveRow | None]: ...

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
        """Take over a live stream (a demoted or parked session) as a row: `cache` holds
        every token but `pending_token`, the last one emitted."""

    def remove(self, request_id: str) -> None: ...

    def num_rows(self) -> int: ...

    def step_stats(self) -> dict | None:
        """Decode steps and pipelined ones, where the backend counts them (None: it does not)."""

    def drafts_rows_of(self, greedy: bool) -> bool:
        """Whether rows of this kind (greedy, or sampled) verify their own drafts."""

    def new_session_cache(self, prompt_ids: Sequence[int] = ()) -> list:
        """A session's cache from this batch's KV store (only where `shares_slab`)."""

    def keep_prompt(self, cache: list, prompt_ids: Sequence[int]) -> None:
        """Store a session's prompt KV in the prefix cache (a no-op without one)."""

    def release(self, cache: list, token_ids: Sequence[int] | None = None) -> None:
        """Free a session's row (a cache that is not one of this batch's rows is ignored)."""

    def close(self) -> None: ...
