"""The tiers: device, host and NVMe stores (zinfjax.store)."""
