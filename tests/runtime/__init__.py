"""The process and the OS (zinfjax.runtime): allocator, launch, multi-process runs."""
