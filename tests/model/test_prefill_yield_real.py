"""`prefill_yield_tokens` over a real model (CPU, the packed slab): a long prompt that
comes while rows decode is prefilled in forwards of a few positions, with a decode step
of the earlier rows between two of them whose tokens go out at once. No stream may
differ from what it gives otherwise: greedy streams equal their isolated decode, and
seeded sampled streams equal the same run with the prompt prefilled whole."""

import os
import random

import pytest

from models.batch import slab_batch
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from tests.model.conftest import PROMPTS, isolated_streams, make_request
from tests.model.test_fused_real import BUNDLED, bundled_runner, quiet_costs

pytestmark = pytest.mark.model

MAX_TOKENS = 24
PIECE = 128  # positions a forward while rows wait: the long prompt runs in 5 or more


@pytest.fixture(scope="module")
def runner():
    r = bundled_runner("ngram")
    quiet_costs(r, "ngram")
    yield r
    r.close()


@pytest.fixture(scope="module")
def prompts(runner):
    """Two short prompts, then one of ~600 tokens (every prompt of the list, twice)."""
    long_prompt = []
    while len(long_prompt) < 600:
        long_prompt += runner.tokenizer.encode("\n".join(PROMPTS))
    return [runner.tokenizer.encode(PROMPTS[0]), runner.tokenizer.encode(PROMPTS[8]), long_prompt[:600]]


def run(runner, prompts, sampling=None, **overrides):
    """The two short requests decode; the long one comes during their third decode step
    (every request classic: only a lone one may take the slot). Returns (streams, the
    events in the order they were handed out, scheduler)."""
    config = SchedulerConfig(**{"b1_policy": "on", "speculative_disable_by_batch_size": 1, **overrides})
    scheduler = Scheduler(runner, config)
    handed_out = []
    scheduler.publish = handed_out.extend  # as the Engine does: events out before the tick ends
    requests = [make_request(f"r{i}", p, max_tokens=MAX_TOKENS, **(sampling or {})) for i, p in enumerate(prompts)]
    later = requests[2:]
    real, calls = runner.classic_decode, [0]

    def decode(drafts=False, skip_cap=2, interrupt=None):
        calls[0] += 1
        if calls[0] == 3:
            scheduler.submit(later.pop(0))
        return real(drafts, skip_cap, interrupt)

    runner.classic_decode = decode
    try:
        for r in requests[:2]:
            scheduler.submit(r)
        streams = {r.request_id: [] for r in requests}
        for _ in range(2000):
            handed_out += scheduler.tick()
            if not scheduler.has_work() and not later:
                break
    finally:
        del runner.classic_decode
    for event in handed_out:
        assert event.error is None, event.error
        streams[event.request_id] += event.token_ids
    assert runner.num_classic_rows() == 0 and runner.num_live_sessions() == 0
    assert all(len(s) == MAX_TOKENS or s for s in streams.values())
    return streams, handed_out, scheduler


@pytest.fixture(scope="module")
def isolated(runner, prompts):
    return isolated_streams(runner, prompts, MAX_TOKENS)


@pytest.fixture(params=["packed", "grid"])
def layout(request, runner, monkeypatch):
    """The runner's slab as a CPU lays it out, or as a GPU does (`Slab.grid`: padded
    grids, plain steps pipelined), here on the CPU. A grid's prompt runs in its
    chunks (at most `MAX_PREFILL_CHUNK` positions), whatever `prefill_yield_tokens`
    says: scaled down to `PIECE` to fit the bundled model's context several times."""
    slab = runner._classic.slab
    assert not slab.rows
    slab.grid = request.param == "grid"
    if slab.grid:
        monkeypatch.setattr(slab_batch, "PREFILL_CHUNK", PIECE)
        monkeypatch.setattr(slab_batch, "MAX_PREFILL_CHUNK", PIECE)
    yield request.param
    slab.grid = False


def test_greedy_streams_are_their_isolated_decode(runner, prompts, isolated, layout):
    streams, handed_out, scheduler = run(runner, prompts, prefill_yield_tokens=PIECE)
    yields = scheduler.counters.prefill_yields
    assert yields >= len(prompts[2]) // PIECE - 1  # the rows stepped between the prompt's forwards
    # ... and their tokens went out before the long prompt's first token
    first_long = next(k for k, e in enumerate(handed_out) if e.request_id == "r2" and e.token_ids)
    before = [e for e in handed_out[:first_long] if e.request_id != "r2"]
    assert sum(len(e.token_ids) for e in before) >= yields
    for request_id, tokens in isolated.items():
        assert streams[request_id] == tokens, request_id


