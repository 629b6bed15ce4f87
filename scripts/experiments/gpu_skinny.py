"""A few-token matmul kernel on a CUDA GPU (made for the lent H200): is it right, and does
it pay? (docs/history/gpu-2026-12.md, "A few-token matmul kernel: measured, not adopted".)

MLX CUDA's bf16 matmul (cuBLAS) costs ~4.7 ms for the 196 weight matmuls of one
Qwen2.5-1.5B-shaped forward of any 2 to 1,024 tokens, against 1.5 ms for one token. The
kernel here (`mx.fast.cuda_kernel`) computes y = x W^T + b for a few tokens: each block
of `BLOCK` threads owns `ROWS` output features, its threads stream those rows of W 16
bytes at a time, multiply them with every token of x, accumulate in float32 and sum
across the block, so W is read once whatever the token count.

1. Accuracy: the kernel and cuBLAS against a float32 reference, for the q15 shape's layer
   sizes, 2-32 tokens, with and without a bias, and x at an address that is not 16-byte
   aligned: the largest error of each, relative to the reference's largest magnitude.
2. The weight matmuls of one forward at the q15 shape (28 layers x q, k, v, o, gate, up,
   down; random weights), cuBLAS against the kernel with 2, 4 and 8 output features per
   block of 128 or 256 threads, by token count; device synchronized per forward, median
   of 15.
3. With `--model DIR`: the model's decode step of R rows (one token each, over a
   256-token cache, trimmed back after each step), plain `nn.Linear` against the
   kernel's layer (`SkinnyLinear`: 2-`MAX_TOKENS` tokens through the kernel):
   synchronized, and ten steps queued back to back (pipelined).

4. With `--host`: what a launch costs the host, the part that undid the kernel in the
   service (`mx.fast.cuda_kernel` assembles the kernel's source text at every call; a
   launch without it measured as costly: docs/history/gpu-2026-12.md). Microseconds per call to build (no evaluation) and to evaluate 2,000 calls of a
   (N, 1536) x (1536, 1536) product: cuBLAS's matmul, the kernel through
   `mx.fast.cuda_kernel`, and the same compiled kernel launched through
   `mx.fast.precompiled_cuda_kernel` (PTX compiled here through NVRTC from a standalone
   copy of the source: MLX 0.32.4 writes no custom kernel to its PTX cache); then the
   forward table's weight matmuls with the precompiled launch.

The kernel reads N, K and M from a small int32 input (`dims`) rather than from its
inputs' shapes, so `mx.fast.cuda_kernel` gives it no shape parameters and the precompiled
launch has the same signature. (The tables of sections 1-3 in docs/history/gpu-2026-12.md
were taken with the shapes read as `x_shape` / `w_shape`, commits 43fa79e and 4530120.)

    python3 -m scripts.experiments.gpu_skinny [--model /tmp/specslot-q15] [--rows 1 2 4 8 16] [--host]
"""

from __future__ import annotations

import argparse
import ctypes  # noqa: E402
import functools  # noqa: E402
import glob  # noqa: E402
import os
import sys
import time

import models  # noqa: E402,F401  (before mlx, as the service imports it)

# isort: split
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from scripts.bench.util import median_eval_s  # noqa: E402

MAX_TOKENS = 8  # SkinnyLinear's inputs of 2..MAX_TOKENS tokens take the kernel
ROWS = 2  # output features per block
BLOCK = 128  # threads per block
_BUCKETS = (2, 4, 8, 16, 32)  # compile-time accumulator counts: N rounds up to one

_HEADER = """
template <typename T>
__device__ __forceinline__ void skinny_load8(const T* p, bool aligned, float* out) {
  if (aligned) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(e[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i]);
  }
}
"""

