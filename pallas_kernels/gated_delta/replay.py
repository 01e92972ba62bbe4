"""Replay decode step: one new token per row, computed with exactly the prefill's arithmetic (EXACT_CONFIG of
`chunk.py`), one row at a time — a Pallas-Triton kernel for the H200 (interpretable on CPU).

Dimension legend as in `reference.py`; C = 64 (the chunk), i = the new token's row in the open chunk.

Why this is possible: in the exact configuration every per-row quantity of a chunk — the cumulative gate gc_i,
the row A[i, :], the WY inverse's row X[i, :] (forward substitution), w_i, u_i, v_new_i = u_i - w_i S and the
output o_i — is computed by FMA chains (`_dot(..., "fma")`) whose result for row i depends only on rows <= i and
not on how many rows the tile holds. So a decode step can compute row i alone, on a 16-row tile, and get the
bits a prefill of the whole sequence computes for that position, if it keeps what the rows before i produced.

Per row of the batch the state holds (`jaxgdn.state.GDNLayerState`, replay mode): S [HV, K, V] fp32 at the last
grid boundary; the open chunk's inputs (post-conv q|k|v and the gates, rows < i); X [HV, C, C] and
v_new [HV, C, V] fp32 of those rows. Rows >= i of the open buffers are never read (masked), so they may hold
anything (the rows of an earlier chunk, say).

One program per (V block, value head, batch row); each program:
  1. recomputes from the open chunk (rows <= i) the normalised keys, gc and A's 16-row block holding row i;
  2. X[i, :] = e_i - A[i, :] X (rows < i of X from the state);
  3. w_i, u_i (X's block rows @ (beta exp(gc) k), (beta v)), v_new_i = u_i - w_i S;
  4. o_i = scale q_i exp(gc_i) S + sum_{j <= i} Aqk[i, j] v_new_j;
  5. writes X's and v_new's block (row i new), and, when the chunk is full (i = 63), the new boundary state
     S exp(gc_63) + kd^T v_new — in place (`input_output_aliases`; callers donate the state).
A row with i < 0 is skipped (its state stays bit-identical).

The prefill kernels write X and v_new of the last chunk (`chunk_gated_delta_rule_pallas(..., return_open=True)`),
so a decode can continue any prefill that ended inside a chunk, and a prefill can continue any decode (it replays
the open chunk from its inputs).

Status (H200, BENCHMARKS.md, 2026-11-29): correct — 150 steps of it equal the exact prefill bit for bit, outputs
and boundary states — but slow: 7.5 ms per step at B=64 (bv=128, 4 warps; 88x the recurrent kernel), and the
exact prefill is 54-58x the default one. Triton lowers an fp32 "ieee" dot to FMAs that hold each thread's whole
K extent of both operands in registers, which spills at K = 128. So `jaxgdn`'s replay decode mode does not use
this kernel yet; it still recomputes the open chunk with the default prefill kernels each step. Since that run the
"fma" dots take K in slices of 16 (`chunk._fma_dot`; a different but equally row-exact association), which keeps
each thread's operands small: not yet measured. The other way out: the same row-exact structure on 16-row
tensor-core tiles in both kernels (an MMA row does not depend on the tile's other rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config import merged_config
from .chunk import (CHUNK, EXACT_CONFIG, _SUB, _block_slice, _chunk_gc, _dot, _exact_a_block, _exact_block_rows,
                    _exact_x_row, _intra, _last, _load_key, _pick_row, _triton_params, _wy_rhs)

# Launch configuration (bv: V block per program). On the H200 at B=64, with unsliced FMA dots, every configuration
# took 7.5-12.8 ms per step (bv128/w4 7.47, bv128/w8 7.94, bv64/w8 8.37, bv64/w4 9.50, bv32/w4 12.79): see the
# module docstring. Not re-tuned since the dots take K in slices.
DEFAULT_CONFIG = dict(bv=64, num_warps=4, num_stages=1)


def _replay_kernel(idx_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, x_ref, vn_ref,
                   o_ref, so_ref, xo_ref, vno_ref, *, scale, use_l2, interpret):
    i = idx_ref[0]

    @pl.when(i >= 0)
    def _():
        blk = lax.div(i, _SUB)
        r = lax.rem(i, _SUB)
        sl = _block_slice(blk)
        rows64 = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
        rows = _exact_block_rows(blk)
        valid = rows64 <= i
        kn = _load_key(k_ref, valid, use_l2, True, interpret)  # [C, K] as the prep and output kernels load it
        g = jnp.where(valid, g_ref[...].astype(jnp.float32), 0.0)
        beta = jnp.where(valid, beta_ref[...].astype(jnp.float32), 0.0)
        gc = _chunk_gc(g, True, interpret)
        a_blk, gcb = _exact_a_block(k_ref, beta_ref, kn, g, gc, blk, i + 1, use_l2, interpret)
        x_prev = jnp.where((rows64 < i)[:, None], x_ref[...], 0.0)  # what the prefill's loop holds at row i
        x_row = _exact_x_row(a_blk, x_prev, i, r, interpret)
        xb = jnp.where((rows == i)[:, None], x_row[None, :], jnp.where((rows < i)[:, None], x_ref[sl, :], 0.0))
        v = jnp.where(valid[:, None], v_ref[...].astype(jnp.float32), 0.0)
        bk, bv = _wy_rhs(kn, v, beta, gc)
        w_b = _dot(xb, bk, "fma", interpret)
        u_b = _dot(xb, bv, "fma", interpret)
        s = s_ref[...]
        vn_b = u_b - _dot(w_b, s, "fma", interpret)  # [16, BV]; row r is v_new_i
        vn_row = _pick_row(vn_b, r)
        vn = jnp.where((rows64 == i)[:, None], vn_row[None, :],
                       jnp.where((rows64 < i)[:, None], vn_ref[...], 0.0))  # [C, BV]
        q = _load_key(q_ref.at[sl], rows <= i, use_l2, True, interpret) * scale
        aqk, qg = _intra(q, kn, gc, EXACT_CONFIG, interpret, rows=rows, gc_rows=gcb)
        o = _dot(qg, s, "fma", interpret) + _dot(aqk, vn, "fma", interpret)
        o_ref[...] = _pick_row(o, r).astype(o_ref.dtype)
        xo_ref[sl, :] = xb
        vno_ref[sl, :] = vn_b

        @pl.when(i == CHUNK - 1)
        def _():  # the chunk is full: the new boundary state, as the prefill's recurrence computes it
            kd = kn * jnp.exp(_last(gc) - gc)[:, None]
            so_ref[...] = s * jnp.exp(_last(gc)) + _dot(kd, vn, "fma", interpret, trans_a=True)


def _columns(groups: int, HK: int, K: int, HV: int, V: int):
    """Column offsets in the mixed open buffer [.., C_mix] (G groups of [q_g | k_g | v_g]) of key head hk's q and
    k and value head h's v."""
    cg = (2 * HK * K + HV * V) // groups
    hkg, hvg = HK // groups, HV // groups

    def q_col(hk):
        return (hk // hkg) * cg + (hk % hkg) * K

    def k_col(hk):
        return (hk // hkg) * cg + hkg * K + (hk % hkg) * K

    def v_col(h):
        return (h // hvg) * cg + 2 * hkg * K + (h % hvg) * V

    return q_col, k_col, v_col


@functools.partial(jax.jit, static_argnames=("groups", "scale", "use_qk_l2norm", "interpret", "config"))
def _replay_impl(open_qkv, open_gates, state, open_x, open_vnew, index, *, groups, scale, use_qk_l2norm, interpret,
                 config):
    cfg = merged_config("replay_gated_delta_step", DEFAULT_CONFIG, config, blocks={"bv": state.shape[3]})
    B, HV, K, V = state.shape
    HK = (open_qkv.shape[2] - HV * V) // (2 * K)
    G = HV // HK
    bv = min(cfg["bv"], V)
    q_col, k_col, v_col = _columns(groups, HK, K, HV, V)
    f32 = jnp.float32
    o, s, x, vn = pl.pallas_call(
        functools.partial(_replay_kernel, scale=scale, use_l2=use_qk_l2norm, interpret=interpret),
        grid=(V // bv, HV, B),
        in_specs=[
            pl.BlockSpec((1,), lambda j, h, b: (b,)),
            pl.BlockSpec((None, CHUNK, K), lambda j, h, b: (b, 0, q_col(h // G) // K)),
            pl.BlockSpec((None, CHUNK, K), lambda j, h, b: (b, 0, k_col(h // G) // K)),
            pl.BlockSpec((None, CHUNK, bv), lambda j, h, b: (b, 0, v_col(h) // bv + j)),
            pl.BlockSpec((None, CHUNK, None, None), lambda j, h, b: (b, 0, 0, h)),
            pl.BlockSpec((None, CHUNK, None, None), lambda j, h, b: (b, 0, 1, h)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, CHUNK, CHUNK), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, CHUNK, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, bv), lambda j, h, b: (b, h, j)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, CHUNK, CHUNK), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, CHUNK, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, HV, V), open_qkv.dtype),
            jax.ShapeDtypeStruct((B, HV, K, V), f32),
            jax.ShapeDtypeStruct((B, HV, CHUNK, CHUNK), f32),
            jax.ShapeDtypeStruct((B, HV, CHUNK, V), f32),
        ],
        input_output_aliases={6: 1, 7: 2, 8: 3},
        compiler_params=_triton_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="gdn_replay_step",
    )(index, open_qkv, open_qkv, open_qkv, open_gates, open_gates, state, open_x, open_vnew)
    return o, s, x, vn


def replay_gated_delta_step_pallas(open_qkv, open_gates, state, open_x, open_vnew, index, *, groups: int = 1,
                                   scale=None, use_qk_l2norm=True, interpret=False, config=None):
    """One replay decode step per row.

    open_qkv [B, C, C_mix]: the open chunk's post-conv q|k|v (G = `groups` groups of [q_g | k_g | v_g], as the
    model's in_proj_qkv lays them out), with the new token already written at row index[b]; open_gates
    [B, C, 2, HV] fp32: g and beta, likewise; state fp32 [B, HV, K, V]: the state at the chunk's start (the last
    grid boundary); open_x [B, HV, C, C], open_vnew [B, HV, C, V] fp32: X and v_new of the rows before index[b];
    index int32 [B]: the new token's row in the open chunk (position % 64), or -1 to leave a row untouched.

    Returns (o [B, HV, V] in open_qkv's dtype, state, open_x, open_vnew), the last three updated in place when
    donated: X's and v_new's row index[b] written, the state replaced by the next boundary state where
    index[b] == 63. Bitwise what `chunk_gated_delta_rule_pallas(..., config=EXACT_CONFIG)` computes for that
    token and state.
    """
    if state.ndim != 4 or state.dtype != jnp.float32:
        raise ValueError(f"state must be fp32 [B,HV,K,V]; got {state.dtype} {state.shape}")
    B, HV, K, V = state.shape
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n}: the Pallas-Triton kernel needs a power of two >= 16")
    if open_qkv.ndim != 3 or open_qkv.shape[:2] != (B, CHUNK):
        raise ValueError(f"open_qkv must be [B, {CHUNK}, C_mix] with B={B}; got {open_qkv.shape}")
    rest = open_qkv.shape[2] - HV * V
    if rest <= 0 or rest % (2 * K) or HV % (rest // (2 * K)):
        raise ValueError(f"open_qkv's {open_qkv.shape[2]} columns do not hold q, k [HK*{K}] and v [{HV}*{V}]")
    HK = rest // (2 * K)
    if HK % groups or HV % groups:
        raise ValueError(f"groups={groups} must divide the key heads ({HK}) and the value heads ({HV})")
    cg = open_qkv.shape[2] // groups
    if cg % K or (2 * (HK // groups) * K) % V or cg % V:
        raise ValueError(f"the open buffer's column groups ({cg}) do not align with K={K} and V={V} blocks")
    expect = {"open_gates": (B, CHUNK, 2, HV), "open_x": (B, HV, CHUNK, CHUNK), "open_vnew": (B, HV, CHUNK, V),
              "index": (B,)}
    for name, arr in (("open_gates", open_gates), ("open_x", open_x), ("open_vnew", open_vnew), ("index", index)):
        if arr.shape != expect[name]:
            raise ValueError(f"{name} must be {expect[name]}; got {arr.shape}")
    scale = float(K**-0.5 if scale is None else scale)
    config = None if config is None else tuple(sorted(dict(config).items()))
    return _replay_impl(open_qkv, open_gates.astype(jnp.float32), state, open_x.astype(jnp.float32),
                        open_vnew.astype(jnp.float32), jnp.asarray(index, jnp.int32), groups=groups, scale=scale,
                        use_qk_l2norm=bool(use_qk_l2norm), interpret=bool(interpret), config=config)
