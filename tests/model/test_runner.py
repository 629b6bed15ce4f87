"""MlxRunner satisfies scheduler.model_api.ModelRunner on real tiny models."""

import inspect
import re

import pytest

from models.runner import MlxRunner
from models.speculative.session import PROBE_TOKENS
from scheduler.model_api import ModelRunner, RoundOutcome, TokenBatch

from .conftest import make_request
from .helpers import run_classic

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def runner(tiny_pair):
    r = MlxRunner.from_paths(tiny_pair[0], drafter_kind="draft_model", drafter_path=tiny_pair[1], num_draft_tokens=3)
    yield r
    r.close()


def classic_expected(runner, prompt, max_tokens, **sampling):
    req = make_request("x", prompt, max_tokens, **sampling)
    return run_classic(runner.target.model, [req], runner.eos_token_ids)["x"]


def test_implements_every_protocol_method(runner):
    for name, member in inspect.getmembers(ModelRunner, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(runner, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(member).parameters)[1:]


def test_attributes_and_policy_key(runner):
    assert runner.max_context == 512
    assert runner.eos_token_ids == [0]
    assert runner.tokenizer.encode("def")
    # models are named by content (models.loading.checks.model_fingerprint), not by directory
    assert re.fullmatch(r"[0-9a-f]{16}\|draft_model:[0-9a-f]{16}\|cpu-[\w]+\|K=3\|blas [\w+-]+", runner.policy_key())


def test_spec_supports(runner, prompt_ids):
    p = prompt_ids[0]
    assert runner.spec_supports(make_request("a", p, 16))
    assert runner.spec_supports(make_request("a", p, 16, temperature=0.7, top_p=0.9, seed=1))
    assert not runner.spec_supports(make_request("a", [], 16))
    assert not runner.spec_supports(make_request("a", p, 512))  # beyond the context
    assert not runner.spec_supports(make_request("a", p, 16, top_p=0.0))


def test_no_drafter_means_classic_only(tiny_pair, prompt_ids):
    r = MlxRunner.from_paths(tiny_pair[0], drafter_kind=None)
    assert not r.spec_supports(make_request("a", prompt_ids[0], 8))
    assert "|none:none|" in r.policy_key()
    with pytest.raises(ValueError, match="drafter_path"):
        MlxRunner.from_paths(tiny_pair[0], drafter_kind="draft_model")
    with pytest.raises(ValueError, match="drafter_kind"):
        MlxRunner.from_paths(tiny_pair[0], drafter_kind="medusa")


def test_classic_prefill_decode_remove(runner, prompt_ids):
    a, b = make_request("a", prompt_ids[1], 6), make_request("b", prompt_ids[2], 3)
    first = runner.classic_prefill([a, b])
    assert [t.request_id for t in first] == ["a", "b"]
    assert all(len(t.token_ids) == 1 and t.finish_reason is None for t in first)
    assert runner.num_classic_rows() == 2
    # A later prefill does not advance existing rows; the new row then decodes with them.
    c = make_request("c", prompt_ids[3], 4)
    (only_c,) = runner.classic_prefill([c])
    assert only_c.request_id == "c" and len(only_c.token_ids) == 1 and only_c.finish_reason is None
    assert runner.num_classic_rows() == 3
    out = {"a": first[0].token_ids, "b": first[1].token_ids, "c": only_c.token_ids}
    reasons = {}
    while len(reasons) < 3:
        step = runner.classic_decode()
        # One token per row while rows share the batch; a row left alone may get a
        # short burst (classic_burst_ms).
        assert all(isinstance(t, TokenBatch) and len(t.token_ids) >= 1 for t in step)
        assert len(step) == 1 or all(len(t.token_ids) == 1 for t in step)
        for t in step:
            out[t.request_id] += t.token_ids
            if t.finish_reason:
                reasons[t.request_id] = t.finish_reason
                runner.classic_remove(t.request_id)
                runner.classic_remove(t.request_id)  # idempotent
    assert runner.num_classic_rows() == 0
    assert (out["a"], reasons["a"]) == classic_expected(runner, prompt_ids[1], 6)
    assert (out["b"], reasons["b"]) == classic_expected(runner, prompt_ids[2], 3)
    assert (out["c"], reasons["c"]) == classic_expected(runner, prompt_ids[3], 4)
    # A row that finishes at its first token.
    (d,) = runner.classic_prefill([make_request("d", prompt_ids[9], 1)])
    assert len(d.token_ids) == 1 and d.finish_reason == "length"
    runner.classic_remove("d")


def test_spec_begin_round_park_resume_finish(runner, prompt_ids):
    expected = {i: classic_expected(runner, prompt_ids[i], 16) for i in (4, 5)}
    a, b = make_request("a", prompt_ids[4], 16), make_request("b", prompt_ids[5], 16)
    out = {"a": runner.spec_begin(a).token_ids, "b": None}
    r = runner.spec_round("a")
    assert isinstance(r, RoundOutcome) and len(r.token_ids) == r.num_accepted + 1 and r.seconds > 0
    out["a"] += r.token_ids
    runner.spec_park("a")
    with pytest.raises(RuntimeError, match="does not hold the drafter"):
        runner.spec_round("a")
    probe = runner.spec_round("a", probe=True)  # probes need no drafter
    assert (probe.probe, probe.num_drafted) == (True, 0) and 1 <= len(probe.token_ids) <= PROBE_TOKENS
    assert probe.seconds_per_token is not None and 0 < probe.seconds_per_token <= probe.seconds
    out["a"] += probe.token_ids
    out["b"] = runner.spec_begin(b).token_ids
    out["b"] += runner.spec_round("b").token_ids
    runner.spec_park("b")
    assert runner.num_live_sessions() == 2
    reasons = {}
    for rid in ("a", "b", "a", "b") * 20:
        if rid in reasons:
            continue
        runner.spec_resume(rid)
        r = runner.spec_round(rid)
        out[rid] += r.token_ids
        runner.spec_park(rid)
        if r.finish_reason:
            reasons[rid] = r.finish_reason
            runner.spec_finish(rid)
            runner.spec_finish(rid)  # idempotent
    assert (out["a"], reasons["a"]) == expected[4]
    assert (out["b"], reasons["b"]) == expected[5]
    assert runner.num_live_sessions() == 0


def test_stop_token_inside_an_accepted_run(runner, prompt_ids):
    """A per-request stop id cuts the round at that token, like classic decode."""
    tokens, _ = classic_expected(runner, prompt_ids[7], 16)
    stop = tokens[5]
    cut = tokens[: tokens.index(stop) + 1]
    req = make_request("s", prompt_ids[7], 16, stop_token_ids=(stop,))
    assert classic_expected(runner, prompt_ids[7], 16, stop_token_ids=(stop,)) == (cut, "stop")
    out = runner.spec_begin(req).token_ids
    while True:
        r = runner.spec_round("s")
        out += r.token_ids
        if r.finish_reason:
            break
    runner.spec_finish("s")
    assert (out, r.finish_reason) == (cut, "stop")


def test_max_tokens_one(runner, prompt_ids):
    first = runner.spec_begin(make_request("m", prompt_ids[8], 1))
    assert len(first.token_ids) == 1 and first.finish_reason == "length"
    runner.spec_finish("m")
    assert runner.num_live_sessions() == 0


def test_cancel_a_classic_row_and_an_active_session(runner, prompt_ids):
    a, b = make_request("a", prompt_ids[10], 8), make_request("b", prompt_ids[11], 8)
    out_b = runner.classic_prefill([a, b])[1].token_ids
    out_b += [t for tb in runner.classic_decode() if tb.request_id == "b" for t in tb.token_ids]
    runner.classic_remove("a")  # cancelled mid-stream; b carries on unaffected
    reason = None
    while reason is None:
        (tb,) = runner.classic_decode()
        out_b += tb.token_ids
        reason = tb.finish_reason
    runner.classic_remove("b")
    assert runner.num_classic_rows() == 0
    assert (out_b, reason) == classic_expected(runner, prompt_ids[11], 8)

    runner.spec_begin(make_request("x", prompt_ids[12], 16))
    runner.spec_round("x")
    runner.spec_finish("x")  # cancelled while holding the drafter
    assert runner.num_live_sessions() == 0
    runner.spec_begin(make_request("y", prompt_ids[12], 16))  # the drafter is free again
    runner.spec_finish("y")


@pytest.mark.parametrize("backend", ["slab", "generator"])
def test_both_batch_backends_implement_every_classic_rows_member(backend):
    """The runner asks a classic batch only through `ClassicRows`: both backends carry
    every attribute it declares and every method with the same parameters."""
    from models.batch.generator_batch import GeneratorBatch
    from models.batch.protocol import ClassicRows
    from models.batch.slab_batch import SlabBatch

    cls = SlabBatch if backend == "slab" else GeneratorBatch
    for name in ClassicRows.__annotations__:
        assert hasattr(cls, name) or name in _instance_attributes(cls), f"{cls.__name__} lacks {name}"
    for name, member in inspect.getmembers(ClassicRows, inspect.isfunction):
        if name.startswith("_"):
            continue
        ours = getattr(cls, name)
        assert list(inspect.signature(ours).parameters) == list(inspect.signature(member).parameters), name


def _instance_attributes(cls) -> set[str]:
    """Names `__init__` assigns on `self`."""
    source = inspect.getsource(cls.__init__)
    return set(re.findall(r"self\.([a-z_]+)\s*[:=]", source))
