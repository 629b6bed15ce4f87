"""Serving load generator for any OpenAI-compatible endpoint (streaming completions/chat).

    python -m scripts.bench.loadgen --base-url http://127.0.0.1:8000 --num-prompts 32 \
        --concurrency 4 --max-tokens 64 --priority-mix high=0.2,normal=0.8 --out results/lg.json

Fixed concurrency (`--concurrency N`: N requests in flight) or a Poisson arrival
process (`--request-rate R` requests/s, seeded). Prompts are bundled and reproducible
by seed (`scripts.bench.prompts`). Lanes are sent as `X-Priority`. Output length: every
request asks for `--max-tokens`; with `--ignore-eos auto` the field `ignore_eos` is sent
only if the server accepts it (a probe request), and the actual lengths are always
reported. Metrics use `vllm bench serve` names (TTFT, TPOT, ITL, E2EL: mean, median,
p90, p99; request and output throughput), overall and per lane, plus per-request
speculative stats from `usage.speculative` when the server reports them. Only
loopback URLs are accepted unless `--allow-remote` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from scripts.bench import metrics
from scripts.bench.prompts import chat_messages, chat_questions, sized_snippets, stdlib_snippets

SHARED_PREFIX_SEED = 7919  # the shared prefix's snippet, the same in every run


@dataclass
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"  # "completions" | "chat"
    # Chat prompts: "code" asks to continue a code snippet, "questions" asks everyday
    # questions (`prompts.chat_questions`).
    chat_prompts: str = "code"
    model: str | None = None  # omitted from bodies when None (servers use their default)
    num_prompts: int = 16
    concurrency: int | None = 4
    request_rate: float | None = None  # Poisson arrivals per second; overrides concurrency
    max_tokens: int = 64
    prompt_chars: int = 600
    # Completions prompts of this many tokens instead (as `tokenizer`'s tokenizer counts
    # them, a model directory's; `prompts.sized_snippets`); 0: `prompt_chars` characters.
    prompt_tokens: int = 0
    tokenizer: str | None = None
    # Every prompt starts with the same text of about this many characters (a system
    # prompt or tool definitions that every request of an agent resends); 0: none.
    shared_prefix_chars: int = 0
    temperature: float = 0.0
    seed: int = 0
    priority_mix: dict[str, float] = field(default_factory=lambda: {"normal": 1.0})
    ignore_eos: str = "auto"  # "auto" | "on" | "off"
    progress: bool = True
    timeout_s: float = 600.0
    allow_remote: bool = False


def parse_mix(text: str) -> dict[str, float]:
    """ "high=0.2,normal=0.8" -> {"high": 0.2, "normal": 0.8} (weights, normalized later)."""
    mix = {}
    for part in text.split(","):
        lane, _, weight = part.partition("=")
        mix[lane.strip().lower()] = float(weight or 1.0)
    if not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise ValueError(f"bad priority mix {text!r}")
    return mix


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"{url} is not a loopback address; pass --allow-remote to load a remote server")


def build_requests(cfg: LoadConfig) -> list[dict]:
    """(body, lane) per request, deterministic in `cfg.seed`."""
    rng = random.Random(cfg.seed)
    lanes, weights = zip(*cfg.priority_mix.items())
    # The shared text depends on its length only: runs of any seed share it.
    shared = stdlib_snippets(1, SHARED_PREFIX_SEED, cfg.shared_prefix_chars)[0] if cfg.shared_prefix_chars else ""
    if cfg.prompt_tokens and (cfg.endpoint == "chat" or shared or not cfg.tokenizer):
        raise ValueError("prompt_tokens sizes completions prompts without a shared prefix, and needs a tokenizer")
    if cfg.endpoint == "chat":
        system = [{"role": "system", "content": shared}] if shared else []
        chats = (
            chat_questions(cfg.num_prompts, cfg.seed)
            if cfg.chat_prompts == "questions"
            else chat_messages(cfg.num_prompts, cfg.seed, cfg.prompt_chars)
        )
        prompts = [{"messages": system + m} for m in chats]
    elif cfg.prompt_tokens:
        from serve_app.openai.codec import TextCodec

        codec = TextCodec.from_path(cfg.tokenizer)
        prompts = [{"prompt": p} for p in sized_snippets(codec, cfg.num_prompts, cfg.seed, cfg.prompt_tokens)]
    else:
        prompts = [{"prompt": shared + p} for p in stdlib_snippets(cfg.num_prompts, cfg.seed, cfg.prompt_chars)]
    out = []
    for i, prompt in enumerate(prompts):
        body = {
            **prompt,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if cfg.model:
            body["model"] = cfg.model
        out.append({"index": i, "body": body, "lane": rng.choices(lanes, weights)[0]})
    return out


def _path(cfg: LoadConfig) -> str:
    return "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"


async def probe_ignore_eos(session, cfg: LoadConfig) -> bool:
    """True if the server accepts an `ignore_eos` field (it may still not honor it:
    actual lengths are reported either way)."""
    body = build_requests(LoadConfig(**{**cfg.__dict__, "num_prompts": 1}))[0]["body"]
    body.update({"max_tokens": 1, "stream": False, "ignore_eos": True})
    body.pop("stream_options")
    async with session.post(cfg.base_url + _path(cfg), json=body) as resp:
        await resp.read()
        return resp.status < 400


async def one_request(session, cfg: LoadConfig, item: dict, t0: float, send_ignore_eos: bool) -> dict:
    body = dict(item["body"], **({"ignore_eos": True} if send_ignore_eos else {}))
    rec = {
        "index": item["index"],
        "lane": item["lane"],
        "arrival_s": time.perf_counter() - t0,
        "first_token_s": None,
        "chunks": [],
        "finish_s": None,
        "prompt_tokens": 0,
        "output_tokens": 0,
        "speculative": None,
        "error": None,
        "finish_reason": None,
        "usage_reported": False,
        "cached_prompt_tokens": None,
    }
    num_chunks = 0
    try:
        async with session.post(cfg.base_url + _path(cfg), json=body, headers={"X-Priority": item["lane"]}) as resp:
            if resp.status >= 400:
                rec["error"] = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return rec
            buffer = b""
            async for raw in resp.content:
                buffer += raw
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    now = time.perf_counter() - t0
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        rec["error"] = json.dumps(chunk["error"])[:300]
                    for choice in chunk.get("choices") or []:
                        text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                        if text:
                            num_chunks += 1
                            rec["chunks"].append((now, 1))
                            if rec["first_token_s"] is None:
                                rec["first_token_s"] = now
                        if choice.get("finish_reason"):
                            rec["finish_reason"] = choice["finish_reason"]
                    usage = chunk.get("usage")
                    if usage:
                        rec["usage_reported"] = True
                        rec["prompt_tokens"] = usage.get("prompt_tokens", 0)
                        rec["output_tokens"] = usage.get("completion_tokens", 0)
                        rec["speculative"] = usage.get("speculative")
                        # prompt tokens served from a server-side prompt cache (mlx_lm.server)
                        details = usage.get("prompt_tokens_details") or {}
                        rec["cached_prompt_tokens"] = details.get("cached_tokens")
    except Exception as exc:  # noqa: BLE001 - one failed request is a data point, not a crash
        rec["error"] = f"{type(exc).__name__}: {exc}"
    rec["finish_s"] = time.perf_counter() - t0
    if not rec["usage_reported"]:
        rec["output_tokens"] = num_chunks  # one token per streamed chunk: a lower bound
    return rec


async def run_load(cfg: LoadConfig) -> dict:
    import aiohttp

    if not cfg.allow_remote:
        check_loopback(cfg.base_url)
    items = build_requests(cfg)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        send_ignore_eos = {"on": True, "off": False}.get(cfg.ignore_eos)
        if send_ignore_eos is None:
            send_ignore_eos = await probe_ignore_eos(session, cfg)
        bar = None
        if cfg.progress:
            from tqdm import tqdm

            bar = tqdm(total=len(items), desc="requests", leave=False)
        t0 = time.perf_counter()
        records: list[dict] = []

        async def run_one(item):
            rec = await one_request(session, cfg, item, t0, send_ignore_eos)
            records.append(rec)
            if bar is not None:
                bar.update(1)

        if cfg.request_rate:
            rng = random.Random(cfg.seed + 1)
            tasks = []
            for item in items:
                tasks.append(asyncio.create_task(run_one(item)))
                await asyncio.sleep(rng.expovariate(cfg.request_rate))
            await asyncio.gather(*tasks)
        else:
            queue = list(items)

            async def worker():
                while queue:
                    await run_one(queue.pop(0))

            await asyncio.gather(*(worker() for _ in range(max(1, cfg.concurrency or 1))))
        duration = time.perf_counter() - t0
        if bar is not None:
            bar.close()
    records.sort(key=lambda r: r["index"])
    summary = metrics.summarize(records, duration)
    lengths = [r["output_tokens"] for r in records if not r["error"]]
    return {
        "config": {k: v for k, v in cfg.__dict__.items()},
        "ignore_eos_sent": send_ignore_eos,
        "output_lengths": {
            "requested": cfg.max_tokens,
            "min": min(lengths, default=None),
            "max": max(lengths, default=None),
            "mean": sum(lengths) / len(lengths) if lengths else None,
            "usage_reported": all(r["usage_reported"] for r in records),
        },
        "cached_prompt_tokens": sum(r.get("cached_prompt_tokens") or 0 for r in records),
        "summary": summary,
        "requests": records,
    }


SUMMARY_KEYS = [
    "completed",
    "failed",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p90_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p90_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p90_e2el_ms",
    "p99_e2el_ms",
    "acceptance_length",
]


def report(result: dict) -> str:
    s = result["summary"]
    lines = [f"{'':<24}{'all':>12}" + "".join(f"{lane:>12}" for lane in s["lanes"])]
    for key in SUMMARY_KEYS:
        values = [s.get(key)] + [lane.get(key) for lane in s["lanes"].values()]
        lines.append(f"{key:<24}" + "".join(f"{metrics.fmt(v, 2):>12}" for v in values))
    lengths = result["output_lengths"]
    lines.append(
        f"output tokens per request: requested {lengths['requested']}, actual "
        f"{lengths['min']}..{lengths['max']} (mean {metrics.fmt(lengths['mean'], 1)}); "
        f"ignore_eos sent: {result['ignore_eos_sent']}"
    )
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    from scripts.bench.util import pyplot, save_figure

    plt = pyplot()
    recs = [r for r in result["requests"] if not r["error"]]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for lane in metrics.LANES:
        lane_recs = [r for r in recs if r["lane"] == lane]
        if not lane_recs:
            continue
        derived = [metrics.per_request(r) for r in lane_recs]
        axes[0].scatter([r["arrival_s"] for r in lane_recs], [d["ttft_s"] * 1000 for d in derived], s=12, label=lane)
        axes[1].scatter([r["arrival_s"] for r in lane_recs], [d["e2el_s"] * 1000 for d in derived], s=12, label=lane)
        itl = sorted(x * 1000 for d in derived for x in d["itl_s"])
        if itl:
            axes[2].plot(itl, [i / len(itl) for i in range(len(itl))], label=lane)
    axes[0].set(xlabel="arrival (s)", ylabel="TTFT (ms)", title="TTFT")
    axes[1].set(xlabel="arrival (s)", ylabel="E2EL (ms)", title="end-to-end latency")
    axes[2].set(xlabel="ITL (ms)", ylabel="fraction", title="inter-token latency CDF", xscale="log")
    for ax in axes:
        ax.legend()
    save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=600)
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="completions prompts of this many tokens instead, as --tokenizer counts them",
    )
    ap.add_argument("--tokenizer", default=None, help="a model directory whose tokenizer sizes --prompt-tokens")
    ap.add_argument(
        "--shared-prefix-chars",
        type=int,
        default=0,
        help="every prompt starts with the same text of this many characters (default none)",
    )
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--priority-mix", default="normal=1", help="e.g. high=0.2,normal=0.7,low=0.1")
    ap.add_argument("--ignore-eos", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--allow-remote", action="store_true")
    ap.add_argument("--out", default=None, help="JSON result path (a PNG plot is written next to it)")
    args = ap.parse_args(argv)
    cfg = LoadConfig(
        base_url=args.base_url.rstrip("/"),
        endpoint=args.endpoint,
        model=args.model,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        max_tokens=args.max_tokens,
        prompt_chars=args.prompt_chars,
        prompt_tokens=args.prompt_tokens,
        tokenizer=args.tokenizer,
        shared_prefix_chars=args.shared_prefix_chars,
        temperature=args.temperature,
        seed=args.seed,
        priority_mix=parse_mix(args.priority_mix),
        ignore_eos=args.ignore_eos,
        progress=not args.no_progress,
        allow_remote=args.allow_remote,
    )
    result = asyncio.run(run_load(cfg))
    print(report(result))
    if args.out:
        from scripts.bench.util import machine

        result["machine"] = machine()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        plot(result, args.out.rsplit(".", 1)[0] + ".png")
    return 0 if result["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
