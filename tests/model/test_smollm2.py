"""The default deployment's real model, SmolLM2-135M-Instruct (llama, 30 layers; its GGUF
file from the pinned PyPI wheel, converted by `models.loading.gguf`, dequantized to float32 on
the CPU), end to end:

- greedy chat answers a factual question;
- every drafter's greedy streams equal classic decode token for token, four requests at
  once rotating through the slot (n-gram drafts, and the distilled draft model shipped in
  models/drafts/smollm2);
- structured output (a JSON schema, forced tool calls), a tool-call history through
  SmolLM2's own template (which renders only `content`), and finite logprobs, through the
  real HTTP layer and an in-process engine (no Ray), as tests/serve/test_structured_engine.py
  does with the bundled model.

The runners get fixed tick costs instead of measuring their own at load: on a 2-core CPU
measuring SmolLM2's forwards takes minutes, and these tests check streams and outputs,
not costs (tests/model/test_fused_real.py pins costs the same way).
"""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from tests.conftest import SMOLLM2_QUESTIONS as QUESTIONS

from .conftest import drain, make_request
from .helpers import run_classic

pytestmark = pytest.mark.model

MAX_TOKENS = 32
# Forward costs (seconds) of the order tests/model/test_fused_real.py fixes for the bundled
# pair: the runners here take these instead of measuring SmolLM2's own.
QUIET_COSTS = dict(
    decode={1: 0.0100, 2: 0.0110, 4: 0.0130, 8: 0.0170},
    fused={0: 0.0140, 2: 0.0150, 4: 0.0170, 8: 0.0210},
    all_verify={2: 0.0160, 4: 0.0220, 8: 0.0330},
)
SHIPPED_DRAFT = os.path.join(  # SmolLM2's distilled draft, in the repository
    os.path.dirname(__file__), "..", "..", "models", "drafts", "smollm2"
)
SERVED = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CAPITAL = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "maxLength": 24},
        "capital": {"type": "string", "maxLength": 24},
        "continent": {"enum": ["Africa", "Asia", "Europe", "Oceania", "America"]},
    },
    "required": ["country", "capital", "continent"],
    "additionalProperties": False,
}
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "clear"}'},
]


@pytest.fixture(scope="module", autouse=True)
def fixed_tick_costs():
    """Every runner built in this module takes `QUIET_COSTS` instead of measuring."""
    from models.forward import tick_costs
    from models.speculative.drafters import DraftModelDrafter
    from scheduler.costs import TickCosts

    def measure(model, drafter, *args, **kwargs):
        return TickCosts(draft=0.0055 if isinstance(drafter, DraftModelDrafter) else 0.0, **QUIET_COSTS)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tick_costs, "measure", measure)
        yield


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(smollm2_dir))
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts):
    """Classic decode (mlx-lm's BatchGenerator), each prompt alone, greedy, on the model as
    the runner loads it (float32): ({r0..r3: tokens}, the smallest top-1 minus top-2
    logit along those streams)."""
    from models.loading import dense_weights
    from models.loading.loader import load_pair
    from models.tiny import greedy_margins

    target, _ = load_pair(smollm2_dir, None)
    assert dense_weights.apply(target.model, target.name, None) > 0  # Q4_1 / Q8_0 -> float32 here
    eos = sorted(target.tokenizer.eos_token_ids)
    assert eos == [2]
    out, margin = {}, math.inf
    for i, ids in enumerate(prompts):
        ((tokens, _),) = run_classic(target.model, [make_request(f"r{i}", ids, MAX_TOKENS)], eos).values()
        out[f"r{i}"] = tokens
        margin = min(margin, *greedy_margins(target.model, ids, len(tokens)))
    return out, margin


@pytest.fixture(scope="module")
def classic(reference):
    return reference[0]


def test_greedy_margins_are_far_above_float_noise(reference):
    """Guards the parity test below against passing or failing by float luck: every greedy
    choice must win by far more than float32 rounding moves a logit between batched,
    verifying and single-step forwards (the smallest seen here: ~0.03)."""
    assert reference[1] > 1e-3, f"a near-tie (margin {reference[1]:.2e}) in the reference streams"


@pytest.fixture(scope="module")
def runners(smollm2_dir):
    """`runners(kind)`: an MlxRunner over SmolLM2 drafting with `kind`, loaded once."""
    from models.runner import MlxRunner

    loaded = {}

    def get(kind):
        if kind not in loaded:
            loaded[kind] = MlxRunner.from_paths(
                smollm2_dir,
                drafter_kind=kind,
                num_draft_tokens=4,
                drafter_path=SHIPPED_DRAFT if kind == "draft_model" else None,
            )
        return loaded[kind]

    yield get
    for runner in loaded.values():
        runner.close()


