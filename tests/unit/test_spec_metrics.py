"""Speculative counters per request (SpecStats.record_round) and their Prometheus series
under vLLM's names (serve_app.deployment.metrics), from slot rounds and row verifies alike."""

from scheduler.request import SpecStats
from serve_app.deployment.metrics import ReplicaMetrics, StreamTimes


def test_record_round_counts_verifies_and_accepted_positions():
    stats = SpecStats()
    for drafted, accepted in ((4, 2), (0, 0), (3, 3), (4, 0), (2, 1)):
        stats.record_round(drafted, accepted)
    assert (stats.num_rounds, stats.num_drafted, stats.num_accepted) == (5, 13, 6)
    assert stats.num_drafts == 4  # the verify with nothing drafted does not count
    assert stats.accepted_by_position == [3, 2, 1]  # position 0 accepted 3 times, 1 twice, 2 once


def test_slot_rounds_and_row_verifies_are_told_apart_by_drafter():
    stats = SpecStats()
    stats.record_round(0, 0, probe=True, drafter="draft_model")  # a probe drafts nothing
    stats.record_round(4, 3, drafter="draft_model")
    stats.record_round(4, 1, drafter="draft_model")
    stats.record_round(2, 2, row=True, drafter="ngram")
    stats.record_round(0, 0, row=True)  # a row step that drafted nothing is not a verify
    assert (stats.num_rounds, stats.num_probe_rounds, stats.num_row_rounds) == (5, 1, 2)
    assert stats.num_slot_rounds == 2  # the adaptive policy's measure of a slot session
    usage = stats.as_usage()
    assert usage["drafters"] == {
        "draft_model": {"rounds": 2, "drafted": 8, "accepted": 4},
        "ngram": {"rounds": 1, "drafted": 2, "accepted": 2},
    }
    assert (usage["rounds"], usage["row_rounds"], usage["drafted"], usage["accepted"]) == (5, 2, 10, 6)


def test_vllm_named_series_sum_over_requests():
    metrics = ReplicaMetrics("tiny")
    for rounds in (((4, 2), (4, 4)), ((3, 1),)):
        stats = SpecStats()
        for drafted, accepted in rounds:
            stats.record_round(drafted, accepted)
        metrics.record_finish("normal", "length", StreamTimes(arrival=0.0), 1.0, stats, None)
    text = metrics.render(None).decode()
    for line in (
        'specslot:spec_decode_num_drafts_total{model_name="tiny"} 3.0',
        'specslot:spec_decode_num_draft_tokens_total{model_name="tiny"} 11.0',
        'specslot:spec_decode_num_accepted_tokens_total{model_name="tiny"} 7.0',
        'specslot:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"} 3.0',
        'specslot:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="1"} 2.0',
        'specslot:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="3"} 1.0',
    ):
        assert line in text, line
