"""Scenario 4: our service side by side with `mlx_lm.server`, alternating runs.

    python -m scripts.bench.vs_mlx_lm [--quick] [--out results/vs_mlx_lm]
        [--config PATH[:key=value,...]]... [--concurrency N]... [--peer NAME]... [--repeats N]

All servers are started by this script on 127.0.0.1 and stopped with SIGTERM:
- `specslot`: our service through its own entry point (`python -m serve_app.cli`,
  configs/local.yaml with the port moved): speculative slot + classic batching.
- `mlx_lm`: `mlx_lm server --model <target>`, the model directory the first config
  serves unless `--target` names one (`servers.config_models`: a `pypi:` or GGUF model
  is its converted directory in the specslot cache).
- `mlx_lm+draft`: the same with `--draft-model <draft> --num-draft-tokens 4`: `--draft`,
  else the config's draft model, else the bundled draft for the bundled target
  (`configs/bundled.yaml`); without one these peers do not run.
- `mlx_lm-wide`: the peer's batching opened up (`--decode-concurrency 64
  --prompt-concurrency 16`; its defaults are 32 and 8): its best plain configuration
  for many streams. Runs only when named with `--peer`.
- on CPU also `mlx_lm-f32` / `mlx_lm-f32+draft`: the peer on a float32 copy of the same
  weights. Our loader casts float16 weights to float32 on CPU (much faster there), so
  the same-directory peer runs different arithmetic; the f32 rows are the fair pair.

The peer's `--draft-model` path decodes one request at a time (no batching), so the
`+draft` peers are fair at concurrency 1; quick mode runs them only there, full mode
everywhere. All servers stay up (an idle mlx_lm.server uses no CPU); at each
concurrency every server first gets one unmeasured run of the same shape (its kernels
and caches warm, as the measured runs find them), then for each repeat one run per
server in turn with the same seeded prompts (streaming, greedy unless `--temperature`,
fixed max_tokens); ratios are ours / peer for each (our run, peer run) pair of the same
repeat, warm against warm. `--prompts` picks completions of code snippets (default),
chat requests to continue them (`code`), or everyday chat questions (`chat`).

Prompts: every (concurrency, repeat) run gets its own seeded prompt set, the same for
every server of that run, so no server sees a prompt twice. `mlx_lm.server` keeps an
LRU prompt cache (10 KV caches by default) and we have none, so reusing prompts across
runs hands the peer prefix-cache hits that depend on what ran before (its c=4 TTFT
goes from ~3 s cold to ~0.1 s on the bundled pair). `--repeat-prompts` restores
reuse (seed = seed + repeat at every concurrency), to measure that cache on purpose;
the JSON records each run's `cached_prompt_tokens` as the server reports them.

TTFT is the load generator's: the first streamed chunk with text. For our servers each
run also reads the replica's own TTFT histogram before and after
(`specslot:time_to_first_token_seconds`: the first token, text or not), and the table
counts the requests whose first token came after 1 s there (a random-weight model's
first tokens can decode to no text, which moves the client's TTFT later).

`--config` (repeatable) starts one of our servers per config, each alternating with the
peers: `configs/classic-only.yaml`, or `configs/local.yaml:backlog_cap=0,grant_rounds=2`
to override `args` keys (YAML values), and `deployment.num_replicas=2` (any
`deployment.NAME`) to set an option of the config's deployment, and `env.NAME=value` a
variable of its environment (`env.RAY_SERVE_PROXY_USE_GRPC=0`: the proxy's transport). With more than one config each is named
`specslot[<spec>]`. `--concurrency` and `--peer` (repeatable) narrow the sweep.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time

import yaml

from scripts.bench import metrics, proc_tree, servers
from scripts.bench import util as bench_util
from scripts.bench.loadgen import LoadConfig, run_load

CONCURRENCIES = (1, 4, 16)
WIDE = ("--decode-concurrency", "64", "--prompt-concurrency", "16")  # the `mlx_lm-wide` peer


def _is_cpu() -> bool:
    import mlx.core as mx

    import models  # noqa: F401

    return mx.default_device() == mx.cpu


DEFAULT_CONFIG = "configs/local.yaml"


def parse_config_spec(spec: str) -> tuple[str, dict]:
    """`PATH[:key=value,...]` -> (path, args overrides); values are parsed as YAML.

    >>> parse_config_spec("configs/local.yaml:backlog_cap=0,tick_slice=false")
    ('configs/local.yaml', {'backlog_cap': 0, 'tick_slice': False})
    """
    path, _, rest = spec.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"bad override {item!r} in --config {spec!r}; expected key=value")
        overrides[key.strip()] = yaml.safe_load(value)
    return path, overrides


def split_overrides(overrides: dict) -> tuple[dict, dict, dict]:
    """(args overrides, deployment options, environment): keys `deployment.NAME` set
    the first deployment's option NAME (e.g. `num_replicas`), keys `env.NAME` the
    variable NAME of the server's environment (e.g. `RAY_SERVE_PROXY_USE_GRPC`, read by
    the Ray it starts), the others its application's `args`.

    >>> split_overrides({"deployment.num_replicas": 2, "actor_num_gpus": 1, "env.RAY_SERVE_PROXY_USE_GRPC": 0})
    ({'actor_num_gpus': 1}, {'num_replicas': 2}, {'RAY_SERVE_PROXY_USE_GRPC': '0'})
    """
    parts: dict[str, dict] = {"deployment.": {}, "env.": {}, "": {}}
    for key, value in overrides.items():
        prefix = next(p for p in parts if key.startswith(p))
        parts[prefix][key[len(prefix) :]] = str(value) if prefix == "env." else value
    return parts[""], parts["deployment."], parts["env."]


def our_servers(specs: list[str], base_port: int, out_dir: str) -> list:
    """One server per config spec (`deployment.NAME=value` overrides set deployment
    options, `env.NAME=value` its environment: `split_overrides`); a lone default spec
    keeps the plain name `specslot`."""
    fleet = []
    for i, spec in enumerate(specs):
        path, overrides = parse_config_spec(spec)
        args, deployment, env = split_overrides(overrides)
        name = "specslot" if len(specs) == 1 else f"specslot[{os.path.basename(path)}{spec[len(path) :]}]"
        fleet.append(
            servers.ours(base_port + i, out_dir, path, args, name=name, deployment=deployment or None, env=env)
        )
    return fleet


def peer_models(specs: list[str], target: str | None, draft: str | None) -> tuple[str, str | None]:
    """(target, draft) for the peers and `--engine`: as given, else what the first config
    spec serves (`servers.config_models`), so the peers run our weights; the bundled
    draft goes with the bundled target."""
    if target is None:
        path, overrides = parse_config_spec(specs[0])
        target, config_draft = servers.config_models(path, split_overrides(overrides)[0])
        return target, draft or config_draft
    return target, draft or servers.bundled_draft(target)


def select_peers(target: str, draft: str | None, peer_names: list[str] | None, cpu: bool) -> list[tuple]:
    """The peers that run, as (name, model, draft model, extra flags): those named
    (`["none"]`: none), else all but `mlx_lm-wide`; the `-f32` ones (CPU only) name the
    model to copy to float32. Without a draft model the `+draft` peers are left out, or
    a ValueError when named.

    >>> [p[0] for p in select_peers("t", None, None, cpu=True)]
    ['mlx_lm', 'mlx_lm-f32']
    >>> [p[0] for p in select_peers("t", "d", None, cpu=False)]
    ['mlx_lm', 'mlx_lm+draft']
    """
    peers = [("mlx_lm", target, None, ()), ("mlx_lm+draft", target, draft, ()), ("mlx_lm-wide", target, None, WIDE)]
    if cpu:
        peers += [("mlx_lm-f32", target, None, ()), ("mlx_lm-f32+draft", target, draft, ())]
    named = set(peer_names or ()) - {"none"}
    unknown = named - {p[0] for p in peers}
    if unknown:
        raise ValueError(f"unknown peer(s) {sorted(unknown)}; choose from {[p[0] for p in peers]}")
    if draft is None and any(name.endswith("+draft") for name in named):
        raise ValueError(
            f"peer(s) {sorted(n for n in named if n.endswith('+draft'))} need a draft model, "
            f"and {target} has none: --draft names one"
        )
    if peer_names == ["none"]:  # ours only (e.g. one replica against two)
        return []
    if peer_names:
        return [p for p in peers if p[0] in named]
    # `mlx_lm-wide` runs only when named; the `+draft` peers only with a draft model
    return [p for p in peers if not p[3] and (draft is not None or not p[0].endswith("+draft"))]


PROMPT_SETS = ("completions", "code", "chat")


def run(
    quick: bool,
    target: str | None,
    draft: str | None,
    seed: int = 0,
    out_dir: str = "results/vs_mlx_lm",
    concurrencies: tuple[int, ...] = CONCURRENCIES,
    base_port: int = 8120,
    configs: list[str] | None = None,
    peer_names: list[str] | None = None,
    repeats: int | None = None,
    repeat_prompts: bool = False,
    max_tokens: int | None = None,
    prompts_per_stream: int | None = None,
    temperature: float = 0.0,
    startup_timeout_s: float = 300.0,
    prompt_chars: int = 600,
    shared_prefix_chars: int = 0,
    engine: bool = False,
    prompt_tokens: int = 0,
    prompts: str = "completions",
) -> dict:
    max_tokens = max_tokens or (32 if quick else 128)
    repeats = repeats or (2 if quick else 3)
    target, draft = peer_models(configs or [DEFAULT_CONFIG], target, draft)
    peers = select_peers(target, draft, peer_names, _is_cpu())

    def f32(path):  # the f32 peers' float32 copies, made once, only for the peers that run
        return path and servers.float32_copy(path, out_dir)

    peers = [(name, f32(m), f32(d), extra) if "-f32" in name else (name, m, d, extra) for name, m, d, extra in peers]
    ours = our_servers(configs or [DEFAULT_CONFIG], base_port, out_dir)
    fleet = ours + [
        servers.mlx_lm_server(base_port + len(ours) + i, out_dir, model, d, name=name, extra=extra)
        for i, (name, model, d, extra) in enumerate(peers)
    ]
    runs = []

    def load_config(base_url: str, concurrency: int, prompt_seed: int) -> LoadConfig:
        num_prompts = max(4 if quick else 8, (prompts_per_stream or (1 if quick else 4)) * concurrency)
        return LoadConfig(
            base_url=base_url,
            num_prompts=num_prompts,
            concurrency=concurrency,
            max_tokens=max_tokens,
            seed=prompt_seed,
            progress=False,
            ignore_eos="off",
            temperature=temperature,
            prompt_chars=prompt_chars,
            shared_prefix_chars=shared_prefix_chars,
            prompt_tokens=prompt_tokens,
            tokenizer=target if prompt_tokens else None,
            endpoint="completions" if prompts == "completions" else "chat",
            chat_prompts="questions" if prompts == "chat" else "code",
        )

    def seeds():
        for concurrency in concurrencies:
            for rep in range(repeats):
                yield concurrency, rep, seed + rep if repeat_prompts else run_seed(seed, concurrency, rep)

    try:
        for server in fleet:
            server.start("/v1/models", timeout_s=startup_timeout_s)
        for server in fleet:  # warm-up: first-call costs out of the measured runs
            asyncio.run(
                run_load(
                    LoadConfig(
                        base_url=server.base_url,
                        num_prompts=2,
                        concurrency=2,
                        max_tokens=8,
                        seed=seed + 999,
                        progress=False,
                    )
                )
            )
        warmed = set()
        for concurrency, rep, prompt_seed in seeds():
            if concurrency not in warmed:  # an unmeasured run of the same shape first, on every server
                warmed.add(concurrency)
                for server in fleet:
                    if not (quick and concurrency > 1 and server.name.endswith("+draft")):
                        asyncio.run(run_load(load_config(server.base_url, concurrency, warm_seed(seed, concurrency))))
            for server in fleet:
                if quick and concurrency > 1 and server.name.endswith("+draft"):
                    continue
                cfg = load_config(server.base_url, concurrency, prompt_seed)
                before = scrape(server) if server in ours else None
                cpu_before = proc_tree.cpu_seconds(server.proc.pid)
                wall, client_cpu = time.perf_counter(), time.process_time()
                result = asyncio.run(run_load(cfg))
                cores = cores_used(
                    cpu_before,
                    proc_tree.cpu_seconds(server.proc.pid),
                    time.perf_counter() - wall,
                    time.process_time() - client_cpu,
                )
                server_side = ticks = None
                if before is not None:
                    after = scrape(server)
                    server_side = metrics.bucket_delta(before["ttft"], after["ttft"])
                    ticks = tick_delta(before, after)
                runs.append(run_record(server.name, concurrency, rep, prompt_seed, result, server_side, ticks, cores))
                within = (
                    ""
                    if server_side is None
                    else " server TTFT <= 1 s: %d / %d" % metrics.share_within(server_side, 1.0)
                )
                spread = "" if before is None else replica_line(before, after)
                print(
                    f"{run_line(server.name, concurrency, rep, result['summary'])} failed "
                    f"{result['summary']['failed']} cached prompt tokens {result['cached_prompt_tokens']}{within}"
                    f"{tick_line(ticks)}{spread}{cores_line(cores)}",
                    flush=True,
                )
    finally:
        stops = {server.name: server.stop() for server in fleet}
    if engine:  # the same runs in-process, once the servers are gone
        runs += engine_runs((configs or [DEFAULT_CONFIG])[0], target, seeds(), load_config, seed)
    startup = {server.name: server.startup_s for server in fleet}
    return {
        "scenario": "vs_mlx_lm",
        "quick": quick,
        "max_tokens": max_tokens,
        "repeats": repeats,
        "repeat_prompts": repeat_prompts,
        "shared_prefix_chars": shared_prefix_chars,
        "temperature": temperature,
        "machine": bench_util.machine(),
        "servers": {s.name: s.cmd for s in fleet},
        "startup_s": startup,
        "exit_codes": stops,
        "runs": runs,
        "rows": pair_ratios(runs, [p[0] for p in peers], [s.name for s in ours]),
        "engine_rows": engine_rows(runs, ours[0].name) if engine else [],
    }


ENGINE = "specslot-engine"


def run_record(
    name: str,
    concurrency: int,
    repeat: int,
    prompt_seed: int,
    result: dict,
    server_side: dict | None = None,
    ticks: dict | None = None,
    cores: dict | None = None,
) -> dict:
    """One run as the results keep it: `result` from the load generator (or the
    in-process load), `server_side` the replica's TTFT histogram over the run,
    `ticks` its scheduler's ticks (`tick_delta`; None: not read) and `cores` the CPU
    cores each kind of the server's processes and the load generator used (`cores_used`)."""
    return {
        "server": name,
        "concurrency": concurrency,
        "repeat": repeat,
        "prompt_seed": prompt_seed,
        "cached_prompt_tokens": result["cached_prompt_tokens"],
        "summary": result["summary"],
        "output_lengths": result["output_lengths"],
        "server_ttft_buckets": None if server_side is None else {str(k): v for k, v in server_side.items()},
        "server_ticks": ticks,
        "cores": cores,
    }


