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

Sequences that share a prompt (k sampled completions of one prompt, as an RL trainer rescores them) share its
prefill: the prefix up to the last 64-token grid boundary before a sequence's first scored position is prefilled
once per batch for all the sequences that have it, and each continues from a copy of its state
(`cache.state_from_checkpoints`), as a prefix-cache hit does — the same logprobs (bitwise with `deterministic=True`:
a prefill split on the grid is the unsplit one; within fp32 rounding otherwise). Identical (sequence, start) pairs
are scored once. `share_prefixes=False` turns both off.

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

from .cache import Checkpoint, checkpoint_from_state, state_from_checkpoints
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


@functools.partial(jit, donate_argnums=1)
def _advance(model: Model, state, tokens, lengths):
    """One prefill call of a shared prefix: the state alone (the last rows' logits, all it computes beyond, unused)."""
    return prefill_chunk(model, state, tokens, lengths, last_only=True)[0]


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
          batch_size: int = 8, window: int = DEFAULT_WINDOW, share_prefixes: bool = True) -> list[list[float]]:
    """Per-token logprobs by teacher forcing.

    sequences: token-id sequences (any lengths >= 2: lists, tuples, 1-D NumPy / JAX integer arrays; any iterable of
    them). start: the first position scored, one int for all or one per sequence (Python, NumPy or 0-d JAX
    integers), in [1, len - 1]. batch_size and window are ints (Python, NumPy or 0-d JAX; window a multiple of 64).
    Bad input raises `InputError` naming the argument or the sequence, before anything is compiled. A model placed on
    a mesh (`jaxgdn.sharding.shard_model`) scores with its kernels per shard, as `generate` runs them.
    share_prefixes (a bool, default True): sequences of a batch with the same tokens up to the last 64-token grid
    boundary before their start share that prefix's prefill, and identical (sequence, start) pairs are scored once
    (module docstring). Returns, in order, for each sequence the list of log p(seq[t] | seq[:t]) for
    t = start .. len - 1 (full-vocabulary log_softmax of the model's logits, fp32).
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
    if not isinstance(share_prefixes, (bool, np.bool_)):
        raise InputError(f"share_prefixes must be a bool; got {type(share_prefixes).__name__} {share_prefixes!r:.40}")
    plan = _SharingPlan(seqs, starts, bool(share_prefixes))
    scored: dict[int, list[float]] = {}  # distinct request (index into plan.distinct) -> its logprobs
    with mesh_context(model):  # a model placed on a mesh (jaxgdn.sharding): its Pallas kernels run per shard
        held: dict[int, Checkpoint] = {}  # prefix group -> the state after its prefix, while a request needs it
        order = plan.order()
        last_batch = {plan.group[j]: n // batch_size for n, j in enumerate(order)}  # (group -> its last batch)
        for k in range(0, len(order), batch_size):
            idx = order[k:k + batch_size]
            rows = min(next_pow2(len(idx)), next_pow2(batch_size))
            groups = dict.fromkeys(plan.group[j] for j in idx if plan.group[j] is not None)  # (in order, once)
            new = {g: plan.prefix(g) for g in groups if g not in held}
            if new:
                held.update(_prefix_states(model, new, window))
            hits = [held[plan.group[j]] if plan.group[j] is not None else None for j in idx]
            lp = _score_batch(model, [seqs[plan.distinct[j]] for j in idx], hits, rows, window)
            for r, j in enumerate(idx):
                i = plan.distinct[j]
                off = hits[r].position if hits[r] is not None else 0
                scored[j] = lp[r, starts[i] - 1 - off:len(seqs[i]) - 1 - off].tolist()
            for g in groups:
                if last_batch[g] == k // batch_size:
                    del held[g]
    return [list(scored[j]) for j in plan.copy_of]


class _SharingPlan:
    """Which requests `score` computes and from what: identical (sequence, start) requests once (`copy_of`: each
    request's distinct one), and for each distinct request j the prefix group it continues (`group[j]`, None for a
    prefill from scratch): the requests whose first P tokens are equal, P = the last grid boundary at or before
    start - 1 (the logits of start - 1 must be their own prefill's), P >= 64, when at least two distinct requests of
    the call have it."""

    def __init__(self, seqs: list[list[int]], starts: list[int], share: bool):
        self.seqs = seqs
        key_of: dict[tuple, int] = {}
        self.copy_of, self.distinct = [], []
        for i, (s, st) in enumerate(zip(seqs, starts)):
            key = (tuple(s), st) if share else i
            if key not in key_of:
                key_of[key] = len(self.distinct)
                self.distinct.append(i)
            self.copy_of.append(key_of[key])
        self.cut = [(starts[i] - 1) // CHUNK * CHUNK if share else 0 for i in self.distinct]
        members: dict[tuple, list[int]] = {}
        for j, i in enumerate(self.distinct):
            if self.cut[j] >= CHUNK:
                members.setdefault(tuple(seqs[i][:self.cut[j]]), []).append(j)
        self.members = [m for m in members.values() if len(m) > 1]
        self.group: list[int | None] = [None] * len(self.distinct)
        for g, m in enumerate(self.members):
            for j in m:
                self.group[j] = g

    def prefix(self, g: int) -> list[int]:
        j = self.members[g][0]
        return self.seqs[self.distinct[j]][:self.cut[j]]

    def order(self) -> list[int]:
        """Distinct requests in batch order: shortest first, a prefix group's requests together (at the place of its
        longest), so that a group's prefix is prefilled once and held no longer than its requests need it."""
        length = [len(self.seqs[i]) for i in self.distinct]
        span = [max(length[j] for j in self.members[g]) if g is not None else length[j]
                for j, g in enumerate(self.group)]
        return sorted(range(len(self.distinct)),
                      key=lambda j: (span[j], -1 if self.group[j] is None else self.group[j], length[j], j))


