"""Teacher-forced scoring: the logprob of each token of a sequence given the tokens before it, by prefill.

    scores = jaxgdn.score(model, [prompt + completion, ...], start=[len(prompt), ...])
    scores[i][j]  # log p(seq_i[start_i + j] | seq_i[:start_i + j]), fp32 values as Python floats

This is what an RL trainer or an evaluator recomputes for a sampled completion. Sequences are batched (up to
`batch_size` rows, shortest first so rows of similar length share a batch), padded with per-row lengths, and
run through one jitted prefill + order-invariant log_softmax per batch. Shapes are bucketed: the token width to
a multiple of 64 (or to `window` columns per call for long batches) and the row count to a power of two, so
repeated calls with similar sizes reuse one compiled program.

Long batches are prefilled in windows of `window` tokens (a multiple of 64); every window starts on the 64-token
grid, so the result is what one prefill of the whole sequence computes (bitwise with `deterministic=True`,
within fp32 rounding otherwise), while the logits held at once
are [rows, window, vocab] fp32 (8 x 512 x 248k x 4 B = 4 GiB for a Qwen3.5 vocabulary: lower `batch_size` or
`window` on a small device).

Generation's logprobs under recurrent decode agree with these within about 1e-5 (the recurrent state differs
from prefill's in the low bits); under replay decode (`model.with_decode_mode("replay")`) with
`deterministic=True` they are bitwise equal.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from pallas_kernels import CHUNK
from pallas_kernels.invariant import log_softmax

from .errors import InputError, is_flat_ids, is_int, plain_int, refuse_unordered, token_array, token_id
from .generate import check_model
from .model import Model, jit, mesh_context, prefill_chunk
from .shapes import next_pow2

DEFAULT_WINDOW = 512


def _round_up(n: int, step: int = CHUNK) -> int:
    return max(step, -(-n // step) * step)


@functools.partial(jit, donate_argnums=1)
def _score_window(model: Model, state, tokens, lengths, targets):
    """One prefill call; returns (state, logprob of targets[b, t] under the logits at [b, t]) -> [B, T] fp32."""
    state, logits = prefill_chunk(model, state, tokens, lengths)
    lp = jnp.take_along_axis(log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    return state, lp


def check_sequences(model: Model, sequences, start) -> tuple[list[list[int]], list[int]]:
    """Validate and normalise (sequences, start) for `score`; raises `InputError` naming the sequence."""
    check_model(model)
    V = model.config.vocab_size
    if isinstance(sequences, (str, bytes)):
        raise InputError("sequences must be a list of token-id sequences (got a string: encode it with a tokenizer)")
    flat = InputError("sequences must be a list of token-id sequences (got one flat sequence of ids: wrap it in a "
                      "list)")
    if is_flat_ids(sequences):
        raise flat
    refuse_unordered(sequences, "sequences")
    try:
        items = list(sequences)
    except TypeError:
        raise InputError("sequences must be a list of token-id sequences") from None
    if is_flat_ids(items):  # a generator of ids, say
        raise flat
    seqs = [token_array(s, f"sequence {i}", V) for i, s in enumerate(items)]
    if not seqs:
        raise InputError("no sequences given")
    if token_id(start) is not None:  # an int (NumPy's, a 0-d NumPy / JAX integer array too)
        starts = [token_id(start)] * len(seqs)
    else:
        try:
            given = list(start)
        except TypeError:
            raise InputError(f"start must be an int or one int per sequence; got {start!r:.80}") from None
        bad = [i for i, s in enumerate(given) if token_id(s) is None]
        if bad:
            raise InputError(f"start must be an int or one int per sequence; start value {bad[0]} is "
                             f"{given[bad[0]]!r:.40}, not an integer")
        starts = [token_id(s) for s in given]
        if len(starts) != len(seqs):
            raise InputError(f"{len(starts)} start values for {len(seqs)} sequences")
    out = []
    for i, (s, st) in enumerate(zip(seqs, starts)):
        if len(s) < 2:
            raise InputError(f"sequence {i} has one token: scoring needs at least 2 (token 0 has no context)")
        if not 1 <= st < len(s):
            raise InputError(f"start {st} is out of range for sequence {i} of {len(s)} tokens: it must lie in "
                             f"[1, {len(s) - 1}] (token 0 has no context; at least one token must be scored)")
        out.append([int(t) for t in s])
    return out, starts


def score(model: Model, sequences: Sequence[Sequence[int]], start: int | Sequence[int] = 1, *,
          batch_size: int = 8, window: int = DEFAULT_WINDOW) -> list[list[float]]:
    """Per-token logprobs by teacher forcing.

    sequences: token-id sequences (any lengths >= 2: lists, tuples, 1-D NumPy / JAX integer arrays; any iterable of
    them). start: the first position scored, one int for all or one per sequence (Python, NumPy or 0-d JAX
    integers), in [1, len - 1]. batch_size and window are ints (Python, NumPy or 0-d JAX; window a multiple of 64).
    Bad input raises `InputError` naming the argument or the sequence, before anything is compiled. A model placed on
    a mesh (`jaxgdn.sharding.shard_model`) scores with its kernels per shard, as `generate` runs them. Returns, in
    order, for each sequence the list of log p(seq[t] | seq[:t]) for t = start .. len - 1 (full-vocabulary
    log_softmax of the model's logits, fp32).
    """
    seqs, starts = check_sequences(model, sequences, start)
    batch_size, window = plain_int(batch_size), plain_int(window)
    for name, value in (("batch_size", batch_size), ("window", window)):
        if not is_int(value):
            raise InputError(f"{name} must be an integer; got {type(value).__name__} {value!r:.40}")
    batch_size, window = int(batch_size), int(window)
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1; got {batch_size}")
    if window < CHUNK or window % CHUNK:
        raise InputError(f"window must be a positive multiple of {CHUNK}; got {window}")
    out: list[list[float] | None] = [None] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    with mesh_context(model):  # a model placed on a mesh (jaxgdn.sharding): its Pallas kernels run per shard
        for k in range(0, len(order), batch_size):
            idx = order[k:k + batch_size]
            rows = min(next_pow2(len(idx)), next_pow2(batch_size))
            lp = _score_batch(model, [seqs[i] for i in idx], rows, window)
            for r, i in enumerate(idx):
                out[i] = lp[r, starts[i] - 1:len(seqs[i]) - 1].tolist()
    return out


def _score_batch(model: Model, seqs: list[list[int]], rows: int, window: int) -> np.ndarray:
    """Logprob of seq[t + 1] at [row, t] for one batch (rows >= len(seqs); extra rows are empty padding)."""
    lengths = np.zeros((rows,), np.int32)
    lengths[:len(seqs)] = [len(s) for s in seqs]
    width = _round_up(int(lengths.max()))
    step = min(width, window)
    width = _round_up(width, step)
    tokens = np.zeros((rows, width), np.int32)
    targets = np.zeros((rows, width), np.int32)
    for r, s in enumerate(seqs):
        tokens[r, :len(s)] = s
        targets[r, :len(s) - 1] = s[1:]
    state = model.init_state(rows, width)
    parts = []
    for w in range(0, width, step):
        call_lengths = np.clip(lengths - w, 0, step).astype(np.int32)
        state, lp = _score_window(model, state, jnp.asarray(tokens[:, w:w + step]), jnp.asarray(call_lengths),
                                  jnp.asarray(targets[:, w:w + step]))
        parts.append(np.asarray(lp))
    return np.concatenate(parts, axis=1)
