"""The packed forward (models.forward.ragged): one forward for a decode batch plus a verify row
gives each group what its own forward gives, and leaves each cache as its own forward
would; families it cannot serve are detected at load."""

import mlx.core as mx
import pytest
from mlx_lm.models import gemma2, gemma3_text, qwen2
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from models.forward import ragged
from models.tiny import random_model, tiny_args

pytestmark = pytest.mark.model

ATOL = 1e-4


def _llama(tied: bool, seed: int = 0):
    args = tiny_args(vocab_size=256, num_layers=2, hidden=64)
    args.tie_word_embeddings = tied
    return random_model(args, seed=seed, embed_scale=3.0, out_scale=0.5)


def _qwen2():
    mx.random.seed(3)
    model = qwen2.Model(
        qwen2.ModelArgs(
            model_type="qwen2",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            vocab_size=256,
            tie_word_embeddings=True,
        )
    )
    mx.eval(model.parameters())
    return model


def _prefilled(model, prompt):
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _batch(caches):
    return [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]


PROMPTS = [list(range(3, 40)), list(range(50, 61)), list(range(70, 143)), list(range(5, 9))]


@pytest.mark.parametrize(
    "make_model",
    [lambda: _llama(False), lambda: _llama(True), _qwen2],
    ids=["llama-untied", "llama-tied", "qwen2-bias"],
)
@pytest.mark.parametrize("num_verify", [1, 2, 4, 5, 7])  # K = 0, 1, 3, 4, 6
@pytest.mark.parametrize("num_rows", [1, 3])
def test_packed_forward_matches_separate_forwards(make_model, num_verify, num_rows):
    model = make_model()
    rows = PROMPTS[:num_rows]
    verify_prompt = PROMPTS[3 if num_rows == 1 else 2]
    step = mx.array([11 + i for i in range(num_rows)])
    verify = mx.array([20 + i for i in range(num_verify)])

    def fresh_batch():
        caches = [_prefilled(model, p) for p in rows]
        return caches[0] if num_rows == 1 else _batch(caches)  # a lone row keeps a plain KVCache

    alone_cache, alone_verify_cache = fresh_batch(), _prefilled(model, verify_prompt)
    alone = model(step[:, None], cache=alone_cache)[:, 0, :]
    alone_verify = model(verify[None], cache=alone_verify_cache)[0]

    packed_cache, packed_verify_cache = fresh_batch(), _prefilled(model, verify_prompt)
    packed, packed_verify = ragged.packed_forward(
        model, [ragged.Group(packed_cache, step), ragged.Group(packed_verify_cache, verify)]
    )
    assert mx.abs(packed - alone).max().item() < ATOL
    assert mx.abs(packed_verify - alone_verify).max().item() < ATOL
    assert (mx.argmax(packed_verify, -1) == mx.argmax(alone_verify, -1)).all().item()
    # The caches now hold the same entries: a following plain step agrees too.
    for a, b in zip(alone_cache + alone_verify_cache, packed_cache + packed_verify_cache):
        assert a.offset.tolist() == b.offset.tolist() if isinstance(a.offset, mx.array) else a.offset == b.offset
    nxt = mx.array([[30]] * num_rows)
    assert mx.abs(model(nxt, cache=alone_cache) - model(nxt, cache=packed_cache)).max().item() < ATOL
    one = mx.array([[31]])
    assert mx.abs(model(one, cache=alone_verify_cache) - model(one, cache=packed_verify_cache)).max().item() < ATOL


def test_rider_carries_a_verify_through_a_models_own_call():
    model = _llama(False)
    verify_cache = _prefilled(model, PROMPTS[2])
    rider = ragged.Rider(model, ragged.Group(verify_cache, mx.array([1, 2, 3])))
    batch_cache = _batch([_prefilled(model, p) for p in PROMPTS[:2]])
    out = rider(mx.array([[4], [5]]), cache=batch_cache)
    assert out.shape == (2, 1, 256) and rider.extra_logits.shape == (3, 256)
    with pytest.raises(RuntimeError):
        rider(mx.array([[4], [5]]), cache=batch_cache)


def refused_models():
    """(sliding-window gemma3_text, gemma2): tiny models the packed forwards refuse. gemma2
    keeps plain caches but computes attention itself (logit soft-capping)."""
    mx.random.seed(0)
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=256,
        num_key_value_heads=2,
        query_pre_attn_scalar=16.0,
    )
    sliding = gemma3_text.Model(
        gemma3_text.ModelArgs(model_type="gemma3_text", sliding_window=8, sliding_window_pattern=2, **common)
    )
    softcapped = gemma2.Model(gemma2.ModelArgs(model_type="gemma2", **common))
    mx.eval(softcapped.parameters())
    return sliding, softcapped


def test_the_load_check_accepts_plain_families_and_refuses_the_others():
    assert ragged.check_support(_llama(True)) is None
    assert ragged.check_support(_qwen2()) is None
    sliding, softcapped = refused_models()
    reason = ragged.check_support(sliding)
    assert reason is not None and "KVCache" in reason
    reason = ragged.check_support(softcapped)
    assert reason is not None and "packed forward" in reason


def test_other_attention_calls_pass_through_unchanged():
    """The hook only takes packed calls: a quantized KV cache still gets mlx-lm's own path."""
    import mlx_lm.models.base as mlx_base

    class QuantizedCacheLike:
        bits, group_size = 8, 32

    q = mx.random.normal((1, 4, 1, 32))
    qk = mx.quantize(mx.random.normal((1, 2, 5, 32)), group_size=32, bits=8)
    qv = mx.quantize(mx.random.normal((1, 2, 5, 32)), group_size=32, bits=8)
    # (mlx-lm scales the queries in place: each call gets its own copy)
    ours = mlx_base.scaled_dot_product_attention(q + 0, qk, qv, cache=QuantizedCacheLike(), scale=0.25, mask=None)
    theirs = ragged._MLX_QUANTIZED_SDPA(q + 0, qk, qv, scale=0.25, mask=None, group_size=32, bits=8)
    assert mlx_base.quantized_scaled_dot_product_attention is ragged._attention
    assert mx.array_equal(ours, theirs)
