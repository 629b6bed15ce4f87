"""Where the speculative slot's time to first token goes (made for the lent H200).

Runs the engine loop (`scripts.bench.engine.drive`, b1 policy on, 1 stream at a time) on
the bundled pair in fresh child processes, each serving three requests one after the
other: a 64-token prompt (as `bench_engine --streams 1`), a 97-token prompt (a prompt
length the process has not met), then the 64-token prompt again. Per request: TTFT,
TPOT, the runner time of `spec_begin` and of the first and the slowest round. Per
process: load and warm-up seconds.

Modes: "before" = plain mlx-lm prefill, shape warm-up only (the first measured code,
except that both modes verify 1 + K positions to the end); "after" = compiled chunked
prefill and the end-to-end warm requests at load. "cold"
children get empty kernel caches (MLX_PTX_CACHE_DIR, CUDA_CACHE_PATH), as the first
process on a fresh machine does.

    python -m scripts.experiments.gpu_ttft --out DIR       # writes DIR/gpu_ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PLAN = [  # (mode, drafter, cache dir tag, cold?)
    ("before", "ngram", "a", True),
    ("before", "ngram", "a", False),
    ("before", "draft_model", "a", False),
    ("after", "ngram", "b", True),
    ("after", "ngram", "b", False),
    ("after", "draft_model", "b", False),
]


class CallLog:
    """Proxy recording (method, request_id, seconds) of every speculative runner call."""

    def __init__(self, runner):
        self._runner = runner
        self.calls: list[tuple[str, str, float]] = []

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if name not in ("spec_begin", "spec_round"):
            return attr

        def logged(arg, *a, **kw):
            tic = time.perf_counter()
            try:
                return attr(arg, *a, **kw)
            finally:
                rid = arg.request_id if hasattr(arg, "request_id") else arg
                self.calls.append((name, rid, time.perf_counter() - tic))

        return logged


def child(mode: str, drafter: str, max_tokens: int) -> dict:
    import mlx.core as mx

    import models  # noqa: F401  (fast BLAS before mlx)
    from models.loading.loader import load_pair
    from models.runner import MlxRunner
    from models.speculative.drafters import DraftModelDrafter, NgramDrafter
    from scheduler.config import SchedulerConfig
    from scripts.bench import metrics
    from scripts.bench.engine import DRAFT, TARGET, Arrival, drive
    from scripts.bench.prompts import token_prompts

    tic = time.perf_counter()
    target, draft = load_pair(
        os.path.join(HERE, TARGET), os.path.join(HERE, DRAFT) if drafter == "draft_model" else None
    )
    mx.eval(target.model.parameters())
    load_s = time.perf_counter() - tic
    handle = DraftModelDrafter(draft.model, draft.name) if drafter == "draft_model" else NgramDrafter()
    tic = time.perf_counter()
    after = mode == "after"
    on_cpu = mx.default_device() == mx.cpu  # CPU: a quick smoke run of the same path
    runner = MlxRunner(
        target,
        handle,
        num_draft_tokens=4,
        fast_verify=True,
        warm_positions=256 if on_cpu else None,
        prefill_chunk=128 if after else 0,
        warm_session=after,
    )
    warm_s = time.perf_counter() - tic
    p64 = token_prompts(runner.tokenizer, 1, 0, 64)[0]
    p97 = token_prompts(runner.tokenizer, 1, 1, 97)[0]
    arrivals = [
        Arrival("r0", p64, max_tokens),
        Arrival("r1", p97, max_tokens, after_request="r0"),
        Arrival("r2", p64, max_tokens, after_request="r1"),
    ]
    log = CallLog(runner)
    run = drive(log, SchedulerConfig(grant_rounds=8, b1_policy="on", num_draft_tokens=4), arrivals)
    out = {
        "mode": mode,
        "drafter": drafter,
        "device": str(mx.default_device()),
        "fast_verify": runner.fast_verify,
        "load_s": load_s,
        "runner_init_s": warm_s,
        "requests": {},
    }
    for rid, rec in run.records.items():
        m = metrics.per_request(rec)
        calls = [(name, s) for name, r, s in log.calls if r == rid]
        rounds = [s for name, s in calls if name == "spec_round"]
        out["requests"][rid] = {
            "prompt_tokens": rec["prompt_tokens"],
            "output_tokens": rec["output_tokens"],
            "ttft_ms": m["ttft_s"] * 1e3,
            "tpot_ms": (m["tpot_s"] or 0) * 1e3,
            "tok_per_s": rec["output_tokens"] / m["e2el_s"],
            "begin_ms": sum(s for name, s in calls if name == "spec_begin") * 1e3,
            "first_round_ms": rounds[0] * 1e3 if rounds else None,
            "max_round_ms": max(rounds) * 1e3 if rounds else None,
            "median_round_ms": sorted(rounds)[len(rounds) // 2] * 1e3 if rounds else None,
            "rounds": len(rounds),
            "speculative": rec["speculative"],
        }
    runner.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "DRAFTER"))
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], args.child[1], args.max_tokens)), flush=True)
        return 0
    scratch = tempfile.mkdtemp(prefix="gpu_ttft_")
    results = []
    for mode, drafter, tag, cold in PLAN:
        env = dict(
            os.environ,
            MLX_PTX_CACHE_DIR=os.path.join(scratch, tag, "ptx"),
            CUDA_CACHE_PATH=os.path.join(scratch, tag, "nv"),
        )
        tic = time.perf_counter()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "scripts.experiments.gpu_ttft",
                "--child",
                mode,
                drafter,
                "--max-tokens",
                str(args.max_tokens),
            ],
            env=env,
            cwd=HERE,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - tic
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{mode} {drafter} cold={cold} FAILED rc={proc.returncode}\n{proc.stderr[-3000:]}", flush=True)
            continue
        res = json.loads(lines[-1][7:])
        res.update(cold=cold, process_wall_s=wall)
        results.append(res)
        print(
            f"== {mode} {drafter} cold={cold}: load {res['load_s']:.2f} s, runner init (warm) "
            f"{res['runner_init_s']:.2f} s, process {wall:.1f} s",
            flush=True,
        )
        for rid, r in res["requests"].items():
            print(
                f"   {rid} prompt {r['prompt_tokens']}: TTFT {r['ttft_ms']:.1f} ms (begin {r['begin_ms']:.1f}), "
                f"TPOT {r['tpot_ms']:.2f} ms, {r['tok_per_s']:.1f} tok/s, rounds {r['rounds']} "
                f"(first {r['first_round_ms']:.2f}, median {r['median_round_ms']:.2f}, max {r['max_round_ms']:.2f} ms)",
                flush=True,
            )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_ttft.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
