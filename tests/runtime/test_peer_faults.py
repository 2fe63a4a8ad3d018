"""Peers that die or hang under another launcher (SLURM, Kubernetes): each process started on its own.

No `zinfjax launch`: every process gets the ``ZINFJAX_*`` variables and is started alone, as a cluster's
launcher starts it, with real jax.distributed over gloo on localhost. One process is killed (SIGKILL) or
stopped (SIGSTOP, a hung peer) mid-step or mid-save; every survivor must exit 1 within the peer timeout
with one line naming the missing process, a save cut short must not be listed, and a resume with both
processes must be bit-identical to an uninterrupted run (zinfjax/runtime/peers.py, docs/sharding.md).
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.xla_flags import child_env
from zinfjax.checkpoint import format as fmt
from zinfjax.runtime.launch import free_port

TIMEOUT = 3  # ZINFJAX_PEER_TIMEOUT of these tests
BOUND_S = 240  # a run that takes longer is hung: the test fails instead of stalling CI
RUN = ["--quiet", "--set", "steps=6", "--set", "seq_len=32", "--set", "batch_size=8", "--set", "seed=3",
       "--set", "stage=3", "--set", "params=nvme", "--set", "optimizer=nvme", "--set", "gradients=nvme",
       "--set", "activations=nvme", "--set", "save_every=2"]

# `zinfjax train`, where process FAULT_RANK kills or stops itself: in the second layer of step FAULT_AT
# (mid-step), or in checkpoint FAULT_AT's background write once its first directory is durable (mid-save).
# It writes the wall-clock time of its fault to FAULT_TIME first.
FAULTY_TRAIN = textwrap.dedent("""
    import os, signal, sys, time
    from zinfjax.checkpoint import snapshot
    from zinfjax.cli import main
    from zinfjax.engine import _step

    fault, at = os.environ.get("FAULT", ""), int(os.environ.get("FAULT_AT", "0"))
    steps, calls, saving = [0], [0], [False]

    def die():
        with open(os.environ["FAULT_TIME"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP if fault.endswith("stop") else signal.SIGKILL)

    def second_call():
        calls[0] += 1
        if calls[0] == 2:
            die()

    def counting(init):
        def wrapped(self, *a, **k):
            steps[0] += 1
            init(self, *a, **k)
        return wrapped

    def in_step(scan_step):
        def wrapped(self, *a, **k):
            if steps[0] == at:
                second_call()
            return scan_step(self, *a, **k)
        return wrapped

    def in_save(write):
        def wrapped(self):
            saving[0] = self.root.endswith(f".tmp-{at}")
            return write(self)
        return wrapped

    def synced(fsync_dir):
        def wrapped(path):
            fsync_dir(path)
            if saving[0]:
                second_call()
        return wrapped

    if fault and os.environ["ZINFJAX_PROCESS_ID"] == os.environ["FAULT_RANK"]:
        if fault.startswith("step"):
            _step.Step.__init__ = counting(_step.Step.__init__)
            _step.Step._scan_step = in_step(_step.Step._scan_step)
        else:
            snapshot.Snapshot.write = in_save(snapshot.Snapshot.write)
            snapshot.fsync_dir = synced(snapshot.fsync_dir)
    sys.exit(main(sys.argv[1:]))
""")

# Both processes meet; then FAULT_RANK kills or stops itself while the other waits for it in a collective.
FAULTY_COLLECTIVE = textwrap.dedent("""
    import os, signal, time
    from jax.experimental import multihost_utils
    from zinfjax.runtime.distributed import initialize_from_env
    initialize_from_env()
    multihost_utils.sync_global_devices("both here")
    if os.environ["ZINFJAX_PROCESS_ID"] == os.environ["FAULT_RANK"]:
        with open(os.environ["FAULT_TIME"], "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP if os.environ["FAULT"] == "stop" else signal.SIGKILL)
    multihost_utils.sync_global_devices("the other never comes")
    print("unreachable: the collective returned", flush=True)
""")


def start_ranks(tmp_path, argv, count=2, peer_timeout=TIMEOUT, **fault):
    """``count`` processes started one by one, each with its own variables, as SLURM or a Kubernetes job would."""
    port, procs = free_port(), []
    for rank in range(count):
        env = child_env()  # the tests' compile flags, and no forced device count: ZINFJAX_LOCAL_DEVICES decides
        env.update({"ZINFJAX_COORDINATOR": f"127.0.0.1:{port}", "ZINFJAX_NUM_PROCESSES": str(count),
                    "ZINFJAX_PROCESS_ID": str(rank), "ZINFJAX_LOCAL_DEVICES": "2",
                    "ZINFJAX_PEER_TIMEOUT": str(peer_timeout), "FAULT_TIME": str(tmp_path / "fault_time"),
                    **{k.upper(): str(v) for k, v in fault.items()}})
        env.pop("ZINFJAX_FAILURES", None)
        procs.append(subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    return procs


def finish(procs, tmp_path, victim=None):
    """Waits for every process but ``victim`` (killed at the end if stopped); returns their (rc, stderr lines,
    seconds from the fault to their exit)."""
    deadline, ended = time.monotonic() + BOUND_S, {}
    try:
        while len(ended) < len(procs) - (victim is not None):
            for rank, p in enumerate(procs):
                if rank != victim and rank not in ended and p.poll() is not None:
                    ended[rank] = time.time()
            assert time.monotonic() < deadline, "a surviving process hung"
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    fault = float((tmp_path / "fault_time").read_text()) if victim is not None else None
    results = {}
    for rank, p in enumerate(procs):
        _, err = p.communicate(timeout=30)
        if rank != victim:
            results[rank] = (p.returncode, err.strip().splitlines(), ended[rank] - fault if fault else None)
    return results


def line(missing, count, survivor, age=TIMEOUT, timeout=TIMEOUT):
    return (f"zinfjax: error: process {missing} of {count} stopped responding (no heartbeat for {age} s); "
            f"stopping process {survivor} (the limit is ZINFJAX_PEER_TIMEOUT={timeout} s)")


def check_one_line(results, missing, count, quick=False):
    """``quick``: a killed peer whose collective failed, named before the timeout; False: a hung one, named at the
    timeout; None: either (a peer killed mid-save, while the others may be between collectives)."""
    for rank, (rc, err, seconds) in results.items():
        print(f"process {rank}: exit {rc} {seconds:.1f} s after the fault: {err[-1] if err else ''!r}")
        assert rc == 1, err
        assert err, "no line"
        age = err[-1].split("no heartbeat for ")[1].split(" s)")[0]
        assert err[-1] == line(missing, count, rank, age=age), err[-1]
        assert int(age) >= (TIMEOUT if quick is False else 0)
        assert not [x for x in err if "Traceback" in x or "internal error" in x or x.startswith(("F0", "E0"))], err
        assert seconds < (TIMEOUT if quick else 2 * TIMEOUT + 5), seconds  # ours, long before XLA's (peers.py)


@pytest.mark.parametrize(("count", "missing"), [(2, 0), pytest.param(3, 1, marks=pytest.mark.wide)])
def test_hung_peer_stops_the_others_blocked_in_a_collective(tmp_path, count, missing):
    """A stopped process (0, which holds the coordination service; or 1 of 3) while the others are blocked in a
    collective on it: the watchdog's threads run, the main thread waiting in C without the GIL. Of 3, process 2
    says so too, though process 0's exit takes the coordination service away (its verdict is read first)."""
    procs = start_ranks(tmp_path, [sys.executable, "-c", FAULTY_COLLECTIVE], count=count, fault="stop",
                        fault_rank=missing)
    check_one_line(finish(procs, tmp_path, victim=missing), missing, count)


def test_killed_peer_is_named_as_soon_as_its_collective_fails(tmp_path):
    """SIGKILL: the peer is named well before XLA's own heartbeat abort (2 x timeout + 30 s, peers.py): after a few
    missed heartbeats where the collective fails at once (gloo: connection closed by peer), and at the latest at the
    watchdog's timeout, where it does not (a loaded machine: clean-clone CI saw 33 s with the timeout at 30)."""
    procs = start_ranks(tmp_path, [sys.executable, "-c", FAULTY_COLLECTIVE], count=3, peer_timeout=30,
                        fault="kill", fault_rank=2)
    results = finish(procs, tmp_path, victim=2)
    for rank, (rc, err, seconds) in results.items():
        print(f"process {rank}: exit {rc} {seconds:.1f} s after the fault: {err[-1] if err else ''!r}")
        assert rc == 1 and err[-1].startswith("zinfjax: error: process 2 of 3 stopped responding (no heartbeat for ")
        assert err[-1].endswith(f"stopping process {rank} (the limit is ZINFJAX_PEER_TIMEOUT=30 s)")
        assert seconds < 30 + 10, seconds


def test_bad_peer_timeout_is_one_line(tmp_path):
    env = {**child_env(), "ZINFJAX_COORDINATOR": f"127.0.0.1:{free_port()}", "ZINFJAX_NUM_PROCESSES": "2",
           "ZINFJAX_PROCESS_ID": "0", "ZINFJAX_PEER_TIMEOUT": "soon"}
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", "train", "--quiet", "--set", "steps=1"], env=env,
                         capture_output=True, text=True, timeout=BOUND_S, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["zinfjax: error: ZINFJAX_PEER_TIMEOUT='soon' must be an integer >= 1"]


# ---- training on NVMe, checkpoints every 2 steps ---------------------------------------------------------


def train(tmp_path, directory, *extra, **fault):
    args = [*RUN, "--set", f"nvme_path={directory / 'nvme'}", "--set", f"save_dir={directory / 'ckpt'}",
            "--set", f"log={directory / 'log.json'}", *extra]
    script = tmp_path / "faulty_train.py"
    script.write_text(FAULTY_TRAIN)
    return start_ranks(tmp_path, [sys.executable, str(script), "train", *args], **fault)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Both processes for 6 steps, no fault: the losses and the checkpoint of step 6 to match."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    results = finish(train(tmp, tmp), tmp)
    assert all(rc == 0 for rc, _, _ in results.values()), results
    return tmp


CASES = {  # name: (fault, its step, the process it strikes, the checkpoints left complete, and one that may be)
    "kill mid-step": ("step", 5, 1, [2], 4),  # checkpoint 4 is written in the background during step 5
    "kill mid-save": ("save", 4, 1, [2], None),
    "stop mid-step": ("stepstop", 5, 1, [2], 4),
}


@pytest.mark.slow
def test_hung_peer_in_training_stops_the_run(tmp_path):
    """make test's case: process 1 stopped mid-step on NVMe; process 0 stops within the timeout, one line."""
    run_case(tmp_path, "stop mid-step", resume=False)


@pytest.mark.slow
@pytest.mark.wide
@pytest.mark.parametrize("case", list(CASES))
def test_fault_in_training_then_resume_is_bit_identical(tmp_path, uninterrupted, case):
    run_case(tmp_path, case, resume=True, reference=uninterrupted)


def run_case(tmp_path, case, resume, reference=None):
    fault, at, victim, complete, maybe = CASES[case]
    results = finish(train(tmp_path, tmp_path, fault=fault, fault_at=at, fault_rank=victim), tmp_path, victim)
    check_one_line(results, victim, 2, quick={"step": True, "save": None}.get(fault, False))
    ckpt = tmp_path / "ckpt"
    listed = fmt.complete_steps(str(ckpt))
    if maybe in listed:  # its commit finished before the fault
        complete = [*complete, maybe]
    assert listed == complete  # a save cut short on any process is never listed
    assert maybe in listed or not maybe or (ckpt / f".tmp-{maybe}").exists(), sorted(os.listdir(ckpt))
    out = subprocess.run([sys.executable, "-m", "zinfjax.cli", "ckpt", "info", str(ckpt)], capture_output=True,
                         text=True, env=child_env(), timeout=BOUND_S)
    info = next((x for x in out.stdout.splitlines() if x.startswith("steps:")), "steps: none")
    print(f"{case}: zinfjax ckpt info: {info}; in {ckpt}: {sorted(os.listdir(ckpt))}")
    assert info == "steps: " + ", ".join(map(str, complete)), out.stdout + out.stderr
    if not resume:
        return
    (tmp_path / "fault_time").unlink()
    results = finish(train(tmp_path, tmp_path, "--set", "resume=true"), tmp_path)
    assert all(rc == 0 for rc, _, _ in results.values()), results
    check_bit_identical(reference, tmp_path, first=complete[-1] + 1)


def check_bit_identical(reference, resumed, first):
    want = json.loads((reference / "log.json").read_text())["steps"]
    got = json.loads((resumed / "log.json").read_text())["steps"]
    assert [s["step"] for s in got] == list(range(first, 7))
    assert [s["loss"] for s in got] == [s["loss"] for s in want][first - 1:]  # bit for bit
    a, b = reference / "ckpt" / "6", resumed / "ckpt" / "6"
    files = sorted(os.path.relpath(os.path.join(r, f), a) for r, _, fs in os.walk(a) for f in fs if f != "zinfjax.json")
    assert files and files == sorted(os.path.relpath(os.path.join(r, f), b) for r, _, fs in os.walk(b)
                                     for f in fs if f != "zinfjax.json")
    different = [f for f in files if (a / f).read_bytes() != (b / f).read_bytes()]
    assert not different, different  # parameters and optimizer state, chunk for chunk
    print(f"resumed from step {first - 1}: losses of steps {first}..6 and the {len(files)} files of checkpoint 6 "
          "are bit-identical to the uninterrupted run")
