"""Serve test fixtures. The two-node loopback cluster (`ray_cluster`) and `tiny_pair`
come from tests/conftest.py, shared with tests/reliability: one cluster per session."""

from __future__ import annotations

import pytest

# tests/conftest.py has set Ray's loopback variables; Ray may be imported now.
from serve_helpers import deploy  # noqa: E402


@pytest.fixture(scope="session")
def main_app(ray_cluster, tiny_pair):
    """The default app at `/`: tiny pair, draft-model drafter, one replica."""
    return deploy(ray_cluster, tiny_pair, "main", "/")


@pytest.fixture(scope="session")
def codec(tiny_pair):
    """The tiny target's tokenizer (a ChatML-style chat template), for the HTTP layer without Ray."""
    from serve_app.openai.codec import TextCodec

    return TextCodec.from_path(tiny_pair[0])
