"""The process's CPU time by thread role, per step: zinfjax's pools are named in the kernel, so it can tell."""

import os

from tests.engine_helpers import batches, config, make_engine
from zinfjax.store.threads import ALL_ROLES, executor


def _kernel_names() -> set[str]:
    names = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.add(f.read().strip())
        except OSError:
            pass
    return names


def test_a_pool_thread_carries_its_name_into_the_kernel():
    pool = executor(1, "zinf-write-names")
    try:
        pool.submit(lambda: None).result()
        assert "zinf-write-name" in _kernel_names()  # the kernel keeps 15 bytes
    finally:
        pool.shutdown()


def test_an_nvme_step_reports_cpu_seconds_by_role(tmp_path):
    c = config(mesh="data:1", params="nvme", optimizer="nvme", activations="nvme", nvme_path=str(tmp_path))
    engine = make_engine(c)
    try:
        data = batches(c)
        engine.train_step(next(data))
        metrics = engine.train_step(next(data))
    finally:
        engine.close()
    cpu = {role: metrics[f"cpu_s_{role}"] for role in ALL_ROLES}
    assert all(v >= 0 for v in cpu.values())
    assert cpu["xla"] > 0 and cpu["main"] > 0
    assert cpu["read"] + cpu["write"] + cpu["chunk_io"] > 0  # the I/O path's own threads did the I/O
    assert sum(cpu.values()) <= os.cpu_count() * metrics["step_s"] * 1.05 + 0.05
