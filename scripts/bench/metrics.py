"""Serving metrics with the names users know from `vllm bench serve`.

A request record is plain data (seconds on one monotonic clock):
`{"lane", "arrival_s", "first_token_s", "chunks": [(t, num_tokens), ...], "finish_s",
"prompt_tokens", "output_tokens", "speculative": {...} | None, "error": str | None}`.
Definitions follow vLLM: TTFT = first token - arrival; TPOT = (E2EL - TTFT) /
(output tokens - 1); ITL = gaps between consecutive streamed chunks (a chunk holding
several tokens, e.g. a speculative round, is one gap); E2EL = finish - arrival.
"""

from __future__ import annotations

import math
import urllib.request
from typing import Iterable

import numpy as np

PERCENTILES = (90, 99)
LANES = ("high", "normal", "low")


def describe(values_s: Iterable[float], name: str) -> dict[str, float | None]:
    """mean/median/p90/p99 of `values_s`, reported in milliseconds as `<stat>_<name>_ms`."""
    arr = np.asarray(list(values_s), dtype=float) * 1000.0
    out: dict[str, float | None] = {}
    for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
        key = f"{stat}_{name}_ms"
        if arr.size == 0:
            out[key] = None
        elif stat == "mean":
            out[key] = float(arr.mean())
        elif stat == "median":
            out[key] = float(np.median(arr))
        else:
            out[key] = float(np.percentile(arr, int(stat[1:])))
    return out


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1.0 = equal, 1/n = one takes all."""
    xs = [float(v) for v in values]
    if not xs or not any(xs):
        return None
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def per_request(record: dict) -> dict:
    """TTFT, TPOT, E2EL (seconds) and ITL list of one finished request."""
    arrival = record["arrival_s"]
    chunk_times = [t for t, n in record["chunks"] if n > 0]
    ttft = record["first_token_s"] - arrival if record.get("first_token_s") is not None else None
    e2el = record["finish_s"] - arrival if record.get("finish_s") is not None else None
    n = record["output_tokens"]
    tpot = (e2el - ttft) / (n - 1) if ttft is not None and e2el is not None and n > 1 else None
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return {"ttft_s": ttft, "tpot_s": tpot, "e2el_s": e2el, "itl_s": itl}


def summarize(records: list[dict], duration_s: float) -> dict:
    """vLLM-style summary over `records`, plus the same per lane."""
    out = _summary(records, duration_s)
    out["lanes"] = {
        lane: _summary([r for r in records if r["lane"] == lane], duration_s)
        for lane in LANES
        if any(r["lane"] == lane for r in records)
    }
    return out


def _summary(records: list[dict], duration_s: float) -> dict:
    ok = [r for r in records if not r.get("error")]
    derived = [per_request(r) for r in ok]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else None,
    }
    summary.update(describe([d["ttft_s"] for d in derived if d["ttft_s"] is not None], "ttft"))
    summary.update(describe([d["tpot_s"] for d in derived if d["tpot_s"] is not None], "tpot"))
    summary.update(describe([x for d in derived for x in d["itl_s"]], "itl"))
    summary.update(describe([d["e2el_s"] for d in derived if d["e2el_s"] is not None], "e2el"))
    summary.update(speculative_totals(ok))
    return summary


def speculative_totals(records: list[dict]) -> dict:
    """Sums of the per-request speculative usage extension, and acceptance length."""
    stats = [r["speculative"] for r in records if r.get("speculative")]
    totals = {
        k: sum(s.get(k) or 0 for s in stats)
        for k in ("rounds", "probe_rounds", "row_rounds", "drafted", "accepted", "grants", "parks")
    }
    real_rounds = totals["rounds"] - totals["probe_rounds"]
    return {
        "speculative": totals,
        "acceptance_length": (totals["accepted"] / real_rounds + 1) if real_rounds > 0 else None,
        "acceptance_rate": totals["accepted"] / totals["drafted"] if totals["drafted"] else None,
    }


def fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(rows: list[dict], columns: list[tuple[str, str]], digits: int = 1) -> str:
    """A markdown table of `rows`; `columns` = [(key, header), ...]."""
    head = "| " + " | ".join(h for _, h in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(k), digits) for k, _ in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def histogram_buckets(text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts (upper bound -> count, summed over label sets) of the
    Prometheus histogram `name` in an exposition `text`.

    >>> histogram_buckets('h_bucket{le="1.0",m="a"} 3.0\\nh_bucket{le="+Inf",m="a"} 5.0\\nh_count 5.0', "h")
    {1.0: 3.0, inf: 5.0}
    """
    out: dict[float, float] = {}
    prefix = name + "_bucket{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, _, value = line[len(prefix) :].rpartition("} ")
        le = next(part.split("=", 1)[1].strip('"') for part in labels.split(",") if part.startswith("le="))
        bound = math.inf if le == "+Inf" else float(le)
        out[bound] = out.get(bound, 0.0) + float(value)
    return out


def bucket_delta(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    """What a histogram gained between two scrapes, per bucket."""
    return {le: count - before.get(le, 0.0) for le, count in sorted(after.items())}


def share_within(delta: dict[float, float], bound: float) -> tuple[int, int]:
    """(observations at or under `bound`, all observations) of a bucket delta; `bound`
    must be one of its buckets' bounds."""
    return int(delta.get(bound, 0.0)), int(delta.get(math.inf, 0.0))


def labelled_samples(text: str, name: str, label: str) -> dict[str, float]:
    """The samples of series `name` in an exposition `text` by the value of `label`
    (summed over the other labels; a sample without labels under "").

    >>> labelled_samples('t_sum{action="decode"} 0.5\\nt_sum{action="idle"} 0.0\\nt_sum2 1.0', "t_sum", "action")
    {'decode': 0.5, 'idle': 0.0}
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        head, _, value = line.rpartition(" ")
        key = ""
        if "{" in head:
            parts = head[head.index("{") + 1 : head.rindex("}")].split(",")
            key = next((p.split("=", 1)[1].strip('"') for p in parts if p.startswith(label + "=")), "")
        out[key] = out.get(key, 0.0) + float(value)
    return out


def series_total(text: str, name: str) -> float:
    """Series `name` in an exposition `text`, summed over every label set (0 if absent).

    >>> series_total('t_sum{m="a"} 0.5\\nt_sum{m="b"} 0.25\\nt_sum2 1.0', "t_sum")
    0.75
    """
    return sum(labelled_samples(text, name, "").values())


def fetch(base_url: str) -> str:
    """A running server's Prometheus exposition (`GET /metrics`)."""
    return fetch_tagged(base_url)[1]


def fetch_tagged(base_url: str) -> tuple[str | None, str]:
    """(the answering replica's id from its `X-Specslot-Replica` header, or None; the
    exposition of `GET /metrics`)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        return resp.headers.get("X-Specslot-Replica"), resp.read().decode()


def fetch_replicas(base_url: str, num_replicas: int, tries: int = 40) -> dict[str | None, str]:
    """Every replica's exposition, by replica id: Serve's proxy sends each `GET /metrics`
    to one replica of its choosing, so ask until `num_replicas` different ones answered
    (at most `tries` times: with two replicas chosen at random, missing one 39 times
    running has odds of 2^-39)."""
    texts: dict[str | None, str] = {}
    for _ in range(tries):
        replica, text = fetch_tagged(base_url)
        texts[replica] = text
        if len(texts) >= num_replicas:
            break
    return texts