def cores_used(before: dict, after: dict, wall_s: float, client_cpu_s: float) -> dict:
    """CPU cores used over a run by each kind of the server's processes
    (`proc_tree.cpu_by_kind`) and by this process, the load generator (`client`).

    >>> cores_used({7: ("ProxyActor", 1.0)}, {7: ("ProxyActor", 2.0)}, 2.0, 0.5)
    {'ProxyActor': 0.5, 'client': 0.25}
    """
    return {**proc_tree.cpu_by_kind(before, after, wall_s), "client": client_cpu_s / wall_s}


def cores_line(cores: dict | None, top: int = 5) -> str:
    """The progress line's part about CPU: the busiest kinds and the client, in cores.

    >>> cores_line({"ProxyActor": 0.91, "SchedulerActor": 0.6, "raylet": 0.01, "client": 0.42}, top=2)
    '; cores: ProxyActor 0.91, SchedulerActor 0.60, client 0.42'
    """
    if not cores:
        return ""
    busiest = [(name, value) for name, value in cores.items() if name != "client"][:top]
    parts = [f"{name} {value:.2f}" for name, value in busiest + [("client", cores.get("client", 0.0))]]
    return f"; cores: {', '.join(parts)}"


def run_line(name: str, concurrency: int, repeat: int, summary: dict) -> str:
    """The progress line of one run: throughput, mean TTFT, TPOT p50."""
    return (
        f"c={concurrency} rep={repeat} {name:<18} {summary['output_throughput']:8.1f} tok/s "
        f"TTFT {summary['mean_ttft_ms']:8.1f} ms  TPOT {metrics.fmt(summary['median_tpot_ms'])} ms"
    )


