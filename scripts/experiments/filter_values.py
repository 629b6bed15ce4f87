"""What a request with a top_p or min_p value the replica has not seen before costs: its
time to first token, and the longest wait of the streams already decoding while it
arrives. Two ways to apply the filters take turns in one process, on one engine:
`ours` (`models.sampling.samplers`'s filters, the value as data) and `mlx_lm` (mlx-lm's
`apply_top_p` / `apply_min_p`, compiled with the value as a constant: each new value is
traced and its fused kernel built, on the engine thread).

Each probe: `--streams` sampled streams (top_p 0.9, warmed first) decode; one request
with a fresh value arrives (a random value never used before in this process, so no
cache holds its kernel: MLX's CPU kernels are also cached on disk by name, hence the
random digits); its TTFT and the other streams' longest gap between two events, from
its arrival until it finishes, are recorded. Medians over `--probes` probes per way and filter.

    python -m scripts.experiments.filter_values [--config configs/bundled.yaml] [--probes 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402,F401  (fast BLAS before mlx)

# isort: split
from models.sampling.samplers import min_p_filter, top_p_filter  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from scripts.bench.engine_load import engine_from_config  # noqa: E402


def use_filters(way: str) -> None:
    """Point the sampler at one way of applying top_p and min_p."""
    from models.sampling import samplers as sampling

    if way == "mlx_lm":
        from mlx_lm.sample_utils import apply_min_p, apply_top_p

        sampling.top_p_filter, sampling.min_p_filter = apply_top_p, apply_min_p
    else:
        sampling.top_p_filter, sampling.min_p_filter = top_p_filter, min_p_filter


def probe(engine, prompt: list[int], tag: str, streams: int, tokens: int, filters: dict) -> tuple[float, float]:
    """(TTFT ms of a request with `filters`, longest gap ms between two events of the
    other streams from its submit until it finishes)."""
    for i in range(streams):
        engine.submit(Request(f"{tag}-s{i}", prompt, SamplingParams(max_tokens=tokens, temperature=0.7, top_p=0.9)))
    started, finished = set(), set()
    while len(started | finished) < streams:  # every stream decoding (or done: EOS may come early)
        for e in engine.get_events(timeout=1.0):
            (finished if e.finish_reason is not None else started).add(e.request_id)
    tic = time.perf_counter()
    engine.submit(Request(f"{tag}-new", prompt, SamplingParams(max_tokens=4, temperature=0.7, **filters)))
    last, gap, ttft = tic, 0.0, None
    while len(finished) < streams + 1:
        events = engine.get_events(timeout=1.0)
        now = time.perf_counter()
        if any(e.request_id != f"{tag}-new" and e.token_ids for e in events) and f"{tag}-new" not in finished:
            gap, last = max(gap, now - last), now
        for e in events:
            if e.request_id == f"{tag}-new" and e.token_ids and ttft is None:
                ttft = now - tic
            if e.finish_reason is not None:
                finished.add(e.request_id)
    return 1e3 * ttft, 1e3 * gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bundled.yaml")
    ap.add_argument("--target", default=os.path.join(HERE, "models", "bundled", "target"))
    ap.add_argument("--streams", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48, help="tokens of each decoding stream")
    ap.add_argument("--probes", type=int, default=5, help="probes per way and filter")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompt = tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    engine, _ = engine_from_config(args.config, args.target)
    rng = random.Random(time.time_ns())
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for way in ("ours", "mlx_lm"):  # warm-up: the streams' own top_p, both ways
            use_filters(way)
            probe(engine, prompt, f"warm-{way}", args.streams, 8, {"top_p": 0.9})
        for n in range(args.probes):
            for way in ("ours", "mlx_lm") if n % 2 else ("mlx_lm", "ours"):
                use_filters(way)
                for name in ("top_p", "min_p"):
                    value = round(rng.uniform(0.80, 0.98) if name == "top_p" else rng.uniform(0.01, 0.2), 6)
                    results.setdefault((way, name), []).append(
                        probe(engine, prompt, f"{way}{n}{name}", args.streams, args.tokens, {name: value})
                    )
    finally:
        use_filters("ours")
        engine.stop()
    print(
        f"{args.config}: {args.streams} streams decoding (T = 0.7, top_p 0.9), then one request with a "
        f"new value; medians of {args.probes} probes"
    )
    print("| filters | parameter | TTFT ms | the others' longest gap ms |\n|---|---|---|---|")
    for (way, name), runs in sorted(results.items()):
        print(
            f"| {way} | {name} | {statistics.median(t for t, _ in runs):.1f} | "
            f"{statistics.median(g for _, g in runs):.1f} |"
        )


if __name__ == "__main__":
    main()
