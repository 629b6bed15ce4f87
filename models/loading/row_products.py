"""A few tokens' products as batched matrix-vector products (`matvec_tokens`, on a CUDA GPU).

MLX CUDA multiplies one token by a weight matrix in its own matrix-vector kernel and sends
two or more to cuBLAS, whose small products cost several times one token's: a forward of
three tokens took 1.7x one token's on SmolLM2 (docs/gpu.md, "Known issues"). Here a layer
given 2 to `matvec_tokens` tokens multiplies each as a batch of one-row products. The rows
are laid out as a transposed view (shape (n, 1, k), strides (k, 1, 1)): a contiguous
(n, 1, k) batch against a shared weight is folded back into one n-row product for cuBLAS,
a transposed one is not, and a one-row product against a transposed weight is the
matrix-vector kernel's case. Every token still meets the same weights with float32
accumulation: the results match the plain product up to rounding.

Plain `nn.Linear` layers (a fused projection group's matmul included) and a tied output
head (`nn.Embedding.as_linear`); quantized layers are left as they are.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from models.platform.device_memory import on_cuda
from models.runner_config import MATVEC_TOKENS_GPU as DEFAULT_TOKENS

log = logging.getLogger(__name__)


def products(x: mx.array, weight: mx.array, limit: int) -> mx.array:
    """`x @ weight.T`; for 2 to `limit` tokens as one-row products (module docstring)."""
    k = x.shape[-1]
    n = x.size // k
    if n < 2 or n > limit:
        return x @ weight.T
    rows = x.reshape(n, k, 1).swapaxes(1, 2)  # (n, 1, k), strides (k, 1, 1)
    return (rows @ weight.T).reshape(*x.shape[:-1], weight.shape[0])


class RowLinear(nn.Linear):
    """`nn.Linear` through `products` (its `_limit` set by `apply`)."""

    _limit = DEFAULT_TOKENS

    def __call__(self, x: mx.array) -> mx.array:
        out = products(x, self["weight"], self._limit)
        return out + self["bias"] if "bias" in self else out


class RowEmbedding(nn.Embedding):
    """`nn.Embedding` whose `as_linear` (a tied output head) goes through `products`."""

    _limit = DEFAULT_TOKENS

    def as_linear(self, x: mx.array) -> mx.array:
        return products(x, self.weight, self._limit)


def wanted(setting: int | None) -> int:
    """The token limit: `setting` when given, else `DEFAULT_TOKENS` on a CUDA GPU, 0 elsewhere."""
    if setting is not None:
        return setting
    return DEFAULT_TOKENS if on_cuda() else 0


def _swap(layer: nn.Module, limit: int) -> bool:
    kind = {nn.Linear: RowLinear, nn.Embedding: RowEmbedding}.get(type(layer))
    if kind is None:
        return False
    layer.__class__ = kind  # same fields; only the call changes
    layer._limit = limit
    return True


def convert(model: nn.Module, limit: int) -> int:
    """Route `model`'s plain linear layers and embeddings through `products` (in place; a
    fused projection group's matmul too). Returns the layers converted."""
    from models.loading.fused_projections import SharedProjection

    count, groups = 0, {}
    for _, module in model.named_modules():
        count += _swap(module, limit)
        if isinstance(module, SharedProjection):
            groups[id(module._group)] = module._group
    for group in groups.values():
        count += _swap(group.fused, limit)
    return count


def apply(model: nn.Module, name: str, setting: int | None) -> int:
    """`convert` with `wanted(setting)`'s limit when it is 2 or more, logging what it did;
    returns the layers converted."""
    limit = wanted(setting)
    if limit < 2:
        return 0
    count = convert(model, limit)
    log.info("%s: %d layers multiply 2-%d tokens as one-row products (matvec_tokens)", name, count, limit)
    return count
