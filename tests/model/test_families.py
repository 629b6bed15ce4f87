"""Architecture matrix: for each mlx-lm model family a tiny random float32 model (built
with mlx-lm's own class, on the tiny tokenizer's vocabulary) decodes greedily exactly
like mlx-lm's `generate_step`: classic decode, speculative sessions with the n-gram and
the draft-model drafter (K=3), one scheduler run of three concurrent requests (fused
tick, B=1 policy on, one-round grants), and two runs in which the batch-size rule stops
speculating streams mid-stream (a lone slot holder demoted into the classic batch; two
requests sharing the slot). Each family also pins whether the fused tick supports it
(`slab.check_support`). Targets whose cache cannot roll back (state-space mamba,
hybrid qwen3_5) decode classically, with speculation off and the reason given.

Covered families and why some are refused are listed in docs/models.md."""

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from models.forward import slab
from models.loading.loader import LoadedModel
from models.runner import SPEC_OFF_NO_ROLLBACK, MlxRunner
from models.speculative.drafters import NgramDrafter
from models.tiny import greedy_margins
from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler

from .conftest import make_request
from .helpers import make_drafter, mlx_lm_greedy, run_classic, run_session

pytestmark = pytest.mark.model

K = 3
MAX_TOKENS = 16
MIN_MARGIN = 1e-4  # as in test_parity: every greedy choice wins far above float noise
HIDDEN, LAYERS, DRAFT_LAYERS = 64, 2, 1

_BASE = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    intermediate_size=2 * HIDDEN,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    rope_theta=10000.0,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# ministral3 (Ministral 3, mistral3's text model): llama-4 attention scaling, and sliding
# layers where `layer_types` says so (`alternate_sliding` below: every other layer).
_MINISTRAL3_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "llama_4_scaling_beta": 0.1,
    "original_max_position_embeddings": 64,
}

# name: (mlx-lm module, config overrides, precision, fused tick expected to pass); precision is
# None (float32), 4 or 8 (bits, `mlx.nn.quantize`) or "bf16" (weights in bfloat16)
FAMILIES = {
    "llama": ("llama", {"tie_word_embeddings": False}, None, True),
    "llama-tied": ("llama", {"tie_word_embeddings": True}, None, True),
    "llama3-rope": ("llama", {"tie_word_embeddings": False, "rope_scaling": _LLAMA3_ROPE}, None, True),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": False}, None, True),
    "qwen3": ("qwen3", {"tie_word_embeddings": False}, None, True),
    # With GQA (2 KV heads), as every real checkpoint: models.platform.upstream_fixes.
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16.0, "embed_scale": 0.5}, None, False),
    "gemma3_text-sliding": (
        "gemma3_text",
        {"sliding_window": 8, "sliding_window_pattern": 2, "query_pre_attn_scalar": 16, "layers": (4, 2)},
        None,
        False,
    ),
    "phi3": ("phi3", {"tie_word_embeddings": False}, None, True),
    "ministral3-sliding": (
        "ministral3",
        {
            "tie_word_embeddings": False,
            "sliding_window": 8,
            "alternate_sliding": True,
            "rope_parameters": _MINISTRAL3_ROPE,
            "layers": (4, 2),
        },
        None,
        False,
    ),
    "llama-4bit": ("llama", {"tie_word_embeddings": False}, 4, True),
    "qwen3-4bit": ("qwen3", {"tie_word_embeddings": False}, 4, True),
    "llama-8bit": ("llama", {"tie_word_embeddings": False}, 8, True),
    # seed 4: seed 0's 8-bit weights leave a greedy margin of 5e-5 (a near-tie)
    "qwen3-8bit": ("qwen3", {"tie_word_embeddings": False, "seed": 4}, 8, True),
    "llama-bf16": ("llama", {"tie_word_embeddings": True}, "bf16", True),
    # Tied heads in bf16: with an untied random head qwen3's bf16 logits tie exactly.
    "qwen3-bf16": ("qwen3", {"tie_word_embeddings": True}, "bf16", True),
}
# mistral: mlx-lm 0.32.2 has no `mistral` module (its configs load through `llama`, which
# slides only on layers `layer_types` marks), so "llama" covers it; see docs/models.md.