def engine_runs(spec: str, target: str, seeds, load_config, seed: int) -> list[dict]:
    """The runs of `seeds` ((concurrency, repeat, prompt seed)) on the engine config
    `spec` builds, in-process (`scripts.bench.engine_load`), after the same warm-up."""
    from scripts.bench.engine_load import engine_from_config, run_engine_load
    from serve_app.openai.codec import TextCodec

    engine, info = engine_from_config(spec, target)
    codec, eos = TextCodec.from_path(target), info["eos_token_ids"]
    runs = []
    try:
        warm = LoadConfig(base_url="", num_prompts=2, concurrency=2, max_tokens=8, seed=seed + 999)
        run_engine_load(engine, codec, eos, warm)
        warmed = set()
        for concurrency, rep, prompt_seed in seeds:
            if concurrency not in warmed:  # as for the servers: one unmeasured run of each shape
                warmed.add(concurrency)
                run_engine_load(engine, codec, eos, load_config("", concurrency, warm_seed(seed, concurrency)))
            result = run_engine_load(engine, codec, eos, load_config("", concurrency, prompt_seed))
            runs.append(run_record(ENGINE, concurrency, rep, prompt_seed, result))
            print(run_line(ENGINE, concurrency, rep, result["summary"]), flush=True)
    finally:
        engine.stop()
    return runs


