"""One plain decode step of B rows at ~CTX keys, through the slab (the default's classic
batch) and through mlx-lm's `BatchKVCache` forward (what `classic-only`'s
`BatchGenerator` steps), alternating; medians of the whole step and of building its
graph (the forward's call before anything is evaluated). docs/benchmarks.md,
"SmolLM2-135M-Instruct on the CPU".

    python -m scripts.experiments.slab_vs_batchkv --rows 4 --context 300
"""

from __future__ import annotations

import argparse
import statistics
import time

import models  # noqa: F401  (fast BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    from mlx_lm.models.cache import BatchKVCache

    from models.forward.slab import Slab
    from models.runner import MlxRunner
    from scripts.bench.engine_load import serve_args

    serve = serve_args(args.config, {})
    model = MlxRunner.from_paths(serve.model, **serve.runner_args()).target.model
    vocab = model.args.vocab_size
    # rows a little apart in length, as served rows are
    prompts = [[(7 * i + 3 + 11 * r) % vocab for i in range(args.context + 13 * r)] for r in range(args.rows)]
    store = Slab(model, rows=args.rows + 2)
    rows = [store.add() for _ in prompts]
    for row, prompt in zip(rows, prompts):
        store.forward(model, [(row, prompt)])
        mx.eval(store.arrays())
    width = max(map(len, prompts))
    padding = [width - len(p) for p in prompts]
    caches = [BatchKVCache(left_padding=padding) for _ in model.layers]
    mx.eval(model(mx.array([[0] * d + p for d, p in zip(padding, prompts)]), cache=caches))
    built: dict[str, list[float]] = {"slab": [], "BatchKVCache": []}

    def slab_step():
        tic = time.perf_counter()
        out = store.forward(model, [(row, [5]) for row in rows])
        built["slab"].append(time.perf_counter() - tic)
        mx.eval(out, store.arrays())

    def batch_step():
        tic = time.perf_counter()
        out = model(mx.array([[5]] * args.rows), cache=caches)
        built["BatchKVCache"].append(time.perf_counter() - tic)
        mx.eval(out, [c.state for c in caches])

    steps = {"slab": slab_step, "BatchKVCache": batch_step}
    for step in (*steps.values(), *steps.values()):  # unmeasured
        step()
    for times in built.values():
        times.clear()
    took: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            tic = time.perf_counter()
            step()
            took[name].append(time.perf_counter() - tic)
    for name in steps:
        print(
            f"{name:>12}: step {statistics.median(took[name]) * 1e3:.1f} ms, "
            f"of which building its graph {statistics.median(built[name]) * 1e3:.2f} ms"
        )
    print(f"slab / BatchKVCache: {statistics.median(took['slab']) / statistics.median(took['BatchKVCache']):.3f}")


if __name__ == "__main__":
    main()
