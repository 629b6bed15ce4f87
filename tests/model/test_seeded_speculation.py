"""Seeded sampled streams (temperature > 0) are the same token for token with
speculation on and off, under the equality rule: n-gram drafts, and the draft model's
greedy drafts (`sample_drafts` off). Output position p is drawn with p's own key
(`models.sampling.samplers.position_keys`) wherever it is drawn: a classic step, a slot round's
verify, a row's own verify, a pipelined step queued ahead. Rejection sampling (the
draft model's sampled drafts) keeps the distribution only (tests/model/test_sampling.py).

Engine level over the bundled pair (the scheduler over `MlxRunner`: the slot, rotation,
parks, rows that draft), then the paths one by one over the tiny pair, with drafters
that always land (the classic stream's own next tokens), so that every verify position
is one that must match.
"""

import json

import jsonschema
import pytest

from models.batch.slab_batch import SlabBatch
from models.forward.bucketed import BucketedForward
from models.speculative.session import SpeculativeSession

from .conftest import PROMPTS, make_request
from .helpers import make_drafter, run_classic, run_session
from .test_fused_real import bundled_runner, drive, quiet_costs
from .test_grammar_fused import GRAMMAR, SCHEMA
from .test_logprobs import TOL
from .test_sampling_paths import OracleDrafter, OracleRows
from .test_slab import REPEATING, _run

pytestmark = pytest.mark.model

SAMPLED = {
    "t0.7_top_p_penalties_logprobs": dict(
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.4,
        frequency_penalty=0.2,
        repetition_penalty=1.1,
        seed=11,
        logprobs=3,
    ),
    "t1.0_top_k_min_p_bias": dict(temperature=1.0, top_k=20, min_p=0.02, logit_bias=((13, 1.5),), seed=5),
}


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def runner(request):
    r = bundled_runner(request.param)
    quiet_costs(r, request.param)  # which rows draft must not depend on how loaded the machine was
    r.sampled_row_drafts = True  # sampled rows draft too (off by default): their tokens must not change
    if request.param == "draft_model":
        r._slot.drafter.sample_drafts = False  # greedy drafts: the equality rule at T > 0
    yield r
    r.close()


@pytest.fixture(scope="module")
def prompts(runner):
    return [runner.tokenizer.encode(PROMPTS[i]) for i in (0, 8, 21, 3)]


def speculation_off(runner, prompts, sampling, logprobs=None, **kw):
    """Each prompt alone, classic decode only (B=1 policy off): {request id: tokens},
    and each one's logprobs into `logprobs` (where the requests ask)."""
    out = {}
    for i, p in enumerate(prompts):
        reported = {}
        out[f"r{i}"] = drive(runner, [p], b1_policy="off", sampling=sampling, logprobs=reported, **kw)[0]["r0"]
        if logprobs is not None and reported:
            logprobs[f"r{i}"] = reported["r0"]
    return out


def assert_same_logprobs(got, want):
    assert got.keys() == want.keys()
    for rid, entries in want.items():
        assert len(got[rid]) == len(entries), rid
        for a, b in zip(got[rid], entries):
            assert abs(a.logprob - b.logprob) < TOL
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("knobs", SAMPLED)
def test_seeded_sampled_streams_are_the_same_with_speculation_on_and_off(runner, prompts, knobs):
    """And the logprobs reported are those the sampler drew from, wherever it drew."""
    sampling, off_logprobs = SAMPLED[knobs], {}
    off = speculation_off(runner, prompts, sampling, off_logprobs)
    num_accepted = 0
    for i, p in enumerate(prompts[:2]):  # alone in the slot: every token but the first from a round
        streams, (request,), _, _ = drive(runner, [p], b1_policy="on", sampling=sampling)
        assert streams["r0"] == off[f"r{i}"]
        num_accepted += request.spec.num_accepted
    # together: rotation, parks, the ring decoding as rows, rows verifying their own drafts
    on_logprobs = {}
    streams, requests, _, _ = drive(runner, prompts, sampling=sampling, grant_rounds=2, logprobs=on_logprobs)
    assert streams == off
    assert num_accepted + sum(r.spec.num_accepted for r in requests) > 0  # drafts accepted at T > 0
    if runner.rows_draft_like_slot(greedy=False):
        assert sum(r.spec.num_row_rounds for r in requests) > 0  # sampled rows drafted
    assert_same_logprobs(on_logprobs, off_logprobs)
    assert bool(off_logprobs) == (sampling.get("logprobs") is not None)


def test_constrained_sampled_streams_are_the_same_with_speculation_on_and_off(runner, prompts):
    sampling = {"grammar": GRAMMAR, "temperature": 0.8, "top_p": 0.95, "seed": 3}
    off = speculation_off(runner, prompts, sampling, max_tokens=96)
    streams, requests, _, _ = drive(runner, prompts, sampling=sampling, max_tokens=96, grant_rounds=2)
    assert streams == off
    assert sum(r.spec.num_accepted for r in requests) > 0
    for r in requests:
        assert r.finish_reason == "stop", r.request_id
        jsonschema.validate(json.loads(runner.tokenizer.decode(streams[r.request_id][:-1])), SCHEMA)


def test_unseeded_requests_draw_their_own_seed(runner, prompts):
    """Without a seed each request gets a random one, once: two identical requests
    differ, and each finishes with speculation on."""
    sampling = dict(temperature=1.0)
    streams, requests, _, _ = drive(runner, [prompts[0], prompts[0]], sampling=sampling, grant_rounds=2)
    assert streams["r0"] != streams["r1"]
    assert all(r.finish_reason is not None for r in requests)