def _windows(longest: int, window: int) -> tuple[int, int]:
    """(width, step): a batch whose longest row has `longest` tokens is prefilled in calls of `step` columns (a
    multiple of 64, at most `window`), `width` columns in all (a multiple of `step`)."""
    width = _round_up(longest)
    step = min(width, window)
    return _round_up(width, step), step


def _prefix_states(model: Model, prefixes: dict[int, list[int]], window: int) -> dict[int, Checkpoint]:
    """Each prefix prefilled (one batch, its rows padded to a power of two, in windows of `window` columns on the
    grid), as the checkpoint a request continues from. (A padded row costs what a full one does: the kernels run
    on the whole batch; so one row per distinct prefix, not the scored batch's rows.)"""
    n = next_pow2(len(prefixes))
    lengths = np.zeros((n,), np.int32)
    lengths[:len(prefixes)] = [len(p) for p in prefixes.values()]
    width, step = _windows(int(lengths.max()), window)
    tokens = np.zeros((n, width), np.int32)
    for r, p in enumerate(prefixes.values()):
        tokens[r, :len(p)] = p
    state = model.init_state(n, width)
    for w in range(0, width, step):
        state = _advance(model, state, jnp.asarray(tokens[:, w:w + step]),
                         jnp.asarray(np.clip(lengths - w, 0, step).astype(np.int32)))
    return {g: checkpoint_from_state(state, r, p, model) for r, (g, p) in enumerate(prefixes.items())}


def _score_batch(model: Model, seqs: list[list[int]], hits: list[Checkpoint | None], rows: int,
                 window: int) -> np.ndarray:
    """Logprob of seq[off + t + 1] at [row, t] for one batch, each row continuing from its hit (off = its position;
    0 and a fresh row where None). rows >= len(seqs); extra rows are empty padding."""
    offsets = np.array([h.position if h is not None else 0 for h in hits], np.int32)
    lengths = np.zeros((rows,), np.int32)
    lengths[:len(seqs)] = [len(s) for s in seqs] - offsets
    width, step = _windows(int(lengths.max()), window)
    tokens = np.zeros((rows, width), np.int32)
    targets = np.zeros((rows, width), np.int32)
    for r, (s, off) in enumerate(zip(seqs, offsets)):
        tokens[r, :len(s) - off] = s[off:]
        targets[r, :len(s) - off - 1] = s[off + 1:]
    state = model.init_state(rows, _round_up(max(len(s) for s in seqs)) if offsets.any() else width)
    if offsets.any():
        state = state_from_checkpoints(state, list(hits) + [None] * (rows - len(hits)))
    parts = []
    for w in range(0, width, step):
        call_lengths = np.clip(lengths - w, 0, step).astype(np.int32)
        state, lp = _score_window(model, state, jnp.asarray(tokens[:, w:w + step]), jnp.asarray(call_lengths),
                                  jnp.asarray(targets[:, w:w + step]))
        parts.append(np.asarray(lp))
    return np.concatenate(parts, axis=1)
