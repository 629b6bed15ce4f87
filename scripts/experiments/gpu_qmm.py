"""The weight matmuls of one forward at the Qwen2.5-1.5B shape (28 layers x q, k, v, o,
gate, up, down), bf16 against 4-bit (`mx.quantized_matmul`, group 64), for inputs of
several token shapes: what `dense_weights` trades. Random weights; the device is
synchronized after each forward; median of 15 after 3 warm-ups.

A shape `R,W` is a grid forward's (rows, width, hidden) input as the slab passes it; a
shape `N` is the same tokens flattened to (N, hidden).

    python3 -m scripts.experiments.gpu_qmm --shapes 4,1 4 64,1 64 8,5 40 8,512 4096
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

HIDDEN, INTERMEDIATE, KV, LAYERS = 1536, 8960, 256, 28


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["1", "2", "4", "8", "4,1", "64,1", "64", "256", "1024", "4096"])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    outs = [
        (HIDDEN, HIDDEN),
        (KV, HIDDEN),
        (KV, HIDDEN),
        (HIDDEN, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (HIDDEN, INTERMEDIATE),
    ]
    dense = [[(mx.random.normal(s) * 0.02).astype(mx.bfloat16) for s in outs] for _ in range(LAYERS)]
    quant = [[mx.quantize(w, group_size=64, bits=4) for w in layer] for layer in dense]
    mx.eval(dense, quant)

    def forward(inputs: dict[int, mx.array], quantized: bool) -> list[mx.array]:
        out = []
        for layer in range(LAYERS):
            for j, w in enumerate(dense[layer]):
                x = inputs[w.shape[1]]
                if quantized:
                    q, scales, biases = quant[layer][j]
                    out.append(mx.quantized_matmul(x, q, scales, biases, transpose=True, group_size=64, bits=4))
                else:
                    out.append(x @ w.T)
        return out

    def median_ms(shape: tuple[int, ...], quantized: bool) -> float:
        inputs = {n: mx.random.normal(shape + (n,)).astype(mx.bfloat16) for n in (HIDDEN, INTERMEDIATE)}
        mx.eval(inputs)
        for _ in range(3):
            mx.eval(forward(inputs, quantized))
        times = []
        for _ in range(args.repeats):
            tic = time.perf_counter()
            mx.eval(forward(inputs, quantized))
            times.append(time.perf_counter() - tic)
        return sorted(times)[len(times) // 2] * 1e3

    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    print("| input | bf16 ms | 4-bit ms |\n|---|---|---|")
    for spec in args.shapes:
        shape = tuple(int(n) for n in spec.split(","))
        print(f"| {shape} | {median_ms(shape, False):.2f} | {median_ms(shape, True):.2f} |", flush=True)


if __name__ == "__main__":
    main()
