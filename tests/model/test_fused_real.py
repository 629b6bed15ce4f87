"""The fused tick over real mlx models (CPU): the slot holder's verify rides in the
classic batch's forward. Every greedy stream must equal its isolated classic decode,
whatever rotates, parks, demotes or is cancelled around it, and classic rows must
advance in the ticks where the slot verifies."""

import os

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from tests.model.conftest import PROMPTS, make_request

pytestmark = pytest.mark.model

BUNDLED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled")
MAX_TOKENS = 40


def bundled_runner(kind):
    """An `MlxRunner` over the bundled pair, drafting with `kind` (None: no drafter)."""
    from models.runner import MlxRunner

    target, draft = os.path.join(BUNDLED, "target"), os.path.join(BUNDLED, "draft")
    return MlxRunner.from_paths(
        target, drafter_kind=kind, drafter_path=draft if kind == "draft_model" else None, num_draft_tokens=4
    )


# Forward costs (seconds) of the order a 2-core CPU measures for the bundled pair, under
# which drafts pay; fixed so that which rows draft does not depend on how loaded the
# machine was when the runner measured its own (the tests here check streams, not costs).
QUIET_COSTS = dict(
    decode={1: 0.0100, 2: 0.0110, 4: 0.0130, 8: 0.0170},
    fused={0: 0.0140, 2: 0.0150, 4: 0.0170, 8: 0.0210},
    all_verify={2: 0.0160, 4: 0.0220, 8: 0.0330},
)


def quiet_costs(runner, kind: str):
    """Give `runner` (drafting with `kind`) the fixed `QUIET_COSTS` instead of its own."""
    from scheduler.costs import TickCosts

    costs = TickCosts(draft=0.0055 if kind == "draft_model" else 0.0, **QUIET_COSTS)
    runner._tick_costs = costs
    runner._classic.costs = costs
    runner._classic.price_by_steps = False  # the steps' times would move the prices


@pytest.fixture(scope="module", params=["draft_model", "ngram"])
def runner(request):
    r = bundled_runner(request.param)
    assert r.can_fuse(), r.fuse_blocker
    quiet_costs(r, request.param)
    yield r
    r.close()


@pytest.fixture(scope="module")
def prompts(runner):
    return [runner.tokenizer.encode(PROMPTS[i]) for i in (0, 8, 21, 3)]


