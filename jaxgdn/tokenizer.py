"""Text <-> token ids, for the CLI and scripts. The library API itself takes and returns token ids.

    tok = jaxgdn.tokenizer.load_tokenizer("path/to/Qwen3.5-9B")  # its tokenizer.json (None when absent)
    ids = tok.encode("Hello")
    text = tok.decode(ids)

A checkpoint directory's `tokenizer.json` is read with Hugging Face `tokenizers` (the `tools` extra). Its end-of-
sequence ids come from `generation_config.json` or `config.json` (`eos_token_id`, an int or a list), for use as
default stop tokens. `ByteTokenizer` (UTF-8 bytes as ids 0..255) is the fallback for the embedded tiny models,
whose vocabulary is exactly 256.

Both classes decode alike: an id outside [0, vocab_size) (negative ones included) reads as one U+FFFD, and each run
of valid ids between such ids is decoded on its own, so the text around a bad id survives. An id that is not an
integer (a float, a string, a bool) raises `InputError`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Sequence


from .errors import CheckpointError, InputError, JaxGDNError, index_value, is_int

TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT = "\ufffd"


def _token_ids(ids) -> list[int]:
    """`ids` as Python ints; raises InputError for a string or an id that is not an integer."""
    if isinstance(ids, (str, bytes)):
        raise InputError(f"token ids must be a sequence of integers; got {type(ids).__name__} {ids!r:.60}")
    try:
        items = list(ids)
    except TypeError:
        raise InputError(f"token ids must be a sequence of integers; got {ids!r:.60}") from None
    out = []
    for i, t in enumerate(items):
        try:
            out.append(index_value(t))
        except TypeError:
            raise InputError(f"token id {i} is not an integer: {t!r:.60}") from None
    return out


def _check_text(text) -> None:
    if not isinstance(text, str):
        raise InputError(f"text to encode must be a str; got {type(text).__name__}")


def _decode_runs(ids: list[int], vocab_size: int, decode_run: Callable[[list[int]], str]) -> str:
    """Decode each run of ids in [0, vocab_size) with `decode_run`; every id outside it reads as one U+FFFD."""
    if all(0 <= t < vocab_size for t in ids):
        return decode_run(ids)
    parts: list[str] = []
    run: list[int] = []
    for t in ids:
        if 0 <= t < vocab_size:
            run.append(t)
            continue
        if run:
            parts.append(decode_run(run))
            run = []
        parts.append(REPLACEMENT)
    if run:
        parts.append(decode_run(run))
    return "".join(parts)


class Tokenizer:
    """A Hugging Face `tokenizers.Tokenizer` (from tokenizer.json) behind a small encode/decode interface."""

    def __init__(self, backend, name: str = "tokenizer.json", eos_token_ids: Sequence[int] = ()):
        self._tok = backend
        self.name = name
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    @classmethod
    def from_file(cls, path, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"no tokenizer file at {path}")
        try:
            from tokenizers import Tokenizer as HFTokenizer
        except ImportError:
            raise JaxGDNError("reading tokenizer.json needs the `tokenizers` package (pip install 'jaxgdn[tools]')") \
                from None
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception type for malformed files
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path} is not a valid tokenizer.json: {first}") from None
        return cls(backend, name=str(path), eos_token_ids=eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added); InputError unless `text` is a str."""
        _check_text(text)
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. An id outside [0, vocab_size) (negative included) reads as one U+FFFD, and the runs of
        valid ids around it are decoded separately; a non-integer id raises `InputError`."""
        return _decode_runs(_token_ids(ids), self.vocab_size,
                            lambda run: self._tok.decode(run, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (for per-token tables)."""
        return self.decode([token_id])

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab {self.vocab_size})"


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255). Decoding reads each id outside 0..255 (negative included) as one U+FFFD
    and decodes the runs of valid bytes around it as UTF-8 (broken UTF-8 there becomes U+FFFD too), so
    `decode([0xC3, 0xA9, 300]) == "\u00e9\ufffd"`; a non-integer id raises `InputError`."""

    name = "bytes"
    vocab_size = 256
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        _check_text(text)
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return _decode_runs(_token_ids(ids), 256, lambda run: bytes(run).decode("utf-8", errors="replace"))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _eos_field(f: Path, field: str, eos) -> tuple[int, ...]:
    """`eos` (the value of `field` in file `f`) as a tuple of ints; CheckpointError unless an int or a list of ints."""
    if is_int(eos):
        return (int(eos),)
    if isinstance(eos, list) and all(is_int(t) for t in eos):
        return tuple(int(t) for t in eos)
    raise CheckpointError(f"{f}: {field} must be an integer or a list of integers; got {json.dumps(eos):.80}")


def eos_token_ids(model_dir) -> tuple[int, ...]:
    """`eos_token_id` of generation_config.json (else config.json, or its text_config) as a tuple; () if none.
    Raises `CheckpointError` naming the file and field when the file is not a JSON object or the field is anything
    but an integer or a list of integers."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{f} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{f} must hold a JSON object; got a {type(cfg).__name__}")
        if cfg.get("eos_token_id") is not None:
            return _eos_field(f, "eos_token_id", cfg["eos_token_id"])
        text_cfg = cfg.get("text_config")
        if text_cfg is None:
            continue
        if not isinstance(text_cfg, dict):
            raise CheckpointError(f"{f}: text_config must be a JSON object; got {json.dumps(text_cfg):.80}")
        if text_cfg.get("eos_token_id") is not None:
            return _eos_field(f, "text_config.eos_token_id", text_cfg["eos_token_id"])
    return ()


def load_tokenizer(path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory (its tokenizer.json; None when it has none) or of a tokenizer.json
    file. Raises `CheckpointError` for a missing path or a malformed file, `InputError` for a path that is not a
    str or os.PathLike."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"path must be a checkpoint directory or a tokenizer.json (a str or os.PathLike); got "
                         f"{type(path).__name__} {path!r:.60}")
    path = Path(path)
    if path.is_dir():
        f = path / TOKENIZER_FILE
        if f.exists() and not f.is_file():  # (a directory of that name: it read as "no tokenizer")
            raise CheckpointError(f"{f} is not a file")
        return Tokenizer.from_file(f, eos_token_ids(path)) if f.is_file() else None
    if not path.exists():
        raise CheckpointError(f"tokenizer path {path} does not exist")
    return Tokenizer.from_file(path, eos_token_ids(path.parent))
