"""One stream at a time through several engines of one config (each with its own `args`
overrides), in one process: each prompt in turn through every engine, the order reversed
every other prompt; per engine, the decode rate of each prompt (tokens after the first over
their time, `scripts.bench.overhead.engine_decode_rate`), the median, and what its ticks
did. (docs/benchmarks.md, "SmolLM2 with its draft".)

    python -m scripts.experiments.engine_single --config configs/local.yaml --prompts chat --tokens 128 \\
        --engines '{"none": {"drafter": {"kind": "none"}}, "ngram": {}}'
"""

from __future__ import annotations

import argparse
import json
import statistics

import models  # noqa: F401  (fast BLAS before mlx)

# isort: split
from scripts.bench.engine_load import engine_from_config  # noqa: E402
from scripts.bench.overhead import engine_decode_rate  # noqa: E402
from scripts.experiments.engine_ab import prompt_ids, tick_summary  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--prompts", choices=("snippets", "code", "chat"), default="chat")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--engines",
        default='{"default": {}, "none": {"drafter": {"kind": "none"}}}',
        help="JSON: engine name -> `args` overrides",
    )
    args = ap.parse_args()
    from scripts.bench.servers import config_models
    from serve_app.openai.codec import TextCodec

    target = config_models(args.config)[0]
    codec = TextCodec.from_path(target)
    prompts = prompt_ids(codec, args.prompts, args.num_prompts, seed=1)
    engines = {
        name: engine_from_config(args.config, target, over)[0] for name, over in json.loads(args.engines).items()
    }
    names = list(engines)
    rates: dict[str, list[float]] = {name: [] for name in names}
    try:
        for engine in engines.values():  # unmeasured: first uses of each shape
            engine_decode_rate(engine, prompts[0], 16, "warm")
        for i, prompt in enumerate(prompts):
            for name in names if i % 2 else names[::-1]:
                rates[name].append(engine_decode_rate(engines[name], prompt, args.tokens, f"{name}{i}")[0])
        for name in names:
            print(
                f"{name}: tok/s {' '.join(f'{r:.1f}' for r in rates[name])}; median {statistics.median(rates[name]):.1f}"
            )
            print(f"  {name} ticks: {tick_summary(engines[name].snapshot())}")
    finally:
        for engine in engines.values():
            engine.stop()


if __name__ == "__main__":
    main()
