"""Classic B=1 decode, piece by piece, against mlx-lm's `generate_step` (made for the H200).

Per model (the bundled target, then random Llamas named on the command line, e.g. 1B),
three alternating repeats of: raw `generate_step`; `BatchGenerator` alone; our
`GeneratorBatch` (a lone row: the `models.batch.solo` path); a bare pipelined loop over a plain
KVCache; synchronised single-token forwards over a plain `KVCache` and over a
`BatchKVCache`; and, for the bundled target, the threaded `Engine` (classic only).
Prints ms per decoded token (median, then every repeat).

    N=256 python3 -m scripts.experiments.gpu_classic [1B ...]
"""

import os
import statistics
import sys
import time

import models  # noqa

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import make_prompt_cache

from models.batch.generator_batch import GeneratorBatch
from models.loading.loader import load_model
from models.sampling.samplers import RequestSampler
from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.request import Request, SamplingParams
from scripts.bench.engine import load_runner
from scripts.bench.gpu_rounds import random_llama
from scripts.bench.overhead import engine_decode_rate

N = int(os.environ.get("N", "256"))


def t_raw(model, prompt):
    g = generate_step(mx.array(prompt), model, max_tokens=N)
    next(g)
    tic = time.perf_counter()
    c = sum(1 for _ in g)
    return (time.perf_counter() - tic) / c


def t_bg(model, prompt):
    bg = BatchGenerator(model, stop_tokens=[], completion_batch_size=1, prefill_batch_size=1)
    (uid,) = bg.insert([prompt], max_tokens=[N])
    c = 0
    tic = None
    while True:
        _, rs = bg.next()
        for r in rs:
            if tic is None:
                tic = time.perf_counter()
                continue
            c += 1
            if r.finish_reason:
                bg.close()
                return (time.perf_counter() - tic) / c


def t_adapter(model, prompt):
    b = GeneratorBatch(model, eos_token_ids=(), max_batch_size=16, prefill_batch_size=8)
    b.prefill([Request("c", prompt, SamplingParams(max_tokens=N))])
    tic = time.perf_counter()
    c = 0
    while True:
        for tb in b.decode():
            c += 1
            if tb.finish_reason:
                b.remove("c")
                b.close()
                return (time.perf_counter() - tic) / c


def t_solo(model, prompt):
    s = RequestSampler(SamplingParams(max_tokens=N))
    cache = make_prompt_cache(model)

    def step(x):
        lg = model(x, cache=cache)[:, -1, :]
        return s(lg - mx.logsumexp(lg, axis=-1, keepdims=True))

    y = step(mx.array(prompt)[None])
    mx.async_eval(y)
    out = []
    tic = None
    for i in range(N):
        nxt = step(y[:, None])
        mx.async_eval(nxt)
        out.append(y.item())
        if tic is None:
            tic = time.perf_counter()
        y = nxt
    return (time.perf_counter() - tic) / (N - 1)


def t_fwd(model, prompt, batched):
    from mlx_lm.models.cache import BatchKVCache

    if batched:
        cache = [BatchKVCache(left_padding=[0]) for _ in model.layers]
    else:
        cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    y = mx.array([[5]])
    for _ in range(8):
        mx.eval(model(y, cache=cache))
    tic = time.perf_counter()
    for _ in range(64):
        mx.eval(model(y, cache=cache))
    return (time.perf_counter() - tic) / 64


def t_engine(target, prompt):
    eng = Engine(lambda: load_runner(target, None), SchedulerConfig(b1_policy="off"))
    eng.start()
    try:
        engine_decode_rate(eng, prompt, 16, "warm")
        rates = [engine_decode_rate(eng, prompt, N, f"e{i}")[0] for i in range(3)]
    finally:
        eng.stop()
    return 1 / statistics.median(rates)


def run(name, model, prompt, target=None):
    fns = [
        ("raw generate_step", lambda: t_raw(model, prompt)),
        ("BatchGenerator", lambda: t_bg(model, prompt)),
        ("GeneratorBatch", lambda: t_adapter(model, prompt)),
        ("solo loop", lambda: t_solo(model, prompt)),
        ("sync fwd KVCache", lambda: t_fwd(model, prompt, False)),
        ("sync fwd BatchKVCache", lambda: t_fwd(model, prompt, True)),
    ]
    for f in fns:
        f[1]()  # warm
    res = {k: [] for k, _ in fns}
    for _ in range(3):
        for k, f in fns:
            res[k].append(f())
    if target:
        res["Engine (b1 off)"] = [t_engine(target, prompt)]
    for k, v in res.items():
        print(
            f"{name:8s} {k:24s} {statistics.median(v) * 1e3:7.3f} ms/tok  {[round(x * 1e3, 3) for x in v]}", flush=True
        )


if __name__ == "__main__":
    tgt = "models/bundled/target"
    m = load_model(tgt)
    prompt = list(m.tokenizer.encode('def fibonacci(n):\n    """Return the n-th number."""\n'))
    run("bundled", m.model, prompt, tgt)
    for size in sys.argv[1:]:
        model = random_llama(size, mx.bfloat16)
        run(size, model, [(i * 7919) % 31999 + 1 for i in range(64)])
