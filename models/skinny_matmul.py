"""Linear layers of a few tokens on a CUDA GPU: one kernel that reads the weights once.

On the H200, MLX CUDA's bf16 matmul (cuBLAS) takes ~4.7 ms for the 196 weight matmuls
of one Qwen2.5-1.5B-shaped forward of any 2 to 1,024 tokens, where one token's
matrix-vector products take 1.5 ms (docs/gpu.md, "Why a 2-4-row step costs what a
64-row one does"). A decode step of 2 to 16 rows, or a verify of a few rows, therefore
pays about what 64 rows do. This module computes y = x W^T (+ b) for `N` <= `MAX_TOKENS`
tokens with a kernel (`mx.fast.cuda_kernel`) in which each block of `BLOCK` threads
owns `ROWS` output features: its threads stream those rows of W once, 16 bytes each at a
time, multiply them with every token of x, accumulate in float32 and sum across the
block. The weights are read once whatever `N` is, as one token's matrix-vector product
reads them.

`install(model)` turns every plain bf16 or float16 `nn.Linear` of a model into a
`SkinnyLinear` (same parameters, same results up to float32 summation order), whose call
takes the kernel for inputs of 2..`MAX_TOKENS` tokens and `Linear`'s own matmul otherwise.
`models.runner` installs it on a CUDA GPU unless `skinny_matmul` is false; elsewhere
(Apple silicon, a CPU) nothing changes.
"""

from __future__ import annotations

import functools
import logging
import time

import mlx.core as mx
import mlx.nn as nn

from models.device_memory import on_cuda

log = logging.getLogger(__name__)

MAX_TOKENS = 8  # inputs of 2..MAX_TOKENS tokens take the kernel
ROWS = 2  # output features per block
BLOCK = 128  # threads per block (4 warps)
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

# y (N, M) = x (N, K) @ w (M, K)^T + bias (M). Template: T (a 2-byte float), NB >= N
# accumulators per output feature, ROWS output features per block. K % 8 == 0. A block
# of BLOCK threads owns ROWS rows of w: thread t reads 8 columns at t * 8, then every
# BLOCK * 8 columns after, so each thread has ROWS loads of 16 bytes in flight at once
# and a row of 1,536 columns is one pass of 192 threads; the partial sums meet through
# warp shuffles and shared memory.
_SOURCE = """
  constexpr int WARPS = BLOCK / 32;
  __shared__ float partial[WARPS][ROWS][NB];
  const int N = x_shape[0];
  const int K = x_shape[1];
  const int M = w_shape[0];
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
    return mx.fast.cuda_kernel(name="skinny_matmul", input_names=["x", "w", "bias"], output_names=["y"],
                               source=_SOURCE, header=_HEADER)


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


def eligible(weight: mx.array) -> bool:
    """Whether a layer with this weight can take the kernel: a 2-D bf16 or float16 matrix
    whose inner size is a multiple of 8 (the kernel reads 8 columns at a time)."""
    return weight.ndim == 2 and weight.shape[1] % 8 == 0 and weight.dtype in (mx.bfloat16, mx.float16)


def takes(x: mx.array, weight: mx.array) -> bool:
    """Whether `x @ weight.T` goes to the kernel, for an `eligible` weight: 2..MAX_TOKENS
    tokens in the weight's dtype. (The device is checked once, by `apply`.)"""
    return 2 <= x.size // x.shape[-1] <= MAX_TOKENS and x.dtype == weight.dtype


def matmul(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K) @ weight (M, K)^T + bias (M) through the kernel (on a CUDA GPU, for an
    `eligible` weight and an input `takes` accepts): (..., M) in x's dtype."""
    shape = x.shape
    k, m = shape[-1], weight.shape[0]
    n = x.size // k
    args = _launch(n, m, weight.dtype)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.astype(weight.dtype)
    y = _kernel()(inputs=[x.reshape(n, k), weight, args.zeros if bias is None else bias], **args.kwargs)[0]
    return y if len(shape) == 2 else y.reshape(*shape[:-1], m)


class _Launch:
    """One shape's keyword arguments for the kernel, and the bias of a layer without one."""

    def __init__(self, n: int, m: int, dtype: mx.Dtype) -> None:
        self.zeros = _zeros(m, dtype)
        self.kwargs = {"template": [("T", dtype), ("NB", bucket(n)), ("ROWS", ROWS), ("BLOCK", BLOCK)],
                       "grid": (-(-m // ROWS) * BLOCK, 1, 1), "threadgroup": (BLOCK, 1, 1),
                       "output_shapes": [(n, m)], "output_dtypes": [dtype]}


@functools.lru_cache(maxsize=4096)
def _launch(n: int, m: int, dtype: mx.Dtype) -> _Launch:
    """The arguments of an (n tokens, m outputs, dtype) call, built once: a forward makes
    ~200 of these calls, and on the H200's host each microsecond of Python in them is
    ~0.2 ms a step."""
    return _Launch(n, m, dtype)


class SkinnyLinear(nn.Linear):
    """`nn.Linear` whose inputs of 2..MAX_TOKENS tokens take the kernel (`takes`)."""

    def __call__(self, x: mx.array) -> mx.array:
        if 2 <= x.size // x.shape[-1] <= MAX_TOKENS:
            weight = self["weight"]
            if x.dtype == weight.dtype:
                return matmul(x, weight, self["bias"] if "bias" in self else None)
        return nn.Linear.__call__(self, x)


def install(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` with an `eligible` weight a `SkinnyLinear`
    (in place, parameters untouched); returns how many. Subclasses of `Linear` (LoRA and
    the like) are left. Only on a CUDA GPU (`apply` checks)."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear and eligible(module.weight):
            module.__class__ = SkinnyLinear
            count += 1
    return count


def apply(model: nn.Module, name: str, setting: bool | None) -> int:
    """`install` where `setting` asks for it (None: on a CUDA GPU), logging the count;
    returns it (0: left as it was)."""
    if not (on_cuda() if setting is None else setting):
        return 0
    count = install(model)
    if count:
        tic = time.perf_counter()
        variants = warm(model)
        log.info("%s: %d linear layers take the few-token kernel (skinny_matmul) for 2-%d tokens; %d variants "
                 "built in %.1f s", name, count, MAX_TOKENS, variants, time.perf_counter() - tic)
    return count


def warm(model: nn.Module) -> int:
    """Build the kernel's variants the model's layers will use (one per dtype and token
    bucket; the sizes are run-time arguments), so no request waits for a compile; returns
    how many ran."""
    dtypes = {m.weight.dtype for _, m in model.named_modules() if isinstance(m, SkinnyLinear)}
    runs = []
    for dtype in dtypes:
        w = mx.zeros((8, 8), dtype)
        runs += [matmul(mx.zeros((n, 8), dtype), w) for n in _BUCKETS if n <= MAX_TOKENS]
    mx.eval(runs)
    return len(runs)
