"""Long prompts are tokenized on the replica's tokenizer thread, not on its event loop
(`serve_app.openai.http.TOKENIZE_OFF_LOOP_BYTES`), with the same ids and the same errors."""

from __future__ import annotations

import threading

from local_service import ScriptedClient, make_app, run

from serve_app.openai import http as http_module


def _recording(codec, monkeypatch, name: str) -> list[str]:
    """Patch `codec.name` to note the thread each call runs on."""
    threads: list[str] = []
    original = getattr(codec, name)

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(codec, name, recorded)
    return threads


def test_a_large_chat_body_is_tokenized_on_the_tokenizer_thread(codec, monkeypatch):
    threads = _recording(codec, monkeypatch, "encode_chat")
    small = [{"role": "user", "content": "hello there"}]
    large = [
        {"role": "user", "content": "the quick brown fox " * (http_module.TOKENIZE_OFF_LOOP_BYTES // 20)},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
    ]
    client = ScriptedClient([[5]])
    client.info["max_context"] = 1 << 20

    async def go():
        async with make_app(codec, client) as http:
            for messages in (small, large, small):
                r = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
                assert r.status_code == 200, r.text

    run(go())
    loop_thread = threading.current_thread().name  # asyncio.run's loop runs on this thread
    assert threads[0] == threads[2] == loop_thread
    assert threads[1].startswith("specslot-tokenizer")
    assert [r.prompt_ids for r in client.submitted] == [codec.encode_chat(m) for m in (small, large, small)]


def test_errors_raised_on_the_tokenizer_thread_are_the_same_4xx(codec, monkeypatch):
    threads = _recording(codec, monkeypatch, "encode")
    big_text = "x" * http_module.TOKENIZE_OFF_LOOP_BYTES
    client = ScriptedClient([[5]])

    async def go():
        async with make_app(codec, client) as http:
            out_of_vocab = await http.post(
                "/v1/completions",
                json={"prompt": [codec.vocab_size] * (http_module.TOKENIZE_OFF_LOOP_BYTES // 4), "max_tokens": 1},
            )
            too_long = await http.post("/v1/completions", json={"prompt": big_text, "max_tokens": 1})
            fine = await http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
        return out_of_vocab, too_long, fine

    out_of_vocab, too_long, fine = run(go())
    assert out_of_vocab.status_code == 400 and "outside the vocabulary" in out_of_vocab.json()["error"]["message"]
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert fine.status_code == 200
    assert threads[0].startswith("specslot-tokenizer") and threads[1] == threading.current_thread().name
    assert len(client.submitted) == 1
