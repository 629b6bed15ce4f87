"""A whole model step, bf16 dense weights against the 4-bit weights run over the step's
tokens flattened to one (tokens, hidden) matrix: whether a decode step of a few rows
gets cheaper on MLX CUDA (made for the lent H200).

`scripts/experiments/gpu_qmm.py` times the weight matmuls alone: MLX CUDA's quantized
matmul is fast on 8 or more flattened tokens (1.7 ms for a q15 forward's weights at 8
tokens against 3.9-4.8 in bf16) and slow on a (rows, 1, hidden) input. Here each
`QuantizedLinear` of a loaded 4-bit model is wrapped to reshape its input to two
dimensions (a view, no kernel) and back, and whole forwards of a batch of rows (a
`KVCache` per layer, `--context` positions deep, trimmed back after each step) are timed
against the same model dequantized to bf16 (`models.loading.dense_weights`, as the service runs
it), with and without fused projections (`models.loading.fused_projections`). The last column
runs a step of fewer than `--pad` (8) tokens with as many rows as reach it, as a grid
forward would pad them with spare slots. Device synchronized after each forward; median
of `--repeats`.

    python3 -m scripts.experiments.gpu_flatq --model /tmp/specslot-q15 --rows 1 2 4 8 16 64 --widths 1 5
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn


class FlatQuantized(nn.Module):
    """A `QuantizedLinear` that runs on its input flattened to (tokens, features)."""

    def __init__(self, inner: nn.QuantizedLinear) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        lead = x.shape[:-1]
        return self.inner(x.reshape(-1, x.shape[-1])).reshape(*lead, -1)


def flatten_quantized(model: nn.Module) -> int:
    count = 0
    for _, module in model.named_modules():
        for name, child in list(module.children().items()):
            if isinstance(child, nn.QuantizedLinear):
                setattr(module, name, FlatQuantized(child))
                count += 1
    return count


def fuse_quantized(model: nn.Module) -> int:
    """q/k/v and gate/up of every layer as one flattened 4-bit matmul each (their packed
    weights, scales, biases and bias concatenated along the output axis; quantization
    groups run along the input axis, so the rows stay valid)."""
    from models.loading.fused_projections import SharedProjection, _Group

    count = 0
    for layer in model.model.layers:
        for owner, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            parts = [getattr(owner, name) for name in names]
            first = parts[0]
            fused = nn.QuantizedLinear(
                first.weight.shape[1] * 32 // first.bits, 1, bias=False, group_size=first.group_size, bits=first.bits
            )
            fused.weight = mx.concatenate([p.weight for p in parts])
            fused.scales = mx.concatenate([p.scales for p in parts])
            fused.biases = mx.concatenate([p.biases for p in parts])
            if "bias" in first:
                fused.bias = mx.concatenate([p.bias for p in parts])
            sizes = [p.scales.shape[0] for p in parts]
            group = _Group(FlatQuantized(fused), sizes)
            for index, (name, part) in enumerate(zip(names, parts)):
                setattr(owner, name, SharedProjection(part, group, index))
            count += 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    ap.add_argument("--widths", type=int, nargs="+", default=[1])
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--pad", type=int, default=8, help="the 4-bit path runs at least this many tokens")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from models.loading import dense_weights, fused_projections

    def loaded(kind: str) -> nn.Module:
        model, _ = load(args.model)
        if kind.startswith("bf16"):
            dense_weights.dequantize(model)
            if kind == "bf16+fused":
                fused_projections.fuse(model)
        else:
            if kind == "4bit-flat+fused":
                fuse_quantized(model)
            flatten_quantized(model)
        mx.eval(model.parameters())
        return model

    def step_ms(model: nn.Module, rows: int, width: int) -> float:
        cache = make_prompt_cache(model)
        model(mx.random.randint(0, 2000, (rows, args.context)), cache=cache)
        mx.eval([c.state for c in cache])
        tokens = mx.random.randint(0, 2000, (rows, width))
        times = []
        for i in range(args.repeats + 3):
            tic = time.perf_counter()
            mx.eval(model(tokens, cache=cache))
            if i >= 3:
                times.append(time.perf_counter() - tic)
            for c in cache:
                c.trim(width)
        return sorted(times)[len(times) // 2] * 1e3

    kinds = ["bf16", "bf16+fused", "4bit-flat", "4bit-flat+fused"]
    models = {kind: loaded(kind) for kind in kinds}
    print(f"device {mx.default_device()}, mlx {mx.__version__}, context {args.context}")
    print(
        "| rows x width | " + " | ".join(f"{k} ms" for k in kinds) + f" | {kinds[-1]} padded to {args.pad} tokens ms |"
    )
    print("|---|" + "---|" * (len(kinds) + 1))
    for width in args.widths:
        for rows in args.rows:
            cells = [step_ms(models[k], rows, width) for k in kinds]
            need = -(-args.pad // width)  # rows whose tokens reach `--pad` (the 4-bit kernel's fast path)
            padded = step_ms(models[kinds[-1]], need, width) if rows < need else cells[-1]
            print(f"| {rows} x {width} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {padded:.2f} |", flush=True)


if __name__ == "__main__":
    main()
