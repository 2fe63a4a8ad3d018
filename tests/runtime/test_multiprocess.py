"""Multi-process runs: real processes started by `zinfjax launch`, joined by jax.distributed over gloo on localhost."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.xla_flags import child_env

ZINFJAX = [sys.executable, "-m", "zinfjax.cli"]
RUN = ["--quiet", "--set", "steps=3", "--set", "seq_len=32", "--set", "batch_size=8", "--set", "seed=3"]
TOLERANCE = 1e-5
BOUND_S = 300  # no launch may take longer: a hang fails the test instead of stalling CI


def run(args, devices=None, **kw):
    """Runs a command with its own simulated device count (the test process has 8), compiled as the tests compile
    (tests.support.xla_flags): every process of a comparison alike."""
    env = child_env(devices or 1)
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=BOUND_S, **kw)


def launch(n, *command, devices_per_process=2, **kw):
    return run([*ZINFJAX, "launch", "-n", str(n), "--devices-per-process", str(devices_per_process), "--",
                *command], **kw)


def losses(path):
    log = json.loads(path.read_text())
    return [s["loss"] for s in log["steps"]], log


@pytest.fixture(scope="module")
def one_process_four_devices(tmp_path_factory):
    """The reference trainer in one process on 4 devices: what every multi-process run must match."""
    log = tmp_path_factory.mktemp("single") / "ref.json"
    out = run([*ZINFJAX, "train", *RUN, "--set", f"log={log}"], devices=4)
    assert out.returncode == 0, out.stderr
    reference, data = losses(log)
    assert data["processes"] == 1 and data["devices"] == 4
    return reference


def check_matches(reference, path):
    got, data = losses(path)
    assert data["processes"] == 2 and data["devices"] == 4
    assert len(got) == len(reference) == 3
    diffs = [abs(a - b) for a, b in zip(got, reference, strict=True)]
    print(f"max |loss(2x2) - loss(1x4)| = {max(diffs):.3g}")
    assert max(diffs) <= TOLERANCE, (got, reference)


@pytest.mark.slow
@pytest.mark.wide
def test_reference_two_processes_match_one_process(one_process_four_devices, tmp_path):
    log = tmp_path / "mp.json"
    # docs/sharding.md's command: the mesh over both processes' devices (the default, data:-1, is the same)
    out = launch(2, *ZINFJAX, "train", *RUN, "--set", "mesh=data:4", "--set", f"log={log}", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    check_matches(one_process_four_devices, log)
    assert "[rank 0] trained 3 steps" in out.stdout
    assert "[rank 1] trained" not in out.stdout  # only process 0 reports and writes the log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mp.json", "mp.png"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.wide), 3])
@pytest.mark.slow
def test_engine_on_nvme_two_processes_match_one_process(one_process_four_devices, tmp_path, stage):
    """Also saves checkpoints at steps 2 and 3 from both processes (docs/checkpoint.md).

    make test runs stage 3, where each process reads and writes its own shard of every layer and the
    checkpoint is resumed in one process; stage 0 (every process holds every layer: the single-process
    path once per process) is the wide corner, for make test-all."""
    log, nvme, ckpt = tmp_path / "mp.json", tmp_path / "nvme", tmp_path / "ckpt"
    out = launch(2, *ZINFJAX, "train", *RUN, "--set", f"stage={stage}", "--set", "params=nvme",
                 "--set", "optimizer=nvme", "--set", f"nvme_path={nvme}", "--set", f"log={log}",
                 "--set", f"save_dir={ckpt}", "--set", "save_every=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert sorted(p.name for p in nvme.iterdir()) == ["process_0", "process_1"]
    for d in nvme.iterdir():
        assert {"params_blocks", "opt_blocks"} <= {p.name for p in d.iterdir()}
    check_matches(one_process_four_devices, log)
    if stage == 3:
        resume_in_one_process(one_process_four_devices, ckpt, tmp_path / "resumed.json")


def resume_in_one_process(reference, ckpt, log):
    """The checkpoint of step 2 (2 processes x 2 devices, stage 3, nvme) resumed by 1 process on 2 devices,
    stage 1, in memory: step 3 matches the uninterrupted run."""
    meta = json.loads((ckpt / "2" / "zinfjax.json").read_text())
    assert meta["processes"] == 2 and meta["devices"] == 4 and meta["config"]["stage"] == 3
    shutil.rmtree(ckpt / "3")
    out = run([*ZINFJAX, "train", *RUN, "--set", "stage=1", "--set", "mesh=data:2", "--set", f"save_dir={ckpt}",
               "--set", "resume=true", "--set", f"log={log}"], devices=2)
    assert out.returncode == 0, out.stderr
    got, data = losses(log)
    assert [s["step"] for s in data["steps"]] == [3]
    print(f"resumed step 3: {got[0]!r}, uninterrupted 1x4: {reference[2]!r}")
    assert abs(got[0] - reference[2]) <= TOLERANCE


FAIL_IN_COLLECTIVE = textwrap.dedent("""
    import os
    from zinfjax.runtime.distributed import initialize_from_env
    from jax.experimental import multihost_utils
    initialize_from_env()
    multihost_utils.sync_global_devices("both here")
    if os.environ["ZINFJAX_PROCESS_ID"] == "1":
        raise RuntimeError("rank 1 fails on purpose")
    multihost_utils.sync_global_devices("rank 1 never comes")  # blocks until launch stops it
