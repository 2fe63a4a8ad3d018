"""The process's CPU time by thread role, per step: zinfjax's pools are named in the kernel, so it can tell."""

import os

from tests.support.engine_helpers import batches, config, make_engine
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
    # A batch large enough that each role's CPU time is many of the kernel's 10 ms ticks.
    c = config(mesh="data:1", params="nvme", optimizer="nvme", activations="nvme", nvme_path=str(tmp_path),
               batch_size=64, seq_len=64)
    engine = make_engine(c)
    try:
        data = batches(c)
        engine.train_step(next(data))
        steps = [engine.train_step(next(data)) for _ in range(2)]
    finally:
        engine.close()
    for metrics in steps:
        assert all(metrics[f"cpu_s_{role}"] >= 0 for role in ALL_ROLES)
        total = sum(metrics[f"cpu_s_{role}"] for role in ALL_ROLES)
        assert total <= os.cpu_count() * metrics["step_s"] * 1.05 + 0.05
    cpu = {role: sum(m[f"cpu_s_{role}"] for m in steps) for role in ALL_ROLES}
    assert cpu["xla"] > 0 and cpu["main"] > 0
    assert cpu["read"] + cpu["write"] + cpu["chunk_io"] > 0  # the I/O path's own threads did the I/O
