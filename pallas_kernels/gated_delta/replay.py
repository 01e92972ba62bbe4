"""Replay decode over the chunked prefill: one new token per row, computed with the chunked prefill's own arithmetic
(`chunk.py`, split design, inv="tiled"), but only the part of the open chunk the new row needs.

Dimension legend as in `reference.py`; C = 64 (the chunk), S = 16 (a block row of the tiled inverse).

A row's replay state is the fp32 state S0 at the last 64-token grid boundary, the open chunk's inputs (the caller
keeps them: q, k, v, g, beta of the n - 1 tokens since the boundary, the new token at row n - 1), and two caches of
what earlier tokens of the open chunk computed:
  x_cache  [B, HV, C, C NVB]  fp32  block rows of the tiled inverse X = (I + A)^-1 that are complete (rows < 16 i),
                                   one copy per V block (NVB = V // bv: `replay_caches`);
  vn_cache [B, HV, C, V]  fp32  v_new = u - w S0 of those rows.
The step for the token at row t (block row i = t // 16) recomputes block row i of the prefill's prep — its
diagonal tile by substitution, its merged tiles from the cached block rows above it (`wy.merged_block_row`), its
w and u rows (`chunk._wy_block_row`) — then v_new of those rows (`chunk._v_new`, the 64-row dot with S0), the output
rows (`chunk._out_rows`: q k^T, qg S0 and Aqk v_new as 64-row dots) and keeps row t. When block row i completes
(t = 16 i + 15) its X tiles and v_new rows go into the caches; when the chunk completes (t = 63) the new boundary
state is `chunk._next_state` of the whole chunk, written over S0 (`input_output_aliases`; otherwise S0 is not written),
and the caches are cleared, so that they hold exactly what `prime` leaves for the same tokens.

Grid (V // bv, HV, B): each program takes one V block of the recurrence's width `bv` (64 at V = 128) and recomputes
the V-independent part (the inverse's block row, w) itself.

Why the bits equal the prefill's: every value is traced by the same helper functions as the prefill on the same tile
shapes with the same launch (4 warps), and the chunked kernels are row-causal bit for bit (a row's results do not
depend on later rows, which are padding here and real tokens in a prefill: the "j < 64 rows" property the GPU
script checks). The output kernel's dots run on V blocks of 128 in the prefill and of `bv` here: on the GPU an MMA
element does not depend on the instruction's N (BENCHMARKS.md, runs 6, 21 and 37); in interpret mode XLA:CPU's dots
gave the same bits for N = 64 and 128 in the V = 128 test (an observation about XLA:CPU, not a rule; the other
tests' V of 16 and 32 is one block for both). On the GPU the equality is a property of the compiled code,
checked bitwise on the H200 by `scripts/gpu_kernels.py --only replay_step`; on CPU (interpret mode) by the tests.

`prime` fills the caches for an open chunk that a prefill left behind: the step at rows 15, 31 and 47 where the
open chunk reaches them (the step itself, so the caches hold exactly what decode steps would have written).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import chunk as ck
from . import wy
from .wy import CHUNK, SUB

NB = CHUNK // SUB  # block rows of the tiled inverse


def _placed(tiles: dict, n_cols: int, dtype=jnp.float32):
    """{block row b: [S, n]} -> [C, n] with each tile at rows 16 b .. 16 b + 15 and zeros elsewhere (exact: selects)."""
    row_block = lax.broadcasted_iota(jnp.int32, (NB, SUB, n_cols), 0)
    out = jnp.zeros((NB, SUB, n_cols), dtype)
    for b, tile in tiles.items():
        out = jnp.where(row_block == b, jnp.broadcast_to(tile[None].astype(dtype), (NB, SUB, n_cols)), out)
    return out.reshape(CHUNK, n_cols)


def _placed_vector(slices: list):
    """Four [S] vectors -> [C] (the chunk's gc as the prep kernel writes it)."""
    return _placed({b: x[:, None] for b, x in enumerate(slices)}, 1)[:, 0]


def _step_block_row(i, n, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, x_ref, vn_ref, o_ref, s_out, x_out, vn_out, *,
                    scale, use_l2, wk_dtype, cfg, interpret):
    """The step for a token at row t = n - 1 of block row i (static)."""
    t = n - 1
    K = k_ref.shape[-1]
    V = v_ref.shape[-1]
    ks, gcs, betas, valids = ck._chunk_slices(k_ref, g_ref, beta_ref, n, use_l2, start=0)
    # block row i of the tiled inverse: the diagonal tile by substitution, the rest merged from the cached rows above
    x = {(i, i): wy.diag_tiles_by_substitution([ks[i]], [gcs[i]], [betas[i]], cfg, interpret)[0]}
    for j in range(i):
        for m in range(j + 1):
            x[j, m] = x_ref[pl.ds(j * SUB, SUB), pl.ds(m * SUB, SUB)]
    if i:
        x.update(wy.merged_block_row(i, ks, gcs, betas, x, cfg, interpret))
    bks, bvs = ck._wy_rhs_slices(ks, gcs, betas, valids, v_ref)
    w, u = ck._wy_block_row(i, x, bks, bvs, cfg, interpret)
    w64 = _placed({i: w.astype(wk_dtype)}, K, wk_dtype)  # as the recurrence reads w: stored in `_wk_dtype`
    u64 = _placed({i: u}, V)
    rows = lax.broadcasted_iota(jnp.int32, (CHUNK, V), 0)
    cached = jnp.where(rows < i * SUB, vn_ref[...], 0.0)  # v_new of the complete block rows above
    s0 = s_ref[...]  # [K, V] of this program's V block
    v_new = ck._v_new(u64, w64, s0, cfg, interpret)
    in_row = (rows >= i * SUB) & (rows < (i + 1) * SUB)
    vn64 = jnp.where(in_row, v_new, cached)  # rows below block row i: zeros (their tokens are padding)
    ht, vt = ck._transposed(cfg)
    valid = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0) < n
    o = ck._out_rows(valid, q_ref, k_ref, _placed_vector(gcs), s0.T if ht else s0, vn64.T if vt else vn64,
                     scale=scale, use_l2=use_l2, cfg=cfg, interpret=interpret)
    # row t: every other term -0.0, which leaves any value (a signed zero included) as it is, in any order
    o_ref[...] = jnp.sum(jnp.where(rows == t, o, -0.0), axis=0).astype(o_ref.dtype)

    if i < NB - 1:
        @pl.when(t == (i + 1) * SUB - 1)  # block row i is complete: cache its tiles and v_new rows
        def _():
            for m in range(i + 1):  # this V block's copy: no program reads what another writes
                x_out[pl.ds(i * SUB, SUB), pl.ds(m * SUB, SUB)] = x[i, m]

            vn_out[...] = vn64
    else:
        @pl.when(t == CHUNK - 1)  # the chunk is complete: the new boundary state, as the recurrence computes it
        def _():
            g_last = wy.last(gcs[-1])
            kd64 = _placed({b: ck._kd_slice(ks[b], gcs[b], g_last).astype(wk_dtype) for b in range(NB)}, K, wk_dtype)
            s_out[...] = ck._next_state(s0, g_last, kd64, vn64, cfg, interpret)
            x_out[...] = jnp.zeros(x_out.shape, jnp.float32)  # the next chunk starts empty: caches as `prime` leaves
            vn_out[...] = jnp.zeros(vn_out.shape, jnp.float32)  # them, so a state is a function of its tokens


