"""The I/O benchmark runs end to end on a small size and reports every figure."""

import argparse

import pytest

from zinfjax.benchmarks.io import main, parse_size, run_io_bench


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1e6") == 10**6
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte size"):
        parse_size("lots")


def test_io_bench_reports_ratios(tmp_path):
    result = run_io_bench(str(tmp_path), 8 << 20, chunk_bytes=1 << 20, depth=2, cold=False)
    for key in (
        "store_read_GBps",
        "store_write_GBps",
        "raw_read_GBps",
        "raw_write_GBps",
        "read_ratio",
        "write_ratio",
    ):
        assert result[key] > 0
    assert result["store_bytes"] == 8 << 20
    assert "NOT dropped" in result["cache_policy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the bench cleans up after itself


def test_io_bench_cli_prints_json(tmp_path, capsys, monkeypatch):
    import zinfjax.benchmarks.io as io

    monkeypatch.setattr(io, "drop_page_cache", lambda: False)
    assert main(["--dir", str(tmp_path), "--bytes", "4MiB", "--chunk-bytes", "1MiB", "--depth", "1"]) == 0
    assert '"read_ratio"' in capsys.readouterr().out
