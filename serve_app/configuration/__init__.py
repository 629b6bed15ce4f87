"""Deployment arguments: the typed boundary between YAML `args` and the scheduler, their errors, paths and docs."""
