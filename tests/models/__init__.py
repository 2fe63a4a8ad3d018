"""The reference models (zinfjax.models)."""