def engine_rows(runs: list[dict], ours_name: str) -> list[dict]:
    """Per concurrency: our server's TPOT and TTFT p50 against the in-process engine's
    on the same prompts (medians over repeats), and the share of the server's TPOT the
    serving path adds."""
    rows = []
    for concurrency in sorted({r["concurrency"] for r in runs if r["server"] == ENGINE}):

        def median(server, key):
            values = [
                r["summary"][key]
                for r in runs
                if r["server"] == server and r["concurrency"] == concurrency and r["summary"][key] is not None
            ]
            return statistics.median(values) if values else None

        http, inproc = median(ours_name, "median_tpot_ms"), median(ENGINE, "median_tpot_ms")
        rows.append(
            {
                "concurrency": concurrency,
                "http_tpot_ms": http,
                "engine_tpot_ms": inproc,
                "http_share": None if not http or inproc is None else 1 - inproc / http,
                "http_ttft_ms": median(ours_name, "median_ttft_ms"),
                "engine_ttft_ms": median(ENGINE, "median_ttft_ms"),
                "http_tok_s": median(ours_name, "output_throughput"),
                "engine_tok_s": median(ENGINE, "output_throughput"),
            }
        )
    return rows


ENGINE_COLUMNS = [
    ("concurrency", "concurrency"),
    ("http_tok_s", "server tok/s"),
    ("engine_tok_s", "engine tok/s"),
    ("http_tpot_ms", "server TPOT p50 ms"),
    ("engine_tpot_ms", "engine TPOT p50 ms"),
    ("http_share", "serving path's share of TPOT"),
    ("http_ttft_ms", "server TTFT p50 ms"),
    ("engine_ttft_ms", "engine TTFT p50 ms"),
]


