"""Where one request's time to first token goes: in-process against over HTTP.

Two prompts, each sent `--repeats` times one after another (after two unmeasured sends,
so the second prompt's prefix is cached): a short chat message and one of
`--long-tokens` tokens. `max_tokens` 1, greedy, streamed.

- `--engine CONFIG`: the threaded `scheduler.engine.Engine` that CONFIG's scheduler
  actor would run, in this process (no Ray, no HTTP); the time from `submit` to the
  event that carries the first token.
- `--url URL`: a running service. The client's time to the first chunk that carries the
  token (its text, or the finish chunk when the token is a stop token), and what the
  service's own series say over the same requests: the replica's TTFT histogram (arrival
  at the replica) and the scheduler's TTFT summary (arrival at the engine), as means.

Run the two modes one after the other on an otherwise idle machine (the service
stopped for `--engine`): the difference is what the serving path adds.

    python -m scripts.experiments.ttft_path --engine configs/bundled.yaml
    python -m serve_app.cli configs/bundled.yaml &   # then, once it answers:
    python -m scripts.experiments.ttft_path --url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
import urllib.request

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET = os.path.join(HERE, "models", "bundled", "target")


def prompts(target: str, long_tokens: int) -> list[tuple[str, list[dict]]]:
    from transformers import AutoTokenizer

    from scripts.bench.multiturn import user_texts

    tokenizer = AutoTokenizer.from_pretrained(target)
    long_text = user_texts(tokenizer, 1, 1, long_tokens, 1, seed=5)[0][0]
    return [
        ("short", [{"role": "user", "content": "hi"}]),
        (f"{long_tokens} tokens, prefix cached", [{"role": "user", "content": long_text}]),
    ]


def engine_mode(config: str, target: str, cases, repeats: int) -> None:
    from scheduler.request import Request, SamplingParams
    from scripts.bench.engine_load import engine_from_config, first_token
    from serve_app.openai.codec import TextCodec

    engine, info = engine_from_config(config, target)
    codec = TextCodec.from_path(target)
    ids_counter = itertools.count()

    def first_token_s(ids: list[int]) -> float:
        sampling = SamplingParams(max_tokens=1, temperature=0.0, stop_token_ids=tuple(info["eos_token_ids"]))
        return first_token(engine, Request(request_id=f"ttft-{next(ids_counter)}", prompt_ids=ids, sampling=sampling))[
            0
        ]

    try:
        for name, messages in cases:
            ids = codec.encode_chat(messages)
            first_token_s(ids), first_token_s(ids)
            times = [first_token_s(ids) for _ in range(repeats)]
            print(
                f"{name} ({len(ids)} prompt tokens): in-process TTFT mean {1000 * statistics.mean(times):.1f} ms, "
                f"p50 {1000 * statistics.median(times):.1f} ms"
            )
    finally:
        engine.stop()


def service_series(url: str) -> dict[str, float]:
    from scripts.bench import metrics

    text = metrics.fetch(url)
    return {
        "scheduler_s": metrics.series_total(text, "specslot_scheduler_ttft_seconds_sum"),
        "scheduler_n": metrics.series_total(text, "specslot_scheduler_ttft_seconds_count"),
        "replica_s": metrics.series_total(text, "specslot:time_to_first_token_seconds_sum"),
        "replica_n": metrics.series_total(text, "specslot:time_to_first_token_seconds_count"),
    }


def client_first_token_s(url: str, messages: list[dict]) -> float:
    body = json.dumps({"messages": messages, "max_tokens": 1, "temperature": 0.0, "stream": True}).encode()
    request = urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
    )
    tic = time.perf_counter()
    first = None
    with urllib.request.urlopen(request, timeout=60) as resp:
        for raw in resp:
            line = raw.strip()
            if first is not None or not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            for choice in json.loads(line[5:]).get("choices") or []:
                if (choice.get("delta") or {}).get("content") or choice.get("finish_reason"):
                    first = time.perf_counter() - tic
    if first is None:
        raise RuntimeError("the stream ended without a token")
    return first


def url_mode(url: str, cases, repeats: int) -> None:
    for name, messages in cases:
        client_first_token_s(url, messages), client_first_token_s(url, messages)
        before = service_series(url)
        times = [client_first_token_s(url, messages) for _ in range(repeats)]
        after = service_series(url)
        mean = {
            side: (after[f"{side}_s"] - before[f"{side}_s"]) / max(1.0, after[f"{side}_n"] - before[f"{side}_n"])
            for side in ("replica", "scheduler")
        }
        print(
            f"{name}: client TTFT mean {1000 * statistics.mean(times):.1f} ms (p50 "
            f"{1000 * statistics.median(times):.1f}); replica {1000 * mean['replica']:.1f} ms; "
            f"scheduler {1000 * mean['scheduler']:.1f} ms"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--engine", metavar="CONFIG", help="deployment config whose engine runs in-process")
    mode.add_argument("--url", help="a running service, e.g. http://127.0.0.1:8000")
    ap.add_argument("--target", default=TARGET, help="the model directory (its tokenizer builds the prompts)")
    ap.add_argument("--long-tokens", type=int, default=800)
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    cases = prompts(args.target, args.long_tokens)
    if args.engine:
        engine_mode(args.engine, args.target, cases, args.repeats)
    else:
        url_mode(args.url.rstrip("/"), cases, args.repeats)


if __name__ == "__main__":
    main()
