"""Helpers for tests and benchmarks; nothing here is imported by a training run."""
