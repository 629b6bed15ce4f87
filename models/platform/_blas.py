"""Choose and load the CPU BLAS that MLX's matmuls run on, before `mlx.core` is imported.

The `mlx-cpu` wheel links a slow reference BLAS; loading `scipy-openblas32` (DYNAMIC_ARCH:
kernels picked from `cpuid`) globally first makes MLX resolve `cblas_sgemm` to it, through a
cached copy from `models.platform._elf` that exports its `scipy_`-prefixed symbols as plain
`cblas_*`. The choice is made from the CPU's feature flags before anything is loaded (a
library with instructions the CPU lacks dies with SIGILL, which no process can catch):
`CHOICES` is the whole table, `select` a pure function over it. Threads: `OPENBLAS_NUM_THREADS`
wins, then `OMP_NUM_THREADS` as the user launched the process with it (not Ray's value inside
its workers), else every usable core, less one inside a Ray worker (Ray's other processes
share the cores) until `fit_threads` gives it back for weights over `ALL_CORES_BYTES`.
`OPENBLAS_THREAD_TIMEOUT` is 4 (a finished thread sleeps at once) unless the environment sets
it or `GOTO_THREAD_TIMEOUT`. Must not import mlx. See docs/configuration.md, "CPU BLAS".
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from models.platform import _elf

OPENBLAS = "scipy-openblas32"
REFERENCE = "reference"
ACCELERATE = "accelerate"
_PATCH_VERSION = 1  # bump when the rewritten copy's layout changes


@dataclass(frozen=True)
class Choice:
    """What `select` decided: the library and, in words, why."""

    library: str
    reason: str


# (system, machine, CPU flags that must all be present, library): the first row that
# matches wins. OpenBLAS's DYNAMIC_ARCH baseline is SSE2 on x86-64 and Advanced SIMD on
# arm64; its kernels for AVX2 and AVX-512 are chosen at run time, only where present.
CHOICES: tuple[tuple[str, str, frozenset[str], str], ...] = (
    ("darwin", "*", frozenset(), ACCELERATE),
    ("linux", "x86_64", frozenset({"sse2"}), OPENBLAS),
    ("linux", "aarch64", frozenset({"asimd"}), OPENBLAS),
)

# OPENBLAS_CORETYPE forces a kernel set without checking the CPU: the flags each needs.
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
CORETYPE_FLAGS: dict[str, frozenset[str]] = {
    "sapphirerapids": _AVX512 | {"avx512_bf16", "amx_bf16"},
    "cooperlake": _AVX512 | {"avx512_bf16"},
    "skylakex": _AVX512,
    "haswell": frozenset({"avx2", "fma"}),
    "zen": frozenset({"avx2", "fma"}),
    "sandybridge": frozenset({"avx"}),
    "bulldozer": frozenset({"avx"}),
    "piledriver": frozenset({"avx", "fma"}),
    "steamroller": frozenset({"avx", "fma"}),
    "excavator": frozenset({"avx2", "fma"}),
    "nehalem": frozenset({"sse4_2"}),
    "neoversev1": frozenset({"sve"}),
    "neoversev2": frozenset({"sve2"}),
    "neoversen2": frozenset({"sve2"}),
    "armv8sve": frozenset({"sve"}),
    "a64fx": frozenset({"sve"}),
}


def select(system: str, machine: str, flags: frozenset[str]) -> Choice:
    """The library for this CPU, from its flags alone.

    >>> select("linux", "x86_64", frozenset({"sse2", "avx2"})).library
    'scipy-openblas32'
    >>> select("linux", "riscv64", frozenset()).library
    'reference'
    """
    for row_system, row_machine, needed, library in CHOICES:
        if row_system != system or row_machine not in ("*", machine):
            continue
        missing = needed - flags
        if missing:
            return Choice(REFERENCE, f"{machine} CPU lacks {', '.join(sorted(missing))}")
        return Choice(library, f"{system}/{machine}, {_why(library)}")
    return Choice(REFERENCE, f"no fast BLAS known for {system}/{machine}")


def _why(library: str) -> str:
    if library == ACCELERATE:
        return "MLX links Apple's Accelerate itself"
    return "DYNAMIC_ARCH: kernels picked from cpuid at load"


def coretype_conflict(coretype: str | None, flags: frozenset[str]) -> str | None:
    """Why a forced OPENBLAS_CORETYPE would crash this CPU, or None when it is safe."""
    if not coretype:
        return None
    missing = CORETYPE_FLAGS.get(coretype.strip().lower(), frozenset()) - flags
    if not missing:
        return None
    return f"OPENBLAS_CORETYPE={coretype} needs {', '.join(sorted(missing))}, which this CPU lacks"


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (x86 `flags`, arm64 `Features`); empty if unreadable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


LEFT_ONE = "one left to the node's other processes"
# Weights a decode step reads past which its matmuls split well over every core, even beside
# Serve's processes; below it one core is left to them (docs/configuration.md, "CPU BLAS").
ALL_CORES_BYTES = 64 << 20


def thread_count(environ: dict, launch_environ: dict, in_ray_worker: bool, num_cores: int) -> tuple[int, str]:
    """(threads, where the number came from); see the module docstring for the order."""
    for name, env in (("OPENBLAS_NUM_THREADS", environ), ("OMP_NUM_THREADS", environ)):
        value = env.get(name, "").strip()
        if name == "OMP_NUM_THREADS" and in_ray_worker and name not in launch_environ:
            continue  # Ray's own default for workers, not the user's
        if value.isdigit() and int(value) > 0:
            return int(value), name
    if in_ray_worker and num_cores > 1:
        return num_cores - 1, f"{num_cores - 1} of {num_cores} usable cores: {LEFT_ONE}"
    return num_cores, f"all {num_cores} usable cores"


THREAD_TIMEOUT = "4"  # log2 of the cycles an idle OpenBLAS thread spins before it sleeps (4 is its least)


def thread_timeout(environ: dict) -> tuple[str, str]:
    """(OpenBLAS's idle-thread timeout, where it came from); see the module docstring.

    >>> thread_timeout({})
    ('4', 'specslot default')
    >>> thread_timeout({"GOTO_THREAD_TIMEOUT": "28"})
    ('28', 'GOTO_THREAD_TIMEOUT')
    """
    for name in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"):
        value = environ.get(name, "").strip()
        if value:
            return value, name
    return THREAD_TIMEOUT, "specslot default"


@dataclass
class Loaded:
    """What `load_fast_blas` did in this process."""

    choice: Choice
    path: str | None = None
    threads: int | None = None
    threads_from: str = ""
    thread_timeout: str = ""  # OPENBLAS_THREAD_TIMEOUT as the library read it at load
    thread_timeout_from: str = ""
    config: str = ""
    core: str = ""
    warning: str = ""
    lib: object = None  # the loaded library (ctypes), for `fit_threads`
    rows: str = ""  # what became of the few-row products (`_load_rows`)
    rows_kernel: str = ""  # the `ROW_KERNELS` name the shim took, where it serves
    rows_lib: object = None  # the few-row library (ctypes), when it serves


_state: Loaded | None = None


def loaded() -> Loaded | None:
    """What this process loaded (None before `load_fast_blas` ran)."""
    return _state


def load_fast_blas() -> Loaded:
    """Load the library `select` picks, globally, once per process.

    Never raises: where no fast library can be loaded, MLX keeps its reference BLAS and
    one warning line with the reason and the measured rate goes to stderr.
    `SPECSLOT_FAST_BLAS=0` opts out.
    """
    global _state
    if _state is not None:
        return _state
    system = sys.platform if sys.platform == "darwin" else platform.system().lower()
    flags = cpu_flags()
    choice = select(system, platform.machine(), flags)
    _state = Loaded(choice)
    if choice.library == OPENBLAS:
        if os.environ.get("SPECSLOT_FAST_BLAS", "1") == "0":
            _state.choice = Choice(REFERENCE, "SPECSLOT_FAST_BLAS=0")
        elif "mlx.core" in sys.modules:
            _state.choice = Choice(REFERENCE, "mlx.core was imported before models")
        else:
            try:
                _load_openblas(_state, flags)
            except (OSError, AttributeError, _elf.ElfError) as exc:
                _state.choice = Choice(REFERENCE, f"{OPENBLAS} could not be loaded: {exc}")
    if needs_warning(_state.choice, _gpu_is_default):
        _state.warning = (
            f"specslot: warning: MLX runs on its reference CPU BLAS "
            f"({_state.choice.reason}); measured {measure_gflops(256):.1f} GFLOP/s"
        )
        print(_state.warning, file=sys.stderr)
    return _state


def needs_warning(choice: Choice, gpu_is_default: Callable[[], bool]) -> bool:
    """Whether the reference BLAS is worth a warning: not where the user opted out, and
    not where MLX computes on a GPU (the CPU's matmuls then serve no model forward).
    `gpu_is_default` is asked last: it imports mlx.core."""
    return choice.library == REFERENCE and choice.reason != "SPECSLOT_FAST_BLAS=0" and not gpu_is_default()


def _gpu_is_default() -> bool:
    """Whether MLX's default device is a GPU (CUDA or Metal); imports mlx.core, so only
    after the BLAS choice is made."""
    try:
        import mlx.core as mx

        return mx.default_device().type == mx.DeviceType.gpu
    except Exception:  # noqa: BLE001 - an MLX that cannot say: treat as a CPU
        return False


def _load_openblas(state: Loaded, flags: frozenset[str]) -> None:
    conflict = coretype_conflict(os.environ.get("OPENBLAS_CORETYPE"), flags)
    if conflict:
        print(f"specslot: warning: {conflict}; ignoring it", file=sys.stderr)
        os.environ.pop("OPENBLAS_CORETYPE")
    source = openblas_library()
    if source is None:
        raise OSError(f"the {OPENBLAS} wheel is not installed")
    path = _plain_named_copy(source)
    # Read once, by the library's constructor at load, from the C environment os.environ writes.
    state.thread_timeout, state.thread_timeout_from = thread_timeout(os.environ)
    ours = state.thread_timeout_from == "specslot default"
    if ours:
        os.environ["OPENBLAS_THREAD_TIMEOUT"] = state.thread_timeout
    try:  # privately first: the few-row shim, if any, joins the global scope ahead of it
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    finally:
        if ours:  # children choose for themselves when they load it
            del os.environ["OPENBLAS_THREAD_TIMEOUT"]
    lib.cblas_sgemm  # noqa: B018  (AttributeError, reported by the caller, if the rename failed)
    state.rows_lib = _load_rows(state, lib)
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # the same library, now global: MLX binds its cblas_*
    threads, state.threads_from = thread_count(os.environ, _launch_environ(), _in_ray_worker(), _usable_cores())
    lib.scipy_openblas_set_num_threads(threads)
    state.threads = lib.scipy_openblas_get_num_threads()
    state.lib = lib
    for attr, fn in (("config", lib.scipy_openblas_get_config), ("core", lib.scipy_openblas_get_corename)):
        fn.restype = ctypes.c_char_p
        setattr(state, attr, fn().decode())
    state.path = lib._name


ROWS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sgemm_rows.c")
COMPILERS = ("cc", "gcc", "clang")


# The few-row kernels of `sgemm_rows.c` by the number the shim knows each by, best first.
# The shim takes the best its CPU's flags allow (cpuid, as OpenBLAS asks it), capped by
# `SPECSLOT_BLAS_ROWS`; without a kernel a one-row product still goes to sgemv.
ROW_KERNELS = {"avx512": 2, "avx2": 1, "sgemv": 0}
ROWS_MAX = 8  # the most rows of A a kernel takes (MAX_ROWS in sgemm_rows.c)


def row_kernel_cap(setting: str) -> int:
    """The most `SPECSLOT_BLAS_ROWS` lets the shim use: a kernel's name caps it there, `1`
    (or anything else) leaves the CPU's best.

    >>> row_kernel_cap("1"), row_kernel_cap("avx2"), row_kernel_cap("sgemv")
    (2, 1, 0)
    """
    return ROW_KERNELS.get(setting, max(ROW_KERNELS.values()))


def _load_rows(state: Loaded, openblas: ctypes.CDLL) -> ctypes.CDLL | None:
    """The few-row products (`sgemm_rows.c`): OpenBLAS's sgemm packs the whole weight matrix
    even for a product of one to a few rows, so a decode step, a draft step or a verify of a
    few tokens read their weights about twice at sgemm's pace (SmolLM2's MLP up projection
    for 5 rows on two threads: 9.5 ms against 3.7 with the kernel). Products of 1 to
    `ROWS_MAX` rows run on the shim's AVX-512 or AVX2 kernel (`ROW_KERNELS`), split over
    OpenBLAS's thread count; without a kernel a one-row product goes to sgemv. The shim is
    compiled once per machine with the C compiler found on PATH and cached; without one, or
    with `SPECSLOT_BLAS_ROWS=0`, every product stays with sgemm (`state.rows` says which).
    Loaded globally before OpenBLAS so MLX binds its `cblas_sgemm`, handed
    `openblas`'s functions at once; None where it does not serve."""
    setting = os.environ.get("SPECSLOT_BLAS_ROWS", "1").strip().lower() or "1"
    if setting == "0":
        state.rows = "off (SPECSLOT_BLAS_ROWS=0)"
        return None
    try:
        path = _rows_library()
        if path is None:
            state.rows = "off (no C compiler on PATH to build models/platform/sgemm_rows.c)"
            return None
        functions = (openblas.cblas_sgemm, openblas.cblas_sgemv, openblas.scipy_openblas_get_num_threads)
        gemm, gemv, threads = (ctypes.cast(fn, ctypes.c_void_p) for fn in functions)
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
        for name in ("specslot_rows_sent", "specslot_rows_kernel"):
            getattr(lib, name).restype = ctypes.c_long
        lib.specslot_rows_set.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
        # before anything can call it: mlx.core is not imported
        number = lib.specslot_rows_set(gemm, gemv, threads, row_kernel_cap(setting))
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        state.rows = f"off ({exc})"
        return None
    state.rows_kernel = next(name for name, n in ROW_KERNELS.items() if n == number)
    state.rows = f"{state.rows_kernel} kernel for 1-{ROWS_MAX} rows" if number else "sgemv"
    return lib


def _shim_count(name: str) -> int | None:
    lib = _state.rows_lib if _state is not None else None
    return None if lib is None else getattr(lib, name)()


def rows_sent() -> int | None:
    """One-row products sent to sgemv so far in this process (None: the shim is not in use)."""
    return _shim_count("specslot_rows_sent")


def rows_kernel_sent() -> int | None:
    """Few-row products run on the shim's kernel so far in this process (None: no shim)."""
    return _shim_count("specslot_rows_kernel")


def products_key() -> str:
    """Which code runs MLX's CPU products in this process, for keys of what was measured
    with it (the tick costs, the policy's verdicts): the library, and `+` the few-row
    kernel (or `sgemv`) where the shim serves."""
    if _state is None:
        return "unloaded"
    return _state.choice.library + (f"+{_state.rows_kernel}" if _state.rows_lib is not None else "")


def _rows_library() -> str | None:
    """The compiled shim, cached by its source's hash and the machine (it picks its kernel at
    run time, so one build serves every CPU of the architecture); None without a compiler."""
    with open(ROWS_SOURCE, "rb") as f:
        source = f.read()
    digest = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    compiler = next((found for c in COMPILERS if (found := shutil.which(c))), None)

    def make(tmp: str) -> None:
        cmd = [compiler, "-O2", "-pthread", "-shared", "-fPIC", "-o", tmp, ROWS_SOURCE]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip().splitlines()[-1:]}")

    return _cached_file(f"libspecslot-rows-{digest}.so", make if compiler else None, "the few-row library")


