"""Fine-tuning a converted model on real text through the CLI: its own tokenizer, text files, JSON Lines,
Parquet and datasets directories (`zinfjax.data.corpus`, `zinfjax.data.tokenizers`).

The tokenizer is a byte-level BPE trained with ``tokenizers`` (tests/support/hf_text.py; nothing is
downloaded) and saved beside a tiny Hugging Face GPT-2, as a model from the Hub comes. ``zinfjax convert``
keeps it beside the converted model; ``zinfjax train`` then feeds the model the ids that ``AutoTokenizer``
gives for the same text, each document followed by the end-of-text token.
"""

import json
import os

import numpy as np
import pytest

from tests.support.hf_text import DOCS, TEXT, bpe_tokenizer, converted_gpt2
from zinfjax.checkpoint.tokenizer import keep_tokenizer, model_tokenizer
from zinfjax.cli import main
from zinfjax.data import DataError, corpus, load_tokens
from zinfjax.data.tokenizers import HFTokenizer


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny HF GPT-2 with its tokenizer, converted by ``zinfjax convert``."""
    root = tmp_path_factory.mktemp("hf")
    out, tok = converted_gpt2(root)
    hf = root / "gpt2"
    assert sorted(os.listdir(out / "tokenizer")) == sorted(f for f in os.listdir(hf) if f.startswith(("tok", "spec")))
    return out, tok


def expected(tok, texts) -> list[int]:
    return [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]


def train(model, data, tmp_path, *extra) -> dict:
    log = tmp_path / f"log-{os.path.basename(str(data))}.json"
    argv = ["train", "--quiet", "--set", f"model={model}", "--set", f"data={data}", "--set", "steps=2",
            "--set", "batch_size=8", "--set", "seq_len=16", "--set", f"log={log}"]
    assert main(argv + [a for s in extra for a in ("--set", s)]) == 0
    return json.loads(log.read_text())


def fed(log) -> np.ndarray:
    assert log["data"]["token_file"], log["data"]
    return np.fromfile(log["data"]["token_file"], np.uint16)


def test_a_converted_model_trains_on_text_and_jsonl_tokenized_as_its_tokenizer_does(converted, tmp_path):
    out, tok = converted
    (tmp_path / "notes.txt").write_text(TEXT)
    (tmp_path / "notes.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(DOCS)))

    log = train(out, tmp_path / "notes.txt", tmp_path)
    assert log["data"]["tokenizer"] == str(out / "tokenizer")
    np.testing.assert_array_equal(fed(log), expected(tok, [TEXT]))
    assert all(np.isfinite(s["loss"]) for s in log["steps"])

    log = train(out, tmp_path / "notes.jsonl", tmp_path)
    np.testing.assert_array_equal(fed(log), expected(tok, DOCS))
    assert log["data"]["tokens"] == len(expected(tok, DOCS))


def test_tokens_are_cached_by_the_data_and_the_tokenizer(converted, tmp_path):
    out, _ = converted
    path = tmp_path / "notes.txt"
    path.write_text(TEXT)
    first = load_tokens(str(path), HFTokenizer(str(out / "tokenizer")))
    stamp = os.stat(first.filename).st_mtime_ns
    again = load_tokens(str(path), HFTokenizer(str(out / "tokenizer")))
    assert again.filename == first.filename and os.stat(again.filename).st_mtime_ns == stamp  # read, not redone
    other = tmp_path / "other-tokenizer"
    bpe_tokenizer(other, vocab=300)
    assert load_tokens(str(path), HFTokenizer(str(other))).filename != first.filename
    path.write_text(TEXT + "one more line\n")
    changed = load_tokens(str(path), HFTokenizer(str(out / "tokenizer")))
    assert changed.filename != first.filename and len(changed) > len(first)
    assert os.path.dirname(first.filename) == str(tmp_path / corpus.CACHE_DIR)


def test_text_read_in_pieces_is_tokenized_as_the_whole(converted, tmp_path, monkeypatch):
    """Pieces are cut where a line starts with a non-space character, where a byte-level BPE splits anyway."""
    out, tok = converted
    path = tmp_path / "notes.txt"
    path.write_text(TEXT)
    monkeypatch.setattr(corpus, "PIECE", 97)  # dozens of pieces, cut inside runs of blank lines and indents
    pieces = list(corpus.documents(str(path)))
    assert len(pieces) > 20 and "".join(p for p, _ in pieces) == TEXT
    np.testing.assert_array_equal(load_tokens(str(path), HFTokenizer(str(out / "tokenizer"))),
                                  expected(tok, [TEXT]))


def test_parquet_and_a_datasets_directory_give_the_jsonl_tokens(converted, tmp_path):
    datasets = pytest.importorskip("datasets")
    out, tok = converted
    table = datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))})
    table.to_parquet(str(tmp_path / "notes.parquet"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "notes-ds"))
    hf = HFTokenizer(str(out / "tokenizer"))
    for source in ("notes.parquet", "notes-ds"):
        tokens = load_tokens(str(tmp_path / source), hf, field="body")
        np.testing.assert_array_equal(tokens, expected(tok, DOCS), err_msg=source)
    with pytest.raises(DataError, match=r"has no column 'text' \(it has: body, n\); set data_field"):
        load_tokens(str(tmp_path / "notes.parquet"), hf)


def test_bad_text_data_is_refused_in_one_line(converted, tmp_path, capsys):
    out, _ = converted
    (tmp_path / "rows.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "big-vocab").mkdir()
    bpe_tokenizer(tmp_path / "big-vocab", vocab=400)
    cases = [
        ([f"model={out}", f"data={tmp_path / 'rows.jsonl'}"], r"rows.jsonl:2 has no field 'text' \(it has: body\)"),
        ([f"model={out}", f"data={tmp_path / 'latin1.txt'}"], "latin1.txt' is not UTF-8"),
        ([f"model={out}", f"data={tmp_path / 'rows.jsonl'}", f"tokenizer={tmp_path / 'big-vocab'}"],
         "tokens but the model's vocabulary has"),
    ]
    for sets, message in cases:
        assert main(["train", "--quiet"] + [a for s in sets for a in ("--set", s)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("zinfjax: error:") and "\n" not in err and "Traceback" not in err, err
        assert __import__("re").search(message, err), err
    bare = tmp_path / "bare"
    (bare / "0").mkdir(parents=True)
    with pytest.raises(DataError, match="no tokenizer beside it"):
        model_tokenizer(None, str(bare), 50257)


def test_an_empty_source_says_its_error_alone(converted, tmp_path, capsys):
    """No progress line for a source without text (an empty file is no document: no end-of-text token alone)."""
    out, _ = converted
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--set", f"model={out}", "--set", f"data={empty}", "--set", "steps=1"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"zinfjax: error: '{empty}' holds no text to train on"]


def test_a_run_keeps_the_tokenizer_it_was_trained_with_beside_its_checkpoints(converted, tmp_path):
    """`keep_tokenizer`: a fine-tune saved elsewhere than its model keeps the model's tokenizer (or the one given
    as tokenizer=DIR) in <save_dir>/tokenizer; none is kept where one is found beside the save_dir already, nor for
    bytes."""
    out, _ = converted
    kept = keep_tokenizer(str(tmp_path / "run"), str(out), None)
    assert kept == str(tmp_path / "run" / "tokenizer")
    assert model_tokenizer(None, str(tmp_path / "run"), 320).name == kept  # what evaluate and generate then take
    assert keep_tokenizer(str(out), str(out), None) is None  # saved where the model is: found there already
    assert keep_tokenizer(str(tmp_path / "named"), "gpt2-tiny", None) is None  # a named size: bytes
    assert keep_tokenizer(str(tmp_path / "bytes"), str(out), "bytes") is None
    given = keep_tokenizer(str(tmp_path / "given"), "gpt2-tiny", str(out / "tokenizer"))
    assert sorted(os.listdir(given)) == sorted(os.listdir(out / "tokenizer"))
