"""A functional prefix cache of model checkpoints.

A checkpoint is everything needed to continue a sequence from a token prefix: for every GDN layer the exact
fp32 recurrent state and the conv state (the last KC-1 pre-conv inputs), and for every attention layer the
keys/values of the prefix. Checkpoints sit only on one absolute grid: positions that are multiples of
`interval` (itself a multiple of the 64-token chunk).

`PrefixCache` is immutable: `insert` and `lookup` return a new cache (lookup records recency and hit counts)
and never change the old one. With `deterministic=True` it admits only prefill-produced checkpoints
(provenance PREFILL): a decode-produced GDN state is not bitwise equal to the prefill-produced state of the
same prefix, and caching it would make a request's logprobs depend on what ran before it. `check_cache`
proves the invariant with chex assertions.

Default interval 256: a hit recomputes at most 256 tokens (a few ms of prefill on a GPU), while a 9B model's
checkpoint (24 GDN layers x 2 MiB of fp32 state, plus the prefix KV) is large enough that checkpointing every
64 tokens would fill a byte budget four times faster for little gain. Tests use 64.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Iterable, Mapping, Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import CHUNK, resolve_backend

from .errors import CapacityError, InputError, JaxGDNError, index_value, is_flat_ids, is_int, token_array
from .model import jit, placed_like
from .shapes import next_pow2
from .state import AttentionLayerState, GDNLayerState, ModelState, PrefillCheckpoints, Provenance, at_boundary

DEFAULT_INTERVAL = 256


def _token_tuple(tokens, what: str) -> tuple[int, ...]:
    """`tokens` (`errors.token_array`'s inputs; `what` names it in errors) as a tuple of Python ints: any
    non-negative integer ids, no vocabulary (a cache knows no model; a float id used to be truncated, silently
    matching another prefix). Empty is allowed here: callers decide (a checkpoint of no tokens is off the grid;
    `lookup` refuses an empty prompt)."""
    return tuple(token_array(tokens, what, None, allow_empty=True).tolist())


class CheckpointRefused(JaxGDNError):
    """A prefix cache refused a state: `insert` of a checkpoint its rules do not admit (off its grid, MIXED, in
    deterministic mode not prefill-produced), larger than its whole budget, or computed by other numerics than the
    states it holds; and `bound_to` (so `generate`, `score` and the `Engine`) given a cache of another kind of
    model's states."""


KVBlock = tuple[AttentionLayerState, ...]  # consecutive rows of a prefix's attention keys and values, per attention
# layer [L, HKV, Dh] (L rows, the same for every layer of the block)


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class Checkpoint:
    """The state of one sequence after `tokens` (position = len(tokens)). Leaves carry no batch axis.

    The attention keys and values of the prefix are held as consecutive blocks (`kv_blocks`) so that the
    checkpoints of one sequence share the blocks of their common prefix (the same arrays) instead of each holding a
    copy: the checkpoints `generate` makes of a prompt of n cache intervals hold n intervals of keys and values, not
    n²/2. `kv` is the whole prefix's (the blocks concatenated: a new array unless there is one block).

    Build it with `kv=` (the whole prefix's keys and values: one block; positionally, the fourth argument, as before
    the blocks) or `kv_blocks=`; where both are given, `kv` replaces the blocks (so that
    `dataclasses.replace(ck, kv=...)` replaces the keys and values)."""

    tokens: tuple[int, ...]
    provenance: int  # Provenance of the state that produced it
    gdn: tuple[GDNLayerState, ...]  # per GDN layer: conv [KC-1, C], recurrent fp32 [HV, K, V] (on the grid:
    # `state.at_boundary`, no open-chunk buffers; elsewhere, in replay mode, with them)
    kv_blocks: tuple[KVBlock, ...]  # the prefix's keys and values in consecutive blocks of rows (their rows add up
    # to the position), possibly shared with other checkpoints of the same sequence
    # `numerics_key` of the model that computed it, or None where not known (a checkpoint made by hand without the
    # model): `PrefixCache.insert` refuses one made with other numerics than the cache's states
    numerics: str | None = None
    # `Model.numerics_tag` of the model that computed the state (`ModelState.origin` of its row; 0: unclaimed). A
    # cache refuses one of another tag than its states'; a state restored from it carries the tag on
    origin: int = 0

    def __init__(self, tokens, provenance, gdn, kv=None, numerics=None, origin=0, *, kv_blocks=None):
        if kv is not None:
            kv_blocks = (tuple(kv),) if isinstance(kv, (tuple, list)) else kv  # (a bad kv: `_checked` names it)
        elif kv_blocks is None:
            raise InputError("Checkpoint needs its prefix's attention keys and values: kv= (per attention layer) or "
                             "kv_blocks= (consecutive blocks of them)")
        else:
            kv_blocks = tuple(tuple(b) if isinstance(b, list) else b for b in kv_blocks) \
                if isinstance(kv_blocks, (tuple, list)) else kv_blocks
        for name, value in (("tokens", tokens), ("provenance", provenance), ("gdn", gdn), ("kv_blocks", kv_blocks),
                            ("numerics", numerics), ("origin", origin)):
            object.__setattr__(self, name, value)

    def __setstate__(self, state: dict):
        """Unpickling, also of a checkpoint pickled before `kv_blocks` (2026-12-05), which held `kv` whole."""
        state = dict(state)
        if "kv_blocks" not in state and "kv" in state:
            state["kv_blocks"] = (tuple(state.pop("kv")),)
        self.__dict__.update(state)

    def __repr__(self) -> str:  # (not the arrays: a long prefix's blocks are many, each a device-to-host copy)
        try:
            provenance = Provenance(self.provenance).name
        except (ValueError, TypeError):
            provenance = repr(self.provenance)
        return (f"Checkpoint(position={self.position}, provenance={provenance}, gdn_layers={len(self.gdn)}, "
                f"kv_blocks={len(self.kv_blocks)}, numerics={self.numerics!r}, origin={self.origin})")

    @property
    def position(self) -> int:
        return len(self.tokens)

    @property
    def kv(self) -> tuple[AttentionLayerState, ...]:
        """Per attention layer, the keys and values of the whole prefix [P, HKV, Dh]."""
        if len(self.kv_blocks) == 1:
            return self.kv_blocks[0]
        if not self.kv_blocks:
            return ()
        return tuple(AttentionLayerState(*(jnp.concatenate([getattr(b[i], name) for b in self.kv_blocks])
                                           for name in ("keys", "values")))
                     for i in range(len(self.kv_blocks[0])))

    @property
    def nbytes(self) -> int:
        """The bytes of this checkpoint alone (blocks shared with others counted in full)."""
        return sum(int(x.nbytes) for x in _leaves(self))


def _checked(ck, what: str) -> Checkpoint:
    """`ck` checked to be a well-formed checkpoint, with its tokens as a tuple of Python ints (a copy when they were
    a list or an array: as given, a list never equalled a prompt's tuple, so the entry was never found, and an array
    made every lookup of its prefix raise); InputError naming `what` otherwise. What it checks needs no model: the
    tokens, the provenance, the numerics' type, the layer states' kinds, one key/value row per token."""
    if not isinstance(ck, Checkpoint):
        raise InputError(f"{what} must be a jaxgdn.cache.Checkpoint; got {type(ck).__name__}")
    tokens = _token_tuple(ck.tokens, f"{what}'s tokens")
    valid = {int(p) for p in Provenance if p != Provenance.FRESH or not tokens}  # FRESH: nothing absorbed
    if not is_int(ck.provenance) or int(ck.provenance) not in valid:
        raise InputError(f"{what} has provenance {ck.provenance!r}; a state that absorbed {len(tokens)} tokens has "
                         f"one of {sorted(valid)} (jaxgdn.state.Provenance)")
    if ck.numerics is not None and not isinstance(ck.numerics, str):
        raise InputError(f"{what}'s numerics must be a `numerics_key` string or None; got {ck.numerics!r}")
    if not is_int(ck.origin) or not 0 <= int(ck.origin) < 2**31:
        raise InputError(f"{what}'s origin must be a `Model.numerics_tag` (an integer in [1, 2**31)) or 0; got "
                         f"{ck.origin!r}")
    blocks = ck.kv_blocks
    if not (isinstance(ck.gdn, (tuple, list)) and all(isinstance(g, GDNLayerState) for g in ck.gdn)
            and isinstance(blocks, tuple) and blocks
            and all(isinstance(b, tuple) and all(isinstance(a, AttentionLayerState) for a in b) for b in blocks)):
        raise InputError(f"{what} must hold a tuple of GDNLayerState (gdn) and of AttentionLayerState (kv; kv_blocks: "
                         f"a non-empty tuple of such tuples)")
    if len({len(b) for b in blocks}) != 1:
        raise InputError(f"{what}'s kv_blocks hold {[len(b) for b in blocks]} attention layers (every block holds "
                         f"one state per attention layer)")
    rows = []
    for b in blocks:
        lengths = {np.shape(x)[0] if np.ndim(x) >= 1 else None for a in b for x in a}
        if None in lengths or len(lengths) > 1:
            shapes = [np.shape(x) for a in b for x in a]
            raise InputError(f"{what}: attention keys and values of shapes {shapes} in one block (one row per token "
                             f"expected, the same rows in every layer)")
        rows.append(lengths.pop() if lengths else 0)
    if blocks[0] and sum(rows) != len(tokens):
        shapes = (f"of shape {np.shape(blocks[0][0].keys)}" if len(blocks) == 1 else
                  f"in blocks of {rows} rows")
        raise InputError(f"{what}: attention keys {shapes} for {len(tokens)} tokens (one row per token expected: "
                         f"tokens and states of different prefixes)")
    return ck if type(ck.tokens) is tuple else dataclasses.replace(ck, tokens=tokens)


def checkpoint_from_state(state: ModelState, row: int, tokens: Sequence[int], model=None) -> Checkpoint:
    """The checkpoint of batch row `row` of `state`, whose absorbed tokens are `tokens` (len == its position).
    `model`: the model that computed the state; its `numerics_key` goes into the checkpoint (a state carries only its
    `numerics_tag`, `ModelState.origin`), so that a cache of other numerics refuses it; InputError when the row's
    origin names another model. Without it the checkpoint's numerics are unknown (None). The row's origin goes into
    the checkpoint either way."""
    if not is_int(row) or not 0 <= row < state.batch_size:
        raise InputError(f"row must be an integer in [0, {state.batch_size}); got {row!r}")
    pos = int(state.position[row])
    origin = int(state.origin[row])
    if model is not None and origin not in (0, model.numerics_tag):
        raise InputError(f"row {row} was computed by another model than `model` (numerics_tag {origin}; the model's "
                         f"is {model.numerics_tag}): pass the model that computed the state")
    tokens = _token_tuple(tokens, "tokens")
    if len(tokens) != pos:
        raise InputError(f"row {row} is at position {pos} but {len(tokens)} tokens were given")
    gdn = tuple(jax.tree.map(lambda x: x[row], at_boundary(s) if pos % CHUNK == 0 else s)
                for s in state.layers if isinstance(s, GDNLayerState))
    kv = tuple(AttentionLayerState(keys=s.keys[row, :pos], values=s.values[row, :pos])
               for s in state.layers if isinstance(s, AttentionLayerState))
    return Checkpoint(tokens=tokens, provenance=int(state.provenance[row]), gdn=gdn, kv=kv,
                      numerics=None if model is None else numerics_key(model), origin=origin)


def prefix_blocks(kv_state: ModelState, row: int, positions: Sequence[int], base: Checkpoint | None = None
                  ) -> dict[int, tuple[KVBlock, ...]]:
    """For each of `positions` (ascending, each past `base`'s), the keys and values of row `row` of `kv_state` up to
    there as `Checkpoint.kv_blocks`, sharing blocks: one block between consecutive positions, after `base`'s blocks
    (the checkpoint the row was restored from: its blocks are the row's first rows, bit for bit). The keys and
    values of a prefix never change, so `kv_state` may be any later state of the row."""
    start = base.position if base is not None else 0
    attn = [s for s in kv_state.layers if isinstance(s, AttentionLayerState)]
    blocks = list(base.kv_blocks) if base is not None else []
    out = {}
    for p in positions:
        if p <= start:
            raise InputError(f"positions must ascend, each past the one before and past the base's position "
                             f"({base.position if base is not None else 0}); got {list(positions)}")
        blocks.append(tuple(AttentionLayerState(keys=s.keys[row, start:p], values=s.values[row, start:p])
                            for s in attn))
        out[p], start = tuple(blocks), p
    return out


def checkpoints_from_prefill(found: PrefillCheckpoints, provenance, histories: Sequence[Sequence[int]],
                             kv_state: ModelState, interval: int, numerics: str | None = None,
                             bases: Sequence[Checkpoint | None] | None = None, by_row: bool = False,
                             rows: Sequence[int] | None = None) -> list[Checkpoint] | list[list[Checkpoint]]:
    """The cache checkpoints among a prefill's in-call states (`prefill_chunk(..., checkpoint_stride=...)`).

    provenance: [B] provenance of the rows after the call. histories[b]: the tokens row b has absorbed (at least
    up to each checkpoint). kv_state: the state after the call, or any later state of the same rows (the keys
    and values of a prefix never change; its rows' origin is the checkpoints', so rows no other model has advanced
    since). Kept: valid checkpoints at positive multiples of `interval`. numerics: the `numerics_key` of the model
    that ran the prefill (None: unknown). bases[b]: the checkpoint row b was restored from before the call (None:
    a fresh row), whose key/value blocks the new checkpoints of the row share (`prefix_blocks`; in-call states at or
    before its position are left out: it holds them); so do the new checkpoints of one row among themselves.
    InputError for a base whose tokens are not the row's first tokens. by_row: a list per row (ascending positions)
    instead of one list. rows: for each row of `found` and `provenance`, the row of `kv_state`, `histories` and
    `bases` it is, or None to skip it (default: the same; `generate` prefills a group of requests of one prompt once,
    and pads the prefill's rows with unused copies). by_row lists only the rows not skipped.
    """
    out = []
    pos, valid, provenance = np.asarray(found.position), np.asarray(found.valid), np.asarray(provenance)
    origin = np.asarray(kv_state.origin)
    keep = valid & (pos > 0) & (pos % interval == 0)
    rows = range(pos.shape[0]) if rows is None else rows
    if len(rows) != pos.shape[0]:
        raise InputError(f"rows names {len(rows)} rows for {pos.shape[0]} rows of checkpoints")
    for r, b in enumerate(rows):
        if b is None:
            continue
        base = bases[b] if bases is not None else None
        start = base.position if base is not None else 0
        if base is not None and tuple(base.tokens) != tuple(int(t) for t in histories[b][:start]):
            raise InputError(f"bases[{b}] is a checkpoint of another sequence than row {b}'s (its {start} tokens are "
                             f"not the row's first): its keys and values are not the row's")
        slots = {int(pos[r, j]): j for j in np.nonzero(keep[r])[0] if pos[r, j] > start}  # (one per position)
        slots = [slots[p] for p in sorted(slots)]
        blocks = prefix_blocks(kv_state, b, [int(pos[r, j]) for j in slots], base)
        out.append([])
        for j in slots:
            p = int(pos[r, j])
            gdn = tuple(jax.tree.map(lambda x: x[r, j], g) for g in found.gdn)
            out[-1].append(Checkpoint(tokens=tuple(int(t) for t in histories[b][:p]), provenance=int(provenance[r]),
                                      gdn=gdn, kv_blocks=blocks[p], numerics=numerics, origin=int(origin[b])))
    return out if by_row else [ck for row in out for ck in row]


def state_from_checkpoints(template: ModelState, checkpoints: Sequence[Checkpoint | None]) -> ModelState:
    """A batched state whose row b continues from checkpoints[b] (a fresh row where None).

    `template` is a fresh state of the wanted batch size and capacity (`model.init_state(B, N)`); the result
    is a new array tree (the caller may donate it). A restored row's origin is its checkpoint's (`Checkpoint.origin`),
    so a model of other numerics continuing it marks it MIXED. checkpoints: any iterable (read once). InputError
    when the template is not a state or a checkpoint's layers differ from the template's in count, shape or dtype.
    """
    if not isinstance(template, ModelState):
        raise InputError(f"template must be a ModelState (model.init_state(batch_size, capacity)); got "
                         f"{type(template).__name__}")
    try:
        checkpoints = list(checkpoints)
    except TypeError:
        raise InputError(f"checkpoints must be a sequence of Checkpoint or None; got {type(checkpoints).__name__}") \
            from None
    if len(checkpoints) != template.batch_size:
        raise InputError(f"{len(checkpoints)} checkpoints for a state of {template.batch_size} rows")
    layers = list(template.layers)
    gdn_ids = [i for i, s in enumerate(layers) if isinstance(s, GDNLayerState)]
    attn_ids = [i for i, s in enumerate(layers) if isinstance(s, AttentionLayerState)]
    position = np.array(template.position)
    provenance = np.array(template.provenance)
    origin = np.array(template.origin)
    writes: dict[tuple[int, str], dict] = {}  # (layer, leaf) -> (id(part), start) -> (part, start, rows)
    checked: dict[int, Checkpoint] = {}  # id(as given) -> checked
    for b, ck in enumerate(checkpoints):
        if ck is None:
            continue
        if not isinstance(ck, Checkpoint):
            raise InputError(f"checkpoints[{b}] must be a jaxgdn.cache.Checkpoint or None; got {type(ck).__name__}")
        if ck.position > template.capacity and attn_ids:
            raise CapacityError(f"checkpoint of {ck.position} tokens exceeds the state's capacity "
                                f"{template.capacity}")
        if id(ck) in checked:  # (rows restored from one checkpoint: checked once)
            ck = checked[id(ck)]
        else:
            original = id(ck)
            ck = _checked(ck, f"checkpoints[{b}]")
            n_attn = len(ck.kv_blocks[0])
            if len(ck.gdn) != len(gdn_ids) or n_attn != len(attn_ids):
                raise InputError(f"checkpoint {b} holds {len(ck.gdn)} GDN and {n_attn} attention layers; the "
                                 f"state has {len(gdn_ids)} and {len(attn_ids)} (a checkpoint of another model)")
            for g, i in zip(ck.gdn, gdn_ids):
                extra = [name for name, row in g._asdict().items()
                         if row is not None and getattr(layers[i], name) is None]
                if extra:
                    raise InputError(f"checkpoint {b} carries {', '.join(extra)} (replay decode's open chunk, at "
                                     f"position {ck.position}, off the 64-token grid) that this state's model does "
                                     f"not keep: restore it into a state of a replay-mode model")
            rows = [(f"GDN layer {i}'s {name}", getattr(layers[i], name), row, 1) for i, g in zip(gdn_ids, ck.gdn)
                    for name, row in g._asdict().items() if row is not None]
            rows += [(f"attention layer {i}'s {name}", getattr(layers[i], name), getattr(kv, name), 2)
                     for block in ck.kv_blocks for i, kv in zip(attn_ids, block) for name in ("keys", "values")]
            for what, leaf, row, lead in rows:  # (shapes only: a KV block's first axis is its rows, `_checked`'s)
                want = tuple(row.shape[:1]) * (lead - 1) + tuple(leaf.shape[lead:])
                if tuple(row.shape) != want or row.dtype != leaf.dtype:
                    raise InputError(f"checkpoint {b}'s {what} is {row.dtype}{list(row.shape)}; the state holds "
                                     f"{leaf.dtype}{list(want)} per row (a checkpoint of a model of other shapes or "
                                     f"dtype)")
            checked[original] = ck
        parts = [(i, name, row, 0) for i, g in zip(gdn_ids, ck.gdn) for name, row in g._asdict().items()
                 if row is not None]  # (the leaves a grid checkpoint does not keep stay the template's zeros)
        start = 0
        for block in ck.kv_blocks:
            parts += [(i, name, getattr(kv, name), start) for i, kv in zip(attn_ids, block)
                      for name in ("keys", "values")]
            start += _block_rows(block)
        for i, name, part, at in parts:
            # an array several rows take (rows restored from one checkpoint, or from checkpoints of one sequence,
            # which share its key/value blocks) is written to all of them at once
            writes.setdefault((i, name), {}).setdefault((id(part), at), (part, at, []))[2].append(b)
        position[b] = ck.position
        provenance[b] = ck.provenance
        origin[b] = ck.origin
    for (i, name), parts in writes.items():
        given = getattr(layers[i], name)
        layers[i] = layers[i]._replace(**{name: placed_like(_written(given, list(parts.values())), given)})
    return ModelState(layers=tuple(layers), position=jnp.asarray(position, jnp.int32),
                      provenance=jnp.asarray(provenance, jnp.int32), origin=jnp.asarray(origin, jnp.int32))


_PARTS_PER_CALL = 16  # the most parts one `_write_parts` program writes: its compile grows with them (XLA:CPU, a
# [16, 32768, 4, 256] leaf: 0.15 / 0.49 / 1.72 s for 1 / 16 / 64 parts), each further call costs ~0.26 ms of host time


def _written(leaf: jax.Array, parts: list[tuple]) -> jax.Array:
    """A copy of `leaf` [B, N, ...] with each (part [n, ...], start, rows) of `parts` written at [r, start:start + n]
    for every r in rows. Parts of one shape go in one jitted call (`_write_parts`; up to `_PARTS_PER_CALL` a call),
    their count padded to a power of two, so a restore compiles once per leaf shape, part shape and power of two,
    whatever its pattern of rows and lengths, and launches a few programs, not one per block (a call per block cost
    ~0.26 ms of host time each on an H100, run 156)."""
    B = leaf.shape[0]
    out = jnp.copy(leaf)  # (the template stays the caller's; the copy is donated and written in place)
    groups: dict[tuple, list[tuple]] = {}
    for part, start, rows in parts:
        groups.setdefault((tuple(part.shape), str(part.dtype)), []).append((part, start, rows))
    for group in (g[k:k + _PARTS_PER_CALL] for g in groups.values() for k in range(0, len(g), _PARTS_PER_CALL)):
        count = next_pow2(len(group))
        rows = np.full((count, B), B, np.int32)  # (padding: row B, out of range, which the scatter drops)
        starts = np.zeros((count,), np.int32)
        for j, (_, start, taken) in enumerate(group):
            rows[j, :len(taken)] = taken
            starts[j] = start
        arrays = tuple(part for part, _, _ in group) + (group[0][0],) * (count - len(group))
        out = _write_parts(out, arrays, rows, starts)
    return out


@functools.partial(jit, donate_argnums=0)
def _write_parts(leaf, parts, rows, starts):
    """`leaf` with parts[j] [n, ...] written at [r, starts[j]:starts[j] + n] for every r in rows[j] (int32 [B],
    padded with B, which is dropped), in place (the leaf donated): one scatter per part, no loop whose trip count
    the host would read."""
    for j, part in enumerate(parts):
        update = jnp.broadcast_to(part[None].astype(leaf.dtype), (rows.shape[1],) + part.shape)
        index = (rows[j][:, None], starts[j] + jnp.arange(part.shape[0])[None, :])
        leaf = leaf.at[index].set(update, mode="drop")
    return leaf


def _held_bytes(checkpoints: Iterable[Checkpoint]) -> int:
    """The bytes of `checkpoints` together: every array they hold once (the key/value blocks of a sequence are the
    same arrays in each of its checkpoints, whatever tuples hold them)."""
    return sum(int(x.nbytes) for x in {id(x): x for ck in checkpoints for x in _leaves(ck)}.values())


def _leaves(ck: Checkpoint) -> list:
    return jax.tree.leaves((ck.gdn, ck.kv_blocks))


def _block_rows(block: KVBlock) -> int:
    """The rows of a key/value block (0 for a model without attention layers)."""
    return int(np.shape(block[0].keys)[0]) if block else 0


def _sharing_held_blocks(ck: Checkpoint, keys: dict[int, bytes], entries: Mapping[bytes, "_Entry"]) -> Checkpoint:
    """`ck` with its leading key/value blocks replaced by those of the longest held entry that ends where one of its
    blocks ends (`keys`: position -> prefix key, for the grid positions before ck's), so that requests that computed a
    common prefix apart (identical prompts in one batch, a prompt again) hold its keys and values once. Only in a
    deterministic cache, whose entries all equal a fresh prefill of their prefix bit for bit (`check_cache`'s
    `recompute`), so the held blocks are the new ones' bits; `ck` itself when nothing is held."""
    ends = np.cumsum([_block_rows(b) for b in ck.kv_blocks])
    for j in reversed(range(len(ends) - 1)):  # (the last block ends at ck's own position)
        held = entries.get(keys.get(int(ends[j]), b""))
        if held is not None and held.checkpoint.tokens == ck.tokens[:int(ends[j])]:
            if len(held.checkpoint.kv_blocks) == j + 1 and all(
                    a is b for a, b in zip(held.checkpoint.kv_blocks, ck.kv_blocks)):
                return ck  # (already shared)
            return dataclasses.replace(ck, kv_blocks=held.checkpoint.kv_blocks + ck.kv_blocks[j + 1:])
    return ck


def _prefix_keys(tokens: Sequence[int], interval: int, upto: int) -> list[tuple[int, bytes]]:
    """(position, sha256 of the prefix) for every grid position <= upto; chained per interval block."""
    arr = np.asarray(tokens, np.int64)
    h = hashlib.sha256(b"jaxgdn-prefix")
    out = []
    for p in range(interval, upto + 1, interval):
        h.update(arr[p - interval:p].tobytes())
        out.append((p, h.copy().digest()))
    return out


@dataclasses.dataclass(frozen=True)
class CacheStats:
    entries: int
    bytes: int
    hits: int
    misses: int
    hit_tokens: int
    refused_writes: int
    evictions: int


@dataclasses.dataclass(frozen=True)
class _Entry:
    checkpoint: Checkpoint
    last_used: int


def numerics_key(model) -> str:
    """What decides a model's state bits: its weights (`Model.weights_digest`: a fine-tune or an RL policy update of
    the same architecture computes other states), the architecture (a digest of its `ModelConfig`: a "tiny-next"
    state has the shapes of a "tiny" one), deterministic mode, the GDN prefill arithmetic, the activation dtype, the
    kernel backend (resolved: None is the device's default), the GDN q/k/v channel layout (`jaxgdn.sharding`: a conv
    state's channels follow it) and the mesh a model is placed on (a split projection sums in other pieces). A cache
    holds states of one kind only (`PrefixCache.bound_to`). Last, `tag`: the model's `numerics_tag` (a digest of
    the fields above but the weights and the mesh), which a checkpoint carries as its `origin`."""
    from .sharding import layout_groups, mesh_of  # local: the sharding module imports this one

    mesh = mesh_of(model)
    placed = "x".join(f"{name}{size}" for name, size in mesh.shape.items()) if mesh is not None else "none"
    config = model.config.digest()[:12]
    return (f"config={config}, weights={model.weights_digest}, deterministic={bool(model.deterministic)}, "
            f"gdn_prefill={model.gdn_prefill}, dtype={jnp.dtype(model.dtype).name}, "
            f"backend={resolve_backend(model.backend)}, qkv_groups={layout_groups(model.config)}, mesh={placed}, "
            f"tag={model.numerics_tag}")


def _key_fields(key: str) -> dict[str, str]:
    """A `numerics_key`'s fields, name -> value."""
    return dict(part.split("=", 1) for part in key.split(", ") if "=" in part)


def _key_difference(held: str, other: str) -> str:
    """The fields in which two `numerics_key`s differ, as 'name: held -> other' (the whole keys where they do not
    parse as fields)."""
    a, b = _key_fields(held), _key_fields(other)
    changed = [f"{name}: {a.get(name)} -> {b.get(name)}" for name in {**a, **b} if a.get(name) != b.get(name)]
    if len(changed) > 1:  # the tag follows from the other fields: named alone only when nothing else differs
        changed = [c for c in changed if not c.startswith("tag: ")]
    return "; ".join(changed) if changed else f"{held} -> {other}"


def _key_tag(numerics: str | None) -> int:
    """The `numerics_tag` a `numerics_key` names (0: none, or no key)."""
    tag = _key_fields(numerics).get("tag", "0") if numerics is not None else "0"
    return int(tag) if tag.isdigit() else 0


@dataclasses.dataclass(frozen=True)
class PrefixCache:
    """Immutable prefix cache. `interval`: checkpoint grid (a multiple of 64); `max_bytes`: LRU byte budget;
    `numerics`: the `numerics_key` of the model whose states it holds (set by the first `generate` through it, or
    by the first checkpoint inserted whose numerics are known); `origin`: the `Model.numerics_tag` of the states it
    holds (0: not yet known; set with `numerics`, or by the first checkpoint admitted whose `origin` is known), so
    that a cache whose numerics are not yet known still holds states of one kind only.

    The checkpoints of one sequence share the attention key/value blocks of their common prefix
    (`Checkpoint.kv_blocks`): those `generate` makes of a prompt of n intervals hold n intervals of keys and values,
    and the checkpoints of a later request that continued from a cached one share its blocks. `nbytes` and
    `max_bytes` count every array once; evicting an entry frees its GDN states and the blocks no other entry holds.
    In a deterministic cache, a checkpoint inserted past a held entry of its prefix takes that entry's blocks (the same
    bits: every entry is a fresh prefill's), so requests that computed a common prefix apart (rows of one batch, a
    prompt sent again) hold it once; a non-deterministic cache keeps a copy per request there."""

    interval: int = DEFAULT_INTERVAL
    deterministic: bool = True
    max_bytes: int | None = None
    numerics: str | None = None
    origin: int = 0
    _entries: Mapping[bytes, _Entry] = dataclasses.field(default_factory=dict, repr=False)
    _clock: int = 0
    _counts: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)  # hits, misses, hit_tokens, refused, evictions

    def __post_init__(self):
        # Checked and normalised to Python ints / bools: a float interval used to pass here and fail in the first
        # lookup (`range`), a NaN budget evicted every entry, and deterministic=None made a non-deterministic cache.
        try:
            interval = index_value(self.interval)
        except TypeError:
            interval = None
        if interval is None or interval <= 0 or interval % CHUNK:
            raise InputError(f"interval must be a positive multiple of {CHUNK}; got {self.interval!r}")
        if not isinstance(self.deterministic, (bool, np.bool_)):
            raise InputError(f"deterministic must be True or False; got {self.deterministic!r}")
        max_bytes = self.max_bytes
        if max_bytes is not None:
            if isinstance(max_bytes, (float, np.floating)) and np.isfinite(max_bytes) and max_bytes == int(max_bytes):
                max_bytes = int(max_bytes)  # a whole number written as a float (8e9) is a byte count
            try:
                max_bytes = index_value(max_bytes)
            except TypeError:
                raise InputError(f"max_bytes must be an integer number of bytes >= 0, or None; got {max_bytes!r}") \
                    from None
            if max_bytes < 0:
                raise InputError(f"max_bytes must be >= 0; got {max_bytes}")
        if self.numerics is not None and not isinstance(self.numerics, str):
            raise InputError(f"numerics must be a `numerics_key` string or None; got {self.numerics!r}")
        if not is_int(self.origin) or not 0 <= int(self.origin) < 2**31:
            raise InputError(f"origin must be a `Model.numerics_tag` or 0; got {self.origin!r}")
        origin = int(self.origin) or _key_tag(self.numerics)
        if self.origin and _key_tag(self.numerics) not in (0, origin):
            raise InputError(f"origin {self.origin} is not the numerics_tag of `numerics` ({_key_tag(self.numerics)})")
        object.__setattr__(self, "origin", origin)
        object.__setattr__(self, "interval", interval)
        object.__setattr__(self, "deterministic", bool(self.deterministic))
        object.__setattr__(self, "max_bytes", max_bytes)

    # ---- reading -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        """The bytes the entries hold: their GDN states, and every key/value block once (blocks are shared)."""
        return _held_bytes(e.checkpoint for e in self._entries.values())

    def checkpoints(self) -> list[Checkpoint]:
        """Every entry, least recently used first."""
        return [e.checkpoint for e in sorted(self._entries.values(), key=lambda e: e.last_used)]

    def stats(self) -> CacheStats:
        h, m, ht, r, ev = self._counts
        return CacheStats(entries=len(self), bytes=self.nbytes, hits=h, misses=m, hit_tokens=ht, refused_writes=r,
                          evictions=ev)

    def bound_to(self, numerics: str) -> "PrefixCache":
        """This cache for a model of `numerics` (`numerics_key`): the same cache, marked with it if unmarked. A cache
        already holding another kind of state raises `CheckpointRefused`: restoring a state made by other numerics
        (a chunked prefill's into a token-by-token model, say) would silently change the results."""
        if self.numerics is None:
            if self.origin not in (0, _key_tag(numerics)):
                raise CheckpointRefused(f"this cache holds states of numerics_tag {self.origin} (checkpoints made "
                                        f"without `model=`); the model using it has numerics_tag "
                                        f"{_key_tag(numerics)}: use one cache per kind of model")
            return dataclasses.replace(self, numerics=numerics, origin=_key_tag(numerics))
        if self.numerics != numerics:
            raise CheckpointRefused(f"this cache holds states of a model with {self.numerics}; the model using it has "
                                    f"{numerics} (differing: {_key_difference(self.numerics, numerics)}; use one "
                                    f"cache per kind of model, and a new cache when the weights change)")
        return self

    def accepts(self, checkpoint: Checkpoint) -> bool:
        """Whether `insert` would admit `checkpoint` into this cache: on the grid; not MIXED (continued by a model of
        other numerics than the one that began it); when deterministic, produced by prefill alone (on the grid);
        computed with the cache's numerics where both are known; no larger than the byte budget. A malformed
        checkpoint raises InputError, as in `insert`."""
        return self._refusal(_checked(checkpoint, "checkpoint"), self.numerics, self.origin) is None

    def _refusal(self, ck: Checkpoint, numerics: str | None, origin: int = 0) -> str | None:
        """Why the admission rule refuses `ck` into a cache of states of `numerics` and `origin` (their
        `numerics_tag`; 0 where unknown) (None: admitted)."""
        if ck.numerics is not None and numerics is not None and ck.numerics != numerics:
            return (f"this checkpoint was computed by a model with {ck.numerics}; this cache holds states of a "
                    f"model with {numerics} (differing: {_key_difference(numerics, ck.numerics)}; restored, it would "
                    f"silently give other bits)")
        if not (ck.position > 0 and ck.position % self.interval == 0):
            return f"position {ck.position} is not on the cache grid (a positive multiple of {self.interval})"
        tag = origin or _key_tag(ck.numerics)  # (`origin` is the tag of `numerics` wherever that is known)
        if ck.origin and tag and ck.origin != tag:
            return (f"this checkpoint's state was computed by a model of numerics_tag {ck.origin}; this cache holds "
                    f"states of numerics_tag {tag} (another config or q/k/v layout, deterministic mode, GDN prefill, "
                    f"dtype or kernel backend; restored, it would silently give other bits)")
        if ck.provenance == Provenance.MIXED:
            return ("this state is MIXED: a model of other numerics continued what another computed, so it is "
                    "neither model's state (jaxgdn.state.ModelState.origin)")
        if self.deterministic and ck.provenance != Provenance.PREFILL:
            return (f"deterministic cache admits only prefill-produced states (provenance PREFILL); this "
                    f"state is {Provenance(ck.provenance).name}: a decode-produced or off-grid-split GDN "
                    f"state is not bitwise equal to a prefill of the same prefix")
        if self.max_bytes is not None and ck.nbytes > self.max_bytes:
            return f"checkpoint of {ck.nbytes} bytes exceeds the cache budget of {self.max_bytes} bytes"
        return None

    def _replace(self, **kw) -> "PrefixCache":
        return dataclasses.replace(self, **kw)

    # ---- lookup --------------------------------------------------------------------------------------------
    def lookup(self, prompts: Sequence[Sequence[int]]) -> tuple[list[Checkpoint | None], "PrefixCache"]:
        """For each prompt, the longest cached prefix of at most len(prompt) - 1 tokens (None on a miss).

        prompts: a sequence of prompts, each a non-empty flat sequence (list, tuple, NumPy or JAX array) of
        non-negative integer token ids; InputError otherwise (nothing is counted then).
        Returns (checkpoints, new cache) — the new cache records recency and hit statistics.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):
            raise InputError(f"prompts must be a sequence of prompts (lists of token ids); got "
                             f"{type(prompts).__name__}")
        if is_flat_ids(prompts):
            raise InputError("prompts must be a sequence of prompts (got one flat sequence of ids: wrap it in a list)")
        checked = []
        for i, tokens in enumerate(prompts):
            tokens = _token_tuple(tokens, f"prompt {i}")
            if not tokens:
                raise InputError(f"prompt {i} is empty")
            checked.append(tokens)
        entries = dict(self._entries)
        clock = self._clock
        h, m, ht, r, ev = self._counts
        found = []
        for tokens in checked:
            hit = None
            for p, key in reversed(_prefix_keys(tokens, self.interval, len(tokens) - 1)):
                e = entries.get(key)
                if e is not None and e.checkpoint.tokens == tokens[:p]:
                    hit = e.checkpoint
                    clock += 1
                    entries[key] = _Entry(hit, clock)
                    break
            found.append(hit)
            h, m, ht = (h + 1, m, ht + hit.position) if hit else (h, m + 1, ht)
        return found, self._replace(_entries=entries, _clock=clock, _counts=(h, m, ht, r, ev))

    # ---- insert --------------------------------------------------------------------------------------------
    def insert(self, checkpoints: Checkpoint | Sequence[Checkpoint], *, skip_refused: bool = False) -> "PrefixCache":
        """A new cache holding `checkpoints` too (the old cache is unchanged).

        A checkpoint the admission rule refuses raises `CheckpointRefused` (naming the rule), or with
        `skip_refused=True` is counted in `stats().refused_writes` and left out. So is a checkpoint computed with
        other numerics than the cache's states (`Checkpoint.numerics`, when both are known), or of another
        `numerics_tag` (`Checkpoint.origin` against `PrefixCache.origin`); an unbound cache takes the numerics and
        the tag of the first checkpoint it admits that knows them. Least recently used entries are evicted until
        the byte budget holds (`nbytes`: an evicted entry frees the arrays no remaining entry holds — its GDN states,
        and the key/value blocks no other checkpoint of its sequence shares); a checkpoint larger than the whole
        budget is refused. A prefix already cached
        keeps its entry (its recency refreshed), unless the new checkpoint's state was produced more exactly
        (`Provenance`: a prefill's replaces a decode-produced one, in a cache that admits both).

        A malformed checkpoint — not a `Checkpoint`, tokens that are not a flat sequence of non-negative integer ids,
        attention keys/values not one row per token, an unknown provenance — raises InputError, `skip_refused` or
        not (the whole call then inserts nothing). Tokens given as a list or an array are stored as a tuple.
        """
        if isinstance(checkpoints, Checkpoint):
            checkpoints = [checkpoints]
        if isinstance(checkpoints, (str, bytes)) or not isinstance(checkpoints, Iterable):
            raise InputError(f"checkpoints must be a Checkpoint or a sequence of them; got "
                             f"{type(checkpoints).__name__}")
        checkpoints = [_checked(ck, f"checkpoints[{i}]") for i, ck in enumerate(checkpoints)]
        entries = dict(self._entries)
        clock = self._clock
        h, m, ht, refused, ev = self._counts
        numerics, origin = self.numerics, self.origin
        for ck in checkpoints:
            problem = self._refusal(ck, numerics, origin)
            if problem:
                if not skip_refused:
                    raise CheckpointRefused(problem)
                refused += 1
                continue
            numerics = numerics if ck.numerics is None else ck.numerics
            origin = origin or _key_tag(numerics) or ck.origin
            keys = _prefix_keys(ck.tokens, self.interval, ck.position)
            key = keys[-1][1]
            old = entries.get(key)
            if old is not None and old.checkpoint.tokens != ck.tokens:
                raise RuntimeError("sha256 prefix collision")  # never silently alias two prefixes
            if old is None and self.deterministic:
                ck = _sharing_held_blocks(ck, dict(keys[:-1]), entries)
            clock += 1
            # An existing entry for the same prefix is kept (deterministic: identical anyway), recency refreshed —
            # unless the new one was produced more exactly (a lower Provenance: a prefill's state replaces a
            # decode-produced one of the same prefix in a non-deterministic cache)
            keep = old is not None and int(old.checkpoint.provenance) <= int(ck.provenance)
            entries[key] = _Entry(old.checkpoint if keep else ck, clock)
        if self.max_bytes is not None:
            held = {key: {id(x): x for x in _leaves(e.checkpoint)} for key, e in entries.items()}  # distinct arrays
            holders = {}  # id(array) -> how many entries hold it
            for arrays in held.values():
                for i in arrays:
                    holders[i] = holders.get(i, 0) + 1
            total = _held_bytes(e.checkpoint for e in entries.values())
            for key, e in sorted(entries.items(), key=lambda kv: kv[1].last_used):
                if total <= self.max_bytes:
                    break
                for i, x in held[key].items():  # an array is freed with the last entry holding it
                    holders[i] -= 1
                    if not holders[i]:
                        total -= int(x.nbytes)
                del entries[key]
                ev += 1
        return self._replace(_entries=entries, _clock=clock, _counts=(h, m, ht, refused, ev), numerics=numerics,
                             origin=origin)


def check_cache(cache: PrefixCache, model, recompute: bool = False) -> None:
    """Assert the cache's invariants (chex assertions; raises AssertionError naming the entry).

    The cache's numerics, where known, the model's (`numerics_key`), and every entry's, where known, the cache's; its
    bytes within `max_bytes`. Every entry on the grid, computed by a model of the model's `numerics_tag` where its
    origin is known (and the cache's tag, where known, the model's), stored under its own prefix's key (an entry
    under another key is never found and blocks the insertion of that prefix), its tokens a tuple of the model's
    token ids, its provenance one of a state that absorbed tokens (not MIXED), finite, matching the model's state
    spec in structure, shape and dtype; in deterministic mode every entry prefill-produced; with `recompute=True`
    every entry bitwise equal to a fresh prefill of its prefix. InputError when `cache` is not a PrefixCache or
    `model` not a Model (before any assertion).
    """
    from .model import Model, _prefill_jit, mesh_context  # local: the model module does not depend on the cache

    if not isinstance(cache, PrefixCache):
        raise InputError(f"check_cache(cache, model): cache must be a jaxgdn.PrefixCache (the first argument); got "
                         f"{type(cache).__name__}")
    if not isinstance(model, Model):
        raise InputError(f"check_cache(cache, model): model must be a jaxgdn.Model (the second argument); got "
                         f"{type(model).__name__}")
    spec = jax.eval_shape(lambda: model.init_state(1, 1))
    gdn_spec = tuple(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), at_boundary(s))
                     for s in spec.layers if isinstance(s, GDNLayerState))  # entries lie on the grid
    attn_spec = [s for s in spec.layers if isinstance(s, AttentionLayerState)]
    if cache.numerics is not None:
        chex.assert_equal(cache.numerics, numerics_key(model),
                          custom_message="the cache holds states of a model with other numerics")
    if cache.max_bytes is not None:
        chex.assert_equal(cache.nbytes <= cache.max_bytes, True,
                          custom_message=f"the cache holds {cache.nbytes} bytes, over its budget of {cache.max_bytes}")
    vocab = model.config.vocab_size
    absorbed = [int(p) for p in Provenance if p not in (Provenance.FRESH, Provenance.MIXED)]
    for key, entry in sorted(cache._entries.items(), key=lambda kv: kv[1].last_used):
        ck = entry.checkpoint
        where = f"entry at position {ck.position}"
        chex.assert_equal(ck.position % cache.interval, 0, custom_message=f"{where} is off the grid")
        chex.assert_equal(ck.position > 0, True, custom_message=f"{where} is empty")
        chex.assert_equal(type(ck.tokens) is tuple and all(is_int(t) and 0 <= t < vocab for t in ck.tokens), True,
                          custom_message=f"{where}: its tokens are not a tuple of token ids in [0, {vocab})")
        chex.assert_equal(key, _prefix_keys(ck.tokens, cache.interval, ck.position)[-1][1],
                          custom_message=f"{where} is stored under another prefix's key")
        chex.assert_equal(ck.provenance in absorbed, True,
                          custom_message=f"{where} has provenance {ck.provenance!r}, not one of {absorbed}")
        if ck.numerics is not None:
            chex.assert_equal(ck.numerics, numerics_key(model) if cache.numerics is None else cache.numerics,
                              custom_message=f"{where} was computed with other numerics than the cache's")
        chex.assert_equal(ck.origin in (0, model.numerics_tag) and cache.origin in (0, model.numerics_tag), True,
                          custom_message=f"{where}'s state was computed by a model of numerics_tag {ck.origin}, not "
                                         f"the model's {model.numerics_tag}")
        chex.assert_tree_all_finite((ck.gdn, ck.kv_blocks), custom_message=f"{where} is not finite")
        chex.assert_trees_all_equal_structs(ck.gdn, gdn_spec)
        chex.assert_trees_all_equal_shapes_and_dtypes(ck.gdn, gdn_spec, custom_message=where)
        rows = 0
        for block in ck.kv_blocks:  # each block [L, HKV, Dh] per attention layer, the blocks' rows the prefix's
            n = _block_rows(block)
            kv_spec = tuple(AttentionLayerState(*(jax.ShapeDtypeStruct((n,) + x.shape[2:], x.dtype) for x in s))
                            for s in attn_spec)
            chex.assert_trees_all_equal_shapes_and_dtypes(block, kv_spec, custom_message=where)
            rows += n
        chex.assert_equal(rows if attn_spec else ck.position, ck.position,
                          custom_message=f"{where}: its key/value blocks hold {rows} rows")
        if cache.deterministic:
            chex.assert_equal(ck.provenance, int(Provenance.PREFILL),
                              custom_message=f"{where} is not prefill-produced in a deterministic cache")
        if recompute:
            toks = jnp.asarray([ck.tokens], jnp.int32)
            with mesh_context(model):  # on a mesh, the kernels per shard, as `generate` computed the checkpoint
                state, _ = _prefill_jit(model, model.init_state(1, ck.position), toks,
                                        jnp.asarray([ck.position], jnp.int32))
            fresh = checkpoint_from_state(state, 0, ck.tokens)
            chex.assert_trees_all_equal((ck.gdn, ck.kv), (fresh.gdn, fresh.kv),
                                        custom_message=f"{where} differs from a fresh prefill of its prefix")
