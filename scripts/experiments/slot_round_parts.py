"""Where a lone slot holder's round goes, part by part, as the runner a deployment config
builds runs it (no scheduler, no Ray): for each prompt the first token, then rounds of the
fused tick's path (`MlxRunner.spec_round_with_decode` with no classic rows) until
`--tokens`, each part timed to a device sync: the draft (the draft's prefill of the prompt
in a request's first drafting round, then `propose`), the verify's forward, and the
acceptance. Prints each request's first round and the median of its later rounds, with
the history length, so kernels built per request or per key length show as first-round or
outlier rounds. (docs/gpu.md, "Known issues": a draft model's slot rounds.)

    python3 -m scripts.experiments.slot_round_parts --config configs/smollm2-draft.yaml --prompts chat \\
        --num-prompts 4 --tokens 96 --override '{"draft_compiled": true}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import models  # noqa: F401  (fast BLAS before mlx)

# isort: split
import mlx.core as mx  # noqa: E402

from models.forward import ragged  # noqa: E402
from scheduler.request import Request, SamplingParams  # noqa: E402
from scripts.bench.engine_load import serve_args  # noqa: E402
from scripts.experiments.engine_ab import prompt_ids  # noqa: E402

PARTS = ("draft", "verify", "accept")


def timed_round(runner, request_id: str) -> tuple[dict[str, float], int, int, str | None]:
    """One round of the fused path, each part synced: ({part: ms}, tokens emitted, history
    length before it, finish reason)."""
    session = runner.session(request_id)
    length = len(session.history)
    times = {}
    tic = time.perf_counter()
    tokens = session.prepare_round()
    mx.synchronize()
    times["draft"] = time.perf_counter() - tic
    t1 = time.perf_counter()
    rider = ragged.Rider(runner.target.model, ragged.Group(session.cache, mx.array(tokens, dtype=mx.int32)))
    runner._classic.decode(rider, drafts=False)
    logits = rider.extra_logits
    if logits is None:
        logits = session.forward(tokens)
    mx.eval(logits)
    times["verify"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    outcome = session.complete_round(tokens, logits, tic)
    times["accept"] = time.perf_counter() - t2
    return {part: s * 1e3 for part, s in times.items()}, len(outcome.token_ids), length, outcome.finish_reason


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/smollm2-draft.yaml")
    ap.add_argument("--prompts", choices=("snippets", "code", "chat"), default="chat")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--override", default="{}", help="JSON: `args` overrides")
    args = ap.parse_args()
    from models.runner import MlxRunner
    from scripts.bench.servers import config_models
    from serve_app.openai.codec import TextCodec

    target = config_models(args.config)[0]
    sargs = serve_args(args.config, {**json.loads(args.override), "model": target})
    runner = MlxRunner.from_paths(sargs.model, **sargs.runner_args())
    if not runner.can_fuse():
        raise SystemExit(f"the verify cannot ride in the batch: {runner.fuse_blocker}")
    codec = TextCodec.from_path(target)
    prompts = prompt_ids(codec, args.prompts, args.num_prompts, seed=1)
    print(f"device {mx.default_device()}, drafter {sargs.drafter.kind}, K = {runner.num_draft_tokens}")
    print(
        "| request | prompt | first round ms (draft / verify / accept) | later rounds | median ms (draft / verify / accept) | slowest later round ms (history) |"
    )
    print("|---|---|---|---|---|---|")
    for i, prompt in enumerate(prompts):
        request_id = f"r{i}"
        runner.spec_begin(Request(request_id, prompt, SamplingParams(max_tokens=args.tokens)))
        rounds, emitted, reason = [], 1, None
        while reason is None and emitted < args.tokens:
            parts, count, length, reason = timed_round(runner, request_id)
            rounds.append((parts, length))
            emitted += count
        runner.spec_finish(request_id)
        first, later = rounds[0], rounds[1:]
        medians = [statistics.median(p[part] for p, _ in later) for part in PARTS] if later else []
        slowest = max(later, key=lambda r: sum(r[0].values())) if later else None
        print(
            f"| {request_id} | {len(prompt)} | {' / '.join(f'{first[0][p]:.1f}' for p in PARTS)} | {len(later)} | "
            f"{' / '.join(f'{m:.1f}' for m in medians)} | "
            + (f"{sum(slowest[0].values()):.1f} ({slowest[1]})" if slowest else "-")
            + " |"
        )
    runner.close()


if __name__ == "__main__":
    main()
