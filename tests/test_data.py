import numpy as np
import pytest

from zinfjax.data import Batches, DataError, check_vocab, decode_bytes, demo_corpus, encode_bytes, load_tokens


def test_demo_corpus_is_real_text_that_ships_with_python():
    text = demo_corpus().decode()
    assert len(text) > 300_000
    assert "the" in text.split()[:2000]


def test_byte_tokenizer_round_trips():
    text = "zinfjax streams layers — ünïcode too"
    assert decode_bytes(encode_bytes(text)) == text


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