def fit_threads(weight_bytes: int) -> str | None:
    """Where the thread count left a core to Ray's other processes (no variable set it),
    every core for a model whose weights exceed `ALL_CORES_BYTES`. Returns what changed
    (None: nothing)."""
    state = _state
    if state is None or state.lib is None or not state.threads_from.endswith(LEFT_ONE):
        return None
    if weight_bytes <= ALL_CORES_BYTES:
        return None
    cores = _usable_cores()
    state.lib.scipy_openblas_set_num_threads(cores)
    state.threads = state.lib.scipy_openblas_get_num_threads()
    state.threads_from = f"all {cores} usable cores: the model's weights ({weight_bytes / 1e6:.0f} MB) split well"
    return f"BLAS threads {state.threads} ({state.threads_from})"


def _plain_named_copy(source: str) -> str:
    """A cached copy of `source` whose `scipy_cblas_*` symbols are exported as `cblas_*`."""
    stat = os.stat(source)

    def make(tmp: str) -> None:
        with open(source, "rb") as f:
            image, renamed = _elf.strip_symbol_prefix(f.read(), b"scipy_", b"scipy_cblas_")
        if b"cblas_sgemm" not in renamed:
            raise _elf.ElfError("cblas_sgemm could not be exported under its plain name")
        with open(tmp, "wb") as f:
            f.write(image)

    return _cached_file(
        f"libopenblas-plain-v{_PATCH_VERSION}-{stat.st_size}-{stat.st_mtime_ns}.so", make, "the BLAS library"
    )