def drive(runner, prompts, **overrides):
    """All requests submitted at once, greedy; returns ({request id: tokens}, requests)."""
    scheduler = Scheduler(runner, SchedulerConfig(**{"b1_policy": "on", **overrides}))
    requests = [make_request(f"r{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.submit(r)
    streams = drain(scheduler, {r.request_id: [] for r in requests}, max_ticks=2000)
    assert runner.num_live_sessions() == 0 and runner.num_classic_rows() == 0
    return streams, requests


def test_classic_decode_answers_and_stops(classic, smollm2_dir):
    from pathlib import Path

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(Path(smollm2_dir))
    answer = tokenizer.decode(classic["r0"])
    assert "Paris" in answer and classic["r0"][-1] == 2, answer  # <|im_end|> ends the turn
    assert all(len(tokens) > 4 for tokens in classic.values())


def test_the_shipped_draft_was_trained_on_this_target(smollm2_dir):
    """Its provenance names the fingerprint of the SmolLM2 file the tests fetch, and the
    loader pairs the two (same vocabulary)."""
    from models.loading.loader import load_pair

    with open(os.path.join(SHIPPED_DRAFT, "provenance.json")) as f:
        record = json.load(f)
    target, draft = load_pair(smollm2_dir, SHIPPED_DRAFT)
    assert record["target"]["fingerprint"] == target.fingerprint
    assert draft.model.args.num_hidden_layers == record["draft"]["config"]["num_hidden_layers"] < 30


@pytest.mark.parametrize("kind, tick_mode", [("ngram", "fused"), ("ngram", "alternate"), ("draft_model", "fused")])
def test_four_rotating_streams_equal_classic_decode(runners, prompts, classic, kind, tick_mode):
    runner = runners(kind)
    assert runner.can_fuse(), runner.fuse_blocker
    streams, requests = drive(runner, prompts, grant_rounds=2, tick_mode=tick_mode)
    for r in requests:
        assert streams[r.request_id] == classic[r.request_id], (kind, tick_mode, r.request_id)
    spec = [r.spec for r in requests]
    print(f"\n{kind} / {tick_mode}: {[(s.num_rounds, s.num_drafted, s.num_accepted, s.num_grants) for s in spec]}")
    # the slot rotated among the requests, and drafts were both accepted and rejected
    assert sum(s.num_grants > 0 for s in spec) >= 2 and sum(s.num_grants for s in spec) >= 4
    accepted, drafted = sum(s.num_accepted for s in spec), sum(s.num_drafted for s in spec)
    assert 0 < accepted < drafted
    if kind == "draft_model":  # on a CPU rounds stop by the draft's confidence (`draft_confidence`)
        assert runner.slot_drafts_vary() and drafted < runner.num_draft_tokens * sum(s.num_rounds for s in spec)


# -- through the HTTP layer ---------------------------------------------------------------


class Served:
    """An in-process engine over SmolLM2 behind the real HTTP layer, on its own event loop;
    `run(coro_fn)` calls `coro_fn(openai_client)` there."""

    def __init__(self, model_dir: str):
        self.loop = asyncio.new_event_loop()
        self.model_dir = model_dir
        self.client, self.http, self.openai = self.loop.run_until_complete(self._start())

    async def _start(self):
        import httpx
        from openai import AsyncOpenAI

        from serve_app.configuration.args import ServeArgs
        from serve_app.deployment.actor import build_engine
        from serve_app.deployment.client import EngineClient, LocalSource
        from serve_app.openai.codec import TextCodec
        from serve_app.openai.http import OpenAIService

        args = ServeArgs.model_validate(
            {"model": self.model_dir, "served_model_name": SERVED, "drafter": {"kind": "ngram"}, "max_batch_size": 4}
        )
        client = EngineClient(LocalSource(lambda: build_engine(args)))
        service = OpenAIService(client, None, args)
        await client.start()
        codec = TextCodec.from_path(self.model_dir)
        assert codec.tool_format.name == "hermes"  # SmolLM2's template names no format: the default
        service.mark_ready(codec)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=service.app()), base_url="http://t/v1")
        return client, http, AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http)

    def run(self, coro_fn):
        return self.loop.run_until_complete(coro_fn(self.openai))

    def close(self):
        self.loop.run_until_complete(self.http.aclose())
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


@pytest.fixture(scope="module")
def served(smollm2_dir):
    s = Served(smollm2_dir)
    yield s
    s.close()


def chat(served, messages, **kw):
    return served.run(
        lambda openai: openai.chat.completions.create(model=SERVED, messages=messages, temperature=0, **kw)
    )


@pytest.fixture(scope="module")
def paris_reply(served):
    return chat(served, [{"role": "user", "content": QUESTIONS[0]}], max_tokens=24, logprobs=True, top_logprobs=3)