def build(module_name, overrides, num_layers, vocab_size, seed, precision, source=None, embed_scale=4.0):
    """A float32 (4- or 8-bit, or bfloat16) tiny model; with `source`, the first layers
    and every non-layer weight are the source's (a truncated draft)."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    overrides = dict(overrides)
    if overrides.pop("alternate_sliding", False):  # a full-attention layer after each sliding one
        overrides["layer_types"] = ["sliding_attention", "full_attention"] * (num_layers // 2)
    config = {
        "model_type": module_name,
        **_BASE,
        **overrides,
        "num_hidden_layers": num_layers,
        "vocab_size": vocab_size,
    }
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    if source is None:
        # Peaked embeddings and damped layer outputs: clear greedy margins (models.tiny).
        emb = model.model.embed_tokens
        emb.weight = mx.random.normal(emb.weight.shape) * embed_scale
        for layer in model.model.layers:
            # qwen3_5's linear-attention layers name theirs linear_attn.out_proj.
            out = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
            out.weight = out.weight * 0.5
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * 0.5
    if precision in (4, 8):
        nn.quantize(model, group_size=32, bits=precision)
    elif precision == "bf16":
        model.set_dtype(mx.bfloat16)
    if source is not None:

        def kept(key):
            parts = key.split(".")
            return parts[:2] != ["model", "layers"] or int(parts[2]) < num_layers

        model.load_weights([(k, v) for k, v in tree_flatten(source.parameters()) if kept(k)])
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, loaded):
    """(name, (target, draft) LoadedModels, expected fused support)."""
    module_name, overrides, precision, fuses = FAMILIES[request.param]
    # gemma3_text and ministral3 need a full-attention layer after each sliding one, in
    # the draft too; gemma2 scales its embeddings by sqrt(hidden) and softcaps its logits
    # at 30, so its own embeddings stay small (else the capped logits tie).
    num_layers, num_draft_layers = overrides.get("layers", (LAYERS, DRAFT_LAYERS))
    embed_scale = overrides.get("embed_scale", 4.0)
    seed = overrides.get("seed", 0)
    overrides = {k: v for k, v in overrides.items() if k not in ("layers", "embed_scale", "seed")}
    vocab = loaded[0].model.args.vocab_size
    target = build(module_name, overrides, num_layers, vocab, seed, precision, embed_scale=embed_scale)
    draft = build(module_name, overrides, num_draft_layers, vocab, seed, precision, source=target)
    tok = loaded[0].tokenizer
    pair = (
        LoadedModel("", f"tiny-{request.param}", target, tok, 512),
        LoadedModel("", f"tiny-{request.param}-draft", draft, tok, 512),
    )
    return request.param, pair, fuses


def make_prompts(vocab):
    """A short prompt, a repeating one, and a long one holding most of the vocabulary
    (so n-gram lookups find the generated tokens earlier and draft) and many times
    the sliding families' window."""
    rng = random.Random(3)
    tokens = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731 (0 is EOS)
    return {"short": tokens(5), "repeating": tokens(6) * 3, "long": rng.sample(range(1, vocab), 300)}


@pytest.fixture(scope="module")
def prompts(family):
    return make_prompts(family[1][0].model.args.vocab_size)


@pytest.fixture(scope="module")
def expected(family, prompts):
    target = family[1][0]
    eos = tuple(target.tokenizer.eos_token_ids)
    return {name: mlx_lm_greedy(target.model, ids, MAX_TOKENS, eos) for name, ids in prompts.items()}


def test_greedy_margins_are_far_above_float_noise(family, prompts):
    model = family[1][0].model
    worst = min(min(greedy_margins(model, ids, MAX_TOKENS)) for ids in prompts.values())
    assert worst > MIN_MARGIN, f"{family[0]}: near-tie (margin {worst:.2e})"


def test_fused_tick_support_is_as_expected(family):
    name, pair, fuses = family
    assert (slab.check_support(pair[0].model) is None) is fuses, slab.check_support(pair[0].model)


def test_classic_decode_equals_mlx_lm(family, prompts, expected):
    target = family[1][0]
    eos = sorted(target.tokenizer.eos_token_ids)
    requests = [make_request(name, ids, MAX_TOKENS) for name, ids in prompts.items()]
    out = run_classic(target.model, requests, eos)
    assert {rid: tokens for rid, (tokens, _) in out.items()} == expected


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_speculative_equals_mlx_lm(family, prompts, expected, kind):
    drafter = make_drafter(kind, family[1])
    num_drafted = 0
    for name, ids in prompts.items():
        tokens, _, rounds = run_session(family[1], make_request(name, ids, MAX_TOKENS), K, drafter)
        assert tokens == expected[name], name
        num_drafted += sum(r[1] for r in rounds)
    assert num_drafted > 0  # the session really speculated


