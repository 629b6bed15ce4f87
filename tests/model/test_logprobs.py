"""Logprobs on every decode path, over the tiny real float32 models.

The reference is computed here, independently of the sampler: one forward over the
prompt and the emitted tokens, each position's logits processed from explicit token
lists (`test_sampling_processors.reference`), then a numpy log-softmax. Every path
(mlx-lm's `BatchGenerator` rows and its lone row, the slab's rows with and without
their own drafts and pipelining, speculative sessions with either drafter, probes,
and the scheduler's fused tick) must report each emitted token's log-probability and
the k most likely at its position from exactly that distribution.
"""

import mlx.core as mx
import numpy as np
import pytest

from models.batch.generator_batch import GeneratorBatch
from models.batch.slab_batch import SlabBatch
from models.forward.bucketed import BucketedForward
from models.sampling.samplers import RequestSampler, logprob_arrays
from scheduler.request import SamplingParams, TokenLogprob

from .conftest import make_request
from .helpers import make_drafter, new_session
from .test_sampling_paths import OracleDrafter, OracleRows
from .test_sampling_processors import reference
from .test_slab import REPEATING

pytestmark = pytest.mark.model

MAX_TOKENS = 20
TOL = 2e-4  # float32: one forward over the whole stream against incremental decode
KNOBS = {
    "plain": {},
    "penalized": dict(logit_bias=((40, 2.0),), repetition_penalty=1.3, frequency_penalty=0.4),
    "sampled": dict(temperature=0.8, top_p=0.9, seed=7),
}


def eos(loaded):
    return sorted(loaded[0].tokenizer.eos_token_ids)


def reference_logprobs(model, prompt: list[int], out: list[int], params: SamplingParams) -> np.ndarray:
    """(len(out), V): the processed log-softmax at each emitted position."""
    logits = np.array(model(mx.array([list(prompt) + list(out[:-1])]))[0, len(prompt) - 1 :].astype(mx.float32))
    rows = []
    for j in range(len(out)):
        x = reference(logits[j], params, list(prompt), list(out[:j])).astype(np.float64)
        rows.append(x - (np.log(np.sum(np.exp(x - x.max()))) + x.max()))
    return np.stack(rows)


