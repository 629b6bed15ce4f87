"""Bad input, priority lanes, disconnects, live reconfiguration and queue overload
through real Ray Serve (the `main` app from test_serve_app's helpers)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai
import pytest
from serve_helpers import MODEL, PROMPT, deploy, oai, wait_until

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_pair):
    # Small limits so the matrix can hit them; a second route keeps it apart from `main`.
    # A fixed code version: a redeploy that changes only `user_config` is then a live
    # reconfigure of the same replica, as with `serve deploy` of a YAML (which versions
    # code by the config's hash). The Python API otherwise draws a random version per
    # `serve.run`; `_internal=True` is how Serve's own declarative path passes one.
    return deploy(
        ray_cluster,
        tiny_pair,
        "behaviour",
        "/b",
        args={"max_tokens_limit": 300, "max_body_bytes": 64 * 1024, "max_queue_depth": 4, "backlog_cap": 4},
        **PINNED_VERSION,
    )


PINNED_VERSION = {"version": "behaviour-1", "_internal": True}


def snapshot(base):
    return httpx.get(f"{base}/v1/internal/scheduler", timeout=10).json()


LONG_PROMPT = "x = 1\n" * 400  # well over the tiny model's 512-token context
HI = {"prompt": "hi", "max_tokens": 3}
USER = [{"role": "user", "content": "hi"}]


def j(body) -> bytes:
    return json.dumps(body).encode()


# (route, body, expected status[, headers]): each must be a 4xx with an OpenAI error body
# (or 200 where the input is odd but valid), never a 5xx.
BAD_BODIES = [
    ("completions", b"{not json", 400),
    ("completions", b"\xff\xfe\x00garbage", 400),
    ("completions", b"[1, 2, 3]", 400),
    ("completions", b'"just a string"', 400),
    ("completions", json.dumps({"max_tokens": 5}).encode(), 400),  # missing prompt
    ("completions", json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": -3}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": 2.5}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": "10"}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": 301}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": 10**12}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "temperature": "hot"}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "stop": [""]}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "n": 9}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "bogus_field": 1}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "model": "gpt-4"}).encode(), 400),
    ("completions", json.dumps({"prompt": "", "max_tokens": 3}).encode(), 400),
    ("completions", json.dumps({"prompt": [1, -2]}).encode(), 400),
    ("completions", json.dumps({"prompt": [10**9]}).encode(), 400),
    ("completions", json.dumps({"prompt": LONG_PROMPT, "max_tokens": 5}).encode(), 400),
    ("completions", json.dumps({"prompt": "hi", "max_tokens": 300}).encode(), 200),  # fits
    ("completions", json.dumps({"prompt": "hi", "stream_options": {"include_usage": True}}).encode(), 400),
    ("chat/completions", json.dumps({"messages": []}).encode(), 400),
    ("chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), 400),
    ("chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode(), 400),
    ("chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400),
    ("chat/completions", json.dumps({"messages": "hello"}).encode(), 400),
    ("chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}).encode(), 400),
    ("completions", b"{" * 100_000, 413),
    ("completions", b" " * (65 * 1024), 413),
    # -- malformed bodies and types
    ("completions", b"", 400),
    ("completions", b"null", 400),
    ("completions", b"{}", 400),
    ("completions", b"[" * 50_000, 400),  # nesting deeper than the parser's recursion limit
    ("completions", b'{"prompt": "a\\ud800b"}', 400),  # an unpaired surrogate escape
    ("completions", b'{"prompt": "hi", "prompt": 5}', 400),  # duplicate key: the last wins
    ("completions", j({"prompt": None}), 400),
    ("completions", j({"prompt": 123}), 400),
    ("completions", j({"prompt": ["a", "b"]}), 400),
    ("completions", j({"prompt": [[1, 2], [3, 4]]}), 400),  # a batch of prompts
    ("completions", j({"prompt": [1.5, 2]}), 400),
    ("completions", j({**HI, "max_tokens": True}), 400),
    ("completions", b'{"prompt": "hi", "max_tokens": Infinity}', 400),
    ("completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("completions", j({**HI, "max_tokens": 2**70}), 400),
    ("completions", j({**HI, "max_tokens": -(2**70)}), 400),
    ("completions", j({**HI, "max_completion_tokens": 3}), 400),  # both limits given
    ("completions", j({"prompt": "hi", "max_completion_tokens": 0}), 400),
    ("completions", j({**HI, "seed": 2**70}), 400),
    ("completions", j({**HI, "stream": 1}), 400),
    ("completions", j({**HI, "stop": 5}), 400),
    ("completions", j({**HI, "stop": ["x" * 300]}), 400),
    ("completions", j({**HI, "echo": True}), 400),
    ("completions", j({**HI, "logprobs": 6}), 400),  # out of OpenAI's range (0..5)
    ("completions", j({**HI, "presence_penalty": 2.5}), 400),  # out of OpenAI's range
    ("completions", j({**HI, "model": ""}), 400),
    ("completions", j({**HI, "user": "u" * 300}), 400),
    ("completions", j({**HI, "stream": True, "stream_options": {"include_usage": "y"}}), 400),
    ("completions", j({"prompt": [5] * 600, "max_tokens": 3}), 400),  # ids past the context
    ("completions", j({"prompt": "hi", "max_tokens": 510}), 400),  # > max_tokens_limit
    ("completions", j({"prompt": "hi\u0000there", "max_tokens": 3}), 200),  # NUL is text
    ("completions", b"a" * (10 * 1024 * 1024), 413),  # a 10 MB body
    ("completions", j({"prompt": "x" * (10 * 1024 * 1024)}), 413),  # 10 MB of valid JSON
    # -- chat specifics
    ("chat/completions", b"{}", 400),
    ("chat/completions", j({"messages": None}), 400),
    ("chat/completions", j({"messages": [{"role": "USER", "content": "hi"}]}), 400),
    ("chat/completions", j({"messages": [{"role": "tool", "content": "hi"}]}), 400),
    ("chat/completions", j({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}), 400),
    (
        "chat/completions",
        j({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}),
        400,
    ),
    ("chat/completions", j({"messages": [{"role": "user", "content": [{"type": "text"}]}]}), 400),
    ("chat/completions", j({"messages": [["user", "hi"]]}), 400),
    ("chat/completions", j({"messages": USER, "tools": []}), 400),
    ("chat/completions", j({"messages": USER, "response_format": {"type": "json_schema"}}), 400),
    ("chat/completions", j({"messages": USER, "n": 0}), 400),
    ("chat/completions", j({"messages": USER, "max_tokens": -1}), 400),
    ("chat/completions", j({"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 3}), 400),
    ("chat/completions", j({"messages": [{"role": "user", "content": "x"}] * 5000}), 413),  # 150 KB
    ("chat/completions", j({"prompt": "hi"}), 400),  # a completions body on the chat route
    ("completions", j({"messages": USER}), 400),  # and the other way round
    # -- absurd X-Priority values: the header is unauthenticated, so they are served as
    #    the normal lane, never an error (scheduler.request.parse_priority)
    ("completions", j(HI), 200, {"X-Priority": "urgent!!!"}),
    ("completions", j(HI), 200, {"X-Priority": "-1"}),
    ("completions", j(HI), 200, {"X-Priority": "99999999999999999999"}),
    ("completions", j(HI), 200, {"X-Priority": "high, low"}),
    ("completions", j(HI), 200, {"X-Priority": "h" * 4000}),
    ("completions", j(HI), 200, {"X-Priority": ""}),
]


@pytest.mark.parametrize("case", BAD_BODIES, ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD_BODIES)])
def test_bad_input_gets_an_openai_error_and_the_service_keeps_running(app, case):
    route, body, status = case[:3]
    headers = {"Content-Type": "application/json", **(case[3] if len(case) > 3 else {})}
    try:
        r = httpx.post(f"{app}/v1/{route}", content=body, timeout=30, headers=headers)
    except httpx.WriteError:  # refused with 413 before the client finished sending
        assert status == 413 and len(body) > 1024 * 1024
        return
    assert r.status_code == status, r.text[:300]
    if status != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "Traceback" not in err["message"] and "/" not in err["message"].replace("/v1", "")
        assert ".py" not in err["message"] and "site-packages" not in r.text


def test_service_healthy_after_the_matrix_and_openai_client_sees_errors(app):
    client = oai(app)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="not-this-one", prompt="hi", max_tokens=3)
    assert info.value.body["code"] == "model_not_found"
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert ok.usage.completion_tokens == 5
    # No input killed the replica or its scheduler actor along the way.
    assert snapshot(app)["replica"]["scheduler_restarts"] == 0
    for path, status in (("/v1/nope", 404), ("/v1/models", 200), ("/health", 200)):
        r = httpx.get(f"{app}{path}")
        assert r.status_code == status
    assert httpx.get(f"{app}/v1/models").json()["data"][0]["id"] == MODEL
    metrics = httpx.get(f"{app}/metrics").text
    for series in (
        "specslot_ttft_seconds_count",
        "specslot:inter_token_latency_seconds_count",
        "specslot_acceptance_length_count",
        "specslot_drafted_tokens_total",
        "specslot_accepted_tokens_total",
        "specslot:spec_decode_num_drafts_total",
        "specslot:spec_decode_num_accepted_tokens_total",
        "specslot_scheduler_grants",
        "specslot_scheduler_parks",
        "specslot_scheduler_skip_escalations",
        "specslot_scheduler_backlog_depth",
        "specslot_scheduler_live_sessions",
        'specslot_scheduler_queue_wait_seconds_count{lane="high"}',
        'specslot_requests_total{finish_reason="length",lane="normal"}',
    ):
        assert series in metrics, series


def _stream_request(base, priority, max_tokens=300, prompt=PROMPT):
    headers = {"X-Priority": priority} if priority else {}
    with httpx.stream(
        "POST",
        f"{base}/v1/completions",
        headers=headers,
        timeout=60,
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
    ) as r:
        return r.status_code, r.headers.get("retry-after"), "".join(r.iter_text())


def test_x_priority_lanes_show_in_the_scheduler_and_queue_full_is_503(app):
    seen_lanes: set[str] = set()
    with cf.ThreadPoolExecutor(8) as pool:
        first = pool.submit(_stream_request, app, None)  # takes the slot
        time.sleep(0.3)
        rest = []
        for priority in ("high", "LOW"):  # backlog_cap 4: both always fit in the backlog
            rest.append(pool.submit(_stream_request, app, priority))
            time.sleep(0.1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(f.done() for f in rest):
            state = snapshot(app)
            seen_lanes |= {e["lane"] for e in state["slot"]["backlog"]}
            if state["slot"]["owner"]:
                seen_lanes.add(state["slot"]["owner"]["lane"])
            time.sleep(0.02)
        results = [first.result()] + [f.result() for f in rest]
    assert {"high", "low"} <= seen_lanes, seen_lanes
    assert _stream_request(app, "bogus", 5)[0] == 200  # an unknown lane is just normal
    assert all(status == 200 and text.rstrip().endswith("data: [DONE]") for status, _, text in results)

    # max_queue_depth 4: a burst of 10 gets some 503s with Retry-After; the rest complete.
    with cf.ThreadPoolExecutor(10) as pool:
        burst = list(pool.map(lambda _: _stream_request(app, "normal", 200), range(10)))
    codes = sorted(s for s, _, _ in burst)
    assert codes.count(200) >= 4 and 503 in codes, codes
    assert all(ra == "1" for s, ra, _ in burst if s == 503)
    assert all(t.rstrip().endswith("data: [DONE]") for s, _, t in burst if s == 200)
    wait_until(lambda: snapshot(app)["unfinished"] == 0, 20)


def disconnects(base) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{base}/metrics").text.splitlines()
        if line.startswith("specslot_requests_total") and 'finish_reason="disconnected"' in line
    )


def test_client_disconnect_mid_stream_leaves_no_live_session(app):
    before = disconnects(app)
    for _ in range(3):
        with httpx.stream(
            "POST",
            f"{app}/v1/completions",
            timeout=30,
            json={"prompt": PROMPT, "max_tokens": 300, "temperature": 0, "stream": True},
        ) as r:
            chunks = r.iter_lines()
            got = [next(chunks) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
        # leaving the block closes the connection mid-stream
    for _ in range(2):  # a non-streaming client that gives up waiting
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{app}/v1/completions",
                timeout=httpx.Timeout(5, read=0.3),
                json={"prompt": PROMPT, "max_tokens": 300, "temperature": 0},
            )

    def drained():
        state = snapshot(app)
        c = state["counters"]
        return (
            state["unfinished"] == 0
            and c["live_sessions"] == 0
            and state["replica"]["open_streams"] == 0
            and state["slot"]["owner"] is None
        )

    wait_until(drained, 20)
    # The streams were abandoned (cancelled in the scheduler) long before their 300
    # tokens; a non-streaming one may finish before the proxy notices, so not counted.
    assert disconnects(app) - before >= 3


def test_live_reconfigure_through_user_config(app, ray_cluster, tiny_pair):
    from ray import serve

    from serve_app.app import SpecslotServer, build_app

    target, draft = tiny_pair
    args = {
        "model": target,
        "served_model_name": MODEL,
        "drafter": {"kind": "draft_model", "path": draft},
        "max_tokens_limit": 300,
        "max_body_bytes": 64 * 1024,
        "max_queue_depth": 4,
        "backlog_cap": 4,
    }
    before = snapshot(app)["replica"]
    bound = build_app(args)._bound_deployment.init_args
    app_v2 = SpecslotServer.options(
        **PINNED_VERSION, user_config={"grant_rounds": 3, "skip_cap": 1, "tick_slice": True}
    ).bind(*bound)
    serve.run(app_v2, name="behaviour", route_prefix="/b", blocking=False)
    wait_until(lambda: snapshot(app)["config"]["grant_rounds"] == 3, 60)
    state = snapshot(app)
    assert state["config"]["skip_cap"] == 1
    # Same version, new user_config: Serve called `reconfigure` on the running replica
    # (same replica, same process, same scheduler actor) instead of replacing it.
    after = state["replica"]
    for key in ("replica_id", "pid", "scheduler_pid", "scheduler_restarts"):
        assert after[key] == before[key], key
    # greedy: at OpenAI's default temperature 1 the tiny random model (512 tokens) can
    # draw its EOS among the 4 tokens; a CI run once ended after 1 token that way
    completion = oai(app).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4
