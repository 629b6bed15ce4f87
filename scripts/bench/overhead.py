"""Scenario 5: overheads. Scheduler time per tick, actor hop per token, and the
engine's classic decode against raw mlx-lm `generate_step` on the same model.

    python -m scripts.bench.overhead [--quick] [--out results/overhead]

- Scheduler time per tick = tick wall time minus time inside runner calls, over a
  mixed workload (3 speculative streams rotating at grant_rounds 2 plus classic rows).
- Engine vs raw: one greedy stream through the threaded `scheduler.engine.Engine`
  (classic only: B=1 policy "off"; a fresh engine per pair, stopped before the raw
  run) and through `mlx_lm.generate.generate_step` on a separately loaded copy of the
  same weights (float32, as the runner loads them), alternating engine/raw per pair;
  decode rate = tokens after the first / their time.
  The issue's bar is >= 0.95x.
- Actor hop: runs `scripts/bench/actor_hop.py` (the serve layer's own measurement)
  when it exists, and records its output verbatim.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import models  # noqa: F401
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.request import Request, SamplingParams
from scripts.bench import metrics
from scripts.bench import util as bench_util
from scripts.bench.engine import drive, load_runner, raw_generate_step, stream_arrivals
from scripts.bench.prompts import token_prompts


def scheduler_tick_overhead(target: str, draft: str, quick: bool, seed: int) -> dict:
    runner = load_runner(target, "draft_model", draft, num_draft_tokens=4)
    bench_util.warm_up(runner, runner.tokenizer)
    arrivals = stream_arrivals(runner.tokenizer, 7, 48 if quick else 192, 64, seed, stagger_tokens=4)
    result = drive(runner, SchedulerConfig(grant_rounds=2, b1_policy="on"), arrivals)
    runner.close()
    own = [t["tick_s"] - t["runner_s"] for t in result.ticks]
    share = sum(own) / sum(t["tick_s"] for t in result.ticks)
    by_action = {}
    for action in sorted({t["action"] for t in result.ticks}):
        xs = [t["tick_s"] - t["runner_s"] for t in result.ticks if t["action"] == action]
        by_action[action] = {
            "ticks": len(xs),
            "mean_us": statistics.fmean(xs) * 1e6,
            "p99_us": metrics.describe(xs, "x")["p99_x_ms"] * 1000,
        }
    d = metrics.describe(own, "x")
    return {
        "ticks": len(own),
        "mean_us": d["mean_x_ms"] * 1000,
        "median_us": d["median_x_ms"] * 1000,
        "p90_us": d["p90_x_ms"] * 1000,
        "p99_us": d["p99_x_ms"] * 1000,
        "share_of_tick_time": share,
        "by_action": by_action,
        "classic_fallbacks": result.counters["classic_fallbacks"],
    }


def engine_decode_rate(engine: Engine, prompt: list[int], max_tokens: int, request_id: str) -> tuple[float, int]:
    engine.submit(Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens)))
    first = None
    count = 0
    while True:
        for ev in engine.get_events(timeout=30):
            if ev.request_id != request_id:
                continue
            if ev.token_ids:
                if first is None:
                    first = time.perf_counter()
                    count += len(ev.token_ids) - 1
                else:
                    count += len(ev.token_ids)
            if ev.finish_reason is not None:
                if ev.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"engine request ended with {ev.finish_reason}: {ev.error}")
                return count / (time.perf_counter() - first), count + 1


def engine_vs_raw(target: str, quick: bool, seed: int) -> dict:
    from models.loading import dense_weights
    from models.loading.loader import load_model

    max_tokens = 128 if quick else 512
    num_pairs = 5 if quick else 8
    raw = load_model(target)
    # The weights the runner serves: a quantized file (a GGUF's Q4_1) dequantized as it does at load.
    dense_weights.apply(raw.model, raw.name, None)
    prompts = token_prompts(raw.tokenizer, num_pairs + 1, seed, num_tokens=64)
    raw_generate_step(raw.model, prompts[-1], 16)  # first-call costs out of the pairs
    pairs = []
    for i, prompt in enumerate(prompts[:num_pairs]):
        # A fresh engine per pair, stopped before the raw run: no engine thread (or its
        # BLAS workers) is alive while generate_step is timed, and vice versa.
        engine = Engine(lambda: load_runner(target, None), SchedulerConfig(b1_policy="off"))
        engine.start()
        try:
            engine_decode_rate(engine, prompts[-1], 16, "warm")
            engine_rate, engine_tokens = engine_decode_rate(engine, prompt, max_tokens, f"p{i}")
        finally:
            engine.stop()
        # Same token count as the engine produced (it may stop at EOS before max_tokens).
        raw_rate = raw_generate_step(raw.model, prompt, engine_tokens)
        pairs.append(
            {
                "engine_tok_s": engine_rate,
                "raw_tok_s": raw_rate,
                "tokens": engine_tokens,
                "ratio": engine_rate / raw_rate,
            }
        )
    ratios = [p["ratio"] for p in pairs]
    return {
        "max_tokens": max_tokens,
        "pairs": pairs,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "engine_tok_s_median": statistics.median(p["engine_tok_s"] for p in pairs),
        "raw_tok_s_median": statistics.median(p["raw_tok_s"] for p in pairs),
        "meets_0_95": statistics.median(ratios) >= 0.95,
    }


def actor_hop(quick: bool, out_dir: str) -> dict:
    """The serve layer's own hop measurement (tiny models, LocalSource vs ActorSource)."""
    script = os.path.join(os.path.dirname(__file__), "actor_hop.py")
    if not os.path.isfile(script):
        return {"available": False, "note": "scripts/bench/actor_hop.py not present; not measured"}
    out_json = os.path.join(out_dir, "actor_hop.json")
    cmd = [sys.executable, "-m", "scripts.bench.actor_hop", "--out", out_json]
    cmd += ["--requests", "4", "--max-tokens", "64", "--repeats", "1"] if quick else []
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"available": True, "command": " ".join(cmd[1:]), "error": "timed out after 600 s"}
    result = {
        "available": True,
        "command": "python " + " ".join(cmd[1:]),
        "returncode": proc.returncode,
        "stdout": proc.stdout[-8000:],
        "stderr_tail": proc.stderr[-2000:],
    }
    if proc.returncode == 0 and os.path.isfile(out_json):
        with open(out_json) as f:
            result["measured"] = json.load(f)
    return result


