"""The lone classic row (`models.batch.solo.SoloRow`) and its moves in and out of the batch.

Reference: the same requests through `GeneratorBatch(single_row_fast_path=False)`, i.e.
`BatchGenerator` alone. Streams must be token-identical (greedy and seeded sampling),
with the same finish reasons, whichever path a row takes and however often it moves.
"""

import pytest

from models.batch.generator_batch import GeneratorBatch
from models.batch.solo import SoloRow

from .conftest import make_request
from .helpers import run_classic

pytestmark = pytest.mark.model

SAMPLED = dict(temperature=0.8, top_p=0.9, seed=11)


def eos(loaded):
    return sorted(loaded[0].tokenizer.eos_token_ids)


def reference(loaded, request):
    return run_classic(loaded[0].model, [request], eos(loaded), single_row_fast_path=False)[request.request_id]


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("index", [0, 4, 8])
def test_lone_row_matches_batch_generator(loaded, prompt_ids, index, sampling):
    request = make_request("a", prompt_ids[index], 40, **sampling)
    batch = GeneratorBatch(loaded[0].model, eos_token_ids=eos(loaded))
    (first,) = batch.prefill([request])
    assert isinstance(batch._solo, SoloRow)  # the fast path is really taken
    tokens, reason = list(first.token_ids), first.finish_reason
    while reason is None:
        (b,) = batch.decode()
        tokens += b.token_ids
        reason = b.finish_reason
    assert (tokens, reason) == reference(loaded, request)
    assert batch.num_rows() == 1  # finished, not yet removed
    batch.remove("a")
    assert batch.num_rows() == 0


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_short_budgets(loaded, prompt_ids, max_tokens):
    request = make_request("a", prompt_ids[1], max_tokens)
    got = run_classic(loaded[0].model, [request], eos(loaded))["a"]
    assert got == reference(loaded, request)
    assert len(got[0]) == max_tokens and got[1] == "length"


def test_stop_token_ends_solo_row(loaded, prompt_ids):
    free = reference(loaded, make_request("a", prompt_ids[3], 30))
    stop = free[0][5]
    request = make_request("a", prompt_ids[3], 30, stop_token_ids=(stop,))
    got = run_classic(loaded[0].model, [request], eos(loaded))["a"]
    assert got == reference(loaded, request)
    assert got[1] == "stop" and got[0][-1] == stop and len(got[0]) <= 6


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_moves_in_and_out_of_the_batch_keep_every_stream(loaded, prompt_ids, sampling):
    """a decodes alone, b joins (a moves into the batch), b finishes (a moves out
    again), c joins later: each stream equals its isolated reference."""
    a = make_request("a", prompt_ids[0], 48, **sampling)
    b = make_request("b", prompt_ids[6], 10, **sampling)
    c = make_request("c", prompt_ids[13], 12, **sampling)
    batch = GeneratorBatch(loaded[0].model, eos_token_ids=eos(loaded))
    out = {"a": [], "b": [], "c": []}
    reasons = {}
    moves = []

    def take(batches):
        for tb in batches:
            out[tb.request_id] += tb.token_ids
            if tb.finish_reason:
                reasons[tb.request_id] = tb.finish_reason
                batch.remove(tb.request_id)

    def decode_steps(n):
        for _ in range(n):
            if len(reasons) == 3 or (not batch.num_rows()):
                return
            take(batch.decode())
            moves.append(batch._solo.request_id if batch._solo else None)

    take(batch.prefill([a]))
    decode_steps(5)
    assert batch._solo is not None and batch._solo.request_id == "a"
    take(batch.prefill([b]))
    assert batch._solo is None
    decode_steps(30)  # b finishes within these; a is alone again
    take(batch.prefill([c]))
    decode_steps(200)
    assert set(reasons) == {"a", "b", "c"}
    assert "a" in moves and None in moves  # a really moved back out after b left
    for request in (a, b, c):
        assert (out[request.request_id], reasons[request.request_id]) == reference(loaded, request)
    assert batch.num_rows() == 0


def test_remove_mid_stream_then_new_row(loaded, prompt_ids):
    batch = GeneratorBatch(loaded[0].model, eos_token_ids=eos(loaded))
    batch.prefill([make_request("a", prompt_ids[2], 30)])
    batch.decode()
    batch.remove("a")
    batch.remove("a")  # idempotent
    assert batch.num_rows() == 0 and batch.decode() == []
    request = make_request("b", prompt_ids[5], 12)
    tokens = list(batch.prefill([request])[0].token_ids)
    while len(tokens) < 12:
        tokens += batch.decode()[0].token_ids
    assert (tokens, "length") == reference(loaded, request)


def test_duplicate_request_id_rejected(loaded, prompt_ids):
    batch = GeneratorBatch(loaded[0].model, eos_token_ids=eos(loaded))
    batch.prefill([make_request("a", prompt_ids[2], 30)])
    with pytest.raises(ValueError, match="already a classic row"):
        batch.prefill([make_request("a", prompt_ids[3], 30)])


@pytest.mark.parametrize("burst_s, max_tokens", [(0.0, 20), (10.0, 20), (10.0, 1)])
def test_solo_burst_returns_several_tokens_per_call(loaded, prompt_ids, burst_s, max_tokens):
    """With a burst budget a lone row's decode() keeps stepping (here: a budget no run
    reaches, so one call runs the row to its end); the stream is unchanged."""
    request = make_request("a", prompt_ids[7], max_tokens)
    batch = GeneratorBatch(loaded[0].model, eos_token_ids=eos(loaded), solo_burst_s=burst_s)
    (first,) = batch.prefill([request])
    tokens, reason, calls = list(first.token_ids), first.finish_reason, 0
    while reason is None:
        (b,) = batch.decode()
        calls += 1
        tokens += b.token_ids
        reason = b.finish_reason
        assert len(b.token_ids) == (1 if burst_s == 0 else max_tokens - 1)
    assert (tokens, reason) == reference(loaded, request)
    assert calls == (max_tokens - 1 if burst_s == 0 else min(1, max_tokens - 1))


def test_negative_burst_rejected(loaded):
    with pytest.raises(ValueError, match="solo_burst_s"):
        GeneratorBatch(loaded[0].model, eos_token_ids=eos(loaded), solo_burst_s=-1)
