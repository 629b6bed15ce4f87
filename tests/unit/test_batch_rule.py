"""The batch-size rule (`speculative_disable_by_batch_size`) over the protocol harness:
the real scheduler and slot on the scripted fake runner."""

import pytest

from scheduler.request import RequestStatus
from tests.unit.factories import Trace, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import token_at


def isolated_stream(request):
    return [token_at(request, i) for i in range(request.sampling.max_tokens)]


def statuses(requests):
    return [r.status.name for r in requests]


@pytest.mark.parametrize(
    "threshold, expected",
    [
        # B, C and D arrive in one drain, so each sees three others (A and the other two).
        (0, ["ACTIVE", "WAITING", "WAITING", "CLASSIC"]),  # off: the ring fills, D finds it full
        (1, ["ACTIVE", "CLASSIC", "CLASSIC", "CLASSIC"]),  # only a lone request speculates
        (3, ["ACTIVE", "CLASSIC", "CLASSIC", "CLASSIC"]),
        (4, ["ACTIVE", "WAITING", "WAITING", "CLASSIC"]),  # three others < 4: as if off
    ],
)
def test_late_arrivals_go_classic_once_the_batch_is_big(threshold, expected):
    scheduler, trace = make_scheduler(grant_rounds=8, speculative_disable_by_batch_size=threshold), Trace()
    reqs = [make_request(rid, rounds=3) for rid in "ABCD"]
    scheduler.submit(reqs[0])
    tick(scheduler, trace)  # A installed alone, slice 0 ran
    for r in reqs[1:]:
        scheduler.submit(r)
    tick(scheduler, trace)  # one drain routes B, C, D in order
    assert statuses(reqs) == expected
    run_until_idle(scheduler, trace)
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    fallbacks = scheduler.counters.classic_fallbacks
    assert fallbacks["batch_size"] == (3 if threshold in (1, 3) else 0)
    assert fallbacks["backlog_full"] == (1 if threshold in (0, 4) else 0)
    for r in reqs:  # classic or speculative, every stream is the isolated one
        assert trace.streams()[r.request_id] == isolated_stream(r)


def test_others_are_counted_as_they_arrive():
    """Arrivals one drain apart: the second sees one other, the third two. With two
    others the holder A is then demoted and the waiter B goes classic at promotion."""
    scheduler = make_scheduler(grant_rounds=8, speculative_disable_by_batch_size=2)
    reqs = [make_request(rid, rounds=3) for rid in "ABC"]
    for r in reqs:
        scheduler.submit(r)
        tick(scheduler)
    assert statuses(reqs) == ["ACTIVE", "WAITING", "CLASSIC"]
    run_until_idle(scheduler)
    assert scheduler.counters.classic_fallbacks["batch_size"] == 1
    assert scheduler.counters.classic_fallbacks["batch_size_at_promotion"] == 1
    assert scheduler.counters.demotions == 1 and reqs[1].spec.num_grants == 0


def test_arrivals_of_one_drain_count_each_other():
    """Four requests routed in the same drain: each sees the other three, so with
    threshold 2 none takes the slot and the four are prefilled together."""
    scheduler = make_scheduler(speculative_disable_by_batch_size=2)
    reqs = [make_request(rid, rounds=2) for rid in "ABCD"]
    for r in reqs:
        scheduler.submit(r)
    record = tick(scheduler)
    assert record.model_actions == [("classic_prefill", ("A", "B", "C", "D"))]
    run_until_idle(scheduler)
    assert scheduler.counters.grants == 0 and scheduler.counters.classic_fallbacks["batch_size"] == 4


def test_lone_request_keeps_the_slot_and_finishing_requests_reopen_it():
    scheduler, trace = make_scheduler(speculative_disable_by_batch_size=1), Trace()
    a = make_request("A", rounds=2)
    scheduler.submit(a)
    run_until_idle(scheduler, trace)
    assert a.spec.num_grants == 1 and a.spec.num_rounds == 2
    b, c = make_request("B", rounds=2), make_request("C", max_tokens=3)
    scheduler.submit(b)
    scheduler.submit(c)
    run_until_idle(scheduler, trace)
    assert b.spec.num_grants == 0 and c.spec.num_grants == 0  # each saw the other
    d = make_request("D", rounds=2)
    scheduler.submit(d)  # alone again: the slot is open
    run_until_idle(scheduler, trace)
    assert d.spec.num_grants == 1 and trace.streams()["D"] == isolated_stream(d)


def test_waiter_and_parked_job_promoted_after_the_batch_grew_both_go_classic():
    scheduler, trace = make_scheduler(grant_rounds=1, speculative_disable_by_batch_size=2), Trace()
    a, b = make_request("A", rounds=3), make_request("B", rounds=2)
    scheduler.submit(a)
    tick(scheduler, trace)
    scheduler.submit(b)
    tick(scheduler, trace)  # B waits (one other live); A parks after its round
    assert b.status is RequestStatus.WAITING
    c = make_request("C", max_tokens=6)
    scheduler.submit(c)  # now B has two others: it must not start a session
    assert tick(scheduler, trace).model_actions == [("classic_prefill", ("C",))]  # alternation
    record = tick(scheduler, trace)
    # B left the ring without a session; parked A moved into the batch with its session,
    # so nothing speculative ran and the tick went classic.
    assert record.model_actions == [("classic_prefill", ("B",))]
    assert a.status is RequestStatus.CLASSIC and ("spec_to_classic", "A") in scheduler.runner.calls
    run_until_idle(scheduler, trace)
    assert b.spec.num_grants == 0 and scheduler.counters.demotions == 1
    assert scheduler.counters.classic_fallbacks["batch_size_at_promotion"] == 1
    assert scheduler.counters.backlog_aborts == 0
    assert all(trace.streams()[r.request_id] == isolated_stream(r) for r in (a, b, c))
    assert scheduler.runner.sessions == {} and scheduler.runner.drafter_holder is None
