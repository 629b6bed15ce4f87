"""The load generator's prompts: reproducible by seed, and with `shared_prefix_chars` every
prompt of every run starts with the same text (what both servers' prefix caches meet)."""

import os

import pytest

from scripts.bench.loadgen import LoadConfig, build_requests
from serve_app.openai.codec import TextCodec


def _prompts(**kw):
    return [r["body"] for r in build_requests(LoadConfig(num_prompts=6, **kw))]


def test_the_same_seed_gives_the_same_requests_and_another_seed_others():
    assert _prompts(seed=3) == _prompts(seed=3)
    assert [b["prompt"] for b in _prompts(seed=3)] != [b["prompt"] for b in _prompts(seed=4)]


def test_a_shared_prefix_starts_every_prompt_of_every_run():
    plain = [b["prompt"] for b in _prompts(seed=1)]
    runs = [[b["prompt"] for b in _prompts(seed=s, shared_prefix_chars=2000)] for s in (1, 2)]
    prefix = os.path.commonprefix(runs[0] + runs[1])
    assert 1900 <= len(prefix) <= 2000
    assert runs[0] == [prefix + p for p in plain]  # the request's own text follows, unchanged
    assert len(os.path.commonprefix(plain)) < 100


def test_a_shared_prefix_is_a_system_message_in_chat():
    bodies = _prompts(seed=1, endpoint="chat", shared_prefix_chars=500)
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and all(b["messages"][0]["role"] == "system" for b in bodies)
    assert [b["messages"][1:] for b in bodies] == [b["messages"] for b in _prompts(seed=1, endpoint="chat")]


BUNDLED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled", "target")


def test_sized_prompts_have_the_asked_tokens_and_share_no_prefix():
    codec = TextCodec.from_path(BUNDLED)
    prompts = [b["prompt"] for b in _prompts(seed=5, prompt_tokens=700, tokenizer=BUNDLED)]
    lengths = [len(codec.encode(p)) for p in prompts]
    assert all(698 <= n <= 700 for n in lengths), lengths  # the cut may merge the last tokens
    heads = {p.split("\n", 1)[0] for p in prompts}
    assert len(heads) == len(prompts)  # each starts with a line of its own
    assert prompts == [b["prompt"] for b in _prompts(seed=5, prompt_tokens=700, tokenizer=BUNDLED)]
    with pytest.raises(ValueError, match="tokenizer"):
        _prompts(seed=5, prompt_tokens=700)
    with pytest.raises(ValueError, match="completions"):  # chat prompts are not sized
        _prompts(seed=5, prompt_tokens=700, tokenizer=BUNDLED, endpoint="chat")
