"""lort's benchmark suites: ``python -m benchmarks --list`` from the repository root lists
them, ``python -m benchmarks SUITE [args]`` runs one; results in benchmarks/results/,
one-off studies in benchmarks/studies/."""
