"""Reading one layer of one leaf of a checkpoint, its crc32c checked.

A leaf whose chunk is one whole layer (what `CheckpointWriter` writes, and what a save from an
unsharded store writes) is read with one direct read of its chunk file into an aligned buffer:
one copy of the layer in memory and none in the page cache. A leaf chunked by device shards is
read through tensorstore, which assembles the layer from its chunks. Both check every chunk's
crc32c.

Example:
    >>> import numpy as np, tempfile
    >>> from zinfjax.checkpoint import format as fmt
    >>> from zinfjax.checkpoint.writer import write_params
    >>> kernel = np.arange(4 * 8 * 16, dtype=np.float32).reshape(4, 8, 16)      # 4 layers of (8, 16)
    >>> path = write_params(tempfile.mkdtemp(), {"blocks": {"fc": {"kernel": kernel}}}, step=10)
    >>> reader = LeafReader(path, fmt.read_meta(path)["items"])
    >>> layer = reader.read("params", "blocks.fc.kernel", 3)
    >>> layer.shape, bool((layer == kernel[3]).all())
    ((8, 16), True)
"""

from __future__ import annotations

import os

import numpy as np
import tensorstore as ts

from zinfjax.checkpoint.errors import CheckpointCorruptError
from zinfjax.store import chunkfile
from zinfjax.store.nvme import aligned_empty


class LeafReader:
    """Reads layers of the leaves of the checkpoint ``directory``, described by its metadata's ``items``.

    ``hint`` ends the message of a `CheckpointCorruptError` (what the user can do about it).
    """

    def __init__(self, directory: str, items: dict[str, dict[str, dict]], hint: str = ""):
        self.directory, self.items, self.hint = directory, items, hint
        self._arrays: dict[tuple[str, str], ts.TensorStore] = {}

    def read(self, item: str, name: str, layer: int | None) -> np.ndarray:
        """Layer ``layer`` of leaf ``item/name`` (``None``: the whole leaf, for embed and head)."""
        meta = self.items[item][name]
        try:
            if _one_chunk(meta, layer):
                return self._read_chunk(item, name, meta, layer)
            array = self._open(item, name)
            return (array[layer] if layer is not None else array).read().result()
        except (ValueError, FileNotFoundError) as e:  # ChunkCorruptError is a ValueError, as tensorstore's are
            where = f"leaf {item}/{name}" + (f", layer {layer}" if layer is not None else "")
            missing = f"chunk file {e.filename} is missing" if isinstance(e, FileNotFoundError) else str(e)
            raise CheckpointCorruptError(f"the checkpoint {self.directory} is corrupt at {where}: {missing}"
                                         + (f"; {self.hint}" if self.hint else "")) from e

    def read_block(self, item: str, name: str, index: tuple) -> np.ndarray:
        """``leaf[index]`` of leaf ``item/name``: one tile of one layer (tensorstore reads the chunks it spans)."""
        try:
            return self._open(item, name)[index].read().result()
        except (ValueError, FileNotFoundError) as e:
            raise CheckpointCorruptError(f"the checkpoint {self.directory} is corrupt at leaf {item}/{name}, block "
                                         f"{index}: {e}" + (f"; {self.hint}" if self.hint else "")) from e

    def read_rows(self, item: str, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of leaf ``item/name`` (a chunk of a vocabulary table)."""
        try:
            return self._open(item, name)[start:stop].read().result()
        except (ValueError, FileNotFoundError) as e:
            raise CheckpointCorruptError(f"the checkpoint {self.directory} is corrupt at leaf {item}/{name}, rows "
                                         f"{start}:{stop}: {e}" + (f"; {self.hint}" if self.hint else "")) from e

    def _read_chunk(self, item: str, name: str, meta: dict, layer: int | None) -> np.ndarray:
        shape = meta["shape"][1:] if layer is not None else meta["shape"]
        dtype = np.dtype(meta["dtype"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        index = (layer, *[0] * len(shape)) if layer is not None else (0,) * len(shape)
        path = chunkfile.chunk_path(os.path.join(self.directory, item, name), index)
        slot = aligned_empty((chunkfile.slot_bytes(nbytes),), np.uint8, chunkfile.BLOCK)
        return chunkfile.read_chunk(path, slot, nbytes).view(dtype).reshape(shape)

    def _open(self, item: str, name: str) -> ts.TensorStore:
        key = (item, name)
        if key not in self._arrays:
            kvstore = {"driver": "file", "path": os.path.join(self.directory, item, name)}
            spec = {"driver": "zarr3", "kvstore": kvstore, "fill_missing_data_reads": False}
            self._arrays[key] = ts.open(spec, open=True, read=True).result()
        return self._arrays[key]

    def close(self) -> None:
        self._arrays.clear()


def _one_chunk(meta: dict, layer: int | None) -> bool:
    """Whether the layer (or the whole leaf) is exactly one chunk, of at least one dimension."""
    shape, chunk = meta["shape"], meta["chunk_shape"]
    whole = [1, *shape[1:]] if layer is not None else list(shape)
    return len(shape) >= (2 if layer is not None else 1) and list(chunk) == whole
