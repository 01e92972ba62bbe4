"""Exceptions raised by jaxgdn. Each names what was wrong so callers and the CLI can report one clear line."""

import operator

import numpy as np


class JaxGDNError(Exception):
    """Base class for jaxgdn's own errors."""


class CheckpointError(JaxGDNError):
    """A checkpoint directory is missing, malformed, or does not match the config (names the file or tensor)."""


class UnsupportedModelError(CheckpointError):
    """config.json describes a model jaxgdn does not implement: another model_type, or a feature of the supported
    ones it lacks (RoPE scaling, attention bias, an activation other than silu, quantisation, a classification head;
    the message names it)."""


class InputError(JaxGDNError, ValueError):
    """Bad input to a state function: token ids out of range, wrong dtype or rank, lengths, capacity."""


class CapacityError(InputError):
    """The KV cache of a state has no room for the tokens asked for."""


def refuse_unordered(items, what: str) -> None:
    """InputError when `items` (prompts, sequences: `what`) is a set or a dict: results come back in their order,
    which those do not have."""
    if isinstance(items, (set, frozenset, dict)):
        raise InputError(f"{what} must be an ordered sequence of token-id sequences (a list); got a "
                         f"{type(items).__name__}, whose order the results could not follow")


def is_int(x) -> bool:
    """A Python or NumPy integer (not a bool)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def plain_int(x):
    """`index_value(x)` where x is an integer (so integer options take NumPy and 0-d JAX integers as Python ints);
    anything else unchanged, for the caller's check to judge (a bool, a float, a tracer)."""
    try:
        return index_value(x)
    except TypeError:
        return x


def index_value(x) -> int:
    """x as a Python int when it is an integer — anything with __index__: Python, NumPy and concrete 0-d integer
    arrays, JAX's too — and not a bool; TypeError otherwise (callers turn it into their InputError)."""
    if isinstance(x, (bool, np.bool_)) or getattr(x, "dtype", None) == np.bool_:
        raise TypeError(f"{x!r} is a bool, not an integer")
    return operator.index(x)


def check_token_ids(ids: np.ndarray, what: str, vocab_size: int | None, allow_empty: bool = False) -> None:
    """`ids` (what the caller calls `what`: "prompt 3", "sequence 0") must be a flat, non-empty (unless `allow_empty`)
    array of integer token ids in [0, vocab_size) — [0, 2**63) with no vocabulary (the prefix cache's, which knows no
    model); raises InputError naming the problem otherwise (shared by `generate`, `score` and the cache)."""
    if ids.ndim != 1:
        raise InputError(f"{what} must be a flat sequence of integer token ids; got shape {ids.shape}")
    if ids.size == 0:
        if allow_empty:
            return
        raise InputError(f"{what} is empty")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{what} must hold integer token ids; got {ids.dtype}")
    bound, shown = (vocab_size, vocab_size) if vocab_size is not None else (2**63, "2**63")
    if int(ids.min()) < 0 or int(ids.max()) >= bound:
        raise InputError(f"{what} holds token ids outside [0, {shown}): min {int(ids.min())}, max {int(ids.max())}")


def safe_ndim(value) -> int:
    """np.ndim(value), or -1 for a ragged nesting (NumPy refuses to make one array of it)."""
    try:
        return np.ndim(value)
    except ValueError:
        return -1


def token_id(x) -> int | None:
    """x as a Python int when it is an integer — a Python or NumPy integer, or a 0-d integer array (NumPy or JAX) —
    and not a bool; None otherwise."""
    try:
        return index_value(x)
    except TypeError:
        return None


def is_flat_ids(seq) -> bool:
    """Whether `seq`, given where a list of token-id sequences belongs, is one flat sequence of ids instead: a 1-D
    array (NumPy or JAX, not of Python objects), or a non-empty list / tuple of integers (0-d integer arrays too)."""
    if hasattr(seq, "ndim") and hasattr(seq, "dtype"):
        return seq.ndim == 1 and seq.dtype != object
    if isinstance(seq, (list, tuple)):
        return len(seq) > 0 and all(token_id(t) is not None for t in seq)
    return False


def bool_among_ints(x) -> bool:
    """Whether `x`, a (nested) Python sequence rather than an array, holds a bool: NumPy reads [1, True] as the int64
    [1, 1], so a bool would otherwise pass as the integer 1 (arrays: their dtype says it)."""
    if hasattr(x, "dtype") or isinstance(x, (str, bytes)):
        return False
    if isinstance(x, (bool, np.bool_)):
        return True
    if isinstance(x, (list, tuple)):  # the common case, a flat sequence: its few element types, gathered at C speed
        kinds = set(map(type, x))     # (an isinstance per element took ~3 ms per 32k-token checkpoint)
        if not any(issubclass(k, (list, tuple)) for k in kinds):
            return any(issubclass(k, (bool, np.bool_)) for k in kinds)
    try:
        flat = np.asarray(x, dtype=object).ravel()
    except (TypeError, ValueError):
        return False
    return any(isinstance(v, (bool, np.bool_)) for v in flat)


def token_array(ids, what: str, vocab_size: int | None, allow_empty: bool = False) -> np.ndarray:
    """`ids` (a list, tuple, NumPy or JAX array; `what` names it in errors: "prompt 3", "sequence 0") as a flat NumPy
    array of integer token ids, checked by `check_token_ids`; also refused: a string (not ids: encode it with a
    tokenizer), nested or ragged sequences, and bools among ints ([1, True] is int64 to NumPy; it used to pass the
    prefix cache and `score` as token 1). The one check `generate`, the engine, `score` and the prefix cache share."""
    if isinstance(ids, (str, bytes)):
        raise InputError(f"{what} must be a flat sequence of integer token ids; got a string "
                         f"({type(ids).__name__}: encode it with a tokenizer)")
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, OverflowError):  # ragged or nested rows: no one flat array
        raise InputError(f"{what} must be a flat sequence of integer token ids") from None
    check_token_ids(arr, what, vocab_size, allow_empty)
    if bool_among_ints(ids):
        raise InputError(f"{what} must hold integer token ids; got a bool")
    return arr
