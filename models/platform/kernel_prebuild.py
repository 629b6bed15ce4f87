"""A fresh GPU kernel cache's first kernels, built in parallel while the replica loads.

MLX's CUDA backend compiles a kernel family with NVRTC the first time one of its ops
runs, on the thread that evaluates, one family after another, seconds each: a replica's
first start on a fresh machine spent most of its time building nine (gathers of the dtype
pairs the forward and the sampler use, the key/value write's scatter, SiLU, SwiGLU;
docs/gpu.md, "Install and serve"), every other start loads them from the kernel cache
(`models.platform.kernel_cache`). A family is keyed by its op and dtypes alone (whatever the
shapes), so a tiny op of the same dtypes builds the same kernels. When the replica's
kernel cache is empty, `start` runs one process per family in `FAMILIES`, each with a
cache directory of its own, and `publish`es each one's files into the replica's cache
as it finishes: the kernel-name list and the source first, the compiled code last,
each renamed into place, so MLX (which reads the code, then the list) never sees half a
family. The replica's first use of a family then loads it; one it reaches before its
helper is done it builds itself, as it always did. Nothing waits for the helpers.

Run as a script (`python kernel_prebuild.py FAMILY ...`, without the `models` package,
whose import measures the CPU BLAS), it builds the families named in the directory
`MLX_PTX_CACHE_DIR` names.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

log = logging.getLogger(__name__)

# What a llama / qwen2 / mistral forward and the sampler build on first use under the pinned
# mlx, `{dt}` the model's float dtype (docs/gpu.md, "Install and serve").
FAMILIES = (
    "gather:{dt}:int32",
    "gather:{dt}:uint32",
    "gather:uint32:uint32",
    "gather:uint32:int32",
    "gather:int32:int32",
    "gather_axis:{dt}:int32",
    "scatter:{dt}:int64",
    "silu:{dt}",
    "swiglu:{dt}",
)
HELPER_TIMEOUT_S = 180.0
# safetensors' dtype names -> MLX's, for the floating dtypes a model computes in
_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def model_dtype(model_dir: str) -> str:
    """The float dtype most of the model at `model_dir` computes in, read from file
    headers alone: a GGUF file (or a directory holding one) by its tensor types, else the
    safetensors dtypes (a quantized model's scales: what its dequantized weights compute
    in); "bfloat16" when none can be read (the helpers then build what the common case
    needs)."""
    from models.loading.checks import ModelLoadError
    from models.loading.gguf import find_gguf  # no mlx: this runs before it is imported

    try:
        gguf = find_gguf(model_dir)
    except ModelLoadError:  # a folder of several GGUF files: which one is not for us to guess
        gguf = None
    if gguf is not None:
        return _gguf_dtype(gguf) or "bfloat16"
    counts: Counter[str] = Counter()
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))[:4]:
        try:
            with open(path, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error):
            continue
        for name, entry in header.items():
            if name != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") in _FLOAT_DTYPES:
                counts[_FLOAT_DTYPES[entry["dtype"]]] += 1
    return counts.most_common(1)[0][0] if counts else "bfloat16"


def _gguf_dtype(path: str) -> str | None:
    """What MLX computes a GGUF file's weights in: its quantized blocks' scales and F16
    tensors are float16, BF16 ones bfloat16; the most common among the 2-D tensors (norms
    stay float32 in every file). None when the header cannot be read."""
    counts: Counter[str] = Counter()
    try:
        with open(path, "rb") as f:
            magic, _version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
            if magic != b"GGUF":
                return None
            for _ in range(n_kv):
                _skip_gguf_string(f)
                (kind,) = struct.unpack("<I", f.read(4))
                _skip_gguf_value(f, kind)
            for _ in range(n_tensors):
                _skip_gguf_string(f)
                (n_dims,) = struct.unpack("<I", f.read(4))
                f.seek(8 * n_dims, os.SEEK_CUR)
                ggml_type, _offset = struct.unpack("<IQ", f.read(12))
                if n_dims >= 2 and ggml_type != _GGML_F32:
                    counts["bfloat16" if ggml_type == _GGML_BF16 else "float16"] += 1
                elif n_dims >= 2:
                    counts["float32"] += 1
    except (OSError, ValueError, struct.error):
        return None
    return counts.most_common(1)[0][0] if counts else None


_GGML_F32, _GGML_BF16 = 0, 30
# GGUF metadata value types -> their size in bytes (8: string, 9: array, handled apart)
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_gguf_string(f) -> None:
    (length,) = struct.unpack("<Q", f.read(8))
    f.seek(length, os.SEEK_CUR)


def _skip_gguf_value(f, kind: int) -> None:
    if kind == 8:
        _skip_gguf_string(f)
    elif kind == 9:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _GGUF_SIZES:
            f.seek(_GGUF_SIZES[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_gguf_value(f, item)
    elif kind in _GGUF_SIZES:
        f.seek(_GGUF_SIZES[kind], os.SEEK_CUR)
    else:
        raise ValueError(f"GGUF value type {kind}")


def families(dtype: str) -> list[str]:
    """`FAMILIES` for a model computing in `dtype`."""
    return [f.format(dt=dtype) for f in FAMILIES]


def mlx_default_ptx_dir() -> str:
    """Where MLX keeps its compiled kernels without `MLX_PTX_CACHE_DIR`."""
    from importlib import metadata

    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return os.path.join(tempfile.gettempdir(), "mlx", version, "ptx")


def publish(src: str, dst: str) -> int:
    """Move the kernel families compiled into `src` into `dst` (same file system): per
    family its source and kernel-name list, then its compiled code, each renamed into
    place. Returns the families moved."""
    moved = 0
    for code in sorted(glob.glob(os.path.join(src, "*.ptx"))):
        stem = code[: -len(".ptx")]
        if not os.path.exists(stem + ".txt"):  # the helper died between the two writes
            continue
        name = os.path.basename(stem)
        for ext in (".cu", ".txt", ".ptx"):
            if os.path.exists(stem + ext):
                os.replace(stem + ext, os.path.join(dst, name + ext))
        moved += 1
    return moved


def start(ptx_dir: str, dtype: str, env: dict | None = None) -> threading.Thread | None:
    """Build `families(dtype)` into `ptx_dir` in parallel (a thread watching one process
    per family) when `ptx_dir` holds no kernel yet; None when it does (a cache from an
    earlier start, whose kernels MLX loads anyway, or a folder it cannot write: the
    load then builds them itself). `env`: more environment for the helpers."""
    if glob.glob(os.path.join(ptx_dir, "*.ptx")):
        return None
    if _building(ptx_dir):
        log.info("GPU kernel cache %s: another process is building its first kernels", ptx_dir)
        return None
    try:
        os.makedirs(ptx_dir, exist_ok=True)
        work = tempfile.mkdtemp(prefix=".prebuild-", dir=ptx_dir)  # the helpers' folders, on the cache's disk
    except OSError as exc:
        log.warning("not building kernels in parallel: %s", exc)
        return None
    thread = threading.Thread(
        target=_build_all,
        args=(ptx_dir, work, families(dtype), env or {}),
        name="specslot-kernel-prebuild",
        daemon=True,
    )
    thread.start()
    return thread


def _building(ptx_dir: str) -> bool:
    """Whether another `start` (the CLI's, before this replica's) has helpers at work in
    `ptx_dir`: a helpers' folder younger than their timeout (an older one was left by a
    killed process)."""
    now = time.time()
    for work in glob.glob(os.path.join(ptx_dir, ".prebuild-*")):
        try:
            if now - os.path.getmtime(work) < HELPER_TIMEOUT_S:
                return True
        except OSError:  # finished and removed meanwhile
            continue
    return False


def _build_all(ptx_dir: str, work: str, names: list[str], extra_env: dict) -> None:
    """Run one helper per family in its own folder under `work`, publish each into
    `ptx_dir` as it ends, then remove `work`."""
    tic = time.perf_counter()
    log.info("fresh GPU kernel cache: building %d kernel families in parallel", len(names))
    helpers = []
    try:
        for i, name in enumerate(names):
            out = os.path.join(work, str(i))
            os.makedirs(out)
            env = {**os.environ, **extra_env, "MLX_PTX_CACHE_DIR": out}
            with open(os.path.join(work, f"{i}.err"), "wb") as err:  # a file: a pipe left unread could fill
                helpers.append(
                    (
                        name,
                        out,
                        subprocess.Popen(
                            [sys.executable, os.path.abspath(__file__), name],
                            env=env,
                            stdout=subprocess.DEVNULL,
                            stderr=err,
                        ),
                    )
                )
        built, failed, pending = 0, [], list(helpers)
        while pending:  # publish each family as soon as its helper is done
            time.sleep(0.05)
            timed_out = time.perf_counter() - tic > HELPER_TIMEOUT_S
            for helper in list(pending):
                name, out, proc = helper
                if proc.poll() is None and not timed_out:
                    continue
                pending.remove(helper)
                if proc.poll() is None:
                    proc.kill()
                    failed.append(f"{name} (timed out)")
                elif proc.returncode != 0:
                    with open(out + ".err", "rb") as err:
                        last = err.read().decode(errors="replace").strip().splitlines()[-1:]
                    failed.append(f"{name} ({last[0] if last else proc.returncode})")
                built += publish(out, ptx_dir)
        log.info(
            "built %d kernel families in %.1f s%s",
            built,
            time.perf_counter() - tic,
            f"; failed: {', '.join(failed)}" if failed else "",
        )
    except Exception:  # noqa: BLE001 - a helper's failure only costs the replica the time it saves
        log.exception("building the kernel families in parallel failed; the replica builds them as it goes")
    finally:
        for _, _, proc in helpers:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


def build(family: str) -> None:
    """Run one tiny op of `family` ("gather:bfloat16:int32", ...), so MLX compiles its kernels."""
    import mlx.core as mx
    import mlx.nn as nn

    kind, *names = family.split(":")
    dt = [getattr(mx, n) for n in names]
    if kind == "gather":
        out = mx.zeros((4, 8), dt[0])[mx.array([0, 2], dt[1])]
    elif kind == "gather_axis":
        out = mx.take_along_axis(mx.zeros((2, 8), dt[0]), mx.zeros((2, 1), dt[1]), axis=-1)
    elif kind == "scatter":
        out = mx.zeros((8, 4), dt[0])
        out[mx.array([1, 3], dt[1])] = mx.ones((2, 4), dt[0])
    elif kind == "silu":
        out = nn.silu(mx.ones((2, 8), dt[0]))
    elif kind == "swiglu":  # mlx-lm's `activations.swiglu`, the same graph (importing mlx-lm takes seconds)
        out = mx.compile(lambda gate, x: nn.silu(gate) * x, shapeless=True)(
            mx.ones((2, 8), dt[0]), mx.ones((2, 8), dt[0])
        )
    else:
        raise ValueError(f"unknown kernel family {family!r}")
    mx.eval(out)


if __name__ == "__main__":
    del sys.path[0]  # this file's directory: its modules are not to shadow anything
    for arg in sys.argv[1:]:
        build(arg)
