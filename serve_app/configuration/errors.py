"""Config validation errors, one line per problem, for operators reading a failed deploy."""

from __future__ import annotations

import difflib
import typing

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """Deployment args or user_config failed validation (message lists every problem)."""


def format_validation_error(err: ValidationError, prefix: str = "args", schema: type[BaseModel] | None = None) -> str:
    """One line per problem, `args.field: message`, for operators reading a failed deploy.

    With `schema` (the model validated), an unknown key names its closest known
    sibling: `args.grant_round: unknown key (did you mean 'grant_rounds'?)`.
    """
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"])
        where = f"{prefix}.{loc}" if loc else prefix
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
            close = difflib.get_close_matches(str(e["loc"][-1]), _keys_at(schema, e["loc"][:-1]), n=1)
            if close:
                msg += f" (did you mean '{close[0]}'?)"
        lines.append(f"{where}: {msg}")
    return "invalid specslot config:\n  " + "\n  ".join(lines)


def _keys_at(schema: type[BaseModel] | None, loc: tuple) -> list[str]:
    """Field names of the (nested) model at `loc`, e.g. ("drafter",) -> DrafterArgs'."""
    for part in loc:
        if schema is None or isinstance(part, int):  # list index: same item model
            continue
        field = schema.model_fields.get(part)
        schema = _model_in(field.annotation) if field else None
    return list(schema.model_fields) if schema else []


def _model_in(annotation) -> type[BaseModel] | None:
    """The pydantic model an annotation holds: `DrafterArgs`, `list[ApiKeyArgs]`, ...."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
