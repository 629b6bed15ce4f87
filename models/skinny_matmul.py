"""Linear layers of a few tokens on a CUDA GPU: one kernel that reads the weights once.

On the H200, MLX CUDA's bf16 matmul (cuBLAS) takes ~4.7 ms for the 196 weight matmuls
of one Qwen2.5-1.5B-shaped forward of any 2 to 1,024 tokens, where one token's
matrix-vector products take 1.5 ms (docs/gpu.md, "Why a 2-4-row step costs what a
64-row one does"). A decode step of 2 to 16 rows, or a verify of a few rows, therefore
pays about what 64 rows do. This module computes y = x W^T (+ b) for `N` <= `MAX_TOKENS`
tokens with a kernel (`mx.fast.cuda_kernel`) in which each warp owns `ROWS` output
features: it streams those rows of W once, 16 bytes a lane, multiplies them with every
token of x, accumulates in float32 and reduces across the warp. The weights are read
once whatever `N` is, as one token's matrix-vector product reads them.

`install(model)` turns every plain `nn.Linear` of a model into a `SkinnyLinear` (same
parameters, same results up to float32 summation order), whose call takes the kernel for
inputs of 2..`MAX_TOKENS` tokens in bf16 or float16 and `Linear`'s own matmul otherwise.
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

MAX_TOKENS = 16  # inputs of 2..MAX_TOKENS tokens take the kernel
ROWS = 2  # output features per warp
BLOCK = 256  # threads per block (8 warps)
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
# accumulators per output feature, ROWS output features per warp. K % 8 == 0.
_SOURCE = """
  const int N = x_shape[0];
  const int K = x_shape[1];
  const int M = w_shape[0];
  const int lane = threadIdx.x & 31;
  const int row0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * ROWS;
  if (row0 >= M) return;
  const bool x_aligned = (reinterpret_cast<unsigned long long>(x) & 15) == 0;
  const bool w_aligned = (reinterpret_cast<unsigned long long>(w) & 15) == 0;
  float acc[ROWS][NB];
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int n = 0; n < NB; ++n) acc[r][n] = 0.0f;
  for (int k = lane * 8; k < K; k += 256) {
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
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int n = 0; n < NB; ++n) {
      float v = acc[r][n];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
      acc[r][n] = v;
    }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (row0 + r < M) {
        const float b = static_cast<float>(bias[row0 + r]);
        for (int n = 0; n < N; ++n) y[(long long)n * M + row0 + r] = static_cast<T>(acc[r][n] + b);
      }
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


def takes(x: mx.array, weight: mx.array) -> bool:
    """Whether `x @ weight.T` goes to the kernel: 2..MAX_TOKENS tokens, both in the same
    2-byte float type, an inner size that is a multiple of 8, on a CUDA GPU."""
    k = x.shape[-1]
    n = x.size // k if k else 0
    return (2 <= n <= MAX_TOKENS and weight.ndim == 2 and weight.shape[1] == k and k % 8 == 0
            and x.dtype == weight.dtype and weight.dtype in (mx.bfloat16, mx.float16) and on_cuda())


def matmul(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """x (..., K) @ weight (M, K)^T + bias (M) through the kernel, for inputs `takes`
    accepts: (..., M) in x's dtype."""
    k, m = x.shape[-1], weight.shape[0]
    n = x.size // k
    flat = x.reshape(n, k)
    b = _zeros(m, weight.dtype) if bias is None else bias.astype(weight.dtype)
    nb = bucket(n)
    y = _kernel()(inputs=[flat, weight, b], template=[("T", weight.dtype), ("NB", nb), ("ROWS", ROWS)],
                  grid=(-(-m // ROWS) * 32, 1, 1), threadgroup=(BLOCK, 1, 1),
                  output_shapes=[(n, m)], output_dtypes=[weight.dtype])[0]
    return y.reshape(*x.shape[:-1], m)


class SkinnyLinear(nn.Linear):
    """`nn.Linear` whose inputs of 2..MAX_TOKENS tokens take the kernel (`takes`)."""

    def __call__(self, x: mx.array) -> mx.array:
        if takes(x, self.weight):
            return matmul(x, self.weight, self["bias"] if "bias" in self else None)
        return super().__call__(x)


def install(model: nn.Module) -> int:
    """Make every plain `nn.Linear` of `model` a `SkinnyLinear` (in place, parameters
    untouched); returns how many. Subclasses of `Linear` (LoRA and the like) are left."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.Linear:
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
    for dtype in dtypes & {mx.bfloat16, mx.float16}:
        w = mx.zeros((8, 8), dtype)
        runs += [matmul(mx.zeros((n, 8), dtype), w) for n in _BUCKETS if n <= MAX_TOKENS]
    mx.eval(runs)
    return len(runs)
