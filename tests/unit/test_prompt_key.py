"""The prompt's affinity key: every turn of a conversation shares it, other
conversations do not."""

import json

import pytest

from serve_app.deployment.prompt_key import PROMPT_KEY_CHARS, PROMPT_KEY_TOKENS, key_of_body, prompt_affinity_key

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_key(messages, **fields):
    return prompt_affinity_key(CHAT, json.dumps({"messages": messages, **fields}).encode())


def conversation(first_user, num_turns, system=None):
    """The messages each turn sends: the whole history, then the new user message."""
    history = [{"role": "system", "content": system}] if system else []
    turns = []
    for turn in range(num_turns):
        history.append({"role": "user", "content": first_user if turn == 0 else f"and then {turn}?"})
        turns.append(list(history))
        history.append({"role": "assistant", "content": f"answer {turn}"})
    return turns


@pytest.mark.parametrize("system", [None, "You are terse."])
def test_every_turn_of_a_conversation_has_the_first_turns_key(system):
    turns = conversation("Explain this code.", 6, system)
    keys = {chat_key(messages) for messages in turns}
    assert len(keys) == 1 and None not in keys


def test_conversations_that_start_differently_have_different_keys():
    keys = {chat_key(conversation(f"question {i}", 1)[0]) for i in range(50)}
    assert len(keys) == 50


@pytest.mark.parametrize(
    "a, b",
    [
        (
            [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}],
            [{"role": "system", "content": "B"}, {"role": "user", "content": "q"}],
        ),  # system prompt
        ([{"role": "user", "content": "q"}], [{"role": "user", "content": "q "}]),  # first user message
        ([{"role": "user", "content": "q"}], [{"role": "user", "content": [{"type": "text", "text": "q"}]}]),
    ],
)
def test_the_leading_messages_are_hashed(a, b):
    assert chat_key(a) != chat_key(b)


def test_tools_are_part_of_the_key_and_key_order_is_not():
    messages = [{"role": "user", "content": "q"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert chat_key(messages, tools=[tool]) != chat_key(messages)
    reordered = json.dumps({"tools": [tool], "messages": [{"content": "q", "role": "user"}]}).encode()
    assert prompt_affinity_key(CHAT, reordered) == chat_key(messages, tools=[tool])


def test_sampling_fields_do_not_change_the_key():
    messages = [{"role": "user", "content": "q"}]
    assert chat_key(messages, temperature=0.7, max_tokens=9, stream=True) == chat_key(messages)


def test_a_completions_prompt_keys_on_its_first_characters():
    first = "x" * PROMPT_KEY_CHARS
    key = prompt_affinity_key(COMPLETIONS, json.dumps({"prompt": first + " turn 1"}).encode())
    assert key == prompt_affinity_key(COMPLETIONS, json.dumps({"prompt": first + " turn 1 reply turn 2"}).encode())
    assert key == prompt_affinity_key(COMPLETIONS, json.dumps({"prompt": [first + "!"]}).encode())
    short = prompt_affinity_key(COMPLETIONS, json.dumps({"prompt": "short"}).encode())
    assert short not in (None, key)  # a short prompt keys on all of itself


def test_token_prompts_key_on_their_first_ids():
    ids = list(range(PROMPT_KEY_TOKENS))
    assert key_of_body(COMPLETIONS, {"prompt": ids + [1]}) == key_of_body(COMPLETIONS, {"prompt": [ids + [2, 3]]})


@pytest.mark.parametrize(
    "path, body",
    [
        (CHAT, b"not json"),
        (CHAT, b"[1, 2]"),
        (CHAT, json.dumps({"messages": []}).encode()),
        (CHAT, json.dumps({"messages": "hi"}).encode()),
        (COMPLETIONS, json.dumps({"prompt": ""}).encode()),
        (COMPLETIONS, json.dumps({"prompt": ["a", "b"]}).encode()),
        (COMPLETIONS, json.dumps({"prompt": [1, "a"]}).encode()),
        ("/v1/models", b""),
        ("/health", json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode()),
    ],
)
def test_no_key(path, body):
    assert prompt_affinity_key(path, body) is None
