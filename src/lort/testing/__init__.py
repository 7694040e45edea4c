"""Helpers shared by lort's tests, benchmarks and demo (not needed to use lort)."""
