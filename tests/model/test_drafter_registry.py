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
