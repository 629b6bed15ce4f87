"""What `MlxRunner` is built from: its classic batch, its prefix cache, its warm-up.

Functions over plain arguments (or the runner's public methods), so the runner's own
module keeps to the ModelRunner protocol.
"""

from __future__ import annotations

import logging
import platform
import time

import mlx.core as mx
import mlx.nn as nn

from models.batch import prefix_cache
from models.batch.generator_batch import GeneratorBatch
from models.batch.protocol import ClassicRows
from models.batch.slab_batch import SlabBatch
from models.forward.bucketed import BucketedForward
from models.runner_config import RunnerConfig
from models.sampling.grammar import Grammars
from models.speculative.drafters import Drafter
from models.speculative.session import PROBE_TOKENS
from scheduler.request import Request, SamplingParams

log = logging.getLogger(__name__)


def hardware_name() -> str:
    """e.g. "cpu-x86_64" or "gpu-arm64"."""
    device = mx.default_device()
    kind = getattr(getattr(device, "type", None), "name", None) or str(device)
    return f"{kind}-{platform.machine()}"


def make_classic_batch(
    model: nn.Module,
    config: RunnerConfig,
    fuse_blocker: str | None,
    drafter: Drafter | None,
    eos_token_ids: list[int],
    grammars: Grammars,
) -> ClassicRows:
    """Where the verify can ride in the batch's forward (`fuse_blocker` None), classic
    rows and sessions share one slab (`models.batch.slab_batch`): moving a stream between
    them moves no keys. Otherwise, or with `config.slab_batch` False, mlx-lm's
    `BatchGenerator` (`models.batch.generator_batch`); `config.slab_batch` True demands the slab.
    `drafter`: the slot's (None: no slot); on the slab, with the prefix cache on, a
    drafter that keeps KV gets its own share of the budget (`make_prefix_caches`)."""
    if config.slab_batch and fuse_blocker is not None:
        raise ValueError(f"the slab batch needs a verify that rides in it: {fuse_blocker}")
    common = dict(
        eos_token_ids=eos_token_ids,
        max_batch_size=config.max_batch_size,
        prefill_batch_size=config.prefill_batch_size,
        solo_burst_s=config.classic_burst_ms / 1000.0,
        grammars=grammars,
    )
    if fuse_blocker is None and config.slab_batch is not False:
        batch = SlabBatch(
            model,
            row_drafts=config.row_drafts and drafter is not None,
            num_draft_tokens=config.num_draft_tokens,
            **common,
        )
        # The draft's bytes per position cost a draft forward: only asked when a cache is on.
        draft_bytes = drafter.kv_bytes_per_position() if drafter and config.prefix_cache_bytes != 0 else 0
        batch.prefix_cache, draft_cache = make_prefix_caches(
            config.prefix_cache_bytes, batch.slab.bytes_per_position, draft_bytes
        )
        if draft_cache is not None:
            drafter.prefix_cache = draft_cache
        return batch
    if config.prefix_cache_bytes != 0:
        log.info("prefix cache off: it needs the slab batch (%s)", fuse_blocker)
    return GeneratorBatch(model, **common)


def make_prefix_caches(
    budget_bytes: int | None, target_bytes_per_position: int, draft_bytes_per_position: int = 0
) -> tuple[prefix_cache.PrefixCache | None, ...]:
    """(the target's prefix cache, the draft model's): None when off (budget 0); None
    as the budget: sized from the memory available now (a deployment's default,
    `RunnerConfig.prefix_cache_bytes`). A drafter that keeps KV (bytes per position > 0)
    gets the budget's share its positions take, so a prompt fits both caches alike
    and together they stay within the budget.

    >>> [c.budget_bytes for c in make_prefix_caches(1000, 300, 100)]
    [750, 250]
    >>> make_prefix_caches(1000, 300)[1] is None, make_prefix_caches(0, 300, 100)
    (True, (None, None))
    """
    if budget_bytes is None:
        budget_bytes = prefix_cache.default_budget(prefix_cache.available_memory())
        log.info(
            "prefix cache: %.2f GiB (1/%d of the memory available, at most %d GiB)",
            budget_bytes / 2**30,
            prefix_cache.DEFAULT_BUDGET_SHARE,
            prefix_cache.DEFAULT_BUDGET_CAP >> 30,
        )
    if budget_bytes <= 0:
        return None, None
    draft_budget = budget_bytes * draft_bytes_per_position // (target_bytes_per_position + draft_bytes_per_position)
    draft = prefix_cache.PrefixCache(draft_budget) if draft_budget > 0 else None
    return prefix_cache.PrefixCache(budget_bytes - draft_budget), draft


