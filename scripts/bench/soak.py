"""Cancellation soak: many requests, random cancellations aimed at every phase, then
proof that nothing was lost or corrupted.

Engine level (no HTTP; `scheduler.engine.Engine` + `models.runner.MlxRunner`): each
request gets a fate, either "complete" or a target phase (see
`scheduler.counters.CANCEL_PHASES`). The driver watches `Engine.snapshot()` and cancels
a request when it is seen in its target phase; "inbox" is cancelled right after submit,
and "prefill" from inside the runner's prefill (`CancelInjector`), which is exactly a
cancel arriving while the prefill runs. The scheduler records the phase each
cancellation actually took effect in (`counters.cancelled_by_phase`); targets are
intents, the counters are the truth.

Afterwards (`SoakReport.problems()` lists any violation): every request got exactly one
finish event, no errors; every stream that was not cancelled is complete and equal to
its isolated greedy output (and every cancelled one is a prefix of it); live
speculative sessions are 0, peak live sessions <= 1 + backlog_cap, no request in any
queue, no classic row, the slot is free.

    python -m scripts.bench.soak                       # 1,000 requests, tiny random pair
    python -m scripts.bench.soak --model bundled --requests 300
    python -m scripts.bench.soak --http http://127.0.0.1:8000 --requests 200   # a running server
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import models  # noqa: F401  (fast BLAS before mlx)
from scheduler.config import SchedulerConfig
from scheduler.counters import CANCEL_PHASES
from scheduler.request import Lane, Request, SamplingParams
from scripts.bench.soak_inject import CancelInjector

PROMPTS = [
    "def parse(text):\n    ",
    "import os\nimport ",
    "class Stack:\n    def push(self, item):",
    "for i in range(10):",
    "while lo < hi:\n    mid = (lo + hi) // 2",
    "raise ValueError(",
    "def wrap(text, width=70, **kwargs):",
    "lines = text.splitlines()",
    "x",
    "# Copyright",
    "try:\n    import re\nexcept ImportError:",
    "return ''.join(result)",
]
MAX_TOKENS = (8, 48)  # per-request max_tokens drawn from this range
# Small classic batch so requests really wait in the admission queue; grant_rounds 2 so
# the slot rotates (parks) often; b1 "on" so the tiny pair always takes the slot.
SOAK_CONFIG = dict(
    b1_policy="on", grant_rounds=2, backlog_cap=2, max_batch_size=4, prefill_batch_size=2, max_queue_depth=64
)


@dataclass
class SoakReport:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    lost: int = 0  # submitted, never finished
    mismatched: list = field(default_factory=list)  # request ids whose tokens differ
    targets: dict = field(default_factory=dict)  # intended phase -> count
    cancelled_by_phase: dict = field(default_factory=dict)  # scheduler's record
    peak_live_sessions: int = 0
    max_live_sessions: int = 3
    final_state: dict = field(default_factory=dict)
    seconds: float = 0.0

    def problems(self) -> list[str]:
        out = []
        if self.lost:
            out.append(f"{self.lost} requests never finished")
        if self.errors:
            out.append(f"{self.errors} requests ended with an error")
        if self.mismatched:
            out.append(f"streams differ from isolated greedy output: {self.mismatched[:5]}")
        if self.peak_live_sessions > self.max_live_sessions:
            out.append(f"peak live sessions {self.peak_live_sessions} > {self.max_live_sessions}")
        if sum(self.cancelled_by_phase.values()) != self.cancelled:
            out.append(f"phase counters {self.cancelled_by_phase} != {self.cancelled} cancellations")
        bad = {k: v for k, v in self.final_state.items() if v}
        if bad:
            out.append(f"not drained: {bad}")
        return out


def observed_phase(request_id: str, state: dict) -> str:
    """Where a still-unfinished request is, from an `Engine.snapshot()`."""
    owner = state["slot"]["owner"]
    if owner and owner["request_id"] == request_id:
        return "active" if owner["started"] else "prefill"
    for entry in state["slot"]["backlog"]:
        if entry["request_id"] == request_id:
            return entry["kind"]
    if request_id in state["classic_row_ids"]:
        return "classic"
    return "queued" if request_id in state["queued_ids"] else "inbox"


def expected_tokens(reference: list[int], max_tokens: int) -> list[int]:
    """Isolated greedy output for `max_tokens`, from the reference run with the largest
    budget (greedy decoding is a prefix property; an EOS ends both)."""
    return reference[:max_tokens]


def references(engine, prompt_ids: list[list[int]], stop_ids: tuple, max_tokens: int) -> list[list[int]]:
    """Each prompt alone through the engine (greedy): the isolated outputs."""
    out = []
    for i, ids in enumerate(prompt_ids):
        rid = f"ref-{i}"
        engine.submit(Request(rid, list(ids), SamplingParams(max_tokens, stop_token_ids=stop_ids)))
        tokens, done = [], False
        while not done:
            for event in engine.get_events(timeout=10):
                tokens += event.token_ids
                done = done or event.finish_reason is not None
        out.append(tokens)
    return out


def engine_soak(
    engine,
    injector: CancelInjector,
    prompt_ids: list[list[int]],
    refs: list[list[int]],
    stop_ids: tuple,
    num_requests: int,
    concurrency: int,
    cancel_fraction: float,
    seed: int,
    timeout_s: float = 600.0,
) -> SoakReport:
    """Drive `num_requests` through a started engine; see the module docstring."""
    rng = random.Random(seed)
    report = SoakReport(requests=num_requests, max_live_sessions=1 + engine.snapshot()["config"]["backlog_cap"])
    before = Counter(engine.snapshot()["counters"]["cancelled_by_phase"])
    targets: dict[str, str | None] = {}  # intents, kept for the report
    expected: dict[str, list[int]] = {}
    streams: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    live: set[str] = set()
    started = time.monotonic()
    deadline = started + timeout_s
    next_id = 0
    while (next_id < num_requests or live) and time.monotonic() < deadline:
        while next_id < num_requests and len(live) < concurrency:
            rid, next_id = f"soak-{next_id}", next_id + 1
            p = rng.randrange(len(prompt_ids))
            max_tokens = rng.randint(*MAX_TOKENS)
            target = rng.choice(CANCEL_PHASES) if rng.random() < cancel_fraction else None
            targets[rid], streams[rid] = target, []
            expected[rid] = expected_tokens(refs[p], max_tokens)
            if target is not None:
                injector.targets[rid] = target
            lane = rng.choice((Lane.HIGH, Lane.NORMAL, Lane.NORMAL, Lane.LOW))
            engine.submit(
                Request(rid, list(prompt_ids[p]), SamplingParams(max_tokens, stop_token_ids=stop_ids), lane=lane)
            )
            live.add(rid)
            if target == "inbox":
                injector.try_cancel(rid, "inbox")
        for event in engine.get_events(timeout=0.005):
            streams[event.request_id] += event.token_ids
            if event.finish_reason is not None:
                finish[event.request_id] = event.finish_reason
                live.discard(event.request_id)
        state = engine.snapshot()
        for rid in list(live):  # waiters and queued requests are only seen here
            if rid in injector.targets:
                injector.try_cancel(rid, observed_phase(rid, state))
    report.seconds = round(time.monotonic() - started, 2)
    report.targets = dict(Counter(t for t in targets.values() if t))
    for rid in targets:
        reason = finish.get(rid)
        if reason is None:
            report.lost += 1
        elif reason == "error":
            report.errors += 1
        elif reason == "cancelled":
            report.cancelled += 1
            if streams[rid] != expected[rid][: len(streams[rid])]:
                report.mismatched.append(rid)
        else:
            report.completed += 1
            if streams[rid] != expected[rid]:
                report.mismatched.append(rid)
    report.lost += num_requests - len(targets)
    state = engine.snapshot()
    after = Counter(state["counters"]["cancelled_by_phase"])
    report.cancelled_by_phase = {p: after[p] - before[p] for p in CANCEL_PHASES}
    report.peak_live_sessions = max(injector.peak_live_sessions, state["counters"]["live_sessions_peak"])
    report.final_state = drained_state(state, injector)
    return report


def drained_state(state: dict, runner) -> dict:
    """Everything that must be zero / empty once the engine is idle."""
    return {
        "unfinished": state["unfinished"],
        "pending_submissions": state["pending_submissions"],
        "queued": sum(state["queue_depth"].values()),
        "classic_rows": state["classic_rows"],
        "slot_owner": state["slot"]["owner"] is not None,
        "backlog": len(state["slot"]["backlog"]),
        "live_sessions": runner.num_live_sessions(),
        "runner_classic_rows": runner.num_classic_rows(),
    }


def start_engine(target: str, draft: str, **config):
    """A started Engine over an injecting MlxRunner; returns (engine, injector)."""
    from models.runner import MlxRunner
    from scheduler.engine import Engine

    cfg = SchedulerConfig(**{**SOAK_CONFIG, **config})
    holder: dict = {}

    def factory():
        holder["runner"] = CancelInjector(
            MlxRunner.from_paths(
                target,
                drafter_kind="draft_model",
                drafter_path=draft,
                max_batch_size=cfg.max_batch_size,
                prefill_batch_size=cfg.prefill_batch_size,
            )
        )
        return holder["runner"]

    engine = Engine(factory, cfg)
    engine.start()
    injector = holder["runner"]
    injector.engine = engine
    return engine, injector


def run_engine(
    target: str,
    draft: str,
    num_requests: int,
    concurrency: int,
    cancel_fraction: float,
    seed: int,
    tick_mode: str = "alternate",
) -> SoakReport:
    """`tick_mode` alternate (the default here) exercises the seed's ring, whose waiting
    and parked entries are phases of their own (as the seed ran it: rows decode one
    token per step); fused, the ring of classic rows, which verify their own drafts."""
    engine, injector = start_engine(target, draft, tick_mode=tick_mode, row_drafts=tick_mode == "fused")
    try:
        tok = injector.tokenizer
        prompt_ids = [tok.encode(p) for p in PROMPTS]
        stop_ids = tuple(injector.eos_token_ids)
        refs = references(engine, prompt_ids, stop_ids, MAX_TOKENS[1])
        return engine_soak(
            engine, injector, prompt_ids, refs, stop_ids, num_requests, concurrency, cancel_fraction, seed
        )
    finally:
        engine.stop()


def model_paths(which: str) -> tuple[str, str]:
    if which == "bundled":
        from serve_app.configuration.args import REPO_ROOT

        return str(REPO_ROOT / "models/bundled/target"), str(REPO_ROOT / "models/bundled/draft")
    from models.tiny import build_tiny_pair

    return build_tiny_pair(tempfile.mkdtemp(prefix="soak-tiny-"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=10)
    ap.add_argument("--cancel-fraction", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=("tiny", "bundled"), default="tiny")
    ap.add_argument("--http", metavar="BASE_URL", help="soak a running server instead (loopback)")
    ap.add_argument("--json", metavar="PATH", help="write the report as JSON")
    args = ap.parse_args(argv)
    if args.http:
        from scripts.bench.soak_http import http_soak

        report = http_soak(args.http, args.requests, min(args.concurrency, 8), args.seed)
    else:
        target, draft = model_paths(args.model)
        report = run_engine(target, draft, args.requests, args.concurrency, args.cancel_fraction, args.seed)
    body = asdict(report)
    body["mismatched"] = len(report.mismatched)
    body["problems"] = report.problems()
    print(json.dumps(body, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(body, f, indent=2)
    return 1 if report.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
