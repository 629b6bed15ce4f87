"""`models.skinny_matmul` on a CUDA GPU (made for the lent H200): is it right, and what
does it save?

1. Accuracy: the kernel and cuBLAS's bf16 matmul against a float32 reference, for the
   q15 shape's layer sizes, 2-16 tokens, with and without a bias, and x at an address
   that is not 16-byte aligned. Prints the largest error of each, relative to the
   reference's largest magnitude.
2. The weight matmuls of one forward at the Qwen2.5-1.5B shape (28 layers x q, k, v, o,
   gate, up, down; random weights), cuBLAS against the kernel with 2, 4 and 8 output
   features per block of 128 or 256 threads, by token count; device synchronized per
   forward, median of 15.
3. With `--model DIR`: the model's decode step of R rows (one token each, over a
   256-token cache, trimmed back after each step), plain `nn.Linear` against
   `SkinnyLinear`: synchronized, and ten steps queued back to back (pipelined).

    python3 scripts/experiments/gpu_skinny.py [--model /tmp/specslot-q15] [--rows 1 2 4 8 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import models  # noqa: E402,F401  (before mlx, as the service imports it)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from models import skinny_matmul  # noqa: E402

HIDDEN, INTERMEDIATE, KV, LAYERS = 1536, 8960, 256, 28
SIZES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def median_ms(fn, repeats: int = 15) -> float:
    for _ in range(3):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def accuracy() -> None:
    print("| M x K | tokens | bias | x aligned | kernel error | cuBLAS error |\n|---|---|---|---|---|---|")
    for m, k in SIZES:
        w = (mx.random.normal((m, k)) * 0.02).astype(mx.bfloat16)
        bias = (mx.random.normal((m,)) * 0.1).astype(mx.bfloat16)
        for n in (2, 3, 4, 7, 8, 13, 16, 20, 32):
            for with_bias, aligned in ((False, True), (True, True), (False, False)):
                base = mx.random.normal((n * k + 1,)).astype(mx.bfloat16)
                x = (base[:n * k] if aligned else base[1:]).reshape(n, k)
                b = bias if with_bias else None
                ref = x.astype(mx.float32) @ w.astype(mx.float32).T + (b.astype(mx.float32) if b is not None else 0)
                got = skinny_matmul.matmul(x, w, b)
                cublas = (x + 0) @ w.T + (b if b is not None else 0)  # cuBLAS refuses a misaligned x
                scale = mx.abs(ref).max()
                err = (mx.abs(got.astype(mx.float32) - ref).max() / scale).item()
                err_cublas = (mx.abs(cublas.astype(mx.float32) - ref).max() / scale).item()
                print(f"| {m} x {k} | {n} | {with_bias} | {aligned} | {err:.2e} | {err_cublas:.2e} |", flush=True)
                if err > 4 * max(err_cublas, 4e-3):
                    raise SystemExit(f"kernel error {err} against cuBLAS {err_cublas} at {m}x{k}, {n} tokens")


def matmuls(token_counts: list[int]) -> None:
    outs = [(HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN),
            (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
    dense = [[(mx.random.normal(s) * 0.02).astype(mx.bfloat16) for s in outs] for _ in range(LAYERS)]
    mx.eval(dense)
    defaults = skinny_matmul.ROWS, skinny_matmul.BLOCK
    variants = [(rows, block) for block in (128, 256) for rows in (2, 4, 8)]
    print("| tokens | cuBLAS ms | " + " | ".join(f"kernel {r} rows x {b} threads" for r, b in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for n in token_counts:
        inputs = {d: mx.random.normal((n, d)).astype(mx.bfloat16) for d in (HIDDEN, INTERMEDIATE)}
        mx.eval(inputs)
        row = [median_ms(lambda: [inputs[w.shape[1]] @ w.T for layer in dense for w in layer])]
        for rows, block in variants:
            skinny_matmul.ROWS, skinny_matmul.BLOCK = rows, block
            if n >= 2:
                row.append(median_ms(lambda: [skinny_matmul.matmul(inputs[w.shape[1]], w) for layer in dense
                                              for w in layer]))
            else:
                row.append(float("nan"))
        skinny_matmul.ROWS, skinny_matmul.BLOCK = defaults
        print(f"| {n} | " + " | ".join(f"{v:.2f}" for v in row) + " |", flush=True)


def steps(path: str, row_counts: list[int]) -> None:
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from models import dense_weights
    from models.loader import load_model

    model = load_model(path).model
    dense_weights.dequantize(model)
    linears = [m for _, m in model.named_modules() if type(m) is nn.Linear]
    print("| rows | plain sync ms | skinny sync ms | plain pipelined ms | skinny pipelined ms |\n|---|---|---|---|---|")
    for rows in row_counts:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[(i * 7919) % 2000 + 3 for i in range(256)]] * rows), cache=cache))
        tokens = mx.array([[5]] * rows)

        def step():
            out = model(tokens, cache=cache)
            trim_prompt_cache(cache, 1)
            return out

        def pipelined():
            outs = [step() for _ in range(10)]
            for out in outs:
                mx.async_eval(out)
            return outs

        figures = {}
        for name, cls in (("plain", nn.Linear), ("skinny", skinny_matmul.SkinnyLinear)):
            for m in linears:
                m.__class__ = cls
            figures[name] = (median_ms(step), median_ms(pipelined, 5) / 10)
        for m in linears:
            m.__class__ = nn.Linear
        print(f"| {rows} | {figures['plain'][0]:.2f} | {figures['skinny'][0]:.2f} | {figures['plain'][1]:.2f} | "
              f"{figures['skinny'][1]:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory for the decode-step table")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 20, 32])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    accuracy()
    matmuls(args.tokens)
    if args.model:
        steps(args.model, args.rows)


if __name__ == "__main__":
    main()
