"""`python -m models.platform.doctor`: what this machine runs specslot's models on.

Prints the CPU flags that decide the BLAS, the library chosen and why, its threads and
measured float32 matmul rate, the MLX device and the versions that matter. `--json`
prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib import metadata

import models  # noqa: F401  (loads the BLAS, as every specslot process does)
from models.platform import _blas

# Flags that change which kernels run (x86-64 levels, AVX-512 extensions, arm64 SIMD).
FLAGS_THAT_MATTER = (
    "sse2",
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "amx_tile",
    "asimd",
    "sve",
    "sve2",
)
ENV_THAT_MATTERS = (
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_THREAD_TIMEOUT",
    "GOTO_THREAD_TIMEOUT",
    "SPECSLOT_FAST_BLAS",
    "SPECSLOT_BLAS_ROWS",
)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":")[0].strip() in ("model name", "Model", "CPU part"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(size: int = 1024) -> dict:
    """Everything the doctor prints, as plain data."""
    import mlx.core as mx

    state = _blas.loaded()
    flags = _blas.cpu_flags()
    launch = _blas._launch_environ()  # as the user started it: loading the BLAS sets variables of its own
    return {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": _cpu_model(),
        "usable_cores": _blas._usable_cores(),
        "cpu_flags": {name: name in flags for name in FLAGS_THAT_MATTER},
        "blas": state.choice.library,
        "blas_reason": state.choice.reason,
        "blas_path": state.path,
        "blas_config": state.config,
        "blas_kernels": state.core,
        "blas_threads": state.threads,
        "blas_threads_from": state.threads_from,
        "blas_thread_timeout": state.thread_timeout,
        "blas_thread_timeout_from": state.thread_timeout_from,
        "blas_rows": state.rows,
        "matmul_gflops": round(_blas.measure_gflops(size), 1),
        "matmul_size": size,
        "mlx_device": str(mx.default_device()),
        "versions": {
            "python": platform.python_version(),
            "mlx": _version("mlx"),
            "mlx-lm": _version("mlx-lm"),
            "ray": _version("ray"),
            "scipy-openblas32": _version("scipy-openblas32"),
        },
        "env": {name: launch[name] for name in ENV_THAT_MATTERS if name in launch},
    }


def render(info: dict) -> str:
    flags = " ".join(f"{name}{'+' if has else '-'}" for name, has in info["cpu_flags"].items())
    lines = [
        f"platform      {info['platform']}, {info['cpu']}, {info['usable_cores']} usable cores",
        f"cpu flags     {flags}",
        f"blas          {info['blas']}: {info['blas_reason']}",
    ]
    if info["blas_path"]:
        lines += [
            f"  library     {info['blas_path']}",
            f"  build       {info['blas_config']}",
            f"  kernels     {info['blas_kernels']}",
            f"  threads     {info['blas_threads']} ({info['blas_threads_from']}); idle ones sleep after "
            f"2^{info['blas_thread_timeout']} cycles ({info['blas_thread_timeout_from']})",
            f"  few-row     {info['blas_rows']} (models/platform/sgemm_rows.c)",
        ]
    lines += [
        f"matmul        {info['matmul_gflops']} GFLOP/s (float32 {info['matmul_size']}², MLX CPU stream)",
        f"mlx device    {info['mlx_device']}",
        "versions      " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
        "environment   "
        + (
            ", ".join(f"{k}={v}" for k, v in info["env"].items()) or "(none of " + ", ".join(ENV_THAT_MATTERS) + " set)"
        ),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m models.platform.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--size", type=int, default=1024, help="matmul size for the rate (default 1024)")
    args = parser.parse_args(argv)
    info = report(args.size)
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
