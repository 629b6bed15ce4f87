"""The benchmark metrics: vLLM definitions on hand-made request records."""

import pytest

from scripts.bench import metrics


def record(lane="normal", arrival=0.0, chunks=((0.5, 1), (0.7, 2), (1.0, 1)), finish=1.0, output=4):
    return {
        "lane": lane,
        "arrival_s": arrival,
        "first_token_s": chunks[0][0] if chunks else None,
        "chunks": list(chunks),
        "finish_s": finish,
        "prompt_tokens": 10,
        "output_tokens": output,
        "speculative": None,
        "error": None,
    }


def test_per_request_follows_vllm_definitions():
    d = metrics.per_request(record())
    assert d["ttft_s"] == pytest.approx(0.5)
    assert d["e2el_s"] == pytest.approx(1.0)
    assert d["tpot_s"] == pytest.approx((1.0 - 0.5) / 3)  # (E2EL - TTFT) / (tokens - 1)
    assert d["itl_s"] == pytest.approx([0.2, 0.3])  # one gap per streamed chunk


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1, 1, 1, 1], 1.0),
        ([1, 0, 0, 0], 0.25),
        ([2, 1], 9 / 10),
        ([0, 0], None),
        ([], None),
    ],
)
def test_jain_index(values, expected):
    assert metrics.jain_index(values) == (pytest.approx(expected) if expected is not None else None)


def test_describe_reports_milliseconds_and_percentiles():
    d = metrics.describe([i / 1000 for i in range(1, 101)], "ttft")
    assert d["mean_ttft_ms"] == pytest.approx(50.5)
    assert d["median_ttft_ms"] == pytest.approx(50.5)
    assert d["p90_ttft_ms"] == pytest.approx(90.1)
    assert d["p99_ttft_ms"] == pytest.approx(99.01)
    assert metrics.describe([], "x") == {"mean_x_ms": None, "median_x_ms": None, "p90_x_ms": None, "p99_x_ms": None}


def test_summary_per_lane_and_failures():
    records = [
        record("high"),
        record("normal", output=2, chunks=((0.2, 1), (0.4, 1)), finish=0.4),
        dict(record("normal"), error="HTTP 503"),
    ]
    s = metrics.summarize(records, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["output_throughput"] == pytest.approx(3.0)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert set(s["lanes"]) == {"high", "normal"}
    assert s["lanes"]["high"]["mean_ttft_ms"] == pytest.approx(500)
    assert s["lanes"]["normal"]["completed"] == 1 and s["lanes"]["normal"]["failed"] == 1
    assert s["acceptance_length"] is None


def test_speculative_totals_exclude_probe_rounds_from_acceptance_length():
    spec = {"rounds": 12, "probe_rounds": 2, "drafted": 40, "accepted": 25, "grants": 2, "parks": 1}
    s = metrics.speculative_totals([dict(record(), speculative=spec)])
    assert s["speculative"]["rounds"] == 12
    assert s["acceptance_length"] == pytest.approx(25 / 10 + 1)
    assert s["acceptance_rate"] == pytest.approx(25 / 40)


EXPOSITION = """# HELP specslot:time_to_first_token_seconds TTFT
# TYPE specslot:time_to_first_token_seconds histogram
specslot:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 2.0
specslot:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 3.0
specslot:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 5.0
specslot:time_to_first_token_seconds_count{model_name="m"} 5.0
specslot:time_to_first_token_seconds_bucket{le="1.0",model_name="other"} 1.0
specslot:time_to_first_token_seconds_bucket{le="+Inf",model_name="other"} 1.0
specslot:time_per_output_token_seconds_bucket{le="1.0",model_name="m"} 9.0
"""


def test_server_side_ttft_over_a_run_from_two_scrapes():
    before = metrics.histogram_buckets(EXPOSITION, "specslot:time_to_first_token_seconds")
    assert before == {0.5: 2.0, 1.0: 4.0, float("inf"): 6.0}  # label sets summed, other histograms left out
    after = {**before, 1.0: 7.0, float("inf"): 12.0}
    delta = metrics.bucket_delta(before, after)
    assert metrics.share_within(delta, 1.0) == (3, 6)  # 6 requests in the run, 3 of them within 1 s


def test_pair_rows_count_requests_whose_server_side_ttft_passed_a_second():
    from scripts.bench.vs_mlx_lm import pair_ratios

    summary = {
        "output_throughput": 10.0,
        **{f"{stat}_{name}_ms": 100.0 for stat in ("mean", "median", "p99") for name in ("ttft", "tpot")},
    }
    runs = [
        {
            "server": "specslot",
            "concurrency": 4,
            "repeat": r,
            "summary": summary,
            "server_ttft_buckets": {"1.0": 3.0, "inf": 4.0 + r},
        }
        for r in range(2)
    ]
    runs += [{"server": "mlx_lm", "concurrency": 4, "repeat": r, "summary": summary} for r in range(2)]
    (row,) = pair_ratios(runs, ["mlx_lm"])
    assert row["ours_server_ttft_over_1s"] == 1 + 2


def test_tick_delta_reads_a_runs_ticks_from_two_scrapes():
    """What bench_vs_mlx_lm prints per run of ours: ticks per action that ran between
    two /metrics scrapes, their mean ms, and the engine's mean gap per tick."""
    from scripts.bench.vs_mlx_lm import TICK_GAP, TICK_SUMMARY, tick_delta, tick_line

    def text(decode_n, decode_s, spec_n, spec_s, gap_s):
        return "\n".join(
            [
                f'{TICK_SUMMARY}_count{{action="decode"}} {decode_n}',
                f'{TICK_SUMMARY}_sum{{action="decode"}} {decode_s}',
                f'{TICK_SUMMARY}_count{{action="speculative"}} {spec_n}',
                f'{TICK_SUMMARY}_sum{{action="speculative"}} {spec_s}',
                f'{TICK_SUMMARY}_count{{action="idle"}} 3.0',
                f'{TICK_SUMMARY}_sum{{action="idle"}} 0.0',
                f"{TICK_GAP} {gap_s}",
            ]
        )

    def scrape(t):
        return {
            "tick_count": metrics.labelled_samples(t, TICK_SUMMARY + "_count", "action"),
            "tick_sum": metrics.labelled_samples(t, TICK_SUMMARY + "_sum", "action"),
            "gap_s": metrics.labelled_samples(t, TICK_GAP, "").get("", 0.0),
        }

    delta = tick_delta(scrape(text(10, 0.1, 5, 0.1, 0.001)), scrape(text(110, 1.1, 5, 0.1, 0.011)))
    assert delta["actions"] == {"decode": {"count": 100, "mean_ms": pytest.approx(10.0)}}
    assert delta["gap_ms"] == pytest.approx(0.1)
    assert tick_line(delta) == "; ticks: decode 100 x 10.00 ms; gap 0.10 ms/tick"
    assert tick_line(None) == ""
