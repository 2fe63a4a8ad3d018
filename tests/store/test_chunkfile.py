"""The nvme tier's direct chunk I/O writes zarr3 chunks that tensorstore reads, and the other way round."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax.store import BufferPool, StoreCorruptionError, open_store
from zinfjax.store.chunkfile import (
    BLOCK,
    CHECKSUM_BYTES,
    SEGMENT,
    ChunkCorruptError,
    crc32c,
    read_chunks,
    slot_bytes,
    write_chunks,
)
from zinfjax.store.nvme import aligned_empty, zarr_spec

L = 3


def _like():
    return {"w": jax.ShapeDtypeStruct((L, 40, 24), jnp.bfloat16), "b": jax.ShapeDtypeStruct((L, 24), jnp.float32)}


def _layer(i):
    rng = np.random.default_rng(i)
    return {
        "w": rng.standard_normal((40, 24)).astype(jnp.bfloat16),
        "b": rng.standard_normal(24).astype(np.float32),
    }


def _open(tmp_path, chunk_io):
    return open_store("nvme", _like(), path=str(tmp_path), pool=BufferPool(1 << 20), chunk_io=chunk_io)


@pytest.mark.parametrize("writer, reader", [("direct", "tensorstore"), ("tensorstore", "direct")])
def test_direct_and_tensorstore_chunk_io_share_one_format(tmp_path, writer, reader):
    with _open(tmp_path, writer) as store:
        for i in range(L):
            store.write(i, _layer(i))
    with _open(tmp_path, reader) as store:
        for i in range(L):
            got = store.read(i).result()
            for name in ("w", "b"):
                np.testing.assert_array_equal(np.asarray(got[name]).view(np.uint8), _layer(i)[name].view(np.uint8))


def test_direct_chunks_open_in_plain_tensorstore(tmp_path):
    with _open(tmp_path, "direct") as store:
        for i in range(L):
            store.write(i, _layer(i))
        layouts = store.layouts
    lay = next(lay for lay in layouts if lay.name.endswith("w"))
    array = ts.open(zarr_spec(str(tmp_path / "params" / lay.name), lay)).result()
    np.testing.assert_array_equal(array[1].read().result(), _layer(1)["w"])


def test_chunk_file_is_data_then_little_endian_crc32c(tmp_path):
    data = np.arange(1000, dtype=np.uint8)
    slot = np.zeros(slot_bytes(data.nbytes), np.uint8)
    slot[: data.nbytes] = data
    path = str(tmp_path / "c" / "0")
    write_chunks([(path, slot, data.nbytes)])
    raw = open(path, "rb").read()
    assert len(raw) == data.nbytes + CHECKSUM_BYTES
    assert raw[: data.nbytes] == data.tobytes()
    assert int.from_bytes(raw[-CHECKSUM_BYTES:], "little") == crc32c(data)
    assert crc32c(np.frombuffer(b"123456789", np.uint8)) == 0xE3069283  # the crc32c check value (RFC 3720)
    assert os.listdir(tmp_path / "c") == ["0"]  # no temporary file left behind


def test_flipped_bit_is_caught_by_the_direct_reader(tmp_path):
    with _open(tmp_path, "direct") as store:
        store.write(1, _layer(1)).result()
        lay = next(lay for lay in store.layouts if lay.name.endswith("b"))
        chunk = tmp_path / "params" / lay.name / "c" / "1" / "0"
        raw = bytearray(chunk.read_bytes())
        raw[5] ^= 0x01
        chunk.write_bytes(bytes(raw))
        with pytest.raises(StoreCorruptionError, match=r"layer 1") as e:
            store.read(1).result()
        assert "crc32c" in str(e.value)


def _slot(nbytes: int, seed: int) -> np.ndarray:
    slot = aligned_empty((slot_bytes(nbytes),), np.uint8, BLOCK)
    slot[:nbytes] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return slot


SIZES = (2 * SEGMENT + 12345, 100, BLOCK - CHECKSUM_BYTES, 3 * SEGMENT)  # several segments, a tail, exact blocks


@pytest.mark.parametrize("atomic", [True, False])
def test_chunks_of_many_segments_round_trip(tmp_path, atomic):
    chunks = [(str(tmp_path / "c" / str(k)), _slot(n, k), n) for k, n in enumerate(SIZES)]
    for _ in range(2):  # the second write overwrites (in place when not atomic)
        write_chunks(chunks, atomic=atomic)
    back = [(p, aligned_empty((slot_bytes(n),), np.uint8, BLOCK), n) for p, _, n in chunks]
    for (_, slot, n), got in zip(chunks, read_chunks(back), strict=True):
        np.testing.assert_array_equal(got, slot[:n])
    for path, _, n in chunks:
        assert os.path.getsize(path) == n + CHECKSUM_BYTES
    assert sorted(os.listdir(tmp_path / "c")) == [str(k) for k in range(len(SIZES))]  # no temporary files


def test_in_place_writes_keep_the_file_and_atomic_writes_replace_it(tmp_path):
    path, n = str(tmp_path / "c" / "0"), SEGMENT + 5000
    write_chunks([(path, _slot(n, 0), n)], atomic=False)  # no file yet: written atomically
    inode = os.stat(path).st_ino
    write_chunks([(path, _slot(n, 1), n)], atomic=False)
    assert os.stat(path).st_ino == inode
    got = read_chunks([(path, aligned_empty((slot_bytes(n),), np.uint8, BLOCK), n)])[0]
    np.testing.assert_array_equal(got, _slot(n, 1)[:n])
    write_chunks([(path, _slot(n, 2), n)], atomic=True)
    assert os.stat(path).st_ino != inode


def test_a_torn_in_place_write_is_caught_and_names_its_chunk(tmp_path):
    chunks = [(str(tmp_path / "c" / str(k)), _slot(SEGMENT + 99, k), SEGMENT + 99) for k in range(3)]
    write_chunks(chunks)
    with open(chunks[1][0], "r+b") as f:  # a write cut short: the first block new, the rest old
        f.write(bytes(BLOCK))
    back = [(p, aligned_empty((slot_bytes(n),), np.uint8, BLOCK), n) for p, _, n in chunks]
    with pytest.raises(ChunkCorruptError, match="crc32c mismatch") as err:
        read_chunks(back)
    assert err.value.chunk == 1
    os.unlink(chunks[2][0])
    with pytest.raises(FileNotFoundError) as err:
        read_chunks(back)
    assert err.value.chunk == 2


def test_replicated_shards_read_in_place_do_not_share_memory(tmp_path):
    """On the CPU backend a chunk is read into the array that becomes its device buffer; a shard
    held by several devices gets a copy each."""
    mesh = jax.make_mesh((8,), ("data",))
    like = {"w": jax.ShapeDtypeStruct((2, 64, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, None, None)))}
    with open_store("nvme", like, path=str(tmp_path), pool=BufferPool(1 << 20)) as store:
        w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
        store.write(0, {"w": w}).result()
        got = store.read(0).result()["w"]
    pointers = {s.data.unsafe_buffer_pointer() for s in got.addressable_shards}
    assert len(pointers) == 8
    for s in got.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), w)
