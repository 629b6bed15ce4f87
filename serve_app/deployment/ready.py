"""What a ready replica reports: the /health body and the operator's one ready line.

Pure functions over the deployment args and the scheduler's runner info, so the line
`python -m serve_app.cli` prints is tested without a model or a cluster.
"""

from __future__ import annotations

import os
import re

from models.loading.hub import is_repo_id
from models.platform.startup import SHOWN, describe
from serve_app.configuration.args import ServeArgs

_EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception): (.+)$")


def drafter_label(args: ServeArgs) -> str:
    """e.g. "ngram", "none", "draft_model draft" (the draft directory's name, or its hub id)."""
    if args.drafter.needs_weights:
        path = args.drafter.path or ""
        return f"{args.drafter.kind} {path if is_repo_id(path) else os.path.basename(os.path.normpath(path))}"
    return args.drafter.kind


def speculation_status(args: ServeArgs, info: dict) -> tuple[bool, str]:
    """(on, why). Off when the runner turned the slot off (`spec_off_reason`) or the B=1
    policy is pinned off; when on, why names the tick that runs (`fuse_blocker` None:
    the fused tick)."""
    if info.get("spec_off_reason"):
        return False, info["spec_off_reason"]
    if args.b1_policy == "off":
        return False, "b1_policy is off"
    if args.tick_mode == "alternate":
        return True, "alternating tick, as configured"
    blocker = info.get("fuse_blocker")
    return True, "fused tick" if blocker is None else f"alternating tick: {blocker}"


def health_body(args: ServeArgs, info: dict) -> dict:
    """The 200 body of /health once the model is loaded."""
    on, why = speculation_status(args, info)
    body = {
        "status": "ok",
        "model": args.model_name,
        "drafter": drafter_label(args),
        "speculation": "on" if on else "off",
        "speculation_reason": why,
    }
    if info.get("startup_s"):  # the scheduler actor's load, by phase (`models.platform.startup`)
        body["startup_s"] = {name: round(s, 2) for name, s in info["startup_s"].items()}
    if info.get("replica_startup_s"):  # the replica's own: its process start, the tokenizer
        body["replica_startup_s"] = {name: round(s, 2) for name, s in info["replica_startup_s"].items()}
    if info.get("prestarted"):  # the CLI started the scheduler actor, before Serve
        body["scheduler_prestarted"] = True
    return body


def ready_line(base_url: str, body: dict) -> str:
    """`specslot ready at http://127.0.0.1:8000/v1 — model m, drafter ngram, speculation on (fused tick)`"""
    return (
        f"specslot ready at {base_url.rstrip('/')}/v1 — model {body.get('model')}, "
        f"drafter {body.get('drafter')}, speculation {body.get('speculation')} "
        f"({body.get('speculation_reason')})"
    )


def startup_line(phases: dict[str, float], body: dict, beside: dict[str, dict[str, float]] | None = None) -> str:
    """Where the start went, for the operator: the CLI's own phases (`phases`, seconds, in
    order, the last one ending at ready; `beside`: what ran alongside a phase, by phase),
    then within the last one the replica's process start, the scheduler actor's worker
    start and its load by phase (from the /health body; "prestarted" when the CLI started
    it beside Serve), and the tokenizer the replica built meanwhile.
    >>> startup_line({"checks": 1.0, "replica": 9.0}, {"startup_s": {"scheduler actor": 6.0, "weights": 2.0}})
    'specslot started in 10.0 s: checks 1.0 s, replica 9.0 s (scheduler actor 6.0 s: weights 2.0 s)'
    >>> startup_line({"Ray": 3.0, "replica": 9.0}, {}, {"Ray": {"model checks": 2.5}})
    'specslot started in 12.0 s: Ray 3.0 s (model checks 2.5 s beside it), replica 9.0 s'
    >>> body = {"startup_s": {"scheduler actor": 6.0, "worker start": 1.5},
    ...         "replica_startup_s": {"replica process": 0.5, "tokenizer": 1.0}}
    >>> startup_line({"replica": 9.0}, body).split(" (")[1]
    'replica process 0.5 s; actor worker start 1.5 s; scheduler actor 6.0 s; tokenizer 1.0 s beside the actor)'
    >>> startup_line({"replica": 3.0}, {"startup_s": {"scheduler actor": 6.0}, "scheduler_prestarted": True})
    'specslot started in 3.0 s: replica 3.0 s (prestarted scheduler actor 6.0 s)'
    """
    shown = []
    for name, seconds in phases.items():
        alongside = {what: s for what, s in ((beside or {}).get(name) or {}).items() if s is not None}
        shown.append(describe({name: seconds}) + (f" ({describe(alongside)} beside it)" if alongside else ""))
    text = f"specslot started in {sum(phases.values()):.1f} s: {', '.join(shown)}"
    actor = dict(body.get("startup_s") or {})
    replica = body.get("replica_startup_s") or {}
    worker, total = actor.pop("worker start", None), actor.pop("scheduler actor", None)
    parts = []
    if replica.get("replica process") is not None:
        parts.append(f"replica process {replica['replica process']:.1f} s")
    if worker is not None:
        parts.append(f"actor worker start {worker:.1f} s")
    if total is not None:
        shown = describe(actor, SHOWN)
        label = "prestarted scheduler actor" if body.get("scheduler_prestarted") else "scheduler actor"
        parts.append(f"{label} {total:.1f} s" + (f": {shown}" if shown else ""))
    elif actor:
        parts.append(describe(actor, SHOWN))
    if replica.get("tokenizer") is not None:
        parts.append(f"tokenizer {replica['tokenizer']:.1f} s beside the actor")
    return text + (f" ({'; '.join(parts)})" if parts else "")


def last_error_line(message: str) -> str:
    """The text of the last `SomeError: text` line of `message` (often a traceback Ray or
    Serve wrapped), else its last line: what an operator needs from a failure."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match:
            return match.group(2)
    return lines[-1] if lines else "no message"
