"""Typed recurrent state of a batch of sequences (NamedTuples: leaves flatten in declaration order, so
`input_output_aliases` / donation indices are stable). Shapes use the legend in `jaxgdn.shapes`."""

from __future__ import annotations

import enum
from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import CHUNK, replay_caches
from pallas_kernels.attention import DEFAULT_CONFIG as _ATTENTION_CONFIG

from .config import LINEAR, ModelConfig
from .errors import CapacityError, InputError, bool_among_ints, index_value

ATTENTION_KEY_BLOCK = _ATTENTION_CONFIG["bk"]  # KV capacities are rounded up to it (`init_state`)


class Provenance(enum.IntEnum):
    """How a row's state was produced. Combined with max(): a taint survives later prefills."""

    FRESH = 0  # nothing absorbed yet (all zeros)
    # only prefill calls, each starting on the 64-token grid (or anywhere where that is exact: replay decode mode,
    # gdn_prefill="recurrent")
    PREFILL = 1
    PREFILL_OFF_GRID = 2  # a prefill call started off the grid: not equal to an unsplit prefill
    DECODE = 3  # a recurrent decode step touched it
    # a model of other numerics than the one that computed the row so far continued it (`ModelState.origin`): the
    # result is neither model's state (never cached)
    MIXED = 4


class GDNLayerState(NamedTuple):
    conv: jax.Array  # [B, KC-1, C] the last KC-1 pre-conv inputs, model dtype (exact)
    # [B, HV, K, V] fp32: the state at `position`, or, in replay decode mode over the chunked GDN prefill, at the
    # last 64-token grid boundary at or before `position`
    recurrent: jax.Array
    # Replay decode over the chunked prefill only (None otherwise; `Model.keeps_open_chunk`): the open chunk since
    # that boundary, position % 64 tokens valid, zeros after them: post-conv q|k|v [B, 64, C] in model dtype, and
    # the gates g, beta [B, 64, 2, HV] fp32
    open_qkv: jax.Array | None = None
    open_gates: jax.Array | None = None
    # With them, fp32, what the open chunk's tokens computed that a replay step reuses (`pallas_kernels.
    # chunk_replay_step`; zeros on the reference backend, which recomputes the open chunk): the tiled WY inverse's
    # rows so far [B, HV, 64, 64] (complete 16-row block rows, and the diagonal tile's rows of the one in progress)
    # and the open tokens' v_new = u - w S rows [B, HV, 64, V]
    open_x: jax.Array | None = None
    open_vnew: jax.Array | None = None


def at_boundary(s: GDNLayerState) -> GDNLayerState:
    """A GDN layer's state as kept at a 64-token grid boundary (prefill checkpoints, cache entries, decode snapshots):
    conv and recurrent only. Replay decode's open-chunk buffers are empty there (zeros: `init_state`'s) and are not
    stored; `cache.state_from_checkpoints` restores a row into a fresh state, whose buffers are those zeros."""
    if not isinstance(s, GDNLayerState):
        raise InputError(f"at_boundary takes a GDNLayerState; got {type(s).__name__}")
    return GDNLayerState(conv=s.conv, recurrent=s.recurrent)


class AttentionLayerState(NamedTuple):
    keys: jax.Array  # [B, N, HKV, Dh] normed and rotated keys
    values: jax.Array  # [B, N, HKV, Dh]


LayerState = Union[GDNLayerState, AttentionLayerState]


class PrefillCheckpoints(NamedTuple):
    """GDN states at grid points inside one prefill call (`prefill_chunk(..., checkpoint_stride=...)`)."""

    position: jax.Array  # [B, M] int32 absolute position of each checkpoint
    valid: jax.Array  # [B, M] bool: the checkpoint lies within the row's tokens of this call
    gdn: tuple[GDNLayerState, ...]  # per GDN layer, conv and recurrent [B, M, ...] (`at_boundary`: no open buffers)


class ModelState(NamedTuple):
    layers: tuple[LayerState, ...]  # one per layer, in layer order
    position: jax.Array  # [B] int32 tokens absorbed
    provenance: jax.Array  # [B] int32 Provenance
    # [B] int32 `Model.numerics_tag` of the model that last advanced the row (restored from a cache checkpoint:
    # the checkpoint's `origin`); 0 where unclaimed (a fresh row; one moved by `jaxgdn.sharding.convert_layout`
    # from a config rather than a Model). A model continuing a row another model's numerics computed marks it
    # Provenance.MIXED (its `prefill_chunk` / `decode_step` methods refuse to)
    origin: jax.Array

    @property
    def batch_size(self) -> int:
        return self.position.shape[0]

    @property
    def capacity(self) -> int:
        """KV capacity N (0 for a model without attention layers)."""
        for layer in self.layers:
            if isinstance(layer, AttentionLayerState):
                return layer.keys.shape[1]
        return 0


MAX_CAPACITY = 2**31 - CHUNK  # KV positions per row: they are int32 (`jaxgdn.generate.MAX_ROW_TOKENS` too)


def checked_sizes(batch_size, capacity) -> tuple[int, int]:
    """A state's batch_size and capacity as Python ints (hashable), each an integer >= 1, the capacity at most
    `MAX_CAPACITY` (CapacityError beyond); InputError otherwise."""
    try:
        batch_size, capacity = index_value(batch_size), index_value(capacity)
    except TypeError:
        raise InputError(f"batch_size and capacity must be integers; got {batch_size!r}, {capacity!r}") from None
    if batch_size < 1 or capacity < 1:
        raise InputError(f"batch_size and capacity must be >= 1; got {batch_size}, {capacity}")
    if capacity > MAX_CAPACITY:
        raise CapacityError(f"capacity {capacity} is past the {MAX_CAPACITY} KV positions a row can hold (positions "
                            f"are int32)")
    return batch_size, capacity


STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))  # the model dtypes (`jaxgdn.model.MODEL_DTYPES`)


def check_state_dtype(dtype) -> None:
    """InputError unless `dtype` is one a model computes in (float32 or bfloat16)."""
    try:
        ok = jnp.dtype(dtype) in STATE_DTYPES
    except TypeError:
        ok = False
    if not ok:
        raise InputError(f"dtype must be float32 or bfloat16; got {dtype!r}")


def init_state(config: ModelConfig, batch_size: int, capacity: int, dtype=jnp.float32,
               replay: bool = False) -> ModelState:
    """A fresh (all-zero) state for `batch_size` sequences of up to `capacity` tokens (`replay`: with the open
    chunk buffers of replay decode over the chunked prefill). The KV capacity is rounded up to a multiple of the
    attention kernel's key block (ATTENTION_KEY_BLOCK, 64): a cache of another length would be copied into a
    padded one at every call (measured on the H200: ~0.18 ms per attention layer and decode step at B=64 with 1104
    slots). `dtype`: the model's activation dtype (float32 or bfloat16; InputError otherwise), which conv, KV and
    open-chunk q|k|v buffers are kept in."""
    batch_size, capacity = checked_sizes(batch_size, capacity)
    check_state_dtype(dtype)
    capacity = -(-capacity // ATTENTION_KEY_BLOCK) * ATTENTION_KEY_BLOCK
    layers = []
    for t in config.layer_types:
        if t == LINEAR:
            hv = config.linear_num_value_heads
            open_x, open_vnew = replay_caches(batch_size, hv, config.linear_value_head_dim) if replay else (None, None)
            layers.append(GDNLayerState(
                conv=jnp.zeros((batch_size, config.linear_conv_kernel_dim - 1, config.gdn_conv_dim), dtype),
                recurrent=jnp.zeros((batch_size, hv, config.linear_key_head_dim, config.linear_value_head_dim),
                                    jnp.float32),
                open_qkv=jnp.zeros((batch_size, CHUNK, config.gdn_conv_dim), dtype) if replay else None,
                open_gates=jnp.zeros((batch_size, CHUNK, 2, hv), jnp.float32) if replay else None,
                open_x=open_x, open_vnew=open_vnew))
        else:
            shape = (batch_size, capacity, config.num_key_value_heads, config.head_dim)
            layers.append(AttentionLayerState(keys=jnp.zeros(shape, dtype), values=jnp.zeros(shape, dtype)))
    return ModelState(layers=tuple(layers), position=jnp.zeros((batch_size,), jnp.int32),
                      provenance=jnp.zeros((batch_size,), jnp.int32), origin=jnp.zeros((batch_size,), jnp.int32))


def checked_rows(rows, batch_size: int):
    """`rows` (one int, or a flat sequence or array of ints) as a flat integer index array; InputError for a bool,
    a non-integer, an empty or a nested selection, and for concrete rows outside [-B, B). Traced rows (under `jit`)
    are checked for dtype and rank only: JAX's indexing clamps their values."""
    B = batch_size
    if isinstance(rows, jax.core.Tracer):
        if not jnp.issubdtype(rows.dtype, jnp.integer) or rows.ndim > 1 or rows.size == 0:
            raise InputError(f"rows must be one integer or a flat, non-empty integer array; got "
                             f"{rows.dtype}{list(rows.shape)}")
        return jnp.reshape(rows, (-1,))
    try:
        r = np.asarray(rows)
    except (TypeError, ValueError):  # ragged or nested sequences
        raise InputError("rows must be one integer or a flat sequence of integer row indices") from None
    if r.size == 0:
        raise InputError("rows is empty: a state holds at least one row")
    if r.dtype == np.bool_ or bool_among_ints(rows):
        raise InputError("rows must be integer row indices, not bools (for a mask, pass np.flatnonzero(mask))")
    if not np.issubdtype(r.dtype, np.integer):
        raise InputError(f"rows must be integer row indices; got {r.dtype}")
    if r.ndim > 1:
        raise InputError(f"rows must be one integer or a flat sequence of them; got shape {r.shape}")
    if r.min() < -B or r.max() >= B:
        raise InputError(f"rows must lie in [0, {B}) (or [-{B}, 0)); got {r.tolist()}")
    return np.atleast_1d(r)


def select_rows(state: ModelState, rows) -> ModelState:
    """The state of the given batch rows, in the order given: `rows` is one int (a one-row state: the batch axis is
    kept) or a flat list, NumPy or JAX array of ints in [-B, B). A row may be named more than once (its state is
    copied, e.g. to sample one prompt several ways). Every leaf is indexed on its leading axis.

    InputError for something other than a ModelState, and for rows that are bools, not integers, empty or nested,
    or (concrete) outside [-B, B) — JAX's indexing would clamp them silently; under `jit`, traced rows are checked
    for dtype and rank only."""
    if not isinstance(state, ModelState):
        raise InputError(f"state must be a jaxgdn ModelState; got {type(state).__name__}")
    rows = checked_rows(rows, state.batch_size)
    return jax.tree.map(lambda x: x[rows], state)