def run_to_completion(scheduler, runner, requests, arrivals=()):
    """{request_id: tokens} of `requests` submitted at once, then of each of `arrivals`
    (request, when(streams so far) -> bool), submitted after the first tick at which
    `when` holds; closes the runner."""
    pending = list(arrivals)
    for r in requests:
        scheduler.submit(r)
    streams = {r.request_id: [] for r in [*requests, *(a for a, _ in arrivals)]}
    for _ in range(2000):
        for event in scheduler.tick():
            streams[event.request_id] += event.token_ids
        for arrival in [a for a in pending if a[1](streams)]:
            pending.remove(arrival)
            scheduler.submit(arrival[0])
        if not scheduler.has_work() and not pending:
            break
    assert not scheduler.has_work() and not pending
    assert runner.num_live_sessions() == 0 and runner.num_classic_rows() == 0
    runner.close()
    return streams


def test_three_concurrent_streams_in_the_scheduler_equal_mlx_lm(family, prompts, expected):
    """Fused tick (where supported), B=1 on, one-round grants: the slot rotates, parks
    and resumes, and rows move in and out of the classic batch."""
    name, pair, fuses = family
    runner = MlxRunner(
        pair[0], make_drafter("draft_model", pair), num_draft_tokens=K, fast_verify=False, warm_positions=0
    )
    assert runner.spec_off_reason is None and runner.can_fuse() is fuses, runner.fuse_blocker
    scheduler = Scheduler(runner, SchedulerConfig(b1_policy="on", grant_rounds=1, num_draft_tokens=K))
    requests = [make_request(rid, ids, MAX_TOKENS) for rid, ids in prompts.items()]
    assert run_to_completion(scheduler, runner, requests) == expected
    assert sum(r.spec.num_rounds > 0 for r in requests) >= 2, [r.spec for r in requests]
    assert (scheduler.counters.actions["fused"] > 0) is fuses


# case: (speculating requests, batch-size rule, grant_rounds, demotions on the alternating
# tick, demotions on the fused tick)
DEMOTIONS = {
    "holder": (("long",), 1, 0, 1, 1),
    "ring": (("long", "repeating"), 2, 1, 2, 0),
}


@pytest.mark.parametrize("case", list(DEMOTIONS))
def test_streams_leaving_the_slot_mid_stream_equal_mlx_lm(family, prompts, expected, case):
    """Once every speculating request has run a round, `short` arrives and the
    batch-size rule stops speculation mid-stream. holder: the lone slot holder moves into
    the classic batch at its next boundary (`spec_to_classic`). ring: two requests take
    turns in the slot; the holder is demoted at its boundary and the parked one at its
    promotion (on the fused tick a parked request already decodes as a row and stays
    one). Either way no round runs after the arrival, and every stream is mlx-lm's."""
    name, pair, fuses = family
    speculating_ids, rule, grant_rounds, *num_demotions = DEMOTIONS[case]
    runner = MlxRunner(
        pair[0], make_drafter("draft_model", pair), num_draft_tokens=K, fast_verify=False, warm_positions=0
    )
    scheduler = Scheduler(
        runner,
        SchedulerConfig(
            b1_policy="on", grant_rounds=grant_rounds, num_draft_tokens=K, speculative_disable_by_batch_size=rule
        ),
    )
    speculating = [make_request(rid, prompts[rid], MAX_TOKENS) for rid in speculating_ids]
    at_arrival = {}

    def all_speculated(streams):
        if not all(r.spec.num_rounds > 0 for r in speculating):
            return False
        at_arrival.update(
            num_rounds=scheduler.counters.spec_rounds, num_emitted=[len(streams[r.request_id]) for r in speculating]
        )
        return True

    arrival = (make_request("short", prompts["short"], MAX_TOKENS), all_speculated)
    streams = run_to_completion(scheduler, runner, speculating, [arrival])
    assert streams == {rid: expected[rid] for rid in streams}
    assert all(0 < n < MAX_TOKENS for n in at_arrival["num_emitted"]), at_arrival
    assert scheduler.counters.spec_rounds == at_arrival["num_rounds"]
    counters = scheduler.counters
    num_stopped = counters.demotions + counters.classic_fallbacks["batch_size_at_promotion"]
    assert num_stopped == len(speculating), (counters.demotions, dict(counters.classic_fallbacks))
    assert counters.demotions == num_demotions[fuses]