def test_seeded_sampled_streams_do_not_depend_on_the_yields(runner, prompts):
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    yielded, _, scheduler = run(runner, prompts, sampling, prefill_yield_tokens=PIECE)
    assert scheduler.counters.prefill_yields > 0
    whole, _, scheduler = run(runner, prompts, sampling, prefill_yield_tokens=0)
    assert scheduler.counters.prefill_yields == 0
    assert yielded["r2"] == whole["r2"]
    # the earlier rows drew the same tokens, in other ticks
    assert yielded == whole


def test_a_row_that_finishes_between_two_forwards_leaves_the_prefill_intact(runner, prompts, isolated, layout):
    """A short row ends (max_tokens) while the long prompt is half in: its slot is freed
    and another row moves into it; the prompt's row keeps its keys and its stream."""
    config = SchedulerConfig(b1_policy="on", speculative_disable_by_batch_size=1, prefill_yield_tokens=PIECE)
    scheduler = Scheduler(runner, config)
    short = make_request("short", prompts[0], max_tokens=3)
    other = make_request("other", prompts[1], max_tokens=MAX_TOKENS)
    long = make_request("long", prompts[2], max_tokens=MAX_TOKENS)
    streams = {"short": [], "other": [], "long": []}
    scheduler.submit(short)
    scheduler.submit(other)
    for event in scheduler.tick():  # both prefilled: one token each
        streams[event.request_id] += event.token_ids
    scheduler.submit(long)
    order = []
    for _ in range(2000):
        for event in scheduler.tick():
            assert event.error is None, event.error
            streams[event.request_id] += event.token_ids
            order.append((event.request_id, bool(event.token_ids), event.finish_reason))
        if not scheduler.has_work():
            break
    assert scheduler.counters.prefill_yields >= 2
    short_done = order.index(("short", True, "length"))
    assert short_done < next(k for k, (rid, tokens, _) in enumerate(order) if rid == "long" and tokens)
    assert streams["short"] == isolated["r0"][:3]
    assert streams["other"] == isolated["r1"]
    assert streams["long"] == isolated["r2"]
    assert runner.num_classic_rows() == 0


def run_overtaking(runner, first, arrivals, before=(), **overrides):
    """`before` are prefilled and decode; then `first` prefills, and each of `arrivals`
    is submitted while one of its forwards runs (before the runner's next call back).
    Returns (streams, handed-out events, scheduler)."""
    config = SchedulerConfig(**{"b1_policy": "off", "prefill_yield_tokens": PIECE, **overrides})
    scheduler = Scheduler(runner, config)
    handed_out = []
    scheduler.publish = handed_out.extend
    pending = list(arrivals)
    real = runner.classic_prefill

    def prefill(requests, between=None, piece=0):
        if between is not None and requests[0] is first:
            inner = between

            def between():
                if pending:
                    scheduler.submit(pending.pop(0))
                inner()

        return real(requests, between, piece)

    runner.classic_prefill = prefill
    try:
        for request in before:
            scheduler.submit(request)
        if before:
            handed_out += scheduler.tick()
        scheduler.submit(first)
        for _ in range(2000):
            handed_out += scheduler.tick()
            if not scheduler.has_work():
                break
    finally:
        del runner.classic_prefill
    assert not pending, "the prompt ran in one forward: nothing arrived during it"
    streams = {}
    for event in handed_out:
        assert event.error is None, event.error
        streams.setdefault(event.request_id, []).extend(event.token_ids)
    assert runner.num_classic_rows() == 0 and runner.num_live_sessions() == 0
    return streams, handed_out, scheduler


def first_out(handed_out, request_id):
    return next(k for k, e in enumerate(handed_out) if e.request_id == request_id and e.token_ids)


def test_a_short_request_overtakes_a_long_prompt_in_flight(runner, prompts, isolated, layout):
    """A row decodes as the long prompt comes, which runs in forwards of `PIECE`
    positions; a short request that comes during the first is prefilled before the
    second, its first token out before the long prompt's, and decodes beside it."""
    long = make_request("r2", prompts[2], max_tokens=MAX_TOKENS)
    short = make_request("r0", prompts[0], max_tokens=MAX_TOKENS)
    row = make_request("r1", prompts[1], max_tokens=MAX_TOKENS)
    streams, handed_out, scheduler = run_overtaking(runner, long, [short], before=[row])
    assert scheduler.counters.prefill_overtakes == 1
    assert scheduler.counters.prefill_yields >= 2  # the rows stepped before the prompt was in
    assert first_out(handed_out, "r0") < first_out(handed_out, "r2")
    for request_id, tokens in isolated.items():
        assert streams[request_id] == tokens, request_id


def test_a_lone_prompt_leaves_arrivals_a_boundary_on_a_cpu(runner, prompts, isolated):
    """No row decodes: on a CPU's packed slab the prompt still runs in forwards of 512
    positions (as fast as one whole forward there), so an arrival need not wait for all
    of it."""
    long = make_request("r2", prompts[2], max_tokens=MAX_TOKENS)
    short = make_request("r0", prompts[0], max_tokens=MAX_TOKENS)
    streams, handed_out, scheduler = run_overtaking(runner, long, [short])
    assert scheduler.counters.prefill_overtakes == 1
    assert first_out(handed_out, "r0") < first_out(handed_out, "r2")
    assert streams["r0"] == isolated["r0"]
    assert streams["r2"] == isolated["r2"]


