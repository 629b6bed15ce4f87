"""Table tests for the replica choice: affinity, load bound, fallback."""

import pytest

from serve_app.deployment.affinity import (
    ARRIVAL_GRACE_S,
    Pin,
    SessionPins,
    UnreportedPins,
    choose_replica,
    home_replica,
    least_loaded,
    place_key,
    preferred_replica,
    rank_replicas,
)

REPLICAS = ["r0", "r1", "r2", "r3"]


def idle(replica_ids=REPLICAS):
    return {rid: 0 for rid in replica_ids}


def key_preferring(replica_id, replica_ids=REPLICAS):
    """A session key whose preferred replica is `replica_id`."""
    return next(k for k in (f"session-{i}" for i in range(10_000)) if preferred_replica(k, replica_ids) == replica_id)


def test_a_new_key_on_idle_replicas_goes_where_it_hashes():
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


@pytest.mark.parametrize(
    "preferred_len, least_len, margin, stays",
    [
        (0, 0, 4, True),
        (4, 0, 4, True),  # exactly the margin: still the conversation's replica
        (5, 0, 4, False),  # one past: the least loaded replica
        (7, 3, 4, True),
        (9, 3, 4, False),
        (1, 0, 0, False),  # margin 0: any imbalance moves the request
        (0, 0, 0, True),
        (100, 98, 4, True),
    ],
)
def test_load_bound(preferred_len, least_len, margin, stays):
    queue_lens = {"r0": least_len + 1, "r1": least_len, "r2": preferred_len, "r3": least_len + 2}
    expected = "r2" if stays else "r1"
    assert choose_replica("k", queue_lens, margin, pinned="r2") == expected


def test_a_pin_wins_over_the_hash_and_the_pin_counts():
    key = key_preferring("r0")
    assert choose_replica(key, idle(), 4, pinned="r3", pin_counts={"r3": 9}) == "r3"


def test_a_pin_to_a_replica_that_left_is_placed_anew():
    assert choose_replica("k", {"r0": 0, "r1": 0}, 4, pinned="gone", pin_counts={"r0": 2, "r1": 1}) == "r1"


@pytest.mark.parametrize(
    "pin_counts, queue_lens, expected",
    [
        ({"r0": 3, "r1": 2}, {"r0": 0, "r1": 3}, "r1"),  # fewest pins first, even on a longer queue
        ({"r0": 2, "r1": 2}, {"r0": 1, "r1": 0}, "r1"),  # equal pins: the shorter queue
        ({}, {"r0": 0, "r1": 0}, None),  # all equal: the key's hash decides
    ],
)
def test_a_new_key_goes_to_the_fewest_pins(pin_counts, queue_lens, expected):
    key = key_preferring("r0", ["r0", "r1"])
    assert place_key(key, pin_counts, queue_lens) == (expected or "r0")
    assert choose_replica(key, queue_lens, 4, pin_counts=pin_counts) == (expected or "r0")


@pytest.mark.parametrize(
    "queue_lens, expected",
    [
        ({"r0": 3, "r1": 1, "r2": 2}, "r1"),
        ({"r0": 0, "r1": 0}, "r0"),  # ties: the smaller id
        ({"r5": 2}, "r5"),
    ],
)
def test_no_key_goes_to_the_least_loaded(queue_lens, expected):
    assert least_loaded(queue_lens) == expected
    assert choose_replica(None, queue_lens, 4) == expected


def test_single_replica_takes_everything():
    assert choose_replica("any", {"only": 50}, 0) == "only"


def test_no_replica_is_an_error():
    with pytest.raises(ValueError):
        choose_replica("k", {}, 4)


@pytest.mark.parametrize(
    "preferred_len, expected",
    [
        (0, ["r2", "r1", "r0", "r3"]),  # affinity first, then by queue length
        (9, ["r1", "r0", "r3", "r2"]),  # over the bound: least loaded first
    ],
)
def test_rank_replicas(preferred_len, expected):
    assert rank_replicas("k", {"r0": 2, "r1": 1, "r2": preferred_len, "r3": 3}, 4, pinned="r2") == expected


def test_pins_are_an_lru_with_counts():
    pins = SessionPins(capacity=3)
    for key, replica in [("a", "r0"), ("b", "r1"), ("c", "r0")]:
        pins.pin(key, replica)
    assert pins.get("a") == "r0"  # "a" is now the most recently used
    pins.pin("d", "r1")  # forgets "b", the least recently used
    assert (pins.get("b"), len(pins)) == (None, 3)
    assert pins.counts(["r0", "r1", "r2"]) == {"r0": 2, "r1": 1, "r2": 0}
    pins.pin("a", "r1")  # a move counts once, on its new replica
    assert pins.counts(["r0", "r1"]) == {"r0": 1, "r1": 2}


