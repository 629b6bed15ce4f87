"""Where a burst of long prompts' time to first token goes, tick by tick (made for the lent
H200; runs on a CPU with a small model too).

Builds the scheduler and runner a deployment config builds (`scripts.bench.engine_load.serve_args`), submits `--requests` prompts of `--prompt-chars` characters at once (the
load generator's prompts), and ticks on this thread as the engine thread does, until
every request has its first token and `--tokens` tokens. Per tick: the action, the
requests prefilled, the live rows, milliseconds. Prints the timeline folded into runs
of the same action, each request's first-token time, and writes both to `--out`.

    python -m scripts.experiments.gpu_ticks --target /tmp/specslot-q15 \\
        --config "configs/gpu.yaml:drafter={kind: ngram}" --requests 32 --prompt-chars 5600 --out DIR/ticks.json
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--config", default="configs/gpu.yaml:drafter={kind: ngram}")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=5600)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="prompts of this many tokens (scripts.bench.prompts.sized_snippets; 0: --prompt-chars characters)",
    )
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request")
    ap.add_argument(
        "--per-stream",
        type=int,
        default=1,
        help="closed loop: each of the --requests streams sends this many requests one after "
        "another, the next as its last one finishes (as the load generator's streams do)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's, seeded by its index")
    ap.add_argument("--seed", type=int, default=32000)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--parts",
        action="store_true",
        help="split each prefill tick's time into its parts (synchronizes the device around each part)",
    )
    ap.add_argument(
        "--sync-attention", action="store_true", help="with --parts: time each layer's grid attention on its own too"
    )
    ap.add_argument(
        "--reserve",
        type=int,
        default=0,
        help="grow the classic slab to this many positions before the measured burst (0: as it comes)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="the measured burst's GPU kernel time by kernel, read with torch's CUPTI profiler",
    )
    ap.add_argument(
        "--host",
        action="store_true",
        help="split each tick's wall time into the host's parts without synchronizing: building "
        "the forward's and the draws' graphs, queuing work (async_eval), waiting for results (eval)",
    )
    ap.add_argument(
        "--gil",
        action="store_true",
        help="a second Python thread sleeps 1 ms at a time through the measured burst: how late it "
        "wakes is how long the engine's thread keeps the GIL (the actor's poll threads wait as long)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measured bursts, each with prompts of its own (seed, seed + 2, ...); a line each, the last one in full",
    )
    ap.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="prompt positions per row per prefill forward (slab_batch.PREFILL_CHUNK; 0: as it is)",
    )
    ap.add_argument(
        "--decode-attention",
        choices=["mask", "rows", "matmuls"],
        default=None,
        help="how a grid step of several one-token rows attends (slab_forward.DECODE_ATTENTION; default: as it is)",
    )
    args = ap.parse_args()

    from scheduler.core import Scheduler
    from scheduler.engine import freeze_heap
    from scheduler.request import Request, SamplingParams
    from scripts.bench.engine_load import serve_args
    from scripts.bench.loadgen import LoadConfig, build_requests
    from scripts.bench.prompts import sized_snippets
    from scripts.bench.vs_mlx_lm import parse_config_spec
    from serve_app.openai.codec import TextCodec

    path, overrides = parse_config_spec(args.config)
    serve = serve_args(path, {**overrides, "model": args.target})
    # a `pypi:` file or a GGUF: the mlx-lm directory the replicas load (the codec reads it too)
    args.target = serve.with_resolved_paths().model_dirs()[0]
    from models.platform import kernel_cache

    kernel_cache.use(serve.kernel_cache_dir)
    from models.runner import MlxRunner

    if args.chunk:
        from models.batch import slab_batch

        slab_batch.PREFILL_CHUNK = args.chunk
    if args.decode_attention:
        from models.forward import slab_forward

        slab_forward.DECODE_ATTENTION = args.decode_attention

    tic = time.perf_counter()
    runner = MlxRunner.from_paths(args.target, **serve.runner_args())
    load_s = time.perf_counter() - tic
    codec = TextCodec.from_path(args.target)
    eos = tuple(runner.eos_token_ids)
    scheduler = Scheduler(runner, serve.scheduler_config(), clock=time.perf_counter)
    freeze_heap()  # as the engine thread does once loaded
    parts: dict[str, float] = {}
    forwards: list[dict] = []
    if args.parts:
        instrument(parts, forwards, args.sync_attention)
    elif args.host:
        instrument_host(parts, forwards)

    def burst(seed: int, count: int, per_stream: int = 1) -> dict:
        total = count * per_stream
        if args.prompt_tokens:  # each starts with a line of its own: no two share a prefix
            texts = sized_snippets(codec, total, seed, args.prompt_tokens)
        else:
            texts = [
                item["body"]["prompt"]
                for item in build_requests(
                    LoadConfig(
                        base_url="", num_prompts=total, concurrency=count, seed=seed, prompt_chars=args.prompt_chars
                    )
                )
            ]
        prompts = [codec.encode(text) for text in texts]
        lengths = [len(ids) for ids in prompts]
        first, done, ticks = {}, set(), []
        sent = [0]

        def send() -> None:
            i = sent[0]
            sent[0] += 1
            sampling = SamplingParams(
                max_tokens=args.tokens,
                stop_token_ids=eos,
                temperature=args.temperature,
                seed=i if args.temperature else None,
            )
            scheduler.submit(Request(f"r{seed}-{i}", prompts[i], sampling, arrival_time=time.perf_counter()))

        t0 = time.perf_counter()  # the prompts are tokenized: time runs from their arrival
        for _ in range(count):
            send()
        while len(done) < total:
            parts.clear()
            forwards.clear()
            start = time.perf_counter()
            events = scheduler.tick()
            end = time.perf_counter()
            decision = scheduler.last_decision
            holder = scheduler.slot.active
            ticks.append(
                {
                    "at_ms": round((start - t0) * 1e3, 1),
                    "ms": round((end - start) * 1e3, 2),
                    "action": decision.action.value,
                    "prefilled": decision.num_prefill,
                    "rows": len(scheduler._rows),
                    "holder": None if holder is None else holder.request.request_id,
                    "tokens": sum(len(event.token_ids) for event in events),
                    "finished": sum(1 for event in events if event.finish_reason is not None),
                    **(
                        {"parts_ms": {k: round(v * 1e3, 2) for k, v in parts.items()}, "forwards": list(forwards)}
                        if parts
                        else {}
                    ),
                }
            )
            for event in events:
                if event.token_ids and event.request_id not in first:
                    first[event.request_id] = round((end - t0) * 1e3, 1)
                if event.finish_reason is not None:
                    done.add(event.request_id)
                    if sent[0] < total:  # that stream's next request
                        send()
        return {"prompt_tokens": lengths, "first_token_ms": sorted(first.values()), "ticks": ticks}

    warm = burst(args.seed + 1, min(8, args.requests))  # shapes and kernels out of the measured burst
    if args.reserve:  # after the warm burst, whose rows' end gave its capacity back
        import mlx.core as mx

        runner._classic.slab.reserve(args.reserve)
        mx.eval(runner._classic.slab.arrays())
    late = gil_probe() if args.gil else None
    if args.profile:
        measured, kernels = profiled(lambda: burst(args.seed, args.requests, args.per_stream))
    else:
        earlier = []
        for k in range(args.repeats - 1):  # a line each; the last burst is reported in full below
            counts = scheduler.counters.to_dict()
            run = burst(args.seed + 2 * (k + 1), args.requests, args.per_stream)
            earlier.append({**summary(run, counts, scheduler.counters.to_dict()), "ticks": run["ticks"]})
            print(f"repeat {k}: " + ", ".join(f"{key} {value}" for key, value in earlier[-1].items() if key != "ticks"))
        counts = scheduler.counters.to_dict()
        measured, kernels = burst(args.seed, args.requests, args.per_stream), None
        if earlier:
            last = summary(measured, counts, scheduler.counters.to_dict())
            print(f"repeat {args.repeats - 1}: " + ", ".join(f"{key} {value}" for key, value in last.items()))
            measured["repeats"] = earlier + [{**last, "ticks": "below"}]
    if late is not None:
        wakes = late()
        measured["gil_late_ms"] = wakes
        print(
            f"GIL: a 1 ms sleep woke late by p50 {wakes['p50']:.2f} / p99 {wakes['p99']:.2f} / max "
            f"{wakes['max']:.2f} ms over {wakes['n']} sleeps"
        )
    folded = []
    for t in measured["ticks"]:
        if folded and folded[-1]["action"] == t["action"] and t["action"] != "prefill":
            folded[-1]["n"] += 1
            folded[-1]["ms"] = round(folded[-1]["ms"] + t["ms"], 1)
        else:
            folded.append(
                {"action": t["action"], "n": 1, "ms": t["ms"], "at_ms": t["at_ms"], "prefilled": t["prefilled"]}
            )
    for f in folded:
        print(f"{f['at_ms']:8.1f} ms  {f['action']:<12} x{f['n']:<4} {f['ms']:8.1f} ms  prefilled {f['prefilled']}")
    by_action: dict[str, list[dict]] = {}
    for t in measured["ticks"]:
        by_action.setdefault(t["action"], []).append(t)
    for action, ticks in sorted(by_action.items()):  # what a decode-heavy run's TPOT is made of
        ms = sorted(t["ms"] for t in ticks)
        print(
            f"{action:<12} {len(ms):5d} ticks, ms p50 {ms[len(ms) // 2]:.2f} mean {sum(ms) / len(ms):.2f}, "
            f"{sum(t['tokens'] for t in ticks) / len(ms):.2f} tokens a tick"
        )
    print(f"cost gate: {scheduler.slot.gate.snapshot()}")
    print(
        f"steps pipelined {getattr(runner._classic, 'num_pipelined', 0)}; counters "
        f"{ {k: v for k, v in scheduler.snapshot()['counters'].items() if v} }"
    )
    if args.host:
        for action, ticks in sorted(by_action.items()):
            names = sorted({k for t in ticks for k in t.get("parts_ms", {})})
            mean = {k: sum(t.get("parts_ms", {}).get(k, 0.0) for t in ticks) / len(ticks) for k in names}
            rest = sum(t["ms"] for t in ticks) / len(ticks) - sum(v for k, v in mean.items() if k in HOST_PARTS)
            print(
                f"  {action:<12} host ms a tick: "
                + ", ".join(f"{k} {v:.2f}" for k, v in mean.items())
                + f", rest {rest:.2f}"
            )
        # Steps of one action and one plan together: does a plan set a step's time?
        plans: dict[tuple, list[float]] = {}
        for t in measured["ticks"]:
            if t["action"] != "prefill" and t.get("forwards"):
                key = (t["action"],) + tuple(
                    (f["entries"], f["width"], tuple(f["slots"]), str(f["grid"]), f["keys"]) for f in t["forwards"]
                )
                plans.setdefault(key, []).append(t["ms"])
        for key, ms in sorted(plans.items(), key=lambda kv: -len(kv[1]))[:12]:
            ms = sorted(ms)
            print(f"  x{len(ms):<4} p50 {ms[len(ms) // 2]:6.2f} mean {sum(ms) / len(ms):6.2f} ms  {key}")
    for t in measured["ticks"]:
        if "parts_ms" in t and t["action"] == "prefill":
            print(f"  prefill {t['prefilled']} at {t['at_ms']} ms: {t['ms']} ms = {t['parts_ms']}")
            for f in t["forwards"]:
                print(f"    forward {f}")
    ftt = measured["first_token_ms"]
    print(
        f"load {load_s:.1f} s; prompts {min(measured['prompt_tokens'])}-{max(measured['prompt_tokens'])} tokens; "
        f"first tokens (ms): {ftt}"
    )
    print(
        f"over 1 s: {sum(1 for t in ftt if t > 1000)} / {len(ftt)}; warm burst's last first token "
        f"{max(warm['first_token_ms'])} ms"
    )
    if kernels:
        total = sum(kernels.values())
        end = max(t["at_ms"] + t["ms"] for t in measured["ticks"])
        launches = measured.pop("launches", {})
        print(
            f"GPU kernels busy {total:.0f} ms of the burst's {end:.0f} ms in {sum(launches.values())} launches; "
            f"the costliest (ms, launches):"
        )
        for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {ms:8.1f} {launches.get(name, 0):7d}  {name}")
        measured["kernels_ms"] = {k: round(v, 2) for k, v in kernels.items()}
        measured["kernel_launches"] = launches
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "config": args.config,
                "load_s": load_s,
                "folded": folded,
                **measured,
                "warm_first_token_ms": warm["first_token_ms"],
            },
            f,
            indent=1,
        )


def summary(run: dict, before: dict, after: dict) -> dict:
    """One burst in a line: its wall time and tokens, its ticks by action (count, mean ms),
    the slot's grants and fused rounds in it (`before`/`after`: the scheduler's counters)."""
    ticks = run["ticks"]
    end = max(t["at_ms"] + t["ms"] for t in ticks)
    tokens = sum(t["tokens"] for t in ticks)
    by: dict[str, list[float]] = {}
    for t in ticks:
        by.setdefault(t["action"], []).append(t["ms"])
    # a grid slab stores a finishing row's stream and moves a row while the next step is
    # queued: decode ticks in which rows finished, against the others
    ending = [t["ms"] for t in ticks if t["action"] == "decode" and t["finished"]]
    plain = [t["ms"] for t in ticks if t["action"] == "decode" and not t["finished"]]
    return {
        "wall_ms": round(end, 1),
        "tok_s": round(tokens / end * 1e3, 1),
        "decode_ms_with_finishes": _count_mean(ending),
        "decode_ms_without": _count_mean(plain),
        "grants": after["grants"] - before["grants"],
        "cost_parks": after["cost_parks"] - before["cost_parks"],
        "fused": after["actions"]["fused"] - before["actions"]["fused"],
        **{f"{action}_ms": _count_mean(ms) for action, ms in sorted(by.items())},
    }


def _count_mean(ms: list[float]) -> str:
    """ "n x mean" of tick times in ms ("-" for none)."""
    return f"{len(ms)} x {sum(ms) / len(ms):.2f}" if ms else "-"


def gil_probe():
    """Start a thread that sleeps 1 ms at a time and records how late each wake-up is;
    returns a function that stops it and gives p50 / p99 / max lateness in ms."""
    import threading

    stop, late = threading.Event(), []

    def loop() -> None:
        while not stop.is_set():
            tic = time.perf_counter()
            time.sleep(0.001)
            late.append((time.perf_counter() - tic - 0.001) * 1e3)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def finish() -> dict:
        stop.set()
        thread.join()
        values = sorted(late)
        return {
            "n": len(values),
            "p50": values[len(values) // 2],
            "p99": values[int(len(values) * 0.99)],
            "max": values[-1],
        }

    return finish


def profiled(run) -> tuple[dict, dict[str, float]]:
    """`run()`'s result (with `launches`: kernel name -> launches) and the GPU time of the
    kernels it launched, ms by kernel name (torch's CUPTI profiler sees MLX's kernels
    too; the device image has PyTorch)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = run()
    kernels: dict[str, float] = {}
    launches: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:90]] = kernels.get(e.name[:90], 0.0) + e.device_time / 1e3
            launches[e.name[:90]] = launches.get(e.name[:90], 0) + 1
    return {**out, "launches": launches}, kernels


