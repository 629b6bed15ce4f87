"""Quantized weights, dequantized once at load (`dense_weights`, on by default on a CPU and
on a CUDA GPU where the memory allows).

On a CPU, MLX's quantized matmul is far slower than a float32 one through OpenBLAS
(docs/models.md, "GGUF files"), so quantized layers become float32 ones
(`models.loading.loader` has cast the scales to float32 already). On a CUDA GPU, MLX's
quantized matmul is fast for one token and slow for many (docs/gpu.md, "What runs by
default"), so they become plain layers in the scales' dtype. Either way by default only
while the growth fits in half the memory available. On Apple silicon the quantized kernels
are the fast ones: the model stays as loaded.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from models.batch.prefix_cache import available_memory
from models.platform.device_memory import on_cuda

log = logging.getLogger(__name__)


MAX_SHARE = 0.5  # by default, the weights grow by at most this share of the memory available


def wanted(setting: bool | None, extra_bytes: int = 0, available_bytes: int | None = None) -> bool:
    """Whether to dequantize: `setting` when given, else on a CUDA GPU when the weights'
    growth (`extra_bytes`) fits in `MAX_SHARE` of the memory available
    (`prefix_cache.available_memory()` unless given)."""
    if setting is not None:
        return setting
    if not on_cuda() and mx.default_device() != mx.cpu:
        return False
    if available_bytes is None:
        available_bytes = available_memory()
    return extra_bytes <= MAX_SHARE * available_bytes


def _quantized(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]


def growth(model: nn.Module) -> int:
    """Bytes the model's weights would grow by, dequantized."""
    extra = 0
    for layer in _quantized(model):
        weight, scales = layer["weight"], layer["scales"]
        columns = weight.shape[-1] * 32 // layer.bits
        extra += weight.shape[0] * columns * _dense_dtype(layer).size - weight.nbytes - scales.nbytes
        extra -= layer["biases"].nbytes if "biases" in layer else 0
    return extra


def _dense_dtype(layer: nn.Module) -> mx.Dtype:
    """The dtype a quantized layer's weights take dequantized: its scales' (the model's
    float dtype), bf16 where the scales are not floats."""
    scales = layer["scales"]
    return scales.dtype if mx.issubdtype(scales.dtype, mx.floating) else mx.bfloat16


def _dense(layer: nn.Module) -> mx.array:
    weight = mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        layer.group_size,
        layer.bits,
        mode=getattr(layer, "mode", "affine"),
    )
    return weight.astype(_dense_dtype(layer))


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
    extra = growth(model) if setting is None else 0
    layers = _quantized(model)
    if not wanted(setting, extra):
        if layers:
            why = (
                (
                    f"dequantized, the weights would grow by {extra / 1e9:.2f} GB, over "
                    f"{MAX_SHARE * 100:.0f} % of the memory available"
                )
                if setting is None and extra
                else ("dense_weights is false" if setting is False else "the quantized kernels are the fast ones here")
            )
            log.info("%s: %d quantized layers kept quantized (%s)", name, len(layers), why)
        return 0
    before = _nbytes(model)
    count = dequantize(model)
    if count:
        dtype = _dtype_name(model)
        log.info(
            "%s: %d quantized layers dequantized to %s on the %s (dense_weights): %.2f GB -> %.2f GB of weights",
            name,
            count,
            dtype,
            "GPU" if on_cuda() else "CPU",
            before / 1e9,
            _nbytes(model) / 1e9,
        )
    return count


def _dtype_name(model: nn.Module) -> str:
    dtypes = {
        str(v.dtype).removeprefix("mlx.core.")
        for _, v in tree_flatten(model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    }
    return "/".join(sorted(dtypes))


def _nbytes(model: nn.Module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
