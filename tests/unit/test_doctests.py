"""The examples in the code's docstrings run and hold (pytest collects only tests/).

Every module of the packages and the benchmark helpers that carry examples is imported
and its doctests run; a module whose examples break fails here with doctest's report."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

PACKAGES = ("models", "scheduler", "serve_app")
SCRIPTS = (
    "scripts.bench.metrics",
    "scripts.bench.vs_mlx_lm",
    "scripts.bench.multiturn",
    "scripts.bench.proc_tree",
    "scripts.bench.start_time",
)


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names += [m.name for m in pkgutil.walk_packages(path, f"{package}.") if not m.ispkg]
    return sorted(names) + list(SCRIPTS)


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_hold(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_the_examples_are_found():
    """At least the examples this file was written for are collected."""
    finder = doctest.DocTestFinder()
    attempted = sum(len(t.examples) for name in _modules() for t in finder.find(importlib.import_module(name)))
    assert attempted >= 40
