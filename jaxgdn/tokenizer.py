"""Text <-> token ids, for the CLI and scripts. The library API itself takes and returns token ids.

    tok = jaxgdn.tokenizer.load_tokenizer("path/to/Qwen3.5-9B")  # its tokenizer.json (None when absent)
    ids = tok.encode("Hello")
    text = tok.decode(ids)

A checkpoint directory's `tokenizer.json` is read with Hugging Face `tokenizers` (the `tools` extra). Its end-of-
sequence ids come from `generation_config.json` or `config.json` (`eos_token_id`, an int or a list), for use as
default stop tokens. `ByteTokenizer` (UTF-8 bytes as ids 0..255) is the fallback for the embedded tiny models,
whose vocabulary is exactly 256.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .errors import CheckpointError, JaxGDNError

TOKENIZER_FILE = "tokenizer.json"


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
        """Token ids of `text` (no special tokens added)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """How one token reads on its own (for per-token tables)."""
        return self.decode([token_id])

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab {self.vocab_size})"


class ByteTokenizer:
    """UTF-8 bytes as token ids (0..255). Decoding replaces ids above 255 and broken UTF-8 with U+FFFD."""

    name = "bytes"
    vocab_size = 256
    eos_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(t) for t in ids]
        if all(0 <= t < 256 for t in ids):
            return bytes(ids).decode("utf-8", errors="replace")
        return "".join(bytes([t]).decode("utf-8", errors="replace") if 0 <= t < 256 else "\ufffd" for t in ids)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def eos_token_ids(model_dir) -> tuple[int, ...]:
    """`eos_token_id` of generation_config.json (else config.json, or its text_config) as a tuple; () if none."""
    model_dir = Path(model_dir)
    for name in ("generation_config.json", "config.json"):
        f = model_dir / name
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{f} is not valid JSON: {e}") from None
        for c in (cfg, cfg.get("text_config") or {}):
            eos = c.get("eos_token_id")
            if eos is not None:
                return tuple(int(t) for t in (eos if isinstance(eos, list) else [eos]))
    return ()


def load_tokenizer(path) -> Tokenizer | None:
    """The tokenizer of a checkpoint directory (its tokenizer.json; None when it has none) or of a tokenizer.json
    file. Raises `CheckpointError` for a missing path or a malformed file."""
    path = Path(path)
    if path.is_dir():
        f = path / TOKENIZER_FILE
        return Tokenizer.from_file(f, eos_token_ids(path)) if f.is_file() else None
    if not path.exists():
        raise CheckpointError(f"tokenizer path {path} does not exist")
    return Tokenizer.from_file(path, eos_token_ids(path.parent))
