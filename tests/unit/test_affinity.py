"""Table tests for the replica choice: affinity, load bound, fallback."""

import pytest

from serve_app.affinity import choose_replica, least_loaded, preferred_replica, rank_replicas

REPLICAS = ["r0", "r1", "r2", "r3"]


def idle(replica_ids=REPLICAS):
    return {rid: 0 for rid in replica_ids}


def key_preferring(replica_id, replica_ids=REPLICAS):
    """A session key whose preferred replica is `replica_id`."""
    return next(k for k in (f"session-{i}" for i in range(10_000))
                if preferred_replica(k, replica_ids) == replica_id)


def test_a_key_always_prefers_the_same_replica():
    for i in range(50):
        key = f"conversation-{i}"
        assert len({choose_replica(key, idle(), 4) for _ in range(5)}) == 1


def test_keys_spread_over_replicas():
    counts = {rid: 0 for rid in REPLICAS}
    for i in range(400):
        counts[preferred_replica(f"conversation-{i}", REPLICAS)] += 1
    assert min(counts.values()) > 60  # 100 each on average


def test_preference_ignores_candidate_order():
    key = "conversation-7"
    assert preferred_replica(key, REPLICAS) == preferred_replica(key, list(reversed(REPLICAS)))


def test_a_key_moves_only_when_its_replica_leaves():
    keys = [f"conversation-{i}" for i in range(200)]
    before = {k: preferred_replica(k, REPLICAS) for k in keys}
    after = {k: preferred_replica(k, REPLICAS[:-1]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r3")
    assert all(after[k] != "r3" for k in keys)


@pytest.mark.parametrize("preferred_len, least_len, margin, stays", [
    (0, 0, 4, True),
    (4, 0, 4, True),     # exactly the margin: still the conversation's replica
    (5, 0, 4, False),    # one past: the least loaded replica
    (7, 3, 4, True),
    (9, 3, 4, False),
    (1, 0, 0, False),    # margin 0: any imbalance moves the request
    (0, 0, 0, True),
    (100, 98, 4, True),
])
def test_load_bound(preferred_len, least_len, margin, stays):
    key = key_preferring("r2")
    queue_lens = {"r0": least_len + 1, "r1": least_len, "r2": preferred_len, "r3": least_len + 2}
    expected = "r2" if stays else "r1"
    assert choose_replica(key, queue_lens, margin) == expected


@pytest.mark.parametrize("queue_lens, expected", [
    ({"r0": 3, "r1": 1, "r2": 2}, "r1"),
    ({"r0": 0, "r1": 0}, "r0"),  # ties: the smaller id
    ({"r5": 2}, "r5"),
])
def test_no_key_goes_to_the_least_loaded(queue_lens, expected):
    assert least_loaded(queue_lens) == expected
    assert choose_replica(None, queue_lens, 4) == expected


def test_single_replica_takes_everything():
    assert choose_replica("any", {"only": 50}, 0) == "only"


def test_no_replica_is_an_error():
    with pytest.raises(ValueError):
        choose_replica("k", {}, 4)


@pytest.mark.parametrize("preferred_len, expected", [
    (0, ["r2", "r1", "r0", "r3"]),   # affinity first, then by queue length
    (9, ["r1", "r0", "r3", "r2"]),   # over the bound: least loaded first
])
def test_rank_replicas(preferred_len, expected):
    key = key_preferring("r2")
    assert rank_replicas(key, {"r0": 2, "r1": 1, "r2": preferred_len, "r3": 3}, 4) == expected
