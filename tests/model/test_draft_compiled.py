"""`draft_compiled`: a draft model's steps through compiled, bucketed forwards propose the
drafts mlx-lm's forward does, round after round, across bucket edges, after rollbacks, from
a prefix-cache hit and at temperature > 0; the runner turns it on by default on a CPU."""

from __future__ import annotations

import mlx.core as mx
import pytest

from models.forward.bucketed import DEFAULT_BUCKET, BucketedForward
from models.runner import MlxRunner
from models.speculative.drafters import DraftModelDrafter

from .conftest import make_request
from .helpers import run_session


def drafters(loaded):
    draft = loaded[1]
    plain = DraftModelDrafter(draft.model, draft.name)
    compiled = DraftModelDrafter(draft.model, draft.name)
    compiled.compile_forwards(0)
    return plain, compiled


@pytest.mark.parametrize("k", [1, 2, 4])
def test_compiled_drafts_equal_plain_ones_across_buckets_and_rollbacks(loaded, k):
    plain, compiled = drafters(loaded)
    assert compiled.fast is not None and isinstance(compiled.fast, BucketedForward)
    vocab = loaded[0].model.args.vocab_size
    start = DEFAULT_BUCKET - 40  # the rounds cross the first bucket's edge
    history = [(11 * i + 5) % vocab for i in range(start + 60 * (k + 1) + 1)]
    steps, greedy = [], compiled.fast.greedy
    compiled.fast.greedy = lambda *args: steps.append(1) or greedy(*args)
    states = [d.new_state(history[:start]) for d in (plain, compiled)]
    n = start + 1
    for step in range(60):
        got = [d.propose(s, history[:n], k) for d, s in zip((plain, compiled), states)]
        assert got[0] == got[1], (step, n, got)
        accepted = step % (k + 1)  # every count from none to all, in turn
        for d, s in zip((plain, compiled), states):
            d.rollback(s, k, accepted)
        n += accepted + 1
    assert n > DEFAULT_BUCKET + 1
    assert len(steps) >= 60 * k  # the compiled forward drafted every round


def test_compiled_sampled_drafts_equal_plain_ones(loaded, prompt_ids):
    plain, compiled = drafters(loaded)
    request = make_request("s", prompt_ids[0], max_tokens=24, temperature=0.8, seed=7)
    a = run_session(loaded, request, 3, plain)
    b = run_session(loaded, request, 3, compiled)
    assert a == b


def test_compiled_draft_keeps_its_prefix_cache(loaded):
    from models.batch.prefix_cache import PrefixCache

    plain, compiled = drafters(loaded)
    assert compiled.kv_bytes_per_position() == plain.kv_bytes_per_position() > 0
    compiled.prefix_cache = PrefixCache(1 << 24, block_size=16)
    vocab = loaded[0].model.args.vocab_size
    history = [(13 * i + 1) % vocab for i in range(160)]
    state = compiled.new_state(history[:100])
    compiled.propose(state, history[:101], 2)
    compiled.rollback(state, 2, 0)
    compiled.keep(state, history[:101])
    reused = compiled.new_state(history[:140])
    assert compiled.prefix_cache.lookup(history[:140]) is not None  # it started from kept positions
    fresh = plain.new_state(history[:140])
    assert compiled.propose(reused, history[:141], 3) == plain.propose(fresh, history[:141], 3)


def test_runner_compiles_the_draft_on_a_cpu_by_default(tiny_pair, prompt_ids):
    assert mx.default_device() == mx.cpu
    runs = {}
    for setting in (None, False):
        runner = MlxRunner.from_paths(
            tiny_pair[0], drafter_kind="draft_model", drafter_path=tiny_pair[1], draft_compiled=setting
        )
        drafter = runner._slot.drafter
        assert (drafter.fast is not None) == (setting is None)
        try:
            request = make_request("g", prompt_ids[3], max_tokens=32)
            first = runner.spec_begin(request)
            tokens, reason = list(first.token_ids), first.finish_reason
            while reason is None:
                outcome = runner.spec_round("g")
                tokens += outcome.token_ids
                reason = outcome.finish_reason
            runner.spec_finish("g")
        finally:
            runner.close()
        runs[setting] = tokens
    assert runs[None] == runs[False]
