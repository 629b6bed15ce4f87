"""What a round's drafting costs with a draft model as the runner loads it (dense weights,
fused projections where they apply, the head cut by its draft_vocab.json): `propose` of K
tokens through mlx-lm's forward against the compiled, bucketed steps of `draft_compiled`,
the drafts of both compared, at a few history lengths. (docs/models.md, "Compiled draft
steps".)

    python -m scripts.experiments.draft_steps --draft models/drafts/smollm2 --k 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import models  # noqa: F401  (fast BLAS before mlx on a CPU)

# isort: split
from models.loading import dense_weights, draft_vocab, fused_projections  # noqa: E402
from models.loading.loader import load_model  # noqa: E402
from models.speculative.drafters import DraftModelDrafter  # noqa: E402

ROUNDS = 40


def propose_ms(drafter: DraftModelDrafter, history: list[int], start: int, k: int) -> tuple[float, list]:
    """Median milliseconds of `propose` over ROUNDS rounds from `start` tokens of
    `history` (each round one token further, all drafts rejected), and the drafts."""
    state = drafter.new_state(history[:start])
    times, drafts = [], []
    for i in range(ROUNDS):
        tic = time.perf_counter()
        drafts.append(drafter.propose(state, history[: start + 1 + i], k))
        times.append(time.perf_counter() - tic)
        drafter.rollback(state, k, 0)
    return statistics.median(times[5:]) * 1e3, drafts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="models/drafts/smollm2")
    ap.add_argument("--k", type=int, default=2, help="drafts a round (default 2)")
    ap.add_argument("--starts", default="200,700,1500", help="history lengths the rounds start at")
    args = ap.parse_args()
    loaded = load_model(args.draft, role="draft")
    dense_weights.apply(loaded.model, loaded.name, None)
    fused_projections.apply(loaded.model, loaded.name, None)
    rows = draft_vocab.apply(loaded.model, loaded.path, loaded.name, True)
    vocab = loaded.model.args.vocab_size
    starts = [int(s) for s in args.starts.split(",")]
    history = [(7 * i + 3) % vocab for i in range(max(starts) + ROUNDS + 1)]
    plain = DraftModelDrafter(loaded.model, loaded.name)
    compiled = DraftModelDrafter(loaded.model, loaded.name)
    compiled.compile_forwards(0)
    tic = time.perf_counter()
    count = compiled.warm((1, 2), max(starts) + ROUNDS + args.k)
    print(f"{loaded.name}: head {rows or 'whole'} rows; {count} compiled shapes in {time.perf_counter() - tic:.2f} s")
    print("| history | mlx-lm forward ms | compiled ms | same drafts |\n|---|---|---|---|")
    for start in starts:
        a, da = propose_ms(plain, history, start, args.k)
        b, db = propose_ms(compiled, history, start, args.k)
        print(f"| {start} | {a:.2f} | {b:.2f} | {sum(x == y for x, y in zip(da, db))} / {ROUNDS} |")


if __name__ == "__main__":
    main()
