"""The CPU BLAS under MLX: chosen from CPU flags, loaded in every process, fast, and safe
on CPUs without AVX-512 (a wrong choice there is a SIGILL, so crashes run in children)."""

import os
import platform
import shutil
import subprocess
import sys

import pytest

import models.platform._blas as blas
import models.platform._elf as elf
from tests.conftest import FAST_BLAS_MIN_RATIO

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS uses Accelerate")
x86_linux = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine() == "x86_64"), reason="emulates x86-64 CPUs"
)

AVX512 = {"sse2", "sse4_2", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
AVX2 = {"sse2", "sse4_2", "avx", "avx2", "fma"}
SSE42 = {"sse2", "sse4_2"}


@pytest.mark.parametrize(
    "system, machine, flags, library",
    [
        ("linux", "x86_64", AVX512, blas.OPENBLAS),
        ("linux", "x86_64", AVX2, blas.OPENBLAS),
        ("linux", "x86_64", SSE42, blas.OPENBLAS),
        ("linux", "x86_64", set(), blas.REFERENCE),  # flags unreadable: load nothing
        ("linux", "aarch64", {"fp", "asimd", "sve"}, blas.OPENBLAS),
        ("linux", "aarch64", {"fp"}, blas.REFERENCE),
        ("linux", "riscv64", {"rv64"}, blas.REFERENCE),
        ("darwin", "arm64", set(), blas.ACCELERATE),
    ],
)
def test_selection_table(system, machine, flags, library):
    choice = blas.select(system, machine, frozenset(flags))
    assert choice.library == library
    assert choice.reason  # every choice says why


@pytest.mark.parametrize(
    "coretype, flags, conflict",
    [
        ("SkylakeX", AVX2, True),
        ("skylakex", AVX512, False),
        ("Haswell", SSE42, True),
        ("Haswell", AVX2, False),
        ("Nehalem", SSE42, False),
        ("SapphireRapids", AVX512, True),  # needs bf16 and AMX on top
        ("NeoverseV1", {"asimd"}, True),
        ("SomeFutureCore", SSE42, False),  # unknown names are OpenBLAS's to judge
        (None, SSE42, False),
    ],
)
def test_forced_coretype_is_checked_against_the_flags(coretype, flags, conflict):
    assert (blas.coretype_conflict(coretype, frozenset(flags)) is not None) is conflict


@pytest.mark.parametrize(
    "environ, launch, in_ray, expected",
    [
        ({}, {}, False, (8, "all 8 usable cores")),
        ({"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "5"}, {}, False, (3, "OPENBLAS_NUM_THREADS")),
        ({"OMP_NUM_THREADS": "5"}, {"OMP_NUM_THREADS": "5"}, False, (5, "OMP_NUM_THREADS")),
        (
            {"OMP_NUM_THREADS": "1"},
            {},
            True,  # Ray's worker default is ignored; one core is left to the others
            (7, "7 of 8 usable cores: one left to the node's other processes"),
        ),
        ({"OPENBLAS_NUM_THREADS": "8"}, {}, True, (8, "OPENBLAS_NUM_THREADS")),
        ({"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2"}, True, (2, "OMP_NUM_THREADS")),  # the user's
        ({"OPENBLAS_NUM_THREADS": "0"}, {}, False, (8, "all 8 usable cores")),
        ({"OPENBLAS_NUM_THREADS": "many"}, {}, False, (8, "all 8 usable cores")),
    ],
)
def test_thread_count(environ, launch, in_ray, expected):
    assert blas.thread_count(environ, launch, in_ray, 8) == expected


def test_a_ray_worker_on_one_core_keeps_its_thread():
    assert blas.thread_count({}, {}, True, 1) == (1, "all 1 usable cores")


class _FakeLib:
    def __init__(self, threads):
        self.threads = threads

    def scipy_openblas_set_num_threads(self, n):
        self.threads = n

    def scipy_openblas_get_num_threads(self):
        return self.threads


@pytest.mark.parametrize(
    "threads_from, weight_bytes, changed",
    [
        ("1 of 2 usable cores: one left to the node's other processes", 540_000_000, True),  # SmolLM2 f32
        ("1 of 2 usable cores: one left to the node's other processes", 28_000_000, False),  # the bundled toy
        ("OPENBLAS_NUM_THREADS", 540_000_000, False),  # the user's choice stands
        ("all 2 usable cores", 540_000_000, False),
    ],
)
def test_a_large_model_takes_every_core_a_ray_worker_left(monkeypatch, threads_from, weight_bytes, changed):
    state = blas.Loaded(blas.Choice(blas.OPENBLAS, "test"), threads=1, threads_from=threads_from, lib=_FakeLib(1))
    monkeypatch.setattr(blas, "_state", state)
    monkeypatch.setattr(blas, "_usable_cores", lambda: 2)
    result = blas.fit_threads(weight_bytes)
    assert (result is not None) is changed
    assert state.threads == (2 if changed else 1) and state.lib.threads == state.threads
    if changed:
        assert "all 2 usable cores" in state.threads_from and "540 MB" in result


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, ("4", "specslot default")),
        ({"OPENBLAS_THREAD_TIMEOUT": "28"}, ("28", "OPENBLAS_THREAD_TIMEOUT")),
        ({"GOTO_THREAD_TIMEOUT": "20"}, ("20", "GOTO_THREAD_TIMEOUT")),
        ({"OPENBLAS_THREAD_TIMEOUT": "6", "GOTO_THREAD_TIMEOUT": "20"}, ("6", "OPENBLAS_THREAD_TIMEOUT")),
        ({"OPENBLAS_THREAD_TIMEOUT": " "}, ("4", "specslot default")),
    ],
)
def test_thread_timeout(environ, expected):
    assert blas.thread_timeout(environ) == expected


