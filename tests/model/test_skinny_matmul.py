"""`models.skinny_matmul`: which calls take the few-token CUDA kernel, and what the layer
hands it. The kernel itself needs a CUDA GPU (scripts/experiments/gpu_skinny.py checks
it against a float32 reference there); here a reference stands in for it."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from models import skinny_matmul
from models.tiny import random_model, tiny_args


class FakeKernel:
    """What `mx.fast.cuda_kernel` returns, computing the kernel's contract in float32."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        x, w, bias = inputs
        self.calls.append({"shapes": [a.shape for a in inputs], "template": dict(template), "grid": grid,
                           "threadgroup": threadgroup, "out": output_shapes[0]})
        assert x.ndim == 2 and output_shapes[0] == (x.shape[0], w.shape[0])
        y = x.astype(mx.float32) @ w.astype(mx.float32).T + bias.astype(mx.float32)
        return [y.astype(output_dtypes[0])]


@pytest.fixture
def kernel(monkeypatch):
    fake = FakeKernel()
    monkeypatch.setattr(skinny_matmul, "_kernel", lambda: fake)
    monkeypatch.setattr(skinny_matmul, "on_cuda", lambda: True)
    return fake


def _linear(k=64, m=48, bias=True, dtype=mx.bfloat16):
    layer = nn.Linear(k, m, bias=bias)
    layer.set_dtype(dtype)
    return layer


def test_nothing_changes_off_a_cuda_gpu():
    layer = _linear()
    assert skinny_matmul.apply(layer, "tiny", None) == 0 and type(layer) is nn.Linear


@pytest.mark.parametrize("shape,taken", [((1, 64), False), ((2, 64), True), ((4, 1, 64), True), ((8, 64), True),
                                         ((9, 64), False), ((2, 4, 64), True), ((3, 4, 64), False), ((1, 300, 64), False)])
def test_two_to_max_tokens_take_it(kernel, shape, taken):
    assert skinny_matmul.MAX_TOKENS == 8
    assert skinny_matmul.takes(mx.ones(shape, mx.bfloat16), _linear().weight) == taken


def test_other_dtypes_and_inner_sizes_keep_the_matmul(kernel):
    assert not skinny_matmul.eligible(_linear(dtype=mx.float32).weight)
    assert not skinny_matmul.eligible(_linear(k=60).weight)
    assert skinny_matmul.eligible(_linear(dtype=mx.float16).weight) and skinny_matmul.eligible(_linear().weight)
    assert not skinny_matmul.takes(mx.ones((4, 64), mx.float32), _linear().weight)  # mixed
    layers = [_linear(dtype=mx.float32), _linear(k=60), _linear(dtype=mx.float16)]
    assert [skinny_matmul.install(layer) for layer in layers] == [0, 0, 1]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 64), (4, 1, 64), (2, 3, 64)])
def test_the_layer_computes_what_linear_does(kernel, bias, shape):
    layer = _linear(bias=bias)
    x = mx.random.normal(shape, key=mx.random.key(1)).astype(mx.bfloat16)
    expected = layer(x)
    assert skinny_matmul.install(layer) == 1 and isinstance(layer, skinny_matmul.SkinnyLinear)
    got = layer(x)
    assert got.shape == expected.shape == shape[:-1] + (48,) and got.dtype == mx.bfloat16
    assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), atol=2e-2, rtol=2e-2).item()
    (call,) = kernel.calls
    n = x.size // 64
    assert call["shapes"] == [(n, 64), (48, 64), (48,)]
    assert call["template"] == {"T": mx.bfloat16, "NB": skinny_matmul.bucket(n), "ROWS": skinny_matmul.ROWS,
                                "BLOCK": skinny_matmul.BLOCK}
    # one block (grid counts threads) per ROWS output features
    block = skinny_matmul.BLOCK
    assert call["grid"] == (-(-48 // skinny_matmul.ROWS) * block, 1, 1) and call["threadgroup"] == (block, 1, 1)


def test_longer_inputs_go_to_linear(kernel):
    layer = _linear()
    skinny_matmul.install(layer)
    x = mx.ones((1, 40, 64), mx.bfloat16)
    layer(x)
    layer(x[:, :1])
    assert kernel.calls == []


def test_install_turns_every_plain_linear_and_only_those(kernel):
    model = random_model(tiny_args(vocab_size=64), seed=0, embed_scale=1.0, out_scale=1.0)
    model.set_dtype(mx.bfloat16)
    plain = [m for _, m in model.named_modules() if type(m) is nn.Linear]
    tokens = mx.array([[5, 17], [9, 3]])
    expected = model(tokens)
    assert skinny_matmul.apply(model, "tiny", None) == len(plain) > 0
    assert {c["template"]["NB"] for c in kernel.calls} == {2, 4, 8}  # every bucket built at load
    kernel.calls.clear()
    assert all(type(m) is skinny_matmul.SkinnyLinear for m in plain)
    assert skinny_matmul.install(model) == 0  # already done
    got = model(tokens)
    assert len(kernel.calls) >= len(plain)  # (2, 2) tokens: 4 a call
    assert (mx.argmax(got, -1) == mx.argmax(expected, -1)).all().item()
    assert skinny_matmul.apply(random_model(tiny_args(vocab_size=64), seed=0, embed_scale=1.0, out_scale=1.0),
                               "tiny", False) == 0


def test_bucket_bounds():
    with pytest.raises(ValueError):
        skinny_matmul.bucket(33)
