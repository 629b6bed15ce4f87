"""Where a deployment's paths point: local model directories, hub ids, chat template files."""

from __future__ import annotations

from pathlib import Path

from models.loading.hub import is_repo_id
from models.loading.pypi_weights import is_pypi_source
from serve_app.configuration.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def is_template_path(value: str) -> bool:
    """Whether a `chat_template` value names a file: one line ending in `.jinja`, no braces."""
    return "\n" not in value and "{" not in value and value.strip().endswith(".jinja")


def read_chat_template(value: str | None, cwd: Path | None = None) -> str | None:
    """The template a `chat_template` value means: itself, or its file's text (a relative
    path resolves as a model path does)."""
    if value is None or not is_template_path(value):
        return value
    path = resolve_path(value.strip(), cwd)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"invalid specslot config:\n  args.chat_template: cannot read {path!r}: {reason}") from None
    if not text.strip():
        raise ConfigError(f"invalid specslot config:\n  args.chat_template: {path!r} is empty")
    return text


def resolve_path(path: str, cwd: Path | None = None) -> str:
    """Absolute path: as given if absolute, else under `cwd` if it exists there, else
    under the repo if it exists there. Otherwise a hub id (`org/name`) or a PyPI model file
    (`pypi:PACKAGE/FILE`) stays as it is, and any other path resolves under the repo (so
    the error names a full path)."""
    if is_pypi_source(path):
        return path
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    here = (cwd or Path.cwd()) / p
    if here.exists():
        return str(here.resolve())
    in_repo = REPO_ROOT / p
    if not in_repo.exists() and is_repo_id(path):
        return path
    return str(in_repo.resolve())
