"""The Serve request router over fake replicas: the session key, probing, fallback."""

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from serve_app.deployment.affinity import preferred_replica
from serve_app.deployment.served_keys import ServedKeys

pytest.importorskip("ray.serve.request_router")

from ray.serve._private.request_router.common import ReplicaQueueLengthCache  # noqa: E402

from serve_app.deployment.router import PrefixAffinityRouter, affinity_key  # noqa: E402


@dataclass(frozen=True)
class FakeReplicaId:
    unique_id: str


class FakeReplica:
    def __init__(self, name, queue_len, routing_stats=None):
        self.replica_id = FakeReplicaId(name)
        self.queue_len = queue_len
        self.routing_stats = routing_stats or {}  # Serve's default before any report
        self.num_probes = 0

    async def get_queue_len(self, *, deadline_s):
        self.num_probes += 1
        if self.queue_len is None:
            await asyncio.sleep(10 * deadline_s)  # never answers in time
        return self.queue_len


def make_router(load_margin=4, max_pins=4096):
    router = PrefixAffinityRouter.__new__(PrefixAffinityRouter)  # no Serve controller here
    router._replica_queue_len_cache = ReplicaQueueLengthCache()
    router.initialize_state(load_margin=load_margin, max_pins=max_pins)
    return router


def request(session_id=""):
    return SimpleNamespace(
        metadata=SimpleNamespace(session_id=session_id), routing_context=SimpleNamespace(should_backoff=False)
    )


def choose(router, replicas, pending):
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def sessions_preferring(name, names, count=1):
    """Session ids that all hash to replica `name`."""
    found = (s for s in (f"s{i}" for i in range(10_000)) if preferred_replica(s, names) == name)
    return [next(found) for _ in range(count)]


def test_affinity_key_is_the_session_id():
    assert affinity_key(request("conv-1")) == "conv-1"
    assert affinity_key(request("")) is None
    assert affinity_key(None) is None


def test_a_session_goes_to_its_replica_then_the_rest_by_load():
    replicas = [FakeReplica("a", 1), FakeReplica("b", 0), FakeReplica("c", 2)]
    router = make_router()
    router.pins.pin("conv", "c")
    assert choose(router, replicas, request("conv")) == [["c"], ["b"], ["a"]]


def test_new_sessions_spread_over_replicas_and_stay():
    replicas = [FakeReplica("a", 0), FakeReplica("b", 0)]
    router = make_router()
    sessions = sessions_preferring("a", ["a", "b"], count=4)
    firsts = [choose(router, replicas, request(s))[0][0] for s in sessions]
    assert sorted(firsts) == ["a", "a", "b", "b"]  # by pin count, whatever the hashes say
    assert [choose(router, replicas, request(s))[0][0] for s in sessions] == firsts


def test_concurrent_new_sessions_see_each_others_pins():
    replicas = [FakeReplica("a", 0), FakeReplica("b", 0)]
    router = make_router()

    async def both():
        return await asyncio.gather(*(router.choose_replicas(replicas, request(s)) for s in ["s1", "s2"]))

    ranks = asyncio.run(both())
    assert {ranks[0][0][0].replica_id.unique_id, ranks[1][0][0].replica_id.unique_id} == {"a", "b"}


def test_an_overloaded_replica_gives_way_to_the_least_loaded():
    for margin, expected in [(4, "b"), (6, "a")]:
        router = make_router(load_margin=margin)
        router.pins.pin("conv", "a")
        assert choose(router, [FakeReplica("a", 9), FakeReplica("b", 3)], request("conv"))[0] == [expected]
        assert router.pins.get("conv") == expected  # a moved session stays where it went


def test_pins_are_bounded():
    router = make_router(max_pins=2)
    replicas = [FakeReplica("a", 0), FakeReplica("b", 0)]
    for s in ["s1", "s2", "s3"]:
        choose(router, replicas, request(s))
    assert len(router.pins) == 2 and router.pins.get("s1") is None


def test_fresh_cached_queue_lengths_are_not_probed():
    router = make_router()
    replicas = [FakeReplica("a", 0), FakeReplica("b", 0)]
    router.replica_queue_len_cache.update(replicas[0].replica_id, 7)
    router.pins.pin("conv", "a")
    assert choose(router, replicas, request("conv"))[0] == ["b"]  # 7 - 0 > 4, from the cache
    assert (replicas[0].num_probes, replicas[1].num_probes) == (0, 1)


def test_a_replica_that_does_not_answer_counts_as_idle():
    replicas = [FakeReplica("a", None), FakeReplica("b", 2)]
    assert choose(make_router(), replicas, request("new"))[0] == ["a"]  # 0 < 2: the shorter queue


