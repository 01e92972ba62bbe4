"""Where the replay step (`replay.py`) reads the open chunk's q, k, v, g and beta from, and the clearing of the
model's open-chunk buffers when a chunk completes.

Dimension legend as in `reference.py`; C = 64 (the chunk), Cqkv = 2 HK K + HV V (the packed channels).

Two sources:
  separate arrays  q, k [B, C, HK, K], v [B, C, HV, V], g, beta [B, C, HV] (the kernel API's form);
  packed buffers   qkv [B, C, Cqkv] in `groups` groups of [q_g | k_g | v_g] (G = 1: Hugging Face's [q | k | v]; the
                   model's open-chunk buffer, `jaxgdn.state.GDNLayerState.open_qkv`) and gates [B, C, 2, HV] (g,
                   beta: `open_gates`).
The kernels' block specs pick a head's columns out of either, so the model hands its buffers over as they are: no
q / k / v slices copied per step (115 us per decode step of the 4-layer Qwen3.5-9B slice at B=64 on the H200 when
they were: BENCHMARKS.md). A kernel's refs are the same in both cases ([C, K] per head and row).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .reference import CHUNK


class Heads(NamedTuple):
    """The GDN layer's head shape: HK key heads of width K, HV value heads of width V."""
    HK: int
    HK_dim: int  # K
    HV: int
    HV_dim: int  # V


