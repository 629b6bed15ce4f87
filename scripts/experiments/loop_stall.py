"""How long a long prompt's tokenization holds the replica's event loop, which streams
every request's tokens: the replica's real HTTP app (`serve_app.openai.http.OpenAIService`) with
the bundled tokenizer, in-process (no Ray, no model: a stand-in scheduler answers each
request with one token at once), with a coroutine on the same loop that sleeps 1 ms at a
time and records how late it wakes, as a stream's next token would.

Per prompt size: `--requests` chat requests of that many tokens, sent `--gap-ms` apart,
three ways taking turns for `--rounds` rounds: every prompt tokenized on the event loop,
`serve_app.openai.http`'s default (bodies of `TOKENIZE_OFF_LOOP_BYTES` or more on the tokenizer
thread), and every prompt on the thread. Prints the loop's worst and p99 lateness and the
requests' mean time from when each was due to its response, per side.

    python -m scripts.experiments.loop_stall [--tokens 2000 8000 23000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET = os.path.join(HERE, "models", "bundled", "target")


class OneTokenClient:
    """An `EngineClient` stand-in: every request gets one token and its finish at once."""

    def __init__(self) -> None:
        self.info = {"max_context": 1 << 20, "eos_token_ids": [0]}
        self.healthy, self.num_open_streams, self.num_restarts, self.num_events_merged = True, 0, 0, 0

    async def submit(self, request):
        from scheduler.events import TokenEvent

        async def events():
            yield TokenEvent(request.request_id, [5], "length")

        return events()

    async def cancel(self, request_id) -> None:
        pass

    def release(self, request_id) -> None:
        pass


def conversation(tokenizer, num_tokens: int) -> list[dict]:
    """Chat messages of about `num_tokens` tokens: user turns of stdlib text, short replies."""
    from scripts.bench.prompts import stdlib_snippets

    messages, total, seed = [], 0, 0
    while total < num_tokens:
        piece = stdlib_snippets(1, seed=seed, num_chars=1200)[0]
        seed += 1
        messages += [{"role": "user", "content": piece}, {"role": "assistant", "content": "Noted."}]
        total += len(tokenizer.encode(piece)) + 12
    return messages[:-1]


async def lateness_while(coro) -> tuple[list[float], object]:
    """Run `coro` while a 1 ms sleeper records how late each wake is (ms)."""
    late: list[float] = []
    done = asyncio.Event()

    async def sleeper() -> None:
        while not done.is_set():
            tic = time.perf_counter()
            await asyncio.sleep(0.001)
            late.append(1e3 * (time.perf_counter() - tic - 0.001))

    task = asyncio.ensure_future(sleeper())
    try:
        result = await coro
    finally:
        done.set()
        await task
    return late, result


async def burst(http_client, messages: list[dict], num_requests: int, gap_s: float) -> list[float]:
    """Each request's time from when it was due (the burst's start + its place x `gap_s`)
    to its response: a request the blocked loop could not even send counts that wait."""
    start = time.perf_counter()

    async def one(delay: float) -> float:
        await asyncio.sleep(delay)
        response = await http_client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        return time.perf_counter() - start - delay

    return await asyncio.gather(*(one(k * gap_s) for k in range(num_requests)))


async def main_async(args) -> int:
    import httpx

    from serve_app.configuration.args import ServeArgs
    from serve_app.openai import http
    from serve_app.openai.codec import TextCodec

    codec = TextCodec.from_path(args.target)
    service = http.OpenAIService(OneTokenClient(), codec, ServeArgs.model_validate({"model": args.target}))
    default = http.TOKENIZE_OFF_LOOP_BYTES
    sides = {"on the loop": float("inf"), "default": default, "all on the thread": 0}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=service.app()), base_url="http://t") as client:
        print("| prompt tokens | prompt bytes | side | loop late, max ms | p99 ms | request mean ms |")
        print("|---|---|---|---|---|---|")
        for num_tokens in args.tokens:
            messages = conversation(codec._tok, num_tokens)
            size = len(httpx.Request("POST", "http://t", json={"messages": messages, "max_tokens": 1}).content)
            ids = len(codec.encode_chat(messages))
            results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in sides}
            for k in range(args.rounds + 1):
                for name in sides if k % 2 else list(sides)[::-1]:
                    http.TOKENIZE_OFF_LOOP_BYTES = sides[name]
                    late, took = await lateness_while(burst(client, messages, args.requests, args.gap_ms / 1e3))
                    if k:  # the first round warms both sides
                        results[name][0].extend(late)
                        results[name][1].extend(took)
            http.TOKENIZE_OFF_LOOP_BYTES = default
            for name, (late, took) in results.items():
                late.sort()
                print(
                    f"| {ids:,} | {size:,} | {name} | {late[-1]:.1f} | {late[int(len(late) * 0.99)]:.1f} | "
                    f"{1e3 * statistics.mean(took):.1f} |"
                )
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET, help="the tokenizer's model directory")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000, 23000])
    ap.add_argument("--requests", type=int, default=8, help="requests per burst")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="between a burst's requests")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    raise SystemExit(main())
