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


@pytest.mark.parametrize("path", [None, 3, b"/tmp"])
def test_a_path_that_is_no_path_is_an_input_error(path):
    with pytest.raises(jaxgdn.InputError, match="path must be a checkpoint directory or a tokenizer.json"):
        load_tokenizer(path)


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


def test_byte_decode_keeps_valid_utf8_around_bad_ids():
    b = ByteTokenizer()
    assert b.decode([0xC3, 0xA9, 300]) == "\u00e9\ufffd"  # the valid run still decodes as UTF-8
    assert b.decode([-1, 65]) == "\ufffdA"  # a negative id reads as U+FFFD too
    assert b.decode([0xC3, 0xA9, 256, 0xC3, 0xA9]) == "\u00e9\ufffd\u00e9"
    assert b.decode([0xC3, 300, 0xA9]) == "\ufffd\ufffd\ufffd"  # a bad id splits the character: broken UTF-8
    assert b.decode([]) == ""


def test_hf_decode_out_of_range_ids(tok):
    ids = tok.encode("Hello world")
    assert tok.decode([-1]) == "\ufffd"
    assert tok.decode([tok.vocab_size]) == "\ufffd"
    assert tok.decode(ids + [tok.vocab_size + 1000] + ids) == "Hello world\ufffdHello world"
    assert tok.decode([-5] + ids) == "\ufffdHello world"
    assert tok.token_text(-1) == "\ufffd"


@pytest.mark.parametrize("ids, match", [
    ([1.5], "token id 0 is not an integer"),
    ([65, "6"], "token id 1 is not an integer"),
    ([True], "token id 0 is not an integer"),
    ("65", "token ids must be a sequence of integers"),
    (5, "token ids must be a sequence of integers"),
])
def test_decode_non_integer_ids(tok, ids, match):
    for t in (tok, ByteTokenizer()):
        with pytest.raises(jaxgdn.InputError, match=match):
            t.decode(ids)


def test_decode_accepts_numpy_ids(tok):
    import numpy as np
    ids = tok.encode("Hello")
    assert tok.decode(np.array(ids, np.int32)) == "Hello" == tok.decode([np.int64(t) for t in ids])
    assert ByteTokenizer().decode(np.array([104, 105], np.uint8)) == "hi"


@pytest.mark.parametrize("text", [b"hi", 5, None])
def test_encode_needs_a_str(tok, text):
    for t in (tok, ByteTokenizer()):
        with pytest.raises(jaxgdn.InputError, match="text to encode must be a str"):
            t.encode(text)


@pytest.mark.parametrize("content, match", [
    ([1, 2], r"generation_config.json must hold a JSON object"),
    ({"eos_token_id": [[1]]}, r"generation_config.json: eos_token_id must be an integer or a list of integers"),
    ({"eos_token_id": 2.7}, r"generation_config.json: eos_token_id must be an integer or a list of integers; got 2.7"),
    ({"eos_token_id": "2"}, r"eos_token_id must be an integer or a list of integers"),
    ({"eos_token_id": True}, r"eos_token_id must be an integer or a list of integers; got true"),
    ({"eos_token_id": [1, 2.0]}, r"eos_token_id must be an integer or a list of integers"),
    ({"text_config": {"eos_token_id": {"a": 1}}}, r"text_config\.eos_token_id must be an integer"),
    ({"text_config": [1]}, r"text_config must be a JSON object"),
])
def test_malformed_eos_ids(tmp_path, content, match):
    (tmp_path / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(jaxgdn.CheckpointError, match=match):
        eos_token_ids(tmp_path)
    shutil.copy(FIXTURE, tmp_path / "tokenizer.json")
    with pytest.raises(jaxgdn.CheckpointError, match=match):
        load_tokenizer(tmp_path)


def test_eos_ids_valid_forms(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None, "text_config": None}))
    assert eos_token_ids(tmp_path) == ()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert eos_token_ids(tmp_path) == (2, 5)  # generation_config.json names none: config.json's


def test_a_tokenizer_json_that_is_a_directory_is_an_error(tmp_path):
    """A checkpoint whose tokenizer.json is a directory (a botched download or copy) read as "no tokenizer"."""
    (tmp_path / "tokenizer.json").mkdir()
    with pytest.raises(jaxgdn.CheckpointError, match="tokenizer.json is not a file"):
        load_tokenizer(tmp_path)
    (tmp_path / "empty").mkdir()
    assert load_tokenizer(tmp_path / "empty") is None  # no tokenizer.json at all: None, as before
