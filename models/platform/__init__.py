"""What this machine runs models on: the CPU BLAS, GPU kernel caches and memory, upstream fixes."""
