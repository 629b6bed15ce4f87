"""The Serve request router over fake replicas: the session key, probing, fallback."""

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from serve_app.affinity import preferred_replica

pytest.importorskip("ray.serve.request_router")

from ray.serve._private.request_router.common import ReplicaQueueLengthCache  # noqa: E402

from serve_app.router import PrefixAffinityRouter, affinity_key  # noqa: E402


@dataclass(frozen=True)
class FakeReplicaId:
    unique_id: str


class FakeReplica:
    def __init__(self, name, queue_len):
        self.replica_id = FakeReplicaId(name)
        self.queue_len = queue_len
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
    return SimpleNamespace(metadata=SimpleNamespace(session_id=session_id),
                           routing_context=SimpleNamespace(should_backoff=False))


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
