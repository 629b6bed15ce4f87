"""Shared plumbing of the benchmark scenarios: CLI, environment record, JSON, warm-up, and
the experiments' synchronized timer."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from importlib import metadata


def scenario_args(description: str, default_out: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="small sizes for a 2-core CPU box (minutes)")
    ap.add_argument("--out", default=default_out, help="results folder")
    ap.add_argument("--target", default="models/bundled/target")
    ap.add_argument("--draft", default="models/bundled/draft")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-plot", action="store_true")
    return ap


def machine() -> dict:
    """Where and with what the numbers were taken."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines():
            if line.startswith("Model name:"):
                cpu = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    versions = {}
    for dist in ("mlx", "mlx-lm", "ray", "numpy", "specslot"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    info = {
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "versions": versions,
        "argv": sys.argv,
        "loadavg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        import mlx.core as mx

        info["mlx_device"] = str(mx.default_device())
    except Exception:  # noqa: BLE001 - informational only
        pass
    try:
        info["git_commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def write_json(out_dir: str, name: str, payload: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
    return path


def write_text(out_dir: str, name: str, text: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def publish(args, name: str, result: dict, text: str, plot=None) -> None:
    """A scenario's outputs: the table on stdout, `<name>.json`, `<name>.md` and, unless
    `--no-plot`, `<name>.png` drawn by `plot(result, path)`."""
    print(text)
    write_json(args.out, name, result)
    write_text(args.out, f"{name}.md", text + "\n")
    if plot is not None and not args.no_plot:
        plot(result, os.path.join(args.out, f"{name}.png"))


def pyplot():
    """matplotlib's pyplot on a file-only backend (imported only when plotting)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    """Lay out, write (100 dpi) and release a figure made with `pyplot()`."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def warm_up(runner, tokenizer) -> None:
    """One short classic and one short speculative request, so first-call costs
    (kernel compilation, allocator growth) stay out of the measurements."""
    from scheduler.config import SchedulerConfig
    from scripts.bench.engine import Arrival, drive
    from scripts.bench.prompts import token_prompts

    prompt = token_prompts(tokenizer, 1, seed=12345, num_tokens=32)[0]
    for policy in ("off", "on"):
        drive(
            runner,
            SchedulerConfig(b1_policy=policy, num_draft_tokens=runner.num_draft_tokens),
            [Arrival(f"warm-{policy}", prompt, 16)],
        )


def median_eval_s(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of `mx.eval(fn())` over `repeats` calls, after `warmup` unmeasured
    ones: each call waits for the device, so a GPU's kernels are counted whole."""
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times)
