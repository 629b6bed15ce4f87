"""Scenario 1: one stream, classic vs speculative, K sweep, both drafters.

    python -m scripts.bench.single [--quick] [--with-auto] [--out results/single]

For each drafter and K, the same prompts run classic (B=1 policy "off": the same
runner and weights, speculative disabled) and speculative (policy "on"), alternating
classic/speculative per prompt; the ratio is taken per pair and then summarized.
`--with-auto` adds a third run per prompt under the adaptive policy ("auto", what
`configs/*.yaml` ship), as a replica runs it once settled: one policy per drafter and K
is first profiled on `b1_profile_requests` other prompts (unmeasured), then serves the
measured ones. Its ratio to classic shows whether the policy keeps a stream at least as
fast as classic decode; "auto est" is its speedup estimate and "auto spec rounds" the
full rounds it chose.
Reported rate = output tokens / (finish - first token): decode speed, prefill excluded.
"""

from __future__ import annotations

import statistics

import models  # noqa: F401
from scheduler.adaptive import B1Policy
from scheduler.config import SchedulerConfig
from scripts.bench import metrics
from scripts.bench import util as bench_util
from scripts.bench.engine import Arrival, drive, load_runner, stream_tokens_per_s
from scripts.bench.prompts import token_prompts


def run(quick: bool, target: str, draft: str, seed: int = 0, with_auto: bool = False) -> dict:
    ks = [2, 4] if quick else [1, 2, 3, 4, 6, 8]
    num_prompts = 2 if quick else 4
    max_tokens = 96 if quick else 256
    rows = []
    for drafter in ("draft_model", "ngram"):
        for k in ks:
            runner = load_runner(target, drafter, draft, num_draft_tokens=k)
            bench_util.warm_up(runner, runner.tokenizer)
            prompts = token_prompts(runner.tokenizer, num_prompts, seed, num_tokens=64)
            auto_policy = settled_policy(runner, k, max_tokens, seed) if with_auto else None
            pairs = []
            for i, prompt in enumerate(prompts):
                pair = {}
                modes = [("classic", "off"), ("speculative", "on")] + ([("auto", "auto")] if with_auto else [])
                for mode, policy in modes:
                    # The B=1 policy ("auto") judges the alternating tick; a lone stream
                    # runs the same either way.
                    config = SchedulerConfig(b1_policy=policy, num_draft_tokens=k, tick_mode="alternate")
                    result = drive(
                        runner,
                        config,
                        [Arrival(f"{mode}{i}", prompt, max_tokens)],
                        policy=auto_policy if mode == "auto" else None,
                    )
                    rec = result.records[f"{mode}{i}"]
                    pair[mode] = {
                        "tokens_per_s": stream_tokens_per_s(rec),
                        "output_tokens": rec["output_tokens"],
                        "speculative": rec["speculative"],
                        "ttft_ms": metrics.per_request(rec)["ttft_s"] * 1000,
                    }
                pair["ratio"] = pair["speculative"]["tokens_per_s"] / pair["classic"]["tokens_per_s"]
                if with_auto:
                    pair["auto_ratio"] = pair["auto"]["tokens_per_s"] / pair["classic"]["tokens_per_s"]
                pairs.append(pair)
            spec = [p["speculative"]["speculative"] for p in pairs]
            rounds = full_rounds(spec)
            row = {
                "drafter": drafter,
                "k": k,
                "classic_tok_s": statistics.median(p["classic"]["tokens_per_s"] for p in pairs),
                "spec_tok_s": statistics.median(p["speculative"]["tokens_per_s"] for p in pairs),
                "ratio_median": statistics.median(p["ratio"] for p in pairs),
                "ratio_min": min(p["ratio"] for p in pairs),
                "ratio_max": max(p["ratio"] for p in pairs),
                "acceptance_length": sum(s["accepted"] for s in spec) / rounds + 1 if rounds else None,
                "output_tokens": [p["speculative"]["output_tokens"] for p in pairs],
                "pairs": pairs,
            }
            if with_auto:
                row["auto_ratio_median"] = statistics.median(p["auto_ratio"] for p in pairs)
                row["auto_ratio_min"] = min(p["auto_ratio"] for p in pairs)
                row["auto_spec_rounds"] = full_rounds([p["auto"]["speculative"] for p in pairs])
                row["auto_estimate"] = auto_policy.measurement.speedup
                row["auto_enabled"] = auto_policy.should_run()
            rows.append(row)
            runner.close()
    return {
        "scenario": "single_stream",
        "quick": quick,
        "max_tokens": max_tokens,
        "num_prompts": num_prompts,
        "machine": bench_util.machine(),
        "rows": rows,
    }


def full_rounds(stats: list[dict]) -> int:
    """The slot's rounds other than probes (not rows' own verifies), over requests'
    `speculative` usage."""
    return sum(s["rounds"] - s["probe_rounds"] - s.get("row_rounds", 0) for s in stats)


def settled_policy(runner, k: int, max_tokens: int, seed: int) -> B1Policy:
    """An "auto" policy profiled the way a replica's is: its first requests run the slot
    (probe rounds, then real rounds) until it has a verdict. Prompts differ from the
    measured ones."""
    config = SchedulerConfig(b1_policy="auto", num_draft_tokens=k, tick_mode="alternate")
    policy = B1Policy.from_config(config, runner.policy_key())
    for j, prompt in enumerate(token_prompts(runner.tokenizer, config.b1_profile_requests, seed + 1, num_tokens=64)):
        drive(runner, config, [Arrival(f"profile{j}", prompt, max_tokens)], policy=policy)
    if not policy.settled:
        raise RuntimeError(f"the policy did not settle after {config.b1_profile_requests} requests")
    return policy


COLUMNS = [
    ("drafter", "drafter"),
    ("k", "K"),
    ("classic_tok_s", "classic tok/s"),
    ("spec_tok_s", "spec tok/s"),
    ("ratio_median", "ratio (median)"),
    ("ratio_min", "min"),
    ("ratio_max", "max"),
    ("acceptance_length", "accept len"),
]
AUTO_COLUMNS = [
    ("auto_estimate", "auto est"),
    ("auto_enabled", "auto on"),
    ("auto_ratio_median", "auto / classic (median)"),
    ("auto_ratio_min", "auto min"),
    ("auto_spec_rounds", "auto spec rounds"),
]


def plot(result: dict, path: str) -> None:
    plt = bench_util.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter in ("draft_model", "ngram"):
        rows = [r for r in result["rows"] if r["drafter"] == drafter]
        ax.plot([r["k"] for r in rows], [r["ratio_median"] for r in rows], marker="o", label=drafter)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("speculative / classic decode tok/s")
    ax.set_title("Scenario 1: single stream")
    ax.legend()
    bench_util.save_figure(fig, path)


def main(argv=None) -> int:
    parser = bench_util.scenario_args(__doc__.split("\n\n")[0], "results/single")
    parser.add_argument(
        "--with-auto", action="store_true", help="also run each prompt under the adaptive policy (b1_policy auto)"
    )
    args = parser.parse_args(argv)
    result = run(args.quick, args.target, args.draft, args.seed, with_auto=args.with_auto)
    text = metrics.table(result["rows"], COLUMNS + (AUTO_COLUMNS if args.with_auto else []), digits=2)
    bench_util.publish(args, "single_stream", result, text, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
