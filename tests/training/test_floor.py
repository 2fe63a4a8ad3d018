"""Every step of an NVMe run measured against the disk's floor, and the metrics on TensorBoard.

``io_floor_s`` is the step's NVMe bytes at the disk's probed rates (reads and writes overlapping at best, at the
rate the disk moves both at once);
``floor_ratio`` is the step over max(compute alone, io_floor_s) where the plan timed compute alone, and ``io_ratio``
the step over io_floor_s elsewhere; TensorBoard's own reader sees the scalars.
"""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.training.test_reliability import one_error, train
from zinfjax.config import Config
from zinfjax.training.floor import Floor, plan_compute
from zinfjax.training.loop import progress_text, run

TINY = dict(model="gpt2-tiny", batch_size=2, seq_len=16, mesh="data:1", steps=3)


@pytest.fixture(scope="module")
def nvme_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("floor")
    config = Config(**TINY, params="nvme", optimizer="nvme", nvme_path=str(tmp / "nvme"), log=str(tmp / "run.json"),
                    tensorboard_dir=str(tmp / "tb"))
    log = run(config, progress=False)
    return log, tmp


def test_every_nvme_step_carries_its_floor(nvme_run):
    log, tmp = nvme_run
    assert json.loads((tmp / "run.json").read_text())["steps"] == log["steps"]
    disk = log["disk_probe"]
    assert disk["read_GBps"] > 0 and disk["write_GBps"] > 0 and disk["mixed_GBps"] > 0 and disk["bytes"] == 256 << 20
    assert log["floor_compute"]["source"] is None  # manual tiers: no plan timed compute alone
    for s in log["steps"]:
        assert s["read_bytes_nvme"] > 0 and s["write_bytes_nvme"] > 0
        io_floor = max(s["read_bytes_nvme"] / (disk["read_GBps"] * 1e9),
                       s["write_bytes_nvme"] / (disk["write_GBps"] * 1e9),
                       (s["read_bytes_nvme"] + s["write_bytes_nvme"]) / (disk["mixed_GBps"] * 1e9))
        assert s["io_floor_s"] == pytest.approx(io_floor, rel=1e-9) and s["io_floor_s"] > 0
        assert s["io_ratio"] == pytest.approx(s["step_s"] / s["io_floor_s"], rel=1e-9) and "floor_ratio" not in s
    assert f"io_floor={log['steps'][-1]['io_ratio']:.2f}x" in progress_text(log["steps"][-1])


def test_tensorboard_reader_sees_the_step_metrics(nvme_run):
    log, tmp = nvme_run
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/tokens_per_s", "time/stall_s", "time/overlap", "time/io_floor_s",
                "time/io_ratio", "bytes/read_nvme", "bytes/write_nvme"):
        assert tag in scalars, (tag, scalars)
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(s["step"], pytest.approx(s["loss"], rel=1e-6)) for s in log["steps"]]
    ratios = [e.value for e in events.Scalars("time/io_ratio")]
    assert ratios == [pytest.approx(s["io_ratio"], rel=1e-6) for s in log["steps"]]


def test_an_in_memory_run_has_no_floor(tmp_path):
    log = run(Config(**{**TINY, "steps": 1}, log=str(tmp_path / "run.json")), progress=False)
    assert "disk_probe" not in log
    assert all(not {"io_floor_s", "floor_ratio", "io_ratio"} & set(s) for s in log["steps"])


def test_a_disk_without_rates_gets_a_note_not_a_number():
    floor = Floor({"note": "no O_DIRECT probe under /dev/shm/x (Invalid argument): io_floor_s is not logged"})
    assert floor.fields({"step_s": 1.0, "compute_s": 0.5, "read_bytes_nvme": 10**9, "write_bytes_nvme": 1}) == {}
    assert "note" in floor.log_facts()["disk_probe"]


def test_the_plan_s_compute_is_compute_alone_where_it_timed_it():
    floor = Floor({"read_GBps": 2.0, "write_GBps": 1.0}, compute_alone_s=0.5)
    fields = floor.fields({"step_s": 1.2, "compute_s": 1.1, "read_bytes_nvme": 10**9, "write_bytes_nvme": 4 * 10**8})
    assert fields == {"io_floor_s": pytest.approx(0.5), "floor_ratio": pytest.approx(1.2 / 0.5)}
    fields = floor.fields({"step_s": 1.2, "compute_s": 1.1, "read_bytes_nvme": 2 * 10**9, "write_bytes_nvme": 0})
    assert fields == {"io_floor_s": pytest.approx(1.0), "floor_ratio": pytest.approx(1.2)}



def test_a_disk_that_shares_its_bandwidth_floors_at_the_sum():
    """Reading and writing at once at the probed ``mixed_GBps`` (this machine's virtio disk moves about one rate
    for both): the floor is the bytes together at that rate, where it is slower than each alone."""
    shared = Floor({"read_GBps": 2.0, "write_GBps": 2.0, "mixed_GBps": 2.0}, compute_alone_s=0.5)
    step = {"step_s": 3.0, "compute_s": 2.0, "read_bytes_nvme": 2 * 10**9, "write_bytes_nvme": 2 * 10**9}
    fields = shared.fields(step)
    assert fields == {"io_floor_s": pytest.approx(2.0), "floor_ratio": pytest.approx(1.5)}
    duplex = Floor({"read_GBps": 2.0, "write_GBps": 2.0, "mixed_GBps": 4.0}, compute_alone_s=0.5)
    assert duplex.fields(step)["io_floor_s"] == pytest.approx(1.0)  # each at its own rate, overlapping


def test_compute_alone_comes_from_a_plan_only_where_it_timed_it():
    device = {"params": "device", "optimizer": "device"}
    nvme = {"params": "nvme", "optimizer": "nvme"}
    plan = {"probed": True, "recommended": {"tiers": nvme, "step_s": 1.0}, "rates": {"calibration_layers": 2},
            "placements": [{"tiers": device, "compute_s": 0.2}, {"tiers": nvme, "compute_s": 0.3}]}
    assert plan_compute(plan) == 0.3
    assert plan_compute({**plan, "probed": False}) is None  # nominal figures are no measurement
    assert plan_compute({**plan, "rates": {}}) is None  # probed, but its timing runs did not fit: nominal compute
    assert plan_compute(None) is None


def test_an_unwritable_tensorboard_dir_is_refused_in_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = train(capsys, "steps=1", f"tensorboard_dir={blocker / 'tb'}", f"log={tmp_path / 'run.json'}")
    assert "tensorboard_dir=" in one_error(code, err) and "choose a writable directory" in err
    assert not (tmp_path / "run.json").exists()
    code, _, err = train(capsys, "steps=1", f"tensorboard_dir={blocker}")
    assert "is a file" in one_error(code, err)
