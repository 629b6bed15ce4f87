"""What splitting one prompt's prefill into shorter forwards costs on this device: a lone
row of the slab (the layout the runner uses here: packed on a CPU, grids on a GPU)
prefilled from empty in forwards of each `--widths` positions, against one forward of
`MAX_PREFILL_CHUNK` positions at a time (what a lone prompt runs in when nothing waits).
Synchronized after every forward, as the runner is when a step runs between two of them
(`prefill_yield_tokens`, CONTINUOUS_BATCHING.md "The fused tick", its prefill). Median of
`--rounds` after one warm-up round (a GPU builds a kernel per new width).

    python -m scripts.experiments.prefill_pieces --target DIR [--tokens 16000] [--widths 256,512,1024]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402,F401  (fast BLAS before mlx)

# isort: split


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=os.path.join(HERE, "models", "bundled", "target"))
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--widths", default="256,512,1024")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import mlx.core as mx

    from models.batch.slab_batch import MAX_PREFILL_CHUNK
    from models.forward.slab import Slab
    from models.loading.loader import load_model
    from models.platform import cpu_math

    cpu_math.install()
    model = load_model(args.target).model
    mx.eval(model.parameters())
    rng = random.Random(0)
    widths = [MAX_PREFILL_CHUNK] + [int(w) for w in args.widths.split(",")]

    def prefill_s(width: int) -> float:
        slab = Slab(model, rows=4)
        row = slab.add()
        slab.reserve(args.tokens + 1)
        ids = [rng.randrange(3, 2000) for _ in range(args.tokens)]
        mx.eval(slab.arrays())
        tic = time.perf_counter()
        for start in range(0, len(ids), width):
            out = slab.forward(model, [(row, ids[start : start + width])], last_only=True)
            mx.eval([x for x in out if x is not None], slab.arrays())
        return time.perf_counter() - tic

    times: dict[int, list[float]] = {w: [] for w in widths}
    for k in range(args.rounds + 1):
        for w in widths if k % 2 else widths[::-1]:
            took = prefill_s(w)
            if k:
                times[w].append(took)
        print(f"round {k + 1}/{args.rounds + 1}", file=sys.stderr, flush=True)
    base = statistics.median(times[MAX_PREFILL_CHUNK])
    print(f"{args.target} on {mx.default_device()}: a {args.tokens}-token prompt, a lone row")
    print("| positions a forward | forwards | prefill, ms (median) | against one forward per 2,048 |")
    print("|---|---|---|---|")
    for w in widths:
        t = statistics.median(times[w])
        print(f"| {w} | {-(-args.tokens // w)} | {1e3 * t:.1f} | {t / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
