"""Tool calls in each model family's format, on a real tokenizer: the format chosen from
the chat template (or config), a forced call's grammar compiled against the tokenizer and
walked over the format's text, special marker tokens kept in the reply so it can be read,
and the replies through the HTTP layer (scripted engine, no Ray). The parsing tables are
in tests/unit/test_tool_formats.py."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from local_service import ScriptedClient, make_app, run

pytestmark = pytest.mark.model

USER = [{"role": "user", "content": "weather in Oslo?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
# Minimal templates carrying each family's tool markup, so `auto` picks the family.
BODY = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
TEMPLATES = {
    "hermes": "{# <tool_call> #}" + BODY,
    "llama3_json": "{# ipython <|python_tag|> #}" + BODY,
    "mistral": "{# [TOOL_CALLS] #}" + BODY,
    "mistral_v11": "{# [TOOL_CALLS] [ARGS] #}" + BODY,
}
# Two calls as each family writes them (compact JSON, as a forced reply is generated).
TWO_CALLS = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>\n'
    '<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Oslo"}}; {"name":"get_time","parameters":{}}',
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_time","arguments":{}}]',
    "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"city":"Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
}
ONE_CALL = {
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Oslo"}}',
    "mistral": '[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Oslo"}}]',
    "mistral_v11": '[TOOL_CALLS]get_weather[ARGS]{"city":"Oslo"}',
}
MARKERS = ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>")


@pytest.fixture(scope="module")
def marker_dir(tiny_pair, tmp_path_factory):
    """The tiny tokenizer with Mistral's and Llama's tool markers added as special tokens."""
    from tokenizers import AddedToken, Tokenizer

    out = tmp_path_factory.mktemp("markers")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(os.path.join(tiny_pair[0], name), out / name)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tokenizer.save(str(out / "tokenizer.json"))
    return str(out)


def codec_for(path: str, fmt: str, tool_call_format: str = "auto"):
    from serve_app.openai.codec import TextCodec

    return TextCodec.from_path(path, chat_template=TEMPLATES[fmt], tool_call_format=tool_call_format)


def chat(codec, body, script_ids, finish="stop"):
    client = ScriptedClient([script_ids], finish=finish)

    async def go():
        async with make_app(codec, client) as http:
            return await http.post("/v1/chat/completions", json={"messages": USER, **body})

    r = run(go())
    assert r.status_code == 200, r.text
    if body.get("stream"):
        return [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
        ], client.submitted[0]
    return r.json(), client.submitted[0]


def calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()]


def test_the_format_follows_the_template_and_the_config_overrides_it(tiny_pair, marker_dir):
    for fmt in TEMPLATES:
        assert codec_for(tiny_pair[0], fmt).tool_format.name == fmt
    assert codec_for(tiny_pair[0], "mistral", tool_call_format="llama3_json").tool_format.name == "llama3_json"
    plain = codec_for(tiny_pair[0], "mistral").tool_format
    assert plain.special_ids == ()  # the tiny tokenizer spells the markers as text
    marked = codec_for(marker_dir, "mistral_v11")
    assert [m for m, _ in marked.tool_format.special_ids] == ["[TOOL_CALLS]", "[ARGS]"]


@pytest.mark.parametrize("fmt", list(TEMPLATES))
@pytest.mark.parametrize("tokenizer", ["text markers", "special markers"])
def test_a_forced_calls_grammar_accepts_the_formats_text_on_the_tokenizer(tiny_pair, marker_dir, fmt, tokenizer):
    from models.sampling.grammar import Grammars

    codec = codec_for(tiny_pair[0] if tokenizer == "text markers" else marker_dir, fmt)
    grammars = Grammars.for_tokenizer(codec._tok, [0])
    functions = [WEATHER["function"], CLOCK["function"]]
    many, one = (codec.tool_format.grammar(functions, parallel) for parallel in (True, False))
    two_ids, one_ids = codec.encode(TWO_CALLS[fmt]), codec.encode(ONE_CALL[fmt])
    if tokenizer == "special markers" and fmt.startswith("mistral"):
        assert set(codec.tool_format.kept_ids) & set(one_ids)  # the reply carries the special token
    assert grammars.matcher(many).allowed_prefix(two_ids) == two_ids
    single = grammars.matcher(one)
    assert single.allowed_prefix(one_ids) == one_ids
    single.accept(one_ids)
    assert single.is_finished  # one call, then only EOS
    assert grammars.matcher(one).allowed_prefix(two_ids) != two_ids
    other = "mistral" if fmt != "mistral" else "hermes"
    assert grammars.matcher(many).allowed_prefix(codec.encode(TWO_CALLS[other])) != codec.encode(TWO_CALLS[other])


def test_a_tools_referenced_defs_are_enforced(tiny_pair):
    from models.sampling.grammar import Grammars

    item = {
        "type": "object",
        "properties": {"sku": {"type": "integer"}},
        "required": ["sku"],
        "additionalProperties": False,
    }
    add = {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}},
            "required": ["item"],
            "$defs": {"Item": item},
        },
    }
    codec = codec_for(tiny_pair[0], "mistral")
    grammar = codec.tool_format.grammar([add], parallel=False)
    matcher = Grammars.for_tokenizer(codec._tok, [0])
    good = codec.encode('[TOOL_CALLS][{"name":"add","arguments":{"item":{"sku":3}}}]')
    bad = codec.encode('[TOOL_CALLS][{"name":"add","arguments":{"item":{"sku":"3"}}}]')
    assert matcher.matcher(grammar).allowed_prefix(good) == good
    assert matcher.matcher(grammar).allowed_prefix(bad) != bad


@pytest.mark.parametrize("fmt", list(TEMPLATES))
@pytest.mark.parametrize("tokenizer", ["text markers", "special markers"])
def test_each_formats_reply_comes_back_as_tool_calls(tiny_pair, marker_dir, fmt, tokenizer):
    codec = codec_for(tiny_pair[0] if tokenizer == "text markers" else marker_dir, fmt)
    reply, request = chat(codec, {"tools": [WEATHER, CLOCK]}, codec.encode(TWO_CALLS[fmt]))
    assert request.sampling.grammar is None  # auto: unconstrained
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert calls(choice["message"]) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    forced, request = chat(codec, {"tools": [WEATHER, CLOCK], "tool_choice": "required"}, codec.encode(ONE_CALL[fmt]))
    assert request.sampling.grammar == codec.tool_format.grammar([WEATHER["function"], CLOCK["function"]], True)
    assert calls(forced["choices"][0]["message"]) == [("get_weather", {"city": "Oslo"})]
    events, request = chat(
        codec,
        {"tools": [WEATHER, CLOCK], "tool_choice": "required", "stream": True, "parallel_tool_calls": False},
        codec.encode(TWO_CALLS[fmt]),
    )
    assert request.sampling.grammar == codec.tool_format.grammar([WEATHER["function"], CLOCK["function"]], False)
    deltas = [e["choices"][0]["delta"] for e in events]
    streamed = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["index"] for c in streamed] == [0, 1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_llamas_python_tag_token_before_a_call_is_read(marker_dir):
    codec = codec_for(marker_dir, "llama3_json")
    ids = codec.encode("<|python_tag|>" + ONE_CALL["llama3_json"])
    assert ids[0] in codec.tool_format.kept_ids
    reply, _ = chat(codec, {"tools": [WEATHER]}, ids)
    assert calls(reply["choices"][0]["message"]) == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_a_malformed_call_is_content_with_its_markers(marker_dir, fmt):
    codec = codec_for(marker_dir, fmt)
    text = "Let me see. " + ONE_CALL[fmt][:-3]  # cut short
    reply, _ = chat(codec, {"tools": [WEATHER]}, codec.encode(text))
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"] == text  # special markers included: nothing lost
    # without tools the markers are special tokens and stay out of the text, as before
    plain, _ = chat(codec, {}, codec.encode(text))
    stripped = text
    for marker, _ in codec.tool_format.special_ids:
        stripped = stripped.replace(marker, "")
    assert plain["choices"][0]["message"]["content"] == stripped
