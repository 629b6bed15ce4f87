"""Scenario 7's workload through the replica choice, simulated: conversations resend
their history every turn, `concurrency` at a time; a request's service time grows with
its prompt and with its replica's queue. Two criteria, as the benchmark states them:
at least 95 % of turns after the first land on the replica that served the previous
turn (where the prefix is), and the replicas' request counts stay within 30 % of each
other (the smallest at least 70 % of the largest)."""

import heapq
import random

import pytest

from serve_app.deployment.affinity import SessionPins, preferred_replica, rank_replicas


def simulate(replica_ids, num_conversations, num_turns, concurrency, run_id, load_margin=4, use_pins=True, seed=0):
    """One record (conversation, turn, replica) per request, in send order."""
    rng = random.Random(seed)
    pins = SessionPins()
    queue_lens = {rid: 0 for rid in replica_ids}
    waiting = list(range(num_conversations))
    finishing = []  # (time, seq, conversation, turn, replica)
    records, seq = [], 0

    def send(now, conversation, turn):
        nonlocal seq
        key = f"{run_id}-{conversation}"
        if use_pins:
            replica = rank_replicas(key, queue_lens, load_margin, pins.get(key), pins.counts(replica_ids))[0]
            pins.pin(key, replica)
        else:  # the key's hash alone, as a router without pins would place it
            replica = preferred_replica(key, replica_ids)
        queue_lens[replica] += 1
        records.append((conversation, turn, replica))
        service = (1.0 + 0.1 * turn) * queue_lens[replica] * rng.uniform(0.7, 1.3)
        heapq.heappush(finishing, (now + service, seq, conversation, turn, replica))
        seq += 1

    for _ in range(concurrency):
        if waiting:
            send(0.0, waiting.pop(0), 1)
    while finishing:
        now, _, conversation, turn, replica = heapq.heappop(finishing)
        queue_lens[replica] -= 1
        if turn < num_turns:
            send(now, conversation, turn + 1)
        elif waiting:
            send(now, waiting.pop(0), 1)
    return records


def affinity_share(records):
    last = {}
    kept = later = 0
    for conversation, turn, replica in records:
        if turn > 1:
            later += 1
            kept += last[conversation] == replica
        last[conversation] = replica
    return kept / later


def requests_per_replica(records, replica_ids):
    counts = {rid: 0 for rid in replica_ids}
    for _, _, replica in records:
        counts[replica] += 1
    return counts


def balanced(counts):
    return min(counts.values()) >= 0.7 * max(counts.values())


# Serve's replica ids are random strings; these stand in for them.
TWO = ["SpecslotServer#kqzv1", "SpecslotServer#m2pta"]
THREE = [*TWO, "SpecslotServer#x9hcd"]


@pytest.mark.parametrize(
    "replica_ids, num_conversations, concurrency",
    [
        (TWO, 8, 4),  # scenario 7 with --replicas 2
        (TWO, 8, 2),
        (TWO, 16, 4),
        (THREE, 6, 3),
        (THREE, 12, 4),
    ],
)
@pytest.mark.parametrize("run_id", [f"rep{i}" for i in range(20)])
def test_conversations_keep_their_replica_and_replicas_share_the_load(
    replica_ids, num_conversations, concurrency, run_id
):
    records = simulate(replica_ids, num_conversations, 6, concurrency, run_id)
    assert affinity_share(records) >= 0.95
    counts = requests_per_replica(records, replica_ids)
    assert balanced(counts), counts


@pytest.mark.parametrize("run_id", [f"rep{i}" for i in range(20)])
def test_five_conversations_on_three_replicas_split_as_evenly_as_whole_conversations_can(run_id):
    """30 requests in conversations of 6: with every turn kept, 12 / 12 / 6 is the best
    split (within 30 % would need a conversation cut in two, losing its prefix)."""
    records = simulate(THREE, 5, 6, 4, run_id)
    assert affinity_share(records) >= 0.95
    assert sorted(requests_per_replica(records, THREE).values()) == [6, 12, 12]


def test_hashing_alone_leaves_some_runs_unbalanced():
    """Why new conversations are placed by pin count: by their hash alone, 8 keys often
    split 6 / 2 or worse (the last measured benchmark run split 7 / 1)."""
    runs = [simulate(TWO, 8, 6, 4, f"rep{i}", use_pins=False) for i in range(20)]
    assert any(not balanced(requests_per_replica(records, TWO)) for records in runs)


def test_an_overloaded_replica_moves_a_conversation_and_it_stays_moved():
    """A replica busy with other work (a queue 6 longer than the other's, margin 4): the
    conversation pinned there moves once and then keeps its new replica."""
    pins = SessionPins()
    pins.pin("conv", TWO[0])
    moved = []
    for busy in [6, 6, 0, 0]:
        queue_lens = {TWO[0]: busy, TWO[1]: 0}
        replica = rank_replicas("conv", queue_lens, 4, pins.get("conv"), pins.counts(TWO))[0]
        pins.pin("conv", replica)
        moved.append(replica)
    assert moved == [TWO[1]] * 4
