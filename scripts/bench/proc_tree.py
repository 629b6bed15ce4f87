"""A server's processes as /proc shows them (Linux): its descendants, their peak RSS,
and the CPU time each kind of process used over a run.

A server started by `scripts.bench.servers` is one process tree: for ours the CLI, Ray's
GCS and raylet, and the workers the raylet starts, which name themselves after their
actor (`ray::ProxyActor`, `ray::ServeReplica:<app>:<deployment>`,
`ray::SchedulerActor.poll`: the method running when read). `kind` folds those titles
into one label per actor class, so the CPU of a run reads as "the HTTP proxy used 0.9
of a core, the replicas 0.6, the scheduler actors 1.0".
"""

from __future__ import annotations

import os
import re

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_RAY_TITLE = re.compile(r"^ray::([A-Za-z_][\w]*)")


def _stats() -> dict[int, list[str]]:
    """Every process's /proc/PID/stat fields after its name (state, ppid, ...), read now."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stats[int(entry)] = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
    return stats


def descendants(root_pid: int, stats: dict[int, list[str]] | None = None) -> list[int]:
    """`root_pid` and every process below it, from `stats` (`_stats()`; read now if not given)."""
    children: dict[int, list[int]] = {}
    for pid, fields in (_stats() if stats is None else stats).items():
        children.setdefault(int(fields[1]), []).append(pid)
    found, stack = [], [root_pid]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def kind(cmdline: str) -> str:
    """A label for a process from its command line.

    >>> kind("ray::SchedulerActor.poll"), kind("ray::ServeReplica:specslot:SpecslotServer")
    ('SchedulerActor', 'ServeReplica')
    >>> kind("/venv/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x=1")
    'raylet'
    >>> kind("/venv/bin/python -m serve_app.cli configs/local.yaml"), kind("python3 -c import time")
    ('python -m serve_app.cli', 'python -c')
    """
    match = _RAY_TITLE.match(cmdline)
    if match:
        return match.group(1)
    words = cmdline.split()
    if not words:
        return "?"
    exe = os.path.basename(words[0])
    if exe.startswith("python") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2:
            return f"python -m {words[2]}"
        if words[1] == "-c":
            return "python -c"
        rest = [w for w in words[1:] if not w.startswith("-")]
        return os.path.basename(rest[0]) if rest else exe
    return exe


def cpu_seconds(root_pid: int) -> dict[int, tuple[str, float]]:
    """Per process of the tree: (its kind, the CPU seconds it has used so far)."""
    stats = _stats()
    out = {}
    for pid in descendants(root_pid, stats):
        if pid not in stats:  # the root, ended before the scan
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # ended since the scan
            continue
        # utime and stime: fields 14 and 15 of stat, 12 and 13 after the name
        out[pid] = (kind(cmdline), (int(stats[pid][11]) + int(stats[pid][12])) / _TICKS)
    return out


def cpu_by_kind(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float
) -> dict[str, float]:
    """Cores used per kind between two `cpu_seconds` reads `wall_s` apart (a process
    that started in between counts from zero; one that ended is left out), largest
    first.

    >>> cpu_by_kind({1: ("ProxyActor", 2.0)}, {1: ("ProxyActor", 3.5), 2: ("raylet", 0.5)}, 2.0)
    {'ProxyActor': 0.75, 'raylet': 0.25}
    """
    used: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        used[name] = used.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    return dict(sorted(((name, s / wall_s) for name, s in used.items() if s > 0), key=lambda kv: -kv[1]))


def peak_rss_mb(root_pid: int) -> dict:
    """The largest peak RSS (VmHWM) among `root_pid` and its descendants, and its name."""
    best = {"peak_rss_mb": None, "process": None}
    for pid in descendants(root_pid):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        hwm = fields.get("VmHWM")
        if hwm and (best["peak_rss_mb"] is None or int(hwm.split()[0]) / 1024 > best["peak_rss_mb"]):
            best = {"peak_rss_mb": int(hwm.split()[0]) / 1024, "process": fields.get("Name", "").strip()}
    return best
