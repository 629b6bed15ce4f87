"""Knobs: a config field's default, range and one-line description, declared once.

`SchedulerConfig` and `models.runner_config.RunnerConfig` declare every field with
`knob(...)`; the deployment args (`serve_app.configuration.args.ServeArgs`), the live subset
(`LiveConfig`) and the knob tables of docs/configuration.md are derived from them
(`serve_app.configuration.knob_fields`, `serve_app.configuration.docs`). A new knob is one field here:

    skip_cap: int = knob(2, "Grant decisions an entry may be skipped before it must win.",
                         ge=1, le=1000, live=True)

Pure data: no pydantic, mlx or ray.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Mapping

_SAME = object()  # `Knob.deploy_default` when the deployment default is the field's own


@dataclass(frozen=True)
class Knob:
    description: str  # one line: the pydantic description and the docs table's text
    ge: float | None = None  # checked by the dataclass itself
    le: float | None = None  # checked at the deployment edge only (ServeArgs, LiveConfig)
    choices: tuple[str, ...] = ()  # a str field's accepted values
    live: bool = False  # Serve's user_config may change it on a running replica
    # An env variable read for the default when the deployment leaves the field unset;
    # `parse_env(raw, default)` turns its value (or None) into the field's value.
    env: str | None = None
    parse_env: Callable[[str | None, Any], Any] | None = None
    # The deployment's default where it differs from the dataclass's (e.g. None: sized
    # at load), and how the docs describe such a computed default.
    deploy_default: Any = _SAME
    default_doc: str | None = None
    deployed: bool = True  # False: set by scripts and tests only, not a deployment arg


@dataclass(frozen=True)
class KnobField:
    name: str
    type: Any  # resolved annotation, e.g. int, `int | None`
    default: Any
    knob: Knob

    @property
    def deploy_default(self) -> Any:
        return self.default if self.knob.deploy_default is _SAME else self.knob.deploy_default


def knob(default: Any, description: str, **spec: Any) -> Any:
    """A dataclass field carrying its `Knob` (see the module docstring)."""
    return dataclasses.field(default=default, metadata={"knob": Knob(description, **spec)})


def same_as(field: KnobField) -> Any:
    """A dataclass field declaring the knob `field` of another config again (same default,
    range and description): one knob that two configs read, e.g. num_draft_tokens."""
    return dataclasses.field(default=field.default, metadata={"knob": field.knob})


def knob_fields(cls: type) -> dict[str, KnobField]:
    """The knobs of a config dataclass, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: KnobField(f.name, hints[f.name], f.default, f.metadata["knob"])
        for f in dataclasses.fields(cls)
        if "knob" in f.metadata
    }


def unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(the non-None type, whether None is allowed): `int | None` -> (int, True)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def check_knobs(config: Any) -> None:
    """Raise ValueError naming the first field of `config` whose value has the wrong type,
    lies below its minimum or is not one of its choices. Upper bounds are the deployment
    edge's (`Knob.le`): scripts and tests may go beyond them."""
    for field in knob_fields(type(config)).values():
        value = getattr(config, field.name)
        problem = _problem(field, value)
        if problem is not None:
            raise ValueError(f"{field.name} must be {problem}, got {value!r}")


def _problem(field: KnobField, value: Any) -> str | None:
    base, optional = unwrap_optional(field.type)
    if value is None:
        return None if optional else _expected(base, field.knob)
    spec = field.knob
    if base is bool:
        ok = isinstance(value, bool)
    elif base in (int, float):
        allowed = (int,) if base is int else (int, float)
        ok = isinstance(value, allowed) and not isinstance(value, bool) and (spec.ge is None or value >= spec.ge)
    elif base is str:
        ok = isinstance(value, str) and (not spec.choices or value in spec.choices)
    else:
        ok = isinstance(value, base)
    return None if ok else _expected(base, spec) + (" or None" if optional else "")


def _expected(base: Any, spec: Knob) -> str:
    if base is bool:
        return "a bool"
    if base in (int, float):
        kind = "an integer" if base is int else "a number"
        return kind if spec.ge is None else f"{kind} >= {spec.ge}"
    if spec.choices:
        return f"one of {spec.choices}"
    return "a string" if base is str else f"a {base.__name__}"


def env_defaults(cls: type, environ: Mapping[str, str]) -> dict[str, Any]:
    """Values of the knobs of `cls` that have an env variable, from `environ` (each
    knob's `parse_env` decides what an unset or unparseable value falls back to)."""
    return {
        f.name: f.knob.parse_env(environ.get(f.knob.env), f.default) for f in knob_fields(cls).values() if f.knob.env
    }
