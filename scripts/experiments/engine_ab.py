"""Two engines of one config that differ in a few `args` (e.g. a knob on and off), in one
process, taking turns on the same bursts: N streams of `--prompts` prompts, `--tokens`
each; per configuration, output tok/s of each burst and the median, the median of the
bursts' mean TTFT, and A / B per pair of bursts. The first burst of each is a warm-up.
(docs/history/gpu-2026-12.md, "Fused projections"; docs/benchmarks.md, "SmolLM2-135M-Instruct".)

    python -m scripts.experiments.engine_ab --streams 4 --a '{"fused_projections": false}' --b '{}'
    python -m scripts.experiments.engine_ab --config configs/local.yaml --prompts chat --streams 1 \
        --tokens 64 --b '{"drafter": {"kind": "none"}}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import models  # noqa: E402,F401  (fast BLAS before mlx)

# isort: split
from scheduler.request import Request, SamplingParams  # noqa: E402
from scripts.bench.engine_load import engine_from_config  # noqa: E402
from scripts.bench.prompts import chat_messages, chat_questions, stdlib_snippets  # noqa: E402


def prompt_ids(codec, kind: str, streams: int, seed: int) -> list[list[int]]:
    """`streams` prompts: ~300-token code snippets (`snippets`, completions), chats asking to
    continue one (`code`) or everyday chat questions (`chat`), through the chat template."""
    if kind == "snippets":
        return [codec.encode(s)[:300] for s in stdlib_snippets(streams, seed=seed, num_chars=2400)]
    chats = chat_questions(streams, seed) if kind == "chat" else chat_messages(streams, seed)
    return [codec.encode_chat(m) for m in chats]


def burst(engine, prompts: list[list[int]], tag: str, tokens: int, temperature: float) -> tuple[float, float]:
    """(output tok/s, mean TTFT ms) of the `prompts` submitted at once."""
    streams = len(prompts)
    tic, firsts, done, count = time.perf_counter(), {}, 0, 0
    for i, ids in enumerate(prompts):
        engine.submit(Request(f"{tag}-{i}", ids, SamplingParams(max_tokens=tokens, temperature=temperature, seed=i)))
    while done < streams:
        for event in engine.get_events(timeout=1.0):
            count += len(event.token_ids)
            if event.token_ids and event.request_id not in firsts:
                firsts[event.request_id] = time.perf_counter() - tic
            if event.finish_reason:
                done += 1
    return count / (time.perf_counter() - tic), 1e3 * statistics.mean(firsts.values())


def tick_summary(snapshot: dict) -> str:
    """What an engine's ticks did over all its bursts: count and mean ms per action,
    the slot's and the rows' rounds and their drafted / accepted tokens."""
    counters = snapshot["counters"]
    ticks = ", ".join(
        f"{action} {n} x {1e3 * counters['tick_seconds'][action] / n:.1f} ms"
        for action, n in counters["actions"].items()
        if n
    )
    live = (snapshot.get("classic_steps") or {}).get("draft_costs")
    return (
        f"{ticks}; slot rounds {counters['spec_rounds']}, row rounds {counters['row_rounds']}, "
        f"accepted {counters['accepted_tokens']} of {counters['drafted_tokens']} drafted"
        + (f"; rows' draft costs {live}" if live else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bundled.yaml")
    ap.add_argument("--target", default=None, help="model (default: what --config serves)")
    ap.add_argument(
        "--prompts",
        choices=("snippets", "code", "chat"),
        default="snippets",
        help="snippets: code to complete; code: chats asking to continue code; chat: everyday questions",
    )
    ap.add_argument("--a", default="{}", help="configuration A's `args` overrides (JSON)")
    ap.add_argument("--b", default="{}", help="configuration B's `args` overrides (JSON)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=7, help="bursts per configuration, the first unmeasured")
    args = ap.parse_args()
    from scripts.bench.servers import config_models
    from serve_app.openai.codec import TextCodec

    target = args.target or config_models(args.config)[0]
    codec = TextCodec.from_path(target)
    engines = {
        "A": engine_from_config(args.config, target, json.loads(args.a))[0],
        "B": engine_from_config(args.config, target, json.loads(args.b))[0],
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    work: dict[str, str] = {}
    try:
        for r in range(args.rounds):
            for name in ("A", "B") if r % 2 else ("B", "A"):
                prompts = prompt_ids(codec, args.prompts, args.streams, seed=r)
                figures = burst(engines[name], prompts, f"{name}{r}", args.tokens, args.temperature)
                if r:
                    results[name].append(figures)
        work = {name: tick_summary(engine.snapshot()) for name, engine in engines.items()}
    finally:
        for engine in engines.values():
            engine.stop()
    for name, runs in results.items():
        print(
            f"{name} {getattr(args, name.lower())}: {args.streams} streams, T = {args.temperature}: tok/s "
            + " ".join(f"{rate:.0f}" for rate, _ in runs)
            + f"; median {statistics.median(rate for rate, _ in runs):.1f}, mean TTFT median "
            f"{statistics.median(ttft for _, ttft in runs):.0f} ms"
        )
        print(f"  {name} ticks: {work.get(name, '-')}")
    ratios = [a / b for (a, _), (b, _) in zip(results["A"], results["B"])]
    print(f"A / B per burst pair: {' '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
