"""Prompt-chunk attention on MLX CUDA, three ways, at the shapes a prefill group meets
(made for the lent H200; runs on a CPU too): the slab's masked grid attention as two
matmuls and a softmax (`slab_forward._grid_attention`), the fused kernel with that mask
array, and the fused kernel with its causal mask (which serves chunks whose rows all hold
one length, a group of fresh prompts). Qwen2.5-1.5B's attention shape (12 query heads, 2
key-value heads, 128 dims), bf16 on a GPU, random values. Per shape: the first call
(what a fresh process pays, plans included) and the median of the next ones, in ms.

    python -m scripts.experiments.gpu_attention --out DIR/attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

SHAPES = (
    [(rows, 512, length) for rows in (1, 8) for length in (0, 512, 1024, 1536)]
    + [(rows, width, 0) for rows in (1, 2, 4) for width in (1024, 2048)]
    + [(2, 1024, 1024)]
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import mlx.core as mx
    import numpy as np

    import models  # noqa: F401  (a fast BLAS before mlx.core on a CPU)
    from models.forward.slab_forward import STEP, _grid_attention

    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    heads, kv_heads, dim, scale = 12, 2, 128, 128**-0.5

    def masked(rows: int, width: int, length: int):
        keys = -(-(length + width) // STEP) * STEP
        valid = np.arange(keys)[None, None, :] <= (length + np.arange(width))[None, :, None]
        return keys, mx.array(np.broadcast_to(valid[:, None], (rows, 1, width, keys)))

    ways = {
        "matmul": lambda q, k, v, mask, t: _grid_attention(q, k, v, scale, mask),
        "fused_mask": lambda q, k, v, mask, t: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask),
        "fused_causal": lambda q, k, v, mask, t: mx.fast.scaled_dot_product_attention(
            q, k[:, :, :t], v[:, :, :t], scale=scale, mask="causal"
        ),
    }
    results = []
    for rows, width, length in SHAPES:
        keys, mask = masked(rows, width, length)
        q = mx.random.normal((rows, heads, width, dim)).astype(dtype)
        k = mx.random.normal((rows, kv_heads, keys, dim)).astype(dtype)
        v = mx.random.normal((rows, kv_heads, keys, dim)).astype(dtype)
        mx.eval(q, k, v, mask)
        row = {"rows": rows, "width": width, "length": length}
        outs = {}
        for name, way in ways.items():
            times = []
            for _ in range(args.repeats + 1):
                tic = time.perf_counter()
                out = way(q, k, v, mask, length + width)
                mx.eval(out)
                times.append((time.perf_counter() - tic) * 1e3)
            outs[name] = out
            row[name] = {"first_ms": round(times[0], 2), "ms": round(statistics.median(times[1:]), 3)}
        row["max_diff"] = max(mx.abs(outs[n] - outs["matmul"]).max().item() for n in ways)
        results.append(row)
        print(
            f"rows {rows} width {width:5d} after {length:5d}: "
            + "  ".join(f"{n} {row[n]['ms']:.2f} ms (first {row[n]['first_ms']:.1f})" for n in ways)
            + f"  max diff {row['max_diff']:.3g}",
            flush=True,
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": str(mx.default_device()), "dtype": str(dtype), "shapes": results}, f, indent=1)


if __name__ == "__main__":
    main()
