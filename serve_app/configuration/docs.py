"""docs/configuration.md's knob tables, generated from the configs that declare the knobs.

Each table sits between `<!-- BEGIN generated: NAME -->` and `<!-- END generated: NAME -->`
markers; `python -m serve_app.configuration.docs` rewrites them in place (`--check`: exit 1 when
the page is stale; tests/serve/test_config_docs.py fails then too). A row is one field of
`ServeArgs`: its default, accepted values (from the field's type and range), env
variable, when it takes effect (`live`: `LiveConfig` accepts it) and description.
"""

from __future__ import annotations

import re
import sys
import typing
from typing import Any, Iterable, Literal

from annotated_types import Ge, Le
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from scheduler.knobs import unwrap_optional
from serve_app.configuration import knob_fields
from serve_app.configuration.args import REPO_ROOT, LiveConfig, ServeArgs

DOC_PATH = REPO_ROOT / "docs" / "configuration.md"
HEADER = "| key | default | values | env override | takes effect | description |\n|---|---|---|---|---|---|"
_BLOCK = re.compile(
    r"(<!-- BEGIN generated: (?P<name>[\w-]+) -->\n)(?:.*?\n)?(<!-- END generated: (?P=name) -->)", re.DOTALL
)


def blocks() -> dict[str, str]:
    """Generated text by block name."""
    knob_names = set(knob_fields.deployment_knobs())
    return {
        "serve-args": table(name for name in ServeArgs.model_fields if name not in knob_names),
        "scheduler-knobs": table(knob_fields.scheduler_knob_names()),
        "runner-knobs": table(
            name for name in knob_fields.runner_knob_names() if name not in knob_fields.scheduler_knob_names()
        ),
        "live-keys": "Accepted keys: " + ", ".join(f"`{name}`" for name in LiveConfig.model_fields) + ".",
    }


def render(page: str) -> str:
    """`page` with every generated block replaced by its current text."""
    generated = blocks()
    return _BLOCK.sub(lambda m: m.group(1) + generated[m.group("name")] + "\n" + m.group(3), page)


def table(names: Iterable[str]) -> str:
    rows = []
    for name in names:
        info = ServeArgs.model_fields[name]
        extra = info.json_schema_extra or {}
        if extra.get("expand"):
            nested = info.get_default(call_default_factory=True)
            rows += [
                _row(f"{name}.{sub}", sub_info, getattr(nested, sub))
                for sub, sub_info in type(nested).model_fields.items()
            ]
        else:
            rows.append(_row(name, info, info.get_default(call_default_factory=True)))
    return "\n".join([HEADER, *rows])


def _row(key: str, info: FieldInfo, default: Any) -> str:
    extra = info.json_schema_extra or {}
    if "default_doc" in extra:
        shown = extra["default_doc"]
    elif info.is_required():
        shown = "required"
    else:
        shown = _value(key, extra.get("shown_default", default))
    env = f"`{extra['env']}`" if extra.get("env") else "—"
    effect = "live" if extra.get("live") else "build"
    cells = [f"`{key}`", shown, extra.get("values") or values(key, info), env, effect, info.description or ""]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def values(key: str, info: FieldInfo) -> str:
    """What a field accepts: `fused` \\| `alternate`, bool, 0–64, 1 KiB–1 GiB, string."""
    base, _ = unwrap_optional(info.annotation)
    if typing.get_origin(base) is Literal:
        return " | ".join(f"`{v}`" for v in typing.get_args(base))
    if base is bool:
        return "bool"
    if base in (int, float):
        lo = next((m.ge for m in info.metadata if isinstance(m, Ge)), None)
        hi = next((m.le for m in info.metadata if isinstance(m, Le)), None)
        kind = "integer" if base is int else "number"
        if lo is None and hi is None:
            return kind
        return f"{_value(key, lo) if lo is not None else '…'}–{_value(key, hi) if hi is not None else '…'}"
    if isinstance(base, type) and issubclass(base, BaseModel):
        return "{" + ", ".join(base.model_fields) + "}"
    return "string" if base is str else str(base)


def _value(key: str, value: Any) -> str:
    if value is None or value is PydanticUndefined:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`"
    if key.endswith("_bytes") and value >= 1024:
        return _size(int(value))
    if isinstance(value, float):
        return f"{value:g}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if num_bytes < 1024 or num_bytes % 1024:
            return f"{num_bytes:,} {unit}"
        num_bytes //= 1024
    return f"{num_bytes:,} PiB"


def _cell(text: str) -> str:
    return re.sub(r"(?<!\\)\|", r"\\|", text.replace("\n", " "))


def main(argv: list[str]) -> int:
    page = DOC_PATH.read_text(encoding="utf-8")
    current = render(page)
    if "--check" in argv:
        if current != page:
            print(f"{DOC_PATH} is stale: run `python -m serve_app.configuration.docs`", file=sys.stderr)
            return 1
        return 0
    if current != page:
        DOC_PATH.write_text(current, encoding="utf-8")
        print(f"updated {DOC_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
