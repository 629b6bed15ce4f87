"""Session-wide test setup: load the fast BLAS before anything imports mlx."""

import models  # noqa: F401  (side effect: fast BLAS before mlx.core)
