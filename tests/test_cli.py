import dataclasses
import json
import re
import subprocess
import sys

from tests.support.xla_flags import child_env


def zinfjax(*args, **kw):
    """``zinfjax`` in a child process with one CPU device, as a user's (not the test process's 8, on which the default
    mesh would train data-parallel: the CLI's wiring is what these tests check)."""
    return subprocess.run([sys.executable, "-m", "zinfjax.cli", *args], capture_output=True, text=True,
                          env=child_env(), **kw)


def test_help_explains_every_option():
    """`zinfjax train --help` has a row for every `Config` field, each with its explanation and default."""
    from zinfjax.config import KEY_DOCS, Config

    out = zinfjax("train", "--help")
    assert out.returncode == 0, out.stderr
    _, found, section = out.stdout.partition("config keys (set in the config file or with --set key=value):\n")
    assert found, "zinfjax train --help has no section of config keys"
    rows = {}
    for line in section.split("\n\n")[0].splitlines():
        row = re.fullmatch(r"  (\w+) +(.*?) *\(default: (.*)\)", line)
        assert row, f"not a config key's row: {line!r}"
        key, text, default = row.groups()
        assert key not in rows, f"{key} is explained twice"
        rows[key] = text, default
    names = [f.name for f in dataclasses.fields(Config)]
    assert sorted(rows) == sorted(names), (
        f"keys without a row: {sorted(set(names) - set(rows))}; rows of no key: {sorted(set(rows) - set(names))}")
    for f in dataclasses.fields(Config):
        text, default = rows[f.name]
        assert re.search(r"[a-z]{2}", text), f"{f.name} has no explanation in zinfjax train --help (KEY_DOCS)"
        assert default == repr(f.default), f"{f.name}: help says default {default}, Config has {f.default!r}"
    assert not set(KEY_DOCS) - set(names), f"KEY_DOCS explains keys Config lacks: {sorted(set(KEY_DOCS) - set(names))}"
    assert "train" in zinfjax("--help").stdout


def test_user_mistakes_print_one_line_without_traceback():
    out = zinfjax("train", "--set", "stage=9")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == ["zinfjax: error: stage=9 is not allowed; use 0, 1, 2 or 3"]
    out = zinfjax("train", "missing.yaml")
    assert out.returncode == 2 and "Traceback" not in out.stderr and "does not exist" in out.stderr


def test_a_user_mistake_found_while_running_prints_one_line_and_exits_2(capsys):
    from zinfjax.cli import main

    assert main(["train", "--quiet", "--set", "model=gpt5", "--set", "steps=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zinfjax: error: unknown model 'gpt5'; choose one of gpt2-tiny")


def test_an_internal_error_prints_a_short_report_and_writes_the_traceback_to_a_file(tmp_path, monkeypatch, capsys):
    import tempfile

    import zinfjax.training.loop
    from zinfjax.cli import main

    def broken(*args, **kwargs):
        raise RuntimeError("the engine lost a layer\nsecond line")

    monkeypatch.setattr(zinfjax.training.loop, "run", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["train", "--quiet", "--set", "steps=1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "zinfjax: internal error: RuntimeError: the engine lost a layer"
    assert len(err) == 2 and "bug in zinfjax" in err[1] and "Traceback" not in err[1]
    path = err[1].rsplit(" ", 1)[1]
    assert path.startswith(str(tmp_path)) and "zinfjax-traceback-" in path
    text = open(path).read()
    assert "Traceback (most recent call last)" in text and "RuntimeError: the engine lost a layer" in text
    assert "in broken" in text


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


def test_train_tokenizer_errors_name_what_train_takes(tmp_path, capsys):
    """A tokenizer that cannot serve a run says what ``zinfjax train`` takes (tokenizer=..., .bin data), not
    generate's --prompt-ids."""
    from zinfjax.cli import main

    small = tmp_path / "small.yaml"  # gpt2-tiny with a vocabulary of 97: too small for bytes
    small.write_text("arch: gpt2\nvocab_size: 97\nmax_seq_len: 64\nd_model: 32\nn_layers: 1\nn_heads: 2\nd_ff: 64\n")
    cases = [(["tokenizer=nope"], "unknown tokenizer 'nope': give tokenizer=bytes or tokenizer=DIR"),
             ([f"model={small}"], "the byte tokenizer needs a vocabulary of 256; this model has 97: give "
                                  "tokenizer=DIR (its Hugging Face tokenizer) or pre-tokenized data (a .bin file)")]
    for sets, message in cases:
        assert main(["train", "--quiet", "--set", "steps=1", *[a for s in sets for a in ("--set", s)]]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0] and "--prompt-ids" not in err[0], err
