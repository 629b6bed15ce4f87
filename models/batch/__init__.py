"""Classic continuous batching: the slab batch, mlx-lm's BatchGenerator, the solo row, prefix reuse."""
