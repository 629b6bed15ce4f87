"""The OpenAI API through real Ray Serve on 127.0.0.1 (one shared two-node cluster)."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import MODEL, PROMPT, oai, wait_until

pytestmark = pytest.mark.serve


def test_chat_and_completions_streaming_and_not(main_app):
    client = oai(main_app)
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens >= 1
    spec = full.usage.model_extra["speculative"]
    assert set(spec) >= {"rounds", "drafted", "accepted", "grants", "parks"}

    pieces, usage = [], None
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].text  # greedy: streamed == non-streamed
    assert usage.completion_tokens == full.usage.completion_tokens

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    deltas = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
        )
        if c.choices
    ]
    assert "".join(deltas) == chat.choices[0].message.content


def test_greedy_output_equals_engine_direct(main_app, tiny_pair):
    """The served greedy token stream equals the Engine's own, run in this process."""
    from scheduler.request import Request, SamplingParams
    from serve_app.configuration.args import ServeArgs
    from serve_app.deployment.actor import build_engine
    from serve_app.openai.codec import TextCodec

    target, draft = tiny_pair
    args = ServeArgs.model_validate({"model": target, "drafter": {"kind": "draft_model", "path": draft}})
    engine, info = build_engine(args)
    engine.start()
    try:
        codec = TextCodec.from_path(target)
        prompts = [PROMPT, "import os\nimport ", "class Stack:\n    def push(self, item):"]
        for i, prompt in enumerate(prompts):
            engine.submit(
                Request(
                    f"direct-{i}",
                    codec.encode(prompt),
                    SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=tuple(info["eos_token_ids"])),
                )
            )
        outputs: dict[str, list[int]] = {f"direct-{i}": [] for i in range(len(prompts))}
        finished = set()
        while len(finished) < len(prompts):
            for event in engine.get_events(timeout=5):
                outputs[event.request_id].extend(event.token_ids)
                if event.finish_reason:
                    finished.add(event.request_id)
    finally:
        engine.stop()
    client = oai(main_app)
    for i, prompt in enumerate(prompts):
        served = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        ids = [t for t in outputs[f"direct-{i}"] if t not in info["eos_token_ids"]]
        assert served.choices[0].text == codec.decode(ids)
        assert served.usage.completion_tokens == len(outputs[f"direct-{i}"])


def test_text_stop_sequence_truncates_and_frees_the_request(main_app):
    client = oai(main_app)
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    assert len(free) > 8
    stop = free[5:8]
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[: free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    wait_until(lambda: httpx.get(f"{main_app}/v1/internal/scheduler").json()["unfinished"] == 0, 10)
