"""Offloaded inference (zinfjax.inference)."""
