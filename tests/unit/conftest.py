"""Unit tests: pure scheduler code over a scripted fake runner; no mlx, no ray."""
