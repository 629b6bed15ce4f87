"""Cheap, mlx-free facts about a model directory: is it loadable, and what is it.

Both run where importing mlx would be wasteful (the driver's `build_app`, the replica
before its tokenizer loads), so this module imports only the standard library.
"""

from __future__ import annotations

import glob
import hashlib
import os

WEIGHT_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ModelLoadError(Exception):
    """A model directory could not be loaded; the message names the path and the fault."""


def check_model_dir(path: str, role: str) -> None:
    """Raise ModelLoadError unless `path` looks like an mlx-lm loadable directory.

    Checked before mlx-lm or transformers see the path: given a string that is not a
    local directory they would try the Hugging Face hub instead.
    """
    if not path:
        raise ModelLoadError(f"{role} model path is empty")
    if not os.path.exists(path):
        raise ModelLoadError(f"{role} model path {path!r} does not exist")
    if not os.path.isdir(path):
        raise ModelLoadError(f"{role} model path {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"{role} model path {path!r} is not a model directory: no config.json")
    if not glob.glob(os.path.join(path, "*.safetensors")):
        raise ModelLoadError(f"{role} model path {path!r} is not a model directory: no *.safetensors weights")
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{role} model path {path!r} has no tokenizer files")


def model_fingerprint(path: str) -> str:
    """A short content hash naming a model directory wherever it is copied.

    Hashes config.json and the weight index (or, without one, the sorted weight file
    names and sizes): seconds of hashing multi-GB weights would buy little, since a
    retrained checkpoint almost never keeps every file size. Example: two copies of
    one model give the same 16 hex digits; editing config.json changes them.
    """
    digest = hashlib.sha256()
    with open(os.path.join(path, "config.json"), "rb") as f:
        digest.update(f.read())
    index = os.path.join(path, WEIGHT_INDEX)
    if os.path.isfile(index):
        with open(index, "rb") as f:
            digest.update(f.read())
    else:
        for name in sorted(glob.glob("*.safetensors", root_dir=path)):
            digest.update(f"\0{name}\0{os.path.getsize(os.path.join(path, name))}".encode())
    return digest.hexdigest()[:16]


def cache_root() -> str:
    """Where specslot keeps what it fetches or derives (PyPI model files, converted GGUF
    models): `SPECSLOT_CACHE_DIR`, else `$XDG_CACHE_HOME/specslot`, else `~/.cache/specslot`."""
    root = os.environ.get("SPECSLOT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specslot"
    )
    return os.path.abspath(root)


_SHA256_SEEN: dict[tuple, str] = {}


def file_sha256(path: str) -> str:
    """The file's sha256 (hex), remembered per process by path, size, mtime and inode: a
    replica resolves its model file several times while it starts, each hash a full read."""
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)
    if key not in _SHA256_SEEN:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        _SHA256_SEEN[key] = digest.hexdigest()
    return _SHA256_SEEN[key]