TTFT_HISTOGRAM = "specslot:time_to_first_token_seconds"
TICK_SUMMARY = "specslot_scheduler_tick_seconds"
TICK_GAP = "specslot_scheduler_tick_gap_seconds_total"
STEPS = ("specslot_scheduler_classic_steps_total", "specslot_scheduler_pipelined_steps_total")


def scrape(server) -> dict:
    """Our server's series as they stand, summed over its replicas: the TTFT histogram
    (docs/metrics.md: replica arrival to the first token, whether or not it decodes to
    text; the load generator times the first chunk with text, which a random-weight
    model's first tokens may not have), the scheduler's ticks by action (count and
    seconds), the engine thread's time between ticks and the classic batch's decode steps
    and pipelined ones (`steps`); and by replica, the requests each has given a first
    token (`replicas`)."""
    texts = metrics.fetch_replicas(server.base_url, server.num_replicas)
    out = {"ttft": {}, "tick_count": {}, "tick_sum": {}, "gap_s": 0.0, "steps": [0.0, 0.0], "replicas": {}}
    for replica, text in texts.items():
        ttft = metrics.histogram_buckets(text, TTFT_HISTOGRAM)
        for key, series in (
            ("ttft", ttft),
            ("tick_count", metrics.labelled_samples(text, TICK_SUMMARY + "_count", "action")),
            ("tick_sum", metrics.labelled_samples(text, TICK_SUMMARY + "_sum", "action")),
        ):
            for label, value in series.items():
                out[key][label] = out[key].get(label, 0.0) + value
        out["gap_s"] += metrics.labelled_samples(text, TICK_GAP, "").get("", 0.0)
        for i, name in enumerate(STEPS):
            out["steps"][i] += metrics.labelled_samples(text, name, "").get("", 0.0)
        out["replicas"][replica] = ttft.get(math.inf, 0.0)
    return out