HOST_PARTS = ("forward.build", "draws.build", "async_eval", "eval")  # disjoint wall-time parts


def instrument_host(parts: dict[str, float], forwards: list[dict]) -> None:
    """Time where a tick's wall time goes on the host, into `parts` (seconds, summed per
    name), without waiting for the device anywhere it would not: `Slab.forward` and the
    draws (graph building only: MLX is lazy), `mx.async_eval` (handing the graph to the
    device: on CUDA the kernel launches), `mx.eval` (launches plus waiting for the
    device). Nested calls count once, in the outer part; the rest of a tick is the
    scheduler's and the batch's own Python. Each slab forward's plan goes to `forwards`:
    its entries, widest entry, slots, and the grid (rows, width) and key bucket, or
    "packed"."""
    import mlx.core as mx

    from models.batch import slab_batch
    from models.forward import slab, slab_forward

    plan = slab_forward.Forward.__init__

    def planned(self, owner, entries):
        plan(self, owner, entries)
        slots = sorted(row.slot for row, _ in entries)
        forwards.append(
            {
                "entries": len(entries),
                "width": max(len(t) for _, t in entries),
                "slots": [slots[0], slots[-1]],
                "grid": list(self.grid) if self.grid else "packed",
                "keys": getattr(self, "grid_keys", None),
            }
        )

    slab_forward.Forward.__init__ = planned

    depth = [0]

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            if depth[0]:
                return inner(*a, **k)
            depth[0] += 1
            tic = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                depth[0] -= 1
                parts[label] = parts.get(label, 0.0) + time.perf_counter() - tic

        setattr(owner, name, timed)

    wrap(slab.Slab, "forward", "forward.build")
    wrap(slab_batch.SlabBatch, "_draws", "draws.build")
    wrap(mx, "async_eval", "async_eval")
    wrap(mx, "eval", "eval")


