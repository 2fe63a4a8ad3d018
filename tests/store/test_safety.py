"""Integrity and safety of the nvme tier: checksums, locks, manifests, paths and a full disk."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.mounts import tmpfs
from zinfjax.errors import UserError
from zinfjax.store import (
    BufferPool,
    LayerNotWrittenError,
    ManifestMismatchError,
    StoreCorruptionError,
    StoreLockedError,
    StorePathError,
    StoreSpaceError,
    open_store,
)

L = 4


def _like(rows=8, dtype=jnp.float32):
    return {"blocks": {"w": jax.ShapeDtypeStruct((L, rows, 16), dtype)}}


def _layer(i, rows=8):
    return {"blocks": {"w": np.full((rows, 16), i, np.float32)}}


def _chunk(root, layer):
    return os.path.join(root, "params", "blocks.w", "c", str(layer), "0", "0")


def test_corrupt_chunk_names_leaf_and_layer(tmp_path):
    with open_store("nvme", _like(), path=str(tmp_path)) as store:
        for i in range(L):
            store.write(i, _layer(i))
        store.flush()
        path = _chunk(tmp_path, 2)
        data = bytearray(open(path, "rb").read())
        data[10] ^= 0xFF
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(StoreCorruptionError, match=r"blocks\.w.*layer 2") as e:
            store.read(2).result()
        assert (e.value.leaf, e.value.layer) == ("blocks.w", 2)
        np.testing.assert_array_equal(store.read(1).result()["blocks"]["w"], np.full((8, 16), 1.0))


def test_truncated_chunk_is_corruption(tmp_path):
    with open_store("nvme", _like(), path=str(tmp_path)) as store:
        store.write(0, _layer(0)).result()
        os.truncate(_chunk(tmp_path, 0), 100)
        with pytest.raises(StoreCorruptionError, match="layer 0"):
            store.read(0).result()


def test_unwritten_layer_is_an_error_not_zeros(tmp_path):
    with open_store("nvme", _like(), path=str(tmp_path)) as store:
        with pytest.raises(LayerNotWrittenError, match="layer 3"):
            store.read(3).result()
        store.write(3, {"blocks": {"w": np.zeros((8, 16), np.float32)}}).result()
        np.testing.assert_array_equal(store.read(3).result()["blocks"]["w"], 0.0)


def test_reopen_reads_what_was_written(tmp_path):
    with open_store("nvme", _like(), path=str(tmp_path)) as store:
        store.write_all({"blocks": {"w": np.arange(L * 8 * 16, dtype=np.float32).reshape(L, 8, 16)}})
    with open_store("nvme", _like(), path=str(tmp_path), create=False) as store:
        np.testing.assert_array_equal(store.read(1).result()["blocks"]["w"][0, 0], 128.0)


@pytest.mark.parametrize(
    "like, what",
    [
        (_like(rows=4), "shape"),
        (_like(dtype=jnp.bfloat16), "dtype"),
        ({"blocks": {"v": jax.ShapeDtypeStruct((L, 8, 16), jnp.float32)}}, "missing"),
    ],
)
def test_manifest_mismatch_is_a_clear_error(tmp_path, like, what):
    open_store("nvme", _like(), path=str(tmp_path)).close()
    with pytest.raises(ManifestMismatchError, match=what) as e:
        open_store("nvme", like, path=str(tmp_path))
    assert "fresh nvme_path" in str(e.value) and isinstance(e.value, UserError)
    open_store("nvme", _like(), path=str(tmp_path)).close()  # the failed open left the lock free


def test_open_without_create_needs_a_store(tmp_path):
    with pytest.raises(StorePathError, match="create=True"):
        open_store("nvme", _like(), path=str(tmp_path), create=False)


def test_live_lock_names_pid_and_path(tmp_path):
    store = open_store("nvme", _like(), path=str(tmp_path))
    try:
        with pytest.raises(StoreLockedError, match=f"process {os.getpid()}.*lock file"):
            open_store("nvme", _like(), path=str(tmp_path))
    finally:
        store.close()
    open_store("nvme", _like(), path=str(tmp_path)).close()


def test_lock_held_by_another_process(tmp_path):
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from zinfjax.store import open_store\n"
        "like = {'w': jax.ShapeDtypeStruct((2, 4), jnp.float32)}\n"
        f"s = open_store('nvme', like, path={str(tmp_path)!r})\n"
        "print('ready', flush=True); sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(StoreLockedError, match=f"process {child.pid}"):
            open_store("nvme", {"w": jax.ShapeDtypeStruct((2, 4), jnp.float32)}, path=str(tmp_path))
    finally:
        child.stdin.close()
        child.wait(30)


def test_stale_lock_of_a_dead_process_is_reclaimed(tmp_path):
    with open_store("nvme", _like(), path=str(tmp_path)) as store:
        for i in range(L):
            store.write(i, _layer(i + 1))
        store.flush()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (tmp_path / "params" / ".lock").write_text(f'{{"pid": {dead.pid}, "hostname": "{socket.gethostname()}"}}')
    with open_store("nvme", _like(), path=str(tmp_path)) as store:  # the lock reclaimed, the layers still there
        for i in range(L):
            np.testing.assert_array_equal(np.asarray(store.read(i).result()["blocks"]["w"]),
                                          _layer(i + 1)["blocks"]["w"])


def test_unwritable_path_is_refused_before_writing(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(StorePathError, match="nvme_path"):
        open_store("nvme", _like(), path=str(blocker / "run"))


def test_read_only_path_is_refused(tmp_path):
    with tmpfs(tmp_path / "ro", "1M", read_only=True) as ro:
        with pytest.raises(StorePathError, match="not writable|cannot create"):
            open_store("nvme", _like(), path=str(ro))
        assert os.listdir(ro) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    with tmpfs(tmp_path / "tmpfs", "8M") as mnt:
        yield mnt


def test_store_too_big_for_the_disk_is_refused_up_front(small_tmpfs):
    like = {"w": jax.ShapeDtypeStruct((16, 1024, 1024), jnp.float32)}  # 64 MiB > 8 MiB
    with pytest.raises(StoreSpaceError, match=r"needs \d+ bytes but only \d+ are free"):
        open_store("nvme", like, path=str(small_tmpfs))
    assert not os.path.exists(small_tmpfs / "params" / "manifest.json")


def test_disk_full_during_a_write_says_bytes_needed_and_keeps_old_layers(small_tmpfs):
    rows = 256  # 1 MiB per layer
    like = {"w": jax.ShapeDtypeStruct((L, rows, 1024), jnp.float32)}
    with open_store("nvme", like, path=str(small_tmpfs), pool=BufferPool(4 << 20)) as store:
        store.write(0, {"w": np.full((rows, 1024), 7.0, np.float32)}).result()
        free = os.statvfs(small_tmpfs).f_bavail * os.statvfs(small_tmpfs).f_frsize
        with open(small_tmpfs / "filler", "wb") as f:
            f.write(b"\0" * (free - (64 << 10)))  # leave 64 KiB: not enough for a 1 MiB chunk
        with pytest.raises(StoreSpaceError, match=r"needs \d+ bytes") as e:
            store.write(1, {"w": np.ones((rows, 1024), np.float32)}).result()
        assert str(rows * 1024 * 4 + 4) in str(e.value)
        assert not [f for _, _, fs in os.walk(small_tmpfs / "params") for f in fs if f.endswith(".tmp")]
        np.testing.assert_array_equal(store.read(0).result()["w"], 7.0)
        with pytest.raises(StoreSpaceError):
            store.flush()  # the failed write is reported once more, to whoever flushes
        os.remove(small_tmpfs / "filler")
        store.write(1, {"w": np.ones((rows, 1024), np.float32)}).result()
        np.testing.assert_array_equal(store.read(1).result()["w"], 1.0)
