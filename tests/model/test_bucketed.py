"""The GPU path (`models.forward.bucketed`): shape-stable compiled forwards and the one-sync
speculative round, checked on CPU in float32 against the plain forward and classic decode."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from models.forward.bucketed import BucketedForward, round_up, supports
from models.runner import MlxRunner
from models.speculative.drafters import DraftModelDrafter, NgramDrafter
from models.speculative.session import SpeculativeSession

from .conftest import make_request
from .helpers import run_classic

pytestmark = pytest.mark.model

MAX_TOKENS = 24


def test_round_up_table():
    for n, bucket, want in [(0, 16, 16), (1, 16, 16), (16, 16, 16), (17, 16, 32), (40, 256, 256)]:
        assert round_up(n, bucket) == want


def test_logits_match_plain_forward_across_buckets_and_trims(loaded, prompt_ids):
    model = loaded[0].model
    assert supports(model)
    fast = BucketedForward(model, bucket=16)
    plain_cache, fast_cache = make_prompt_cache(model), make_prompt_cache(model)
    prompt = mx.array([prompt_ids[0]])
    mx.eval(model(prompt, cache=plain_cache), model(prompt, cache=fast_cache))
    sizes = set()
    for step in range(90):  # grows past prefill's 256 positions, with trims in between
        tokens = mx.array([[(7 * step + j) % 300 + 1 for j in range(1 + step % 8)]])
        want = model(tokens, cache=plain_cache)
        got = fast.logits(fast_cache, tokens)
        assert got.shape == want.shape
        assert mx.allclose(got, want, atol=1e-5).item(), f"step {step}"
        assert fast_cache[0].offset == plain_cache[0].offset
        assert fast_cache[0].keys.shape[2] % 16 == 0
        sizes.add(fast_cache[0].keys.shape[2])
        trim_prompt_cache(plain_cache, step % 3)
        trim_prompt_cache(fast_cache, step % 3)
        greedy_want = mx.argmax(model(mx.array([[5]]), cache=plain_cache)[:, -1], axis=-1)
        assert fast.greedy(fast_cache, mx.array([[5]])).tolist() == greedy_want.tolist()
        every = mx.array([[9, 4, 7][: 1 + step % 3]])
        logits = model(every, cache=plain_cache)
        every_want = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
        assert fast.greedy_every(fast_cache, every).tolist() == every_want.tolist()
    assert len(sizes) >= 3


def test_empty_cache_falls_back_to_plain_forward(loaded):
    model = loaded[0].model
    fast = BucketedForward(model, bucket=16)
    cache = make_prompt_cache(model)
    tokens = mx.array([[3, 4, 5]])
    assert mx.allclose(fast.logits(cache, tokens), model(tokens, cache=make_prompt_cache(model))).item()
    assert cache[0].offset == 3


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 21])
def test_chunked_prefill_matches_plain_prefill(loaded, length):
    model = loaded[0].model
    fast = BucketedForward(model, bucket=16, prefill_chunk=8)
    ids = [(5 * i) % 300 + 1 for i in range(length)]
    plain_cache, fast_cache = make_prompt_cache(model), make_prompt_cache(model)
    if ids:
        model(mx.array([ids]), cache=plain_cache)
    fast.prefill(fast_cache, ids)
    assert fast_cache[0].offset == plain_cache[0].offset == length
    assert fast_cache[0].keys.shape[2] % 16 == 0  # buffers exist even for an empty prompt
    for step in range(3):  # then decode and verify on top of it, with a trim
        tokens = mx.array([[7 + step, 9, 11][: 1 + step]])
        want = model(tokens, cache=plain_cache)
        got = fast.logits(fast_cache, tokens)
        assert mx.allclose(got, want, atol=1e-5).item(), f"length {length} step {step}"
        trim_prompt_cache(plain_cache, step)
        trim_prompt_cache(fast_cache, step)
    with pytest.raises(ValueError):
        BucketedForward(model, prefill_chunk=0).prefill(make_prompt_cache(model), ids)


def test_warm_counts_shapes(loaded):
    fast = BucketedForward(loaded[1].model, bucket=16)
    # buckets 16, 32, 48; lengths 1 and 5 fit each
    assert fast.warm((1, 5), 40) == 6
    assert fast.warm((1,), 16, head="last") == 1


def test_propose_array_equals_propose(loaded, prompt_ids):
    draft = loaded[1].model
    for fast in (None, BucketedForward(draft, bucket=16)):
        drafter = DraftModelDrafter(draft, "d", fast=fast)
        ref = DraftModelDrafter(draft, "d")
        history = list(prompt_ids[2]) + [11]
        a, b = drafter.new_state(prompt_ids[2]), ref.new_state(prompt_ids[2])
        for k in (3, 1, 5):
            got = drafter.propose_array(a, history, k)
            assert got.dtype == mx.int32 and got.shape == (k,)
            want = ref.propose(b, history, k)
            assert got.tolist() == want
            assert a.num_cached == b.num_cached
            # accept one draft, then continue from the target's token
            drafter.rollback(a, k, 1)
            ref.rollback(b, k, 1)
            history += want[:1] + [17]


def _run_fast(loaded, request, k, drafter, prefill_chunk=4, fast=True):
    """`fast` = False: the same rounds (probes included) on the plain path."""
    target = loaded[0]
    session = SpeculativeSession(
        request.request_id,
        target.model,
        request.prompt_ids,
        request.sampling,
        num_draft_tokens=k,
        eos_token_ids=sorted(target.tokenizer.eos_token_ids),
        verifier=BucketedForward(target.model, bucket=16, prefill_chunk=prefill_chunk) if fast else None,
    )
    session.bind(drafter)
    first = session.begin()
    tokens, reason, drafted, accepted = list(first.token_ids), first.finish_reason, 0, 0
    while reason is None:
        probe = session.counters.num_rounds % 7 == 3  # probe rounds go through it too
        r = session.step(probe=probe)
        tokens += r.token_ids
        reason = r.finish_reason
        drafted += r.num_drafted
        accepted += r.num_accepted
    phases = session.counters.phase_seconds
    session.finish()
    assert set(phases) == {"draft", "verify", "sync", "rollback"}
    return (tokens, reason), drafted, accepted


@pytest.fixture(scope="module")
def classic_outputs(loaded, prompt_ids):
    requests = [make_request(f"r{i}", ids, MAX_TOKENS) for i, ids in enumerate(prompt_ids)]
    return run_classic(loaded[0].model, requests, sorted(loaded[0].tokenizer.eos_token_ids))


@pytest.mark.parametrize("kind", ["draft_model", "draft_model_fast", "ngram"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_fast_session_equals_classic(loaded, prompt_ids, classic_outputs, kind, k):
    draft = loaded[1].model
    drafter = {
        "draft_model": lambda: DraftModelDrafter(draft, "d"),
        "draft_model_fast": lambda: DraftModelDrafter(draft, "d", fast=BucketedForward(draft, 16, prefill_chunk=4)),
        "ngram": NgramDrafter,
    }[kind]()
    drafted = accepted = 0
    for i, ids in enumerate(prompt_ids):
        # prefill in chunks of 4 (several chunks, padded) and, for one prompt, plainly
        chunk = 0 if i == 3 else 4
        out, d, a = _run_fast(loaded, make_request(f"r{i}", ids, MAX_TOKENS), k, drafter, chunk)
        assert out == classic_outputs[f"r{i}"], f"prompt {i} diverged at K={k}"
        drafted += d
        accepted += a
    assert 0 < accepted < drafted


def test_runner_fast_verify_on_cpu(tiny_pair, loaded, prompt_ids, classic_outputs):
    runner = MlxRunner.from_paths(
        tiny_pair[0],
        drafter_kind="draft_model",
        drafter_path=tiny_pair[1],
        num_draft_tokens=3,
        fast_verify=True,
        warm_positions=0,
    )
    assert runner.fast_verify
    # one 256-position bucket: verify 1 and 4 (logits and greedy heads) + prefill chunk 128;
    # draft 1, 2, the two catch-up lengths after a probe (PROBE_TOKENS + 1, + 2) and 128,
    # and the first four again for sampled drafts (logits)
    assert runner.warm(256) == 5 + 5 + 4
    # the throwaway warm requests leave nothing behind
    assert runner.num_live_sessions() == 0 and runner._slot.holder is None
    try:
        for i in (0, 5, 9):
            req = make_request(f"r{i}", prompt_ids[i], MAX_TOKENS)
            first = runner.spec_begin(req)
            tokens, reason = list(first.token_ids), first.finish_reason
            while reason is None:
                out = runner.spec_round(req.request_id)
                tokens += out.token_ids
                reason = out.finish_reason
            runner.spec_finish(req.request_id)
            assert (tokens, reason) == classic_outputs[f"r{i}"]
    finally:
        runner.close()
    default = MlxRunner.from_paths(tiny_pair[0], drafter_kind="ngram")
    assert not default.fast_verify  # CPU default keeps the plain path
    default.close()


# -- the fused decoder (q/k/v and gate/up as one product each) ------------------------


def _fresh_llama(seed: int = 3, tie: bool = False):
    from models.tiny import random_model, tiny_args

    args = tiny_args(vocab_size=97, num_layers=2, hidden=32)
    args.tie_word_embeddings = tie
    return random_model(args, seed=seed, embed_scale=2.0, out_scale=0.5)


@pytest.mark.parametrize("tie", [False, True])
def test_fused_decoder_keeps_the_plain_forward_exact_and_matches_it(tie):
    model = _fresh_llama(tie=tie)
    tokens = mx.array([[5, 9, 2, 40, 7, 1]])
    before = model(tokens, cache=make_prompt_cache(model))
    fast = BucketedForward(model, bucket=16)
    assert fast.fused is not None
    # The model's q/k/v and gate/up weights are now slices of the fused matrices: the
    # plain forward (classic decode, probes) must give bit-identical logits.
    assert mx.array_equal(model(tokens, cache=make_prompt_cache(model)), before).item()
    assert BucketedForward(model, bucket=16).fused is fast.fused  # built once per model
    unfused = BucketedForward(model, bucket=16, fuse=False)
    assert unfused.fused is None
    caches = [make_prompt_cache(model) for _ in range(3)]
    for c in caches:
        fast.prefill(c, [3, 1, 4, 1, 5, 9, 2, 6])
    for n in (1, 2, 5):
        step = mx.array([[11, 12, 13, 14, 15][:n]])
        got = fast.logits(caches[0], step)
        want = unfused.logits(caches[1], step)
        plain = model(step, cache=caches[2])
        assert mx.allclose(got, want, atol=1e-5).item() and mx.allclose(got, plain, atol=1e-5).item()


def test_qwen2_biases_fuse_with_their_rows():
    from mlx_lm.models import qwen2

    mx.random.seed(1)
    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=97,
        num_key_value_heads=2,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    model = qwen2.Model(args)
    for layer in model.model.layers:  # non-zero biases, so a misplaced bias row shows
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            proj.bias = mx.random.normal(proj.bias.shape)
    mx.eval(model.parameters())
    prompt, step = mx.array([[3, 1, 4, 1, 5]]), mx.array([[7, 8, 9]])
    before = model(mx.concatenate([prompt, step], axis=1), cache=make_prompt_cache(model))[:, -3:]
    fast = BucketedForward(model, bucket=16)
    assert fast.fused is not None
    cache, plain = make_prompt_cache(model), make_prompt_cache(model)
    fast.prefill(cache, prompt[0].tolist())
    model(prompt, cache=plain)
    after = model(step, cache=plain)
    assert mx.allclose(after, before, atol=1e-5).item()  # the model's own weights kept their rows
    assert mx.allclose(fast.logits(cache, step), before, atol=1e-5).item()


def test_model_outside_the_llama_family_runs_unfused_and_exact():
    from mlx_lm.models import qwen3

    mx.random.seed(0)
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=97,
        num_key_value_heads=2,
        max_position_embeddings=512,
        head_dim=8,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    fast = BucketedForward(model, bucket=16)
    assert fast.fused is None  # q/k norms: not the shape the fused decoder computes
    cache, plain = make_prompt_cache(model), make_prompt_cache(model)
    fast.prefill(cache, [3, 1, 4, 1, 5])
    model(mx.array([[3, 1, 4, 1, 5]]), cache=plain)
    step = mx.array([[7, 8, 9]])
    assert mx.allclose(fast.logits(cache, step), model(step, cache=plain), atol=1e-5).item()


def test_fused_decoder_that_disagrees_with_the_model_is_dropped(monkeypatch):
    from models.forward import bucketed

    model = _fresh_llama(seed=4)
    real_call = bucketed._FusedDecoder.__call__
    monkeypatch.setattr(
        bucketed._FusedDecoder, "__call__", lambda self, tokens, cache: real_call(self, tokens, cache) * 1.5
    )
    assert BucketedForward(model, bucket=16).fused is None
    cache, plain = make_prompt_cache(model), make_prompt_cache(model)
    step = mx.array([[7, 8, 9]])
    fast = BucketedForward(model, bucket=16)
    fast.prefill(cache, [1, 2])
    model(mx.array([[1, 2]]), cache=plain)
    assert mx.allclose(fast.logits(cache, step), model(step, cache=plain), atol=1e-5).item()


def test_sampled_fast_session_equals_the_plain_session(loaded, prompt_ids):
    """At temperature > 0 the compiled verify samples the draft model's drafts and
    accepts them by rejection sampling from the same seeded draws as the plain path (the
    two forwards agree to float rounding): same streams, drafts accepted."""
    draft = loaded[1].model
    accepted = 0
    for i in (0, 5, 9):
        req = make_request(f"r{i}", prompt_ids[i], MAX_TOKENS, temperature=0.8, top_k=40, seed=i)
        want = _run_fast(loaded, req, 3, DraftModelDrafter(draft, "d"), fast=False)[0]
        for fast in (None, BucketedForward(draft, 16, prefill_chunk=4)):
            out, _, a = _run_fast(loaded, req, 3, DraftModelDrafter(draft, "d", fast=fast))
            assert out == want, (i, fast)
            accepted += a
    assert accepted > 0
