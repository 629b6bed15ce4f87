"""Benchmarks: the scenarios, the load generator, the servers they compare, their metrics."""