_IDLE_CPU = (
    "import time, models, mlx.core as mx\n"
    "a = mx.random.normal((512, 512)); mx.eval(a @ a)\n"
    "mx.eval(a[:3] @ a)  # a few-row product: the shim's helpers, where it serves\n"
    "c = time.process_time(); time.sleep(0.5); print(time.process_time() - c)"
)


@linux_only
def test_idle_blas_threads_sleep_instead_of_spinning():
    """After a matmul that used every thread, and a few-row product on the shim's helpers,
    the process burns no CPU while it waits: OpenBLAS's own default (2^28 cycles, what a
    user's OPENBLAS_THREAD_TIMEOUT=28 asks for) keeps the finished threads spinning ~0.1 s."""
    if blas._usable_cores() < 2:
        pytest.skip("one usable core: OpenBLAS runs no second thread to spin")

    def idle_cpu_s(env: dict) -> float:
        proc = subprocess.run(
            [sys.executable, "-c", _IDLE_CPU],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={
                k: v
                for k, v in {**os.environ, **env}.items()
                if k not in ("OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT") or k in env
            },
        )
        return float(_assert_ran(proc))

    assert idle_cpu_s({}) < 0.03
    assert idle_cpu_s({"OPENBLAS_THREAD_TIMEOUT": "28"}) > 0.05


def test_cpu_flags_reads_x86_and_arm64_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert blas.cpu_flags(str(x86)) == {"fpu", "sse2", "avx2"}
    assert blas.cpu_flags(str(arm)) == {"fp", "asimd", "sve"}
    assert blas.cpu_flags(str(tmp_path / "missing")) == frozenset()


@linux_only
def test_rewritten_library_exports_plain_cblas_names_through_its_hash_table():
    source = blas.openblas_library()
    assert source, "scipy-openblas32 is a Linux dependency"
    with open(source, "rb") as f:
        original = f.read()
    image, renamed = elf.strip_symbol_prefix(original, b"scipy_", b"scipy_cblas_")
    assert len(image) == len(original) and b"cblas_sgemm" in renamed
    names, old_names = elf.dynamic_symbols(image), elf.dynamic_symbols(original)
    # Every symbol the original table exported is found, under its new name, where the
    # dynamic linker looks.
    exported = [i for i, name in enumerate(old_names) if elf.gnu_lookup(original, name, old_names) == i]
    assert len(exported) > 5000
    for index in exported:
        assert elf.gnu_lookup(image, names[index], names) == index, names[index]
    assert elf.gnu_lookup(image, b"scipy_cblas_sgemm", names) is None
    assert elf.gnu_lookup(image, b"no_such_symbol_anywhere", names) is None
    # Symbols the library calls through its own relocations keep their names.
    assert elf.gnu_lookup(image, b"scipy_sgemm_", names) is not None


