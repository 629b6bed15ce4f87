"""The request ledger: admission, cancels, the hand-over to the scheduler, finishing."""

import pytest

from scheduler.ledger import QueueFull, RequestLedger
from tests.unit.factories import FakeClock, make_request


def test_admit_stamps_arrival_and_take_hands_each_request_over_once():
    ledger = RequestLedger(FakeClock(5.0))
    a, b = make_request("A"), make_request("B")
    b.arrival_time = 1.0
    ledger.admit(a)
    ledger.admit(b)
    assert (a.arrival_seq, a.arrival_time, b.arrival_seq, b.arrival_time) == (0, 5.0, 1, 1.0)
    assert ledger.has_inputs() and ledger.num_untaken == 2 and ledger.num_unfinished == 2
    assert ledger.take() == ([a, b], [])
    assert ledger.take() == ([], []) and not ledger.has_inputs()
    assert ledger.unfinished() == [a, b]  # taken, still unfinished until `finish`


@pytest.mark.parametrize("num_unfinished, limit, full", [(0, 1, False), (1, 1, True), (1, 2, False), (3, None, False)])
def test_admit_refuses_at_the_limit(num_unfinished, limit, full):
    ledger = RequestLedger()
    for i in range(num_unfinished):
        ledger.admit(make_request(f"r{i}"))
    if full:
        with pytest.raises(QueueFull):
            ledger.admit(make_request("new"), max_unfinished=limit)
    else:
        ledger.admit(make_request("new"), max_unfinished=limit)
    assert ledger.num_unfinished == num_unfinished + (not full)


def test_a_duplicate_id_is_refused_until_the_first_finishes():
    ledger = RequestLedger()
    first = make_request("A")
    ledger.admit(first)
    with pytest.raises(ValueError, match="duplicate"):
        ledger.admit(make_request("A"))
    ledger.finish(first)
    ledger.admit(make_request("A"))
    assert ledger.num_unfinished == 1


def test_cancel_flags_an_unfinished_request_and_queues_its_id():
    ledger = RequestLedger()
    a = make_request("A")
    ledger.admit(a)
    ledger.take()
    assert ledger.cancel("A") and a.cancel_requested
    assert not ledger.cancel("nobody")
    assert ledger.take() == ([], ["A"])
    ledger.finish(a)
    assert not ledger.cancel("A") and ledger.get("A") is None