# -- the paths one by one, over the tiny pair -------------------------------------------------------

ROW_KNOBS = {
    "plain": dict(temperature=1.0),  # no processors: pipelined on a grid slab
    "penalized": dict(temperature=0.7, top_p=0.9, top_k=30, presence_penalty=0.5, repetition_penalty=1.2),
}


def eos(loaded):
    return sorted(loaded[0].tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def requests(prompt_ids):
    return {
        name: [make_request(f"r{i}", prompt_ids[i], 24, seed=100 + i, **knobs) for i in (0, 3, 7, 12)]
        for name, knobs in ROW_KNOBS.items()
    }


@pytest.fixture(scope="module")
def classic(loaded, requests):
    return {name: run_classic(loaded[0].model, reqs, eos(loaded)) for name, reqs in requests.items()}


@pytest.mark.parametrize("knobs", ROW_KNOBS)
def test_sampled_rows_that_draft_emit_their_classic_streams(loaded, requests, classic, knobs):
    model, reqs, want = loaded[0].model, requests[knobs], classic[knobs]
    rows = OracleRows(
        model,
        eos_token_ids=eos(loaded),
        row_drafts=True,
        num_draft_tokens=4,
        streams={rid: tokens for rid, (tokens, _) in want.items()},
    )
    rows.sampled_drafts = True
    got, stats = _run(rows, reqs, drafts=True)
    assert got == want and stats["accepted"] >= 20


def test_sampled_rows_verify_their_own_ngram_drafts(loaded, requests):
    """On a prompt where prompt lookup lands (at a low temperature: the tiny random
    model's logits are flat), beside the other sampled rows."""
    repeating = list(loaded[0].tokenizer.encode(REPEATING))
    reqs = [make_request("rep", repeating, 40, temperature=0.05, seed=0), *requests["penalized"]]
    batch = SlabBatch(loaded[0].model, eos_token_ids=eos(loaded), row_drafts=True)
    batch.sampled_drafts = True
    got, stats = _run(batch, reqs, drafts=True)
    assert got == run_classic(loaded[0].model, reqs, eos(loaded))
    assert stats["accepted"] > 0


def test_pipelined_sampled_rows_emit_their_classic_streams(loaded, requests, classic):
    """A grid slab queues the next step's draws (one position ahead) before this step's
    tokens are read; a step taken back draws those positions again, the same."""
    rows = SlabBatch(loaded[0].model, eos_token_ids=eos(loaded), grid=True)
    got, _ = _run(rows, requests["plain"], drafts=False)
    assert got == classic["plain"]
    assert rows.num_pipelined > 20


@pytest.mark.parametrize("knobs", ROW_KNOBS)
@pytest.mark.parametrize("drafter", ["oracle", "ngram", "draft_model"])
def test_sampled_rounds_emit_the_classic_stream(loaded, requests, classic, knobs, drafter):
    num_accepted = 0
    for r in requests[knobs]:
        want = classic[knobs][r.request_id]
        if drafter == "oracle":
            d = OracleDrafter(r.prompt_ids, want[0], wrong_every=3)
        else:
            d = make_drafter(drafter, loaded)
            if drafter == "draft_model":
                d.sample_drafts = False  # greedy drafts: the equality rule
        tokens, reason, rounds = run_session(loaded, r, 4, d)
        assert (tokens, reason) == want, r.request_id
        num_accepted += sum(a for _, _, a in rounds)
    if drafter == "oracle":
        assert num_accepted >= 20


def test_the_compiled_verify_draws_the_same_sampled_stream(loaded, requests, classic):
    """The GPU path's session (`models.forward.bucketed`): drafts padded to K, one sync a round."""
    verifier = BucketedForward(loaded[0].model, bucket=16, prefill_chunk=8)
    for r in requests["penalized"]:
        want = classic["penalized"][r.request_id]
        session = SpeculativeSession(
            r.request_id,
            loaded[0].model,
            r.prompt_ids,
            r.sampling,
            num_draft_tokens=4,
            eos_token_ids=eos(loaded),
            verifier=verifier,
        )
        session.bind(OracleDrafter(r.prompt_ids, want[0][:-2], wrong_every=3))
        tokens = list(session.begin().token_ids)
        while not session.finished:
            tokens += session.step().token_ids
        assert (tokens, session.finish_reason) == want, r.request_id
        assert session.counters.num_accepted >= 5


def test_rejection_sampled_streams_are_reproducible(loaded, requests):
    """The draft model's sampled drafts (rejection sampling): the same seed gives the
    same stream (its drafts and uniforms come from the request's own key streams),
    though not the classic one."""
    for r in requests["penalized"]:
        runs = [run_session(loaded, r, 4, make_drafter("draft_model", loaded)) for _ in range(2)]
        assert runs[0] == runs[1]


@pytest.mark.parametrize("on", [False, True])
def test_the_runner_knob_reaches_the_batch(tiny_pair, on):
    """`sampled_row_drafts` (off by default) is what lets sampled rows draft."""
    from models.runner import MlxRunner

    runner = MlxRunner.from_paths(tiny_pair[0], drafter_kind="ngram", **({"sampled_row_drafts": True} if on else {}))
    assert runner.sampled_row_drafts is on and runner._classic.sampled_drafts is on
    runner.close()
