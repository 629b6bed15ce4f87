"""What `models.cpu_math` does to prompt processing on a CPU: one engine, MLX's own
softmax and SiLU against `cpu_math`'s, alternating in the same process (so both see the
same machine minute by minute).

Per round and per side, one request at a time, `max_tokens` 1, time from `submit` to the
event carrying the first token: a fresh prompt of 76, 466 and 900 random tokens, and a
cached turn (the 466-token prompt again plus 76 new tokens: the prefix cache serves the
466). The first two rounds are not counted.

    python scripts/experiments/cpu_prefill.py [--config configs/local.yaml] [--rounds 16]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, HERE)

import models  # noqa: E402,F401  (fast BLAS before mlx)
import mlx.core as mx  # noqa: E402
from mlx_lm.models import activations  # noqa: E402

from models import cpu_math  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from scripts.engine_load import engine_from_config, first_token  # noqa: E402

CASES = ("fresh 76", "fresh 466", "cached turn (466 + 76)", "fresh 900")


def use(fast: bool) -> None:
    """Both kernels of the process to one side, in every mlx-lm module that holds one."""
    mx.fast.scaled_dot_product_attention = cpu_math.attention if fast else cpu_math._MLX_SDPA
    cpu_math._bind_swiglu(cpu_math.swiglu if fast else cpu_math._MLX_LM_SWIGLU)
    assert activations.swiglu is (cpu_math.swiglu if fast else cpu_math._MLX_LM_SWIGLU)


def first_token_s(engine, ids: list[int], request_id: str) -> float:
    took, final = first_token(engine, Request(request_id, ids, SamplingParams(max_tokens=1)))
    if final.error:
        raise RuntimeError(final.error)
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/local.yaml")
    ap.add_argument("--target", default=os.path.join(HERE, "models", "bundled", "target"))
    ap.add_argument("--rounds", type=int, default=16)
    args = ap.parse_args()
    engine, _ = engine_from_config(args.config, args.target, {})
    if not cpu_math.install():
        print("not on a CPU: cpu_math is not in use here", file=sys.stderr)
        return 2
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(3, 2000) for _ in range(n)]  # noqa: E731
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for k in range(args.rounds):
            sides = ("cpu_math", "mlx") if k % 2 else ("mlx", "cpu_math")
            for side in sides:
                use(side == "cpu_math")
                base = tokens(466)
                run = [("fresh 76", tokens(76)), ("fresh 466", base), ("cached turn (466 + 76)", base + tokens(76)),
                       ("fresh 900", tokens(900))]
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


if __name__ == "__main__":
    raise SystemExit(main())
