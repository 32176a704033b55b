"""Benchmarks: each prints JSON figures, compared in the same run against a named reference."""
