"""Knobs: one declaration gives a config dataclass its validation and env defaults."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from scheduler.knobs import check_knobs, env_defaults, knob, knob_fields, same_as


def parse_int(raw, default):
    return int(raw) if raw and raw.isdigit() else default


@dataclass(frozen=True)
class Toy:
    count: int = knob(3, "How many.", ge=1, le=5, live=True, env="TOY_COUNT", parse_env=parse_int)
    mode: str = knob("a", "Which one.", choices=("a", "b"))
    rate: float = knob(0.5, "How fast.", ge=0.0)
    flag: bool = knob(True, "On or off.")
    path: str | None = knob(None, "Where.")
    budget: int | None = knob(0, "Bytes; None = sized at load.", ge=0, deploy_default=None, default_doc="computed")

    def __post_init__(self):
        check_knobs(self)


@dataclass(frozen=True)
class Shares:
    count: int = same_as(knob_fields(Toy)["count"])


def test_knob_fields_carry_the_declaration():
    fields = knob_fields(Toy)
    assert list(fields) == ["count", "mode", "rate", "flag", "path", "budget"]
    assert (fields["count"].default, fields["count"].knob.ge, fields["count"].knob.le) == (3, 1, 5)
    assert (fields["budget"].default, fields["budget"].deploy_default) == (0, None)
    assert fields["mode"].deploy_default == "a"
    assert knob_fields(Shares)["count"].knob is fields["count"].knob


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(count=0), "count must be an integer >= 1, got 0"),
        (dict(count=True), "count must be an integer >= 1, got True"),
        (dict(count=2.0), "count must be an integer >= 1, got 2.0"),
        (dict(mode="c"), "mode must be one of ('a', 'b'), got 'c'"),
        (dict(rate=-0.1), "rate must be a number >= 0.0, got -0.1"),
        (dict(flag=1), "flag must be a bool, got 1"),
        (dict(path=3), "path must be a string or None, got 3"),
        (dict(budget=-1), "budget must be an integer >= 0 or None, got -1"),
        (dict(count=None), "count must be an integer >= 1, got None"),
    ],
)
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ValueError) as info:
        Toy(**overrides)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        dict(count=7),  # upper bounds are the deployment edge's, not the dataclass's
        dict(rate=2),
        dict(path="/tmp"),
        dict(budget=None),
        dict(mode="b"),
    ],
)
def test_good_values_pass(overrides):
    Toy(**overrides)


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, {"count": 3}),
        ({"TOY_COUNT": "4"}, {"count": 4}),
        ({"TOY_COUNT": "x"}, {"count": 3}),
    ],
)
def test_env_defaults_parse_each_env_knob(environ, expected):
    assert env_defaults(Toy, environ) == expected
