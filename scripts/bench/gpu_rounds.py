"""Speculative round mechanics vs classic decode, single stream (made for the lent H200).

Measures, per random-weight Llama size: classic decode (ours: `GeneratorBatch`; mlx-lm's
pipelined `generate_step`; a synchronised step loop), then `SpeculativeSession` with an
ORACLE drafter (replays the target's own greedy continuation, each draft token corrupted
with probability 1 - alpha; no draft cost) on the plain path ("before") and the
bucketed compiled path ("after"): K sweep at alpha = 0.8, alpha sweep at K = 4, per-round
phase breakdown. Then the trained bundled pair with real drafters (draft model, n-gram)
against classic, with the adaptive policy's verdict; then float32 greedy parity.

    python -m scripts.bench.gpu_rounds --out DIR            # full (GPU)
    python -m scripts.bench.gpu_rounds --quick --out DIR    # tiny shapes, runs on CPU too

Writes DIR/gpu_bench.json and DIR/gpu_bench.md. The oracle is a benchmark tool only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import models  # noqa: E402,F401  (fast BLAS before mlx.core)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from models.batch.generator_batch import GeneratorBatch  # noqa: E402
from models.forward.bucketed import BucketedForward  # noqa: E402
from models.loading.loader import load_pair  # noqa: E402
from models.speculative.drafters import DrafterBase, DraftModelDrafter, NgramDrafter  # noqa: E402
from models.speculative.session import SpeculativeSession  # noqa: E402
from scheduler.adaptive import estimate_speedup, verdict_enabled  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402

SIZES = {  # hidden, layers, intermediate, heads, kv heads (vocab 32000, tied)
    "tiny": (64, 2, 128, 4, 2),
    "125M": (768, 12, 3072, 12, 4),
    "400M": (1024, 24, 4096, 16, 8),
    "1B": (2048, 16, 8192, 32, 8),
}


def random_llama(size: str, dtype) -> llama.Model:
    h, n, inter, heads, kv = SIZES[size]
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=h,
        num_hidden_layers=n,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        rms_norm_eps=1e-5,
        vocab_size=32000,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


class OracleDrafter(DrafterBase):
    """Benchmark-only drafter: the target's greedy continuation `ref`, each token
    replaced by a wrong one with probability 1 - alpha (seeded)."""

    kind = "oracle"

    def __init__(self, ref: list[int], prompt_len: int, alpha: float, vocab: int, seed: int = 0):
        self.ref, self.prompt_len, self.alpha, self.vocab = ref, prompt_len, alpha, vocab
        self.name = f"oracle-{alpha}"
        self.rng = random.Random(seed)

    def new_state(self, prompt_ids):
        return None

    def propose(self, state, history, k):
        p = len(history) - self.prompt_len  # ref[p] follows the pending token
        out = self.ref[p : p + k]
        return [t if self.rng.random() < self.alpha else (t + 1) % self.vocab for t in out]

    def rollback(self, state, num_drafted, num_accepted):
        return None


def classic_ours(model, prompt, n, eos=()):
    """(tokens, seconds per decoded token) through GeneratorBatch, one row."""
    batch = GeneratorBatch(model, eos_token_ids=eos, max_batch_size=1, prefill_batch_size=1)
    req = Request("c", list(prompt), SamplingParams(max_tokens=n))
    out = list(batch.prefill([req])[0].token_ids)
    tic = time.perf_counter()
    done = False
    while not done:
        for b in batch.decode():
            out += b.token_ids
            done = b.finish_reason is not None
    dt = time.perf_counter() - tic
    batch.remove("c")
    batch.close()
    return out, dt / max(len(out) - 1, 1)


def classic_mlxlm(model, prompt, n):
    gen = generate_step(mx.array(prompt), model, max_tokens=n)
    next(gen)
    tic = time.perf_counter()
    count = sum(1 for _ in gen)
    return (time.perf_counter() - tic) / max(count, 1)


def classic_sync(model, prompt, n):
    cache = make_prompt_cache(model)
    y = mx.argmax(model(mx.array([prompt]), cache=cache)[:, -1], axis=-1)
    mx.eval(y)
    tic = time.perf_counter()
    for _ in range(n - 1):
        y = mx.argmax(model(y.reshape(1, 1), cache=cache)[:, -1], axis=-1)
        y.item()
    return (time.perf_counter() - tic) / max(n - 1, 1)


def spec_run(model, prompt, drafter, k, n, verifier=None, eos=(), probes=0):
    s = SpeculativeSession(
        "s", model, prompt, SamplingParams(max_tokens=n), num_draft_tokens=k, eos_token_ids=eos, verifier=verifier
    )
    s.bind(drafter)
    out = list(s.begin().token_ids)
    probe_s = []
    for _ in range(probes):  # shaped like the adaptive policy's probes
        r = s.step(probe=True)
        out += r.token_ids
        probe_s.append(r.seconds_per_token)
    for key in s.counters.phase_seconds:
        s.counters.phase_seconds[key] = 0.0
    rounds = drafted = accepted = 0
    emitted = 0
    tic = time.perf_counter()
    while not s.finished:
        r = s.step()
        out += r.token_ids
        emitted += len(r.token_ids)
        rounds += 1
        drafted += r.num_drafted
        accepted += r.num_accepted
    dt = time.perf_counter() - tic
    phases = {key: v / max(rounds, 1) * 1e3 for key, v in s.counters.phase_seconds.items()}
    s.finish()
    return {
        "tokens": out,
        "s_per_token": dt / max(emitted, 1),
        "rounds": rounds,
        "round_ms": dt / max(rounds, 1) * 1e3,
        "tokens_per_round": emitted / max(rounds, 1),
        "acceptance": accepted / max(drafted, 1),
        "phase_ms": phases,
        "probe_ms": (sorted(probe_s)[len(probe_s) // 2] * 1e3) if probe_s else None,
    }


def log(*a):
    print(*a, flush=True)


def bench_random(size, args, rep):
    model = random_llama(size, mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32)
    prompt = [(i * 7919) % 31999 + 1 for i in range(args.prompt)]
    n = args.tokens
    classic_ours(model, prompt, 16)
    ref, ours = classic_ours(model, prompt, n + 16)
    classic_mlxlm(model, prompt, 16)
    mlxlm = classic_mlxlm(model, prompt, n)
    sync = classic_sync(model, prompt, n)
    row = {
        "size": size,
        "classic_ours_ms": ours * 1e3,
        "classic_mlxlm_ms": mlxlm * 1e3,
        "classic_sync_ms": sync * 1e3,
        "runs": [],
    }
    log(f"[{size}] classic ours {ours * 1e3:.2f} ms/tok, mlx-lm generate_step {mlxlm * 1e3:.2f}, sync {sync * 1e3:.2f}")
    verifier = BucketedForward(model)
    max_pos = len(prompt) + n + 16
    tic = time.perf_counter()
    shapes = verifier.warm(sorted({1} | {k + 1 for k in args.ks}), max_pos, head="every")
    row["warm"] = {"shapes": shapes, "seconds": time.perf_counter() - tic}
    plan = [("after", k, 0.8) for k in args.ks] + [("after", 4, a) for a in args.alphas]
    plan += [("before", k, 0.8) for k in args.before_ks] + [("uncompiled", 4, 0.8)]
    uncompiled = BucketedForward(model, compile=False)
    for path, k, alpha in plan:
        drafter = OracleDrafter(ref, len(prompt), alpha, 32000, seed=k)
        ntok = args.before_tokens if path == "before" else n
        v = {"after": verifier, "uncompiled": uncompiled, "before": None}[path]
        if path == "uncompiled":  # bucketed shapes without mx.compile: JIT fix alone
            spec_run(model, prompt, OracleDrafter(ref, len(prompt), alpha, 32000), k, 32, v)
        try:
            r = spec_run(model, prompt, drafter, k, ntok, v)
        except Exception as exc:  # keep the rest of the run's numbers
            log(f"[{size}] {path} K={k} a={alpha} FAILED: {exc!r}")
            continue
        diverged = r["tokens"] != ref[: len(r["tokens"])]
        rec = {
            "path": path,
            "K": k,
            "alpha": alpha,
            "tokens": ntok,
            "ms_per_token": r["s_per_token"] * 1e3,
            "speedup_vs_ours": ours / r["s_per_token"],
            "speedup_vs_mlxlm": mlxlm / r["s_per_token"],
            "round_ms": r["round_ms"],
            "tokens_per_round": r["tokens_per_round"],
            "acceptance": r["acceptance"],
            "phase_ms": r["phase_ms"],
            "diverged_from_ref": diverged,
        }
        row["runs"].append(rec)
        log(
            f"[{size}] {path} K={k} a={alpha}: {rec['ms_per_token']:.2f} ms/tok "
            f"x{rec['speedup_vs_ours']:.2f} ours x{rec['speedup_vs_mlxlm']:.2f} mlx-lm; round {r['round_ms']:.2f} ms "
            f"{r['tokens_per_round']:.2f} tok/round acc {r['acceptance']:.2f} phases "
            + " ".join(f"{p}={v:.2f}" for p, v in r["phase_ms"].items())
            + (" DIVERGED" if diverged else "")
        )
    rep["random"].append(row)
    del model, verifier


def bench_bundled(args, rep, dtype_name):
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    tgt, dft = load_pair(os.path.join(here, "models/bundled/target"), os.path.join(here, "models/bundled/draft"))
    dtype = getattr(mx, dtype_name)
    for m in (tgt.model, dft.model):
        m.set_dtype(dtype)
    texts = [
        'import os\nimport sys\n\n\ndef main(argv):\n    """',
        "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n",
        'def _splitext(p, sep, altsep, extsep):\n    """Split the extension from a pathname.\n',
    ]
    prompts = [tgt.tokenizer.encode(t) for t in texts]
    n = args.bundled_tokens
    # Stop tokens are ignored so every run decodes n tokens (same work for each path).
    classic_ours(tgt.model, prompts[0], 16)
    refs, ours = [], []
    for p in prompts:
        ref, s = classic_ours(tgt.model, p, n)
        refs.append(ref)
        ours.append(s)
    ours_s = sum(ours) / len(ours)
    mlxlm = sum(classic_mlxlm(tgt.model, p, n) for p in prompts) / len(prompts)
    out = {"dtype": dtype_name, "classic_ours_ms": ours_s * 1e3, "classic_mlxlm_ms": mlxlm * 1e3, "runs": []}
    log(f"[bundled {dtype_name}] classic ours {ours_s * 1e3:.2f} ms/tok mlx-lm {mlxlm * 1e3:.2f}")
    vt, vd = BucketedForward(tgt.model), BucketedForward(dft.model)
    max_pos = max(len(p) for p in prompts) + n + 16
    vt.warm(sorted({1} | {k + 1 for k in args.bundled_ks}), max_pos)
    vt.warm(sorted({1} | {k + 1 for k in args.bundled_ks}), max_pos, head="every")
    vd.warm((1, 2), max_pos, head="last")
    for kind in ("draft_model", "ngram"):
        for path in ("before", "after"):
            for k in args.bundled_ks:
                if path == "before" and k not in args.before_ks:
                    continue
                agg = {"s": 0.0, "tok": 0, "rounds": 0, "acc": 0.0, "round_ms": 0.0, "probe": [], "match": True}
                for p, ref in zip(prompts, refs):
                    d = (
                        DraftModelDrafter(dft.model, "d", fast=vd if path == "after" else None)
                        if kind == "draft_model"
                        else NgramDrafter()
                    )
                    r = spec_run(tgt.model, p, d, k, n, vt if path == "after" else None, probes=3)
                    agg["s"] += r["s_per_token"]
                    agg["acc"] += r["acceptance"]
                    agg["round_ms"] += r["round_ms"]
                    agg["rounds"] += r["rounds"]
                    agg["tok"] += r["tokens_per_round"]
                    agg["probe"].append(r["probe_ms"])
                    agg["match"] &= r["tokens"] == ref[: len(r["tokens"])]
                m = len(prompts)
                s_tok = agg["s"] / m
                round_s = agg["round_ms"] / m / 1e3
                acc_per_round = agg["tok"] / m - 1
                probe_s = sorted(agg["probe"])[m // 2] / 1e3
                est_probe = estimate_speedup(acc_per_round, probe_s, round_s)
                est_true = estimate_speedup(acc_per_round, ours_s, round_s)
                rec = {
                    "drafter": kind,
                    "path": path,
                    "K": k,
                    "ms_per_token": s_tok * 1e3,
                    "speedup_vs_ours": ours_s / s_tok,
                    "speedup_vs_mlxlm": mlxlm / s_tok,
                    "tokens_per_round": agg["tok"] / m,
                    "acceptance": agg["acc"] / m,
                    "round_ms": round_s * 1e3,
                    "probe_ms": probe_s * 1e3,
                    "policy_speedup_from_probes": est_probe,
                    "policy_enabled_from_probes": verdict_enabled(est_probe, True),
                    "policy_speedup_true_classic": est_true,
                    "matches_classic": agg["match"],
                }
                out["runs"].append(rec)
                log(
                    f"[bundled {dtype_name}] {kind} {path} K={k}: {rec['ms_per_token']:.2f} ms/tok x{rec['speedup_vs_ours']:.2f} ours "
                    f"x{rec['speedup_vs_mlxlm']:.2f} mlx-lm; {rec['tokens_per_round']:.2f} tok/round, round {rec['round_ms']:.2f} ms "
                    f"probe {rec['probe_ms']:.2f} ms -> policy est x{est_probe:.2f} "
                    f"({'on' if rec['policy_enabled_from_probes'] else 'off'}); matches classic: {agg['match']}"
                )
    rep["bundled"].append(out)


def parity_random(args, rep):
    """float32 greedy parity of the fast path on a random model: oracle rounds at alpha 0.8."""
    size = "tiny" if args.quick else "125M"
    model = random_llama(size, mx.float32)
    res = []
    for i in range(3):
        prompt = [(i * 31 + j * 7919) % 31999 + 1 for j in range(20 + 13 * i)]
        ref, _ = classic_ours(model, prompt, 96)
        for k in (2, 4, 7):
            r = spec_run(
                model, prompt, OracleDrafter(ref, len(prompt), 0.8, 32000, seed=i), k, 96, BucketedForward(model)
            )
            res.append(r["tokens"] == ref)
    rep["parity_random_f32"] = {"size": size, "cases": len(res), "equal": sum(res)}
    log(f"[parity f32 {size}] fast-path session == classic greedy in {sum(res)}/{len(res)} cases")


def markdown(rep) -> str:
    lines = [f"device: {rep['device']}, mlx {rep['mlx']}", ""]
    for row in rep["random"]:
        lines += [
            f"### random Llama {row['size']} (bf16 on GPU)",
            "",
            f"classic ms/token: ours {row['classic_ours_ms']:.2f}, mlx-lm generate_step "
            f"{row['classic_mlxlm_ms']:.2f}, synchronised step {row['classic_sync_ms']:.2f}; "
            f"warm-up {row['warm']['shapes']} shapes in {row['warm']['seconds']:.1f} s",
            "",
            "| path | K | alpha | ms/token | x ours | x mlx-lm | round ms | tok/round | draft | verify | sync | rollback |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in row["runs"]:
            ph = r["phase_ms"]
            lines.append(
                f"| {r['path']} | {r['K']} | {r['alpha']} | {r['ms_per_token']:.2f} | {r['speedup_vs_ours']:.2f} | "
                f"{r['speedup_vs_mlxlm']:.2f} | {r['round_ms']:.2f} | {r['tokens_per_round']:.2f} | "
                f"{ph['draft']:.2f} | {ph['verify']:.2f} | {ph['sync']:.2f} | {ph['rollback']:.2f} |"
            )
        lines.append("")
    for b in rep["bundled"]:
        lines += [
            f"### bundled pair ({b['dtype']})",
            "",
            f"classic ms/token: ours {b['classic_ours_ms']:.2f}, mlx-lm generate_step {b['classic_mlxlm_ms']:.2f}",
            "",
            "| drafter | path | K | ms/token | x ours | x mlx-lm | tok/round | round ms | probe ms | policy est (probes) | policy | matches classic |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in b["runs"]:
            lines.append(
                f"| {r['drafter']} | {r['path']} | {r['K']} | {r['ms_per_token']:.2f} | {r['speedup_vs_ours']:.2f} | "
                f"{r['speedup_vs_mlxlm']:.2f} | {r['tokens_per_round']:.2f} | {r['round_ms']:.2f} | {r['probe_ms']:.2f} | "
                f"{r['policy_speedup_from_probes']:.2f} | {'on' if r['policy_enabled_from_probes'] else 'off'} | "
                f"{r['matches_classic']} |"
            )
        lines.append("")
    if "parity_random_f32" in rep:
        p = rep["parity_random_f32"]
        lines.append(
            f"float32 parity ({p['size']}, oracle alpha 0.8, K 2/4/7): {p['equal']}/{p['cases']} equal to classic greedy"
        )
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="125M,1B")
    ap.add_argument("--skip", default="", help="comma list of: random,bundled,parity")
    args = ap.parse_args()
    args.prompt, args.tokens, args.before_tokens, args.bundled_tokens = 64, 256, 48, 192
    args.ks, args.alphas, args.before_ks = list(range(1, 9)), [0.5, 0.6, 0.7, 0.9, 1.0], [4]
    args.bundled_ks = [1, 2, 3, 4, 6]
    if args.quick:
        args.sizes, args.tokens, args.before_tokens, args.bundled_tokens = "tiny", 40, 20, 24
        args.ks, args.alphas, args.bundled_ks = [1, 4], [1.0], [2, 4]
    skip = set(filter(None, args.skip.split(",")))
    rep = {"device": str(mx.default_device()), "mlx": mx.__version__, "random": [], "bundled": []}

    def guarded(fn, *a):
        try:
            fn(*a)
        except Exception:
            import traceback

            log(f"SECTION FAILED: {fn.__name__}{a[2:]}\n{traceback.format_exc()}")

    if "random" not in skip:
        for size in args.sizes.split(","):
            guarded(bench_random, size, args, rep)
    if "bundled" not in skip:
        guarded(bench_bundled, args, rep, "float32" if mx.default_device() == mx.cpu else "bfloat16")
    if "parity" not in skip:
        guarded(parity_random, args, rep)
        if mx.default_device() != mx.cpu:  # the trained pair's parity in float32 too
            args.bundled_ks, args.before_ks = [4], []
            guarded(bench_bundled, args, rep, "float32")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(rep, f, indent=1, default=lambda o: None)
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(markdown(rep))
    log(markdown(rep))


if __name__ == "__main__":
    main()
