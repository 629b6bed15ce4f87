"""`interrupt_decode` over a real model (CPU, the packed slab): requests that arrive while
a decode step runs stop it between two layers, are prefilled, and the stopped step runs
again. No stream may differ from what it gives when nothing is stopped: greedy streams
equal their isolated decode, and seeded sampled streams equal the same run with
`interrupt_decode` off."""

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from tests.model.conftest import PROMPTS, isolated_streams, make_request
from tests.model.test_fused_real import bundled_runner, quiet_costs

pytestmark = pytest.mark.model

MAX_TOKENS = 24
ARRIVE_AT = {2: 1, 5: 1}  # decode call -> how many of the later requests arrive during it


@pytest.fixture(scope="module")
def runner():
    r = bundled_runner("ngram")
    quiet_costs(r, "ngram")
    yield r
    r.close()


@pytest.fixture(scope="module")
def prompts(runner):
    return [runner.tokenizer.encode(PROMPTS[i]) for i in (0, 8, 21, 3)]


def run(runner, prompts, sampling=None, **overrides):
    """Two requests from the start, the other two submitted while decode steps run
    (`ARRIVE_AT`); every request classic (only a lone one may take the slot), rows drafting.
    Returns (streams, scheduler)."""
    config = SchedulerConfig(**{"b1_policy": "on", "speculative_disable_by_batch_size": 1, **overrides})
    scheduler = Scheduler(runner, config)
    requests = [make_request(f"r{i}", p, max_tokens=MAX_TOKENS, **(sampling or {})) for i, p in enumerate(prompts)]
    later = requests[2:]
    real, calls = runner.classic_decode, [0]

    def decode(drafts=False, skip_cap=2, interrupt=None):
        calls[0] += 1
        for _ in range(ARRIVE_AT.get(calls[0], 0)):
            scheduler.submit(later.pop(0))
        return real(drafts, skip_cap, interrupt)

    runner.classic_decode = decode
    try:
        for r in requests[:2]:
            scheduler.submit(r)
        streams = {r.request_id: [] for r in requests}
        for _ in range(2000):
            for event in scheduler.tick():
                assert event.error is None, event.error
                streams[event.request_id] += event.token_ids
            if not scheduler.has_work() and not later:
                break
    finally:
        del runner.classic_decode
    assert runner.num_classic_rows() == 0 and runner.num_live_sessions() == 0
    assert all(len(s) == MAX_TOKENS or s for s in streams.values())
    return streams, scheduler


@pytest.fixture(scope="module")
def isolated(runner, prompts):
    return isolated_streams(runner, prompts, MAX_TOKENS)


def test_greedy_streams_are_their_isolated_decode(runner, prompts, isolated):
    drafted_before = runner._classic.num_steps
    streams, scheduler = run(runner, prompts)
    assert scheduler.counters.decode_interrupts == 2  # each arrival stopped the step it came in
    assert scheduler.counters.row_rounds > 0 and runner._classic.num_steps > drafted_before  # rows drafted
    for request_id, tokens in isolated.items():
        assert streams[request_id] == tokens, request_id


def test_seeded_sampled_streams_do_not_depend_on_stopped_steps(runner, prompts):
    sampling = {"temperature": 0.8, "top_p": 0.95, "seed": 11}
    stopped_streams, scheduler = run(runner, prompts, sampling)
    assert scheduler.counters.decode_interrupts == 2
    whole_streams, scheduler = run(runner, prompts, sampling, interrupt_decode=False)
    assert scheduler.counters.decode_interrupts == 0
    assert stopped_streams == whole_streams


def test_an_interrupted_forward_leaves_every_row_as_it_was(runner, prompts):
    """The batch itself: a step stopped at its first checkpoint changes no row's length,
    pending token or draft budget, and the step run next gives what it would have."""
    from models.forward.slab_forward import interrupt_every
    from scheduler.model_api import Interrupted

    batch = runner._classic
    requests = [make_request(f"x{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts[:3])]
    try:
        batch.prefill(requests)
        for _ in range(3):
            batch.decode(drafts=True)
        streams = list(batch._streams.values())
        before = [(s.row.length, s.pending, s.denied, s.num_emitted) for s in streams]
        asked = []
        with pytest.raises(Interrupted):
            batch.decode(drafts=True, interrupt=lambda: asked.append(1) or True)
        assert asked == [1]  # asked once, and the step stopped there
        assert [(s.row.length, s.pending, s.denied, s.num_emitted) for s in streams] == before
        asked_whole = []
        stepped = batch.decode(drafts=True, interrupt=lambda: asked_whole.append(1) and False)
        every = interrupt_every(runner._classic.slab.num_layers)
        assert len(asked_whole) == len(range(every, runner._classic.slab.num_layers, every))
        assert all(b.token_ids for b in stepped)
    finally:
        for r in requests:
            batch.remove(r.request_id)
