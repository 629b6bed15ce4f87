"""The affinity key of a request without a session id: a hash of its prompt's leading
text, the same for every turn of a conversation.

Clients resend the whole conversation every turn, so the key hashes what every turn shares,
as canonical JSON (sorted keys). `/v1/chat/completions`: the messages up to and including
the first `user` message, and the request's `tools` when it has any. `/v1/completions`: the
first `PROMPT_KEY_CHARS` characters of a text prompt, or the first `PROMPT_KEY_TOKENS` ids of
a token prompt (a shorter prompt keys whole, so its conversation changes key once). Anything
else has no key; the server answers it as usual, 4xx included.

>>> turn_1 = {"messages": [{"role": "user", "content": "hi"}]}
>>> turn_2 = {"messages": [{"role": "user", "content": "hi"},
...                        {"role": "assistant", "content": "hello"},
...                        {"role": "user", "content": "how are you?"}]}
>>> key_of_body("/v1/chat/completions", turn_1) == key_of_body("/v1/chat/completions", turn_2)
True
"""

from __future__ import annotations

import hashlib
import json

PROMPT_KEY_CHARS = 256
PROMPT_KEY_TOKENS = 64
KEYED_PATHS = ("/v1/chat/completions", "/v1/completions")


def prompt_affinity_key(path: str, body: bytes) -> str | None:
    """The key of a request's raw body, or None (not a generation path, or not JSON)."""
    if path not in KEYED_PATHS:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return key_of_body(path, parsed)


def key_of_body(path: str, body) -> str | None:
    """The key of a parsed body: see the module docstring for what is hashed."""
    if not isinstance(body, dict):
        return None
    if path == "/v1/chat/completions":
        leading = _leading_messages(body.get("messages"))
        if leading is None:
            return None
        shared = {"messages": leading, **({"tools": body["tools"]} if body.get("tools") else {})}
    elif path == "/v1/completions":
        shared = _prompt_head(body.get("prompt"))
        if shared is None:
            return None
    else:
        return None
    text = json.dumps(shared, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "prompt:" + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _leading_messages(messages) -> list | None:
    """The messages up to and including the first user message (all of them if none is)."""
    if not isinstance(messages, list) or not messages:
        return None
    for index, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return messages[: index + 1]
    return messages


def _prompt_head(prompt) -> str | list | None:
    """The leading part of a completions prompt: text, token ids, or a list of one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt[:PROMPT_KEY_CHARS]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt[:PROMPT_KEY_TOKENS]
    return None
