import numpy as np
import pytest

from zinfjax.cli import main
from zinfjax.data import Batches, DataError, check_vocab, decode_bytes, demo_corpus, encode_bytes, load_tokens


def test_demo_corpus_is_real_text_that_ships_with_python():
    text = demo_corpus().decode()
    assert len(text) > 300_000
    assert "the" in text.split()[:2000]


def test_byte_tokenizer_round_trips():
    text = "zinfjax streams layers — ünïcode too"
    assert decode_bytes(encode_bytes(text)) == text


def test_ids_past_the_bytes_decode_as_the_replacement_character():
    """A model of a larger vocabulary read by bytes (tokenizer=bytes) may emit ids past 255: no crash."""
    assert decode_bytes([72, 300, 105, -1]) == "H\ufffdi\ufffd"


def test_batches_are_deterministic_and_resumable():
    tokens = load_tokens("demo")
    a = Batches(tokens, 4, 32, seed=3)
    first = [next(a) for _ in range(3)]
    saved = a.state()
    fourth = next(a)
    b = Batches(tokens, 4, 32, seed=0)
    b.restore(saved)
    np.testing.assert_array_equal(next(b), fourth)
    assert first[0].shape == (4, 33) and first[0].dtype == np.int32
    assert not np.array_equal(first[0], first[1])


def test_bin_and_text_loaders(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 300
    ids.tofile(tmp_path / "train.bin")
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "train.bin")), ids)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("hello")
    (tmp_path / "docs" / "b.txt").write_text("world")
    assert decode_bytes(load_tokens(str(tmp_path / "docs"))) == "hello\n\nworld"
    with pytest.raises(DataError, match="vocabulary has 256"):
        check_vocab(ids, 256, "train.bin")


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(DataError, match="no text found"):
        load_tokens(str(tmp_path / "missing*.txt"))
    with pytest.raises(DataError, match="does not exist"):
        load_tokens(str(tmp_path / "none.bin"))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="odd size"):
        load_tokens(str(tmp_path / "odd.bin"))


def test_text_that_is_not_utf8_and_files_of_other_kinds_are_refused_under_bytes_too(tmp_path, capsys):
    """The byte tokenizer reads text as every tokenizer does (docs/data.md, "Bad data"): UTF-8 alone, from the
    files the table names, and a source with text in it. Each is one line from ``zinfjax train``, exit 2."""
    (tmp_path / "noise.txt").write_bytes(b"fine so far " + np.random.default_rng(0).bytes(3000))
    (tmp_path / "blob.dat").write_text("text, but in a file of no kind zinfjax reads")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("")
    (tmp_path / "latin1.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    cases = {"noise.txt": r"text file '.*noise.txt' is not UTF-8 \(byte \d+\)",
             "blob.dat": r"data file '.*blob.dat' is a '.dat' file, which zinfjax does not read; give 'demo'",
             "empty.txt": "empty.txt' holds no text to train on", "docs": "docs' holds no text to train on",
             "latin1.jsonl": r"latin1.jsonl:1 is not UTF-8", "*": r"'.*' file, which zinfjax does not read"}
    for name, message in cases.items():
        with pytest.raises(DataError, match=message):
            load_tokens(str(tmp_path / name))
        assert main(["train", "--quiet", "--set", f"data={tmp_path / name}", "--set", "steps=1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("zinfjax: error: ") and "Traceback" not in err[0], err