def test_without_a_session_two_random_replicas_share_one_rank():
    replicas = [FakeReplica(name, 0) for name in "abcd"]
    ranks = choose(make_router(), replicas, request(""))
    assert len(ranks) == 1 and len(ranks[0]) == 2 and len(set(ranks[0])) == 2
    assert all(r.num_probes == 0 for r in replicas)  # Serve's own selection probes


def test_every_pass_backs_off():
    pending = request("s")
    choose(make_router(), [FakeReplica("a", 0)], pending)
    assert pending.routing_context.should_backoff is True


def test_no_candidates_no_ranks():
    assert choose(make_router(), [], request("s")) == []


def test_bad_load_margin_is_rejected():
    with pytest.raises(ValueError):
        make_router(load_margin=-1)


# -- several routers share what the replicas report ------------------------------------


def report_of(keys, now=100.0):
    """A replica's routing stats after serving `keys` (one a second up to `now`)."""
    served = ServedKeys()
    for i, key in enumerate(keys):
        served.record(key, now - len(keys) + i)
    return served.report(now)


def test_a_key_placed_by_another_router_goes_where_that_router_sent_it():
    replicas = [FakeReplica("a", 0, report_of(["x"])), FakeReplica("b", 0, report_of(["conv", "y", "z"]))]
    router = make_router()
    assert choose(router, replicas, request("conv"))[0] == ["b"]  # b has more sessions, and the prefix
    assert router.pins.get("conv") == "b"


def test_a_reported_key_still_obeys_the_load_bound():
    replicas = [FakeReplica("a", 3), FakeReplica("b", 9, report_of(["conv"]))]
    router = make_router()
    assert choose(router, replicas, request("conv"))[0] == ["a"]
    assert router.pins.get("conv") == "a"


def test_a_later_report_elsewhere_moves_this_routers_pin():
    """Two routers placed one conversation on two replicas before either heard of the
    other's placement; once reported, both follow the replica that served it last."""
    router = make_router()
    router.pins.pin("conv", "a", now=50.0)
    replicas = [FakeReplica("a", 0, report_of(["conv"], now=50.5)), FakeReplica("b", 0, report_of(["conv"], now=60.0))]
    assert choose(router, replicas, request("conv"))[0] == ["b"]
    # Sent to b just now: b's report (taken before) no longer outranks the new pin.
    assert choose(router, replicas, request("conv"))[0] == ["b"]


def test_new_keys_are_placed_by_reported_sessions():
    replicas = [FakeReplica("a", 0, report_of(["x", "y", "z"])), FakeReplica("b", 0, report_of(["w"]))]
    router = make_router()
    firsts = [choose(router, replicas, request(s))[0][0] for s in ["s1", "s2", "s3", "s4"]]
    assert firsts[:2] == ["b", "b"]  # 3 vs 1, then 3 vs 2 (this router's placement since b's report)
    assert sorted(firsts[2:]) == ["a", "b"]  # 3 vs 3: they alternate


def test_two_routers_that_see_the_same_reports_place_alike():
    replicas = [FakeReplica("a", 0, report_of(["x", "y"])), FakeReplica("b", 0, report_of(["w"]))]
    keys = [f"s{i}" for i in range(6)]
    placed = [[choose(make_router(), replicas, request(k))[0][0] for k in keys] for _ in range(2)]
    assert placed[0] == placed[1]


def test_a_report_taken_after_a_placement_counts_it_once():
    router = make_router()
    replicas = [FakeReplica("a", 0, report_of(["x", "y", "z"], now=1.0)), FakeReplica("b", 0, report_of([], now=1.0))]
    assert [choose(router, replicas, request(k))[0][0] for k in ["new1", "new2"]] == ["b", "b"]
    replicas[1].routing_stats = report_of(["new1", "new2"], now=time.time() + 1)
    # b holds 2 sessions, not 2 reported + 2 placed here: the next new key still goes to b.
    assert choose(router, replicas, request("other"))[0][0] == "b"


def test_a_report_taken_while_a_placement_is_on_its_way_still_counts_it():
    router = make_router()
    replicas = [FakeReplica("a", 0, report_of(["x"], now=1.0)), FakeReplica("b", 0, report_of([], now=1.0))]
    assert choose(router, replicas, request("new"))[0][0] == "b"
    replicas[1].routing_stats = report_of([], now=time.time() + 0.5)  # taken before "new" arrived
    # b holds 1 session (on its way), a holds 1: a tie, which the key's hash breaks.
    (other,) = sessions_preferring("a", ["a", "b"])
    assert choose(router, replicas, request(other))[0][0] == "a"
