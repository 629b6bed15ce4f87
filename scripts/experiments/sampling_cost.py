"""What turning one decode step's logits into tokens costs for a batch of rows, MLX's
functions against ours (`models.platform.cpu_math` on an x86-64 CPU): the logits are the
target's own, at positions of its sampled chat continuations (so the top_p nuclei are as
wide as real text makes them), stacked `--rows` at a time. Per sampling setting, the
median milliseconds of `draw_plain` / the greedy pick over those rows, with `cpu_math`'s
functions off (MLX's `logsumexp`, `softmax` and a whole-row sort for top_p; greedy as the
argmax of the log-probabilities) and on (greedy as the argmax of the logits), and the
rejection-sampling probabilities of the rows (`RequestSampler.probs`). Both ways pick the
same tokens. (docs/configuration.md, "CPU softmax and SiLU".)

    python -m scripts.experiments.sampling_cost [--config configs/local.yaml] [--rows 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import models  # noqa: F401  (fast BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402

from models.platform import cpu_math  # noqa: E402
from models.sampling import samplers  # noqa: E402
from scheduler.request import SamplingParams  # noqa: E402

SETTINGS = (
    ("greedy", {"temperature": 0.0}),
    ("T 0.7", {"temperature": 0.7}),
    ("T 0.7, top_p 0.95", {"temperature": 0.7, "top_p": 0.95}),
    ("T 0.7, top_p 0.99", {"temperature": 0.7, "top_p": 0.99}),
)


def real_logits(config: str, prompts: int, tokens: int) -> list[mx.array]:
    """The target's logits (1, V) at each position of sampled continuations (T = 0.7)
    of `prompts` chat prompts, `tokens` each."""
    from models.loading import dense_weights
    from models.loading.loader import load_model
    from scripts.bench.servers import config_models
    from scripts.experiments.engine_ab import prompt_ids
    from serve_app.openai.codec import TextCodec

    target = config_models(config)[0]
    loaded = load_model(target)
    dense_weights.apply(loaded.model, loaded.name, None)
    codec = TextCodec.from_path(target)
    out = []
    for i, ids in enumerate(prompt_ids(codec, "chat", prompts, seed=5)):
        ids = list(ids)
        key = mx.random.key(i)
        for _ in range(tokens):
            logits = loaded.model(mx.array([ids]))[0, -1:].astype(mx.float32)
            key, sub = mx.random.split(key)
            ids.append(mx.random.categorical(logits[0] / 0.7, key=sub).item())
            mx.eval(logits)
            out.append(logits)
    return out


def median_ms(fn, batches: list[mx.array]) -> float:
    times = []
    for batch in batches:
        tic = time.perf_counter()
        mx.eval(fn(batch))
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    if not cpu_math.install():
        raise SystemExit("cpu_math is for x86-64 CPUs; here MLX's functions run either way")
    positions = real_logits(args.config, args.prompts, args.tokens)
    batches = [
        mx.concatenate(positions[i : i + args.rows]) for i in range(0, len(positions) - args.rows + 1, args.rows)
    ]
    print(f"{len(positions)} positions of sampled chat, {len(batches)} batches of {args.rows} rows")
    print("| setting | MLX's, ms | ours, ms | probabilities: MLX's / ours, ms |")
    print("|---|---|---|---|")
    for name, params in SETTINGS:
        rows = [samplers.RequestSampler(SamplingParams(8, seed=i, **params)) for i in range(args.rows)]
        counts = [1] * args.rows
        if rows[0].is_greedy:
            pick = {False: lambda x: mx.argmax(samplers.log_probs(x), axis=-1), True: samplers.greedy}
        else:
            pick = {way: (lambda x: samplers.draw_plain(rows, x, counts)) for way in (False, True)}
        cells, tokens = [], []
        for way in (False, True):
            cpu_math._installed = way
            pick[way](batches[0])  # warm
            cells.append(median_ms(pick[way], batches))
            tokens.append([pick[way](b).tolist() for b in batches])
        if tokens[0] != tokens[1]:
            raise SystemExit(f"{name}: the two ways picked different tokens")
        probs = ""
        if not rows[0].is_greedy:
            ms = []
            for way in (False, True):
                cpu_math._installed = way
                ms.append(median_ms(lambda x: rows[0].probs(rows[0].log_probs(x)), batches))
            probs = f"{ms[0]:.2f} / {ms[1]:.2f}"
        print(f"| {name} | {cells[0]:.2f} | {cells[1]:.2f} | {probs or '-'} |")
    cpu_math._installed = True


if __name__ == "__main__":
    main()
