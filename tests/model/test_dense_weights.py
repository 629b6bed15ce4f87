"""`models.loading.dense_weights`: a quantized model's layers served dequantized (the default on a
CPU and on a CUDA GPU)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from models.loading import dense_weights
from models.tiny import random_model, tiny_args


def _quantized(tie: bool, bias: bool = False):
    args = tiny_args(vocab_size=256, hidden=128)
    args.tie_word_embeddings = tie
    args.attention_bias = bias
    model = random_model(args, seed=3, embed_scale=4.0, out_scale=0.5)
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("tie,bias", [(True, False), (False, True)])
def test_dequantized_model_computes_what_the_quantized_one_does(tie, bias):
    model = _quantized(tie, bias)
    tokens = mx.array([[5, 17, 42, 9, 100, 3, 77, 1]])
    expected = model(tokens)
    quantized = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert dense_weights.dequantize(model) == quantized > 0
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    assert not any(k.endswith(("scales", "biases")) for k, _ in tree_flatten(model.parameters()))
    got = model(tokens)
    assert got.dtype == expected.dtype
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
    assert (mx.argmax(got, -1) == mx.argmax(expected, -1)).all().item()


def test_a_dense_model_is_left_alone():
    model = random_model(tiny_args(vocab_size=64), seed=0, embed_scale=1.0, out_scale=1.0)
    assert dense_weights.apply(model, "tiny", True) == 0


def test_default_is_a_cpu_or_cuda_gpu_with_room_for_the_dense_weights(monkeypatch):
    assert dense_weights.wanted(True) and not dense_weights.wanted(False)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert dense_weights.wanted(None, 0, 100) == (on_cuda or mx.default_device() == mx.cpu)
    if mx.default_device() == mx.cpu:
        assert dense_weights.wanted(None, 50, 100) and not dense_weights.wanted(None, 51, 100)
    monkeypatch.setattr(dense_weights, "on_cuda", lambda: True)
    assert dense_weights.wanted(None, 50, 100) and not dense_weights.wanted(None, 51, 100)
    assert dense_weights.wanted(True, 51, 100)  # asked for: wherever


@pytest.mark.parametrize("tie", [True, False])
def test_growth_is_what_dequantizing_adds(tie):
    model = _quantized(tie, bias=True)
    before = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    extra = dense_weights.growth(model)
    assert extra > 0
    dense_weights.dequantize(model)
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == before + extra
    assert dense_weights.growth(model) == 0


def test_from_paths_applies_the_knob(tiny_pair, tmp_path):
    from models.runner import MlxRunner
    from models.tiny import save_model

    model = _quantized(tie=False)
    args = tiny_args(vocab_size=256, hidden=128)
    save_model(model, args, tiny_pair[0], str(tmp_path / "q"))
    import json

    config_path = tmp_path / "q" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization"] = {"group_size": 64, "bits": 4}
    config["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config))
    kept = MlxRunner.from_paths(str(tmp_path / "q"), drafter_kind="ngram", dense_weights=False)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in kept.target.model.named_modules())
    dense = MlxRunner.from_paths(str(tmp_path / "q"), drafter_kind="ngram", dense_weights=True)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dense.target.model.named_modules())
    if mx.default_device() == mx.cpu:  # the default there: float32 layers, whatever the scales were
        default = MlxRunner.from_paths(str(tmp_path / "q"), drafter_kind="ngram")
        weights = [m.weight for _, m in default.target.model.named_modules() if isinstance(m, nn.Linear)]
        assert weights and all(w.dtype == mx.float32 for w in weights)
