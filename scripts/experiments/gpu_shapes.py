"""What a new grid-forward shape costs on MLX CUDA, and how fast the slab prefills (made
for the lent H200; random weights at the Qwen2.5-1.5B shape, 4-bit, vocabulary 2,048).

Part "shapes" (with `--fused`, as measured before the grid's matmul attention): one grid slab (`Slab(grid=True)`, 34 rows), forwards of R rows x W tokens
against keys of bucket K (rows set to a length inside the bucket), each timed at its first
call and again (synchronised, logits of the last row evaluated as a decode step does).
Run it twice with the same `MLX_PTX_CACHE_DIR`: the second process shows what a new shape
costs once the kernels are on disk (a restarted replica with `kernel_cache_dir`).

Part "prefill": prompt tokens per second of the slab's prefill forwards (R rows x W tokens
from length 0 and from 1,536), weights 4-bit as loaded and dequantized to bf16 (cuBLAS).

    python -m scripts.experiments.gpu_shapes --model /tmp/q15 --out DIR/shapes_1.json
"""

from __future__ import annotations

import argparse
import json
import time


def timed(fn, repeats: int = 1) -> float:
    tic = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - tic) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--parts", default="shapes,prefill")
    parser.add_argument(
        "--fused",
        action="store_true",
        help="grid attention on the fused kernel, as before the matmul attention (gpu_prefill.py)",
    )
    args = parser.parse_args()
    import mlx.core as mx

    from models.forward.slab import Slab
    from models.loading.dense_weights import dequantize
    from models.loading.loader import load_pair
    from scripts.experiments.gpu_prefill import fused_attention

    if args.fused:
        fused_attention()
    tic = time.perf_counter()
    target, _ = load_pair(args.model, None)
    model = target.model
    mx.eval(model.parameters())
    result: dict = {"load_s": time.perf_counter() - tic, "device": str(mx.default_device())}
    slab = Slab(model, rows=34, grid=True)
    rows = [slab.add() for _ in range(34)]

    def run(r: int, w: int, length: int, logits: bool = True):
        for row in rows[:r]:
            for view in row.cache:
                view.offset = length
        out = slab.forward(model, [(row, [7] * w) for row in rows[:r]])
        mx.eval(*(out[-1:] if logits else []), *slab.arrays())
        for row in rows[:r]:
            for view in row.cache:
                view.offset = length

    if "shapes" in args.parts:
        shapes = []
        t0 = time.perf_counter()
        for length in (100, 300, 700):
            for w in (1, 2, 5):
                for r in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 28, 32, 34):
                    first = timed(lambda: run(r, w, length))
                    again = timed(lambda: run(r, w, length), 3)
                    shapes.append(dict(rows=r, width=w, length=length, first_ms=first * 1e3, again_ms=again * 1e3))
                print(f"length {length} width {w}: {[round(s['first_ms']) for s in shapes[-15:]]}", flush=True)
        for r in (1, 2, 4, 8):  # prefill chunks: widths 16..512 at the first key buckets
            for w in (16, 64, 128, 256, 512):
                for length in (0, 512, 1536):
                    first = timed(lambda: run(r, w, length, logits=False))
                    again = timed(lambda: run(r, w, length, logits=False), 2)
                    shapes.append(
                        dict(rows=r, width=w, length=length, first_ms=first * 1e3, again_ms=again * 1e3, prefill=True)
                    )
            print(f"prefill rows {r}: {[round(s['first_ms']) for s in shapes[-15:]]}", flush=True)
        result["shapes"] = shapes
        result["shapes_total_s"] = time.perf_counter() - t0
    if "prefill" in args.parts:
        prefill = {}
        for label in ("q4", "bf16"):
            if label == "bf16":
                result["dequantized_layers"] = dequantize(model)
            rates = []
            for r, w in ((1, 512), (1, 2048), (4, 512), (8, 256), (8, 512), (16, 256), (8, 1024), (32, 128)):
                for length in (0, 1536):
                    run(r, w, length, logits=False)
                    run(r, w, length, logits=False)
                    s = timed(lambda: run(r, w, length, logits=False), 3)
                    rates.append(dict(rows=r, width=w, length=length, ms=s * 1e3, tok_s=r * w / s))
            prefill[label] = rates
            print(label, [(x["rows"], x["width"], x["length"], round(x["tok_s"])) for x in rates], flush=True)
        result["prefill"] = prefill
        result["peak_memory_gb"] = mx.get_peak_memory() / 2**30
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
