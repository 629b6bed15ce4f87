"""Logit processors on every decode path, over the tiny real models.

A greedy stream with penalties or a logit bias must be the same token for token in
classic decode (mlx-lm's `BatchGenerator` adapter, its lone row, the slab's rows), in
rows that verify drafts and in speculative rounds; the reference is a plain decode
loop with the processors recomputed from the token lists (test_sampling_processors).
Drafts that always land (an oracle drafter, the reference's own next tokens) make
every verify position read drafts: were a verify position to miss the drafts before
it, these streams would differ (the random n-gram and draft-model drafts rarely hit
the positions where it matters).
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_logits_processors

from models.batch.slab_batch import SlabBatch
from models.speculative.drafters import DrafterBase
from models.speculative.round_math import draft_budget

from .conftest import make_request
from .helpers import make_drafter, run_classic, run_session, stepwise_greedy
from .test_sampling_processors import reference
from .test_slab import REPEATING, _run

pytestmark = pytest.mark.model

KNOBS = {
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=1.0, presence_penalty=-0.5),
    "repetition": dict(repetition_penalty=0.5),
    "bias_and_all": dict(logit_bias=((40, 3.0), (41, -2.0)), repetition_penalty=1.4, frequency_penalty=0.3),
}
INDEXES = (0, 3, 7, 12)
MAX_TOKENS = 24


def eos(loaded):
    return sorted(loaded[0].tokenizer.eos_token_ids)


def plain_decode(model, prompt, params, stop_ids):
    """Greedy decode one token at a time; each step's processors from the token lists."""
    return stepwise_greedy(
        model,
        prompt,
        params.max_tokens,
        stop_ids,
        lambda logits, out: np.argmax(reference(logits, params, list(prompt), out)),
    )


@pytest.fixture(scope="module")
def requests(prompt_ids):
    return {
        name: [make_request(f"r{i}", prompt_ids[i], MAX_TOKENS, **knobs) for i in INDEXES]
        for name, knobs in KNOBS.items()
    }


@pytest.fixture(scope="module")
def expected(loaded, requests):
    stop = set(eos(loaded))
    return {
        name: {r.request_id: plain_decode(loaded[0].model, r.prompt_ids, r.sampling, stop) for r in reqs}
        for name, reqs in requests.items()
    }


@pytest.mark.parametrize("knobs", KNOBS)
def test_classic_paths_match_the_plain_reference(loaded, prompt_ids, requests, expected, knobs):
    model, reqs = loaded[0].model, requests[knobs]
    assert run_classic(model, reqs, eos(loaded)) == expected[knobs]  # BatchGenerator rows
    for r in reqs:  # alone: the lone row (`SoloRow`)
        assert run_classic(model, [r], eos(loaded))[r.request_id] == expected[knobs][r.request_id]
    got, _ = _run(SlabBatch(model, eos_token_ids=eos(loaded)), reqs, drafts=False)
    assert got == expected[knobs]
    plain = run_classic(model, [make_request(r.request_id, r.prompt_ids, MAX_TOKENS) for r in reqs], eos(loaded))
    assert plain != expected[knobs]  # the knobs change the streams


def test_mlx_lm_agrees_on_logit_bias_and_repetition_penalty(loaded, prompt_ids):
    """mlx-lm's own processors (same semantics for these two) in its `generate_step`."""
    model = loaded[0].model
    for i in INDEXES:
        r = make_request("a", prompt_ids[i], MAX_TOKENS, logit_bias=((40, 3.0),), repetition_penalty=1.4)
        processors = make_logits_processors(logit_bias={40: 3.0}, repetition_penalty=1.4)
        theirs = [
            int(t)
            for t, _ in generate_step(
                mx.array(r.prompt_ids), model, max_tokens=MAX_TOKENS, logits_processors=processors
            )
        ]
        ours, _ = run_classic(model, [r], [])["a"]  # no stop ids: generate_step has none
        assert ours == theirs


class OracleDrafter(DrafterBase):
    """Drafts the reference stream's next tokens; every `wrong_every`-th round its last
    draft is wrong (a rejection, rolled back)."""

    kind, name = "ngram", "oracle"

    def __init__(self, prompt, stream, wrong_every=0):
        self.num_prompt, self.stream, self.wrong_every, self.rounds = len(prompt), stream, wrong_every, 0

    def new_state(self, prompt_ids):
        return None

    def propose(self, state, history, k):
        self.rounds += 1
        done = len(history) - self.num_prompt
        return _drafts(self.stream, done, k, self.wrong_every and self.rounds % self.wrong_every == 0)

    def rollback(self, state, num_drafted, num_accepted):
        pass


def _drafts(stream, done, k, spoil):
    out = list(stream[done : done + k])
    if spoil and out:
        out[-1] = (out[-1] + 1) % 512
    return out


@pytest.mark.parametrize("drafter", ["oracle", "draft_model", "ngram"])
@pytest.mark.parametrize("knobs", KNOBS)
def test_speculative_rounds_match_classic_decode(loaded, requests, expected, knobs, drafter):
    num_accepted = 0
    for r in requests[knobs]:
        want = expected[knobs][r.request_id]
        d = (
            OracleDrafter(r.prompt_ids, want[0], wrong_every=3)
            if drafter == "oracle"
            else make_drafter(drafter, loaded)
        )
        tokens, reason, rounds = run_session(loaded, r, 4, d)
        assert (tokens, reason) == want, r.request_id
        num_accepted += sum(a for _, _, a in rounds)
    if drafter != "ngram":  # n-gram drafts seldom land in these streams
        assert num_accepted >= 20