def check(model, request, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
    """The reported logprobs of `tokens` against the reference, and their shape."""
    k = request.sampling.logprobs
    assert logprobs is not None and len(logprobs) == len(tokens)
    ref = reference_logprobs(model, request.prompt_ids, tokens, request.sampling)
    for j, (token, entry) in enumerate(zip(tokens, logprobs)):
        assert abs(entry.logprob - ref[j][token]) < TOL, (j, entry.logprob, ref[j][token])
        assert len(entry.top) == k
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        assert all(np.exp(v) <= 1.0 for v in values)
        for token_id, value in entry.top:
            assert abs(value - ref[j][token_id]) < TOL
        np.testing.assert_allclose(values, np.sort(ref[j])[::-1][:k], atol=TOL)
        if request.sampling.is_greedy:
            assert entry.top[0][0] == token and abs(entry.top[0][1] - entry.logprob) < 1e-6


def collect(into: dict, batches, stats: dict | None = None) -> set:
    """Append each batch's tokens and logprobs (and count accepted drafts in `stats`);
    returns the ids that finished."""
    done = set()
    for b in batches:
        if stats is not None:
            stats["accepted"] = stats.get("accepted", 0) + b.num_accepted
        tokens, logprobs = into.setdefault(b.request_id, ([], []))
        tokens += b.token_ids
        if b.logprobs is None:
            logprobs.append(None)
        else:
            logprobs += b.logprobs
        if b.finish_reason:
            done.add(b.request_id)
    return done


def run_batch(batch, requests, drafts=False, stats=None):
    out, done = {}, set()
    for d in collect(out, batch.prefill(requests)):
        done.add(d)
        batch.remove(d)
    for _ in range(500):
        if len(done) == len(requests):
            break
        for d in collect(out, batch.decode(drafts=drafts), stats):
            done.add(d)
            batch.remove(d)
    assert len(done) == len(requests)
    return out


@pytest.fixture(scope="module")
def requests(loaded, prompt_ids):
    repeating = list(loaded[0].tokenizer.encode(REPEATING))
    prompts = [prompt_ids[0], prompt_ids[7], repeating, prompt_ids[12]]
    return {
        name: [make_request(f"r{i}", p, MAX_TOKENS, logprobs=3, **knobs) for i, p in enumerate(prompts)]
        for name, knobs in KNOBS.items()
    }


@pytest.fixture(scope="module")
def classic(loaded, requests):
    """Each knob's streams from mlx-lm's batch rows: what the oracle drafters draft."""
    return {
        name: {
            rid: tokens
            for rid, (tokens, _) in run_batch(GeneratorBatch(loaded[0].model, eos_token_ids=eos(loaded)), reqs).items()
        }
        for name, reqs in requests.items()
    }


def test_logprob_arrays_read_the_chosen_token_and_the_top_k_in_order():
    lp = mx.log(mx.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    got = logprob_arrays(lp, mx.array([2, 1]), 2).tolist()
    assert [round(float(np.exp(g.logprob)), 5) for g in got] == [0.3, 0.2]
    assert [[t for t, _ in g.top] for g in got] == [[1, 2], [0, 2]]
    assert logprob_arrays(lp, mx.array([0, 0]), 0).tolist()[0].top == ()


def test_a_request_that_does_not_ask_gets_none(loaded, prompt_ids):
    model = loaded[0].model
    for batch in (GeneratorBatch(model, eos_token_ids=eos(loaded)), SlabBatch(model, eos_token_ids=eos(loaded))):
        out = run_batch(batch, [make_request("a", prompt_ids[0], 6), make_request("b", prompt_ids[3], 6)])
        assert all(lp == [None] * len(lp) for _, lp in out.values())
    sampler = RequestSampler(SamplingParams(4))
    assert sampler.sample_with_logprobs(mx.zeros((1, 8)))[1] is None


@pytest.mark.parametrize("knobs", KNOBS)
def test_classic_batch_rows_and_the_lone_row(loaded, requests, knobs):
    model, reqs = loaded[0].model, requests[knobs]
    together = run_batch(GeneratorBatch(model, eos_token_ids=eos(loaded)), reqs)  # BatchGenerator rows
    for r in reqs:
        check(model, r, *together[r.request_id])
        alone = run_batch(GeneratorBatch(model, eos_token_ids=eos(loaded)), [r])  # `SoloRow`
        assert alone[r.request_id][0] == together[r.request_id][0]
        check(model, r, *alone[r.request_id])


@pytest.mark.parametrize("knobs", KNOBS)
@pytest.mark.parametrize("mode", ["plain", "row_drafts", "pipelined"])
def test_slab_rows(loaded, requests, classic, knobs, mode):
    """Rows drafting the classic stream (oracle drafts, every third step one wrong):
    accepted drafts report the verify position that accepted them."""
    model, reqs = loaded[0].model, requests[knobs]
    if mode == "row_drafts":
        batch = OracleRows(
            model, eos_token_ids=eos(loaded), row_drafts=True, num_draft_tokens=4, streams=classic[knobs]
        )
    else:
        batch = SlabBatch(model, eos_token_ids=eos(loaded), grid=mode == "pipelined")
    stats = {}
    out = run_batch(batch, reqs, drafts=mode == "row_drafts", stats=stats)
    for r in reqs:
        check(model, r, *out[r.request_id])
    if mode == "row_drafts" and knobs != "sampled":  # sampled rows do not draft
        assert stats["accepted"] >= 20
    if mode == "pipelined" and knobs != "penalized":  # penalized rows are never pipelined
        assert batch.num_pipelined > 0


@pytest.mark.parametrize("knobs", KNOBS)
@pytest.mark.parametrize("kind", ["oracle", "oracle_compiled", "draft_model", "ngram"])
def test_speculative_sessions_report_each_verify_position(loaded, requests, classic, knobs, kind):
    """`oracle_compiled`: the GPU's compiled verify (`models.forward.bucketed`, fast_verify), on the CPU."""
    model, num_accepted = loaded[0].model, 0
    for r in requests[knobs]:
        drafter = (
            OracleDrafter(r.prompt_ids, classic[knobs][r.request_id], wrong_every=3)
            if kind.startswith("oracle")
            else make_drafter(kind, loaded)
        )
        session = new_session(loaded, r, 4, drafter)
        if kind == "oracle_compiled":
            session.verifier = BucketedForward(model, bucket=16, prefill_chunk=4)
        first = session.begin()
        tokens, logprobs, reason, accepted = list(first.token_ids), list(first.logprobs), first.finish_reason, 0
        for i in range(100):
            if reason is not None:
                break
            step = session.step(probe=i == 1)  # a probe round decodes classically
            tokens += step.token_ids
            logprobs += step.logprobs
            reason, accepted = step.finish_reason, accepted + step.num_accepted
        session.finish()
        check(model, r, tokens, logprobs)
        num_accepted += accepted
    if kind.startswith("oracle") and knobs == "plain":
        assert num_accepted >= 20  # accepted drafts' logprobs are checked


@pytest.mark.parametrize("slab_batch", [True, False], ids=["slab_fused", "batch_generator_alternating"])
def test_greedy_logprobs_are_the_same_with_speculation_on_and_off(loaded, prompt_ids, slab_batch):
    """Through the scheduler and `MlxRunner` (the slab batch and the fused tick, or
    mlx-lm's batch and the alternating tick; rotation, promotion, demotion): the streams
    and their logprobs do not depend on which path produced each token."""
    from models.runner import MlxRunner
    from models.speculative.drafters import DraftModelDrafter
    from scheduler.config import SchedulerConfig
    from scheduler.core import Scheduler

    drafter = DraftModelDrafter(loaded[1].model, loaded[1].name)
    runner = MlxRunner(loaded[0], drafter, num_draft_tokens=4, slab_batch=slab_batch)
    repeating = list(loaded[0].tokenizer.encode(REPEATING))
    prompts = [prompt_ids[0], prompt_ids[7], repeating, prompt_ids[12]]

    def drive(**config):
        scheduler = Scheduler(runner, SchedulerConfig(**config))
        reqs = [make_request(f"r{i}", p, MAX_TOKENS, logprobs=2) for i, p in enumerate(prompts)]
        for r in reqs:
            scheduler.submit(r)
        out = {}
        for _ in range(3000):
            for event in scheduler.tick():
                tokens, logprobs = out.setdefault(event.request_id, ([], []))
                tokens += event.token_ids
                logprobs += event.logprobs or []
            if not scheduler.has_work():
                break
        return out, reqs

    try:
        spec, reqs = drive(b1_policy="on", grant_rounds=2)
        classic, _ = drive(b1_policy="off")
    finally:
        runner.close()
    assert sum(r.spec.num_slot_rounds > 0 for r in reqs) >= 2  # the slot served several streams
    for r in reqs:
        tokens, logprobs = spec[r.request_id]
        assert tokens == classic[r.request_id][0]
        for a, b in zip(logprobs, classic[r.request_id][1]):
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        check(loaded[0].model, r, tokens, logprobs)


@pytest.mark.parametrize("batch_kind", [GeneratorBatch, SlabBatch])
def test_a_grammar_masks_the_reported_distribution(loaded, prompt_ids, batch_kind):
    """Forbidden tokens have -inf (the serve layer reports -9999) and the allowed ones'
    probabilities sum to 1; where fewer than k tokens are allowed the rest of the top k
    are forbidden ones."""
    from models.sampling.grammar import Grammars

    from .test_grammar_paths import GRAMMAR

    model, grammars = loaded[0].model, Grammars.for_tokenizer(loaded[0].tokenizer, eos(loaded))
    reqs = [make_request(f"g{i}", prompt_ids[i], 40, grammar=GRAMMAR, logprobs=5) for i in (0, 3)]
    out = run_batch(batch_kind(model, eos_token_ids=eos(loaded), grammars=grammars), reqs)
    num_forbidden_in_top = 0
    for r in reqs:
        tokens, logprobs = out[r.request_id]
        raw = np.array(
            model(mx.array([list(r.prompt_ids) + tokens[:-1]]))[0, len(r.prompt_ids) - 1 :].astype(mx.float32)
        ).astype(np.float64)
        for j, (token, entry) in enumerate(zip(tokens, logprobs)):
            matcher = grammars.matcher(GRAMMAR)
            matcher.accept(tokens[:j])
            allowed = np.array(matcher.masks(1, [], raw.shape[-1])[0])
            x = np.where(allowed, raw[j], -np.inf)
            ref = x - (np.log(np.sum(np.exp(x[allowed] - x[allowed].max()))) + x[allowed].max())
            assert abs(entry.logprob - ref[token]) < TOL and entry.top[0][0] == token
            for token_id, value in entry.top:
                assert (value == -np.inf) == (not allowed[token_id])
                assert value == -np.inf or abs(value - ref[token_id]) < TOL
            num_forbidden_in_top += sum(v == -np.inf for _, v in entry.top)
    assert num_forbidden_in_top > 0
