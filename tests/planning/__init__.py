"""zinfjax plan (zinfjax.planning)."""
