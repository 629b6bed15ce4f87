"""How a GPU's classic decode step of a few rows should attend (made for the lent H200;
runs on a CPU too, where the slab is packed and the engine part measures nothing).

A lone row's step calls MLX's attention with no mask over exactly its keys, which MLX
CUDA runs on its one-query kernel; a step of several rows of different lengths passes
a mask over a bucket of keys, and MLX CUDA's one-query kernel takes no mask array, so
that call goes to its general attention. On the H200 (q15 shape, random weights) a
4-row step over HTTP took 13.5 ms against 5.1 for one row and the peer's 10.5 ms
(docs/history/gpu-2026-12.md, "With fused projections"). This times, first, the attention
alone: 28 layers of R rows (the q15 heads: 12 query, 2 key/value, dimension 128, bf16)
over a slab-like buffer, with a mask (boolean, additive), without one (the floor, not a
valid answer), as two matmuls (`slab_forward._grid_attention`), and one call per row over
exactly its keys; then, with `--target`, the engine's ticks (`gpu_ticks.py`, T = 0.7,
classic rows only) for each `slab_forward.DECODE_ATTENTION` in turn.

    python3 -m scripts.experiments.gpu_decode_attention --target /tmp/specslot-q15 --rounds 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402,F401  (a fast BLAS before MLX on a CPU)

# isort: split
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from models.forward.slab_forward import _grid_attention, _grid_mask  # noqa: E402
from scripts.bench.util import median_eval_s  # noqa: E402

HEADS, KV_HEADS, DIM, LAYERS, CAPACITY = 12, 2, 128, 28, 1024


def attention_table(rows_list: list[int], keys: int, repeats: int, dtype: mx.Dtype) -> None:
    scale = DIM**-0.5
    names = ["mask (bool)", "mask (additive)", "no mask (floor)", "two matmuls", "a call per row"]
    print(f"device {mx.default_device()}, mlx {mx.__version__}: {LAYERS} layers' decode attention, ms")
    print("| rows | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for rows in rows_list:
        k_all = [mx.random.normal((max(rows, 8), KV_HEADS, CAPACITY, DIM)).astype(dtype) for _ in range(LAYERS)]
        v_all = [mx.random.normal((max(rows, 8), KV_HEADS, CAPACITY, DIM)).astype(dtype) for _ in range(LAYERS)]
        q = [mx.random.normal((rows, HEADS, 1, DIM)).astype(dtype) for _ in range(LAYERS)]
        lengths = np.random.RandomState(rows).randint(keys // 2, keys - 1, rows)
        mask = _grid_mask(lengths, 1, keys)
        additive = mx.where(mask, mx.array(0, dtype), mx.array(-mx.inf, dtype))
        mx.eval(k_all, v_all, q, mask, additive)

        def sdpa(layer, m):
            return mx.fast.scaled_dot_product_attention(
                q[layer], k_all[layer][:rows, :, :keys], v_all[layer][:rows, :, :keys], scale=scale, mask=m
            )

        def per_row(layer):
            return mx.concatenate(
                [
                    mx.fast.scaled_dot_product_attention(
                        q[layer][r : r + 1],
                        k_all[layer][r : r + 1, :, : n + 1],
                        v_all[layer][r : r + 1, :, : n + 1],
                        scale=scale,
                    )
                    for r, n in enumerate(lengths.tolist())
                ]
            )

        ways = [
            lambda: [sdpa(i, mask) for i in range(LAYERS)],
            lambda: [sdpa(i, additive) for i in range(LAYERS)],
            lambda: [sdpa(i, None) for i in range(LAYERS)],
            lambda: [
                _grid_attention(q[i], k_all[i][:rows, :, :keys], v_all[i][:rows, :, :keys], scale, mask)
                for i in range(LAYERS)
            ],
            lambda: [per_row(i) for i in range(LAYERS)],
        ]
        print(f"| {rows} | " + " | ".join(f"{median_eval_s(w, repeats) * 1e3:.2f}" for w in ways) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--keys", type=int, default=512, help="the bucket of keys a step attends over")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--target", default=None, help="a model directory: also time the engine's ticks per mode")
    ap.add_argument("--config", default="configs/gpu.yaml:drafter={kind: ngram},b1_policy=off")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="engine runs per mode, the modes taking turns")
    args = ap.parse_args()
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    attention_table(args.rows, args.keys, args.repeats, dtype)
    if not args.target:
        return
    for k in range(args.rounds):
        for mode in ("mask", "rows", "matmuls"):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "scripts.experiments.gpu_ticks",
                    "--target",
                    args.target,
                    "--config",
                    args.config,
                    "--requests",
                    str(args.streams),
                    "--per-stream",
                    "3",
                    "--tokens",
                    "128",
                    "--prompt-chars",
                    "600",
                    "--temperature",
                    "0.7",
                    "--decode-attention",
                    mode,
                    "--out",
                    os.devnull,
                ],
                capture_output=True,
                text=True,
                cwd=HERE,
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith(("decode ", "prefill "))]
            print(f"round {k} {mode:<8} " + (" | ".join(lines) or f"failed: {out.stderr[-400:]}"), flush=True)


if __name__ == "__main__":
    main()
