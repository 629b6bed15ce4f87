"""Each layer's q, k and v projections as one matmul, and its MLP's gate and up as one
(`fused_projections`, on by default on a CUDA GPU), in every forward the model runs.

A layer's q, k and v (and gate and up) read the same input. `bucketed._FusedDecoder`
already keeps each group's weights as one matrix, the layers' own weights row slices of
it, for the compiled speculative round. Here the model's own modules use it too: q_proj,
k_proj and v_proj become `SharedProjection`s of one group; the first of them called with
an input runs the group's matmul and splits the result, and the others take their part
of that same result (the group remembers the input it ran on, by identity, until each
part was taken once). mlx-lm's model code, the slab's forwards and every other caller
run unchanged. A module keeps its weight and bias (the row slices), so the model's
parameters are the same arrays as before.

A forward launches fewer matmuls, which pays on a CUDA GPU, where each launch costs host
time; on a CPU it gains nothing, so the default is on only on a GPU (docs/gpu.md, "What
runs by default").

Llama-family models (llama, mistral, qwen2: `bucketed._fusable`) only; any other model,
and a quantized one, is left as it is.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

from models.platform.device_memory import on_cuda

log = logging.getLogger(__name__)


class _Group:
    """One fused matmul and the split of its last result (a plain object: the fused
    layer stays out of the model's module tree, whose parameters are the slices)."""

    def __init__(self, fused: nn.Linear, sizes: list[int]) -> None:
        self.fused = fused
        self.bounds = [sum(sizes[:i]) for i in range(1, len(sizes))]
        self.num_parts = len(sizes)
        self._input: mx.array | None = None
        self._parts: list[mx.array] = []
        self._left = 0

    def part(self, x: mx.array, index: int) -> mx.array:
        if self._input is not x or not self._left:
            self._parts = mx.split(self.fused(x), self.bounds, axis=-1)
            self._input, self._left = x, self.num_parts
        out = self._parts[index]
        self._left -= 1
        if not self._left:  # every part taken: hold no activation past this layer
            self._input, self._parts = None, []
        return out


class SharedProjection(nn.Module):
    """A projection computed as its part of a group's fused matmul (see the module
    docstring); `weight` and `bias` are its own rows of the fused ones."""

    def __init__(self, linear: nn.Linear, group: _Group, index: int) -> None:
        super().__init__()
        self.weight = linear.weight
        if "bias" in linear:
            self.bias = linear.bias
        self._group = group  # a plain attribute, not a child module
        self._index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self._group.part(x, self._index)


def wanted(setting: bool | None) -> bool:
    """`setting` when given, else on a CUDA GPU."""
    return on_cuda() if setting is None else setting


def fuse(model: nn.Module) -> int:
    """Make every layer's q/k/v and gate/up projections shared ones (in place). Returns
    the groups made; 0 where the model is not of the llama family's shape, is quantized,
    or the fused decoder did not reproduce its logits."""
    from models.forward.bucketed import _FusedDecoder

    if getattr(model, "_specslot_shared_projections", False):
        return 0  # already done
    decoder = _FusedDecoder.build(model)
    if decoder is None:
        return 0
    object.__setattr__(model, "_specslot_shared_projections", True)
    count = 0
    for layer, parts in zip(model.model.layers, decoder.layers):
        _, qkv, attn, _, gate_up, mlp = parts
        for fused, owner, names in (
            (qkv, attn, ("q_proj", "k_proj", "v_proj")),
            (gate_up, mlp, ("gate_proj", "up_proj")),
        ):
            linears = [getattr(owner, name) for name in names]
            group = _Group(fused, [lin.weight.shape[0] for lin in linears])
            for index, (name, lin) in enumerate(zip(names, linears)):
                setattr(owner, name, SharedProjection(lin, group, index))
            count += 1
    return count


def apply(model: nn.Module, name: str, setting: bool | None) -> int:
    """`fuse` when `wanted(setting)`, logging what it did; returns the groups made."""
    if not wanted(setting):
        return 0
    count = fuse(model)
    if count:
        log.info("%s: %d projection groups share one matmul each (fused_projections)", name, count)
    elif setting:
        log.info("%s: fused_projections: not a llama-family model with plain layers; left as it is", name)
    return count
