"""Quantized weights, dequantized once at load (`dense_weights`, on by default on a CUDA GPU).

MLX CUDA's quantized matmul is fast for one token and slow for many: on the H200, at the
Qwen2.5-1.5B shape (4-bit, random weights, `scripts/experiments/gpu_prefill.py`), a step
of 32 rows took 26 ms with the 4-bit weights and 8.7 ms with the same weights as bf16
(cuBLAS), a prefill forward of 8 x 512 tokens 88 ms against 31, and one row's step 5.4
against 5.1 ms. So on a CUDA GPU every quantized layer becomes a plain one holding its
dequantized weights: the same values the quantized kernels compute with, at twice the
memory of bf16 weights instead of about a quarter. On Apple silicon and on a CPU the
quantized kernels are the fast ones, and the model stays as loaded.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)


def wanted(setting: bool | None) -> bool:
    """Whether to dequantize: `setting` when given, else whether MLX runs on a CUDA GPU."""
    if setting is not None:
        return setting
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def _dense(layer: nn.Module) -> mx.array:
    scales = layer["scales"]
    weight = mx.dequantize(layer["weight"], scales, layer.get("biases"), layer.group_size, layer.bits,
                           mode=getattr(layer, "mode", "affine"))
    return weight.astype(scales.dtype if mx.issubdtype(scales.dtype, mx.floating) else mx.bfloat16)


def dequantize(model: nn.Module) -> int:
    """Replace every `QuantizedLinear` and `QuantizedEmbedding` of `model` by a plain
    `Linear` / `Embedding` holding the dequantized weights, in place (a tied output head,
    `Embedding.as_linear`, follows). Returns the number of layers replaced."""
    count = 0
    for _, module in model.named_modules():
        for name, child in list(module.children().items()):
            if isinstance(child, nn.QuantizedLinear):
                weight = _dense(child)
                dense = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in child)
                dense.weight = weight
                if "bias" in child:
                    dense.bias = child["bias"]
            elif isinstance(child, nn.QuantizedEmbedding):
                weight = _dense(child)
                dense = nn.Embedding(weight.shape[0], weight.shape[1])
                dense.weight = weight
            else:
                continue
            mx.eval(dense.parameters())  # one layer at a time: peak memory stays near the result
            setattr(module, name, dense)
            count += 1
    return count


def apply(model: nn.Module, name: str, setting: bool | None) -> int:
    """Dequantize `model` when `wanted(setting)`, logging what it cost; returns the layers
    replaced (0: left as loaded, or nothing was quantized)."""
    if not wanted(setting):
        return 0
    before = _nbytes(model)
    count = dequantize(model)
    if count:
        log.info("%s: %d quantized layers dequantized (dense_weights): %.2f GB -> %.2f GB of weights",
                 name, count, before / 1e9, _nbytes(model) / 1e9)
    return count


def _nbytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
