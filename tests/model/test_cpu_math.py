"""models.platform.cpu_math: the CPU's softmax and SiLU (numpy for prompt-sized inputs, MLX's fast
primitives otherwise and inside `mx.compile`), against MLX's own kernels and float64 numpy."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from models.platform import cpu_math

MLX_SDPA = cpu_math._MLX_SDPA


def test_exp_matches_float64_over_the_float32_range():
    """As accurate as MLX's own `exp`: the float32 input's rounding, scaled by |x|."""
    x = np.linspace(-87, 88.7, 200001).astype(np.float32)
    want = np.exp(x.astype(np.float64))
    got = np.array(cpu_math.exp(mx.array(x)), dtype=np.float64)
    assert np.max(np.abs(got - want) / want / (1 + np.abs(x))) < 1.5e-7
    # Outside float32's normal range the result is clamped there: positive and finite.
    edges = np.array(cpu_math.exp(mx.array([-mx.inf, -1e30, -100.0, 100.0, 1e30, mx.inf])), dtype=np.float64)
    assert np.all(np.isfinite(edges)) and np.all(edges > 0)
    assert edges[0] < 2e-38 and edges[-1] > 3e38


def test_softmax_and_swiglu_match_mlx():
    x = mx.random.normal((3, 5, 300), key=mx.random.key(0)) * 8
    x = mx.where(mx.random.uniform(shape=x.shape, key=mx.random.key(1)) < 0.2, -mx.inf, x)
    got, want = cpu_math.softmax(x), mx.softmax(x, axis=-1, precise=True)
    assert mx.max(mx.abs(got - want)).item() < 1e-6
    assert mx.max(mx.abs(mx.sum(got, axis=-1) - 1)).item() < 1e-6
    gate, up = (mx.random.normal((7, 768), key=mx.random.key(k)) * 6 for k in (2, 3))
    assert mx.allclose(cpu_math.swiglu(gate, up), nn.silu(gate) * up, rtol=1e-5, atol=1e-6)
    # Half precision keeps mlx-lm's own (the polynomial is for float32).
    half_gate, half_up = gate.astype(mx.bfloat16), up.astype(mx.bfloat16)
    assert mx.array_equal(cpu_math.swiglu(half_gate, half_up), nn.silu(half_gate) * half_up)


def test_row_logsumexp_and_softmax_match_mlx_once_installed(monkeypatch):
    """The samplers' normalisation: MLX's before `install` (and for half precision),
    `exp`'s after it, equal within float32 rounding; a filtered (-inf) token gets
    probability exactly 0, a row of only -inf stays -inf."""
    x = mx.random.normal((4, 3000), key=mx.random.key(5)) * 6
    x = mx.where(mx.random.uniform(shape=x.shape, key=mx.random.key(6)) < 0.3, -mx.inf, x)
    x = mx.concatenate([x, mx.full((1, 3000), -mx.inf)])
    monkeypatch.setattr(cpu_math, "_installed", False)
    assert mx.array_equal(cpu_math.row_logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True))
    monkeypatch.setattr(cpu_math, "_installed", True)
    got, want = cpu_math.row_logsumexp(x), mx.logsumexp(x, axis=-1, keepdims=True)
    assert mx.max(mx.abs(got[:4] - want[:4])).item() < 1e-5 and got[4].item() == -mx.inf
    probs = cpu_math.row_softmax(x[:4])
    assert mx.max(mx.abs(probs - mx.softmax(x[:4], axis=-1, precise=True))).item() < 1e-6
    assert mx.all(mx.where(x[:4] == -mx.inf, probs == 0, True)).item()
    half = x[:4].astype(mx.bfloat16)
    assert mx.array_equal(cpu_math.row_softmax(half), mx.softmax(half, axis=-1))


def test_prompt_sized_swiglu_runs_in_numpy_and_matches():
    """From NUMPY_ELEMENTS elements the SiLU is numpy's; traced (mx.compile), the polynomial's."""
    gate, up = (mx.random.normal((cpu_math.NUMPY_ELEMENTS // 768 + 1, 768), key=mx.random.key(k)) * 6 for k in (4, 5))
    want = nn.silu(gate) * up
    assert gate.size >= cpu_math.NUMPY_ELEMENTS
    assert mx.allclose(cpu_math.swiglu(gate, up), want, rtol=1e-5, atol=1e-6)
    assert mx.allclose(mx.compile(cpu_math.swiglu)(gate, up), want, rtol=1e-5, atol=1e-6)
    edge = mx.array([[-100.0, -88.0, 0.0, 88.0, 100.0] * 8000])
    assert mx.allclose(cpu_math.swiglu(edge, mx.ones_like(edge)), nn.silu(edge), rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("mask", ["causal", None, "bool"])
def test_attention_traced_stays_in_mlx_and_matches(monkeypatch, mask):
    """Inside mx.compile nothing may be evaluated: the softmax falls back to MLX ops."""
    monkeypatch.setattr(cpu_math, "MIN_SCORES", 0)
    q, k, v = _qkv(40, 60, 4, 2)
    if mask == "bool":
        mask = mx.random.uniform(shape=(40, 60), key=mx.random.key(9)) < 0.7
        mask[:, 0] = True
    compiled = mx.compile(lambda q, k, v: cpu_math.attention(q, k, v, scale=0.2, mask=mask))
    want = MLX_SDPA(q, k, v, scale=0.2, mask=mask)
    assert mx.max(mx.abs(compiled(q, k, v) - want)).item() < 2e-6
    assert mx.max(mx.abs(cpu_math.attention(q, k, v, scale=0.2, mask=mask) - want)).item() < 2e-6


def _qkv(n, t, heads, kv_heads, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    return (
        mx.random.normal((2, heads, n, 32), key=keys[0]),
        mx.random.normal((2, kv_heads, t, 32), key=keys[1]),
        mx.random.normal((2, kv_heads, t, 32), key=keys[2]),
    )


@pytest.mark.parametrize("n,t,heads,kv_heads", [(5, 5, 4, 4), (7, 40, 4, 4), (33, 33, 8, 2), (6, 90, 6, 3)])
@pytest.mark.parametrize("mask", ["causal", None, "bool", "additive"])
@pytest.mark.parametrize("block", [cpu_math.BLOCK_SCORES, 64])
def test_attention_matches_mlx(monkeypatch, n, t, heads, kv_heads, mask, block):
    """Every mask form it takes, grouped queries, queries fewer than keys, and small
    blocks (several per call: each reads its own keys and rows of the mask)."""
    monkeypatch.setattr(cpu_math, "BLOCK_SCORES", block)
    monkeypatch.setattr(cpu_math, "MIN_SCORES", 0)  # these small shapes take cpu_math's path too
    q, k, v = _qkv(n, t, heads, kv_heads)
    if mask == "bool":
        mask = mx.random.uniform(shape=(n, t), key=mx.random.key(9)) < 0.7
        mask[:, 0] = True  # no row without a key
    elif mask == "additive":
        mask = mx.random.normal((n, t), key=mx.random.key(9))
    got = cpu_math.attention(q, k, v, scale=0.2, mask=mask)
    want = MLX_SDPA(q, k, v, scale=0.2, mask=mask)
    assert got.shape == want.shape
    assert mx.max(mx.abs(got - want)).item() < 2e-6


def test_attention_leaves_other_calls_to_mlx(monkeypatch):
    """One query (a decode step), a small call, half precision, sinks and 4-D masks go
    to MLX's kernel: the same result bit for bit."""
    q, k, v = _qkv(1, 20, 4, 4)
    assert mx.array_equal(cpu_math.attention(q, k, v, scale=0.3), MLX_SDPA(q, k, v, scale=0.3))
    q, k, v = _qkv(5, 200, 4, 4)  # 4,000 scores
    assert mx.array_equal(
        cpu_math.attention(q, k, v, scale=0.3, mask="causal"), MLX_SDPA(q, k, v, scale=0.3, mask="causal")
    )
    monkeypatch.setattr(cpu_math, "MIN_SCORES", 0)
    q2, k2, v2 = (a.astype(mx.float16) for a in _qkv(6, 20, 4, 4))
    assert mx.array_equal(
        cpu_math.attention(q2, k2, v2, scale=0.3, mask="causal"), MLX_SDPA(q2, k2, v2, scale=0.3, mask="causal")
    )
    q3, k3, v3 = _qkv(6, 20, 4, 4)
    mask4 = mx.ones((2, 1, 6, 20), dtype=mx.bool_)
    assert mx.array_equal(
        cpu_math.attention(q3, k3, v3, scale=0.3, mask=mask4), MLX_SDPA(q3, k3, v3, scale=0.3, mask=mask4)
    )
    sinks = mx.zeros((4,))
    assert mx.array_equal(
        cpu_math.attention(q3, k3, v3, scale=0.3, mask="causal", sinks=sinks),
        MLX_SDPA(q3, k3, v3, scale=0.3, mask="causal", sinks=sinks),
    )


def test_install_replaces_both_process_wide_on_a_cpu():
    import platform

    from mlx_lm.models import activations, llama, qwen2

    # CI and the development machine: x86-64, MLX on the CPU
    assert mx.default_device() == mx.cpu and platform.machine() == "x86_64"
    assert cpu_math.install() and cpu_math.install()  # idempotent
    assert mx.fast.scaled_dot_product_attention is cpu_math.attention
    assert activations.swiglu is cpu_math.swiglu
    assert llama.swiglu is cpu_math.swiglu and qwen2.swiglu is cpu_math.swiglu


def test_install_leaves_other_machines_alone(monkeypatch):
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_math.install() is False
