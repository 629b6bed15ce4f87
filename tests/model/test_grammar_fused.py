"""Grammar-constrained requests through the scheduler over the bundled pair (CPU): with
the slot speculating (draft model or n-gram drafts, fused into the classic batch's
forward) and rows verifying their own drafts, each greedy stream equals its isolated
classic decode and the same requests on a runner with speculation off; every reply
parses and validates against the schema."""

import json

import jsonschema
import pytest

from models.sampling.grammar import json_schema_grammar
from tests.model.test_fused_real import bundled_runner, drive, prompts, runner  # noqa: F401 (fixtures)

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["def", "class", "import"]},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "size", "kind", "args"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
MAX_TOKENS = 96


def _drive(runner, prompts, **overrides):
    return drive(runner, prompts, sampling={"grammar": GRAMMAR}, max_tokens=MAX_TOKENS, **overrides)


@pytest.fixture(scope="module")
def speculation_off(prompts):
    """The same requests on a runner without a drafter (classic decode only)."""
    r = bundled_runner(None)
    try:
        streams, _, _, _ = _drive(r, prompts)
    finally:
        r.close()
    return streams


def test_constrained_streams_are_valid_and_identical_with_speculation_on_and_off(runner, prompts, speculation_off):
    isolated = {}
    for i, p in enumerate(prompts):
        streams, _, _, _ = _drive(runner, [p], b1_policy="off")
        isolated[f"r{i}"] = streams["r0"]
    streams, requests, _, _ = _drive(runner, prompts, grant_rounds=2)
    assert streams == isolated == speculation_off
    for r in requests:
        assert r.finish_reason == "stop", r.request_id
        text = runner.tokenizer.decode(streams[r.request_id][:-1])
        jsonschema.validate(json.loads(text), SCHEMA)
    assert sum(r.spec.num_rounds - r.spec.num_row_rounds for r in requests) > 0  # the slot verified
    assert sum(r.spec.num_drafted for r in requests) > 0
    assert sum(r.spec.num_row_rounds for r in requests) > 0  # rows verified their own drafts
