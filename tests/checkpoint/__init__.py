"""Checkpoints (zinfjax.checkpoint): atomic, verifiable, reshardable."""
