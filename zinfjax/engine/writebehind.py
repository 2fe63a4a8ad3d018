"""Writes and computations that run behind the step's loop, the memory they hold in flight bounded.

The twin of `ReadAhead` (zinfjax/engine/readahead.py), which keeps a step's reads ahead of its compute:
`WriteBehind` lets the computations the loop dispatched and the writes it issued finish behind it, and
waits for them only where what they hold would grow without bound (docs/design.md, invariant 2).

- JAX's dispatch does not wait for compute, and reads that finish early would let the loop queue every
  layer's computation at once, each holding its inputs. So at most ``depth`` computations (at least one)
  are in flight: beyond that, the loop waits for the oldest. The reads of the next operations stay in
  flight meanwhile.
- A write holds its slice in memory until it lands; a disk slower than compute would let that backlog
  grow with the number of layers. So at most ``bound`` bytes of writes are in flight: beyond that, the
  loop waits for the oldest. The bound is in bytes, from the memory budget, so it holds whatever the
  size of a layer.

Example (four layers, each computed and written back; no more than two computations and 64 KiB of writes in
flight):
    >>> import jax.numpy as jnp
    >>> from zinfjax.store import open_store
    >>> store = open_store("host", {"w": jax.ShapeDtypeStruct((4, 64, 64), jnp.float32)})
    >>> behind = WriteBehind(bound=64 << 10, depth=2)
    >>> for i in range(4):
    ...     layer = {"w": jnp.tanh(jnp.full((64, 64), float(i)))}
    ...     behind.computed(layer)
    ...     behind.written(store.write(i, layer), store.part_nbytes())
    >>> behind.writing <= behind.bound
    True
    >>> store.flush(); store.close()
"""

from __future__ import annotations

import collections
from concurrent.futures import Future

import jax


class WriteBehind:
    """Tracks the computations and writes in flight, waiting for the oldest beyond ``depth`` and ``bound``."""

    def __init__(self, bound: int, depth: int):
        self.bound = bound  # bytes of writes in flight, at most
        self.depth = depth  # computations in flight, at most (at least one)
        self.writing = 0  # bytes of the writes in flight
        self._computing: collections.deque = collections.deque()  # outputs of computations not yet waited on
        self._writes: collections.deque = collections.deque()  # (future, bytes) of writes not yet seen to land

    def computed(self, outputs) -> None:
        """A computation was dispatched (``outputs``: its asynchronous result); waits for the oldest beyond
        ``depth``."""
        self._computing.append(outputs)
        while len(self._computing) > max(1, self.depth):
            _wait_for(self._computing.popleft())

    def written(self, future: Future, nbytes: int) -> None:
        """A write of ``nbytes`` was issued (``future``: its completion); forgets those that landed, and waits
        for the oldest while more than ``bound`` bytes are in flight."""
        self._writes.append((future, nbytes))
        self.writing += nbytes
        while self._writes and (self._writes[0][0].done() or self.writing > self.bound):
            done, nbytes = self._writes.popleft()
            self.writing -= nbytes
            done.exception()  # errors surface at the next flush

    def forget_computations(self) -> None:
        """The step is over (its loss was read): none of its computations is waited on any more."""
        self._computing.clear()


def _wait_for(outputs) -> None:
    """Waits until a computation's outputs are ready; an output a later computation took over (donated) is."""
    for x in jax.tree.leaves(outputs):
        if isinstance(x, jax.Array) and not x.is_deleted():
            x.block_until_ready()
