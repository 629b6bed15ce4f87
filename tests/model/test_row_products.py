"""`models.loading.row_products`: a few tokens' products as batched one-row products
(`matvec_tokens`; on by default on a CUDA GPU, forced here on the CPU, float32). The GPU
timing is `scripts/experiments/gpu_batched_matvec.py`'s; here: same results, every layer
reached, off where it should be."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models.forward.slab import Slab
from models.loading import fused_projections, row_products
from models.runner_config import RunnerConfig
from models.tiny import random_model, tiny_args


def _model(seed: int = 3, bias: bool = False, tied: bool = True):
    args = tiny_args(vocab_size=256, hidden=128)
    args.attention_bias = bias
    args.tie_word_embeddings = tied
    model = random_model(args, seed=seed, embed_scale=4.0, out_scale=0.5)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (2, 3, 64), (3, 1, 64), (9, 64)])
def test_products_equal_the_plain_product(shape):
    weight = mx.random.normal((48, 64), key=mx.random.key(1))
    x = mx.random.normal(shape, key=mx.random.key(2))
    got = row_products.products(x, weight, 8)
    assert got.shape == (*shape[:-1], 48)
    assert mx.allclose(got, x @ weight.T, atol=1e-5, rtol=1e-5).item()


def test_products_take_a_noncontiguous_input():
    weight = mx.random.normal((48, 64), key=mx.random.key(1))
    x = mx.random.normal((64, 3), key=mx.random.key(2)).T  # (3, 64), transposed strides
    assert mx.allclose(row_products.products(x, weight, 8), x @ weight.T, atol=1e-5, rtol=1e-5).item()


def _forwards(model):
    """A prompt's logits, then 2, 3 and 1 tokens over its cache."""
    cache = make_prompt_cache(model)
    outs = [model(mx.array([[5, 17, 42, 9, 100, 3, 77, 1]]), cache=cache)]
    for step in ([8, 250], [4, 5, 6], [7]):
        outs.append(model(mx.array([step]), cache=cache))
    return mx.concatenate(outs, axis=1)


@pytest.mark.parametrize(("bias", "tied", "fused"), [(False, True, False), (True, False, False), (False, True, True)])
def test_a_converted_model_computes_what_it_did(bias, tied, fused):
    model = _model(bias=bias, tied=tied)
    if fused:
        assert fused_projections.fuse(model)
    expected = _forwards(model)
    count = row_products.convert(model, 8)
    layers = len(model.model.layers)
    # per layer: q, k, v, o, gate, up, down, or (fused) o, down and the two groups' matmuls;
    # then the embedding (the tied head), and an untied head of its own
    assert count == layers * (4 if fused else 7) + 1 + (not tied)
    kinds = {type(m) for _, m in model.named_modules()}
    assert nn.Linear not in kinds and nn.Embedding not in kinds
    assert mx.allclose(_forwards(model), expected, atol=1e-4, rtol=1e-4).item()
    assert row_products.convert(model, 8) == 0  # a second call changes nothing


def test_the_slab_forward_is_unchanged():
    plain, rows_model = _model(seed=7), _model(seed=7)
    row_products.convert(rows_model, 8)
    outs = []
    for model in (plain, rows_model):
        slab = Slab(model, rows=4, grid=False)
        rows = [slab.add() for _ in range(3)]
        prompts = [[(i * 31 + j) % 250 + 3 for j in range(20 + 7 * i)] for i in range(3)]
        first = slab.forward(model, [(row, p) for row, p in zip(rows, prompts)], last_only=True)
        step = slab.forward(model, [(rows[0], [4]), (rows[1], [5, 6, 7]), (rows[2], [8])])
        outs.append(mx.concatenate([*first, *[s.reshape(-1, s.shape[-1]) for s in step]]))
    assert mx.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-4).item()


def test_off_on_a_cpu_by_default_and_when_asked():
    assert RunnerConfig().matvec_tokens is None
    assert row_products.wanted(None) == 0  # the tests run on a CPU
    assert row_products.wanted(4) == 4
    model = _model()
    assert row_products.apply(model, "tiny", None) == 0
    assert row_products.apply(model, "tiny", 1) == 0
    assert {type(m) for _, m in model.named_modules()} >= {nn.Linear, nn.Embedding}
    assert row_products.apply(model, "tiny", 4) > 0