def run(
    quick: bool, target: str, draft: str, seed: int = 0, with_actor_hop: bool = True, out_dir: str = "results/overhead"
) -> dict:
    return {
        "scenario": "overhead",
        "quick": quick,
        "machine": bench_util.machine(),
        "scheduler_tick": scheduler_tick_overhead(target, draft, quick, seed),
        "engine_vs_raw": engine_vs_raw(target, quick, seed),
        "actor_hop": actor_hop(quick, out_dir) if with_actor_hop else {"available": False, "note": "skipped"},
    }


def report(result: dict) -> str:
    tick, evr = result["scheduler_tick"], result["engine_vs_raw"]
    lines = [
        "| measure | value |",
        "|---|---|",
        f"| scheduler time per tick, mean / median / p99 | {tick['mean_us']:.0f} / {tick['median_us']:.0f} / "
        f"{tick['p99_us']:.0f} us ({tick['ticks']} ticks) |",
        f"| scheduler share of tick time | {100 * tick['share_of_tick_time']:.2f} % |",
        f"| engine classic decode (median) | {evr['engine_tok_s_median']:.1f} tok/s |",
        f"| raw mlx-lm generate_step (median) | {evr['raw_tok_s_median']:.1f} tok/s |",
        f"| engine / raw, median (min..max) over {len(evr['pairs'])} pairs | {evr['ratio_median']:.3f} "
        f"({evr['ratio_min']:.3f}..{evr['ratio_max']:.3f}); >= 0.95: {evr['meets_0_95']} |",
    ]
    hop = result["actor_hop"]
    measured = hop.get("measured")
    if measured:
        for conc, us in sorted(measured.get("overhead_us_per_token", {}).items()):
            lines.append(f"| actor hop added per token, concurrency {conc} | {us:+.1f} us |")
        lines.append(f"| bare actor poll round trip | {measured.get('poll_round_trip_us', float('nan')):.0f} us |")
    else:
        lines.append(
            f"| actor hop | not measured: {hop.get('note') or hop.get('error') or hop.get('stderr_tail', '')[-200:]} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = bench_util.scenario_args(__doc__.split("\n\n")[0], "results/overhead")
    ap.add_argument("--no-actor-hop", action="store_true")
    args = ap.parse_args(argv)
    result = run(args.quick, args.target, args.draft, args.seed, with_actor_hop=not args.no_actor_hop, out_dir=args.out)
    text = report(result)
    bench_util.publish(args, "overhead", result, text)
    if result["actor_hop"].get("stdout"):
        print(result["actor_hop"]["stdout"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
