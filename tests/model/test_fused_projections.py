"""`models.loading.fused_projections`: q/k/v and gate/up as one matmul each, in every forward
(on by default on a CUDA GPU; forced on here, on the CPU, float32)."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from models.forward.slab import Slab
from models.loading import fused_projections
from models.loading.fused_projections import SharedProjection
from models.tiny import random_model, tiny_args
from scheduler.request import Request, SamplingParams


def _llama(bias: bool = False, seed: int = 3):
    args = tiny_args(vocab_size=256, hidden=128)
    args.attention_bias = bias
    model = random_model(args, seed=seed, embed_scale=4.0, out_scale=0.5)
    mx.eval(model.parameters())
    return model


def _qwen2():
    from mlx_lm.models import qwen2

    args = qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        tie_word_embeddings=True,
    )
    mx.random.seed(5)
    model = qwen2.Model(args)
    mx.eval(model.parameters())
    return model


def _shared(model):
    return [m for _, m in model.named_modules() if isinstance(m, SharedProjection)]


def _two_forwards(model):
    """Logits of a prompt, then of two more tokens over its cache (mlx-lm's own KVCache)."""
    cache = make_prompt_cache(model)
    first = model(mx.array([[5, 17, 42, 9, 100, 3, 77, 1]]), cache=cache)
    second = model(mx.array([[8, 250]]), cache=cache)
    return mx.concatenate([first, second], axis=1)


@pytest.mark.parametrize("build", [_llama, lambda: _llama(bias=True), _qwen2], ids=["llama", "llama-bias", "qwen2"])
def test_shared_projections_compute_what_the_separate_ones_do(build):
    model = build()
    expected = _two_forwards(model)
    params = {k: v.shape for k, v in tree_flatten(model.parameters())}
    layers = len(model.model.layers)
    assert fused_projections.fuse(model) == 2 * layers
    assert len(_shared(model)) == 5 * layers
    # the model's parameters are the same names and shapes (the layers' rows of the fused ones)
    assert {k: v.shape for k, v in tree_flatten(model.parameters())} == params
    got = _two_forwards(model)
    assert mx.allclose(got, expected, atol=1e-5, rtol=1e-5).item()
    assert fused_projections.fuse(model) == 0  # a second call changes nothing
    assert mx.allclose(_two_forwards(model), expected, atol=1e-5, rtol=1e-5).item()


def test_the_slab_forward_is_unchanged():
    plain, fused = _llama(seed=7), _llama(seed=7)
    fused_projections.fuse(fused)
    outs = []
    for model in (plain, fused):
        slab = Slab(model, rows=4, grid=False)
        rows = [slab.add() for _ in range(3)]
        prompts = [[(i * 31 + j) % 250 + 3 for j in range(20 + 7 * i)] for i in range(3)]
        first = slab.forward(model, [(row, p) for row, p in zip(rows, prompts)], last_only=True)
        step = slab.forward(model, [(rows[0], [4]), (rows[1], [5, 6, 7]), (rows[2], [8])])
        outs.append(mx.concatenate([*first, *[s.reshape(-1, s.shape[-1]) for s in step]]))
    assert mx.allclose(outs[0], outs[1], atol=1e-5, rtol=1e-5).item()


def test_a_group_holds_no_activation_once_every_part_is_taken():
    model = _llama()
    fused_projections.fuse(model)
    attn = model.model.layers[0].self_attn
    x = mx.random.normal((1, 3, 128))
    q, k = attn.q_proj(x), attn.k_proj(x)
    group = attn.q_proj._group
    assert group._input is x  # v's part is still to come
    v = attn.v_proj(x)
    assert group._input is None and group._parts == []
    for part, lin_out in ((q, x @ attn.q_proj.weight.T), (k, x @ attn.k_proj.weight.T), (v, x @ attn.v_proj.weight.T)):
        assert mx.allclose(part, lin_out, atol=1e-5).item()
    # another input (or the same parts asked for again) runs the group again
    y = mx.random.normal((1, 2, 128))
    assert mx.allclose(attn.k_proj(y), y @ attn.k_proj.weight.T, atol=1e-5).item()
    assert mx.allclose(attn.k_proj(y), y @ attn.k_proj.weight.T, atol=1e-5).item()


def test_other_models_are_left_as_they_are():
    quantized = _llama()
    nn.quantize(quantized, group_size=64, bits=4)
    assert fused_projections.fuse(quantized) == 0 and not _shared(quantized)
    from mlx_lm.models import gemma

    args = gemma.ModelArgs(
        model_type="gemma",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=256,
        num_key_value_heads=2,
    )
    other = gemma.Model(args)
    assert fused_projections.fuse(other) == 0 and not _shared(other)


def test_default_is_a_cuda_gpu(monkeypatch):
    assert fused_projections.wanted(True) and not fused_projections.wanted(False)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert fused_projections.wanted(None) == on_cuda
    monkeypatch.setattr(fused_projections, "on_cuda", lambda: True)
    assert fused_projections.wanted(None)


def test_runner_serves_the_same_greedy_tokens_with_the_knob(tiny_pair):
    """The whole runner (slab rows, the slot's session) with the projections shared gives
    the tokens it gives without."""
    from models.runner import MlxRunner

    def generate(fused: bool) -> dict:
        runner = MlxRunner.from_paths(tiny_pair[0], drafter_kind="ngram", fused_projections=fused)
        assert bool(_shared(runner.target.model)) == fused
        requests = [
            Request(
                f"r{i}",
                [(i * 13 + j) % 200 + 3 for j in range(12 + 5 * i)],
                SamplingParams(max_tokens=12, temperature=0.0),
            )
            for i in range(3)
        ]
        out = {r.request_id: [] for r in requests}
        done = set()
        for batch in runner.classic_prefill(requests):
            out[batch.request_id] += batch.token_ids
        while len(done) < len(requests):
            for batch in runner.classic_decode(drafts=True):
                out[batch.request_id] += batch.token_ids
                if batch.finish_reason:
                    done.add(batch.request_id)
                    runner.classic_remove(batch.request_id)
        return out

    assert generate(True) == generate(False)
