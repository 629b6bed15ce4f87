"""Scenario 6: speculation under concurrency, fused tick vs alternating tick vs classic.

    python -m scripts.bench.concurrency [--quick] [--drafter ngram|draft_model] [--workload code|random]
                                        [--out results/concurrency]

A closed loop of concurrency N (N = 1, 2, 4, 8, 16; quick: 1, 2, 4), as `vllm bench
serve --max-concurrency N` runs one: N greedy requests of held-out stdlib code start
together and each one that finishes is replaced by the next, `--waves` x N requests
in all, each asking for 0.5-1.5 x `max_tokens` (seeded; as in real traffic, streams
do not all end in the same tick), in-process (engine level: the scheduler over `MlxRunner`, no HTTP). Per N, three configurations run back to back, interleaved over
`--repeats` rounds on the same loaded runner:
- `default`: the scheduling `configs/local.yaml` ships: `tick_mode: fused` (the slot
  holder's verify rides in the batch's forward), B=1 policy auto (the measured
  tick-cost gate), classic rows verifying their own n-gram drafts (`row_drafts`);
- `slot_only`: the same without row drafts: only the slot holder speculates;
- `alternate`: the seed's strict alternation, B=1 policy on, no row drafts;
- `classic`: B=1 policy off, every stream a classic row (the ratios' baseline);
- `classic_batchgen`: the same on a second runner whose classic rows run in mlx-lm's
  `BatchGenerator` (`MlxRunner(slab_batch=False)`), the batch the runner used before the
  slab (`models.batch.slab_batch`): what the slab costs or gains plain batching.
`--configs`: a subset of the configurations, or `replica` (`default` with
`replica_drafts`) and `budget` (`default` with `draft_step_share: 0.5`).
`--workload repeat`: every code prompt asked twice, the second time at least N arrivals
later (usually after the first has left: an agent that re-asks), configurations `default`, `replica` (the same with
`replica_drafts`: rows draft from the replica's past outputs) and `classic`.
`--workload random`: prompts of random token ids, every request sampled at temperature
1.0 with its own seed: text in which drafts never land, so speculation can only cost
(what the cost gate and the rows' budgets must keep near 1.0x).
`--workload mixed`: the code prompts, the even-numbered requests greedy and the odd ones
sampled at `--temperature` (0.7 unless given) with their own seeds: one replica serving
both kinds, whose drafts land at different rates.
Reported per configuration: aggregate output tok/s (tokens / wall time from the first
arrival to the last finish), median per-request TPOT, speculative rounds per request,
Jain's index over those rounds (last repeat), and the paired ratio to classic (median over
repeats of the per-repeat ratio). Outputs (greedy, or seeded) are checked to have the
same lengths in every configuration.
"""

from __future__ import annotations

import random
import statistics

import models  # noqa: F401  (fast BLAS before mlx)
from models.speculative.drafter_kinds import DRAFTERS
from scheduler.config import SchedulerConfig
from scripts.bench import metrics
from scripts.bench import util as bench_util
from scripts.bench.engine import Arrival, drive, load_runner
from scripts.bench.prompts import token_prompts

CONFIGS = {
    "default": dict(tick_mode="fused", b1_policy="auto"),
    "slot_only": dict(tick_mode="fused", b1_policy="auto", row_drafts=False),
    "alternate": dict(tick_mode="alternate", b1_policy="on", row_drafts=False),
    "classic": dict(b1_policy="off"),
    "classic_batchgen": dict(b1_policy="off"),
}
# `default` on a runner set otherwise: drafts from past outputs; a step draft budget of half a step
REPLICA = {"replica": dict(tick_mode="fused", b1_policy="auto")}
BUDGET = {"budget": dict(tick_mode="fused", b1_policy="auto")}
SAMPLED = {"sampled": dict(tick_mode="fused", b1_policy="auto")}  # rows at temperature > 0 draft too
# `default` without shadow rounds: an unmeasured row is granted the slot to find out what it accepts
UNSHADOWED = {"unshadowed": dict(tick_mode="fused", b1_policy="auto", shadow_rounds=False)}
NAMED = {**CONFIGS, **REPLICA, **BUDGET, **SAMPLED, **UNSHADOWED}
ON_BATCHGEN = {"classic_batchgen"}  # configurations run on the BatchGenerator runner


