"""Two ways to make the slab's multi-token grid forwards cheaper on MLX CUDA (made for the
lent H200; random weights at the Qwen2.5-1.5B shape, 4-bit, vocabulary 2,048), both now
the GPU default; a variant's name turns either back:

- `fused`: grid attention of several queries per row through
  `mx.fast.scaled_dot_product_attention` with a mask (which builds a plan per shape,
  ~50-70 ms each, `gpu_shapes.py`), instead of the default two matmuls and a softmax
  (`slab_forward._grid_attention`);
- `q4`: the quantized linears as loaded, instead of dequantized to bf16
  (`models.loading.dense_weights`, cuBLAS GEMMs).

Variants combine with `+` (`q4+fused` is what ran before both changes). One process per
variant (a shape's first call is what it costs a fresh process; run the variants with
one `MLX_PTX_CACHE_DIR`, after a warm-up process, so kernels come from disk):

    python -m scripts.experiments.gpu_prefill --model /tmp/q15 --variant q4+fused --out DIR/q4_fused.json
"""

from __future__ import annotations

import argparse
import json

SHAPES = (
    [(r, w, n) for n in (100, 700) for w in (2, 5) for r in (1, 4, 8, 16, 32)]
    + [(r, w, n) for n in (0, 1536) for w in (16, 64, 256, 512) for r in (1, 8)]
    + [(r, 1, n) for n in (100, 700) for r in (1, 8, 32)]
)


def fused_attention() -> None:
    """Grid attention with several queries per row back on the fused kernel (with a mask)."""
    import mlx.core as mx

    from models.forward import slab_forward

    slab_forward._grid_attention = lambda q, k, v, scale, mask: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask=mask
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--variant", default="default", help="default, q4, fused, q4+fused")
    args = parser.parse_args()
    import mlx.core as mx

    from models.forward.slab import Slab
    from models.loading.dense_weights import dequantize
    from models.loading.loader import load_pair
    from scripts.experiments.gpu_shapes import timed

    target, _ = load_pair(args.model, None)
    model = target.model
    if "q4" not in args.variant:
        dequantize(model)
    if "fused" in args.variant:
        fused_attention()
    mx.eval(model.parameters())
    slab = Slab(model, rows=34, grid=True)
    rows = [slab.add() for _ in range(34)]

    def run(r: int, w: int, length: int):
        for row in rows[:r]:
            for view in row.cache:
                view.offset = length
        out = slab.forward(model, [(row, [7] * w) for row in rows[:r]])
        mx.eval(*(out[-1:] if w <= 8 else []), *slab.arrays())
        for row in rows[:r]:
            for view in row.cache:
                view.offset = length

    run(1, 1, 10)
    out = []
    for r, w, n in SHAPES:
        first = timed(lambda: run(r, w, n))
        again = timed(lambda: run(r, w, n), 3)
        out.append(dict(rows=r, width=w, length=n, first_ms=first * 1e3, again_ms=again * 1e3))
        print(r, w, n, round(first * 1e3, 1), round(again * 1e3, 1), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(variant=args.variant, shapes=out, peak_gb=mx.get_peak_memory() / 2**30), f, indent=1)


if __name__ == "__main__":
    main()