def warm_compiled(verifier: BucketedForward, drafter: Drafter, num_draft_tokens: int, max_positions: int) -> int:
    """Compile the fast path's shapes for contexts up to `max_positions`: verifies of 1
    and K + 1 positions (logits for sampled requests, greedy tokens for greedy ones),
    the drafter's catch-up feeds, prefill chunks of target and draft. Returns the shape count."""
    tic = time.perf_counter()
    log.info(
        "warming the compiled verify for contexts up to %d positions (MLX compiles each shape once)", max_positions
    )
    verify_widths = (1, num_draft_tokens + 1)  # 1: a request's last-token round
    count = verifier.warm(verify_widths, max_positions)  # sampled requests
    count += verifier.warm(verify_widths, max_positions, head="every")  # greedy ones
    if verifier.prefill_chunk:
        count += verifier.warm((verifier.prefill_chunk,), max_positions, head="last")
    # The drafter catches up on 1-2 tokens after a round, PROBE_TOKENS + 1-2 after a probe.
    count += drafter.warm((1, 2, PROBE_TOKENS + 1, PROBE_TOKENS + 2), max_positions)
    log.info("compiled %d shapes in %.1f s", count, time.perf_counter() - tic)
    return count


WARM_PROMPT = "def warm(x):\n    return x + 1\n"


def run_warm_batch(runner, max_tokens: int = 4) -> int:
    """Throwaway requests through a slab runner's classic batch (one greedy, two sampled
    with the same filters, so the one-draw path runs too) and through its slot, greedy
    and sampled: the first real requests then find the sampler's and the verify's
    kernels built. The prefix cache and the replica index are detached meanwhile (the
    warm requests leave nothing in them). Returns the throwaway requests run."""
    batch = runner._classic
    saved = batch.prefix_cache, batch.replica_index
    draft_cache = runner._slot.drafter.prefix_cache if runner._slot is not None else None
    batch.prefix_cache = batch.replica_index = None
    if draft_cache is not None:
        runner._slot.drafter.prefix_cache = None
    try:
        prompt = list(runner.tokenizer.encode(WARM_PROMPT))[:16] or [1]
        sampled = dict(max_tokens=max_tokens, temperature=0.7, top_p=0.9)
        requests = [
            Request("__warm_b0", prompt, SamplingParams(max_tokens=max_tokens)),
            Request("__warm_b1", prompt, SamplingParams(seed=0, **sampled)),
            Request("__warm_b2", prompt, SamplingParams(seed=1, **sampled)),
        ]
        runner.classic_prefill(requests)
        for _ in range(4 * max_tokens):
            if not runner.num_classic_rows():
                break
            runner.classic_decode(drafts=True)
        for request in requests:  # idempotent: finished rows are already out
            runner.classic_remove(request.request_id)
        if runner._slot is not None:
            run_warm_requests(runner)
        return len(requests) + (2 if runner._slot is not None else 0)
    finally:
        batch.prefix_cache, batch.replica_index = saved
        if draft_cache is not None:
            runner._slot.drafter.prefix_cache = draft_cache


def run_warm_requests(runner) -> None:
    """Throwaway requests, greedy and sampled, through an `MlxRunner`'s slot: begin, a
    probe round, full rounds to the end. Only at load, before any request holds the slot."""
    if runner._slot.holder is not None:
        return
    prompt = list(runner.tokenizer.encode(WARM_PROMPT))[:16] or [1]
    n = 2 * (runner.num_draft_tokens + 1) + 2
    for i, params in enumerate(
        (SamplingParams(max_tokens=n), SamplingParams(max_tokens=n, temperature=0.7, top_p=0.9, seed=0))
    ):
        request = Request(f"__warm{i}", prompt, params)
        if not runner.spec_supports(request):
            return
        try:
            if runner.spec_begin(request).finish_reason is None:
                reason = runner.spec_round(request.request_id, probe=True).finish_reason
                while reason is None:
                    reason = runner.spec_round(request.request_id).finish_reason
        finally:
            runner.spec_finish(request.request_id)