class OracleRows(SlabBatch):
    """Rows whose drafts are their reference streams' next tokens (every third step the
    last one is wrong)."""

    def __init__(self, *args, streams, **kw):
        super().__init__(*args, **kw)
        self.streams, self.num_steps = streams, 0

    def _drafts(self, streams):
        self.num_steps += 1
        return [
            _drafts(
                self.streams[s.request_id],
                s.num_emitted,
                draft_budget(self.num_draft_tokens, s.max_tokens - s.num_emitted),
                self.num_steps % 3 == 0,
            )
            for s in streams
        ]


@pytest.mark.parametrize("knobs", KNOBS)
def test_rows_that_verify_drafts_match_classic_decode(loaded, requests, expected, knobs):
    model, reqs, want = loaded[0].model, requests[knobs], expected[knobs]
    rows = OracleRows(
        model,
        eos_token_ids=eos(loaded),
        row_drafts=True,
        num_draft_tokens=4,
        streams={rid: tokens for rid, (tokens, _) in want.items()},
    )
    got, stats = _run(rows, reqs, drafts=True)
    assert got == want and stats["accepted"] >= 20
    # the rows' own n-gram drafts, on a prompt where they land
    repeating = list(loaded[0].tokenizer.encode(REPEATING))
    ngram = [make_request("rep", repeating, 40, **KNOBS[knobs]), *reqs]
    got, _ = _run(SlabBatch(model, eos_token_ids=eos(loaded), row_drafts=True), ngram, drafts=True)
    assert got == run_classic(model, ngram, eos(loaded))


@pytest.mark.parametrize(
    "sampling",
    [{}, dict(temperature=1.0, seed=4), dict(temperature=1.0, top_k=5, seed=4)],
    ids=["greedy", "sampled", "top_k"],
)
def test_a_plus_100_logit_bias_forces_its_token_everywhere(loaded, prompt_ids, sampling):
    forced = 77
    reqs = [make_request(f"r{i}", prompt_ids[i], 12, logit_bias=((forced, 100.0),), **sampling) for i in (1, 5)]
    want = {r.request_id: ([forced] * 12, "length") for r in reqs}
    model = loaded[0].model
    assert run_classic(model, reqs, eos(loaded)) == want
    assert run_classic(model, reqs[:1], eos(loaded)) == {"r1": want["r1"]}
    assert _run(SlabBatch(model, eos_token_ids=eos(loaded)), reqs, drafts=False)[0] == want
    for r in reqs:
        assert run_session(loaded, r, 3, make_drafter("draft_model", loaded))[:2] == want[r.request_id]


def test_seeded_sampled_streams_with_processors_agree_on_classic_paths(loaded, prompt_ids):
    """One draw per token on every classic path: the lone row, BatchGenerator rows and
    the slab's rows give the same seeded stream."""
    knobs = dict(
        temperature=0.8,
        top_p=0.95,
        min_p=0.02,
        top_k=30,
        presence_penalty=0.8,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        logit_bias=((40, 1.5),),
    )
    reqs = [make_request(f"r{i}", prompt_ids[i], 20, seed=i, **knobs) for i in INDEXES]
    model = loaded[0].model
    batched = run_classic(model, reqs, eos(loaded))
    alone = {r.request_id: run_classic(model, [r], eos(loaded))[r.request_id] for r in reqs}
    ragged, _ = _run(SlabBatch(model, eos_token_ids=eos(loaded)), reqs, drafts=False)
    assert batched == alone == ragged
    unprocessed = run_classic(
        model,
        [make_request(r.request_id, r.prompt_ids, 20, seed=r.sampling.seed, temperature=0.8) for r in reqs],
        eos(loaded),
    )
    assert unprocessed != batched  # the processors and filters change the draws


@pytest.mark.parametrize("knobs", ["presence", "bias_and_all"])
def test_the_compiled_verify_reads_the_drafts_too(loaded, requests, expected, knobs):
    """The GPU path's session (`models.forward.bucketed`): a greedy request with processors takes
    the verify's logits instead of the compiled argmax; drafts are padded to K there."""
    from models.forward.bucketed import BucketedForward
    from models.speculative.session import SpeculativeSession

    verifier = BucketedForward(loaded[0].model, bucket=16, prefill_chunk=8)
    for r in requests[knobs]:
        want = expected[knobs][r.request_id]
        session = SpeculativeSession(
            r.request_id,
            loaded[0].model,
            r.prompt_ids,
            r.sampling,
            num_draft_tokens=4,
            eos_token_ids=eos(loaded),
            verifier=verifier,
        )
        session.bind(OracleDrafter(r.prompt_ids, want[0][:-2], wrong_every=3))  # short drafts near the end
        result = session.begin()
        tokens = list(result.token_ids)
        while not session.finished:
            tokens += session.step().token_ids
        assert (tokens, session.finish_reason) == want, r.request_id
        assert session.counters.num_accepted >= 5
