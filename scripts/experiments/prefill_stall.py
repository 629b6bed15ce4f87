"""What one long prompt's prefill does to everything else on the engine: `--streams`
sampled streams decode, then a prompt of `--prompt-tokens` random tokens arrives, and
`--short-after-ms` later a 20-token request in the high lane. On the engine thread CONFIG
builds (no Ray, no HTTP), the bundled target unless `--target` says otherwise.

Per repeat: the streams' median gap between token events before the long prompt
arrived, their longest gap around its prefill (overall and each stream's), the two
requests' times to first token, the decode steps run between the prompt's forwards and
the requests prefilled there (`prefill_yield_tokens`, CONTINUOUS_BATCHING.md "The fused
tick", its prefill; neither with `--config configs/bundled.yaml:prefill_yield_tokens=0`)
and the slot's grants (a stream holding the slot is not stepped there).

    OPENBLAS_NUM_THREADS=1 python -m scripts.experiments.prefill_stall [--prompt-tokens 1000] [--repeats 2]
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

TARGET = os.path.join(HERE, "models", "bundled", "target")


def one_repeat(engine, rep: int, args, tokens) -> dict:
    from scheduler.request import Lane, Request, SamplingParams

    before_counts = engine.snapshot()["counters"]
    streams = [f"r{rep}-stream{i}" for i in range(args.streams)]
    for i, request_id in enumerate(streams):
        engine.submit(
            Request(request_id, tokens(100), SamplingParams(max_tokens=args.stream_tokens, temperature=0.7, seed=i))
        )
    times: dict[str, list[float]] = {}
    start = time.perf_counter()
    sent: dict[str, float] = {}
    done: set[str] = set()
    while len(done) < len(streams) + 2:
        now = time.perf_counter()
        if "long" not in sent and now - start > args.long_after_s:
            engine.submit(Request(f"r{rep}-long", tokens(args.prompt_tokens), SamplingParams(max_tokens=4)))
            sent["long"] = now
        if "short" not in sent and "long" in sent and now - sent["long"] > args.short_after_ms / 1e3:
            engine.submit(Request(f"r{rep}-short", tokens(20), SamplingParams(max_tokens=4), lane=Lane.HIGH))
            sent["short"] = now
        for event in engine.get_events(timeout=0.002):
            if event.error:
                raise RuntimeError(f"{event.request_id}: {event.error}")
            times.setdefault(event.request_id, []).append(time.perf_counter())
            if event.finish_reason:
                done.add(event.request_id)
    if "long" not in sent or any(len(times.get(s, ())) < 2 for s in streams):
        raise RuntimeError("the streams ended before the long prompt came; raise --stream-tokens")
    before, around, worst = [], [], []
    for request_id in streams:
        ts = times[request_id]
        mine = [0.0]
        for a, b in zip(ts, ts[1:]):
            (mine if b > sent["long"] and a < times[f"r{rep}-long"][0] + 0.05 else before).append(b - a)
        around += mine
        worst.append(max(mine))
    counts = engine.snapshot()["counters"]
    return {
        "yields": counts["prefill_yields"] - before_counts["prefill_yields"],
        "grants": counts["grants"] - before_counts["grants"],
        "overtakes": counts["prefill_overtakes"] - before_counts["prefill_overtakes"],
        "gap_p50_ms": 1e3 * statistics.median(before),
        "gap_max_ms": 1e3 * max(around),
        "stream_max_ms": " / ".join(f"{1e3 * w:.0f}" for w in sorted(worst)),
        "long_ttft_ms": 1e3 * (times[f"r{rep}-long"][0] - sent["long"]),
        "short_ttft_ms": 1e3 * (times[f"r{rep}-short"][0] - sent["short"]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bundled.yaml", metavar="PATH[:key=value,...]")
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=300, help="max_tokens of each decoding stream")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--long-after-s", type=float, default=1.0, help="when the long prompt comes")
    ap.add_argument("--short-after-ms", type=float, default=20.0, help="the short request after the long one")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    from scripts.bench.engine_load import engine_from_config
    from scripts.bench.vs_mlx_lm import parse_config_spec

    path, overrides = parse_config_spec(args.config)
    engine, _ = engine_from_config(path, args.target, overrides)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, 2000) for _ in range(n)]  # noqa: E731
    print(
        f"{path} {overrides}: {args.streams} streams decoding, a {args.prompt_tokens}-token prompt, "
        f"a 20-token high-lane request {args.short_after_ms:g} ms after it"
    )
    print(
        "| repeat | stream gap p50 before, ms | longest stream gap around the prefill, ms | "
        "each stream's longest gap, ms | long prompt TTFT, ms | short request TTFT, ms | "
        "decode steps within prefills | requests prefilled within prefills | slot grants |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    try:
        for rep in range(args.repeats):
            r = one_repeat(engine, rep, args, tokens)
            print(
                f"| {rep} | {r['gap_p50_ms']:.0f} | {r['gap_max_ms']:.0f} | {r['stream_max_ms']} | "
                f"{r['long_ttft_ms']:.0f} | "
                f"{r['short_ttft_ms']:.0f} | {r['yields']} | {r['overtakes']} | {r['grants']} |"
            )
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
