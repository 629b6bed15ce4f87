"""The grammar matcher over verify positions, with the bundled model's tokenizer (no
model): position i's mask is the mask after the drafts before it, a forbidden draft
ends the draft, and neither query moves the matcher."""

import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from models.sampling.grammar import Grammars, grammar_error, json_schema_grammar

pytestmark = pytest.mark.model

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled", "target")
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
EOS = 0


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, [EOS])


@pytest.fixture(scope="module")
def doc(tokenizer):
    return tokenizer.encode('{"a":12,"b":"yy"}')


def mask_after(grammars, tokens, vocab):
    """The mask of a fresh matcher fed `tokens` one by one."""
    m = grammars.matcher(GRAMMAR)
    m.accept(tokens)
    return np.array(m.masks(1, [], vocab)[0])


@pytest.mark.parametrize("done", [0, 1, 3])
def test_each_position_sees_the_drafts_before_it(grammars, tokenizer, doc, done):
    vocab = len(tokenizer)
    m = grammars.matcher(GRAMMAR)
    m.accept(doc[:done])
    drafts = doc[done : done + 4]
    masks = np.array(m.masks(len(drafts) + 1, drafts, vocab))
    for i in range(len(drafts) + 1):
        assert (masks[i] == mask_after(grammars, doc[: done + i], vocab)).all(), i
    assert (np.array(m.masks(1, [], vocab)[0]) == mask_after(grammars, doc[:done], vocab)).all()  # unmoved


def test_a_forbidden_draft_ends_the_draft(grammars, tokenizer, doc):
    vocab, brace = len(tokenizer), tokenizer.encode("{")[0]
    m = grammars.matcher(GRAMMAR)
    m.accept(doc[:2])
    drafts = [doc[2], brace, doc[3]]  # '{' cannot follow '{"a'
    assert m.allowed_prefix(drafts) == [doc[2]]
    assert m.allowed_prefix([brace]) == []
    masks = np.array(m.masks(4, drafts, vocab))
    assert masks[1].sum() < vocab and not masks[1][brace]  # the forbidden draft's own position
    assert masks[2].all() and masks[3].all()  # after it: never drawn, anything goes
    assert m.allowed_prefix(doc[2:]) == doc[2:]  # unmoved by the queries


def test_a_complete_document_allows_only_eos(grammars, tokenizer, doc):
    m = grammars.matcher(GRAMMAR)
    m.accept(doc)
    allowed = np.array(m.masks(1, [], len(tokenizer))[0])
    assert allowed[EOS] and allowed.sum() == 1
    m.accept([EOS])
    assert m.is_finished
    m.accept([5])  # after the end (a stop id let it through): ignored


def test_a_failed_matcher_allows_only_eos(grammars, tokenizer):
    """A token outside the grammar (or a parser limit) ends that request, not the batch."""
    m = grammars.matcher(GRAMMAR)
    m.accept(tokenizer.encode("x"))
    assert m.error is not None and m.is_finished
    masks = np.array(m.masks(2, [5], len(tokenizer)))
    assert masks[0][EOS] and masks[0].sum() == 1
    assert m.allowed_prefix([5, 6]) == []


@pytest.mark.parametrize(
    "schema, ok",
    [
        ({"type": "object"}, True),
        ({"type": "array", "items": {"type": "integer"}}, True),
        ({"type": "nope"}, False),
    ],
)
def test_schemas_are_checked_up_front(schema, ok):
    assert (grammar_error(json_schema_grammar(schema)) is None) is ok
