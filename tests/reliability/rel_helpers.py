"""Constants and small helpers of the reliability tests."""

from __future__ import annotations

import httpx

KEY_HIGH = "rel-key-high-0001"
KEY_NORMAL = "rel-key-normal-0002"
AUTH = {"Authorization": f"Bearer {KEY_HIGH}"}
# `rel` runs with API keys, a small queue and a rotating slot, so one deployment serves
# the security, overload and HTTP-soak tests.
REL_ARGS = {
    "api_keys": [{"key": KEY_HIGH, "max_lane": "high"}, {"key": KEY_NORMAL, "max_lane": "normal"}],
    "max_queue_depth": 8,
    "backlog_cap": 2,
    "grant_rounds": 2,
    "b1_policy": "on",
    "max_batch_size": 4,
    "prefill_batch_size": 2,
    "max_tokens_limit": 300,
    "max_body_bytes": 64 * 1024,
}
PROMPT = "def parse(text):\n    "


def state(base: str) -> dict:
    return httpx.get(f"{base}/v1/internal/scheduler", headers=AUTH, timeout=10).json()


def rss_mib(pid: int) -> float:
    """Resident set size of a local process (Linux /proc), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def drained(base: str) -> bool:
    """Nothing left anywhere: scheduler queues, rows, slot, sessions, replica streams."""
    s = state(base)
    return (
        s["unfinished"] == 0
        and sum(s["queue_depth"].values()) == 0
        and s["classic_rows"] == 0
        and s["slot"]["owner"] is None
        and not s["slot"]["backlog"]
        and s["counters"]["live_sessions"] == 0
        and s["replica"]["open_streams"] == 0
    )