def _cached_file(name: str, make: Callable[[str], None] | None, what: str) -> str | None:
    """`name` in the first cache folder holding it, else written by `make(path)` into the first
    writable one and moved into place whole (concurrent workers never see half a file).
    None where no folder holds it and there is no `make`."""
    for folder in (_cache_dir(), os.path.join(tempfile.gettempdir(), f"specslot-blas-{os.getuid()}")):
        target = os.path.join(folder, name)
        if os.path.exists(target):
            return target
        if make is None:
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder)
            os.close(fd)
            try:
                make(tmp)
            except BaseException:
                os.unlink(tmp)
                raise
            os.replace(tmp, target)
            return target
        except PermissionError:
            continue
    if make is None:
        return None
    raise OSError(f"no writable cache directory for {what}")


def openblas_library() -> str | None:
    """Path of the wheel's shared library, wherever the wheel is installed (a venv,
    `pip install --target`, a zipapp-free PYTHONPATH entry); None if it is not."""
    spec = importlib.util.find_spec("scipy_openblas32")  # locates the package, runs none of it
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        hits = sorted(glob.glob(os.path.join(folder, "lib", "libscipy_openblas*.so")))
        if hits:
            return hits[0]
    return None


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specslot", "blas")


def _launch_environ() -> dict:
    """The environment this process was started with (not later os.environ changes)."""
    try:
        with open("/proc/self/environ", "rb") as f:
            items = f.read().split(b"\0")
    except OSError:
        return dict(os.environ)
    return dict(item.decode(errors="replace").partition("=")[::2] for item in items if b"=" in item)


def _in_ray_worker() -> bool:
    ray = sys.modules.get("ray")
    if ray is None:
        return False
    try:
        # is_initialized first: get_runtime_context() starts a local Ray instance otherwise.
        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:  # noqa: BLE001  (a Ray without these: not a worker we know)
        return False


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def measure_gflops(size: int = 1024, repeats: int = 5) -> float:
    """Best float32 `size`² matmul rate on MLX's CPU stream, in GFLOP/s (imports mlx)."""
    import time

    import mlx.core as mx

    a = mx.random.normal((size, size), stream=mx.cpu)
    b = mx.random.normal((size, size), stream=mx.cpu)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def probe(size: int = 1024, repeats: int = 5) -> dict:
    """What this process runs MLX's CPU matmuls on: the library, its threads, whether an
    OpenBLAS is mapped, and the best float32 `size`² matmul rate in GFLOP/s."""
    mapped = False
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            mapped = "openblas" in f.read()
    state = _state or Loaded(Choice(REFERENCE, "load_fast_blas was not called"))
    return {
        "library": state.choice.library,
        "path": state.path,
        "threads": state.threads,
        "openblas_mapped": mapped,
        "gflops": measure_gflops(size, repeats),
    }