@pytest.fixture(scope="module")
def cached_runner():
    """The bundled target with a prefix cache (the module's `runner` has none)."""
    from models.runner import MlxRunner

    r = MlxRunner.from_paths(
        os.path.join(BUNDLED, "target"), drafter_kind="ngram", num_draft_tokens=4, prefix_cache_bytes=64 << 20
    )
    quiet_costs(r, "ngram")
    yield r
    r.close()


def test_a_grid_counts_a_prompt_short_up_to_its_shortest_chunk(runner, layout):
    """What may overtake is what fits one forward: `prefill_yield_tokens` positions on a
    packed slab, at least a chunk (`PREFILL_CHUNK`, 512; `PIECE` here) on a grid, whose
    prefill is never split more finely."""
    request = make_request("short", [random.Random(3).randrange(3, 2000) for _ in range(PIECE - 8)])
    assert runner.classic_prefill_fits(request, PIECE - 8)
    assert runner.classic_prefill_fits(request, PIECE - 28) is (layout == "grid")


def test_a_cached_turn_overtakes_a_fresh_prompt(cached_runner, prompts):
    """A long prompt whose prefix is cached (a chat's next turn: the earlier turn's
    prompt and reply, then a few new tokens) computes fewer than `prefill_yield_tokens`
    positions, so it overtakes a fresh long prompt; its stream is the one it gives alone."""
    history = prompts[2][:400][::-1]  # in no other test's prompt: nothing else caches it
    turn_prompt = history + prompts[1]
    fresh_prompt = [random.Random(7).randrange(3, 2000) for _ in range(600)]  # shares no prefix
    runner = cached_runner
    (alone,) = isolated_streams(runner, [turn_prompt], MAX_TOKENS).values()
    warm = Scheduler(runner, SchedulerConfig(b1_policy="off"))
    warm.submit(make_request("warm", history, max_tokens=1))  # the earlier turn, now in the cache
    while warm.has_work():
        warm.tick()
    turn = make_request("turn", turn_prompt, max_tokens=MAX_TOKENS)
    assert runner._classic.prefill_tokens(turn_prompt) <= PIECE < len(turn_prompt)
    assert runner.classic_prefill_fits(turn, PIECE)
    fresh = make_request("fresh", fresh_prompt, max_tokens=MAX_TOKENS)
    streams, handed_out, scheduler = run_overtaking(runner, fresh, [turn])
    assert scheduler.counters.prefill_overtakes == 1
    assert turn.num_cached_tokens >= len(history) - 16  # whole blocks of the history
    assert first_out(handed_out, "turn") < first_out(handed_out, "fresh")
    assert streams["turn"] == alone


def test_the_slot_holder_keeps_its_rounds_through_a_long_prefill(runner, prompts, isolated, layout):
    """A speculative session holds the slot beside a classic row when the long prompt
    comes: between the prompt's forwards the holder's round runs with the row's decode
    step riding in it, both streams' tokens out before the prompt's first; every stream
    is its isolated decode."""
    config = SchedulerConfig(b1_policy="on", prefill_yield_tokens=PIECE, grant_rounds=1000)
    scheduler = Scheduler(runner, config)
    handed_out, inside = [], []  # every event in order; those handed out inside a tick

    def publish(events):
        handed_out.extend(events)
        inside.extend(events)

    scheduler.publish = publish
    holder, row, long = (make_request(f"r{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts))
    scheduler.submit(holder)
    handed_out += scheduler.tick()  # a lone request: the slot's slice 0
    assert scheduler.slot.active is not None and scheduler.slot.active.request is holder
    scheduler.submit(row)
    for _ in range(2):
        handed_out += scheduler.tick()
    rounds = scheduler.counters.spec_rounds
    scheduler.submit(long)
    for _ in range(2000):
        handed_out += scheduler.tick()
        if not scheduler.has_work():
            break
    assert scheduler.counters.prefill_yields >= 2
    first_long = first_out(handed_out, "r2")
    assert scheduler.counters.spec_rounds > rounds
    # inside the prompt's prefill tick, both streams stepped
    assert {e.request_id for e in inside if e.token_ids} == {"r0", "r1"}
    assert handed_out.index(inside[0]) < first_long
    streams = {}
    for event in handed_out:
        assert event.error is None, event.error
        streams.setdefault(event.request_id, []).extend(event.token_ids)
    for request_id, tokens in isolated.items():
        assert streams[request_id] == tokens, request_id
    assert runner.num_classic_rows() == 0 and runner.num_live_sessions() == 0
