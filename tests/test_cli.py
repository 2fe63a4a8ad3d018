import json
import subprocess
import sys


def zinfjax(*args, **kw):
    return subprocess.run([sys.executable, "-m", "zinfjax.cli", *args], capture_output=True, text=True, **kw)


def test_help_explains_every_option():
    out = zinfjax("train", "--help")
    assert out.returncode == 0
    for key in ("stage", "nvme_path", "prefetch_depth", "host_buffer_bytes", "grad_accum", "mesh", "log"):
        assert key in out.stdout
    assert "train" in zinfjax("--help").stdout


def test_user_mistakes_print_one_line_without_traceback():
    out = zinfjax("train", "--set", "stage=9")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["zinfjax: error: stage=9 is not allowed; use 0, 1, 2 or 3"]
    out = zinfjax("train", "missing.yaml")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "does not exist" in out.stderr


def test_train_writes_log_and_loss_curve(tmp_path):
    log = tmp_path / "run.json"
    out = zinfjax("train", "--quiet", "--set", "steps=3", "--set", "seq_len=32", "--set", f"log={log}")
    assert out.returncode == 0, out.stderr
    data = json.loads(log.read_text())
    assert [s["step"] for s in data["steps"]] == [1, 2, 3]
    assert data["config"]["steps"] == 3 and data["steps"][0]["tokens_per_s"] > 0
    assert (tmp_path / "run.png").exists()


def test_train_trace_writes_perfetto_json_and_timeline_png(tmp_path):
    trace = tmp_path / "trace.json"
    out = zinfjax("train", "--quiet", "--set", "steps=2", "--set", "seq_len=32", "--set", "params=nvme",
                  "--set", f"nvme_path={tmp_path / 'nv'}", "--trace", str(trace))
    assert out.returncode == 0, out.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    assert (tmp_path / "trace.png").stat().st_size > 1000