def _step_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, x_ref, vn_ref, o_ref, s_out, x_out, vn_out,
                 **kw):
    n = len_ref[0]  # tokens in the open chunk, the new one included (0: a row with nothing to do)

    @pl.when(n == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    for i in range(NB):
        pl.when((n > i * SUB) & (n <= (i + 1) * SUB))(functools.partial(
            _step_block_row, i, n, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, x_ref, vn_ref, o_ref, s_out, x_out,
            vn_out, **kw))


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "config"))
def _step_impl(q, k, v, g, beta, state, x_cache, vn_cache, lengths, *, scale, use_qk_l2norm, interpret, config):
    B, _, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // HK
    cfg = ck._checked_config(config, V)
    if cfg["design"] != "split" or cfg["inv"] != "tiled" or cfg["prep_kernels"] != 1:
        raise ValueError("the replay step reproduces the split design with inv='tiled' and one prep kernel")
    if not cfg["warps_prep"] == cfg["warps_state"] == cfg["warps_out"]:
        raise ValueError("the replay step runs the prep, recurrence and output arithmetic in one kernel: it needs "
                         "warps_prep == warps_state == warps_out (an MMA's bits depend on the warps sharing it)")
    wk_dtype = ck._wk_dtype(cfg, use_qk_l2norm, interpret)
    bv = min(cfg["bv"], V)  # V block: the recurrence's (its v_new dot and state update, taken the same way)

    def head(*tail):  # a per-(row, value head) array [B, HV, *tail], whole
        return pl.BlockSpec((None, None) + tail, lambda j, h, b: (b, h) + (0,) * len(tail))

    def cols(*tail):  # the same, its last axis in this program's V block
        return pl.BlockSpec((None, None) + tail, lambda j, h, b: (b, h) + (0,) * (len(tail) - 1) + (j,))

    key = pl.BlockSpec((None, CHUNK, None, K), lambda j, h, b: (b, 0, h // G, 0))
    value = pl.BlockSpec((None, CHUNK, None, bv), lambda j, h, b: (b, 0, h, j))
    token = pl.BlockSpec((None, CHUNK, None), lambda j, h, b: (b, 0, h))
    o, state, x_cache, vn_cache = pl.pallas_call(
        functools.partial(_step_kernel, scale=scale, use_l2=use_qk_l2norm, wk_dtype=wk_dtype, cfg=cfg,
                          interpret=interpret),
        grid=(V // bv, HV, B),
        in_specs=[pl.BlockSpec((1,), lambda j, h, b: (b,)), key, key, value, token, token, cols(K, bv),
                  cols(CHUNK, CHUNK), cols(CHUNK, bv)],
        out_specs=[cols(bv), cols(K, bv), cols(CHUNK, CHUNK), cols(CHUNK, bv)],
        out_shape=[jax.ShapeDtypeStruct((B, HV, V), v.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32),
                   jax.ShapeDtypeStruct(x_cache.shape, jnp.float32), jax.ShapeDtypeStruct(vn_cache.shape, jnp.float32)],
        input_output_aliases={6: 1, 7: 2, 8: 3},
        compiler_params=ck._triton_params(cfg["warps_out"], 1),
        interpret=interpret,
        name="gdn_replay_step",
    )(lengths, q, k, v, g, beta, state, x_cache, vn_cache)
    return o, state, x_cache, vn_cache


def _checked(q, k, v, g, beta, state, x_cache, vn_cache, lengths, scale, config):
    if q.ndim != 4 or k.shape != q.shape or q.shape[1] != CHUNK or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected the open chunk: q, k [B,{CHUNK},HK,K] and v [B,{CHUNK},HV,V]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    B, _, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    want = {"g": (g.shape, (B, CHUNK, HV)), "beta": (beta.shape, (B, CHUNK, HV)), "state": (state.shape, (B, HV, K, V)),
            "x_cache": (x_cache.shape, _x_cache_shape(B, HV, V, config)),
            "vn_cache": (vn_cache.shape, (B, HV, CHUNK, V)),
            "lengths": (jnp.shape(lengths), (B,))}
    for name, (got, shape) in want.items():
        if tuple(got) != shape:
            raise ValueError(f"{name} must be {list(shape)}; got {list(got)}")
    ck._check_pow2("K", K)
    ck._check_pow2("V", V)
    return float(K**-0.5 if scale is None else scale)


def _x_cache_shape(B: int, HV: int, V: int, config=None) -> tuple:
    bv = min(ck._checked_config(config, V)["bv"], V)
    return B, HV, CHUNK, CHUNK * (V // bv)


def replay_caches(B: int, HV: int, V: int, config=None):
    """Empty caches for rows whose open chunk is empty: x_cache [B, HV, C, C (V // bv)] (the tiles, one copy per V
    block of the configuration's `bv`) and vn_cache [B, HV, C, V], fp32."""
    return jnp.zeros(_x_cache_shape(B, HV, V, config), jnp.float32), jnp.zeros((B, HV, CHUNK, V), jnp.float32)


def chunk_replay_step_pallas(q, k, v, g, beta, state, x_cache, vn_cache, lengths, *, scale=None, use_qk_l2norm=True,
                             interpret=False, config=None):
    """One replay decode step per row over the chunked prefill (module docstring).

    q, k: [B, 64, HK, K] and v: [B, 64, HV, V], g, beta: [B, 64, HV]: the open chunk, lengths[b] tokens valid in row b
    (the new one last; rows after it are ignored: padding); state: fp32 [B, HV, K, V] at the boundary; x_cache,
    vn_cache: the caches (`replay_caches`, `prime`). lengths[b] = 0: nothing is computed for the row (its output is
    zeros, its state and caches unchanged).
    Returns (o [B, HV, V] of the new token, in v.dtype; state: the new boundary state where lengths == 64, else the
    same; x_cache, vn_cache updated). The state and caches are updated in place when the caller donates them.
    """
    scale = _checked(q, k, v, g, beta, state, x_cache, vn_cache, lengths, scale, config)
    config = None if config is None else tuple(sorted(dict(config).items()))
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, CHUNK)
    return _step_impl(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state.astype(jnp.float32),
                      x_cache, vn_cache, lengths, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                      interpret=bool(interpret), config=config)


def chunk_replay_prime_pallas(q, k, v, g, beta, state, lengths, *, scale=None, use_qk_l2norm=True, interpret=False,
                              config=None):
    """The caches for open chunks a prefill left (lengths[b] tokens of q, k, v, g, beta [B, 64, ...] after the boundary
    state `state`): the step at rows 15, 31 and 47 of each row that reaches them, in order. Returns (x_cache,
    vn_cache)."""
    B, HV, V = v.shape[0], v.shape[2], v.shape[3]
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, CHUNK)

    def complete_block_row(i, caches):  # the step at row 16 i - 1 where the row reaches it (0: nothing to do)
        reach = jnp.where(lengths >= i * SUB, i * SUB, 0)
        return chunk_replay_step_pallas(q, k, v, g, beta, state, *caches, reach, scale=scale,
                                        use_qk_l2norm=use_qk_l2norm, interpret=interpret, config=config)[2:]

    # a loop, not three calls: one kernel to compile
    return lax.fori_loop(1, NB, complete_block_row, replay_caches(B, HV, V, config))
