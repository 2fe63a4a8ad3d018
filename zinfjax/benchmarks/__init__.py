"""The benchmarks `zinfjax bench NAME` runs, one module each; each prints JSON (docs/BENCHMARKS.md)."""
