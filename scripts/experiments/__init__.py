"""One-off investigations, run as modules from the repository root (`python -m scripts.experiments.NAME`)."""