def test_prefix_must_start_the_selection():
    with pytest.raises(ValueError):
        elf.strip_symbol_prefix(b"", b"scipy_", b"cblas_")
    with pytest.raises(elf.ElfError):
        elf.strip_symbol_prefix(b"not an elf file at all" * 4, b"scipy_", b"scipy_cblas_")


@linux_only
def test_this_process_runs_mlx_on_openblas_with_every_core(reference_gflops):
    result = blas.probe()
    assert result["library"] == blas.OPENBLAS and result["openblas_mapped"], blas.loaded()
    expected = blas.thread_count(os.environ, blas._launch_environ(), False, blas._usable_cores())[0]
    assert result["threads"] == min(expected, 64)
    assert result["gflops"] > FAST_BLAS_MIN_RATIO * reference_gflops, (
        f"{result['gflops']:.1f} GFLOP/s against the reference's {reference_gflops:.1f}: slow BLAS"
    )


def _run_matmul(prefix: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    code = (
        "import models, models.platform._blas as b, mlx.core as mx\n"
        "a = mx.random.normal((128, 128)); mx.eval(a @ a, a[:3] @ a)\n"
        "print(b.loaded().choice.library, b.loaded().core, b.loaded().rows_kernel or '-')"
    )
    return _python(code, env, prefix)


def _python(code: str, env: dict | None = None, prefix: list[str] = ()) -> subprocess.CompletedProcess:
    """`code` in a child Python in the repository (run under `prefix`, an emulator), with
    `env` over this environment."""
    return subprocess.run(
        [*prefix, sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def _assert_ran(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (
        f"child exited {proc.returncode} (signal {-proc.returncode} if < 0): {proc.stderr[-2000:]}"
    )
    return proc.stdout.strip()


@linux_only
def test_import_and_matmul_in_a_child_process():
    assert _assert_ran(_run_matmul([])).startswith(blas.OPENBLAS)


def test_importing_models_after_ray_starts_no_ray_instance():
    """A driver that imported Ray but never called ray.init (a script, Serve's CLI) then
    imports models: asking Ray whether this is a worker must not start a local instance."""
    code = "import ray, models\nprint(ray.is_initialized())"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False" and "Started a local Ray instance" not in proc.stderr


@linux_only
def test_a_forced_coretype_the_cpu_lacks_is_dropped_with_a_warning():
    # No x86 or arm64 CPU has both AVX-512 and SVE, so one of the two always conflicts.
    coretype = "NeoverseV1" if platform.machine() == "x86_64" else "SkylakeX"
    code = (
        "import os, models, mlx.core as mx\n"
        "a = mx.random.normal((64, 64)); mx.eval(a @ a)\n"
        "print(os.environ.get('OPENBLAS_CORETYPE'))"
    )
    proc = _python(code, {"OPENBLAS_CORETYPE": coretype})
    assert _assert_ran(proc) == "None"
    assert f"OPENBLAS_CORETYPE={coretype} needs" in proc.stderr


@x86_linux
@pytest.mark.parametrize("cpu, kernels, rows", [("Haswell", "Haswell", "avx2"), ("Nehalem", "Nehalem", "sgemv")])
def test_runs_on_x86_cpus_without_avx512(cpu, kernels, rows):
    """The CPU is emulated (qemu-user: no AVX-512, and no AVX2 for Nehalem), so an
    AVX-512-only library or kernel dies here with SIGILL, as it does on AMD Zen 3 or Intel
    client CPUs. The few-row kernel follows the emulated CPU's flags, not /proc/cpuinfo's."""
    if not shutil.which("qemu-x86_64"):
        if os.environ.get("CI"):
            pytest.fail("CI must install qemu-user (see .ci/run)")
        pytest.skip("qemu-user is not installed (.ci/run installs it)")
    out = _assert_ran(_run_matmul(["qemu-x86_64", "-cpu", cpu]))
    assert out == f"{blas.OPENBLAS} {kernels} {rows if _has_compiler() else '-'}"


def test_doctor_reports_the_choice():
    proc = subprocess.run(
        [sys.executable, "-m", "models.platform.doctor", "--size", "256"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = _assert_ran(proc)
    for heading in ("platform", "cpu flags", "blas", "matmul", "mlx device", "versions"):
        assert any(line.startswith(heading) for line in out.splitlines()), (heading, out)
    if sys.platform.startswith("linux"):
        assert "threads" in out and "GFLOP/s" in out
        user_set = {"OPENBLAS_THREAD_TIMEOUT", "GOTO_THREAD_TIMEOUT"} & set(blas._launch_environ())
        assert user_set or "idle ones sleep after 2^4 cycles (specslot default)" in out, out


def test_no_fast_library_warns_once_with_reason_and_rate_and_keeps_working():
    code = (
        "import platform; platform.machine = lambda: 'riscv64'\n"
        "import models, models.platform._blas as b, mlx.core as mx\n"
        "a = mx.random.normal((64, 64)); mx.eval(a @ a)\n"
        "print(b.loaded().choice.library)"
    )
    proc = _python(code)
    assert _assert_ran(proc) == blas.REFERENCE
    warnings = [line for line in proc.stderr.splitlines() if "reference CPU BLAS" in line]
    assert len(warnings) == 1 and "riscv64" in warnings[0] and "GFLOP/s" in warnings[0], proc.stderr


def test_the_reference_blas_warns_only_where_a_cpu_runs_the_model():
    fallback = blas.Choice(blas.REFERENCE, "the scipy-openblas32 wheel is not installed")
    assert blas.needs_warning(fallback, gpu_is_default=lambda: False)
    assert not blas.needs_warning(fallback, gpu_is_default=lambda: True)  # a CUDA or Metal host
    assert not blas.needs_warning(blas.Choice(blas.REFERENCE, "SPECSLOT_FAST_BLAS=0"), gpu_is_default=lambda: False)
    assert not blas.needs_warning(blas.Choice(blas.OPENBLAS, ""), gpu_is_default=lambda: False)


def _sgemm(lib, a, b, c, *, trans_b: bool, alpha=1.0, beta=0.0):
    """`lib`'s cblas_sgemm on numpy float32 views, row-major: c = alpha a op(b) + beta c."""
    import ctypes

    import numpy as np

    ptr = ctypes.POINTER(ctypes.c_float)
    m, k = a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    lib.cblas_sgemm.restype = None
    lib.cblas_sgemm(
        *(ctypes.c_int(v) for v in (101, 111, 112 if trans_b else 111, m, n, k)),
        ctypes.c_float(alpha),
        a.ctypes.data_as(ptr),
        ctypes.c_int(a.strides[0] // 4),
        b.ctypes.data_as(ptr),
        ctypes.c_int(b.strides[0] // 4),
        ctypes.c_float(beta),
        c.ctypes.data_as(ptr),
        ctypes.c_int(c.strides[0] // 4),
    )
    assert a.strides[1] == b.strides[1] == c.strides[1] == 4 and c.dtype == np.float32


def check_few_row_products() -> str:
    """The shim's products through its C entry point, against float64: both layouts of B,
    1 to 9 rows, alpha and beta, padded rows (lda, ldb, ldc beyond the row), lengths off
    the vector width, and a weight large enough to split over threads. A row's product is
    the same bits whatever it is batched with. Returns the kernel checked (a child runs
    this with SPECSLOT_BLAS_ROWS capping it)."""
    import numpy as np

    import models  # noqa: F401  (loads the BLAS)

    state = blas.loaded()
    lib = state.rows_lib
    rng = np.random.default_rng(0)
    for n, k in ((1000, 70), (300, 64), (17, 5)):  # split over threads; one vector width; tails only
        for trans_b in (True, False):
            shape = (n, k + 3) if trans_b else (k, n + 5)  # padded rows: ldb beyond the row
            wide = rng.standard_normal(shape).astype(np.float32)
            w = wide[:, :k] if trans_b else wide[:, :n]
            ref_w = (w.T if trans_b else w).astype(np.float64)
            for m in range(1, blas.ROWS_MAX + 2):
                a = rng.standard_normal((m, k + 7)).astype(np.float32)[:, :k]
                c0 = rng.standard_normal((m, n + 2)).astype(np.float32)
                for alpha, beta in ((1.0, 0.0), (2.0, 0.5)):
                    c = c0.copy()[:, :n] if beta else np.full((m, n + 2), np.nan, np.float32)[:, :n]
                    before = blas.rows_kernel_sent()
                    _sgemm(lib, a, w, c, trans_b=trans_b, alpha=alpha, beta=beta)
                    on_kernel = state.rows_kernel != "sgemv" and m <= blas.ROWS_MAX
                    assert blas.rows_kernel_sent() - before == int(on_kernel), (m, state.rows)
                    expected = alpha * (a.astype(np.float64) @ ref_w) + beta * c0[:, :n]
                    np.testing.assert_allclose(c, expected, rtol=1e-4, atol=1e-4, err_msg=f"{m}x{n}x{k} {trans_b}")
                    if on_kernel and beta == 0.0:
                        for r in range(m):  # the row alone, then as row r of m: identical bits
                            row = np.empty((1, n), np.float32)
                            _sgemm(lib, a[r : r + 1], w, row, trans_b=trans_b)
                            assert np.array_equal(c[r], row[0]), (m, r, n, k, trans_b)
    return state.rows_kernel


def _check_in_child(setting: str) -> str:
    proc = _python("import tests.test_blas as t; print(t.check_few_row_products())", {"SPECSLOT_BLAS_ROWS": setting})
    return _assert_ran(proc).splitlines()[-1]


def _has_compiler() -> bool:
    return any(shutil.which(c) for c in blas.COMPILERS)


@linux_only
def test_few_row_products_run_on_the_best_kernel_and_match_float64():
    state = blas.loaded()
    if not _has_compiler():
        assert state.rows.startswith("off (no C compiler") and blas.rows_sent() is None
        assert blas.products_key() == blas.OPENBLAS
        return
    flags = blas.cpu_flags()
    best = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "sgemv"
    assert state.rows_kernel == best, state.rows
    assert blas.products_key() == f"{blas.OPENBLAS}+{best}"  # what the tick costs are keyed by
    assert check_few_row_products() == best


@linux_only
@pytest.mark.parametrize("setting", ["avx2", "sgemv"])
def test_every_lesser_kernel_matches_float64_too(setting):
    """The AVX2 kernel (what a CPU without AVX-512 runs) and sgemv alone, checked here by
    capping the shim with SPECSLOT_BLAS_ROWS."""
    if not _has_compiler():
        pytest.skip("no C compiler: the shim is off (checked above)")
    if setting == "avx2" and not {"avx2", "fma"} <= blas.cpu_flags():
        pytest.skip("this CPU has no AVX2")
    assert _check_in_child(setting) == setting


@linux_only
def test_mlx_products_reach_the_kernel_in_every_layout():
    """The layouts MLX's own matmuls hand `cblas_sgemm` (a linear layer, an untransposed
    weight, addmm) run on the kernel, a transposed column on sgemv, 9 rows on sgemm; each
    matches float64."""
    import mlx.core as mx
    import numpy as np

    if blas.loaded().rows_kernel in ("", "sgemv"):
        pytest.skip("no few-row kernel on this machine (checked above)")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((300, 64)).astype(np.float32)
    x, c = rng.standard_normal((4, 64)).astype(np.float32), rng.standard_normal((4, 300)).astype(np.float32)
    col, nine = rng.standard_normal((64, 1)).astype(np.float32), rng.standard_normal((9, 64)).astype(np.float32)
    W, X, C, COL, NINE = (mx.array(v) for v in (w, x, c, col, nine))
    f64 = np.float64
    for name, product, expected, sent in [
        ("x @ w.T", lambda: X @ W.T, x.astype(f64) @ w.T, (1, 0)),
        ("x @ w_t", lambda: X @ mx.array(np.ascontiguousarray(w.T)), x.astype(f64) @ w.T, (1, 0)),
        ("column.T @ w.T", lambda: COL.T @ W.T, col.T.astype(f64) @ w.T, (0, 1)),  # A transposed: sgemv
        ("addmm", lambda: mx.addmm(C, X, W.T, alpha=2.0, beta=0.5), 0.5 * c + 2.0 * (x.astype(f64) @ w.T), (1, 0)),
        ("nine rows", lambda: NINE @ W.T, nine.astype(f64) @ w.T, (0, 0)),
    ]:
        before = blas.rows_kernel_sent(), blas.rows_sent()
        got = np.array(product())
        assert (blas.rows_kernel_sent() - before[0], blas.rows_sent() - before[1]) == sent, name
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4, err_msg=name)


@linux_only
def test_concurrent_and_forked_callers_get_their_products():
    """The helpers serve one caller at a time: a second thread computes alone, and a forked
    child (which has none of its parent's helpers) still gets its product."""
    import threading

    import numpy as np

    lib = blas.loaded().rows_lib
    if lib is None or blas.loaded().rows_kernel == "sgemv":
        pytest.skip("no few-row kernel on this machine (checked above)")
    rng = np.random.default_rng(2)
    w = rng.standard_normal((4096, 64)).astype(np.float32)
    inputs = [rng.standard_normal((3, 64)).astype(np.float32) for _ in range(4)]
    expected = [x @ w.T for x in inputs]
    errors = []

    def work(i):
        for _ in range(200):
            out = np.empty((3, 4096), np.float32)
            _sgemm(lib, inputs[i], w, out, trans_b=True)
            if not np.allclose(out, expected[i], rtol=1e-4, atol=1e-4):
                errors.append(i)
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    pid = os.fork()
    if pid == 0:  # the child: no pytest from here on, only its exit status
        out = np.empty((3, 4096), np.float32)
        _sgemm(lib, inputs[0], w, out, trans_b=True)
        os._exit(0 if np.allclose(out, expected[0], rtol=1e-4, atol=1e-4) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status


@linux_only
def test_one_row_products_can_be_switched_off():
    code = (
        "import models, models.platform._blas as b, mlx.core as mx\n"
        "a = mx.random.normal((1, 64)); w = mx.random.normal((32, 64)); mx.eval(a @ w.T)\n"
        "print(b.loaded().rows, b.rows_sent(), b.products_key())"
    )
    assert _assert_ran(_python(code, {"SPECSLOT_BLAS_ROWS": "0"})) == f"off (SPECSLOT_BLAS_ROWS=0) None {blas.OPENBLAS}"


@linux_only
def test_the_one_row_library_builds_from_its_source(tmp_path, monkeypatch):
    """A fresh cache compiles `sgemm_rows.c` (the cached copy another run left is not reused)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = blas._rows_library()
    if not any(shutil.which(c) for c in blas.COMPILERS):
        assert path is None
        return
    assert path.startswith(str(tmp_path)) and os.path.getsize(path) > 0
    assert blas._rows_library() == path  # built once, then found


@linux_only
def test_a_failed_openblas_load_leaves_no_one_row_library_behind(tmp_path):
    """The shim is loaded only once OpenBLAS is, and handed its functions at once: where
    OpenBLAS cannot be loaded (here a corrupt cached copy), MLX keeps its own BLAS and its
    products still run."""
    stat = os.stat(blas.openblas_library())
    cached = (
        tmp_path
        / "specslot"
        / "blas"
        / f"libopenblas-plain-v{blas._PATCH_VERSION}-{stat.st_size}-{stat.st_mtime_ns}.so"
    )
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"not a shared library")
    code = (
        "import models, models.platform._blas as b, numpy as np, mlx.core as mx\n"
        "state = b.loaded()\n"
        "a = np.ones((1, 40), np.float32); w = np.ones((50, 40), np.float32)\n"
        "print(state.choice.library, state.rows_lib is None, float(np.array(mx.array(a) @ mx.array(w).T).max()))"
    )
    proc = _python(code, {"XDG_CACHE_HOME": str(tmp_path)})
    assert _assert_ran(proc) == f"{blas.REFERENCE} True 40.0"
