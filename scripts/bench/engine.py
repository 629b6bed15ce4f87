"""Engine-level benchmark: drive `scheduler.core.Scheduler` in-process over `MlxRunner`.

No Ray, no HTTP: the loop below is what the engine thread does (submit due requests,
tick, collect events), run on the calling thread so every tick can be timed and the
slot observed between ticks. Separates engine cost from serving cost, and runs the
same on a CPU box and on a GPU (dependencies: numpy, mlx, mlx-lm, our packages).

    python -m scripts.bench.engine --streams 3 --max-tokens 128 --grant-rounds 2 --out r.json

Arrivals are triggered by progress, not wall time (`after_tokens` = tokens emitted so
far by all requests; `after_request` = that request finished), so a workload is the
same sequence of scheduler inputs on any machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import models  # noqa: F401  (fast BLAS before mlx)
from models.runner import MlxRunner
from models.speculative.drafter_kinds import DRAFTERS, NO_DRAFTER
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.request import Lane, Request, SamplingParams
from scripts.bench import metrics
from scripts.bench.prompts import token_prompts

TARGET = "models/bundled/target"
DRAFT = "models/bundled/draft"


def load_runner(
    target: str = TARGET,
    drafter: str | None = "draft_model",
    draft_path: str = DRAFT,
    num_draft_tokens: int = 4,
    max_batch_size: int = 16,
    slab_batch: bool | None = None,
) -> MlxRunner:
    return MlxRunner.from_paths(
        target,
        drafter_kind=drafter,
        drafter_path=draft_path if drafter in DRAFTERS and DRAFTERS[drafter].needs_weights else None,
        num_draft_tokens=num_draft_tokens,
        max_batch_size=max_batch_size,
        prefill_batch_size=min(8, max_batch_size),
        slab_batch=slab_batch,
    )


class TimedRunner:
    """Proxy that adds the wall time spent inside the runner's model calls to `seconds`
    (tick time minus this = the scheduler's own decision and bookkeeping time)."""

    _TIMED = frozenset(
        {
            "classic_prefill",
            "classic_decode",
            "classic_remove",
            "spec_begin",
            "spec_round",
            "spec_round_with_decode",
            "spec_park",
            "spec_resume",
            "spec_finish",
            "spec_to_classic",
        }
    )

    def __init__(self, runner) -> None:
        self._runner = runner
        self.seconds = 0.0

    def __getattr__(self, name):
        attr = getattr(self._runner, name)
        if name not in self._TIMED:
            return attr

        def timed(*args, **kwargs):
            tic = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - tic

        return timed


@dataclass
class Arrival:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    lane: Lane = Lane.NORMAL
    after_tokens: int = 0  # submit once this many tokens were emitted in total
    after_request: str | None = None  # ... and this request finished
    after_finishes: int = 0  # ... and this many requests finished (a closed loop's shared queue)
    sampling: dict = field(default_factory=dict)  # SamplingParams fields besides max_tokens (greedy: none)


@dataclass
class RunResult:
    records: dict[str, dict]
    ticks: list[dict] = field(default_factory=list)  # per tick: t, action, tick_s, runner_s
    grants: list[dict] = field(default_factory=list)  # per grant start: t, request_id, tick
    grant_log: list[tuple[str, int]] = field(default_factory=list)
    counters: dict = field(default_factory=dict)
    duration_s: float = 0.0
    token_ids: dict[str, list[int]] = field(default_factory=dict)  # each request's output


def drive(
    runner, config: SchedulerConfig, arrivals: list[Arrival], max_ticks: int = 1_000_000, policy=None
) -> RunResult:
    """Run `arrivals` to completion on a fresh Scheduler; returns per-request records
    (see `scripts.bench.metrics`) and a per-tick timeline. `policy`: a `B1Policy` to share
    across runs (as one replica's policy outlives its requests); None = a fresh one."""
    timed = TimedRunner(runner)
    scheduler = Scheduler(timed, config, clock=time.perf_counter, policy=policy)
    pending = list(arrivals)
    records: dict[str, dict] = {}
    finished: set[str] = set()
    emitted = 0
    result = RunResult(records)
    t0 = time.perf_counter()
    num_grants = 0
    for tick_index in range(max_ticks):
        due = [
            a
            for a in pending
            if emitted >= a.after_tokens
            and (a.after_request is None or a.after_request in finished)
            and len(finished) >= a.after_finishes
        ]
        for a in due:
            pending.remove(a)
            now = time.perf_counter()
            records[a.request_id] = {
                "lane": a.lane.name.lower(),
                "arrival_s": now - t0,
                "first_token_s": None,
                "chunks": [],
                "finish_s": None,
                "prompt_tokens": len(a.prompt_ids),
                "output_tokens": 0,
                "speculative": None,
                "error": None,
                "finish_reason": None,
            }
            scheduler.submit(
                Request(
                    a.request_id,
                    list(a.prompt_ids),
                    SamplingParams(max_tokens=a.max_tokens, **a.sampling),
                    lane=a.lane,
                    arrival_time=now,
                )
            )
        if not scheduler.has_work():
            if not pending:
                break
            raise RuntimeError(f"workload stalled: {[a.request_id for a in pending]} can never arrive")
        runner_before = timed.seconds
        tic = time.perf_counter()
        events = scheduler.tick()
        toc = time.perf_counter()
        action = scheduler.last_decision.action.value if scheduler.last_decision else None
        result.ticks.append(
            {"t": toc - t0, "action": action, "tick_s": toc - tic, "runner_s": timed.seconds - runner_before}
        )
        if scheduler.counters.grants > num_grants:
            num_grants = scheduler.counters.grants
            owner = scheduler.slot.active
            grantee = owner.request.request_id if owner else scheduler.slot.grant_log[-1][0]
            result.grants.append({"t_start": tic - t0, "request_id": grantee, "tick": tick_index})
        for ev in events:
            rec = records[ev.request_id]
            if ev.token_ids:
                result.token_ids.setdefault(ev.request_id, []).extend(ev.token_ids)
                emitted += len(ev.token_ids)
                rec["output_tokens"] += len(ev.token_ids)
                rec["chunks"].append((toc - t0, len(ev.token_ids)))
                if rec["first_token_s"] is None:
                    rec["first_token_s"] = toc - t0
            if ev.finish_reason is not None:
                rec["finish_s"] = toc - t0
                rec["finish_reason"] = ev.finish_reason
                rec["error"] = ev.error
                finished.add(ev.request_id)
                if ev.stats is not None:
                    rec["speculative"] = ev.stats.as_usage()
    else:
        raise RuntimeError(f"workload did not finish within {max_ticks} ticks")
    result.duration_s = time.perf_counter() - t0
    result.grant_log = list(scheduler.slot.grant_log)
    result.counters = scheduler.counters.to_dict()
    return result


def stream_arrivals(
    tokenizer,
    num_streams: int,
    max_tokens: int,
    prompt_tokens: int = 64,
    seed: int = 0,
    stagger_tokens: int = 0,
    lane: Lane = Lane.NORMAL,
    prefix: str = "s",
) -> list[Arrival]:
    """`num_streams` long streams; stream i arrives after i * stagger_tokens emitted tokens."""
    prompts = token_prompts(tokenizer, num_streams, seed, prompt_tokens)
    return [
        Arrival(f"{prefix}{i}", p, max_tokens, lane, after_tokens=i * stagger_tokens) for i, p in enumerate(prompts)
    ]


def raw_generate_step(model, prompt_ids: list[int], num_tokens: int) -> float:
    """Greedy decode tokens/s of plain mlx-lm `generate_step` (prefill excluded)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt_ids), model, max_tokens=num_tokens)
    next(steps)  # the first token comes out of the prefill
    tic = time.perf_counter()
    count = 0
    for _ in steps:
        count += 1
    return count / (time.perf_counter() - tic)


def ticks_by_action(ticks: list[dict]) -> dict:
    """Count and mean wall time (ms) of the ticks of each action: what one slot round,
    one batched decode step and one prefill cost in this run."""
    grouped: dict[str, list[float]] = {}
    for t in ticks:
        grouped.setdefault(t["action"], []).append(t["tick_s"])
    return {action: {"ticks": len(v), "mean_ms": round(1000 * sum(v) / len(v), 2)} for action, v in grouped.items()}


def stream_tokens_per_s(record: dict) -> float | None:
    """Decode rate of one request after its first token (vLLM's 1 / TPOT)."""
    tpot = metrics.per_request(record)["tpot_s"]
    return 1.0 / tpot if tpot else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--drafter", choices=[*DRAFTERS, NO_DRAFTER], default="draft_model")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--stagger-tokens", type=int, default=0)
    ap.add_argument("--grant-rounds", type=int, default=8)
    ap.add_argument("--backlog-cap", type=int, default=2)
    ap.add_argument("--speculative-disable-by-batch-size", type=int, default=0)
    ap.add_argument("--b1-policy", choices=["auto", "on", "off"], default="on")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    runner = load_runner(
        args.target, None if args.drafter == NO_DRAFTER else args.drafter, args.draft, args.num_draft_tokens
    )
    config = SchedulerConfig(
        grant_rounds=args.grant_rounds,
        b1_policy=args.b1_policy,
        num_draft_tokens=args.num_draft_tokens,
        backlog_cap=args.backlog_cap,
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size,
    )
    arrivals = stream_arrivals(
        runner.tokenizer, args.streams, args.max_tokens, args.prompt_tokens, args.seed, args.stagger_tokens
    )
    run = drive(runner, config, arrivals)
    summary = metrics.summarize(list(run.records.values()), run.duration_s)
    out = {
        "args": vars(args),
        "summary": summary,
        "grant_log": run.grant_log,
        "counters": run.counters,
        "ticks_by_action": ticks_by_action(run.ticks),
        "requests": run.records,
    }
    print(
        json.dumps(
            {
                **{
                    k: summary[k]
                    for k in ("completed", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "acceptance_length")
                },
                "ttft_ms": sorted(round(1000 * r["first_token_s"]) for r in run.records.values()),
                "ticks_by_action": out["ticks_by_action"],
                "classic_fallbacks": run.counters["classic_fallbacks"],
            },
            indent=1,
        )
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
