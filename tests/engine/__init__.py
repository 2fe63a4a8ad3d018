"""The streaming step (zinfjax.engine): exact against the in-memory loop, bounded in memory."""
