"""Few-token matmuls on MLX CUDA at SmolLM2-135M's layer shapes: can a verify's or a few rows'
products cost what one token's do? MLX CUDA sends a product of more than one row to cuBLAS
(a forward of 2-8 tokens costs 1.5-1.7x one token's: docs/gpu.md, "Known issues"), and one
row to its own matrix-vector kernel. The same M tokens as M batched one-row products,
x (M, 1, K) against the broadcast weight, may take the latter. For M = 1, 2, 3, 4, 8: the
products of 30 layers (q/k/v fused, o, gate/up fused, down; random weights), float16 dense
and 4-bit (`mx.quantized_matmul`, group 32), plain (M, K) against batched (M, 1, K),
synchronized per forward, median of 30; and the largest difference between the two ways.
Not run yet (written when the session's device time ran out).

    python3 -m scripts.experiments.gpu_batched_matvec
"""

from __future__ import annotations

import mlx.core as mx

from scripts.bench.util import median_eval_s

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) of one layer's products
TOKENS = (1, 2, 3, 4, 8)


def median_ms(fn) -> float:
    return median_eval_s(fn, repeats=30, warmup=5) * 1e3


def main() -> None:
    weights = [(mx.random.normal((n, k)) * 0.02).astype(mx.float16) for _ in range(LAYERS) for k, n in SHAPES]
    quantized = [mx.quantize(w, group_size=32, bits=4) for w in weights]
    mx.eval(weights, quantized)
    print(f"device {mx.default_device()}; ms for the products of {LAYERS} layers")
    print("| tokens | float16 plain | float16 batched | largest difference | 4-bit plain | 4-bit batched |")
    print("|---|---|---|---|---|---|")
    for m in TOKENS:
        xs = {k: mx.random.normal((m, k)).astype(mx.float16) for k, _ in SHAPES}
        mx.eval(list(xs.values()))

        def dense(batched: bool):
            return [(xs[w.shape[1]][:, None, :] if batched else xs[w.shape[1]]) @ w.T for w in weights]

        def four_bit(batched: bool):
            return [
                mx.quantized_matmul(
                    xs[w.shape[1]][:, None, :] if batched else xs[w.shape[1]], *q, transpose=True, group_size=32, bits=4
                )
                for w, q in zip(weights, quantized)
            ]

        diff = max(mx.abs(b.reshape(a.shape) - a).max().item() for a, b in zip(dense(False), dense(True)))
        cells = [median_ms(lambda: dense(False)), median_ms(lambda: dense(True))]
        cells += [median_ms(lambda: four_bit(False)), median_ms(lambda: four_bit(True))]
        print(f"| {m} | {cells[0]:.2f} | {cells[1]:.2f} | {diff:.1e} | {cells[2]:.2f} | {cells[3]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
