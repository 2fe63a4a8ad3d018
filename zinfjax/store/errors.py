"""Errors raised by the tiered store.

Every store error is a `StoreError`. Those the user can fix (a tier, path or option the store
cannot use, the disk, the budget, a lock, a mismatched store) are also `zinfjax.errors.UserError`s,
so the CLI prints them as one line. The rest are not the user's: a plain `StoreError` is a store
used out of order (closed, or read after a failed write), and a checksum failure is the disk's
(`StoreCorruptionError` names the leaf and layer that failed). A read or write the disk itself fails
(EIO) is a `StoreIOError`, a `UserError`: one line naming the file, the layer and the leaf.
"""

from zinfjax.errors import UserError


class StoreError(Exception):
    """Base class of every error the store raises."""


class StoreUsageError(StoreError, UserError):
    """A tier, path, option or tree the store cannot use; the message says which value to change."""


class BufferBudgetError(StoreError, UserError):
    """The host buffer budget cannot hold the bytes one operation needs."""


class StorePathError(StoreError, UserError):
    """The store path does not exist, is not a directory, or cannot be written."""


class StoreSpaceError(StoreError, UserError, OSError):
    """The disk has too little free space for the store, or filled up during a write."""


class ManifestMismatchError(StoreError, UserError):
    """An existing store on disk was written for different shapes, dtypes or layout."""


class StoreLockedError(StoreError, UserError):
    """Another live process holds the store's lock file."""


class StoreIOError(StoreError, UserError, OSError):
    """The disk failed a read or a write of the nvme tier (EIO, say); the message names the file, layer and leaf."""


class LayerNotWrittenError(StoreError):
    """A layer was read before any write of it reached the store."""


class StoreCorruptionError(StoreError):
    """A chunk failed its checksum or could not be decoded.

    Attributes:
        leaf: name of the leaf whose chunk failed.
        layer: index of the layer whose chunk failed.
    """

    def __init__(self, message: str, *, leaf: str, layer: int):
        super().__init__(message)
        self.leaf = leaf
        self.layer = layer


class LiveStateCorruptError(StoreCorruptionError, UserError):
    """A chunk of a run's own state on the nvme tier failed its checksum: the disk (or memory) changed it after
    the run wrote it. One line for the user: which chunk, and the checkpoint to resume from."""
