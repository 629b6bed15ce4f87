"""Host time against GPU time of short forwards (made for the H200): is a verify forward
bound by its kernels or by dispatching them?

For each path (the plain mlx-lm forward; the bucketed compiled forward without and with
the fused decoder of `models.forward.bucketed`) and query length L, with shapes warm and the
cache trimmed back after every forward, prints milliseconds per forward:
- sync: call, then wait for the result;
- pipelined: ten forwards queued back to back, one wait at the end (steady state);
- dispatch: the call plus `mx.async_eval` until it returns (host work only).
When dispatch is close to sync, the host is the bottleneck and the GPU waits for it.
`--profile` adds the GPU kernel time per forward and the costliest kernels, read with
torch's CUPTI profiler (the device image has PyTorch; it sees MLX's kernels too).

    python3 -m scripts.experiments.gpu_forward_parts --size 1B --lengths 1,2,5,7 [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache  # noqa: E402

from models.forward.bucketed import BucketedForward  # noqa: E402
from scripts.bench.gpu_rounds import log, random_llama  # noqa: E402


def timings(forward, cache, n: int, reps: int = 15) -> dict:
    tokens = mx.array([[5] * n], dtype=mx.int32)

    def once():
        out = forward(cache, tokens)
        trim_prompt_cache(cache, n)
        return out

    for _ in range(3):
        mx.eval(once())
    sync, dispatch = [], []
    for _ in range(reps):
        tic = time.perf_counter()
        out = once()
        mx.async_eval(out)
        mid = time.perf_counter()
        mx.eval(out)
        sync.append(time.perf_counter() - tic)
        dispatch.append(mid - tic)
    pipelined = []
    for _ in range(5):
        tic = time.perf_counter()
        outs = []
        for _ in range(10):
            outs.append(once())
            mx.async_eval(outs[-1])
        mx.eval(outs)
        pipelined.append((time.perf_counter() - tic) / 10)
    return {
        k: statistics.median(v) * 1e3 for k, v in (("sync", sync), ("pipelined", pipelined), ("dispatch", dispatch))
    }


def kernel_profile(forward, cache, n: int, reps: int = 10) -> tuple[float, int, list]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    tokens = mx.array([[5] * n], dtype=mx.int32)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            mx.eval(forward(cache, tokens))
            trim_prompt_cache(cache, n)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict = {}
    for e in events:
        by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.device_time / reps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:6]
    return sum(e.device_time for e in events) / reps / 1e3, len(events) // reps, top


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1B")
    ap.add_argument("--lengths", default="1,2,5,7")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the paths (noise check)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    model = random_llama(args.size, mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32)
    prompt = [(i * 7919) % 31999 + 1 for i in range(300)]
    unfused = BucketedForward(model, fuse=False)
    fused = BucketedForward(model)
    assert fused.fused is not None
    paths = [("plain", None), ("unfused", unfused), ("fused", fused)]
    for _ in range(args.rounds):
        for name, fast in paths:
            cache = make_prompt_cache(model)
            if fast is None:
                mx.eval(model(mx.array([prompt]), cache=cache))
                forward = lambda c, t: model(t, cache=c)  # noqa: E731
            else:
                fast.prefill(cache, prompt)
                forward = fast.greedy_every
            for n in lengths:
                t = timings(forward, cache, n)
                line = (
                    f"[{args.size}] {name:8s} L={n}: sync {t['sync']:5.2f}  pipelined {t['pipelined']:5.2f}  "
                    f"dispatch {t['dispatch']:5.2f} ms"
                )
                if args.profile:
                    gpu, kernels, top = kernel_profile(forward, cache, n)
                    line += f"  | GPU kernels {gpu:5.2f} ms, {kernels} kernels"
                    line += "".join(f"\n      {us:7.1f} us  {name_}" for name_, us in top)
                log(line)


if __name__ == "__main__":
    main()