class OpenChunk(NamedTuple):
    """The open chunk as the replay step's kernels read it: `groups` is None for separate arrays (q, k, v, g, beta
    as the kernel API takes them), else the packed buffers' group count (then q is k is v = qkv [B, C, Cqkv] and g
    is beta = gates [B, C, 2, HV])."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    heads: Heads
    groups: int | None = None

    @classmethod
    def separate(cls, q, k, v, g, beta) -> "OpenChunk":
        return cls(q, k, v, g, beta, Heads(q.shape[2], q.shape[3], v.shape[2], v.shape[3]))

    @classmethod
    def packed(cls, qkv, gates, heads: Heads, groups: int) -> "OpenChunk":
        check_packed(qkv, gates, heads, groups)
        return cls(qkv, qkv, qkv, gates, gates, heads, groups)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def spec(self, name: str, index, rows=None) -> pl.BlockSpec:
        """The block spec of operand `name` ("q", "k", "v", "g" or "beta") for one row and head: index(*program ids)
        -> (row, head) (a key head for q and k, a value head otherwise); rows=B: every row (the kernel picks its
        rows: [B, C, ...] refs), index's row then 0."""
        HK, K, HV, V = self.heads
        if self.groups is None:
            if name in ("g", "beta"):
                return pl.BlockSpec((rows, CHUNK, None), lambda *ids: (index(*ids)[0], 0, index(*ids)[1]))
            width = K if name in ("q", "k") else V
            return pl.BlockSpec((rows, CHUNK, None, width), lambda *ids: (index(*ids)[0], 0, index(*ids)[1], 0))
        if name in ("g", "beta"):
            which = 0 if name == "g" else 1
            return pl.BlockSpec((rows, CHUNK, None, None), lambda *ids: (index(*ids)[0], 0, which, index(*ids)[1]))
        col = {"q": self._q_col, "k": self._k_col, "v": self._v_col}[name]
        width = K if name in ("q", "k") else V
        return pl.BlockSpec((rows, CHUNK, width), lambda *ids: (index(*ids)[0], 0, col(index(*ids)[1])))

    # the packed buffer's column block of a head, in units of the block width (K for q and k, V for v)
    def _group_width(self) -> int:
        HK, K, HV, V = self.heads
        return (2 * HK * K + HV * V) // self.groups

    def _q_col(self, hk):
        per = self.heads.HK // self.groups
        return (hk // per) * (self._group_width() // self.heads.HK_dim) + hk % per

    def _k_col(self, hk):
        return self._q_col(hk) + self.heads.HK // self.groups

    def _v_col(self, h):
        HK, K, HV, V = self.heads
        per = HV // self.groups
        return (h // per) * (self._group_width() // V) + 2 * (HK // self.groups) * K // V + h % per


def packable(heads: Heads, groups: int) -> bool:
    """Whether the kernels can read q, k and v out of a packed buffer of this layout: every head's columns start on
    a multiple of its width."""
    HK, K, HV, V = heads
    if groups < 1 or HK % groups or HV % groups:
        return False
    width = (2 * HK * K + HV * V) // groups
    return width % K == 0 and width % V == 0 and (2 * (HK // groups) * K) % V == 0


def check_packed(qkv, gates, heads: Heads, groups: int):
    HK, K, HV, V = heads
    if not packable(heads, groups):
        raise ValueError(f"a packed q/k/v buffer of {groups} groups with heads {tuple(heads)} cannot be read in "
                         f"place: a head's columns must start on a multiple of its width")
    C = 2 * HK * K + HV * V
    if qkv.ndim != 3 or qkv.shape[1:] != (CHUNK, C):
        raise ValueError(f"qkv must be [B, {CHUNK}, {C}] (2 HK K + HV V); got {list(qkv.shape)}")
    if gates.shape != (qkv.shape[0], CHUNK, 2, HV):
        raise ValueError(f"gates must be [B, {CHUNK}, 2, {HV}]; got {list(gates.shape)}")


def split_packed(qkv, heads: Heads, groups: int):
    """[..., Cqkv] in `groups` groups of [q_g | k_g | v_g] -> q, k [..., HK, K], v [..., HV, V] (copies)."""
    HK, K, HV, V = heads
    lead = qkv.shape[:-1]
    grouped = qkv.reshape(*lead, groups, qkv.shape[-1] // groups)
    kd = HK // groups * K
    q = grouped[..., :kd].reshape(*lead, HK, K)
    k = grouped[..., kd:2 * kd].reshape(*lead, HK, K)
    v = grouped[..., 2 * kd:].reshape(*lead, HV, V)
    return q, k, v


def _clear_kernel(len_ref, qkv_ref, gates_ref, qkv_out, gates_out):
    """Grid (blocks, B): the block's part of row b's buffers zeroed when the row's chunk completed (lengths 64)."""
    del qkv_ref, gates_ref  # aliased to the outputs: blocks not written keep their values
    done = len_ref[0] == CHUNK
    first = pl.program_id(0) == 0  # (read outside the branches: interpret mode has no program ids inside them)

    @pl.when(done)
    def _():
        qkv_out[...] = jnp.zeros(qkv_out.shape, qkv_out.dtype)

    @pl.when(done & first)
    def _():
        gates_out[...] = jnp.zeros(gates_out.shape, gates_out.dtype)


def pow2_divisor(n: int, limit: int) -> int:
    """The largest power of two <= limit that divides n."""
    b = 1
    while b * 2 <= limit and n % (b * 2) == 0:
        b *= 2
    return b


def clear_completed(qkv, gates, lengths, *, interpret: bool = False):
    """The open-chunk buffers with the rows whose chunk completed this step (lengths == 64) zeroed, in place when the
    caller donates them (a Pallas kernel: the rows' blocks are written, nothing else is read or written). XLA's
    scatter of zero rows walked every element of [B, C, Cqkv] — 40 us per layer and decode step at B=64 on the
    H200, a full pass — to write the few rows that complete. qkv [B, C, Cqkv], gates [B, C, 2, HV], lengths [B]."""
    B = qkv.shape[0]
    flat_q = qkv.reshape(B, -1)  # a row's buffer is contiguous: blocks of a power of two that divides it
    flat_g = gates.reshape(B, -1)
    bq = pow2_divisor(flat_q.shape[1], 16384)
    bg = pow2_divisor(flat_g.shape[1], 16384)
    if flat_g.shape[1] != bg:  # the gates in one block (a power of two); else XLA
        return clear_by_select(qkv, gates, lengths)
    nq = flat_q.shape[1] // bq
    q_out, g_out = pl.pallas_call(
        _clear_kernel,
        grid=(nq, B),
        in_specs=[pl.BlockSpec((1,), lambda c, b: (b,)), pl.BlockSpec((None, bq), lambda c, b: (b, c)),
                  pl.BlockSpec((None, bg), lambda c, b: (b, 0))],
        out_specs=[pl.BlockSpec((None, bq), lambda c, b: (b, c)), pl.BlockSpec((None, bg), lambda c, b: (b, 0))],
        out_shape=[jax.ShapeDtypeStruct(flat_q.shape, flat_q.dtype), jax.ShapeDtypeStruct(flat_g.shape, flat_g.dtype)],
        input_output_aliases={1: 0, 2: 1},
        interpret=interpret,
        name="gdn_open_chunk_clear",
    )(lengths, flat_q, flat_g)
    return q_out.reshape(qkv.shape), g_out.reshape(gates.shape)


def clear_by_select(qkv, gates, lengths):
    """`clear_completed` by XLA's select (a pass over the buffers): the reference backend's, and where the gates'
    row is not one power-of-two block."""
    done = lengths == CHUNK
    return (jnp.where(done[:, None, None], jnp.zeros((), qkv.dtype), qkv),
            jnp.where(done[:, None, None, None], jnp.zeros((), gates.dtype), gates))
