"""The load generator's workload in-process: the production engine without HTTP or Ray.

`run_engine_load(engine, codec, eos_ids, cfg)` sends the requests `loadgen.build_requests(cfg)`
builds (same prompts, same closed loop of `cfg.concurrency` streams, same sampling) to a
started `scheduler.engine.Engine`, the thread the scheduler actor runs, and returns what
`loadgen.run_load` returns, so the two summaries compare directly: what the serving
path (Ray Serve, HTTP, the actor hop, detokenizing) adds is the difference.

Times: arrival at submit; a request's first token and every later one when
`get_events` hands them to this thread. The load generator times the first chunk that
has text instead (a random-weight model's first tokens may decode to none).
`engine_from_config(spec, target)` builds the engine a deployment config would run
(`serve_app.deployment.actor.build_engine`), from the `serve_args` the config gives;
`first_token(engine, request)` times one request alone to its first token.
"""

from __future__ import annotations

import itertools
import time

from scripts.bench import metrics
from scripts.bench.loadgen import LoadConfig, build_requests


def serve_args(path: str, overrides: dict):
    """The `ServeArgs` the deployment config at `path` gives its first application (its
    `args`, then its first deployment's `user_config`), with `overrides` on top. Read
    as plain YAML: an engine in-process needs no Ray (a GPU host may have none)."""
    import yaml

    from serve_app.configuration.args import ServeArgs

    with open(path, encoding="utf-8") as f:
        app = yaml.safe_load(f)["applications"][0]
    user_config = app["deployments"][0].get("user_config") or {}
    return ServeArgs.model_validate({**app["args"], **user_config, **overrides})


def engine_from_config(spec: str, target: str, overrides: dict | None = None):
    """(started Engine, its runner info) for config `spec` (PATH[:key=value,...]) with
    `model` = `target` and `overrides` on top of the spec's."""
    from scripts.bench.vs_mlx_lm import parse_config_spec
    from serve_app.deployment.actor import build_engine

    path, spec_overrides = parse_config_spec(spec)
    engine, info = build_engine(serve_args(path, {**spec_overrides, **(overrides or {}), "model": target}))
    engine.start()
    return engine, info


def first_token(engine, request) -> tuple[float, object]:
    """Submits `request` to `engine` (started) and waits for it to finish: (seconds from
    the submit to the first event carrying a token or the finish, the finishing event).
    Other requests' events are dropped: run it with nothing else in flight."""
    tic = time.perf_counter()
    engine.submit(request)
    first = None
    while True:
        for event in engine.get_events(timeout=1.0):
            if event.request_id != request.request_id:
                continue
            if first is None and (event.token_ids or event.finish_reason):
                first = time.perf_counter() - tic
            if event.finish_reason:
                return first, event


def run_engine_load(engine, codec, eos_ids, cfg: LoadConfig) -> dict:
    """`cfg`'s requests through `engine` (started, idle), `cfg.concurrency` at a time,
    their prompts encoded by `codec` (`serve_app.openai.codec.TextCodec`) as the replica does."""
    from scheduler.request import Lane, Request, SamplingParams

    items = build_requests(cfg)
    if cfg.request_rate:
        raise ValueError("the in-process load runs a closed loop only (no request_rate)")
    ids = itertools.count()
    queue, live, records = list(items), {}, []
    t0 = time.perf_counter()

    def submit(item: dict) -> None:
        body = item["body"]
        prompt = codec.encode(body["prompt"]) if "prompt" in body else codec.encode_chat(body["messages"])
        request_id = f"load-{next(ids)}"
        now = time.perf_counter() - t0
        live[request_id] = {
            "index": item["index"],
            "lane": item["lane"],
            "arrival_s": now,
            "first_token_s": None,
            "chunks": [],
            "finish_s": None,
            "prompt_tokens": len(prompt),
            "output_tokens": 0,
            "speculative": None,
            "error": None,
            "finish_reason": None,
            "usage_reported": True,
            "cached_prompt_tokens": None,
        }
        sampling = SamplingParams(
            max_tokens=body["max_tokens"], temperature=body["temperature"], stop_token_ids=tuple(eos_ids)
        )
        engine.submit(Request(request_id, prompt, sampling, lane=Lane[item["lane"].upper()]))

    for _ in range(max(1, cfg.concurrency or 1)):
        if queue:
            submit(queue.pop(0))
    while live:
        events = engine.get_events(timeout=cfg.timeout_s)
        if not events:
            raise TimeoutError(f"no engine event in {cfg.timeout_s} s with {len(live)} requests live")
        now = time.perf_counter() - t0
        for event in events:
            rec = live[event.request_id]
            if event.token_ids:
                rec["chunks"].append((now, len(event.token_ids)))
                rec["output_tokens"] += len(event.token_ids)
                if rec["first_token_s"] is None:
                    rec["first_token_s"] = now
            if event.finish_reason is None:
                continue
            rec.update(
                finish_s=now,
                finish_reason=event.finish_reason,
                error=event.error,
                cached_prompt_tokens=event.num_cached_tokens,
                speculative=event.stats.as_usage() if event.stats is not None else None,
            )
            records.append(live.pop(event.request_id))
            if queue:
                submit(queue.pop(0))
    duration = time.perf_counter() - t0
    records.sort(key=lambda r: r["index"])
    lengths = [r["output_tokens"] for r in records if not r["error"]]
    return {
        "config": dict(cfg.__dict__),
        "ignore_eos_sent": False,
        "output_lengths": {
            "requested": cfg.max_tokens,
            "min": min(lengths, default=None),
            "max": max(lengths, default=None),
            "mean": sum(lengths) / len(lengths) if lengths else None,
            "usage_reported": True,
        },
        "cached_prompt_tokens": sum(r["cached_prompt_tokens"] or 0 for r in records),
        "summary": metrics.summarize(records, duration),
        "requests": records,
    }
