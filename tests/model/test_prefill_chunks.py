"""Chunked prefill: the pieces a long prompt head is run in, and the cache it leaves."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import models.forward.prefill as prefill
from models.forward.prefill import prefill_chunks


@pytest.mark.parametrize(
    "num_tokens, step, sizes",
    [
        (0, 4, []),
        (3, 4, [3]),
        (4, 4, [4]),
        (10, 4, [4, 4, 2]),
    ],
)
def test_the_head_runs_in_chunks_of_prefill_step(monkeypatch, num_tokens, step, sizes):
    monkeypatch.setattr(prefill, "PREFILL_STEP", step)
    seen = []
    prefill_chunks(None, [], range(num_tokens), forward=seen.append)
    assert [len(chunk) for chunk in seen] == sizes
    assert [t for chunk in seen for t in chunk] == list(range(num_tokens))


def test_chunked_and_whole_prefill_leave_the_same_cache(monkeypatch, loaded):
    model = loaded[0].model
    ids = list(range(1, 12))
    whole = make_prompt_cache(model)
    model(mx.array([ids]), cache=whole)
    monkeypatch.setattr(prefill, "PREFILL_STEP", 4)
    chunked = make_prompt_cache(model)
    prefill_chunks(model, chunked, ids)
    assert chunked[0].offset == whole[0].offset == len(ids)
    keys = lambda cache: cache[0].state[0][..., : len(ids), :]  # noqa: E731
    assert mx.allclose(keys(chunked), keys(whole), atol=1e-4).item()
