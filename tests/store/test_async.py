"""Asynchronous behaviour: the buffer pool bound, prefetch order and depth, read-after-write.

Reads in the order of their schedule and the writes of one layer landing in the order they were issued
are the I/O half of invariant 3 (docs/design.md); tests/engine/test_exact.py holds the results to it.
"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zinfjax.engine.readahead import Read, ReadAhead, ReadAheadError
from zinfjax.errors import UserError
from zinfjax.store import BufferBudgetError, BufferPool, open_store, staging_bytes

L = 8
ROWS = 64  # one layer = 64 x 64 float32 = 16 KiB


def _like():
    return {
        "w": jax.ShapeDtypeStruct((L, ROWS, 64), jnp.float32),
        "b": jax.ShapeDtypeStruct((L, 64), jnp.float32),
    }


def _layer(i, salt=0.0):
    return {"w": np.full((ROWS, 64), i + salt, np.float32), "b": np.full((64,), -i - salt, np.float32)}


LAYER_BYTES = staging_bytes(_like())  # the staging one layer needs: data, checksums, block padding


class _CountingPool(BufferPool):
    """A pool that records the most bytes ever held, acquired or kept for reuse, after each change."""

    def __init__(self, capacity):
        super().__init__(capacity)
        self.max_resident = 0

    def acquire(self, nbytes, timeout=None):
        buf = super().acquire(nbytes, timeout)
        self.max_resident = max(self.max_resident, self.resident_bytes)
        return buf


def test_pool_blocks_until_bytes_are_free():
    pool = BufferPool(100)
    a = pool.acquire(60)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(60)))
    t.start()
    time.sleep(0.05)
    assert not got and pool.in_use_bytes == 60
    a.release()
    t.join(1)
    assert got and pool.in_use_bytes == 60 and pool.peak_bytes == 60
    got[0].release()
    assert pool.stats()["waits"] == 1


def test_pool_refuses_more_than_its_capacity_with_the_bytes_needed():
    pool = BufferPool(1000)
    with pytest.raises(BufferBudgetError, match="1001 bytes") as e:
        pool.acquire(1001)
    assert isinstance(e.value, UserError)


def test_pool_reuses_buffers_and_stays_under_capacity():
    pool = BufferPool(4096 * 3)
    first = pool.acquire(4096)
    addr = first.address
    first.release()
    again = pool.acquire(4096)
    assert again.address == addr
    again.release()
    big = pool.acquire(4096 * 3)  # must evict the kept 4 KiB buffer to fit
    assert pool.resident_bytes <= pool.capacity_bytes
    big.release()


def test_a_kept_larger_buffer_serves_a_smaller_request_within_the_capacity():
    """Slices of several sizes (a bf16 compute copy, an fp32 master, Adam's state) share one pool: a kept
    buffer that holds a request serves it, instead of being dropped for a fresh one's page faults."""
    pool = BufferPool(4096 * 4)
    big = pool.acquire(4096 * 3)
    addr = big.address
    big.release()
    small = pool.acquire(4096)
    assert small.address == addr and small.nbytes == 4096 * 3
    assert pool.in_use_bytes == 4096 * 3  # counted at its real size
    other = pool.acquire(4096)  # no room beside it for the kept size: a fresh buffer of its own
    assert other.nbytes == 4096 and pool.in_use_bytes == 4096 * 4 <= pool.capacity_bytes
    small.release()
    other.release()
    assert pool.resident_bytes <= pool.capacity_bytes and pool.in_use_bytes == 0


def test_read_ahead_follows_the_schedule_and_the_pool_bounds_it(tmp_path):
    pool = _CountingPool(2 * LAYER_BYTES + 256)  # room for two layers, well below depth 4
    schedule = list(range(L)) + list(reversed(range(L)))
    with open_store("nvme", _like(), path=str(tmp_path), pool=pool) as store:
        for i in range(L):
            store.write(i, _layer(i))
        store.flush()
        prefetcher = ReadAhead([[Read("w", store, i)] for i in schedule], depth=4)
        for i, (layer,) in zip(schedule, prefetcher, strict=True):
            time.sleep(0.002)  # a consumer slower than the reads lets them pile up to the depth
            np.testing.assert_array_equal(layer["w"], np.full((ROWS, 64), i, np.float32))
        assert prefetcher.max_ahead == 4
        assert store.stats.peak_reads_in_flight <= 4 + 1
    assert pool.peak_bytes <= pool.capacity_bytes
    assert pool.max_resident <= pool.capacity_bytes
    assert pool.in_use_bytes == 0
    assert [r.layer for r in prefetcher.events] == schedule
    assert all(r.complete_t is not None and r.complete_t >= r.issue_t for r in prefetcher.events)
    assert prefetcher.stall_s >= 0


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetch_depth_is_respected(tmp_path, depth):
    with open_store("host", _like(), path=str(tmp_path)) as store:
        store.write_all(jax.tree.map(lambda *x: np.stack(x), *[_layer(i) for i in range(L)]))
        prefetcher = ReadAhead([[Read("w", store, i)] for i in range(L)], depth=depth)
        issued_before_use = []
        for i, _ in enumerate(prefetcher):
            issued_before_use.append(len(prefetcher.events) - 1 - i)
    assert max(issued_before_use) == depth
    assert prefetcher.max_ahead == depth


def test_small_groups_are_read_further_ahead_within_depth_largest_groups_bytes(tmp_path):
    """Depth 1 after a group of 4 layers: the single-layer groups behind it go 4 ahead (its bytes), not 1."""
    with open_store("host", _like(), path=str(tmp_path)) as store:
        store.write_all(jax.tree.map(lambda *x: np.stack(x), *[_layer(i) for i in range(L)]))
        groups = [[Read("w", store, i) for i in range(4)]] + [[Read("w", store, i)] for i in range(L)]
        prefetcher = ReadAhead(groups, depth=1)
        ahead = []
        for k, _ in enumerate(prefetcher):
            ahead.append(len({id(e) for e in prefetcher.events}) - sum(len(g) for g in groups[: k + 1]))
    assert prefetcher.max_ahead == 4  # 4 one-layer groups hold the bytes of the 4-layer group
    assert max(ahead) == 4


def test_a_group_not_ready_is_passed_over_and_read_at_its_turn(tmp_path):
    """Group 1 waits on something group 0's consumer does: groups 2-4 are read meanwhile, group 1 once it is
    ready, before its turn."""
    with open_store("host", _like(), path=str(tmp_path)) as store:
        store.write_all(jax.tree.map(lambda *x: np.stack(x), *[_layer(i) for i in range(L)]))
        done: set = set()
        groups = [[Read("w", store, 0)], [Read("w", store, 1, ready=lambda: 0 in done)]]
        groups += [[Read("w", store, i)] for i in range(2, 5)]
        prefetcher = ReadAhead(groups, depth=3)
        (first,) = next(prefetcher)
        assert [e.layer for e in prefetcher.events] == [0, 2, 3]  # 1 passed over, not holding back 2 and 3
        done.add(0)
        got = [first] + [layer for (layer,) in prefetcher]
    assert [e.layer for e in prefetcher.events] == [0, 2, 3, 1, 4]
    for i, layer in enumerate(got):
        np.testing.assert_array_equal(layer["w"], np.full((ROWS, 64), i, np.float32))


def test_read_after_write_sees_the_last_write_under_concurrency(tmp_path):
    pool = BufferPool(3 * LAYER_BYTES)
    with open_store("nvme", _like(), path=str(tmp_path), pool=pool, write_threads=4, read_threads=4) as store:
        store.write_all(jax.tree.map(lambda *x: np.stack(x), *[_layer(i) for i in range(L)]))
        errors = []

        def worker(layer):
            try:
                for version in range(1, 6):
                    store.write(layer, _layer(layer, salt=1000.0 * version))
                    got = store.read(layer).result()  # issued while the write may be in flight
                    assert float(got["w"][0, 0]) == layer + 1000.0 * version
                    assert float(got["b"][0]) == -(layer + 1000.0 * version)
            except BaseException as e:  # noqa: BLE001 - reported in the main thread
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(L)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        store.flush()
        for i in range(L):
            assert float(store.read(i).result()["w"][0, 0]) == i + 5000.0
    assert pool.peak_bytes <= pool.capacity_bytes


def test_writes_of_one_layer_land_in_issue_order(tmp_path):
    with open_store("nvme", _like(), path=str(tmp_path), write_threads=8) as store:
        futures = [store.write(0, _layer(0, salt=float(v))) for v in range(20)]
        read = store.read(0)
        for f in futures:
            f.result()
        assert float(read.result()["w"][0, 0]) == 19.0


def test_read_results_do_not_alias_reused_pool_buffers(tmp_path):
    pool = BufferPool(LAYER_BYTES + 256)  # one buffer, reused by every read
    with open_store("nvme", _like(), path=str(tmp_path), pool=pool) as store:
        for i in range(L):
            store.write(i, _layer(i))
        results = [store.read(i).result() for i in range(L)]
    for i, layer in enumerate(results):
        np.testing.assert_array_equal(layer["w"], np.full((ROWS, 64), i, np.float32))
        np.testing.assert_array_equal(layer["b"], np.full((64,), -i, np.float32))


def test_caller_may_drop_and_reuse_its_array_after_write(tmp_path):
    with open_store("device", _like(), path=str(tmp_path)) as store:
        layer = _layer(1)
        store.write(1, layer).result()
        layer["w"][:] = -7  # the store kept its own copy
        np.testing.assert_array_equal(store.read(1).result()["w"], np.full((ROWS, 64), 1, np.float32))


def test_a_negative_read_ahead_depth_is_a_user_error():
    with pytest.raises(ReadAheadError, match=r"^prefetch depth=-1 must be 0 or more"):
        ReadAhead([], depth=-1)