# y (N, M) = x (N, K) @ w (M, K)^T + bias (M), dims = [N, K, M] (int32). Template: T (a 2-byte float), NB >= N
# accumulators per output feature, ROWS output features per block. K % 8 == 0. A block
# of BLOCK threads owns ROWS rows of w: thread t reads 8 columns at t * 8, then every
# BLOCK * 8 columns after, so each thread has ROWS loads of 16 bytes in flight at once
# and a row of 1,536 columns is one pass of 192 threads; the partial sums meet through
# warp shuffles and shared memory.
_SOURCE = """
  constexpr int WARPS = BLOCK / 32;
  __shared__ float partial[WARPS][ROWS][NB];
  const int N = dims[0];
  const int K = dims[1];
  const int M = dims[2];
  const int t = threadIdx.x;
  const int row0 = blockIdx.x * ROWS;
  const bool x_aligned = (reinterpret_cast<unsigned long long>(x) & 15) == 0;
  const bool w_aligned = (reinterpret_cast<unsigned long long>(w) & 15) == 0;
  float acc[ROWS][NB];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int n = 0; n < NB; ++n) acc[r][n] = 0.0f;
  for (int k = t * 8; k < K; k += BLOCK * 8) {
    float wf[ROWS][8];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (row0 + r < M) {
        skinny_load8(w + (long long)(row0 + r) * K + k, w_aligned, wf[r]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) wf[r][i] = 0.0f;
      }
    }
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      if (n < N) {
        float xf[8];
        skinny_load8(x + (long long)n * K + k, x_aligned, xf);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][n] += wf[r][i] * xf[i];
      }
    }
  }
  const int lane = t & 31;
  const int warp = t >> 5;
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      float v = acc[r][n];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
      if (lane == 0) partial[warp][r][n] = v;
    }
  __syncthreads();
  for (int j = t; j < ROWS * NB; j += BLOCK) {
    const int r = j / NB;
    const int n = j % NB;
    if (n < N && row0 + r < M) {
      float v = static_cast<float>(bias[row0 + r]);
#pragma unroll
      for (int i = 0; i < WARPS; ++i) v += partial[i][r][n];
      y[(long long)n * M + row0 + r] = static_cast<T>(v);
    }
  }
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="skinny_matmul", input_names=["x", "w", "bias", "dims"], output_names=["y"], source=_SOURCE, header=_HEADER
    )


@functools.cache
def _zeros(m: int, dtype: mx.Dtype) -> mx.array:
    """The bias of a layer without one (one shared array per width and dtype)."""
    return mx.zeros((m,), dtype)


def bucket(n: int) -> int:
    """The accumulator count compiled for `n` tokens: the smallest bucket >= n.

    >>> [bucket(n) for n in (2, 3, 4, 5, 8, 9, 16, 17)]
    [2, 4, 4, 8, 8, 16, 16, 32]
    """
    for b in _BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"{n} tokens: the kernel takes at most {_BUCKETS[-1]}")


def matmul(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K) @ weight (M, K)^T + bias (M) through the kernel (a CUDA GPU; a bf16 or
    float16 weight whose K is a multiple of 8; 2-32 tokens): (..., M) in x's dtype."""
    shape = x.shape
    k, m = shape[-1], weight.shape[0]
    n = x.size // k
    args = _launch(n, k, m, weight.dtype)
    y = _kernel()(inputs=[x.reshape(n, k), weight, args.bias(bias), args.dims], **args.kwargs)[0]
    return y if len(shape) == 2 else y.reshape(*shape[:-1], m)


