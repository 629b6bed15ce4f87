"""What `models.platform.cpu_math` does to prompt processing on a CPU: one engine, MLX's own
softmax and SiLU against `cpu_math`'s, alternating in the same process (so both see the
same machine minute by minute).

Per round and per side, one request at a time, `max_tokens` 1, time from `submit` to the
event carrying the first token: a fresh prompt of 76, 466 and 900 random tokens, and a
cached turn (the 466-token prompt again plus 76 new tokens: the prefix cache serves the
466). The first two rounds are not counted.

    python -m scripts.experiments.cpu_prefill [--config configs/bundled.yaml] [--rounds 16]

`--bare`: no engine, `cpu_math` on: the forwards alone of scenario 7's turns 2-6
(`scripts/bench/multiturn.py`, prompts of 466-871 tokens), each turn's prompt fresh in one
slab forward against its last 76 tokens over the rest cached, in a slab of 4 rows (the
others 300 positions long, as at concurrency 4); median of `--rounds`, the two taking
turns. Their ratio is the prefix cache's at that turn with nothing else counted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import models  # noqa: E402,F401  (fast BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.models import activations  # noqa: E402

from models.platform import cpu_math  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from scripts.bench.engine_load import engine_from_config, first_token  # noqa: E402

CASES = ("fresh 76", "fresh 466", "cached turn (466 + 76)", "fresh 900")


def use(fast: bool) -> None:
    """Both kernels of the process to one side, in every mlx-lm module that holds one."""
    mx.fast.scaled_dot_product_attention = cpu_math.attention if fast else cpu_math._MLX_SDPA
    cpu_math._bind_swiglu(cpu_math.swiglu if fast else cpu_math._MLX_LM_SWIGLU)
    assert activations.swiglu is (cpu_math.swiglu if fast else cpu_math._MLX_LM_SWIGLU)


def random_tokens():
    """tokens(n): n random ids of the bundled vocabulary, one seeded stream per call."""
    rng = random.Random(0)
    return lambda n: [rng.randrange(3, 2000) for _ in range(n)]


def first_token_s(engine, ids: list[int], request_id: str) -> float:
    took, final = first_token(engine, Request(request_id, ids, SamplingParams(max_tokens=1)))
    if final.error:
        raise RuntimeError(final.error)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/bundled.yaml")
    ap.add_argument("--target", default=os.path.join(HERE, "models", "bundled", "target"))
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--bare", action="store_true", help="the turns' forwards alone, no engine")
    args = ap.parse_args()
    if args.bare:
        return bare(args.target, args.rounds)
    engine, _ = engine_from_config(args.config, args.target, {})
    if not cpu_math.install():
        print("not on a CPU: cpu_math is not in use here", file=sys.stderr)
        return 2
    tokens = random_tokens()
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for k in range(args.rounds):
            sides = ("cpu_math", "mlx") if k % 2 else ("mlx", "cpu_math")
            for side in sides:
                use(side == "cpu_math")
                base = tokens(466)
                run = [
                    ("fresh 76", tokens(76)),
                    ("fresh 466", base),
                    ("cached turn (466 + 76)", base + tokens(76)),
                    ("fresh 900", tokens(900)),
                ]
                for case, ids in run:
                    took = first_token_s(engine, ids, f"r{k}-{side}-{case}")
                    if k >= 2:
                        times.setdefault((side, case), []).append(took)
            print(f"round {k + 1}/{args.rounds}", file=sys.stderr, flush=True)
    finally:
        use(True)
        engine.stop()
    print("| prompt | MLX's kernels, ms (median) | cpu_math, ms (median) | speed-up |")
    print("|---|---|---|---|")
    for case in CASES:
        slow, fast = (statistics.median(times[(side, case)]) for side in ("mlx", "cpu_math"))
        print(f"| {case} | {1000 * slow:.1f} | {1000 * fast:.1f} | {slow / fast:.2f}x |")
    return 0


TURN_PROMPTS = (466, 562, 665, 766, 871)  # scenario 7's prompt at turns 2-6
TURN_TOKENS = 76  # each turn's new tokens: the reply's end and the next user message


def bare(target: str, rounds: int) -> int:
    """Each turn's fresh prompt in one slab forward against its new tokens over the rest."""
    import time

    from models.forward.slab import Slab
    from models.loading.loader import load_model

    if not cpu_math.install():
        print("not on a CPU: cpu_math is not in use here", file=sys.stderr)
        return 2
    model = load_model(target).model  # float32 on a CPU, as the runner loads it
    mx.eval(model.parameters())
    tokens = random_tokens()

    def forward_s(cached: int, new: int) -> float:
        slab = Slab(model, rows=4)
        rows = [slab.add() for _ in range(4)]
        slab.reserve(1024)  # no growth inside the timed forward (the engine's slab keeps its room)
        for row in rows[1:]:
            slab.forward(model, [(row, tokens(300))], last_only=True)
        if cached:
            slab.forward(model, [(rows[0], tokens(cached))], last_only=True)
        mx.eval(slab.arrays())
        tic = time.perf_counter()
        out = slab.forward(model, [(rows[0], tokens(new))], last_only=True)
        mx.eval([x for x in out if x is not None], slab.arrays())
        return time.perf_counter() - tic

    times: dict[tuple[int, str], list[float]] = {}
    for k in range(rounds + 2):
        for prompt in TURN_PROMPTS:
            sides = (("fresh", 0, prompt), ("cached", prompt - TURN_TOKENS, TURN_TOKENS))
            for side, cached, new in sides if k % 2 else sides[::-1]:
                took = forward_s(cached, new)
                if k >= 2:
                    times.setdefault((prompt, side), []).append(took)
        print(f"round {k + 1}/{rounds + 2}", file=sys.stderr, flush=True)
    print(f"| turn | prompt tokens | fresh, ms (median) | {TURN_TOKENS} new over the rest cached, ms | ratio |")
    print("|---|---|---|---|---|")
    for turn, prompt in enumerate(TURN_PROMPTS, start=2):
        fresh, cached = (statistics.median(times[(prompt, side)]) for side in ("fresh", "cached"))
        print(f"| {turn} | {prompt} | {1000 * fresh:.1f} | {1000 * cached:.1f} | {fresh / cached:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
