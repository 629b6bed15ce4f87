"""The replica's record of the affinity keys it served, and the report routers read."""

import pickle

import pytest

from serve_app.deployment.served_keys import NO_REPORT, ServedKeys, key_digest, read_report


def test_the_report_holds_the_most_recent_keys_and_when():
    served = ServedKeys(capacity=3)
    for key, now in [("a", 1.0), ("b", 2.0), ("c", 3.0), ("a", 4.0), ("d", 5.0)]:
        served.record(key, now)
    report = read_report(served.report(now=6.0))
    assert (report.num_sessions, report.reported_at) == (3, 6.0)
    assert [report.served_at(key_digest(k)) for k in "abcd"] == [4.0, None, 3.0, 5.0]  # b: the oldest, forgotten


@pytest.mark.parametrize("key", [None, ""])
def test_requests_without_a_key_are_not_recorded(key):
    served = ServedKeys()
    served.record(key, 1.0)
    assert len(served) == 0


def test_an_unchanged_report_is_the_same_report():
    """Serve broadcasts a report only when it changed: nothing served, nothing sent."""
    served = ServedKeys()
    served.record("a", 1.0)
    first = served.report(now=2.0)
    assert served.report(now=3.0) == first
    served.record("b", 4.0)
    assert read_report(served.report(now=5.0)).reported_at == 5.0


def test_a_full_report_stays_small():
    served = ServedKeys()
    for i in range(10_000):
        served.record(f"session with a long id {'x' * 500} {i}", 1.7e9 + i)
    report = served.report(now=1.8e9)
    assert report["num_sessions"] == 4096
    assert len(pickle.dumps(report)) < 160_000  # about 30 bytes a key, whatever the ids' length


@pytest.mark.parametrize("stats", [None, {}, {"something": "else"}, {"served_keys": ["not", "a", "map"]}])
def test_other_stats_read_as_no_report(stats):
    assert read_report(stats) == NO_REPORT


def test_capacity_must_hold_one():
    with pytest.raises(ValueError):
        ServedKeys(capacity=0)
