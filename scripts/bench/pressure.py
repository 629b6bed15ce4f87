"""Scenario 3: sustained high-lane pressure; how long a normal-lane stream waits for grants.

    python -m scripts.bench.pressure [--quick] [--out results/pressure]

A long normal-lane stream takes the slot; from its first token on, two closed-loop
chains of high-lane speculative requests (each next request arrives when the previous
one of its chain finishes) keep the grant ring full. Grant order prefers the high lane, and
the skip cap (2) is the anti-starvation floor. Reported per `grant_rounds`: the
normal stream's gaps between consecutive grants of its own, counted in other grants
and in milliseconds (from the end of its grant to the start of its next one), its
grants and TTFT, and per-lane latency summaries.
"""

from __future__ import annotations

import math
import statistics

import models  # noqa: F401
from scheduler.config import SchedulerConfig
from scheduler.request import Lane
from scripts.bench import metrics
from scripts.bench import util as bench_util
from scripts.bench.engine import Arrival, drive, load_runner
from scripts.bench.prompts import token_prompts

GRANT_ROUNDS = (8, 2, 1)
SKIP_CAP = 2


def pressure_arrivals(tokenizer, normal_tokens: int, high_tokens: int, seed: int) -> list[Arrival]:
    chain_length = math.ceil(normal_tokens / high_tokens) + 2
    prompts = token_prompts(tokenizer, 2 * chain_length + 1, seed, num_tokens=64)
    # The normal stream starts first, so it is in the grant ring (not sent to classic
    # decode by a full ring) when the pressure begins with its first token.
    arrivals = [Arrival("n0", prompts[-1], normal_tokens, Lane.NORMAL)]
    for chain in range(2):
        previous = None
        for j in range(chain_length):
            rid = f"h{chain}.{j}"
            arrivals.append(
                Arrival(
                    rid,
                    prompts[chain * chain_length + j],
                    high_tokens,
                    Lane.HIGH,
                    after_tokens=1,
                    after_request=previous,
                )
            )
            previous = rid
    return arrivals


def grant_gaps(grants: list[dict], request_id: str, until_s: float) -> dict:
    """Gaps between `request_id`'s consecutive grants: other grants in between, and ms
    from the start of the grant after its own (= the end of its own) to its next one."""
    own = [i for i, g in enumerate(grants) if g["request_id"] == request_id and g["t_start"] <= until_s]
    in_grants = [b - a - 1 for a, b in zip(own, own[1:])]
    in_ms = [(grants[b]["t_start"] - grants[a + 1]["t_start"]) * 1000 for a, b in zip(own, own[1:]) if b > a + 1]
    return {
        "num_grants": len(own),
        "gap_grants": in_grants,
        "gap_ms": in_ms,
        "max_gap_grants": max(in_grants, default=None),
        "mean_gap_grants": statistics.fmean(in_grants) if in_grants else None,
        "max_gap_ms": max(in_ms, default=None),
        "mean_gap_ms": statistics.fmean(in_ms) if in_ms else None,
        "first_grant_index": own[0] if own else None,
    }


def run(quick: bool, target: str, draft: str, seed: int = 0, grant_rounds: tuple[int, ...] = GRANT_ROUNDS) -> dict:
    normal_tokens = 64 if quick else 256
    high_tokens = 16 if quick else 32
    runner = load_runner(target, "draft_model", draft, num_draft_tokens=4)
    bench_util.warm_up(runner, runner.tokenizer)
    arrivals = pressure_arrivals(runner.tokenizer, normal_tokens, high_tokens, seed)
    rows = []
    for budget in grant_rounds:
        config = SchedulerConfig(
            grant_rounds=budget, skip_cap=SKIP_CAP, b1_policy="on", num_draft_tokens=4, row_drafts=False
        )  # the slot's lanes and skip cap alone
        result = drive(runner, config, arrivals)
        normal = result.records["n0"]
        gaps = grant_gaps(result.grants, "n0", normal["finish_s"])
        during = [r for r in result.records.values() if r["arrival_s"] <= normal["finish_s"]]
        summary = metrics.summarize(during, normal["finish_s"])
        rows.append(
            {
                "grant_rounds": budget,
                "skip_cap": SKIP_CAP,
                **gaps,
                "normal_ttft_ms": metrics.per_request(normal)["ttft_s"] * 1000,
                "normal_tok_s": normal["output_tokens"] / metrics.per_request(normal)["e2el_s"],
                "normal_speculative": normal["speculative"],
                "high_mean_ttft_ms": summary["lanes"].get("high", {}).get("mean_ttft_ms"),
                "high_requests_during": sum(1 for r in during if r["lane"] == "high"),
                "classic_fallbacks": result.counters["classic_fallbacks"],
                "skip_escalations": result.counters["skip_escalations"],
                "grant_sequence": [g["request_id"] for g in result.grants],
                "summary": summary,
            }
        )
    runner.close()
    return {
        "scenario": "pressure",
        "quick": quick,
        "normal_tokens": normal_tokens,
        "high_tokens": high_tokens,
        "machine": bench_util.machine(),
        "rows": rows,
    }


COLUMNS = [
    ("grant_rounds", "grant_rounds"),
    ("num_grants", "normal grants"),
    ("max_gap_grants", "max gap (grants)"),
    ("mean_gap_grants", "mean gap (grants)"),
    ("max_gap_ms", "max gap ms"),
    ("mean_gap_ms", "mean gap ms"),
    ("normal_ttft_ms", "normal TTFT ms"),
    ("high_mean_ttft_ms", "high mean TTFT ms"),
    ("normal_tok_s", "normal tok/s"),
    ("skip_escalations", "skip-cap grants"),
]


def plot(result: dict, path: str) -> None:
    plt = bench_util.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for row in result["rows"]:
        ax.plot(
            range(1, len(row["gap_ms"]) + 1), row["gap_ms"], marker="o", label=f"grant_rounds={row['grant_rounds']}"
        )
    ax.set_xlabel("normal stream's n-th wait for the slot")
    ax.set_ylabel("ms between its grants")
    ax.set_title("Scenario 3: normal lane under high-lane pressure")
    ax.legend()
    bench_util.save_figure(fig, path)


def main(argv=None) -> int:
    args = bench_util.scenario_args(__doc__.split("\n\n")[0], "results/pressure").parse_args(argv)
    result = run(args.quick, args.target, args.draft, args.seed)
    text = metrics.table(result["rows"], COLUMNS, digits=1)
    bench_util.publish(args, "pressure", result, text, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
