"""The nvme tier's read arrays on the CPU backend are used again, but never while anything holds them."""

import jax
import jax.numpy as jnp
import numpy as np

from zinfjax.store import BufferPool, open_store
from zinfjax.store.chunkfile import slot_bytes

L = 4


def _layers():
    return np.random.default_rng(0).standard_normal((L, 64, 1024)).astype(np.float32)


def _address(x: jax.Array) -> int:
    return x.addressable_shards[0].data.unsafe_buffer_pointer()


def test_a_read_array_held_is_never_read_into_and_a_freed_one_is_used_again(tmp_path):
    data = _layers()
    like = {"w": jax.ShapeDtypeStruct(data.shape, jnp.float32)}
    with open_store("nvme", like, path=str(tmp_path), pool=BufferPool(8 << 20)) as store:
        store.write_all({"w": data})
        first = store.read(0).result()["w"]
        held = _address(first)
        later = [store.read(i).result()["w"] for i in range(1, L)]  # while `first` is held
        assert held not in {_address(x) for x in later}
        np.testing.assert_array_equal(np.asarray(first), data[0])
        del first
        again = store.read(L - 1).result()["w"]
        assert _address(again) == held  # the freed array took the read: no fresh pages
        for i, x in zip(range(1, L), later, strict=True):
            np.testing.assert_array_equal(np.asarray(x), data[i])
        np.testing.assert_array_equal(np.asarray(again), data[L - 1])


def test_a_computation_given_a_read_array_keeps_its_result_while_later_reads_reuse_arrays(tmp_path):
    data = _layers()
    like = {"w": jax.ShapeDtypeStruct(data.shape, jnp.float32)}
    step = jax.jit(lambda w: w * 2.0, donate_argnums=0)
    with open_store("nvme", like, path=str(tmp_path), pool=BufferPool(8 << 20)) as store:
        store.write_all({"w": data})
        doubled = step(store.read(0).result()["w"])
        others = [store.read(i).result()["w"] for i in range(1, L)]
        np.testing.assert_array_equal(np.asarray(doubled), 2 * data[0])
        for i, x in zip(range(1, L), others, strict=True):
            np.testing.assert_array_equal(np.asarray(x), data[i])
        np.testing.assert_array_equal(np.asarray(doubled), 2 * data[0])


def test_the_arrays_nothing_uses_are_let_go_of_and_a_store_told_so_reads_fresh_ones(tmp_path):
    data = _layers()
    like = {"w": jax.ShapeDtypeStruct(data.shape, jnp.float32)}
    with open_store("nvme", like, path=str(tmp_path / "a"), pool=BufferPool(8 << 20)) as store:
        store.write_all({"w": data})
        kept = store.read(1).result()["w"]
        for i in (0, 2):
            store.read(i).result()
        jnp.zeros(1).block_until_ready()  # JAX lets go of the arrays it adopted at its next call
        store.drop_free_reads()
        assert store._read_buffers.held_bytes() == slot_bytes(kept.nbytes)  # the one in use: its slot
    with open_store("nvme", like, path=str(tmp_path / "b"), pool=BufferPool(8 << 20), reuse_reads=False) as store:
        store.write_all({"w": data})
        read = [store.read(i).result()["w"] for i in range(L)]
        assert store._read_buffers.held_bytes() == 0  # every read a fresh array the pool does not keep
        np.testing.assert_array_equal(np.asarray(read[-1]), data[-1])