def one_run(
    runner,
    name: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    grant_rounds: int,
    with_tokens: bool = False,
    temperature: float = 0.0,
    mixed: bool = False,
) -> dict:
    """One closed-loop run; `with_tokens`: also each prompt's output tokens
    (`token_ids`, in prompt order); `temperature` > 0: request i samples with seed i
    (`mixed`: the odd-numbered requests only, the others greedy)."""
    config = SchedulerConfig(
        num_draft_tokens=runner.num_draft_tokens,
        grant_rounds=grant_rounds,
        max_batch_size=max(16, concurrency),
        **NAMED[name],
    )
    if name not in ON_BATCHGEN:
        runner.replica_drafts = False  # a fresh index for each run
        runner.replica_drafts = name in REPLICA
        runner.draft_step_share = 0.5 if name in BUDGET else 0.0
        runner.sampled_row_drafts = name in SAMPLED
    lengths = random.Random(len(prompts)).choices(range(max_tokens // 2, 3 * max_tokens // 2 + 1), k=len(prompts))
    arrivals = [
        Arrival(
            f"s{i}",
            p,
            n,
            after_finishes=max(i - concurrency + 1, 0),
            sampling=dict(temperature=temperature, seed=i) if temperature and (i % 2 or not mixed) else {},
        )
        for i, (p, n) in enumerate(zip(prompts, lengths))
    ]
    result = drive(runner, config, arrivals)
    records = list(result.records.values())
    summary = metrics.summarize(records, result.duration_s)
    rounds = [
        ((r["speculative"] or {}).get("rounds") or 0) - ((r["speculative"] or {}).get("probe_rounds") or 0)
        for r in records
    ]
    return {
        "aggregate_tok_s": summary["output_throughput"],
        "median_tpot_ms": summary["median_tpot_ms"],
        "rounds": rounds,
        "jain_rounds": metrics.jain_index(rounds),
        "acceptance_length": summary["acceptance_length"],
        "fused_ticks": result.counters.get("actions", {}).get("fused", 0),
        "slot_rounds": result.counters.get("spec_rounds", 0),
        "row_rounds": result.counters.get("row_rounds", 0),
        "outputs": {
            r["request_id"]: r["output_tokens"] for r in ({"request_id": k, **v} for k, v in result.records.items())
        },
        **({"token_ids": [result.token_ids.get(a.request_id, []) for a in arrivals]} if with_tokens else {}),
    }


def random_prompts(tokenizer, num_prompts: int, seed: int, num_tokens: int = 64) -> list[list[int]]:
    """Prompts of uniformly random ordinary token ids: text in which no draft lands."""
    rng = random.Random(seed)
    special = set(getattr(tokenizer, "all_special_ids", []) or []) | set(tokenizer.eos_token_ids)
    ordinary = [t for t in range(tokenizer.vocab_size) if t not in special]
    return [rng.choices(ordinary, k=num_tokens) for _ in range(num_prompts)]


def run(
    quick: bool,
    target: str,
    draft: str,
    drafter: str,
    repeats: int,
    waves: int,
    seed: int = 0,
    workload: str = "code",
    configs: list[str] | None = None,
    temperature: float | None = None,
) -> dict:
    """`temperature`: every request's (seeded; `mixed`: the odd-numbered ones'); None: the workload's (1.0
    random, 0.7 mixed, else greedy)."""
    if temperature is None:
        temperature = {"random": 1.0, "mixed": 0.7}.get(workload, 0.0)
    streams = [1, 2, 4] if quick else [1, 2, 4, 8, 16]
    max_tokens = 64 if quick else 128
    runner = load_runner(target, drafter, draft, num_draft_tokens=4, max_batch_size=max(streams))
    batchgen = load_runner(target, drafter, draft, num_draft_tokens=4, max_batch_size=max(streams), slab_batch=False)
    bench_util.warm_up(runner, runner.tokenizer)
    bench_util.warm_up(batchgen, batchgen.tokenizer)
    runner.tick_costs()  # measured once per replica at load, not inside a timed run
    rows = []
    names = configs or (["default", "replica", "classic"] if workload == "repeat" else list(CONFIGS))
    names = [n for n in names if n != "classic"] + ["classic"]  # the ratios' baseline always runs
    for n in streams:
        if workload == "random":
            prompts = random_prompts(runner.tokenizer, n * waves, seed + n)
        elif workload == "repeat":  # every prompt twice, the second time at least n arrivals later
            half = token_prompts(runner.tokenizer, max(n, n * waves // 2), seed + n, num_tokens=64)
            prompts = half + half
        else:
            prompts = token_prompts(runner.tokenizer, n * waves, seed + n, num_tokens=64)
        runs = {name: [] for name in names}
        for _ in range(repeats):
            for name in names:  # interleaved: machine drift hits every configuration alike
                on = batchgen if name in ON_BATCHGEN else runner
                runs[name].append(
                    one_run(
                        on,
                        name,
                        prompts,
                        n,
                        max_tokens,
                        grant_rounds=8,
                        temperature=temperature,
                        mixed=workload == "mixed",
                    )
                )
        ratios = {
            name: [f["aggregate_tok_s"] / c["aggregate_tok_s"] for f, c in zip(runs[name], runs["classic"])]
            for name in names
            if name != "classic"
        }
        for name, results in runs.items():
            rows.append(
                {
                    "streams": n,
                    "config": name,
                    "aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in results),
                    "median_tpot_ms": statistics.median(r["median_tpot_ms"] for r in results),
                    "rounds_per_stream": statistics.median(sum(r["rounds"]) / len(r["rounds"]) for r in results),
                    "jain_rounds": results[-1]["jain_rounds"],
                    "acceptance_length": results[-1]["acceptance_length"],
                    "fused_ticks": results[-1]["fused_ticks"],
                    "ratio_vs_classic": statistics.median(ratios[name]) if name in ratios else 1.0,
                    "ratio_min": min(ratios[name]) if name in ratios else 1.0,
                    "same_lengths": all(r["outputs"] == runs["classic"][0]["outputs"] for r in results),
                    "runs": results,
                }
            )
    long_rows = [long_streams(runner, n, 2 * max_tokens, seed) for n in (2, 3, 4)] if workload == "code" else []
    return {
        "scenario": "concurrency",
        "temperature": temperature,
        "quick": quick,
        "drafter": drafter,
        "workload": workload,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "waves": waves,
        "machine": bench_util.machine(),
        "rows": rows,
        "long_streams": long_rows,
    }


def long_streams(runner, n: int, max_tokens: int, seed: int) -> dict:
    """n long greedy requests of equal length, arriving together, in the default
    configuration: does every stream speculate, and evenly (Jain over rounds)?"""
    prompts = token_prompts(runner.tokenizer, n, seed + 100 + n, num_tokens=64)
    config = SchedulerConfig(
        num_draft_tokens=runner.num_draft_tokens, grant_rounds=8, max_batch_size=16, **CONFIGS["default"]
    )
    result = drive(runner, config, [Arrival(f"l{i}", p, max_tokens) for i, p in enumerate(prompts)])
    specs = [r["speculative"] or {} for r in result.records.values()]
    rounds = [(s.get("rounds") or 0) - (s.get("probe_rounds") or 0) for s in specs]
    return {
        "streams": n,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "jain_rounds": metrics.jain_index(rounds),
        "slot_rounds": result.counters.get("spec_rounds", 0),
        "row_rounds": result.counters.get("row_rounds", 0),
        "aggregate_tok_s": metrics.summarize(list(result.records.values()), result.duration_s)["output_throughput"],
    }


COLUMNS = [
    ("streams", "streams"),
    ("config", "config"),
    ("aggregate_tok_s", "aggregate tok/s"),
    ("ratio_vs_classic", "/ classic (median)"),
    ("ratio_min", "/ classic (min)"),
    ("median_tpot_ms", "TPOT p50 ms"),
    ("rounds_per_stream", "spec rounds / stream"),
    ("jain_rounds", "Jain (rounds)"),
    ("acceptance_length", "accept len"),
    ("fused_ticks", "fused ticks"),
]


LONG_COLUMNS = [
    ("streams", "streams"),
    ("max_tokens", "tokens each"),
    ("rounds", "spec rounds per stream"),
    ("jain_rounds", "Jain (rounds)"),
    ("slot_rounds", "slot rounds"),
    ("row_rounds", "row rounds"),
    ("aggregate_tok_s", "aggregate tok/s"),
]


def plot(result: dict, path: str) -> None:
    plt = bench_util.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name in CONFIGS:
        rows = [r for r in result["rows"] if r["config"] == name]
        ax.plot([r["streams"] for r in rows], [r["aggregate_tok_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title(f"engine, {result['drafter']} drafter, T = {result.get('temperature', 0.0)}")
    ax.legend()
    bench_util.save_figure(fig, path)


def main(argv=None) -> int:
    ap = bench_util.scenario_args(__doc__.split("\n\n")[0], "results/concurrency")
    ap.add_argument("--drafter", choices=list(DRAFTERS), default="ngram", help="default: what configs/local.yaml ships")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds (default 2 quick, 3 full)")
    ap.add_argument("--waves", type=int, default=None, help="requests per concurrency slot (default 3 quick, 4 full)")
    ap.add_argument(
        "--workload",
        choices=["code", "random", "repeat", "mixed"],
        default="code",
        help="code: greedy stdlib code (drafts land); random: random-token prompts at "
        "temperature 1.0, seeded (drafts never land); repeat: the code prompts, each "
        "asked twice (configurations default, replica, classic); mixed: the code "
        "prompts, every other request sampled at --temperature (0.7 unless given)",
    )
    ap.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated configurations (of {', '.join(NAMED)}; "
        "default: "
        "all of CONFIGS, or default,replica,classic for --workload repeat)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="every request's temperature, seeded (default: the workload's, 1.0 random, 0.7 mixed, else 0)",
    )
    args = ap.parse_args(argv)
    configs = args.configs.split(",") if args.configs else None
    unknown = set(configs or ()) - set(NAMED)
    if unknown:
        ap.error(f"unknown configurations: {', '.join(sorted(unknown))}")
    repeats = args.repeats or (2 if args.quick else 3)
    waves = args.waves or (3 if args.quick else 4)
    result = run(
        args.quick,
        args.target,
        args.draft,
        args.drafter,
        repeats,
        waves,
        args.seed,
        args.workload,
        configs,
        args.temperature,
    )
    text = metrics.table([{k: v for k, v in r.items() if k != "runs"} for r in result["rows"]], COLUMNS, digits=2)
    if result["long_streams"]:
        text += "\n\nLong streams, default configuration (equal lengths, arriving together):\n\n"
        text += metrics.table(result["long_streams"], LONG_COLUMNS, digits=2)
    bench_util.publish(args, "concurrency", result, text, plot)
    return 0 if all(r["same_lengths"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
