"""Diagnostics: what ran where (explain), and why."""