def replica_line(before: dict, after: dict) -> str:
    """The progress line's part about how the requests spread over replicas ("" with one)."""
    if len(after["replicas"]) < 2:
        return ""
    counts = [
        int(n - before["replicas"].get(rid, 0.0))
        for rid, n in sorted(after["replicas"].items(), key=lambda kv: str(kv[0]))
    ]
    return f"; requests by replica {' / '.join(map(str, counts))}"


def tick_delta(before: dict, after: dict) -> dict:
    """The scheduler's ticks between two scrapes: per action that ran, how many and their
    mean milliseconds; the engine thread's mean gap between ticks in ms; the classic
    batch's decode steps and how many were pipelined."""
    actions = {}
    for action, count in after["tick_count"].items():
        n = count - before["tick_count"].get(action, 0.0)
        if n > 0:
            seconds = after["tick_sum"].get(action, 0.0) - before["tick_sum"].get(action, 0.0)
            actions[action] = {"count": int(n), "mean_ms": 1000.0 * seconds / n}
    ticks = sum(a["count"] for name, a in actions.items() if name != "fused")
    gap_ms = 1000.0 * (after["gap_s"] - before["gap_s"]) / ticks if ticks else None
    steps, pipelined = (int(a - b) for a, b in zip(after.get("steps", (0, 0)), before.get("steps", (0, 0))))
    return {"actions": actions, "gap_ms": gap_ms, "steps": steps, "pipelined": pipelined}


def tick_line(ticks: dict | None) -> str:
    """The progress line's part about the scheduler's ticks ("" when not read)."""
    if not ticks:
        return ""
    parts = [f"{name} {a['count']} x {a['mean_ms']:.2f} ms" for name, a in ticks["actions"].items() if name != "idle"]
    steps = f"; steps pipelined {ticks['pipelined']} of {ticks['steps']}" if ticks.get("steps") else ""
    return f"; ticks: {', '.join(parts)}; gap {metrics.fmt(ticks['gap_ms'], 2)} ms/tick{steps}"


WARM_REPEAT = 999  # the unmeasured run of a concurrency takes the seed of this repeat (none reaches it)


def run_seed(seed: int, concurrency: int, repeat: int) -> int:
    """Prompt seed of one (concurrency, repeat) run: distinct across runs.

    >>> run_seed(0, 4, 1), run_seed(0, 16, 0)
    (4001, 16000)
    """
    return seed + 1000 * concurrency + repeat


def warm_seed(seed: int, concurrency: int) -> int:
    """Prompt seed of a concurrency's unmeasured run: one no measured run has, so a server
    whose caches remember the warm-up (prefix cache, prompt lookup) gains nothing from it.

    >>> warm_seed(0, 1) in {run_seed(0, c, r) for c in (1, 4, 16) for r in range(WARM_REPEAT)}
    False
    """
    return run_seed(seed, concurrency, WARM_REPEAT)


