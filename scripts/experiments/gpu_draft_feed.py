"""A draft model's round on a GPU, by how its first step feeds the tokens the draft has not
seen: one token (a round after a rejection), two in one forward (after a round that
accepted everything: mlx-lm runs causal attention over a key length that is new every
round), or the two as one-token steps (what `DraftModelDrafter` does on a GPU,
`ONE_AT_A_TIME_FEED`). Each round then takes three one-token steps; the passes run over
the same key lengths twice, so the second pass of each kind finds its kernels built.
(docs/gpu.md, "Known issues".)

    python3 -m scripts.experiments.gpu_draft_feed --draft models/drafts/smollm2
"""

from __future__ import annotations

import argparse
import statistics
import time

import models  # noqa: F401  (fast BLAS before mlx on a CPU)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402


def round_times(model, feed: str, prompt_tokens: int, rounds: int) -> list[float]:
    """Milliseconds of each round: the first step as `feed` says, then three one-token steps."""
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(100, 100 + prompt_tokens))]), cache=cache))
    times = []
    for r in range(rounds):
        tic = time.perf_counter()
        if feed == "two":
            logits = model(mx.array([[5 + r, 6 + r]]), cache=cache)
        elif feed == "two, one at a time":
            model(mx.array([[5 + r]]), cache=cache)
            logits = model(mx.array([[6 + r]]), cache=cache)
        else:
            logits = model(mx.array([[5 + r]]), cache=cache)
        token = mx.argmax(logits[0, -1])
        for _ in range(3):
            token = mx.argmax(model(token.reshape(1, 1), cache=cache)[0, -1])
        mx.eval(token)
        times.append((time.perf_counter() - tic) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="models/drafts/smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=40)
    args = ap.parse_args()
    model, _ = load(args.draft)
    print(f"device {mx.default_device()}, mlx {mx.__version__}, draft {args.draft}")
    for feed in ("one", "two", "two, one at a time", "two", "one"):
        times = round_times(model, feed, args.prompt_tokens, args.rounds)
        print(
            f"first step feeds {feed}: first rounds {[round(t, 1) for t in times[:5]]} ms, "
            f"median of the rest {statistics.median(times[10:]):.2f} ms"
        )


if __name__ == "__main__":
    main()