""")


def test_failed_process_stops_the_others(tmp_path):
    start = time.monotonic()
    out = launch(2, sys.executable, "-c", FAIL_IN_COLLECTIVE)
    elapsed = time.monotonic() - start
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[rank 1] RuntimeError: rank 1 fails on purpose" in out.stdout
    assert out.stderr.strip().splitlines()[-1] == (
        "zinfjax: error: process 1 of 2 failed with exit code 1; stopped the others "
        "(its output is above, prefixed [rank 1])"
    )
    assert elapsed < 60, elapsed


def test_bad_config_on_one_rank_stops_the_run(tmp_path):
    script = ("import os, sys; from zinfjax.cli import main; "
              "bad = os.environ['ZINFJAX_PROCESS_ID'] == '1'; "
              f"sys.exit(main(['train', *{RUN!r}, '--set', 'data=' + ('missing.txt' if bad else 'demo')]))")
    start = time.monotonic()
    out = launch(2, sys.executable, "-c", script, cwd=tmp_path)
    assert time.monotonic() - start < 60
    assert out.returncode == 2, out.stdout + out.stderr
    assert "[rank 1] zinfjax: error: no text found at 'missing.txt'" in out.stdout
    assert out.stderr.strip().splitlines()[-1].startswith("zinfjax: error: process 1 of 2 failed with exit code 2;")


def test_launch_gives_each_rank_its_variables_and_names_a_killed_rank(tmp_path):
    # Rank 2 kills itself only once ranks 0 and 1 have printed: the launcher stops them when it sees the kill.
    script = ("import os, signal, time; r = os.environ['ZINFJAX_PROCESS_ID']; "
              "print('rank', r, 'of', os.environ['ZINFJAX_NUM_PROCESSES'], os.environ['ZINFJAX_LOCAL_DEVICES'], "
              "os.environ['ZINFJAX_COORDINATOR'], flush=True); "
              f"open(os.path.join({str(tmp_path)!r}, r), 'w').close(); "
              f"[time.sleep(0.05) for _ in range(2000) if r == '2' and len(os.listdir({str(tmp_path)!r})) < 3]; "
              "r == '2' and os.kill(os.getpid(), signal.SIGKILL)")
    out = launch(3, sys.executable, "-c", script, devices_per_process=5)
    assert out.returncode == 128 + 9
    lines = out.stdout.splitlines()
    for rank in range(3):
        line = next(x for x in lines if x.startswith(f"[rank {rank}] "))
        assert line.split()[2:7] == ["rank", str(rank), "of", "3", "5"]
        assert line.split()[7].startswith("127.0.0.1:")
    assert out.stderr.strip().splitlines()[-1].startswith(
        "zinfjax: error: process 2 of 3 was killed by SIGKILL (exit code -9)")


def test_missing_peer_fails_with_one_line_within_the_connect_timeout():
    env = {"ZINFJAX_COORDINATOR": "127.0.0.1:1", "ZINFJAX_NUM_PROCESSES": "2", "ZINFJAX_PROCESS_ID": "1",
           "ZINFJAX_CONNECT_TIMEOUT": "3"}
    start = time.monotonic()
    out = subprocess.run([*ZINFJAX, "train", *RUN], capture_output=True, text=True, timeout=BOUND_S,
                         env={**os.environ, **env})
    assert time.monotonic() - start < 30
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "zinfjax: error: process 1 of 2: not all 2 processes joined the run at 127.0.0.1:1 within 3 s; "
        "start every rank (`zinfjax launch -n 2` does) or raise ZINFJAX_CONNECT_TIMEOUT"
    ]


def test_launch_refuses_an_empty_command():
    out = run([*ZINFJAX, "launch", "-n", "2", "--"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "zinfjax: error: no command to launch; write it after --, e.g. zinfjax launch -n 2 -- zinfjax train"
    ]
