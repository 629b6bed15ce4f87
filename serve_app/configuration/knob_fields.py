"""Pydantic fields derived from config dataclasses' knobs (`scheduler.knobs`).

`deployment_fields` gives `ServeArgs` one field per deployed knob of `SchedulerConfig`
and `RunnerConfig`, with the knob's range, choices and description; `live_fields` gives
`LiveConfig` the live ones, each optional. A field's docs extras (`env`, `live`,
`default_doc`) ride in `json_schema_extra`, where `serve_app.configuration.docs` reads them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from models.runner_config import deployed_runner_knobs
from scheduler.config import SchedulerConfig
from scheduler.knobs import KnobField, knob_fields, unwrap_optional


def deployment_knobs() -> dict[str, KnobField]:
    """Every knob a deployment sets: the scheduler's, then the runner's it does not share."""
    fields = dict(knob_fields(SchedulerConfig))
    for name, field in deployed_runner_knobs().items():
        if name in fields and fields[name].knob is not field.knob:
            raise TypeError(f"{name} is declared twice with different specs; share it with `same_as`")
        fields.setdefault(name, field)
    return fields


def scheduler_knob_names() -> tuple[str, ...]:
    return tuple(knob_fields(SchedulerConfig))


def runner_knob_names() -> tuple[str, ...]:
    return tuple(deployed_runner_knobs())


def deployment_fields() -> dict[str, tuple[Any, Any]]:
    """`create_model` field definitions: name -> (annotation, FieldInfo)."""
    return {name: _field(f, live_only=False) for name, f in deployment_knobs().items()}


def live_fields() -> dict[str, tuple[Any, Any]]:
    return {name: _field(f, live_only=True) for name, f in deployment_knobs().items() if f.knob.live}


def _field(field: KnobField, live_only: bool) -> tuple[Any, Any]:
    spec = field.knob
    base, optional = unwrap_optional(field.type)
    if spec.choices:
        base = Literal[spec.choices]
        if {"on", "off"} <= set(spec.choices):
            base = Annotated[base, BeforeValidator(_switch_word)]
    default = field.deploy_default
    extra: dict[str, Any] = {"live": spec.live}
    if spec.env or live_only:
        # Unset: the env variable's value (resolved in ServeArgs.scheduler_config), else
        # the knob's default; for LiveConfig, unset = unchanged.
        optional, default = True, None
    if spec.env:
        extra.update(env=spec.env, shown_default=field.default)
    if spec.default_doc:
        extra["default_doc"] = spec.default_doc
    annotation = base | None if optional else base
    info = Field(default, ge=spec.ge, le=spec.le, description=spec.description, json_schema_extra=extra)
    return annotation, info


def _switch_word(value: Any) -> Any:
    """A YAML 1.1 reader (PyYAML, which Serve's config loader and `serve run` use) reads
    a bare `on` / `off` as a bool; for a knob whose choices are those words (`b1_policy:
    off`), take the bool back as the word the user wrote."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value
