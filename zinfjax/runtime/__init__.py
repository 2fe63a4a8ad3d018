"""The process and the OS: glibc's allocator settings, resident memory, `jax.distributed` and `zinfjax launch`."""