def build_no_rollback(kind, vocab_size):
    """A tiny target whose cache cannot roll back: state-space mamba, or qwen3_5's hybrid
    of gated-delta (linear attention, an `ArraysCache`) and full-attention layers."""
    if kind == "qwen3_5":
        return build(
            "qwen3_5",
            {
                "full_attention_interval": 2,
                "linear_num_value_heads": 4,
                "linear_num_key_heads": 2,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "tie_word_embeddings": False,
                "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            },
            LAYERS,
            vocab_size,
            0,
            False,
        )
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    mx.random.seed(0)
    return mamba.Model(args)


@pytest.mark.parametrize("kind", ["mamba", "qwen3_5"])
def test_a_target_that_cannot_roll_back_decodes_classically_with_speculation_off(loaded, kind):
    """No KV cache to roll back in every layer, so the slot serves nobody and says why;
    the three prompts, run concurrently through the scheduler, decode classically exactly
    like mlx-lm."""
    vocab = loaded[0].model.args.vocab_size
    model, prompts = build_no_rollback(kind, vocab), make_prompts(vocab)
    margins = [min(greedy_margins(model, ids, MAX_TOKENS)) for ids in prompts.values()]
    assert min(margins) > MIN_MARGIN, margins
    target = LoadedModel("", f"tiny-{kind}", model, loaded[0].tokenizer, 512)
    runner = MlxRunner(target, NgramDrafter(), fast_verify=False, warm_positions=0)
    assert runner.spec_off_reason == SPEC_OFF_NO_ROLLBACK
    assert not runner.can_fuse() and slab.check_support(model) is not None
    requests = [make_request(rid, ids, MAX_TOKENS) for rid, ids in prompts.items()]
    assert not any(runner.spec_supports(r) for r in requests)
    eos = tuple(runner.eos_token_ids)
    expected = {rid: mlx_lm_greedy(model, ids, MAX_TOKENS, eos) for rid, ids in prompts.items()}
    scheduler = Scheduler(runner, SchedulerConfig(b1_policy="on", grant_rounds=1, num_draft_tokens=K))
    assert run_to_completion(scheduler, runner, requests) == expected
    assert scheduler.counters.spec_rounds == 0 and all(r.spec.num_rounds == 0 for r in requests)
    with pytest.raises(ValueError, match="cannot be rolled back"):
        make_drafter("draft_model", (target, target))


def test_gemma2_batches_with_grouped_queries(loaded):
    """mlx-lm 0.32.2's gemma2 attention applies a batch's 4-D mask to 5-D grouped queries:
    two rows of different lengths got each other's padding (silently wrong), three or
    more failed to broadcast. With `models.platform.upstream_fixes` batches of 2 and 3 prompts of
    different lengths, prefilled together or one by one, decode as `generate_step` does."""
    from mlx_lm.models import gemma2

    from models.platform import upstream_fixes

    target = build(
        "gemma2", {"query_pre_attn_scalar": 16.0}, LAYERS, loaded[0].model.args.vocab_size, 0, None, embed_scale=0.5
    )
    assert target.model.layers[0].self_attn.repeats > 1
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in (5, 11, 23)]
    for group in (prompts[:2], prompts):
        requests = [make_request(str(i), p, 8) for i, p in enumerate(group)]
        for prefill in (1, len(group)):
            got = run_classic(target, requests, [0], prefill_batch_size=prefill)
            for r in requests:
                assert got[r.request_id][0] == mlx_lm_greedy(target, r.prompt_ids, 8, (0,))
    # Greedy picks can survive a wrong mask; the logits cannot (unfixed: off by ~7 here).
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    width = max(map(len, prompts))
    cache = [BatchKVCache([width - len(p) for p in prompts]) for _ in target.layers]
    batched = target(mx.array([[0] * (width - len(p)) + p for p in prompts]), cache=cache)[:, -1]
    for i, p in enumerate(prompts):
        alone = target(mx.array([p]), cache=make_prompt_cache(target))[0, -1]
        assert mx.abs(batched[i] - alone).max().item() < 1e-4
    assert gemma2.Attention.__call__ is upstream_fixes._gemma2_attention
