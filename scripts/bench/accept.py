"""Speculation at temperature > 0: the draft model's drafts accepted by token equality
(greedy drafts against the target's seeded sample) vs by rejection sampling (drafts
sampled from the draft's distribution, `models.speculative.rejection`).

    python -m scripts.bench.accept [--quick] [--repeats 3] [--out results/accept]

One stream at a time, speculation forced on (b1_policy "on"), the bundled pair, K = 4,
seeded requests. For each temperature the two rules alternate per prompt on one loaded
runner (the rule is the drafter's `sample_drafts`), and the whole set of prompts runs
`--repeats` times with fresh seeds. "accepted / round" = accepted drafts per full slot
round (probes excluded), the median over repeats of each repeat's total; tok/s = output
tokens / (finish - first token), the median over all runs; "tok/s ratio" = the median
over prompt pairs (the two rules' runs of one prompt, back to back) of rejection /
equality, which cancels most of a shared machine's swings.
"""

from __future__ import annotations

import statistics

import models  # noqa: F401
from scheduler.config import SchedulerConfig
from scripts.bench import metrics
from scripts.bench import util as bench_util
from scripts.bench.engine import Arrival, drive, load_runner, stream_tokens_per_s
from scripts.bench.prompts import token_prompts
from scripts.bench.single import full_rounds

RULES = {"equality": False, "rejection": True}  # DraftModelDrafter.sample_drafts


def run(quick: bool, target: str, draft: str, seed: int = 0, repeats: int = 3, k: int = 4) -> dict:
    temperatures = [0.7, 1.0]
    num_prompts = 2 if quick else 4
    max_tokens = 96 if quick else 192
    runner = load_runner(target, "draft_model", draft, num_draft_tokens=k)
    bench_util.warm_up(runner, runner.tokenizer)
    drafter = runner._slot.drafter
    prompts = token_prompts(runner.tokenizer, num_prompts, seed, num_tokens=64)
    config = SchedulerConfig(b1_policy="on", num_draft_tokens=k, tick_mode="alternate")
    rows = []
    for temperature in temperatures:
        per_rule = {rule: [] for rule in RULES}  # per repeat: accepted / round
        all_rates = {rule: [] for rule in RULES}
        pair_ratios = []
        for repeat in range(repeats):
            stats = {rule: [] for rule in RULES}
            rates = {rule: [] for rule in RULES}
            for i, prompt in enumerate(prompts):
                order = list(RULES) if (i + repeat) % 2 == 0 else list(RULES)[::-1]
                for rule in order:
                    drafter.sample_drafts = RULES[rule]
                    rid = f"{rule}{i}"
                    sampling = dict(temperature=temperature, seed=seed + 1000 * repeat + i)
                    rec = drive(runner, config, [Arrival(rid, prompt, max_tokens, sampling=sampling)]).records[rid]
                    stats[rule].append(rec["speculative"])
                    rates[rule].append(stream_tokens_per_s(rec))
            for rule in RULES:
                rounds = full_rounds(stats[rule])
                per_rule[rule].append(sum(s["accepted"] for s in stats[rule]) / rounds if rounds else 0.0)
                all_rates[rule] += rates[rule]
            pair_ratios += [r / e for r, e in zip(rates["rejection"], rates["equality"])]
        row = {"temperature": temperature, "k": k}
        for rule in RULES:
            row[f"{rule}_accepted_per_round"] = statistics.median(per_rule[rule])
            row[f"{rule}_tok_s"] = statistics.median(all_rates[rule])
            row[f"{rule}_repeats"] = per_rule[rule]
            row[f"{rule}_rates"] = all_rates[rule]
        row["tok_s_ratio"] = statistics.median(pair_ratios)
        row["tok_s_ratio_min"], row["tok_s_ratio_max"] = min(pair_ratios), max(pair_ratios)
        rows.append(row)
    drafter.sample_drafts = True
    runner.close()
    return {
        "scenario": "accept_rule",
        "quick": quick,
        "max_tokens": max_tokens,
        "num_prompts": num_prompts,
        "repeats": repeats,
        "machine": bench_util.machine(),
        "rows": rows,
    }


COLUMNS = [
    ("temperature", "T"),
    ("k", "K"),
    ("equality_accepted_per_round", "equality: accepted / round"),
    ("equality_tok_s", "equality tok/s"),
    ("rejection_accepted_per_round", "rejection: accepted / round"),
    ("rejection_tok_s", "rejection tok/s"),
    ("tok_s_ratio", "tok/s ratio (median pair)"),
    ("tok_s_ratio_min", "min"),
    ("tok_s_ratio_max", "max"),
]


def main(argv=None) -> int:
    parser = bench_util.scenario_args(__doc__.split("\n\n")[0], "results/accept")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = run(args.quick, args.target, args.draft, args.seed, args.repeats)
    text = metrics.table(result["rows"], COLUMNS, digits=2)
    bench_util.publish(args, "accept_rule", result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
