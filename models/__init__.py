"""MLX model side of specslot: loading, classic batching, speculative sessions, drafters.

Importing this package loads a fast CPU BLAS before `mlx.core` (see `models.platform._blas`), so
every process that touches MLX through us (tests, `make serve`, benchmarks, Ray
workers) gets it. Import `models` before anything imports `mlx`.
"""

from models.platform._blas import load_fast_blas

load_fast_blas()
