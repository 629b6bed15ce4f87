"""A slab step with each layer's q/k/v and gate/up shared (`models/loading/fused_projections.py`)
against the separate projections (docs/history/gpu-2026-12.md, "Fused projections"): 4 rows over 300
positions, 1 and 5 tokens a row, the two models alternating; per step the host's graph
building and the whole synchronized step, medians of 30. On a CUDA GPU a quantized model
is dequantized first, as `dense_weights` does by default.

    python3 -m scripts.experiments.fused_step /tmp/specslot-q15     # or models/bundled/target on a CPU
"""

from __future__ import annotations

import statistics
import sys
import time

import models  # noqa: E402,F401  (fast BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402

from models.forward.slab import Slab  # noqa: E402
from models.loading import dense_weights, fused_projections  # noqa: E402
from models.loading.loader import load_model  # noqa: E402
from models.platform.device_memory import on_cuda  # noqa: E402

ROWS = 4


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "models/bundled/target"
    models_ = {}
    for name in ("separate", "fused"):
        model = load_model(path).model
        if on_cuda():
            dense_weights.dequantize(model)
        if name == "fused" and not fused_projections.fuse(model):
            raise SystemExit(f"{path}: not a llama-family model with plain layers")
        slab = Slab(model, rows=8)
        rows = [slab.add() for _ in range(ROWS)]
        mx.eval(
            slab.forward(
                model,
                [(r, [(j * 7919 + i) % 2000 + 3 for j in range(300)]) for i, r in enumerate(rows)],
                last_only=True,
            ),
            slab.arrays(),
        )
        models_[name] = (model, slab, rows)
    outs = [models_[n][1].forward(models_[n][0], [(r, [7]) for r in models_[n][2]]) for n in models_]
    mx.eval(outs)
    print(
        "largest logit difference",
        max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() for a, b in zip(*outs)),
    )
    for name in models_:
        for r in models_[name][2]:
            for c in r.cache:
                c.offset -= 1

    def step(name: str, k: int) -> tuple[float, float]:
        model, slab, rows = models_[name]
        tic = time.perf_counter()
        out = slab.forward(model, [(r, list(range(3, 3 + k))) for r in rows])
        built = time.perf_counter() - tic
        mx.eval(out, slab.arrays())
        total = time.perf_counter() - tic
        for r in rows:
            for c in r.cache:
                c.offset -= k
        return built, total

    for k in (1, 5):
        for name in models_:
            for _ in range(5):
                step(name, k)
        times = {n: ([], []) for n in models_}
        for i in range(30):
            for name in ("separate", "fused") if i % 2 else ("fused", "separate"):
                built, total = step(name, k)
                times[name][0].append(built)
                times[name][1].append(total)
        print(
            f"{ROWS} rows x {k} tokens: "
            + ", ".join(
                f"{n} build {1e3 * statistics.median(b):.2f} ms, step {1e3 * statistics.median(t):.2f} ms"
                for n, (b, t) in times.items()
            )
        )


if __name__ == "__main__":
    main()
