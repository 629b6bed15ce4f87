"""API keys, per-key lane caps, request limits and error hygiene, through real Serve."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from rel_helpers import AUTH, KEY_HIGH, KEY_NORMAL, PROMPT

pytestmark = pytest.mark.serve

INTERNAL_DETAIL = re.compile(r"Traceback|File \"|\.py\b|site-packages|/work/|/tmp/|/home/|/root/")


def lane_finishes(base: str, lane: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("specslot_requests_total{") and f'lane="{lane}"' in line
    )


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/models"),
        ("GET", "/v1/internal/scheduler"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
    ],
)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-key-0000", f"Basic {KEY_HIGH}", f"Bearer {KEY_HIGH}x", "Bearer", KEY_HIGH]
)
def test_openai_routes_need_a_valid_key(rel_app, method, path, auth):
    headers = {"Authorization": auth} if auth is not None else {}
    body = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.request(method, f"{rel_app}{path}", headers=headers, timeout=10, json=body if method == "POST" else None)
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert not INTERNAL_DETAIL.search(r.text)


def test_health_and_metrics_stay_public_and_a_key_opens_v1(rel_app):
    assert httpx.get(f"{rel_app}/health").json()["status"] == "ok"
    assert "specslot_requests_total" in httpx.get(f"{rel_app}/metrics").text
    for key in (KEY_HIGH, KEY_NORMAL):
        r = httpx.get(f"{rel_app}/v1/models", headers={"Authorization": f"bearer {key}"})
        assert r.status_code == 200


@pytest.mark.parametrize(
    "key, claimed, served",
    [
        (KEY_HIGH, "high", "high"),
        (KEY_NORMAL, "high", "normal"),
        (KEY_NORMAL, "low", "low"),
        (KEY_HIGH, "not-a-lane", "normal"),
    ],
)
def test_each_key_caps_the_lane_it_may_claim(rel_app, key, claimed, served):
    before = lane_finishes(rel_app, served)
    r = httpx.post(
        f"{rel_app}/v1/completions",
        timeout=30,
        headers={"Authorization": f"Bearer {key}", "X-Priority": claimed},
        json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200
    assert lane_finishes(rel_app, served) == before + 1


LIMITS = [  # (body, status, code): REL_ARGS caps max_tokens at 300 and bodies at 64 KiB
    ({"prompt": "hi", "max_tokens": 301}, 400, "invalid_value"),
    ({"prompt": "hi", "max_tokens": 10**9}, 400, "invalid_value"),
    ({"prompt": "x = 1\n" * 400, "max_tokens": 3}, 400, "context_length_exceeded"),
    ({"prompt": [7] * 500, "max_tokens": 100}, 400, "context_length_exceeded"),
    ({"prompt": "x" * (70 * 1024)}, 413, "body_too_large"),
]


@pytest.mark.parametrize("body, status, code", LIMITS)
def test_limits_on_body_prompt_and_max_tokens(rel_app, body, status, code):
    r = httpx.post(f"{rel_app}/v1/completions", headers=AUTH, content=json.dumps(body), timeout=30)
    assert r.status_code == status and r.json()["error"]["code"] == code, r.text[:300]
    assert not INTERNAL_DETAIL.search(r.text)


def test_omitted_max_tokens_is_clipped_to_the_context_left(rel_app):
    prompt = [7] * 500  # 12 positions left of the tiny model's 512
    r = httpx.post(f"{rel_app}/v1/completions", headers=AUTH, timeout=60, json={"prompt": prompt, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 12


def test_no_internal_detail_in_any_error_body(rel_app):
    """Every error this app can be pushed into, including 404 / 405, reads clean."""
    probes = [
        ("GET", "/v1/completions", None),
        ("POST", "/v1/nope", b"{}"),
        ("DELETE", "/health", None),
        ("POST", "/v1/completions", b'{"prompt": "a\\ud800"}'),
        ("POST", "/v1/completions", b"\xff"),
        ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": {"a": 1}}]}'),
    ]
    for method, path, body in probes:
        r = httpx.request(method, f"{rel_app}{path}", headers=AUTH, content=body, timeout=10)
        assert 400 <= r.status_code < 500, (path, r.status_code)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert not INTERNAL_DETAIL.search(r.text), r.text