def pair_ratios(runs: list[dict], peers: list[str], ours_names: list[str] = ("specslot",)) -> list[dict]:
    rows = []
    for concurrency in sorted({r["concurrency"] for r in runs}):
        for name in ours_names:
            rows += _pairs_at(runs, concurrency, name, peers)
    return rows


def _pairs_at(runs: list[dict], concurrency: int, ours_name: str, peers: list[str]) -> list[dict]:
    rows = []
    ours = {r["repeat"]: r["summary"] for r in runs if r["concurrency"] == concurrency and r["server"] == ours_name}
    buckets = [
        r["server_ttft_buckets"]
        for r in runs
        if r["concurrency"] == concurrency and r["server"] == ours_name and r.get("server_ttft_buckets")
    ]
    # requests whose first token (server side, text or not) came after 1 s, in all repeats
    over = [n - k for k, n in (metrics.share_within({float(b): c for b, c in d.items()}, 1.0) for d in buckets)]
    for peer in peers:
        theirs = {r["repeat"]: r["summary"] for r in runs if r["concurrency"] == concurrency and r["server"] == peer}
        reps = sorted(set(ours) & set(theirs))
        if not reps:  # e.g. a +draft peer skipped at this concurrency in quick mode
            continue
        tput = [ours[k]["output_throughput"] / theirs[k]["output_throughput"] for k in reps]
        ttft = [ours[k]["mean_ttft_ms"] / theirs[k]["mean_ttft_ms"] for k in reps]
        rows.append(
            {
                "concurrency": concurrency,
                "ours": ours_name,
                "peer": peer,
                "pairs": len(reps),
                "ours_tok_s": statistics.median(ours[k]["output_throughput"] for k in reps),
                "peer_tok_s": statistics.median(theirs[k]["output_throughput"] for k in reps),
                "throughput_ratios": tput,
                "throughput_ratio_median": statistics.median(tput),
                "ttft_ratios": ttft,
                "ttft_ratio_median": statistics.median(ttft),
                "ours_ttft_ms": statistics.median(ours[k]["mean_ttft_ms"] for k in reps),
                "peer_ttft_ms": statistics.median(theirs[k]["mean_ttft_ms"] for k in reps),
                **_latency(ours, reps, "ours"),
                **_latency(theirs, reps, "peer"),
                "ours_server_ttft_over_1s": sum(over) if over else None,
            }
        )
    return rows


def _latency(summaries: dict[int, dict], reps: list[int], side: str) -> dict:
    """TTFT and TPOT p50/p99 (medians over repeats) of one server, and the p99 TTFT of its
    first repeat: the first wave at this concurrency, which pays any first-use compiles."""
    out = {
        f"{side}_{stat}_{name}_ms": statistics.median(summaries[k][f"{stat}_{name}_ms"] for k in reps)
        for stat in ("median", "p99")
        for name in ("ttft", "tpot")
        if all(summaries[k][f"{stat}_{name}_ms"] is not None for k in reps)
    }
    out[f"{side}_first_p99_ttft_ms"] = summaries[reps[0]]["p99_ttft_ms"]
    return out


COLUMNS = [
    ("concurrency", "concurrency"),
    ("ours", "ours"),
    ("peer", "peer"),
    ("ours_tok_s", "specslot tok/s"),
    ("peer_tok_s", "peer tok/s"),
    ("throughput_ratio_median", "tok/s ratio (median of pairs)"),
    ("ours_ttft_ms", "specslot TTFT ms"),
    ("peer_ttft_ms", "peer TTFT ms"),
    ("ttft_ratio_median", "TTFT ratio"),
    ("ours_p99_ttft_ms", "specslot TTFT p99"),
    ("peer_p99_ttft_ms", "peer TTFT p99"),
    ("ours_median_tpot_ms", "specslot TPOT p50"),
    ("peer_median_tpot_ms", "peer TPOT p50"),
    ("ours_p99_tpot_ms", "specslot TPOT p99"),
    ("peer_p99_tpot_ms", "peer TPOT p99"),
    ("ours_first_p99_ttft_ms", "specslot 1st-wave TTFT p99"),
    ("peer_first_p99_ttft_ms", "peer 1st-wave TTFT p99"),
    ("ours_server_ttft_over_1s", "specslot requests with a server-side TTFT over 1 s"),
]


