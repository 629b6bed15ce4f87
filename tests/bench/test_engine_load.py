"""`scripts.bench.engine_load`: the load generator's workload on the in-process engine, and
`bench_vs_mlx_lm --engine`'s per-concurrency comparison with the server's runs."""

from __future__ import annotations

import pytest

from scripts.bench import vs_mlx_lm as bench_vs_mlx_lm
from scripts.bench.engine_load import engine_from_config, run_engine_load
from scripts.bench.loadgen import LoadConfig, build_requests

pytestmark = pytest.mark.model


def test_engine_load_runs_the_load_generators_requests(tiny_pair):
    from serve_app.openai.codec import TextCodec

    engine, info = engine_from_config("configs/bundled.yaml", tiny_pair[0], {"drafter": {"kind": "ngram"}})
    codec = TextCodec.from_path(tiny_pair[0])
    cfg = LoadConfig(base_url="", num_prompts=5, concurrency=2, max_tokens=12, seed=3, prompt_chars=200)
    try:
        result = run_engine_load(engine, codec, info["eos_token_ids"], cfg)
    finally:
        engine.stop()
    records, summary = result["requests"], result["summary"]
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert [r["index"] for r in records] == list(range(5))
    for record, item in zip(records, build_requests(cfg)):
        assert record["prompt_tokens"] == len(codec.encode(item["body"]["prompt"]))
        assert 1 <= record["output_tokens"] <= 12
        assert record["output_tokens"] == sum(n for _, n in record["chunks"])
        assert record["arrival_s"] <= record["first_token_s"] <= record["finish_s"]
        assert record["finish_reason"] in ("stop", "length")
    # a closed loop of two: the third request arrives only when one of the first two ends
    third = records[2]["arrival_s"]
    assert third >= min(records[0]["finish_s"], records[1]["finish_s"]) - 1e-6
    assert summary["output_throughput"] > 0 and summary["median_tpot_ms"] is not None


def _run(server, concurrency, repeat, tpot, ttft=100.0, tok_s=50.0):
    return {
        "server": server,
        "concurrency": concurrency,
        "repeat": repeat,
        "summary": {"median_tpot_ms": tpot, "median_ttft_ms": ttft, "output_throughput": tok_s},
    }


def test_engine_rows_give_the_serving_paths_share_of_tpot():
    runs = [
        _run("specslot", 1, 0, 10.0),
        _run("specslot", 1, 1, 12.0),
        _run("mlx_lm", 1, 0, 30.0),
        _run(bench_vs_mlx_lm.ENGINE, 1, 0, 9.0),
        _run(bench_vs_mlx_lm.ENGINE, 1, 1, 9.0),
    ]
    (row,) = bench_vs_mlx_lm.engine_rows(runs, "specslot")
    assert row["concurrency"] == 1 and row["http_tpot_ms"] == 11.0 and row["engine_tpot_ms"] == 9.0
    assert row["http_share"] == pytest.approx(1 - 9 / 11)
