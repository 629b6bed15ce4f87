"""Run every benchmark scenario, each in its own process, into one results folder.

    python -m scripts.bench.all --quick --out results/quick     # make bench-quick
    python -m scripts.bench.all --out results/full              # make bench

Writes `<out>/<scenario>/` (JSON, markdown table, PNG) per scenario plus
`<out>/summary.md` and `<out>/summary.json` (machine, versions, wall time per
scenario, exit codes). A failing scenario does not stop the others; the exit code is
non-zero if any failed. `--only` / `--skip` select scenarios by name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from scripts.bench import util as bench_util

SCENARIOS = [
    ("single", "scripts.bench.single", "1. single stream, classic vs speculative (K sweep, both drafters)"),
    ("rotation", "scripts.bench.rotation", "2. 2-4 concurrent speculative streams x grant_rounds"),
    ("pressure", "scripts.bench.pressure", "3. sustained high-lane pressure: normal-lane grant gaps"),
    ("vs_mlx_lm", "scripts.bench.vs_mlx_lm", "4. side by side with mlx_lm.server (HTTP, alternating)"),
    ("overhead", "scripts.bench.overhead", "5. overheads: scheduler per tick, actor hop, engine vs raw"),
    (
        "concurrency",
        "scripts.bench.concurrency",
        "6. speculation under concurrency: fused vs alternating tick vs classic",
    ),
    (
        "multiturn",
        "scripts.bench.multiturn",
        "7. multi-turn chat: TTFT per turn, prefix cache on vs off (and mlx_lm.server)",
    ),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/full")
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    ap.add_argument("--skip", default="", help="comma-separated scenario names")
    args = ap.parse_args(argv)
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    os.makedirs(args.out, exist_ok=True)
    started = time.perf_counter()
    report = {"machine": bench_util.machine(), "quick": args.quick, "scenarios": {}}
    sections = []
    for name, module, title in SCENARIOS:
        if (only and name not in only) or name in skip:
            continue
        out_dir = os.path.join(args.out, name)
        cmd = [sys.executable, "-m", module, "--out", out_dir] + (["--quick"] if args.quick else [])
        print(f"== {title}\n   $ {' '.join(cmd[1:])}", flush=True)
        tic = time.perf_counter()
        proc = subprocess.run(cmd)
        wall = time.perf_counter() - tic
        report["scenarios"][name] = {
            "command": " ".join(["python"] + cmd[1:]),
            "returncode": proc.returncode,
            "wall_s": round(wall, 1),
        }
        table_path = os.path.join(out_dir, f"{'single_stream' if name == 'single' else name}.md")
        table = open(table_path).read() if os.path.isfile(table_path) else f"(failed: exit {proc.returncode})\n"
        sections.append(f"## {title}\n\n`python {' '.join(cmd[1:])}` ({wall:.0f} s)\n\n{table}")
    report["total_wall_s"] = round(time.perf_counter() - started, 1)
    m = report["machine"]
    header = (
        f"# Benchmark results ({'quick' if args.quick else 'full'})\n\n"
        f"{m['date_utc']}, {m['nproc']} cores, {m['cpu']}, {m.get('mlx_device')}, python {m['python']}, "
        f"{', '.join(f'{k} {v}' for k, v in m['versions'].items())}, commit {m.get('git_commit')}; "
        f"total {report['total_wall_s']:.0f} s\n"
    )
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(header + "\n" + "\n".join(sections))
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(report, f, indent=1)
    failed = [n for n, r in report["scenarios"].items() if r["returncode"] != 0]
    print(
        f"total wall time {report['total_wall_s']:.0f} s; results in {args.out}"
        + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
