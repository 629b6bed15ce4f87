"""Which part of a short multi-token forward costs more than a one-token one (made for the H200).

For a 1B Llama's shapes (hidden 2048, MLP 8192, 32 query / 8 KV heads of 64), times
synchronised batches of 16 (one per layer) of: each projection matmul at M query rows,
and attention at L queries over a 768-key cache with a boolean mask, an additive mask,
and no mask (L = 1) / the causal string. Prints microseconds per op, medians of 20 runs.

Read it as a comparison between variants in the same harness, not as kernel times: each
op is dispatched from Python, so host dispatch (~15-25 us per op on the H200's host) is
part of every figure.

    python3 -m scripts.experiments.gpu_verify_parts
"""

from __future__ import annotations

import models  # noqa: E402,F401  (fast BLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402

from scripts.bench.util import median_eval_s  # noqa: E402

LAYERS = 16
HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, KEYS = 2048, 8192, 32, 8, 64, 768


def per_op_us(fn, reps: int = 20) -> float:
    return median_eval_s(fn, reps) / LAYERS * 1e6


def main() -> None:
    dt = mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32
    mx.random.seed(0)
    weights = {
        name: [mx.random.normal(shape).astype(dt) * 0.02 for _ in range(LAYERS)]
        for name, shape in [
            ("q/o proj", (HIDDEN, HIDDEN)),
            ("k/v proj", (HIDDEN, KV_HEADS * HEAD_DIM)),
            ("gate/up proj", (HIDDEN, MLP)),
            ("down proj", (MLP, HIDDEN)),
        ]
    }
    mx.eval(weights)
    keys = mx.random.normal((1, KV_HEADS, KEYS, HEAD_DIM)).astype(dt)
    values = mx.random.normal((1, KV_HEADS, KEYS, HEAD_DIM)).astype(dt)
    print(f"device {mx.default_device()}, {LAYERS} ops per sync, microseconds per op (median)")
    for name, ws in weights.items():
        row = []
        for m in (1, 2, 5, 7):
            x = mx.random.normal((1, m, ws[0].shape[0])).astype(dt)
            mx.eval(x)
            row.append(f"M={m}: {per_op_us(lambda: [x @ w for w in ws]):7.1f}")
        print(f"matmul {name:14s} " + "  ".join(row))
    for length in (1, 5, 7):
        q = mx.random.normal((1, HEADS, length, HEAD_DIM)).astype(dt)
        mask = mx.arange(KEYS)[None, :] <= (KEYS - length + mx.arange(length))[:, None]
        mx.eval(q, mask)
        sdpa = mx.fast.scaled_dot_product_attention
        additive = mx.where(mask, 0.0, -mx.inf).astype(dt)
        mx.eval(additive)
        masked = per_op_us(lambda: [sdpa(q, keys, values, scale=0.125, mask=mask) for _ in range(LAYERS)])
        added = per_op_us(lambda: [sdpa(q, keys, values, scale=0.125, mask=additive) for _ in range(LAYERS)])
        plain = per_op_us(
            lambda: [sdpa(q, keys, values, scale=0.125, mask=None if length == 1 else "causal") for _ in range(LAYERS)]
        )
        print(
            f"attention L={length}: boolean mask {masked:7.1f}   additive mask {added:7.1f}   "
            f"{'no mask' if length == 1 else 'causal'} {plain:7.1f}"
        )


if __name__ == "__main__":
    main()
