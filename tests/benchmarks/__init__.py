"""The benchmarks (zinfjax.benchmarks)."""
