"""A block device that fails on command: ext4 on a loop device whose backing image the kernel reads through FUSE.

This kernel has no device-mapper (``CONFIG_MD`` is off: no ``/dev/mapper/control``, so no ``error`` or
``flakey`` target) and no fault injection (``CONFIG_FAULT_INJECTION`` is off). What it has is the loop
driver and FUSE. So the faulty device is built one layer lower than a dm table would put it: the image
file of a loop device lives on a one-file FUSE filesystem served by `serve` (a child process speaking the
FUSE protocol on ``/dev/fuse``, opened with ``FOPEN_DIRECT_IO`` so no page cache hides the image). While
the control file says ``ok`` it passes every read and write to the image; ``reads``, ``writes`` or
``all`` make it answer EIO to those, as dm-flakey's ``error_reads``/``error_writes`` or dm-error would.
The loop driver turns that into a failed bio (``BLK_STS_IOERR``), ext4 (mounted ``errors=continue``) into
EIO from ``pread``/``pwrite``/``fsync``: the same errors, from the same kernel code above the block
layer, that a failing NVMe drive gives.

Lifting a fault: a failed journal write aborts ext4's journal (the filesystem turns read-only whatever
``errors=`` says), so `FaultyDisk.repair` does what an operator would after a drive's transient fault:
unmount, ``e2fsck -fy``, mount again. Everything that was fsynced before the fault is there afterwards.

    with FaultyDisk(tmp_path / "disk") as disk:   # disk.mount is an empty ext4 directory
        disk.fail("reads"); ...; disk.fail("ok"); disk.repair()
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import struct
import subprocess
import sys
import time

_IN = struct.Struct("<IIQQIIIHH")  # fuse_in_header
_OUT = struct.Struct("<IiQ")  # fuse_out_header
_ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr
_ROOT, _IMAGE = 1, 2
LOOKUP, FORGET, GETATTR, OPEN, READ, WRITE, STATFS, RELEASE, FSYNC, FLUSH, INIT, BATCH_FORGET = (
    1, 2, 3, 14, 15, 16, 17, 18, 20, 25, 26, 42)
MODES = ("ok", "reads", "writes", "all")


def unavailable() -> str | None:
    """Why a faulty disk cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (losetup, mount)"
    for tool in ("losetup", "mkfs.ext4", "e2fsck", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.path.exists("/dev/fuse") or not os.path.exists("/dev/loop-control"):
        return "the kernel has no FUSE or no loop driver (/dev/fuse, /dev/loop-control)"
    return None


class FaultyDisk:
    """ext4 of ``size`` bytes mounted at ``<root>/mnt``; `fail` switches its faults, `repair` recovers it."""

    def __init__(self, root, size: int = 512 << 20):
        self.root = os.fspath(root)
        self.fuse_dir, self.mount = os.path.join(self.root, "fuse"), os.path.join(self.root, "mnt")
        self.control, self.image = os.path.join(self.root, "mode"), os.path.join(self.root, "image")
        self.size, self.loop, self.server = size, None, None

    def __enter__(self) -> FaultyDisk:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        for d in (self.fuse_dir, self.mount):
            os.makedirs(d, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        self.fail("ok")
        self.server = subprocess.Popen([sys.executable, __file__, self.fuse_dir, self.image, self.control])
        deadline = time.monotonic() + 20
        while not os.path.exists(os.path.join(self.fuse_dir, "image")):
            assert self.server.poll() is None and time.monotonic() < deadline, "the FUSE server did not start"
            time.sleep(0.05)
        self.loop = _run("losetup", "--find", "--show", os.path.join(self.fuse_dir, "image")).strip()
        _run("mkfs.ext4", "-q", "-F", "-E", "nodiscard", self.loop)
        self._mount()

    def _mount(self) -> None:
        _run("mount", "-t", "ext4", "-o", "errors=continue,data=ordered", self.loop, self.mount)

    def fail(self, mode: str) -> None:
        """Switches the device to ``mode``: ``ok``, or EIO on ``reads``, ``writes`` or ``all`` I/O."""
        assert mode in MODES
        with open(self.control + ".new", "w") as f:
            f.write(mode)
        os.replace(self.control + ".new", self.control)

    def repair(self) -> None:
        """After a fault is lifted: unmount, ``e2fsck -fy`` (a journal aborted by a failed write), mount again."""
        self.fail("ok")
        _run("umount", self.mount)
        code = subprocess.run(["e2fsck", "-fy", self.loop], capture_output=True, text=True).returncode
        assert code in (0, 1, 2), f"e2fsck could not repair {self.loop}: exit {code}"
        self._mount()

    def close(self) -> None:
        """Unmounts and detaches everything, however far `_start` got; safe to call twice."""
        if os.path.exists(self.control):
            self.fail("ok")
        if os.path.ismount(self.mount):
            if subprocess.run(["umount", self.mount], capture_output=True).returncode:
                subprocess.run(["umount", "-l", self.mount], capture_output=True)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
            self.loop = None
        if os.path.ismount(self.fuse_dir):
            subprocess.run(["umount", "-l", self.fuse_dir], capture_output=True)
        if self.server is not None:
            if self.server.poll() is None:
                self.server.terminate()
            self.server.wait(timeout=30)
            self.server = None


def _run(*argv) -> str:
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, f"{' '.join(argv)}: {done.stderr.strip()}"
    return done.stdout


# ---- the FUSE server: one directory holding one file, ``image`` -------------------------------------------------


def serve(mountpoint: str, image: str, control: str) -> None:
    """Mounts a FUSE filesystem at ``mountpoint`` whose one file passes I/O to ``image`` or fails it (``control``)."""
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"faultydisk", mountpoint.encode(), b"fuse", 0, opts) != 0:
        raise OSError(ctypes.get_errno(), "mount of FUSE failed")
    backing = os.open(image, os.O_RDWR)
    while True:
        try:
            request = os.read(fd, (1 << 20) + 4096)
        except OSError as e:
            if e.errno in (errno.ENODEV, errno.EBADF):  # unmounted
                return
            if e.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                continue
            raise
        _, opcode, unique, node, *_ = _IN.unpack_from(request)
        if opcode in (FORGET, BATCH_FORGET):
            continue
        err, body = _answer(opcode, node, request[_IN.size:], backing, _mode(control))
        try:
            os.write(fd, _OUT.pack(_OUT.size + len(body), -err, unique) + body)
        except OSError as e:
            if e.errno != errno.ENOENT:  # an interrupted request
                raise


def _mode(control: str) -> str:
    try:
        with open(control) as f:
            return f.read().strip()
    except OSError:
        return "ok"


def _attr(node: int, backing: int) -> bytes:
    now = int(time.time())
    if node == _ROOT:
        return _ATTR.pack(_ROOT, 0, 0, now, now, now, 0, 0, 0, 0o40755, 2, 0, 0, 0, 4096, 0)
    size = os.fstat(backing).st_size
    return _ATTR.pack(_IMAGE, size, size // 512, now, now, now, 0, 0, 0, 0o100644, 1, 0, 0, 0, 4096, 0)


def _answer(opcode: int, node: int, arg: bytes, backing: int, mode: str) -> tuple[int, bytes]:
    """(errno, reply body) of one request."""
    if opcode == INIT:
        major, minor, readahead, _ = struct.unpack_from("<IIII", arg)
        return 0, struct.pack("<IIIIHHIIHHII", 7, min(minor, 31), readahead, 1 << 5, 16, 12, 1 << 20, 1, 256, 0, 0, 0
                              ) + bytes(24)  # FUSE_BIG_WRITES; max_write 1 MiB, max_pages 256
    if opcode == LOOKUP:
        if node != _ROOT or arg.rstrip(b"\0") != b"image":
            return errno.ENOENT, b""
        return 0, struct.pack("<QQQQII", _IMAGE, 0, 0, 0, 0, 0) + _attr(_IMAGE, backing)
    if opcode == GETATTR:
        return 0, struct.pack("<QII", 0, 0, 0) + _attr(node, backing)
    if opcode == OPEN:
        return 0, struct.pack("<QIi", 0, 1, 0)  # FOPEN_DIRECT_IO: every read and write comes here
    if opcode == READ:
        _, offset, size = struct.unpack_from("<QQI", arg)
        if mode in ("reads", "all"):
            return errno.EIO, b""
        return 0, os.pread(backing, size, offset)
    if opcode == WRITE:
        _, offset, size = struct.unpack_from("<QQI", arg)
        if mode in ("writes", "all"):
            return errno.EIO, b""
        return 0, struct.pack("<II", os.pwrite(backing, arg[40 : 40 + size], offset), 0)
    if opcode == FSYNC:
        return (errno.EIO, b"") if mode in ("writes", "all") else (0, b"")
    if opcode == STATFS:
        return 0, struct.pack("<QQQQQIII", 1 << 20, 1 << 19, 1 << 19, 16, 15, 4096, 255, 4096) + bytes(28)
    if opcode in (RELEASE, FLUSH):
        return 0, b""
    return errno.ENOSYS, b""


if __name__ == "__main__":
    serve(*sys.argv[1:4])
