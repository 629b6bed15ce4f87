"""Speculation over sliding-window targets (mlx-lm gives those layers a
`RotatingKVCache`): greedy output equals mlx-lm's own `generate_step` on the same
float32 model at contexts several windows long, for both drafters and K in {1, 3, 4},
alone and with two sessions taking turns in the slot; the draft model's own ring cache
stays what a fresh prefill would give. A target whose cache cannot roll back at all
(state-space layers) decodes classically and says why."""

import logging
import random

import pytest

from models.loading.loader import LoadedModel
from models.runner import MlxRunner
from models.speculative.drafters import DraftModelDrafter, NgramDrafter
from models.tiny import greedy_margins, tiny_sliding_pair

from .conftest import make_request
from .helpers import make_drafter, mlx_lm_greedy, run_classic, run_session

pytestmark = pytest.mark.model

WINDOW = 16
MAX_TOKENS = 56  # with the prompts below, 4 to 7 windows of context
MIN_MARGIN = 1e-4  # as in test_parity: every greedy choice wins far above float noise


@pytest.fixture(scope="module", params=["gemma3_text", "llama"])
def sliding(request, loaded):
    """(target, draft) LoadedModels: a tiny pair with every other layer sliding over
    WINDOW tokens, on the tiny tokenizer."""
    target, draft = tiny_sliding_pair(request.param, loaded[0].model.args.vocab_size, WINDOW)
    name = f"tiny-{request.param}"
    return (
        LoadedModel("", name, target, loaded[0].tokenizer, 4096),
        LoadedModel("", f"{name}-draft", draft, loaded[0].tokenizer, 4096),
    )


@pytest.fixture(scope="module")
def prompts(sliding):
    """Shorter than the window (it wraps while decoding), repeating (n-gram drafts
    hit), and three windows long. With this seed both drafters see accepted and
    rejected drafts while the ring is wrapped, and the margins are clear."""
    rng = random.Random(2)
    vocab = sliding[0].model.args.vocab_size
    tokens = lambda n: [rng.randrange(1, vocab) for _ in range(n)]  # noqa: E731 (0 is EOS)
    return {"short": tokens(9), "repeating": tokens(12) * 3, "long": tokens(50)}


@pytest.fixture(scope="module")
def expected(sliding, prompts):
    eos = tuple(sliding[0].tokenizer.eos_token_ids)
    return {name: mlx_lm_greedy(sliding[0].model, ids, MAX_TOKENS, eos) for name, ids in prompts.items()}


def test_greedy_margins_are_far_above_float_noise(sliding, prompts):
    worst = min(min(greedy_margins(sliding[0].model, ids, MAX_TOKENS)) for ids in prompts.values())
    assert worst > MIN_MARGIN, f"tiny sliding model has a near-tie (margin {worst:.2e})"


class RefillingDrafter(DraftModelDrafter):
    """Reference draft: prefills a fresh cache with the whole history every round."""

    def propose(self, state, history, k):
        fresh = self.new_state(history[:-1])
        state.cache, state.num_cached = fresh.cache, fresh.num_cached
        return super().propose(state, history, k)


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_speculative_equals_mlx_lm_generate(sliding, prompts, expected, kind, k):
    drafter = make_drafter(kind, sliding)
    num_drafted = num_accepted = 0
    for name, ids in prompts.items():
        request = make_request(name, ids, MAX_TOKENS)
        tokens, _, rounds = run_session(sliding, request, k, drafter)
        diverged = next((i for i, (a, b) in enumerate(zip(tokens, expected[name])) if a != b), None)
        assert tokens == expected[name], f"{name}: diverged at token {diverged}"
        num_drafted += sum(r[1] for r in rounds)
        num_accepted += sum(r[2] for r in rounds)
        if kind == "draft_model":
            # A draft cache left holding rejected drafts (or missing window entries)
            # keeps the output exact but drafts differently: compare every round.
            reference = RefillingDrafter(sliding[1].model, sliding[1].name)
            assert rounds == run_session(sliding, request, k, reference)[2], name
    assert 0 < num_accepted < num_drafted