class _Launch:
    """One shape's keyword arguments for the kernel, its `dims`, and the bias of a layer
    without one."""

    def __init__(self, n: int, k: int, m: int, dtype: mx.Dtype) -> None:
        self.zeros = _zeros(m, dtype)
        self.dims = mx.array([n, k, m], dtype=mx.int32)
        self.kwargs = {
            "template": [("T", dtype), ("NB", bucket(n)), ("ROWS", ROWS), ("BLOCK", BLOCK)],
            "grid": (-(-m // ROWS) * BLOCK, 1, 1),
            "threadgroup": (BLOCK, 1, 1),
            "output_shapes": [(n, m)],
            "output_dtypes": [dtype],
        }

    def bias(self, bias: mx.array | None) -> mx.array:
        """The bias input: the layer's in the kernel's dtype, or zeros."""
        if bias is None:
            return self.zeros
        dtype = self.kwargs["output_dtypes"][0]
        return bias if bias.dtype == dtype else bias.astype(dtype)


@functools.lru_cache(maxsize=4096)
def _launch(n: int, k: int, m: int, dtype: mx.Dtype) -> _Launch:
    """The arguments of an (n tokens, k inputs, m outputs, dtype) call, built once: a
    forward makes ~200 of these calls, and on the H200's host each microsecond of Python
    in them is ~0.2 ms a step."""
    return _Launch(n, k, m, dtype)


class SkinnyLinear(nn.Linear):
    """`nn.Linear` whose inputs of 2..MAX_TOKENS tokens in its weight's dtype take the kernel."""

    def __call__(self, x: mx.array) -> mx.array:
        if 2 <= x.size // x.shape[-1] <= MAX_TOKENS:
            weight = self["weight"]
            if x.dtype == weight.dtype:
                return matmul(x, weight, self["bias"] if "bias" in self else None)
        return nn.Linear.__call__(self, x)


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """The NVRTC library MLX compiles its kernels with (mapped into this process once MLX
    has compiled one), else the first `libnvrtc.so*` found by name."""
    mx.eval(matmul(mx.zeros((2, 8), mx.bfloat16), mx.zeros((8, 8), mx.bfloat16)))
    with open("/proc/self/maps") as f:
        mapped = sorted({line.split()[-1] for line in f if "libnvrtc.so" in line and "builtins" not in line})
    for name in mapped + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("no libnvrtc found")


def _include_dirs() -> list[str]:
    """Folders holding cuda_bf16.h: the CUDA toolkit's, or the pip wheels' (nvidia/*)."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = [
        os.path.join(r, "include") for r in roots if r and os.path.exists(os.path.join(r, "include", "cuda_bf16.h"))
    ]
    for entry in sys.path:
        found += sorted(
            os.path.dirname(h) for h in glob.glob(os.path.join(entry, "nvidia", "**", "cuda_bf16.h"), recursive=True)
        )
    return list(dict.fromkeys(found))


@functools.cache
def _compiled(nb: int) -> tuple[str, bytes]:
    """(kernel name, PTX) of the bf16 kernel for `nb` accumulators, compiled here with
    NVRTC from a standalone copy of the source (MLX 0.32.4 keeps its custom kernels' code
    in memory only: its PTX cache stays empty for them)."""
    name = f"skinny_matmul_nb{nb}"
    source = (
        "#include <cuda_bf16.h>\n" + _HEADER + f'extern "C" __global__ void {name}(\n'
        "    const __nv_bfloat16* x, const __nv_bfloat16* w, const __nv_bfloat16* bias, const int* dims,\n"
        "    __nv_bfloat16* y) {\n"
        f"  using T = __nv_bfloat16;\n  constexpr int NB = {nb};\n  constexpr int ROWS = {ROWS};\n"
        f"  constexpr int BLOCK = {BLOCK};\n" + _SOURCE + "}\n"
    )
    lib = _nvrtc()
    prog = ctypes.c_void_p()

    def ok(result: int, what: str) -> None:
        if result != 0:
            log_size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(log_size))
            log = ctypes.create_string_buffer(log_size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise SystemExit(f"{what} failed ({result}): {log.value.decode(errors='replace')[:3000]}")

    ok(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None), "create")
    # PTX for compute_90 (the H200): the driver compiles it for the GPU at load.
    opts = [b"--gpu-architecture=compute_90"] + [f"--include-path={d}".encode() for d in _include_dirs()]
    ok(lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)), "compile")
    size = ctypes.c_size_t()
    ok(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "ptx size")
    ptx = ctypes.create_string_buffer(size.value)
    ok(lib.nvrtcGetPTX(prog, ptx), "ptx")
    return name, ptx.value


def matmul_precompiled(x: mx.array, weight: mx.array) -> mx.array:
    """`matmul` (no bias; x (N, K)) launched through `mx.fast.precompiled_cuda_kernel`
    (no source text)."""
    (n, k), m = x.shape, weight.shape[0]
    args = _launch(n, k, m, weight.dtype)
    name, code = _compiled(bucket(n))
    return mx.fast.precompiled_cuda_kernel(
        name=name,
        compiled_source=code,
        inputs=[x, weight, args.zeros, args.dims],
        output_shapes=args.kwargs["output_shapes"],
        output_dtypes=args.kwargs["output_dtypes"],
        scalars=[],
        grid=args.kwargs["grid"],
        threadgroup=args.kwargs["threadgroup"],
        ensure_row_contiguous=True,
    )[0]


def host(token_counts: list[int], calls: int = 2000) -> None:
    w = (mx.random.normal((HIDDEN, HIDDEN)) * 0.02).astype(mx.bfloat16)
    print("| tokens | launch | build µs a call | evaluate µs a call | largest difference from cuBLAS |")
    print("|---|---|---|---|---|")
    for n in token_counts:
        x = mx.random.normal((n, HIDDEN)).astype(mx.bfloat16)
        mx.eval(w, x)
        ref = (x @ w.T).astype(mx.float32)
        for label, fn in (
            ("cuBLAS", lambda: x @ w.T),
            ("cuda_kernel", lambda: matmul(x, w)),
            ("precompiled", lambda: matmul_precompiled(x, w)),
        ):
            diff = mx.abs(fn().astype(mx.float32) - ref).max().item()
            tic = time.perf_counter()
            outs = [fn() for _ in range(calls)]
            built = time.perf_counter() - tic
            mx.eval(outs)
            done = time.perf_counter() - tic - built
            print(f"| {n} | {label} | {built / calls * 1e6:.1f} | {done / calls * 1e6:.1f} | {diff:.2e} |", flush=True)
    dense = forward_weights()
    print("| tokens | one forward's weight matmuls, ms: cuBLAS | cuda_kernel | precompiled |\n|---|---|---|---|")
    for n in token_counts:
        inputs = {d: mx.random.normal((n, d)).astype(mx.bfloat16) for d in (HIDDEN, INTERMEDIATE)}
        mx.eval(inputs)
        row = [
            median_ms(lambda: [f(inputs[w.shape[1]], w) for layer in dense for w in layer])
            for f in (lambda a, b: a @ b.T, matmul, matmul_precompiled)
        ]
        print(f"| {n} | " + " | ".join(f"{v:.2f}" for v in row) + " |", flush=True)


HIDDEN, INTERMEDIATE, KV, LAYERS = 1536, 8960, 256, 28
SIZES = [(HIDDEN, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def median_ms(fn, repeats: int = 15) -> float:
    return median_eval_s(fn, repeats) * 1e3


def forward_weights() -> list[list[mx.array]]:
    """Random bf16 weights of one forward at the q15 shape: per layer q, k, v, o, gate,
    up, down, as (out, in)."""
    outs = [
        (HIDDEN, HIDDEN),
        (KV, HIDDEN),
        (KV, HIDDEN),
        (HIDDEN, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (INTERMEDIATE, HIDDEN),
        (HIDDEN, INTERMEDIATE),
    ]
    dense = [[(mx.random.normal(s) * 0.02).astype(mx.bfloat16) for s in outs] for _ in range(LAYERS)]
    mx.eval(dense)
    return dense


def accuracy() -> None:
    print("| M x K | tokens | bias | x aligned | kernel error | cuBLAS error |\n|---|---|---|---|---|---|")
    for m, k in SIZES:
        w = (mx.random.normal((m, k)) * 0.02).astype(mx.bfloat16)
        bias = (mx.random.normal((m,)) * 0.1).astype(mx.bfloat16)
        for n in (2, 3, 4, 7, 8, 13, 16, 20, 32):
            for with_bias, aligned in ((False, True), (True, True), (False, False)):
                base = mx.random.normal((n * k + 1,)).astype(mx.bfloat16)
                x = (base[: n * k] if aligned else base[1:]).reshape(n, k)
                b = bias if with_bias else None
                ref = x.astype(mx.float32) @ w.astype(mx.float32).T + (b.astype(mx.float32) if b is not None else 0)
                got = matmul(x, w, b)
                cublas = (x + 0) @ w.T + (b if b is not None else 0)  # cuBLAS refuses a misaligned x
                scale = mx.abs(ref).max()
                err = (mx.abs(got.astype(mx.float32) - ref).max() / scale).item()
                err_cublas = (mx.abs(cublas.astype(mx.float32) - ref).max() / scale).item()
                print(f"| {m} x {k} | {n} | {with_bias} | {aligned} | {err:.2e} | {err_cublas:.2e} |", flush=True)
                if err > 4 * max(err_cublas, 4e-3):
                    raise SystemExit(f"kernel error {err} against cuBLAS {err_cublas} at {m}x{k}, {n} tokens")


def matmuls(token_counts: list[int]) -> None:
    global ROWS, BLOCK
    dense = forward_weights()
    defaults = ROWS, BLOCK
    variants = [(rows, block) for block in (128, 256) for rows in (2, 4, 8)]
    print("| tokens | cuBLAS ms | " + " | ".join(f"kernel {r} rows x {b} threads" for r, b in variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for n in token_counts:
        inputs = {d: mx.random.normal((n, d)).astype(mx.bfloat16) for d in (HIDDEN, INTERMEDIATE)}
        mx.eval(inputs)
        row = [median_ms(lambda: [inputs[w.shape[1]] @ w.T for layer in dense for w in layer])]
        for rows, block in variants:
            ROWS, BLOCK = rows, block
            _launch.cache_clear()
            if n >= 2:
                row.append(median_ms(lambda: [matmul(inputs[w.shape[1]], w) for layer in dense for w in layer]))
            else:
                row.append(float("nan"))
        ROWS, BLOCK = defaults
        _launch.cache_clear()
        print(f"| {n} | " + " | ".join(f"{v:.2f}" for v in row) + " |", flush=True)


def steps(path: str, row_counts: list[int]) -> None:
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from models.loading import dense_weights
    from models.loading.loader import load_model

    model = load_model(path).model
    dense_weights.dequantize(model)
    linears = [m for _, m in model.named_modules() if type(m) is nn.Linear]
    print("| rows | plain sync ms | skinny sync ms | plain pipelined ms | skinny pipelined ms |\n|---|---|---|---|---|")
    for rows in row_counts:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[(i * 7919) % 2000 + 3 for i in range(256)]] * rows), cache=cache))
        tokens = mx.array([[5]] * rows)

        def step():
            out = model(tokens, cache=cache)
            trim_prompt_cache(cache, 1)
            return out

        def pipelined():
            outs = [step() for _ in range(10)]
            for out in outs:
                mx.async_eval(out)
            return outs

        figures = {}
        for name, cls in (("plain", nn.Linear), ("skinny", SkinnyLinear)):
            for m in linears:
                m.__class__ = cls
            figures[name] = (median_ms(step), median_ms(pipelined, 5) / 10)
        for m in linears:
            m.__class__ = nn.Linear
        print(
            f"| {rows} | {figures['plain'][0]:.2f} | {figures['skinny'][0]:.2f} | {figures['plain'][1]:.2f} | "
            f"{figures['skinny'][1]:.2f} |",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a model directory for the decode-step table")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 20, 32])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--host", action="store_true", help="only the launch-cost tables (section 4)")
    args = ap.parse_args()
    print(f"device {mx.default_device()}, mlx {mx.__version__}")
    if args.host:
        host([n for n in args.tokens if 2 <= n <= 8])
        return
    accuracy()
    matmuls(args.tokens)
    if args.model:
        steps(args.model, args.rows)


if __name__ == "__main__":
    main()
