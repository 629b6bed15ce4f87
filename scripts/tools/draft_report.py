"""The README.md `scripts.tools.train_draft` writes beside a draft, from its provenance record."""

from __future__ import annotations


def commands(record: dict) -> list[str]:
    """The commands that made the draft: an --init draft's own first, then the data
    command where the data was read from an earlier run, then the training command."""
    lines = []
    earlier = record.get("continued_from")
    if earlier:
        lines += [
            *commands(earlier),
            f"# then, continuing that draft on new data (--init: where it was written, {earlier['args']['out']}):",
        ]
    if "command" in record["data"]:
        lines += [record["data"]["command"], "# then, on the data that command kept:"]
    return [*lines, record["command"]]


def readme(record: dict) -> str:
    """What the draft is, how it was made, how well it drafts, and the command again."""
    d, t, training = record["draft"], record["target"], record["training"]
    shape = " / ".join(
        str(d["config"][k])
        for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    )
    quantized = f", {d['bits']}-bit (groups of {d['group_size']})" if d["bits"] else ""
    cost = record["decode_step_ms"]
    facts = [
        ("shape (layers / hidden / MLP / heads / KV heads)", shape),
        (
            "parameters",
            f"{d['parameters']:,} ({d['embedding_parameters'] / d['parameters']:.0%} in the tied embedding)",
        ),
        ("weights", f"{d['weight_file_bytes'] / 1e6:.1f} MB, {d['dtype']}{quantized}"),
        (
            "training data",
            f"{record['data']['examples']} continuations, {record['data']['completion_tokens']:,} target tokens",
        ),
        (
            "training",
            f"{training['steps_run']} steps (stopped by {training['stopped_by']}), "
            f"loss {training['loss_first']} -> {training['loss_last']}",
        ),
        *(
            [
                (
                    "output head",
                    f"cut to the {record['draft_vocab']['ids']:,} most frequent target tokens, "
                    f"{record['draft_vocab']['coverage']:.1%} of the training data's (draft_vocab.json)",
                )
            ]
            if record.get("draft_vocab")
            else []
        ),
        (
            f"one decode step on {record['device']}",
            f"draft {cost['draft']} ms, target {cost['target']} ms ({cost['draft_over_target']:.2f}x)",
        ),
    ]
    acceptance = [
        f"| {kind} | {e['prompts']} | {e['positions']} | {e['agreement']:.3f} | "
        f"{e['accepted_per_round_k2']:.2f} | {e['accepted_per_round_k4']:.2f} | "
        f"{e['accepted_per_round_k6']:.2f} |"
        for kind, e in record["held_out_acceptance"].items()
    ]
    lines = [
        f"# Draft model for {t['source']}",
        "",
        "Trained by `scripts/tools/train_draft.py` from the target's own continuations (target",
        f"fingerprint `{t['fingerprint']}`). Serve it as the target's draft model:",
        "",
        "```yaml",
        "drafter: {kind: draft_model, path: <this directory>}",
        "```",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in facts),
        "",
        "Greedy agreement with the target along its greedy continuations of held-out prompts, and",
        "simulated accepted drafts per round at K = 2, 4, 6:",
        "",
        "| prompts | n | positions | agreement | K=2 | K=4 | K=6 |",
        "|---|---|---|---|---|---|---|",
        *acceptance,
        "",
        f"Command (seed {record['seed']}, {record['device']}, mlx {record['versions']['mlx']}):",
        "",
        "```",
        *commands(record),
        "```",
        "",
        "`provenance.json` holds the full record.",
    ]
    return "\n".join(lines) + "\n"