def drive(runner, prompts, *, cancel_at=None, sampling=None, max_tokens=MAX_TOKENS, logprobs=None, **overrides):
    """All requests submitted at once (`sampling`: their SamplingParams fields); returns
    (streams, requests, scheduler, ticks in which a fused round advanced classic rows).
    `logprobs`: a dict that collects each request's reported logprobs."""
    config = SchedulerConfig(**{"b1_policy": "on", **overrides})
    scheduler = Scheduler(runner, config)
    requests = [make_request(f"r{i}", p, max_tokens=max_tokens, **(sampling or {})) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.submit(r)
    streams = {r.request_id: [] for r in requests}
    fused_with_rows = 0
    for i in range(3000):
        if cancel_at is not None and i == cancel_at[1]:
            scheduler.cancel(cancel_at[0])
        before = scheduler.counters.actions["fused"]
        events = scheduler.tick()
        if scheduler.counters.actions["fused"] > before:
            spec_ids = {e.request_id for e in events} & {r.request_id for r in requests if r.spec.num_rounds}
            if len({e.request_id for e in events} - spec_ids) > 0:
                fused_with_rows += 1
        for event in events:
            streams[event.request_id] += event.token_ids
            if logprobs is not None and event.logprobs:
                logprobs.setdefault(event.request_id, []).extend(event.logprobs)
        if not scheduler.has_work():
            break
    assert not scheduler.has_work()
    assert runner.num_live_sessions() == 0 and runner.num_classic_rows() == 0
    return streams, requests, scheduler, fused_with_rows


@pytest.fixture(scope="module")
def isolated(runner, prompts):
    """Each prompt alone, classic only (B=1 policy off): the reference streams."""
    out = {}
    for i, p in enumerate(prompts):
        streams, _, _, _ = drive(runner, [p], b1_policy="off")
        out[f"r{i}"] = streams["r0"]
    return out


@pytest.mark.parametrize("grant_rounds", [1, 2, 8])
def test_four_concurrent_streams_match_isolated_classic_decode(runner, prompts, isolated, grant_rounds):
    streams, requests, scheduler, fused_with_rows = drive(runner, prompts, grant_rounds=grant_rounds)
    for r in requests:
        assert streams[r.request_id] == isolated[r.request_id], r.request_id
    speculated = [r for r in requests if r.spec.num_rounds > 0]
    assert len(speculated) >= 2, [r.spec for r in requests]  # rotation engaged under load
    assert fused_with_rows > 0, "no tick carried classic rows and a verify together"
    counters = scheduler.counters
    assert counters.actions["fused"] > 0
    assert counters.backlog_peak <= 3


@pytest.mark.parametrize("grant_rounds", [1, 8])
def test_grid_forwards_give_the_same_streams(runner, prompts, isolated, grant_rounds):
    """The GPU's way of running a slab forward (`Slab.grid`: rows padded to the widest,
    gap rows as padding, one masked attention call), forced on the CPU: rotation,
    parks and rows' drafts change nothing in any stream."""
    store = runner._classic.slab
    store.grid = True
    try:
        streams, requests, scheduler, fused_with_rows = drive(runner, prompts, grant_rounds=grant_rounds)
    finally:
        store.grid = False
    for r in requests:
        assert streams[r.request_id] == isolated[r.request_id], r.request_id
    assert fused_with_rows > 0 and sum(r.spec.num_rounds > 0 for r in requests) >= 2


def test_the_snapshot_counts_the_batchs_steps_and_those_a_queued_step_drew(runner, prompts):
    """`classic_steps` in the scheduler's snapshot: every decode step of the batch, and
    the pipelined ones, which a grid slab's plain steps are (sampled rows that do not
    draft, the slot off) and a packed slab's never are."""
    sampled, store = runner.sampled_row_drafts, runner._classic.slab
    runner.sampled_row_drafts = False
    counts = {}
    try:
        for grid in (False, True):
            store.grid = grid
            before = runner.classic_step_stats()
            _, _, scheduler, _ = drive(runner, prompts, b1_policy="off", sampling={"temperature": 0.7, "seed": 3})
            after = scheduler.snapshot()["classic_steps"]
            counts[grid] = {k: after[k] - before[k] for k in ("steps", "pipelined")}
            assert counts[grid]["steps"] >= scheduler.counters.actions["decode"] > 0
    finally:
        store.grid, runner.sampled_row_drafts = False, sampled
    assert counts[False]["pipelined"] == 0
    assert 0 < counts[True]["pipelined"] < counts[True]["steps"]  # the first step after a prefill is not


def test_alternate_mode_gives_the_same_streams(runner, prompts, isolated):
    streams, requests, scheduler, _ = drive(runner, prompts, grant_rounds=2, tick_mode="alternate")
    assert scheduler.counters.actions["fused"] == 0
    for r in requests:
        assert streams[r.request_id] == isolated[r.request_id]


def test_demotion_and_cancellation_inside_fused_ticks(runner, prompts, isolated):
    streams, requests, scheduler, _ = drive(
        runner, prompts, grant_rounds=2, speculative_disable_by_batch_size=3, cancel_at=("r1", 12)
    )
    for r in requests:
        if r.request_id == "r1":
            assert streams["r1"] == isolated["r1"][: len(streams["r1"])]
        else:
            assert streams[r.request_id] == isolated[r.request_id], r.request_id


def test_the_cost_gate_moves_streams_between_slot_and_batch_exactly(runner, prompts, isolated):
    """b1_policy auto: the measured tick costs decide, per tick, who speculates."""
    costs = runner.tick_costs()
    assert costs is not None and costs.fused[0] > 0 and set(costs.decode) >= {1, 2}
    streams, requests, scheduler, _ = drive(runner, prompts, grant_rounds=2, b1_policy="auto")
    for r in requests:
        assert streams[r.request_id] == isolated[r.request_id], r.request_id
    assert scheduler.snapshot()["slot"]["tick_costs"] is not None


PENALIZED = dict(presence_penalty=-0.5, frequency_penalty=0.1, repetition_penalty=0.9, logit_bias=((13, 1.5),))


def test_penalized_streams_match_isolated_classic_decode(runner, prompts, isolated):
    """Logit processors read the stream's tokens, which move with it between the slot,
    the ring, the batch and rows that draft: every stream still equals its isolated
    classic decode."""
    alone = {f"r{i}": drive(runner, [p], b1_policy="off", sampling=PENALIZED)[0]["r0"] for i, p in enumerate(prompts)}
    assert alone != isolated  # the processors change the streams
    for overrides in (dict(grant_rounds=2), dict(grant_rounds=1, speculative_disable_by_batch_size=3)):
        streams, requests, scheduler, _ = drive(runner, prompts, sampling=PENALIZED, **overrides)
        assert streams == alone, overrides
        assert sum(r.spec.num_rounds > 0 for r in requests) >= 2 and sum(r.spec.num_accepted for r in requests) > 0


SAMPLED = dict(temperature=0.8, top_p=0.95, presence_penalty=0.3, seed=5)


def test_a_sampled_round_is_the_same_fused_or_alone(runner, prompts):
    """At temperature > 0 the fused tick's round (the verify riding in the classic
    batch's forward) decides acceptance by the same rule as a round alone (rejection
    sampling for the draft model, equality for n-gram), from the same seeded draws: the
    holder's stream and per-round acceptance are the same, and drafts are accepted."""

    def holder_rounds(fused):
        if fused:
            runner.classic_prefill([make_request("row", prompts[1], max_tokens=200)])
        tokens = list(runner.spec_begin(make_request("a", prompts[0], MAX_TOKENS, **SAMPLED)).token_ids)
        rounds = []
        while True:
            outcome = runner.spec_round_with_decode("a")[0] if fused else runner.spec_round("a")
            tokens += outcome.token_ids
            rounds.append((outcome.num_drafted, outcome.num_accepted))
            if outcome.finish_reason is not None:
                break
        runner.spec_finish("a")
        if fused:
            runner.classic_remove("row")
        return tokens, rounds

    alone, fused = holder_rounds(False), holder_rounds(True)
    assert fused == alone
    assert sum(a for _, a in alone[1]) > 0
