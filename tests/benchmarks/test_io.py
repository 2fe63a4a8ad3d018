"""The I/O benchmark runs end to end on a small size and reports every figure."""

import argparse
import statistics
import time
import types

import pytest

from zinfjax.benchmarks.io import main, parse_size, run_io_bench


def test_parse_size():
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1e6") == 10**6
    with pytest.raises(argparse.ArgumentTypeError, match="not a byte size"):
        parse_size("lots")


PLACES = 4  # the report rounds every figure to 4 decimal places
HALF = 0.5 * 10**-PLACES
FIGURES = ("store_read_GBps", "store_write_GBps", "raw_read_GBps", "raw_write_GBps", "read_ratio", "write_ratio")


def assert_quotient(report, ratio, num, den):
    """``report[ratio]`` is ``report[num] / report[den]``, up to the rounding of all three to PLACES decimals."""
    n, d, r = report[num], report[den], report[ratio]
    assert d > HALF, f"{den}={d} is too small to check {ratio} against"
    lo, hi = (n - HALF) / (d + HALF) - HALF, (n + HALF) / (d - HALF) + HALF
    assert lo <= r <= hi, f"{ratio}={r} is not {num}/{den} = {n}/{d} = {n / d:.6f}"


def test_io_bench_reports_ratios(tmp_path):
    nbytes, chunk_bytes, depth = 8 << 20, 1 << 20, 2
    t0 = time.perf_counter()
    result = run_io_bench(str(tmp_path), nbytes, chunk_bytes=chunk_bytes, depth=depth, cold=False)
    wall_s = time.perf_counter() - t0
    for key in FIGURES:
        assert result[key] > 0
    # The ratios are the store's throughput over the disk's, from the figures the same report gives.
    assert_quotient(result, "read_ratio", "store_read_GBps", "raw_read_GBps")
    assert_quotient(result, "write_ratio", "store_write_GBps", "raw_write_GBps")
    # The bytes are what the benchmark was asked to move: whole chunks of chunk_bytes, nbytes in all.
    assert result["bytes"] == nbytes and result["chunk_bytes"] == chunk_bytes and result["prefetch_depth"] == depth
    assert result["layers"] == nbytes // chunk_bytes
    assert result["store_bytes"] == result["layers"] * chunk_bytes == nbytes
    # GB/s of bytes moved: each phase moved nbytes, so its seconds are nbytes / (GB/s x 1e9); the four
    # phases were timed one after another inside the call, so together they took no longer than it.
    phase_s = [nbytes / (result[key] * 1e9) for key in FIGURES[:4]]
    assert sum(phase_s) <= wall_s, f"{FIGURES[:4]} imply {phase_s} s, more than the {wall_s:.3f} s the run took"
    assert result["rounds"] is None and result["statistic"] == "one round"
    assert "NOT dropped" in result["cache_policy"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the bench cleans up after itself


def test_io_bench_figures_are_bytes_over_clock_seconds(tmp_path, monkeypatch):
    """On a clock that says how long each phase took, each figure is bytes / seconds / 1e9 and each ratio
    the disk's seconds over the store's; with two rounds, the figures are the medians of the rounds'."""
    import zinfjax.benchmarks.io as io
    import zinfjax.store.probe as probe

    nbytes, chunk_bytes = 8 << 20, 1 << 20
    # seconds of (raw write, raw read, store write, store read), the order each round measures them in
    rounds = [(0.001, 0.002, 0.005, 0.004), (0.002, 0.001, 0.004, 0.008)]
    stamps, t = [], 100.0
    for seconds in rounds:
        for s in seconds:
            stamps += [t, t + s]
            t += s + 1.0
    clock = iter(stamps)
    fake_time = types.SimpleNamespace(perf_counter=lambda: next(clock))
    monkeypatch.setattr(io, "time", fake_time)
    monkeypatch.setattr(probe, "time", fake_time)

    result = run_io_bench(str(tmp_path), nbytes, chunk_bytes=chunk_bytes, depth=1, cold=False, rounds=len(rounds))
    assert next(clock, None) is None, "the benchmark no longer reads the clock twice per phase, raw first"

    def expected(raw_w, raw_r, store_w, store_r):
        return {
            "raw_write_GBps": nbytes / raw_w / 1e9,
            "raw_read_GBps": nbytes / raw_r / 1e9,
            "store_write_GBps": nbytes / store_w / 1e9,
            "store_read_GBps": nbytes / store_r / 1e9,
            "write_ratio": raw_w / store_w,
            "read_ratio": raw_r / store_r,
        }

    per_round = [expected(*seconds) for seconds in rounds]
    assert len(result["rounds"]) == len(rounds)
    for got, want in zip(result["rounds"], per_round, strict=True):
        assert got["store_bytes"] == nbytes
        for key in FIGURES:
            assert got[key] == pytest.approx(want[key], abs=HALF), key
    for key in FIGURES:
        median = statistics.median(w[key] for w in per_round)
        assert result[key] == pytest.approx(median, abs=2 * HALF), key


def test_io_bench_cli_prints_json(tmp_path, capsys, monkeypatch):
    import zinfjax.benchmarks.io as io

    monkeypatch.setattr(io, "drop_page_cache", lambda: False)
    assert main(["--dir", str(tmp_path), "--bytes", "4MiB", "--chunk-bytes", "1MiB", "--depth", "1"]) == 0
    assert '"read_ratio"' in capsys.readouterr().out