def instrument(parts: dict[str, float], forwards: list[dict], attention: bool) -> None:
    """Time the parts of a prefill into `parts` (seconds, summed per name; nested parts
    count in their callers too): each wrapped call waits for the device before and after.
    `Slab.forward` splits into building the graph (`forward.build`) and running it
    (`forward.run`: its logits and the slab's buffers evaluated); each forward's shape
    and times go to `forwards`. Python's garbage collections count as `gc`."""
    import gc

    import mlx.core as mx

    from models.batch import prefix_cache, slab_batch
    from models.forward import slab, slab_forward

    def sync() -> None:
        mx.synchronize()

    def add(name: str, seconds: float) -> None:
        parts[name] = parts.get(name, 0.0) + seconds

    def wrap(owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            sync()
            tic = time.perf_counter()
            out = inner(*a, **k)
            sync()
            add(label, time.perf_counter() - tic)
            return out

        setattr(owner, name, timed)

    collecting = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            collecting.append(time.perf_counter())
        elif collecting:
            add("gc", time.perf_counter() - collecting.pop())

    gc.callbacks.append(on_gc)
    forward = slab.Slab.forward

    def timed_forward(self, model, entries, *a, **k):
        sync()
        capacity = self.capacity
        tic = time.perf_counter()
        out = forward(self, model, entries, *a, **k)
        mid = time.perf_counter()
        mx.eval([x for x in out if x is not None], self.arrays())
        end = time.perf_counter()
        widths = [len(t) for _, t in entries]
        forwards.append(
            {
                "rows": len(entries),
                "width": max(widths),
                "tokens": sum(widths),
                "start": min(r.length for r, _ in entries) - min(widths),
                "capacity": f"{capacity}->{self.capacity}",
                "slab_rows": self.keys[0].shape[0],
                "build_ms": round((mid - tic) * 1e3, 2),
                "run_ms": round((end - mid) * 1e3, 2),
                "active_gb": round(mx.get_active_memory() / 1e9, 2),
                "cache_gb": round(mx.get_cache_memory() / 1e9, 2),
            }
        )
        add("forward.build", mid - tic)
        add("forward.run", end - mid)
        add("forward.tokens", sum(len(t) for _, t in entries) / 1e3)  # thousands of tokens, not seconds
        add("forward.calls", 1e-3)
        return out

    slab.Slab.forward = timed_forward
    wrap(slab.Slab, "reserve", "reserve")
    wrap(slab.Slab, "copy_prefix", "copy_prefix")
    wrap(slab.Slab, "write_prefix", "write_prefix")
    wrap(prefix_cache.PrefixCache, "store", "prefix_store")
    wrap(prefix_cache.PrefixCache, "lookup", "prefix_lookup")
    wrap(slab_batch.SlabBatch, "_sample", "sample")
    wrap(slab_batch.SlabBatch, "_apply", "apply")
    wrap(slab_batch.SlabBatch, "_add_stream", "add_stream")
    wrap(slab.Slab, "arrange", "arrange")
    wrap(slab_batch.SlabBatch, "_prefill_group", "group")
    if attention:
        grid = slab_forward._grid_attention

        def timed_attention(*a):
            sync()
            tic = time.perf_counter()
            out = grid(*a)
            mx.eval(out)
            add("attention", time.perf_counter() - tic)
            return out

        slab_forward._grid_attention = timed_attention


if __name__ == "__main__":
    main()
