"""Reliability fixtures: the `rel` app (see rel_helpers.REL_ARGS) on the session's one
loopback cluster, which tests/conftest.py owns and tests/serve shares."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "serve"))

from rel_helpers import REL_ARGS  # noqa: E402
from serve_helpers import deploy  # noqa: E402  (tests/conftest.py has set Ray's env)


@pytest.fixture(scope="session")
def rel_app(ray_cluster, tiny_pair):
    return deploy(ray_cluster, tiny_pair, "rel", "/rel", args=REL_ARGS)