def test_pins_need_room_for_one():
    with pytest.raises(ValueError):
        SessionPins(capacity=0)


# -- several routers: what the replicas report -----------------------------------------


@pytest.mark.parametrize(
    "pin, served_at, expected",
    [
        (None, {}, None),  # nobody knows the key: place it
        (None, {"r1": 4.0}, "r1"),  # placed by another router, reported by r1
        (None, {"r0": 4.0, "r1": 6.0}, "r1"),  # reported twice: the later turn
        (None, {"r0": 4.0, "r1": 4.0}, "r1"),  # same time: the larger id, in every router
        (Pin("r0", 5.0), {}, "r0"),  # only this router knows it
        (Pin("r0", 5.0), {"r0": 5.1}, "r0"),
        (Pin("r0", 5.0), {"r1": 4.0}, "r0"),  # r1 served it before this router's pin
        (Pin("r0", 5.0), {"r1": 6.0}, "r1"),  # another router sent it to r1 since
        (Pin("r0", 5.0), {"r0": 7.0, "r1": 6.0}, "r0"),
        (Pin("gone", 5.0), {"r1": 1.0}, "r1"),  # the pinned replica left
        (Pin("gone", 5.0), {}, None),
        (None, {"gone": 9.0, "r2": 1.0}, "r2"),  # a report of a replica that left
    ],
)
def test_home_is_the_latest_placement_known(pin, served_at, expected):
    assert home_replica(pin, served_at, REPLICAS) == expected


def test_a_reported_home_is_still_load_bound():
    home = home_replica(None, {"r2": 4.0}, REPLICAS)
    assert choose_replica("k", {"r0": 3, "r1": 3, "r2": 7, "r3": 3}, 4, pinned=home) == "r2"
    assert choose_replica("k", {"r0": 3, "r1": 4, "r2": 9, "r3": 3}, 4, pinned=home) == "r0"


@pytest.mark.parametrize(
    "reported, unreported, queue_lens, expected",
    [
        ({"r0": 5, "r1": 3}, {}, {"r0": 0, "r1": 4}, "r1"),  # reported sessions count
        ({"r0": 5, "r1": 3}, {"r1": 2}, {"r0": 1, "r1": 0}, "r1"),  # 5 vs 3 + 2: the shorter queue
        ({"r0": 5, "r1": 3}, {"r1": 3}, {"r0": 4, "r1": 0}, "r0"),  # this router's new placements too
    ],
)
def test_a_new_key_counts_reported_and_unreported_sessions(reported, unreported, queue_lens, expected):
    counts = {rid: reported[rid] + unreported.get(rid, 0) for rid in reported}
    assert place_key("k", counts, queue_lens) == expected


def test_unreported_pins_until_a_report_holds_them():
    unreported = UnreportedPins()
    for digest, now in [("k1", 1.0), ("k2", 2.0), ("k3", 3.0)]:
        unreported.note("r0", digest, now, served=())
    unreported.note("r0", "k0", 3.5, served={"k0"})  # r0's report holds it: counted there
    assert unreported.count("r0", served=(), reported_at=0.0) == 3
    assert unreported.count("r0", served={"k1", "k2"}, reported_at=2.5) == 1
    # Taken after k3 was placed, but k3's request was still on its way: still counted here.
    assert unreported.count("r0", served={"k1", "k2"}, reported_at=3.5) == 1
    # A report taken long after without k3: its request never arrived.
    assert unreported.count("r0", served={"k1", "k2"}, reported_at=3.0 + ARRIVAL_GRACE_S + 1) == 0
    assert unreported.count("r1", served=(), reported_at=0.0) == 0
    unreported.note("r0", "k4", 20.0, served=())
    unreported.retain({"r1"})
    assert unreported.count("r0", served=(), reported_at=0.0) == 0


def test_unreported_pins_are_bounded_per_replica():
    unreported = UnreportedPins(capacity=2)
    for i in range(5):
        unreported.note("r0", f"k{i}", float(i + 1), served=())
    assert unreported.count("r0", served=(), reported_at=0.0) == 2


def test_pins_remember_when():
    pins = SessionPins()
    pins.pin("k", "r0", now=3.0)
    pins.pin("k", "r1", now=4.0)
    assert pins.lookup("k") == Pin("r1", 4.0) and pins.get("k") == "r1"
    assert pins.lookup("other") is None
