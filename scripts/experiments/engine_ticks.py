"""The engine as the scheduler actor runs it (its own thread, `scheduler.engine.Engine`),
without Ray or HTTP: the load generator's closed-loop workload at each `--streams`, and
per run the client's TPOT beside the scheduler's own tick times by action (the
`tick_seconds` tallies `/metrics` exports as `specslot_scheduler_tick_seconds`).

Set beside `gpu_ticks.py` (the same scheduler ticked on the calling thread) and beside a
server's runs (`scripts/bench/vs_mlx_lm.py` prints the same tick times per run), it says
whether a slower step over HTTP comes from the engine's thread or from the service
around it.

    python3 -m scripts.experiments.engine_ticks --target /tmp/specslot-q15 \\
        --config "configs/gpu.yaml:drafter={kind: ngram}" --streams 1 4 --repeats 3 --temperature 0.7
"""

from __future__ import annotations

import argparse


def tick_state(engine) -> dict:
    """The engine's tick tallies in the shape `bench_vs_mlx_lm.tick_delta` reads from a
    server's /metrics."""
    state = engine.snapshot()
    return {
        "tick_count": state["counters"]["actions"],
        "tick_sum": state["counters"]["tick_seconds"],
        "gap_s": state["tick_gap_seconds"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--config", default="configs/gpu.yaml:drafter={kind: ngram}")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-chars", type=int, default=600)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()

    from scripts.bench.engine_load import engine_from_config, run_engine_load
    from scripts.bench.loadgen import LoadConfig
    from scripts.bench.vs_mlx_lm import tick_delta, tick_line
    from serve_app.openai.codec import TextCodec

    engine, info = engine_from_config(args.config, args.target)
    codec, eos = TextCodec.from_path(args.target), info["eos_token_ids"]
    try:
        run_engine_load(
            engine,
            codec,
            eos,
            LoadConfig(base_url="", num_prompts=2, concurrency=2, max_tokens=8, seed=999, progress=False),
        )
        for rep in range(args.repeats):
            for streams in args.streams:
                before = tick_state(engine)
                cfg = LoadConfig(
                    base_url="",
                    num_prompts=args.requests_per_stream * streams,
                    concurrency=streams,
                    max_tokens=args.tokens,
                    seed=1000 * streams + rep,
                    temperature=args.temperature,
                    prompt_chars=args.prompt_chars,
                    ignore_eos="off",
                    progress=False,
                )
                summary = run_engine_load(engine, codec, eos, cfg)["summary"]
                ticks = tick_delta(before, tick_state(engine))
                print(
                    f"engine thread, {streams} streams, repeat {rep}: {summary['output_throughput']:.1f} tok/s, "
                    f"TPOT p50 {summary['median_tpot_ms']:.2f} ms{tick_line(ticks)}",
                    flush=True,
                )
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
