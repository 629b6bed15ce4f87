"""Scenario 7: multi-turn chat, TTFT per turn with the prefix cache on and off.

    python -m scripts.bench.multiturn [--quick] [--out results/multiturn] [--peer | --no-peer] [--repeats N]
        [--replicas N [--prompt-key]] [--engine] [--config PATH[:key=value,...]]

Conversations resend their whole history every turn, as chat clients and agents do: a
first user message of `first_tokens` tokens, then per turn the assistant's reply
(`max_tokens`, greedy) and a new user message of `turn_tokens` tokens, so the history
grows toward the model's context (full mode: 8 conversations x 6 turns, ~350 + 5 x 96
tokens, ~900 at the last turn for the bundled model's 1,024). `concurrency`
conversations run at once, each turn after the previous one's reply. Texts are held-out
stdlib snippets cut to exact token counts with the target's tokenizer: the model the
config serves (`servers.config_models`) unless `--target` names one.

Servers, all started here on 127.0.0.1 and up together, each run in turn with the same
conversations (an idle server uses no CPU):
- `cache_on`: configs/local.yaml (the prefix cache at its default budget);
- `cache_off`: the same with `prefix_cache_bytes: 0`;
- `mlx_lm`: `mlx_lm server` with its own prompt cache, on a float32 copy of the weights
  on CPU (what our CPU loader runs; scenario 4 says why); full mode only unless
  `--peer`, off with `--no-peer`;
- `cache_on_xN` with `--replicas N`: configs/local.yaml with N replicas; each
  conversation sends its own `X-Session-Id`, so affinity routing keeps it on one
  replica; reports the share of turns that stayed and the requests per replica;
- `cache_on_xN_prompt` with `--replicas N --prompt-key`: the same with
  `affinity_key: prompt`, and the conversations send no session id (affinity from the
  prompt's leading messages, through `SpecslotIngress`).
With `--engine` no server starts: the same conversations run in-process on the engine
`configs/local.yaml` builds (the scheduler actor's engine thread, `cache_on`, and
`cache_off` with the prefix cache off), no HTTP and no Ray; TTFT is from the submit to
the event that carries the first token. What the serving path adds is the difference
between the two tables.
Every repeat (`--repeats`, default 1) uses fresh conversations (its own seed), so no
server reuses a previous run's cache. TTFT is the time to the first streamed content chunk. Peak RSS is each
server's largest process (VmHWM from /proc: the scheduler actor for ours) when the run
ends. For our servers the result also says where the turns' TTFT went (`phases`: means
over the measured turns from each server's /metrics, read before and after every run).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time

from scripts.bench import metrics, servers
from scripts.bench import util as bench_util
from scripts.bench.proc_tree import peak_rss_mb
from scripts.bench.prompts import stdlib_snippets
from scripts.bench.vs_mlx_lm import parse_config_spec

DEFAULT_CONFIG = "configs/local.yaml"
# Where a turn's TTFT goes, from our servers' own series (docs/metrics.md): the replica's
# TTFT (arrival at the replica to the first token reaching it), and the scheduler's
# queue (arrival at the engine to first scheduled) and prefill (to the first token).
PHASES = {
    "replica": "specslot:time_to_first_token_seconds",
    "queue": "specslot:request_queue_time_seconds",
    "prefill": "specslot:request_prefill_time_seconds",
}


def sizes(quick: bool) -> dict:
    if quick:
        return {
            "num_conversations": 4,
            "num_turns": 3,
            "concurrency": 2,
            "first_tokens": 350,
            "turn_tokens": 64,
            "max_tokens": 16,
            "repeats": 1,
        }
    return {
        "num_conversations": 8,
        "num_turns": 6,
        "concurrency": 4,
        "first_tokens": 350,
        "turn_tokens": 64,
        "max_tokens": 32,
        "repeats": 1,
    }


def split_sizes(quick: bool, repeats: int | None, overrides: dict | None) -> tuple[dict, dict]:
    """(workload sizes, our servers' `args` overrides): `overrides` keys that name a size
    (`first_tokens`, `turn_tokens`, `max_tokens`, ...) set it, the others go to the servers.

    >>> split_sizes(True, None, {"first_tokens": 2000, "prefix_cache_bytes": 0})[1]
    {'prefix_cache_bytes': 0}
    """
    size = {**sizes(quick), **({"repeats": repeats} if repeats else {})}
    overrides = dict(overrides or {})
    size.update({k: overrides.pop(k) for k in list(overrides) if k in size})
    return size, overrides


def user_texts(
    tokenizer, num_conversations: int, num_turns: int, first_tokens: int, turn_tokens: int, seed: int
) -> list[list[str]]:
    """Per conversation, its user messages: the first `first_tokens` tokens long, the
    others `turn_tokens`; deterministic in `seed`. A message longer than one held-out
    file joins snippets until it has its tokens. A first message begins with a line
    naming its conversation and seed: a snippet longer than its file is the whole file,
    so without it two conversations (of one run, or of two runs with other seeds) could
    open with the same text and one would find the other's prompt cached, or share its
    prefill."""
    snippets = stdlib_snippets(num_conversations * num_turns, seed, num_chars=8 * first_tokens)
    more = (stdlib_snippets(1, seed + 1000 + k, num_chars=8 * first_tokens)[0] for k in itertools.count())

    def cut(text: str, num_tokens: int) -> str:
        ids = tokenizer.encode(text)
        while len(ids) < num_tokens:
            ids += tokenizer.encode("\n" + next(more))
        return tokenizer.decode(ids[:num_tokens])

    texts = iter(snippets)
    return [
        [
            cut(
                (f"# conversation {seed}-{index}\n" if turn == 0 else "") + next(texts),
                first_tokens if turn == 0 else turn_tokens,
            )
            for turn in range(num_turns)
        ]
        for index in range(num_conversations)
    ]


async def stream_chat(session, base_url: str, messages: list[dict], max_tokens: int, session_id: str | None) -> dict:
    """One streamed chat completion: TTFT, the reply's text, what usage reports and which
    replica answered. `session_id` goes in Serve's session header (replica affinity);
    None sends none."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tic = time.perf_counter()
    rec = {"ttft_s": None, "text": "", "prompt_tokens": None, "cached_tokens": None, "error": None, "replica": None}
    headers = {"X-Session-Id": session_id} if session_id else {}
    async with session.post(base_url + "/v1/chat/completions", json=body, headers=headers) as resp:
        rec["replica"] = resp.headers.get("X-Specslot-Replica")
        if resp.status >= 400:
            rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return rec
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                # The first token: the first text, or the end of a reply without any (its
                # first token was a stop token), so an empty reply still has a TTFT.
                if (text or choice.get("finish_reason")) and rec["ttft_s"] is None:
                    rec["ttft_s"] = time.perf_counter() - tic
                if text:
                    rec["text"] += text
            usage = chunk.get("usage")
            if usage:
                rec["prompt_tokens"] = usage.get("prompt_tokens")
                rec["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return rec


async def run_conversations(
    base_url: str,
    conversations: list[list[str]],
    concurrency: int,
    max_tokens: int,
    run_id: str = "run",
    session_ids: bool = True,
) -> list[dict]:
    """Every conversation's turns in order, `concurrency` conversations at a time; one
    record per turn, with its conversation and turn index. `session_ids`: each
    conversation sends its own X-Session-Id."""
    import aiohttp

    records: list[dict] = []
    pending = list(enumerate(conversations))
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker():
            while pending:
                index, user_messages = pending.pop(0)
                history: list[dict] = []
                for turn, text in enumerate(user_messages):
                    history.append({"role": "user", "content": text})
                    rec = await stream_chat(
                        session, base_url, history, max_tokens, f"{run_id}-{index}" if session_ids else None
                    )
                    records.append({"conversation": index, "turn": turn + 1, **rec})
                    history.append({"role": "assistant", "content": rec["text"]})

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


def phase_totals(text: str) -> dict[str, list[float]]:
    """Per phase of `PHASES`, [seconds, observations] summed over label sets, from a
    /metrics exposition `text`."""
    return {
        phase: [metrics.series_total(text, name + suffix) for suffix in ("_sum", "_count")]
        for phase, name in PHASES.items()
    }


def scrape_phases(base_url: str) -> dict[str, list[float]]:
    return phase_totals(metrics.fetch(base_url))


def add_phases(total: dict, before: dict, after: dict, run_records: list[dict]) -> None:
    """Adds to `total` what the phases gained over one run, and the client's TTFTs of the
    run's turns (`client`)."""
    ttfts = [r["ttft_s"] for r in run_records if r["ttft_s"] is not None]
    gains = {phase: (after[phase][0] - before[phase][0], after[phase][1] - before[phase][1]) for phase in PHASES}
    gains["client"] = (sum(ttfts), len(ttfts))
    for phase, (seconds, count) in gains.items():
        sums = total.setdefault(phase, [0.0, 0.0])
        sums[0] += seconds
        sums[1] += count


def phase_rows(phases: dict[str, dict]) -> list[dict]:
    """Per server, the phases' means in ms over every measured turn: the client's TTFT,
    the replica's, the scheduler's queue and prefill, and the differences: the proxy
    and the stream's way out (`serving`: client - replica), and the replica's way to
    the engine and back (`hop`: replica - queue - prefill).

    >>> phase_rows({"s": {"client": [1.0, 10], "replica": [0.8, 10], "queue": [0.1, 10], "prefill": [0.5, 10]}})
    [{'server': 's', 'turns': 10, 'client_ms': 100.0, 'replica_ms': 80.0, 'queue_ms': 10.0, 'prefill_ms': 50.0, 'serving_ms': 20.0, 'hop_ms': 20.0}]
    """
    rows = []
    for name, total in phases.items():
        mean = {phase: 1000 * seconds / count if count else None for phase, (seconds, count) in total.items()}
        if None in mean.values():
            continue
        rows.append(
            {
                "server": name,
                "turns": int(total["client"][1]),
                "client_ms": mean["client"],
                "replica_ms": mean["replica"],
                "queue_ms": mean["queue"],
                "prefill_ms": mean["prefill"],
                "serving_ms": mean["client"] - mean["replica"],
                "hop_ms": mean["replica"] - mean["queue"] - mean["prefill"],
            }
        )
    return rows


PHASE_COLUMNS = [
    ("server", "server"),
    ("turns", "turns"),
    ("client_ms", "TTFT at the client"),
    ("replica_ms", "at the replica"),
    ("queue_ms", "engine queue"),
    ("prefill_ms", "engine prefill"),
    ("serving_ms", "proxy and stream out (client - replica)"),
    ("hop_ms", "replica to engine and back (replica - queue - prefill)"),
]


def turn_rows(records: list[dict], names: list[str]) -> list[dict]:
    """One row per turn: prompt tokens, and per server TTFT p50/p99 and cached tokens."""
    rows = []
    for turn in sorted({r["turn"] for r in records}):
        row = {"turn": turn}
        for name in names:
            mine = [r for r in records if r["server"] == name and r["turn"] == turn and r["ttft_s"] is not None]
            stats = metrics.describe([r["ttft_s"] for r in mine], "ttft")
            row[f"{name}_p50_ms"], row[f"{name}_p99_ms"] = stats["median_ttft_ms"], stats["p99_ttft_ms"]
            cached = [r["cached_tokens"] or 0 for r in mine]
            row[f"{name}_cached"] = sum(cached) / len(cached) if cached else None
            if name == names[0]:
                prompts = [r["prompt_tokens"] for r in mine if r["prompt_tokens"]]
                row["prompt_tokens"] = sum(prompts) / len(prompts) if prompts else None
        if row.get("cache_on_p50_ms") and row.get("cache_off_p50_ms"):
            row["off_over_on_p50"] = row["cache_off_p50_ms"] / row["cache_on_p50_ms"]
        rows.append(row)
    return rows


def affinity_stats(records: list[dict], name: str) -> dict:
    """For a multi-replica server: the share of turns after the first that landed on the
    replica of their conversation's first turn, and the requests each replica served."""
    mine = [r for r in records if r["server"] == name]
    home = {(r["repeat"], r["conversation"]): r["replica"] for r in mine if r["turn"] == 1}
    later = [r for r in mine if r["turn"] > 1]
    same = sum(1 for r in later if r["replica"] == home.get((r["repeat"], r["conversation"])))
    counts: dict[str, int] = {}
    for r in mine:
        counts[r["replica"]] = counts.get(r["replica"], 0) + 1
    return {"same_replica_share": same / len(later) if later else None, "requests_per_replica": counts}


def columns(names: list[str]) -> list[tuple[str, str]]:
    cols = [("turn", "turn"), ("prompt_tokens", "prompt tokens")]
    for name in names:
        cols += [
            (f"{name}_p50_ms", f"{name} TTFT p50 ms"),
            (f"{name}_p99_ms", f"{name} p99 ms"),
            (f"{name}_cached", f"{name} cached tokens"),
        ]
    return cols + [("off_over_on_p50", "cache off / on (p50)")]


def run(
    quick: bool,
    target: str | None,
    seed: int = 0,
    out_dir: str = "results/multiturn",
    base_port: int = 8160,
    with_peer: bool | None = None,
    repeats: int | None = None,
    replicas: int = 0,
    prompt_key: bool = False,
    config: str = DEFAULT_CONFIG,
    overrides: dict | None = None,
) -> dict:
    """`config`, `overrides`: our servers' deployment config and `args` merged over its
    own; `overrides` may also set the workload's sizes (`sizes` keys)."""
    from transformers import AutoTokenizer

    size, ours = split_sizes(quick, repeats, overrides)
    target = target or servers.config_models(config, ours)[0]
    with_peer = (not quick) if with_peer is None else with_peer
    fleet = [
        servers.ours(base_port, out_dir, config, ours, name="cache_on"),
        servers.ours(base_port + 1, out_dir, config, {**ours, "prefix_cache_bytes": 0}, name="cache_off"),
    ]
    if with_peer:
        model = servers.float32_copy(target, out_dir) if _is_cpu() else target
        fleet.append(servers.mlx_lm_server(base_port + 2, out_dir, model, name="mlx_lm"))
    if replicas > 1:
        fleet.append(
            servers.ours(
                base_port + 3,
                out_dir,
                config,
                ours,
                name=f"cache_on_x{replicas}",
                deployment={"num_replicas": replicas},
            )
        )
        if prompt_key:
            fleet.append(
                servers.ours(
                    base_port + 4,
                    out_dir,
                    config,
                    {**ours, "affinity_key": "prompt"},
                    name=f"cache_on_x{replicas}_prompt",
                    deployment={"num_replicas": replicas},
                )
            )
    without_session = {server.name for server in fleet if server.name.endswith("_prompt")}
    tokenizer = AutoTokenizer.from_pretrained(target)
    records, rss, phases = [], {}, {}
    ours_names = {server.name for server in fleet if server.name != "mlx_lm"}
    try:
        for server in fleet:
            server.start("/v1/models")
        # First-call costs out of the measured runs: one short conversation per replica
        # (affinity places each on a replica of its own, so every replica warms up and
        # each holds one session when the measured ones arrive).
        warm = user_texts(tokenizer, max(1, replicas), 2, 64, 16, seed + 999)
        for server in fleet:
            asyncio.run(
                run_conversations(
                    server.base_url, warm, 1, 4, run_id="warm", session_ids=server.name not in without_session
                )
            )
        for rep in range(size["repeats"]):
            conversations = user_texts(
                tokenizer,
                size["num_conversations"],
                size["num_turns"],
                size["first_tokens"],
                size["turn_tokens"],
                seed + rep,
            )
            for server in fleet:
                before = scrape_phases(server.base_url) if server.name in ours_names else None
                tic = time.perf_counter()
                run_records = asyncio.run(
                    run_conversations(
                        server.base_url,
                        conversations,
                        size["concurrency"],
                        size["max_tokens"],
                        run_id=f"rep{rep}",
                        session_ids=server.name not in without_session,
                    )
                )
                if before is not None:
                    add_phases(phases.setdefault(server.name, {}), before, scrape_phases(server.base_url), run_records)
                records += [{"server": server.name, "repeat": rep, **r} for r in run_records]
                errors = [r["error"] for r in run_records if r["error"]]
                print(
                    f"rep={rep} {server.name:<10} {len(run_records)} turns in {time.perf_counter() - tic:.1f} s"
                    + (f"; {len(errors)} errors, first: {errors[0]}" if errors else ""),
                    flush=True,
                )
        rss = {server.name: peak_rss_mb(server.proc.pid) for server in fleet}
    finally:
        stops = {server.name: server.stop() for server in fleet}
    names = [server.name for server in fleet]
    return {
        "scenario": "multiturn",
        "quick": quick,
        **size,
        "machine": bench_util.machine(),
        "servers": {s.name: s.cmd for s in fleet},
        "exit_codes": stops,
        "startup_s": {s.name: s.startup_s for s in fleet},
        "peak_rss": rss,
        "records": [{k: v for k, v in r.items() if k != "text"} for r in records],
        "num_errors": sum(1 for r in records if r["error"]),
        "rows": turn_rows(records, names),
        "affinity": {name: affinity_stats(records, name) for name in names if "_x" in name},
        "phases": phase_rows(phases),
        "server_names": names,
    }


def engine_conversations(
    engine, tokenizer, conversations: list[list[str]], concurrency: int, max_tokens: int, run_id: str = "run"
) -> list[dict]:
    """`run_conversations` in-process: the conversations' turns on `engine` (a started
    `scheduler.engine.Engine`, the scheduler actor's engine thread without Ray),
    `concurrency` conversations at a time, each turn submitted from this thread when the
    last one's reply is complete. A turn's TTFT runs from its submit to the moment this
    thread reads the event carrying its first token; a turn arrives while the engine
    thread may be mid-tick for the others, as a request does in the actor."""
    from scheduler.request import Request, SamplingParams

    pending, live, records = list(enumerate(conversations)), {}, []

    def start(index: int, turn: int, history: list[dict]) -> None:
        text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        request_id = f"{run_id}-c{index}t{turn}"
        live[request_id] = {
            "conversation": index,
            "turn": turn + 1,
            "history": history,
            "out": [],
            "submitted": time.perf_counter(),
            "ttft_s": None,
            "prompt_tokens": len(ids),
        }
        engine.submit(Request(request_id, ids, SamplingParams(max_tokens=max_tokens)))

    def next_conversation() -> None:
        if pending:
            index, messages = pending.pop(0)
            start(index, 0, [{"role": "user", "content": messages[0]}])

    for _ in range(concurrency):
        next_conversation()
    while live:
        events = engine.get_events(timeout=0.1)
        now = time.perf_counter()
        for event in events:
            state = live.get(event.request_id)
            if state is None:
                continue
            if event.token_ids and state["ttft_s"] is None:
                state["ttft_s"] = now - state["submitted"]
            state["out"] += event.token_ids
            if event.finish_reason is None:
                continue
            del live[event.request_id]
            records.append(
                {
                    "conversation": state["conversation"],
                    "turn": state["turn"],
                    "ttft_s": state["ttft_s"],
                    "prompt_tokens": state["prompt_tokens"],
                    "cached_tokens": event.num_cached_tokens,
                    "error": event.error,
                    "replica": None,
                }
            )
            user_messages = conversations[state["conversation"]]
            if state["turn"] < len(user_messages):
                reply = tokenizer.decode(state["out"], skip_special_tokens=True)
                start(
                    state["conversation"],
                    state["turn"],
                    state["history"]
                    + [
                        {"role": "assistant", "content": reply},
                        {"role": "user", "content": user_messages[state["turn"]]},
                    ],
                )
            else:
                next_conversation()
    return records


def run_engine(
    quick: bool,
    target: str | None,
    seed: int = 0,
    repeats: int | None = None,
    config: str = DEFAULT_CONFIG,
    overrides: dict | None = None,
) -> dict:
    """The workload of `run`, in-process on the engine `config` (with `overrides`) builds
    (`serve_app.deployment.actor.build_engine`, as the scheduler actor does), with the prefix cache
    at its configured budget (`cache_on`) and off (`cache_off`)."""
    from transformers import AutoTokenizer

    from scripts.bench.engine_load import engine_from_config

    size, ours = split_sizes(quick, repeats, overrides)
    target = target or servers.config_models(config, ours)[0]
    tokenizer = AutoTokenizer.from_pretrained(target)
    names, records = ["cache_on", "cache_off"], []
    for name in names:
        engine, _ = engine_from_config(
            config, target, {**ours, **({"prefix_cache_bytes": 0} if name == "cache_off" else {})}
        )
        try:
            warm = user_texts(tokenizer, 1, 2, 64, 16, seed + 999)
            engine_conversations(engine, tokenizer, warm, 1, 4, run_id="warm")
            for rep in range(size["repeats"]):
                conversations = user_texts(
                    tokenizer,
                    size["num_conversations"],
                    size["num_turns"],
                    size["first_tokens"],
                    size["turn_tokens"],
                    seed + rep,
                )
                tic = time.perf_counter()
                run_records = engine_conversations(
                    engine, tokenizer, conversations, size["concurrency"], size["max_tokens"], run_id=f"rep{rep}"
                )
                records += [{"server": name, "repeat": rep, **r} for r in run_records]
                print(
                    f"rep={rep} engine {name:<10} {len(run_records)} turns in {time.perf_counter() - tic:.1f} s",
                    flush=True,
                )
        finally:
            engine.stop()
    return {
        "scenario": "multiturn",
        "level": "engine",
        "quick": quick,
        **size,
        "machine": bench_util.machine(),
        "config": config,
        "overrides": ours,
        "peak_rss": {},
        "records": records,
        "num_errors": sum(1 for r in records if r["error"]),
        "rows": turn_rows(records, names),
        "affinity": {},
        "server_names": names,
    }


def _is_cpu() -> bool:
    import mlx.core as mx

    import models  # noqa: F401

    return mx.default_device() == mx.cpu


def plot(result: dict, path: str) -> None:
    plt = bench_util.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in result["server_names"]:
        ax.plot(
            [r["turn"] for r in result["rows"]], [r[f"{name}_p50_ms"] for r in result["rows"]], marker="o", label=name
        )
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("Scenario 7: multi-turn chat")
    ax.legend()
    bench_util.save_figure(fig, path)


def render(result: dict) -> str:
    rss = "; ".join(
        f"{name} {info['peak_rss_mb']:.0f} MB ({info['process']})"
        for name, info in result["peak_rss"].items()
        if info.get("peak_rss_mb")
    )
    affinity = "".join(
        f"\n{name}: {info['same_replica_share']:.0%} of later turns on their first turn's "
        f"replica; requests per replica {sorted(info['requests_per_replica'].values())}"
        for name, info in result.get("affinity", {}).items()
        if info["same_replica_share"] is not None
    )
    phases = result.get("phases")
    where = (
        (
            "\n\nWhere a turn's TTFT goes, ms (means over every measured turn, from each server's /metrics):\n\n"
            + metrics.table(phases, PHASE_COLUMNS, digits=1)
        )
        if phases
        else ""
    )
    return (
        metrics.table(result["rows"], columns(result["server_names"]), digits=1)
        + f"\n\nPeak RSS (largest process, per replica for ours): {rss or '-'}"
        + affinity
        + where
    )


def main(argv=None) -> int:
    ap = bench_util.scenario_args(__doc__.split("\n\n")[0], "results/multiturn")
    peer = ap.add_mutually_exclusive_group()
    peer.add_argument(
        "--peer",
        dest="with_peer",
        action="store_true",
        default=None,
        help="also run mlx_lm.server (the default in full mode)",
    )
    peer.add_argument("--no-peer", dest="with_peer", action="store_false", help="skip mlx_lm.server")
    ap.add_argument("--repeats", type=int, default=None, help="runs of the whole workload per server (default 1)")
    ap.add_argument(
        "--replicas", type=int, default=0, help="also run the cached service with this many replicas (affinity routing)"
    )
    ap.add_argument(
        "--prompt-key",
        action="store_true",
        help="with --replicas: also run it with affinity_key: prompt, sending no session ids",
    )
    ap.add_argument(
        "--engine",
        action="store_true",
        help="no servers: the conversations in-process on the config's scheduler, cache on and off",
    )
    ap.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        metavar="PATH[:key=value,...]",
        help=f"our deployment config and args overrides (default {DEFAULT_CONFIG}); the keys "
        f"{', '.join(sizes(False))} set the workload instead",
    )
    ap.set_defaults(target=None)  # the model the config serves
    args = ap.parse_args(argv)
    config, overrides = parse_config_spec(args.config)
    if args.engine:
        result = run_engine(
            args.quick, args.target, args.seed, repeats=args.repeats, config=config, overrides=overrides
        )
    else:
        result = run(
            args.quick,
            args.target,
            args.seed,
            out_dir=args.out,
            with_peer=args.with_peer,
            repeats=args.repeats,
            replicas=args.replicas,
            prompt_key=args.prompt_key,
            config=config,
            overrides=overrides,
        )
    bench_util.publish(args, "multiturn", result, render(result), plot)
    return 1 if result["num_errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
