"""Round trips through every tier: every dtype, sharded leaves, the manifest."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zinfjax.store import BufferPool, StoreError, layer_sharding, open_store, stacked_sharding
from zinfjax.store.pool import staging_pinned

DTYPES = ["float32", "float16", "bfloat16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "bool"]
L = 3


def _random(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if jnp.issubdtype(dtype, jnp.integer):
        info = jnp.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
    # Raw bit patterns, NaNs and infinities included, to prove the round trip is bit-exact.
    bits = rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    return bits.view(dtype).reshape(shape)


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype != bool else x


def _open(tier, like, tmp_path, **kw):
    return open_store(tier, like, path=str(tmp_path), pool=BufferPool(8 << 20), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvme_round_trips_every_dtype_bit_exactly(tmp_path, dtype):
    like = {"w": jax.ShapeDtypeStruct((L, 4, 6), jnp.dtype(dtype))}
    data = _random((L, 4, 6), dtype)
    with _open("nvme", like, tmp_path) as store:
        store.write_all({"w": data})
        out = store.read_all()["w"]
    assert out.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(_bits(out), _bits(data))


@pytest.mark.parametrize("tier", ["device", "host"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "bool"])
def test_memory_tiers_round_trip(tmp_path, tier, dtype):
    like = {"w": jax.ShapeDtypeStruct((L, 5), jnp.dtype(dtype))}
    data = _random((L, 5), dtype)
    with _open(tier, like, tmp_path) as store:
        for i in range(L):
            store.write(i, {"w": data[i]})
        for i in range(L):
            got = store.read(i).result()["w"]
            assert got.sharding.memory_kind == "device"
            np.testing.assert_array_equal(_bits(got), _bits(data[i]))


def test_host_tier_on_the_cpu_backend_holds_layers_in_device_memory_and_reads_them_without_a_copy(tmp_path):
    """On the CPU backend device memory is host RAM: the tier keeps the written buffer and hands that same
    buffer to compute (`host_tier_kind`), so a read costs no copy."""
    like = {"w": jax.ShapeDtypeStruct((L, 5), jnp.float32)}
    with _open("host", like, tmp_path) as store:
        store.write(0, {"w": jnp.arange(5.0)})
        held = store._layers[0][0]
        got = store.read(0).result()["w"]
    assert store.memory_kind == held.sharding.memory_kind == got.sharding.memory_kind == "device"
    assert got.unsafe_buffer_pointer() == held.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(got), np.arange(5.0))


def test_host_tier_keeps_layers_in_pinned_host_when_told_and_copies_them_to_the_device_on_read(tmp_path):
    like = {"w": jax.ShapeDtypeStruct((L, 5), jnp.float32)}
    with _open("host", like, tmp_path, host_kind="pinned_host") as store:
        store.write(0, {"w": jnp.arange(5.0)})
        held = store._layers[0][0]
        got = store.read(0).result()["w"]
    assert held.sharding.memory_kind == "pinned_host" and got.sharding.memory_kind == "device"
    assert got.unsafe_buffer_pointer() != held.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(got), np.arange(5.0))


def _sharded_like(mesh):
    return {
        "w": jax.ShapeDtypeStruct(
            (L, 8, 16), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "data", "model"))
        ),
        "b": jax.ShapeDtypeStruct((L, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "model"))),
        "r": jax.ShapeDtypeStruct((L, 3), jnp.int32, sharding=NamedSharding(mesh, P())),
    }


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_sharded_leaves_round_trip_on_8_devices(tmp_path, tier):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    like = _sharded_like(mesh)
    data = {k: _random(v.shape, v.dtype, seed=1) for k, v in like.items()}
    with _open(tier, like, tmp_path) as store:
        store.write_all(data)
        layer = store.read(1).result()
        out = store.read_all()
    for k, v in like.items():
        assert layer[k].sharding.is_equivalent_to(layer_sharding(v.sharding), v.ndim - 1)
        assert out[k].sharding.is_equivalent_to(v.sharding, v.ndim)
        np.testing.assert_array_equal(_bits(out[k]), _bits(data[k]))
        np.testing.assert_array_equal(_bits(layer[k]), _bits(data[k][1]))


def test_nvme_chunk_is_one_layer_device_shard(tmp_path):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    like = _sharded_like(mesh)
    with _open("nvme", like, tmp_path) as store:
        store.write_all({k: _random(v.shape, v.dtype) for k, v in like.items()})
    chunks = [f for _, _, fs in os.walk(tmp_path / "params" / "w" / "c") for f in fs]
    assert len(chunks) == L * 8  # (layer, 4 x 2 shards)
    manifest = json.loads((tmp_path / "params" / "manifest.json").read_text())
    w = next(leaf for leaf in manifest["leaves"] if leaf["name"] == "w")
    assert manifest["format_version"] == 1
    assert w["chunk_shape"] == [1, 2, 8]
    assert w["layer_spec"] == ["data", "model"]
    assert w["mesh"] == {"axis_names": ["data", "model"], "shape": [4, 2]}
    assert w["dtype"] == "bfloat16"


def test_write_accepts_jax_arrays_on_another_sharding(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    like = {"w": jax.ShapeDtypeStruct((L, 16), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))}
    with _open("nvme", like, tmp_path) as store:
        store.write(0, {"w": jnp.arange(16.0)}).result()  # single device, resharded by the store
        np.testing.assert_array_equal(store.read(0).result()["w"], np.arange(16.0))


def test_mesh_sharding_argument_applies_to_plain_leaves(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    like = {"w": jax.ShapeDtypeStruct((L, 16), jnp.float32)}
    stacked = NamedSharding(mesh, P(None, "data"))
    with _open("nvme", like, tmp_path, mesh_sharding=stacked) as store:
        store.write(0, {"w": np.arange(16.0, dtype=np.float32)}).result()
        got = store.read(0).result()["w"]
    assert got.sharding.is_equivalent_to(layer_sharding(stacked), 1)
    assert stacked_sharding(layer_sharding(stacked)).spec == stacked.spec


def test_sharded_layer_axis_is_refused(tmp_path):
    mesh = jax.make_mesh((8,), ("data",))
    like = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=NamedSharding(mesh, P("data")))}
    with pytest.raises(StoreError, match="layer axis"):
        open_store("device", like)


def test_stats_count_bytes_and_operations(tmp_path):
    like = {"w": jax.ShapeDtypeStruct((L, 4), jnp.float32)}
    with _open("nvme", like, tmp_path) as store:
        store.write_all({"w": np.zeros((L, 4), np.float32)})
        store.read(0).result()
        assert (store.stats.writes, store.stats.reads) == (L, 1)
        assert (store.stats.bytes_written, store.stats.bytes_read) == (L * 16, 16)


@pytest.mark.parametrize("chunk_io", ["direct", "tensorstore"])
@pytest.mark.parametrize("kind", ["device", "pinned_host"])
def test_nvme_stages_in_pinned_memory_and_reads_into_either_memory_kind(tmp_path, chunk_io, kind):
    """A pinned pool (what an accelerator gets) stages writes, and tensorstore's reads, in pinned_host memory."""
    like = {"w": jax.ShapeDtypeStruct((L, 64, 48), jnp.bfloat16), "b": jax.ShapeDtypeStruct((L, 48), jnp.float32)}
    data = {"w": _random((L, 64, 48), "bfloat16"), "b": _random((L, 48), "float32", seed=1)}
    pool = BufferPool(8 << 20, pinned=True)
    with open_store("nvme", like, path=str(tmp_path), pool=pool, chunk_io=chunk_io) as store:
        for i in range(L):
            store.write(i, {"w": jnp.asarray(data["w"][i]), "b": data["b"][i]})
        store.flush()
        for i in range(L):
            got = store.read(i, None, kind).result()
            assert {x.sharding.memory_kind for x in got.values()} == {kind}
            for key in like:
                np.testing.assert_array_equal(_bits(got[key]), _bits(data[key][i]))
        buf = pool.acquire(1 << 20)
        owner = buf._owner
        assert owner.sharding.memory_kind == "pinned_host" and buf.address % 4096 == 0
        assert owner.unsafe_buffer_pointer() <= buf.address < owner.unsafe_buffer_pointer() + owner.nbytes
        buf.release()
    assert pool.stats()["memory"] == "pinned_host" and pool.peak_bytes > 0


def test_the_cpu_backend_stages_in_pageable_memory():
    assert not staging_pinned(jax.devices()[0])
    assert BufferPool(1 << 20).stats()["memory"] == "pageable"
