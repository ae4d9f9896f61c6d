"""Benchmarks (pytest-benchmark) and load generators."""