def test_greedy_chat_answers_a_factual_question(paris_reply, classic, prompts):
    choice = paris_reply.choices[0]
    assert "Paris" in choice.message.content, choice.message.content
    assert choice.finish_reason == "stop"
    assert paris_reply.usage.prompt_tokens == len(prompts[0])
    assert paris_reply.usage.completion_tokens == len(classic["r0"])  # its <|im_end|> included


def test_logprobs_are_finite_and_ordered(paris_reply):
    content = paris_reply.choices[0].logprobs.content
    assert len(content) == paris_reply.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(paris_reply.choices[0].message.content)
    for entry in content:
        assert math.isfinite(entry.logprob) and entry.logprob <= 0
        top = [t.logprob for t in entry.top_logprobs]
        assert len(top) == 3 and all(math.isfinite(v) for v in top)
        assert top == sorted(top, reverse=True) and entry.top_logprobs[0].logprob == entry.logprob  # greedy
        assert sum(math.exp(v) for v in top) <= 1 + 1e-5
    assert sum(e.logprob for e in content) > -20  # a confident answer, not noise


def test_a_json_schema_reply_validates(served):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL, "strict": True}}
    reply = chat(
        served,
        [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format=fmt,
        max_tokens=64,
    )
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), CAPITAL)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
def test_a_forced_tool_call_is_valid(served, tool_choice):
    import jsonschema

    reply = chat(
        served, [HISTORY[0]], tools=[WEATHER], tool_choice=tool_choice, max_tokens=64, parallel_tool_calls=False
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_tool_call_history_renders_through_smollm2s_own_template(smollm2_dir):
    """SmolLM2's template reads `content` on every message and never renders
    `tool_calls`: the assistant's call reaches it as Hermes text in its content."""
    from serve_app.openai.chat import ChatMessage, template_messages
    from serve_app.openai.codec import TextCodec
    from serve_app.openai.tool_formats import ToolFormat

    codec = TextCodec.from_path(smollm2_dir)
    ids = codec.encode_chat(template_messages([ChatMessage.model_validate(m) for m in HISTORY]))
    text = codec._tok.decode(ids, skip_special_tokens=False)
    assert ids[0] == 1 and text.startswith("<|im_start|>system\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = ToolFormat("hermes").read(turn, frozenset({"get_weather"}))
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    assert '<|im_start|>tool\n{"temperature": 18, "sky": "clear"}<|im_end|>\n' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_tool_call_history_is_answered(served):
    reply = chat(served, HISTORY, tools=[WEATHER], max_tokens=24)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert reply.usage.prompt_tokens > 40  # the call and its result were in the prompt


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_slab_takes_smollm2_in_half_precision_and_refuses_a_layout_bug(smollm2_dir, monkeypatch, dtype):
    """The load check's criterion on real weights (what a GPU serves: half precision):
    packed forwards that differ from separate ones by rounding pass, and a slab that hands
    each row another row's logits (a layout bug) is refused."""
    import mlx.core as mx

    from models.forward import slab
    from models.loading import dense_weights
    from models.loading.loader import load_model

    target = load_model(smollm2_dir, "target")
    dense_weights.apply(target.model, target.name, None)
    target.model.set_dtype(getattr(mx, dtype))
    text = "The quick brown fox jumps over the lazy dog while the old cat sleeps on a warm mat."
    ids = list(target.tokenizer.encode(text))
    assert len(ids) >= 17
    assert slab.check_support(target.model, token_ids=ids) is None

    forward = slab.Slab.forward

    def rows_rotated(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out[1:] + out[:1]

    monkeypatch.setattr(slab.Slab, "forward", rows_rotated)
    why = slab.check_support(target.model, token_ids=ids)
    assert why is not None and "differs from separate ones" in why, why


def test_smollm2_writes_requests_of_its_own_to_train_a_draft_on(smollm2_dir):
    """train_draft's self_chat kind: SmolLM2 continues its template's user turn into
    requests, each then rendered for the assistant's turn like any other chat prompt."""
    import mlx.core as mx

    from models.loading import dense_weights
    from models.loading.loader import load_pair
    from scripts.tools import draft_data

    target, _ = load_pair(smollm2_dir, None)
    dense_weights.apply(target.model, target.name, None)
    tokenizer = target.tokenizer
    prefix = draft_data.user_turn_prefix(tokenizer)
    assert tokenizer.decode(prefix).endswith("<|im_start|>user\n")
    mx.random.seed(0)
    prompts, stats = draft_data.self_chat_prompts(target.model, tokenizer, 8, batch_size=8)
    assert stats["prompts"] == 8 and stats["requests_kept"] == len(prompts) >= 4
    texts = [tokenizer.decode(p) for p in prompts]
    assert len(set(texts)) == len(texts)
    for ids, text in zip(prompts, texts):
        assert ids[: len(prefix)] == prefix and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        request = text[len(tokenizer.decode(prefix)) : -len("<|im_end|>\n<|im_start|>assistant\n")]
        assert request.strip() and "<|im_start|>" not in request
