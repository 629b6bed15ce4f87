"""Demotion over real tiny models: `MlxRunner.spec_to_classic` moves a live session
into the classic batch (`GeneratorBatch.adopt`, or `SlabBatch.adopt` where the session
is already a row of the batch's slab) without recomputing or redrawing.

Greedy: a demoted stream equals its isolated classic run. Sampled (seeded): the
tokens after the demotion equal a plain classic decode from a copy of the session's
cache and sampler state taken at the demotion. Both with no other row (the adopted
row becomes the lone `SoloRow`) and with rows in the batch.
"""

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from models.batch.solo import SoloRow
from models.runner import MlxRunner
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler

from .conftest import make_request
from .helpers import run_classic

pytestmark = pytest.mark.model

SAMPLED = dict(temperature=0.8, top_p=0.9, seed=5)
PENALIZED = dict(presence_penalty=1.0, repetition_penalty=1.3, logit_bias=((40, 1.0),))


@pytest.fixture(scope="module", params=[True, False], ids=["slab", "batch_generator"])
def runner(tiny_pair, request):
    r = MlxRunner.from_paths(
        tiny_pair[0],
        drafter_kind="draft_model",
        drafter_path=tiny_pair[1],
        num_draft_tokens=3,
        classic_burst_ms=0,
        slab_batch=request.param,
        row_drafts=False,
    )  # rows verifying drafts: tests/model/test_row_drafts.py
    yield r
    r.close()


def lone_row(runner):
    """The request id of `GeneratorBatch`'s lone `SoloRow` (None: none, or a slab batch,
    whose rows are all alike)."""
    solo = getattr(runner._classic, "_solo", None)
    return solo.request_id if isinstance(solo, SoloRow) else None


def isolated(runner, request):
    return run_classic(runner.target.model, [request], runner.eos_token_ids)[request.request_id]


def speculate(runner, request, rounds, park=False):
    """Slice 0 plus `rounds` rounds; the session stays live (parked if asked)."""
    tokens = list(runner.spec_begin(request).token_ids)
    for _ in range(rounds):
        outcome = runner.spec_round(request.request_id)
        assert outcome.finish_reason is None
        tokens += outcome.token_ids
    if park:
        runner.spec_park(request.request_id)
    return tokens


def drain(runner, out, reasons, batches):
    for b in batches:
        out.setdefault(b.request_id, []).extend(b.token_ids)
        if b.finish_reason:
            reasons[b.request_id] = b.finish_reason
            runner.classic_remove(b.request_id)


def decode_all(runner, out, reasons, ids):
    for _ in range(500):
        if set(ids) <= set(reasons):
            return
        drain(runner, out, reasons, runner.classic_decode())
    raise AssertionError("rows did not finish")


def reference_after(runner, session, max_steps):
    """A plain classic decode from copies of the session's cache and sampler: feed the
    pending token, sample, repeat (what a classic row with that state produces)."""
    cache = []
    for c in session.cache:
        fresh = KVCache()
        fresh.state = (c.keys[..., : c.offset, :] * 1, c.values[..., : c.offset, :] * 1, c.offset)
        cache.append(fresh)
    mx.eval([c.state for c in cache])
    sampler = copy.copy(session.sampler)
    token, tokens = session.history[-1], []
    stop = set(session.stop_ids)
    for _ in range(max_steps):
        logits = runner.target.model(mx.array([[token]]), cache=cache)[:, -1, :]
        token = sampler.next_token(logits).item()
        tokens.append(token)
        if token in stop:
            break
    return tokens


@pytest.mark.parametrize("knobs", [{}, PENALIZED], ids=["plain", "penalized"])
@pytest.mark.parametrize("others", [0, 1, 2], ids=["alone", "lone_row", "batch"])
@pytest.mark.parametrize("park", [False, True], ids=["active", "parked"])
def test_greedy_demoted_stream_equals_isolated_classic(runner, prompt_ids, others, park, knobs):
    a = make_request("a", prompt_ids[0], 40, **knobs)
    rows = [make_request(f"r{i}", prompt_ids[5 + i], 30) for i in range(others)]
    out, reasons = {}, {}
    for r in rows:  # one at a time: two rows end up in BatchGenerator, one stays a SoloRow
        drain(runner, out, reasons, runner.classic_prefill([r]))
    out["a"] = speculate(runner, a, rounds=3, park=park)
    moved = runner.spec_to_classic("a")
    # BatchGenerator: the lone row moved into the batch and emitted its pending token
    # on the way; the slab batch moves nothing.
    assert [b.request_id for b in moved] == (["r0"] if others == 1 and not runner._classic.shares_slab else [])
    drain(runner, out, reasons, moved)
    assert (lone_row(runner) == "a") is (others == 0 and not runner._classic.shares_slab)
    assert runner.num_live_sessions() == 0 and runner._slot.holder is None
    decode_all(runner, out, reasons, ["a", *out])
    assert (out["a"], reasons["a"]) == isolated(runner, a)
    for r in rows:
        assert (out[r.request_id], reasons[r.request_id]) == isolated(runner, r)
    assert runner.num_classic_rows() == 0


