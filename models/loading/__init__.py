"""From a configured model name to a loaded mlx-lm model: local, hub, GGUF and PyPI sources, checks."""
