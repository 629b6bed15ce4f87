"""Grammar-constrained decoding on every path, over the tiny real models.

The reference is a plain greedy loop that asks a fresh matcher, fed the whole output
so far, for each step's mask. Every path must emit exactly that stream: classic rows
(BatchGenerator's, the lone row, the slab's), rows verifying their own drafts, and
speculative sessions. Oracle drafts (the reference's next tokens, every third round
spoiled with a token the grammar forbids) make every verify position read drafts.
The schema is bounded (short strings, few items, small integers), so even the tiny
random model's output closes and must parse and validate.
"""

import json

import jsonschema
import numpy as np
import pytest

from models.batch.slab_batch import SlabBatch
from models.sampling.grammar import Grammars, json_schema_grammar
from models.speculative.drafters import DrafterBase
from models.speculative.round_math import draft_budget
from models.speculative.session import SpeculativeSession

from .conftest import make_request
from .helpers import make_drafter, run_classic, stepwise_greedy
from .test_slab import REPEATING, _run

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
    },
    "required": ["name", "count", "ok", "tags"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
INDEXES = (0, 3, 7, 12)
MAX_TOKENS = 80


def eos(loaded):
    return sorted(loaded[0].tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def grammars(loaded):
    return Grammars.for_tokenizer(loaded[0].tokenizer, eos(loaded))


def plain_decode(model, grammars, prompt, max_tokens, stop_ids):
    """Greedy, one token at a time; each step's mask from a new matcher fed the output."""

    def pick(logits, out):
        matcher = grammars.matcher(GRAMMAR)
        matcher.accept(out)
        allowed = np.array(matcher.masks(1, [], logits.shape[-1])[0])
        return np.argmax(np.where(allowed, logits, -np.inf))

    return stepwise_greedy(model, prompt, max_tokens, stop_ids, pick)


@pytest.fixture(scope="module")
def requests(prompt_ids):
    return [make_request(f"r{i}", prompt_ids[i], MAX_TOKENS, grammar=GRAMMAR) for i in INDEXES]


@pytest.fixture(scope="module")
def expected(loaded, grammars, requests):
    stop = set(eos(loaded))
    return {r.request_id: plain_decode(loaded[0].model, grammars, r.prompt_ids, MAX_TOKENS, stop) for r in requests}


def test_the_reference_streams_are_valid_json_that_ends(loaded, expected):
    tokenizer = loaded[0].tokenizer
    for tokens, reason in expected.values():
        assert reason == "stop" and tokens[-1] in eos(loaded)
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)


def test_unconstrained_streams_are_not_json(loaded, requests):
    plain = run_classic(loaded[0].model, [make_request(r.request_id, r.prompt_ids, 30) for r in requests], eos(loaded))
    for tokens, _ in plain.values():
        with pytest.raises(ValueError):
            json.loads(loaded[0].tokenizer.decode(tokens))


def test_classic_paths_match_the_reference(loaded, grammars, requests, expected):
    model = loaded[0].model
    assert run_classic(model, requests, eos(loaded), grammars=grammars) == expected
    for r in requests:  # alone: the lone row
        assert run_classic(model, [r], eos(loaded), grammars=grammars)[r.request_id] == expected[r.request_id]
    got, _ = _run(SlabBatch(model, eos_token_ids=eos(loaded), grammars=grammars), requests, drafts=False)
    assert got == expected


def test_a_budget_that_ends_mid_json_finishes_with_length(loaded, grammars, requests, expected):
    r = requests[0]
    short = make_request(r.request_id, r.prompt_ids, 5, grammar=GRAMMAR)
    got = run_classic(loaded[0].model, [short], eos(loaded), grammars=grammars)[r.request_id]
    assert got == (expected[r.request_id][0][:5], "length")


def _oracle_drafts(stream, done, k, spoil, forbidden):
    out = list(stream[done : done + k])
    if spoil and out:
        out[-1] = forbidden
    return out


class OracleDrafter(DrafterBase):
    """The reference stream's next tokens; every third round the last one is a token
    the grammar never allows after the first ('{' can only open the object)."""

    kind, name = "ngram", "oracle"

    def __init__(self, prompt, stream, forbidden):
        self.num_prompt, self.stream, self.forbidden, self.rounds, self.proposed = len(prompt), stream, forbidden, 0, 0

    def new_state(self, prompt_ids):
        return None

    def propose(self, state, history, k):
        self.rounds += 1
        out = _oracle_drafts(self.stream, len(history) - self.num_prompt, k, self.rounds % 3 == 0, self.forbidden)
        self.proposed += len(out)
        return out

    def rollback(self, state, num_drafted, num_accepted):
        pass


def run_session(loaded, grammars, request, drafter):
    target = loaded[0]
    session = SpeculativeSession(
        request.request_id,
        target.model,
        request.prompt_ids,
        request.sampling,
        num_draft_tokens=4,
        eos_token_ids=eos(loaded),
        grammars=grammars,
    )
    session.bind(drafter)
    first = session.begin()
    tokens, reason, drafted, accepted = list(first.token_ids), first.finish_reason, 0, 0
    while reason is None:
        r = session.step()
        tokens, reason = tokens + r.token_ids, r.finish_reason
        drafted, accepted = drafted + r.num_drafted, accepted + r.num_accepted
    session.finish()
    return (tokens, reason), drafted, accepted


def _forbidden(loaded):
    return loaded[0].tokenizer.encode("{")[0]


@pytest.mark.parametrize("drafter", ["oracle", "draft_model", "ngram"])
def test_speculative_sessions_match_the_reference(loaded, grammars, requests, expected, drafter):
    num_accepted, num_cut = 0, 0
    for r in requests:
        want = expected[r.request_id]
        if drafter == "oracle":
            d = OracleDrafter(r.prompt_ids, want[0], _forbidden(loaded))
        else:
            d = make_drafter(drafter, loaded)
        got, drafted, accepted = run_session(loaded, grammars, r, d)
        assert got == want, r.request_id
        num_accepted += accepted
        if drafter == "oracle":
            num_cut += d.proposed - drafted  # spoiled drafts cut before the verify
    if drafter == "oracle":
        assert num_accepted >= 20 and num_cut > 0


class OracleRows(SlabBatch):
    def __init__(self, *args, streams, forbidden, **kw):
        super().__init__(*args, **kw)
        self.streams, self.forbidden, self.num_steps, self.proposed = streams, forbidden, 0, 0

    def _drafts(self, streams):
        self.num_steps += 1
        out = []
        for s in streams:
            k = draft_budget(self.num_draft_tokens, s.max_tokens - s.num_emitted)
            d = _oracle_drafts(self.streams[s.request_id], s.num_emitted, k, self.num_steps % 3 == 0, self.forbidden)
            self.proposed += len(d)
            out.append(s.sampler.allowed_drafts(d))
        return out


def test_rows_that_verify_drafts_match_the_reference(loaded, grammars, requests, expected):
    model = loaded[0].model
    rows = OracleRows(
        model,
        eos_token_ids=eos(loaded),
        row_drafts=True,
        num_draft_tokens=4,
        grammars=grammars,
        streams={rid: tokens for rid, (tokens, _) in expected.items()},
        forbidden=_forbidden(loaded),
    )
    got, stats = _run(rows, requests, drafts=True)
    assert got == expected and stats["accepted"] >= 20 and stats["drafted"] < rows.proposed
    # the rows' own n-gram drafts, on a prompt where they would land unconstrained
    repeating = make_request("rep", list(loaded[0].tokenizer.encode(REPEATING)), MAX_TOKENS, grammar=GRAMMAR)
    reqs = [repeating, *requests]
    got, _ = _run(SlabBatch(model, eos_token_ids=eos(loaded), row_drafts=True, grammars=grammars), reqs, drafts=True)
    assert got == run_classic(model, reqs, eos(loaded), grammars=grammars)


def test_a_constrained_request_needs_the_grammars(loaded, requests):
    with pytest.raises(ValueError, match="Grammars"):
        run_classic(loaded[0].model, requests[:1], eos(loaded))


def test_a_session_with_the_compiled_verifier_takes_the_plain_verify(loaded, grammars, requests, expected):
    """The GPU path's compiled verify (`models.forward.bucketed`) pads drafts and takes no
    grammar: a constrained session verifies through the plain forward instead."""
    from models.forward.bucketed import BucketedForward

    verifier = BucketedForward(loaded[0].model, bucket=16, prefill_chunk=8)
    for r in requests:
        want = expected[r.request_id]
        session = SpeculativeSession(
            r.request_id,
            loaded[0].model,
            r.prompt_ids,
            r.sampling,
            num_draft_tokens=4,
            eos_token_ids=eos(loaded),
            verifier=verifier,
            grammars=grammars,
        )
        session.bind(OracleDrafter(r.prompt_ids, want[0], _forbidden(loaded)))
        tokens = list(session.begin().token_ids)
        while not session.finished:
            tokens += session.step().token_ids
        assert (tokens, session.finish_reason) == want, r.request_id
        assert session.counters.num_accepted >= 5


def test_sampled_constrained_streams_are_valid_on_every_path(loaded, grammars, prompt_ids):
    """Temperature 1 draws from the masked distribution: whatever it picks parses."""
    model, tokenizer = loaded[0].model, loaded[0].tokenizer
    reqs = [make_request(f"s{i}", prompt_ids[i], MAX_TOKENS, grammar=GRAMMAR, temperature=1.0, seed=i) for i in INDEXES]
    outputs = list(run_classic(model, reqs, eos(loaded), grammars=grammars).values())
    outputs += list(
        _run(SlabBatch(model, eos_token_ids=eos(loaded), grammars=grammars), reqs, drafts=False)[0].values()
    )
    outputs += [run_session(loaded, grammars, r, make_drafter("draft_model", loaded))[0] for r in reqs]
    assert len({tuple(tokens) for tokens, _ in outputs}) > 1  # the draws differ
    for tokens, reason in outputs:
        assert reason == "stop"
        jsonschema.validate(json.loads(tokenizer.decode(tokens[:-1])), SCHEMA)


def test_the_runner_builds_the_grammar_index_at_load(tiny_pair, monkeypatch):
    """The tokenizer index (about a second on a large vocabulary) is built while the
    runner loads, never by the first constrained request on the engine thread."""
    from models.runner import MlxRunner

    runner = MlxRunner.from_paths(tiny_pair[0], drafter_kind="ngram")
    index = runner.grammars._tokenizer
    assert index is not None
    monkeypatch.setattr("llguidance.hf.from_tokenizer", lambda *a, **k: pytest.fail("index built again"))
    assert runner.grammars.matcher(GRAMMAR) is not None and runner.grammars.index() is index
    runner.close()
