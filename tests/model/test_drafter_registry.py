"""The drafter registry: each kind's class implements the Drafter protocol, the runner
builds it from the kind, and the deployment args accept exactly the registered kinds."""

from __future__ import annotations

import inspect

import pytest

from models.runner import MlxRunner
from models.speculative.drafter_kinds import DRAFTERS, NO_DRAFTER
from models.speculative.drafters import Drafter
from serve_app.configuration.args import DrafterArgs

pytestmark = pytest.mark.model

PROTOCOL_MEMBERS = sorted(name for name in {*Drafter.__annotations__, *vars(Drafter)} if not name.startswith("_"))


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_each_kind_implements_the_protocol(kind):
    cls = DRAFTERS[kind].load_class()
    assert cls.kind == kind
    missing = [name for name in PROTOCOL_MEMBERS if not hasattr(cls, name) and name not in ("name",)]
    assert missing == []
    for name in ("load", "new_state", "propose", "rollback", "compile_forwards", "warm"):
        assert (
            list(inspect.signature(getattr(cls, name)).parameters)[1:]
            == list(inspect.signature(getattr(Drafter, name)).parameters)[1:]
        ), name


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_from_paths_builds_the_kind(tiny_pair, kind):
    path = tiny_pair[1] if DRAFTERS[kind].needs_weights else None
    runner = MlxRunner.from_paths(tiny_pair[0], drafter_kind=kind, drafter_path=path)
    try:
        drafter = runner._slot.drafter
        assert isinstance(drafter, DRAFTERS[kind].load_class()) and drafter.kind == kind
        assert f"|{kind}:" in runner.policy_key()
    finally:
        runner.close()


def test_deployment_args_accept_the_registered_kinds():
    accepted = DrafterArgs.model_fields["kind"].annotation.__args__
    assert set(accepted) == {*DRAFTERS, NO_DRAFTER}
    for kind, entry in DRAFTERS.items():
        assert DrafterArgs(kind=kind, path="d" if entry.needs_weights else None).needs_weights is entry.needs_weights


@pytest.mark.parametrize("path", ["propose", "propose_array", "propose_sampled"])
def test_a_gpu_feeds_a_rounds_unseen_tokens_one_at_a_time_with_the_same_drafts(loaded, prompt_ids, path, monkeypatch):
    """A round whose first step feeds two unseen tokens (a round that accepted all its
    drafts) runs them as one-token steps on a GPU, which builds no attention kernel per
    key length; the drafts are those of the two-token forward. (On this CPU the device
    check is made to say GPU; the forwards still run here.)"""
    import mlx.core as mx

    from models.sampling.samplers import RequestSampler
    from models.speculative import drafters
    from scheduler.request import SamplingParams

    def rounds(gpu: bool) -> list:
        monkeypatch.setattr(drafters.mx, "default_device", (lambda: mx.gpu) if gpu else (lambda: mx.cpu))
        drafter = drafters.DraftModelDrafter(loaded[1].model, loaded[1].name)
        history = list(prompt_ids[0])
        state = drafter.new_state(history[:-1])
        sampler = RequestSampler(SamplingParams(max_tokens=64, temperature=0.7, seed=5), history)
        out = []
        for _ in range(4):
            if path == "propose_sampled":
                tokens, _ = drafter.propose_sampled(state, history, 3, sampler)
                drafts = tokens.tolist()
            else:
                drafts = getattr(drafter, path)(state, history, 3)
                drafts = drafts if isinstance(drafts, list) else drafts.tolist()
            out.append((drafts, state.cache[0].offset))  # the cache holds what a two-token forward writes
            history += drafts + [drafts[0]]  # every draft accepted, then the target's own token
            assert len(history) - state.num_cached == 2  # the next round feeds two unseen tokens
        monkeypatch.undo()
        return out

    assert rounds(gpu=True) == rounds(gpu=False)
