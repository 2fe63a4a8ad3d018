"""A method cache held by its instance, so what it caches (compiled functions) dies with the object.

``functools.cache`` on a method keys a class-wide cache on ``self``: every instance it ever saw,
and every executable its methods compiled, stays alive for the life of the process. A process
that builds engine after engine (a test suite, a notebook that wraps again) then grows without
bound: 55 MB a gpt2-tiny engine on 8 devices. `instance_cache` keeps the cache in the instance's
own ``__dict__`` instead.

Example:
    >>> class Square:
    ...     @instance_cache
    ...     def of(self, x):
    ...         print("computing", x)
    ...         return x * x
    >>> s = Square()
    >>> s.of(3), s.of(3)
    computing 3
    (9, 9)
    >>> Square().of(3)  # another instance, another cache
    computing 3
    9
"""

from __future__ import annotations

import functools


def instance_cache(method):
    """``method`` cached per instance and per (hashable) arguments, like ``functools.cache`` but freed with ``self``.

    Two threads asking at once may both compute; the first result stored is the one every caller gets.
    """
    slot = f"_instance_cache_{method.__name__}"

    @functools.wraps(method)
    def cached(self, *args, **kwargs):
        cache = vars(self).setdefault(slot, {})
        key = (args, tuple(sorted(kwargs.items())))
        try:
            return cache[key]
        except KeyError:
            return cache.setdefault(key, method(self, *args, **kwargs))

    return cached
