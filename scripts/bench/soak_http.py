"""Cancellation soak over HTTP: real clients that hang up at random points.

Each request is a streaming completion that either reads to `[DONE]` or drops the
connection after a random number of SSE lines (1 = right after the role chunk, while
the request is queued, waiting or prefilling; more = mid-decode in whatever phase it
is in); a few are non-streaming clients that give up after a short read timeout. The
server's scheduler records where each cancellation took effect
(`counters.cancelled_by_phase` in `GET /v1/internal/scheduler`).

Afterwards: every stream read to the end equals the same request's isolated output
(taken first, one request at a time), nothing is left in the scheduler, no stream is
open on the replica, no live speculative session, peak live sessions <= 1 + backlog_cap.
Loopback only: `base` must be a 127.0.0.1 / localhost URL.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time
from collections import Counter
from urllib.parse import urlparse

import httpx

from scheduler.counters import CANCEL_PHASES
from scripts.bench.soak import SoakReport

HTTP_PROMPTS = [
    "def parse(text):\n    ",
    "import os\nimport ",
    "class Stack:\n    def push(self, item):",
    "while lo < hi:\n    mid = (lo + hi) // 2",
]
HTTP_MAX_TOKENS = 40


def _state(base: str, headers: dict) -> dict:
    return httpx.get(f"{base}/v1/internal/scheduler", headers=headers, timeout=10).json()


def _body(prompt: str, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": HTTP_MAX_TOKENS, "temperature": 0, "stream": stream}


def _one(base: str, headers: dict, prompt: str, hang_up_after: int | None, give_up_s: float | None):
    """Returns (outcome, text, finish_reason): outcome in complete | hung_up | rejected | error."""
    url = f"{base}/v1/completions"
    if give_up_s is not None:  # a non-streaming client that stops waiting
        try:
            r = httpx.post(url, json=_body(prompt, False), headers=headers, timeout=httpx.Timeout(10, read=give_up_s))
        except httpx.ReadTimeout:
            return "hung_up", "", None
        if r.status_code == 503:
            return "rejected", "", None
        if r.status_code != 200:
            return "error", r.text[:200], None
        choice = r.json()["choices"][0]
        return "complete", choice["text"], choice["finish_reason"]
    texts, finish, lines = [], None, 0
    with httpx.stream("POST", url, json=_body(prompt, True), headers=headers, timeout=60) as r:
        if r.status_code == 503:
            return "rejected", "", None
        if r.status_code != 200:
            return "error", r.read().decode()[:200], None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            lines += 1
            if line == "data: [DONE]":
                return "complete", "".join(texts), finish
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return "error", chunk["error"]["message"], None
            if chunk["choices"]:
                texts.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
            if hang_up_after is not None and lines >= hang_up_after:
                return "hung_up", "", None  # leaving the block closes the connection
    return "error", "stream ended without [DONE]", None


def http_soak(
    base: str,
    num_requests: int,
    concurrency: int,
    seed: int,
    headers: dict | None = None,
    hang_up_fraction: float = 0.5,
    drain_timeout_s: float = 30.0,
) -> SoakReport:
    host = urlparse(base).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError("the HTTP soak only talks to loopback servers")
    headers = dict(headers or {})
    rng = random.Random(seed)
    refs = {}
    for prompt in HTTP_PROMPTS:  # isolated outputs, one request at a time
        r = httpx.post(f"{base}/v1/completions", json=_body(prompt, False), headers=headers, timeout=60)
        r.raise_for_status()
        refs[prompt] = (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"])
    before = Counter(_state(base, headers)["counters"]["cancelled_by_phase"])
    plan = []
    for _ in range(num_requests):
        prompt = rng.choice(HTTP_PROMPTS)
        roll = rng.random()
        if roll < hang_up_fraction * 0.8:
            plan.append((prompt, rng.randint(1, 12), None))
        elif roll < hang_up_fraction:
            plan.append((prompt, None, rng.uniform(0.02, 0.3)))
        else:
            plan.append((prompt, None, None))
    report = SoakReport(requests=num_requests)
    started = time.monotonic()
    outcomes: Counter = Counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(_one, base, headers, *p) for p in plan]
        for (prompt, _, _), future in zip(plan, futures):
            outcome, text, finish = future.result()
            outcomes[outcome] += 1
            if outcome == "complete" and (text, finish) != refs[prompt]:
                report.mismatched.append(prompt)
    report.completed, report.errors = outcomes["complete"], outcomes["error"]
    report.targets = {"hung_up": outcomes["hung_up"], "rejected": outcomes["rejected"]}
    deadline = time.monotonic() + drain_timeout_s
    while True:  # cancels of the last hang-ups may still be in flight
        state = _state(base, headers)
        final = {
            "unfinished": state["unfinished"],
            "queued": sum(state["queue_depth"].values()),
            "classic_rows": state["classic_rows"],
            "slot_owner": state["slot"]["owner"] is not None,
            "backlog": len(state["slot"]["backlog"]),
            "live_sessions": state["counters"]["live_sessions"],
            "open_streams": state["replica"]["open_streams"],
        }
        if not any(final.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    report.seconds = round(time.monotonic() - started, 2)
    after = Counter(state["counters"]["cancelled_by_phase"])
    report.cancelled_by_phase = {p: after[p] - before[p] for p in CANCEL_PHASES}
    report.cancelled = sum(report.cancelled_by_phase.values())
    report.peak_live_sessions = state["counters"]["live_sessions_peak"]
    report.max_live_sessions = 1 + state["config"]["backlog_cap"]
    report.final_state = final
    return report
