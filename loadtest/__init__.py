"""Benchmarks and load tests."""
