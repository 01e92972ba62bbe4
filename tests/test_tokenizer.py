"""Tokenizers: the fixture tokenizer.json (byte-level BPE, 256 ids) round-trips text; checkpoint directories with
and without tokenizer.json; eos ids from generation_config.json; the UTF-8 byte fallback; malformed files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import jaxgdn
from jaxgdn.tokenizer import ByteTokenizer, Tokenizer, eos_token_ids, load_tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer_tiny" / "tokenizer.json"
TEXTS = ["Hello world!", "The prefill state of a gated delta layer.", "  two  spaces,\ttab and\nnewline ~|{}",
         "def main(argv=None):\n\treturn 0\n", "0123456789 ASCII only: !\"#$%&'()*+,-./:;<=>?@[\\]^_`"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(FIXTURE)


def test_fixture_fits_the_tiny_models(tok):
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 256 == jaxgdn.tiny_qwen3_5().vocab_size
    assert tok.encode("<|endoftext|>") == [1] and tok.decode([0]) == "<unk>"


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(isinstance(t, int) and 0 <= t < 256 for t in ids)
    assert tok.decode(ids) == text
    assert "".join(tok.token_text(t) for t in ids) == text  # byte-level tokens of ASCII text read on their own


def test_bpe_merges_words(tok):
    text = "The prefill state"
    assert len(tok.encode(text)) < len(text)  # merges learnt from the training text shorten it


def test_unknown_characters_become_unk(tok):
    assert 0 in tok.encode("caf\u00e9")  # outside the ASCII alphabet: <unk> (id 0)


def test_checkpoint_directory(tmp_path, tok):
    assert load_tokenizer(tmp_path) is None  # a directory without tokenizer.json
    shutil.copy(FIXTURE, tmp_path / "tokenizer.json")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.eos_token_ids == (1, 0)
    assert loaded.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_eos_ids_from_config(tmp_path):
    assert eos_token_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": 7}}))
    assert eos_token_ids(tmp_path) == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert eos_token_ids(tmp_path) == (3,)  # generation_config.json first


def test_bad_files(tmp_path):
    with pytest.raises(jaxgdn.CheckpointError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(jaxgdn.CheckpointError, match="not a valid tokenizer.json"):
        load_tokenizer(tmp_path)
    bad.write_text(json.dumps({"model": {"type": "NoSuchModel"}}))
    with pytest.raises(jaxgdn.CheckpointError, match="not a valid tokenizer.json"):
        load_tokenizer(bad)
    (tmp_path / "generation_config.json").write_text("{oops")
    shutil.copy(FIXTURE, bad)
    with pytest.raises(jaxgdn.CheckpointError, match="generation_config.json is not valid JSON"):
        load_tokenizer(tmp_path)


def test_byte_tokenizer():
    b = ByteTokenizer()
    text = "na\u00efve \u2014 \U0001F600"
    ids = b.encode(text)
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert b.decode(ids) == text
    assert b.decode([104, 105, 300]) == "hi\ufffd"  # an id beyond 255 decodes as U+FFFD