def plot(result: dict, path: str) -> None:
    plt = bench_util.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for ours, peer in sorted({(r.get("ours", "specslot"), r["peer"]) for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["peer"] == peer and r.get("ours", "specslot") == ours]
        label = peer if ours == "specslot" else f"{ours} / {peer}"
        ax.plot([r["concurrency"] for r in rows], [r["throughput_ratio_median"] for r in rows], marker="o", label=label)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("specslot / peer output tok/s")
    ax.set_title("Scenario 4: side by side with mlx_lm.server")
    ax.legend()
    bench_util.save_figure(fig, path)


def main(argv=None) -> int:
    ap = bench_util.scenario_args(__doc__.split("\n\n")[0], "results/vs_mlx_lm")
    ap.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="PATH[:key=value,...]",
        help=f"our deployment config, repeatable (default {DEFAULT_CONFIG})",
    )
    ap.add_argument(
        "--concurrency",
        action="append",
        type=int,
        default=None,
        help=f"repeatable (default {' '.join(map(str, CONCURRENCIES))})",
    )
    ap.add_argument("--peer", action="append", default=None, help="only these peers (repeatable; `none`: ours only)")
    ap.add_argument("--repeats", type=int, default=None, help="runs per server and concurrency")
    ap.add_argument(
        "--repeat-prompts",
        action="store_true",
        help="reuse the same prompts in every run (exercises the peer's prompt cache)",
    )
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per request (default 128; quick 32)")
    ap.add_argument(
        "--prompts-per-stream",
        type=int,
        default=None,
        help="requests per run = this x concurrency (default 4; quick 1)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's temperature (default greedy)")
    ap.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for each server to be ready")
    ap.add_argument("--prompt-chars", type=int, default=600, help="characters per prompt (default 600)")
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="prompts of this many tokens instead of --prompt-chars characters (the target's "
        "tokenizer counts them; each starts with a line of its own)",
    )
    ap.add_argument(
        "--shared-prefix-chars",
        type=int,
        default=0,
        help="every prompt of every run starts with the same text of this many characters, as an "
        "agent's system prompt does (both servers' prefix caches; default none)",
    )
    ap.add_argument(
        "--prompts",
        choices=PROMPT_SETS,
        default="completions",
        help="completions: code snippets to continue (default); code: chat requests to continue "
        "them; chat: everyday chat questions (prose answers: prompt lookup rarely drafts)",
    )
    ap.add_argument(
        "--engine",
        action="store_true",
        help="then the same runs in-process on the engine the first config builds "
        "(no HTTP, no Ray): what the serving path adds, per concurrency",
    )
    ap.set_defaults(target=None, draft=None)  # the peers run what the first config serves
    args = ap.parse_args(argv)
    if args.repeats is not None and not 1 <= args.repeats < WARM_REPEAT:
        ap.error(f"--repeats: 1 to {WARM_REPEAT - 1}")
    result = run(
        args.quick,
        args.target,
        args.draft,
        args.seed,
        out_dir=args.out,
        concurrencies=tuple(args.concurrency or CONCURRENCIES),
        configs=args.config,
        peer_names=args.peer,
        repeats=args.repeats,
        repeat_prompts=args.repeat_prompts,
        max_tokens=args.max_tokens,
        prompts_per_stream=args.prompts_per_stream,
        temperature=args.temperature,
        startup_timeout_s=args.startup_timeout,
        prompt_chars=args.prompt_chars,
        shared_prefix_chars=args.shared_prefix_chars,
        engine=args.engine,
        prompt_tokens=args.prompt_tokens,
        prompts=args.prompts,
    )
    text = metrics.table(result["rows"], COLUMNS, digits=2)
    if result["engine_rows"]:
        text += "\n\nThe same runs in-process (`--engine`):\n\n" + metrics.table(
            result["engine_rows"], ENGINE_COLUMNS, digits=2
        )
    bench_util.publish(args, "vs_mlx_lm", result, text, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
