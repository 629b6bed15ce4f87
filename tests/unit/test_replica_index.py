"""The replica's index of past outputs (models.speculative.replica_index), by tables."""

import pytest

from models.speculative.replica_index import ReplicaIndex


def test_the_longest_match_wins_then_the_latest_occurrence():
    index = ReplicaIndex(min_ngram=2, max_ngram=4)
    index.add([1, 2, 3, 4, 5, 6])
    index.add([7, 3, 4, 8, 9])
    assert index.propose([0, 3, 4], 3) == [8, 9]  # (3, 4): the latest output
    assert index.last_match == 2
    assert index.propose([2, 3, 4], 3) == [5, 6]  # (2, 3, 4) is longer: the first output
    assert index.last_match == 3
    assert index.propose([9, 9, 1, 2, 3, 4], 1) == [5]  # only the last max_ngram tokens count
    assert index.propose([5], 2) == [] and index.propose([], 2) == []  # shorter than min_ngram
    assert index.propose([6, 7], 2) == []  # no n-gram across two outputs
    assert index.last_match == 0
    assert index.propose([2, 3], 0) == []
    assert index.stats() == {"tokens": 11, "outputs": 2, "proposals": 6, "hits": 3}


def test_a_draft_stops_at_the_end_of_its_output():
    index = ReplicaIndex(min_ngram=2, max_ngram=2)
    index.add([1, 2, 3])
    index.add([4, 5, 6, 7])
    assert index.propose([1, 2], 4) == [3]


@pytest.mark.parametrize("capacity", [10, 25, 64])
def test_memory_stays_under_capacity_and_old_outputs_go_first(capacity):
    index = ReplicaIndex(capacity=capacity, min_ngram=2, max_ngram=3)
    outputs = [[100 * i + j for j in range(8)] for i in range(20)]
    for out in outputs:
        index.add(out)
        assert len(index) <= capacity
    assert index.propose(outputs[-1][:2], 2) == outputs[-1][2:4]  # the newest is always held
    assert index.propose(outputs[0][:2], 2) == []  # the oldest is gone
    index.add(list(range(1000, 1000 + 3 * capacity)))  # longer than capacity: its tail is kept
    assert len(index) == capacity and index.propose([1000 + 3 * capacity - 3, 1000 + 3 * capacity - 2], 5) == [
        1000 + 3 * capacity - 1
    ]


def test_short_outputs_are_not_stored_and_bad_bounds_are_refused():
    index = ReplicaIndex(min_ngram=4, max_ngram=8)
    index.add([1, 2, 3, 4])  # no 4-gram with a follower
    assert len(index) == 0
    with pytest.raises(ValueError):
        ReplicaIndex(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError):
        ReplicaIndex(capacity=0)
