"""The nvme tier's direct chunk I/O writes zarr3 chunks that tensorstore reads, and the other way round."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

from zinfjax.store import BufferPool, StoreCorruptionError, open_store
from zinfjax.store.chunkfile import CHECKSUM_BYTES, crc32c, slot_bytes, write_chunks
from zinfjax.store.nvme import zarr_spec

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