@pytest.mark.parametrize("knobs", [{}, PENALIZED], ids=["plain", "penalized"])
@pytest.mark.parametrize("others", [0, 2], ids=["alone", "batch"])
def test_sampled_tokens_after_demotion_are_not_redrawn(runner, prompt_ids, others, knobs):
    a = make_request("a", prompt_ids[3], 36, **SAMPLED, **knobs)
    rows = [make_request(f"r{i}", prompt_ids[9 + i], 24, **SAMPLED) for i in range(others)]
    out, reasons = {}, {}
    for r in rows:
        drain(runner, out, reasons, runner.classic_prefill([r]))
    before = speculate(runner, a, rounds=3)
    session = runner.session("a")
    expected = reference_after(runner, session, a.sampling.max_tokens - session.num_emitted)
    drain(runner, out, reasons, runner.spec_to_classic("a"))
    assert (lone_row(runner) == "a") is (others == 0 and not runner._classic.shares_slab)
    decode_all(runner, out, reasons, ["a", *[r.request_id for r in rows]])
    assert out["a"] == expected and len(before) + len(expected) == 36
    for r in rows:  # the rows beside it are untouched
        assert (out[r.request_id], reasons[r.request_id]) == isolated(runner, r)


def test_cancel_after_demotion_frees_the_row_and_the_slot(runner, prompt_ids):
    a, b = make_request("a", prompt_ids[1], 40), make_request("b", prompt_ids[2], 20)
    out, reasons = {}, {}
    speculate(runner, a, rounds=2)
    runner.spec_to_classic("a")
    drain(runner, out, reasons, runner.classic_prefill([b]))  # a (solo) moves into the batch
    drain(runner, out, reasons, runner.classic_decode())
    runner.classic_remove("a")  # the cancellation
    assert runner.num_classic_rows() == 1
    decode_all(runner, out, reasons, ["b"])
    assert (out["b"], reasons["b"]) == isolated(runner, b) and "a" not in reasons
    c = make_request("c", prompt_ids[4], 12)  # the drafter is free again
    tokens = speculate(runner, c, rounds=1)
    runner.spec_finish("c")
    assert tokens and runner.num_live_sessions() == 0 and runner.num_classic_rows() == 0


def test_spec_to_classic_rejects_unknown_and_finished(runner, prompt_ids):
    with pytest.raises(KeyError):
        runner.spec_to_classic("nobody")
    a = make_request("a", prompt_ids[2], 1)
    assert runner.spec_begin(a).finish_reason == "length"
    with pytest.raises(RuntimeError, match="not running"):
        runner.spec_to_classic("a")
    runner.spec_finish("a")


def test_scheduler_demotes_the_lone_speculator_when_a_second_request_comes(runner, prompt_ids):
    """Engine path at knob 1: A speculates alone, B arrives and goes classic, A moves
    into the batch at its next boundary; both greedy streams are the isolated ones."""
    scheduler = Scheduler(runner, SchedulerConfig(b1_policy="on", speculative_disable_by_batch_size=1))
    a, b = make_request("A", prompt_ids[0], 40), make_request("B", prompt_ids[8], 30)
    streams = {"A": [], "B": []}
    scheduler.submit(a)
    for i in range(300):
        for event in scheduler.tick():
            streams[event.request_id] += event.token_ids
        if i == 2:
            scheduler.submit(b)
        if not scheduler.has_work():
            break
    assert scheduler.counters.demotions == 1 and a.spec.num_rounds >= 1
    assert scheduler.counters.spec_rounds == a.spec.num_rounds  # no round after the demotion
    assert streams["A"] == isolated(runner, a)[0] and streams["B"] == isolated(runner, b)[0]
    assert runner.num_live_sessions() == 0 and runner.num_classic_rows() == 0


@pytest.mark.parametrize("others", [0, 2], ids=["alone", "batch"])
def test_demotion_from_the_bucketed_path(tiny_pair, prompt_ids, others):
    """The GPU path's session caches (bucket-sized KV buffers, offset below capacity)
    move into the classic batch just as well (float32 on CPU: streams stay exact)."""
    fast = MlxRunner.from_paths(
        tiny_pair[0],
        drafter_kind="draft_model",
        drafter_path=tiny_pair[1],
        num_draft_tokens=3,
        classic_burst_ms=0,
        fast_verify=True,
        warm_positions=0,
    )
    try:
        a = make_request("a", prompt_ids[4], 40)
        rows = [make_request(f"r{i}", prompt_ids[12 + i], 24) for i in range(others)]
        out, reasons = {}, {}
        for r in rows:
            drain(fast, out, reasons, fast.classic_prefill([r]))
        out["a"] = speculate(fast, a, rounds=3)
        session = fast.session("a")
        assert session.cache[0].keys.shape[2] > session.cache[0].offset  # a bucketed buffer
        drain(fast, out, reasons, fast.spec_to_classic("a"))
        decode_all(fast, out, reasons, ["a", *[r.request_id for r in rows]])
        assert (out["a"], reasons["a"]) == isolated(fast, a)
        for r in rows:
            assert (out[r.request_id], reasons[r.request_id]) == isolated(fast, r)
    finally:
        fast.close()
