"""Where a multi-turn conversation's time to first token goes, tick by tick, on the engine
thread (no Ray, no HTTP): scenario 7's conversations (`scripts/bench/multiturn.py`) on the
engine CONFIG builds, with every tick's start, end and action recorded.

A turn's TTFT, from its `submit` to the moment the conversation's thread reads the event
with its first token, is split into:
- `in flight`: the rest of the tick that was running when the turn arrived;
- `other ticks`: the ticks after that one and before the tick that gave the turn its first
  token, by action (another conversation's decode, speculative round or prefill);
- `own tick`: the tick that prefilled the turn and sampled its first token (`with` how
  many other turns' prefills on average: turns that arrive together prefill together);
- `read`: from that tick's end to the event read.

Rows: turn 1 (nothing cached), and turns 2 on (the history cached, unless the cache is off).

    python -m scripts.experiments.turn_trace [--config configs/bundled.yaml[:key=value,...]] [--repeats 2]
    # on the H200 (after `source scripts/device_env.sh`), histories to ~4,400 tokens:
    python3 -m scripts.experiments.turn_trace --target "$MODEL" \\
        --config "configs/gpu.yaml:model=$MODEL,drafter={kind: ngram},first_tokens=2000,turn_tokens=380,max_tokens=64"
"""

from __future__ import annotations

import argparse
import bisect
import os
import statistics
import time
from collections import Counter

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402,F401  (fast BLAS before mlx)

# isort: split
from scripts.bench import multiturn as bench_multiturn  # noqa: E402
from scripts.bench.vs_mlx_lm import parse_config_spec  # noqa: E402

TARGET = os.path.join(HERE, "models", "bundled", "target")


class Recorder:
    """Wraps a started engine's `submit` and its scheduler's `tick` (both called with the
    engine's own objects, so nothing else changes): when each request was submitted, per
    tick (start, end, action, how many requests got their first token in it), and the
    index of the tick that gave each request its first token."""

    def __init__(self, engine) -> None:
        self.submitted: dict[str, float] = {}
        self.ticks: list[tuple[float, float, str, int]] = []
        self.starts: list[float] = []  # the ticks' starts, for bisecting
        self.first_tick: dict[str, int] = {}
        scheduler = engine._scheduler
        submit, tick = engine.submit, scheduler.tick

        def timed_submit(request) -> None:
            self.submitted[request.request_id] = time.perf_counter()
            submit(request)

        def timed_tick():
            start = time.perf_counter()
            events = tick()
            end = time.perf_counter()
            decision = scheduler.last_decision
            firsts = {e.request_id for e in events if e.token_ids and e.request_id not in self.first_tick}
            for request_id in firsts:
                self.first_tick[request_id] = len(self.ticks)
            self.ticks.append((start, end, "idle" if decision is None else decision.action.value, len(firsts)))
            self.starts.append(start)
            return events

        engine.submit = timed_submit
        scheduler.tick = timed_tick


def split_turn(recorder: Recorder, request_id: str, ttft_s: float) -> dict | None:
    """One turn's TTFT in parts (ms), or None when its first-token tick was not seen."""
    submitted = recorder.submitted[request_id]
    ticks = recorder.ticks
    own = recorder.first_tick.get(request_id)
    if own is None:
        return None
    first = bisect.bisect_right(recorder.starts, submitted)  # the first tick to start after the submit
    parts = {
        "in flight": 0.0,
        "own tick": 1e3 * (ticks[own][1] - ticks[own][0]),
        "with": ticks[own][3] - 1,
        "own action": ticks[own][2],
        "in flight action": None,
    }
    if first > 0 and ticks[first - 1][1] > submitted and first - 1 < own:
        parts["in flight"] = 1e3 * (ticks[first - 1][1] - submitted)
        parts["in flight action"] = ticks[first - 1][2]
    for start, end, action, _ in ticks[first:own]:
        key = f"other: {action}"
        parts[key] = parts.get(key, 0.0) + 1e3 * (end - start)
    parts["read"] = 1e3 * (submitted + ttft_s - ticks[own][1])
    parts["ttft"] = 1e3 * ttft_s
    return parts


def table(rows: dict[str, list[dict]]) -> str:
    keys = (
        ["ttft", "in flight"]
        + sorted({k for parts in rows.values() for p in parts for k in p if k.startswith("other")})
        + ["own tick", "with", "read"]
    )
    actions = {
        name: (Counter(p["in flight action"] for p in parts), Counter(p["own action"] for p in parts))
        for name, parts in rows.items()
    }
    lines = [
        "| turns | n | "
        + " | ".join(f"{k}, mean ms" if k != "with" else "other turns in own tick" for k in keys)
        + " |",
        "|---|---|" + "---|" * len(keys),
    ]
    for name, parts in rows.items():
        if parts:
            lines.append(
                f"| {name} | {len(parts)} | "
                + " | ".join(f"{statistics.mean(p.get(k, 0.0) for p in parts):.1f}" for k in keys)
                + " |"
            )
    for name, (in_flight, own) in actions.items():
        lines.append(
            f"turns {name}: the tick in flight at arrival {dict(in_flight)} (None: none), the own tick {dict(own)}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bundled.yaml", metavar="PATH[:key=value,...]")
    ap.add_argument("--target", default=TARGET, help="the tokenizer's model directory")
    ap.add_argument("--repeats", type=int, default=2, help="runs of fresh conversations (a warm-up run first)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from scripts.bench.engine_load import engine_from_config

    path, overrides = parse_config_spec(args.config)
    size, ours = bench_multiturn.split_sizes(False, args.repeats, overrides)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    engine, _ = engine_from_config(path, args.target, ours)
    try:
        warm = bench_multiturn.user_texts(tokenizer, 1, 2, 64, 16, args.seed + 999)
        bench_multiturn.engine_conversations(engine, tokenizer, warm, 1, 4, run_id="warm")
        recorder = Recorder(engine)
        rows: dict[str, list[dict]] = {"1": [], "2 on": []}
        for rep in range(size["repeats"]):
            conversations = bench_multiturn.user_texts(
                tokenizer,
                size["num_conversations"],
                size["num_turns"],
                size["first_tokens"],
                size["turn_tokens"],
                args.seed + rep,
            )
            records = bench_multiturn.engine_conversations(
                engine, tokenizer, conversations, size["concurrency"], size["max_tokens"], run_id=f"rep{rep}"
            )
            for r in records:
                request_id = f"rep{rep}-c{r['conversation']}t{r['turn'] - 1}"
                parts = split_turn(recorder, request_id, r["ttft_s"]) if r["ttft_s"] else None
                if parts is not None:
                    rows["1" if r["turn"] == 1 else "2 on"].append(parts)
    finally:
        engine.stop()
    print(
        f"{path} {ours}: {size['num_conversations']} conversations x {size['num_turns']} turns at concurrency "
        f"{size['concurrency']}, {size['repeats']} repeats; first message {size['first_tokens']} tokens, then "
        f"{size['max_tokens']}-token replies and {size['turn_tokens']}-token messages"
    )
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