def test_lazy_drafts_roll_a_ring_draft_back_like_a_fresh_prefill(sliding, prompts):
    """`propose_array` (the GPU path's drafting, for a KV-cache target with a
    sliding-window draft) keeps the ring draft exact through every kind of round."""
    drafter = DraftModelDrafter(sliding[1].model, "d")
    reference = RefillingDrafter(sliding[1].model, "d")
    history = list(prompts["long"])
    state, ref_state = drafter.new_state(history[:-1]), reference.new_state(history[:-1])
    for k, num_accepted in [(3, 1), (4, 4), (1, 0), (4, 0), (3, 2), (4, 3)] * 2:
        drafts = drafter.propose_array(state, history, k).tolist()
        assert drafts == reference.propose(ref_state, history, k)
        drafter.rollback(state, k, num_accepted)
        history += drafts[:num_accepted] + [1 + len(history) % 97]  # the target's token


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_sessions_taking_turns_in_the_slot_equal_mlx_lm(sliding, prompts, expected, kind):
    """Two sessions alternate rounds (each parked while the other runs), with probe
    rounds (one-token steps over the ring) in between; fast_verify is asked for, but a
    sliding window never takes the bucketed path."""
    runner = MlxRunner(sliding[0], make_drafter(kind, sliding), num_draft_tokens=3, fast_verify=True, warm_positions=0)
    assert runner.spec_off_reason is None and not runner.fast_verify
    names = {"a": "repeating", "b": "long"}
    out = {"a": runner.spec_begin(make_request("a", prompts["repeating"], MAX_TOKENS)).token_ids}
    out["a"] += runner.spec_round("a").token_ids
    runner.spec_park("a")
    out["b"] = runner.spec_begin(make_request("b", prompts["long"], MAX_TOKENS)).token_ids
    runner.spec_park("b")
    done, turn = set(), 0
    while len(done) < 2:
        for rid in sorted(set(names) - done):
            turn += 1
            probe = turn % 5 == 3  # turns 3, 8, 13, ...: each session in turn
            if not probe:
                runner.spec_resume(rid)
            r = runner.spec_round(rid, probe=probe)
            out[rid] += r.token_ids
            if not probe:
                runner.spec_park(rid)
            if r.finish_reason:
                done.add(rid)
                runner.spec_finish(rid)
    runner.close()
    assert out == {rid: expected[name] for rid, name in names.items()}


def test_a_session_demoted_into_the_classic_batch_goes_on_exactly(sliding, prompts, expected):
    """The rolled-back ring becomes a `BatchGenerator` row (merged with another row's)."""
    runner = MlxRunner(sliding[0], make_drafter("draft_model", sliding), num_draft_tokens=3)
    out = {"a": runner.spec_begin(make_request("a", prompts["long"], MAX_TOKENS)).token_ids}
    for _ in range(8):
        out["a"] += runner.spec_round("a").token_ids
    out["b"] = runner.classic_prefill([make_request("b", prompts["repeating"], MAX_TOKENS)])[0].token_ids
    for batch in runner.spec_to_classic("a"):
        out[batch.request_id] += batch.token_ids
    done = set()
    while len(done) < 2:
        for batch in runner.classic_decode():
            out[batch.request_id] += batch.token_ids
            if batch.finish_reason:
                done.add(batch.request_id)
                runner.classic_remove(batch.request_id)
    runner.close()
    assert out == {"a": expected["long"], "b": expected["repeating"]}


def test_a_target_whose_cache_cannot_roll_back_decodes_classically(loaded, caplog):
    from mlx_lm.models import mamba

    args = mamba.ModelArgs(
        model_type="mamba",
        vocab_size=loaded[0].model.args.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        state_size=8,
        num_hidden_layers=2,
        conv_kernel=4,
        use_bias=False,
        use_conv_bias=True,
        time_step_rank=4,
    )
    model = mamba.Model(args)
    target = LoadedModel("", "tiny-mamba", model, loaded[0].tokenizer, 512)
    with caplog.at_level(logging.INFO, logger="models.runner"):
        runner = MlxRunner(target, NgramDrafter(), fast_verify=True, warm_positions=0)
    assert [r.getMessage() for r in caplog.records] == [
        "speculation off: the target's cache cannot be rolled back (target tiny-mamba)"
    ]
    assert runner.spec_off_reason == "the target's cache cannot be rolled back"
    from scheduler.config import SchedulerConfig
    from scheduler.core import Scheduler

    shown = Scheduler(runner, SchedulerConfig()).snapshot()["speculation"]  # GET /v1/internal/scheduler
    assert shown["off_reason"] == runner.spec_off_reason and shown["tick"] == "alternate"
    request = make_request("a", [5, 6, 7, 8], 6)
    assert not runner.spec_supports(request)
    assert "|none:none|" in runner.policy_key()
    tokens, _ = run_classic(model, [request], runner.eos_token_ids)["a"]
    assert tokens == mlx_lm_greedy(model, request.prompt_ids, 6, runner.eos_token_ids)
    runner.close()
    with pytest.raises(ValueError, match="cannot be rolled back"):
        DraftModelDrafter(model, "tiny-mamba")


def test_a_ring_draft_keeps_no_prefixes(sliding):
    """A sliding-window draft's ring holds only the window, never a whole prefix: it
    takes no share of the prefix cache's budget and keeps nothing."""
    drafter = DraftModelDrafter(sliding[1].model, "d")
    assert drafter.kv_bytes_per_position() == 0
    runner = MlxRunner(sliding[0], drafter, num_draft_tokens=3, prefix_cache_bytes=1 << 20)
    assert drafter.prefix_cache is None
    stats = runner.prefix_cache_stats()
    assert stats is None or ("draft" not in stats and stats["budget_bytes"] == 1 << 20)
    runner.close()
