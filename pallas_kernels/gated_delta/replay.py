"""Replay decode over the chunked prefill: one new token per row, computed with the chunked prefill's own arithmetic
(`chunk.py`, split design, inv="tiled"), but only the part of the open chunk the new row needs.

Dimension legend as in `reference.py`; C = 64 (the chunk), S = 16 (a block row of the tiled inverse).

A row's replay state is the fp32 state S0 at the last 64-token grid boundary, the open chunk's inputs (the caller
keeps them: q, k, v, g, beta of the n - 1 tokens since the boundary, the new token at row n - 1), and two caches of
what earlier tokens of the open chunk computed:
  x_cache  [B, HV, C, C]  fp32  block rows of the tiled inverse X = (I + A)^-1 that are complete (rows < 16 i);
  vn_cache [B, HV, C, V]  fp32  v_new = u - w S0 of those rows.
The step for the token at row t (block row i = t // 16) runs three kernels, split as the prefill splits its own:
  1. `gdn_replay_prep`, grid (HV, B), the prefill prep's warps: block row i of the prep — its diagonal tile by
     substitution, its merged tiles from the cached block rows above it (`wy.merged_block_row`), its w and u rows
     (`chunk._wy_block_row`), written out as the prefill's prep kernel writes them (w in `_wk_dtype`, u fp32), and
     kd where the chunk completes;
  2. `gdn_replay_intra`, grid (HV, B), the output kernel's warps: Aqk and qg (`chunk._intra_rows`, 64-row as in
     the prefill's output kernel), of which it writes block row i;
  3. `gdn_replay_out`, grid (V // bv_replay, HV, B), the recurrence's and output kernel's warps (they must be
     equal): v_new of block row i (`chunk._v_new`, the 64-row dot with S0, the rows placed among zeros), the output
     rows (`chunk._out_dots`, 64-row dots), of which it keeps row t.
When block row i completes (t = 16 i + 15) its X tiles (kernel 1) and v_new rows (kernel 3) go into the caches; when
the chunk completes (t = 63) the new boundary state is `chunk._next_state` of the whole chunk, written over S0
(`input_output_aliases`; otherwise S0 is not written), and the caches are cleared, so that they hold exactly what
`prime` leaves for the same tokens. Only the V-dependent part runs per V block; one kernel doing everything (before
2026-11-30's runs 39-40) recomputed the prep and q k^T in every V block's program and spilled registers (ptxas
offline: 255 registers, 516 B of spill stores; now 216 / 225 / 255 registers, 0 / 0 / 20 B).

Why the bits equal the prefill's: every value is traced by the same helper functions as the prefill on the same tile
shapes with the same warps, and the chunked kernels are row-causal bit for bit (a row's results do not
depend on later rows, which are padding here and real tokens in a prefill: the "j < 64 rows" property the GPU
script checks). The prefill's dots run on V blocks of `bv` (64; `bv_small`, 32, on small grids) in its recurrence and
of 128 in its output kernel, the replay step's on blocks of `bv_replay`: on the GPU an MMA
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


def _placed(tiles, n_cols: int, dtype=jnp.float32):
    """[(block row b, [S, n])] -> [C, n] with each tile at rows 16 b .. 16 b + 15 and zeros elsewhere (exact:
    selects; b static or traced)."""
    row_block = lax.broadcasted_iota(jnp.int32, (NB, SUB, n_cols), 0)
    out = jnp.zeros((NB, SUB, n_cols), dtype)
    for b, tile in tiles:
        out = jnp.where(row_block == b, jnp.broadcast_to(tile[None].astype(dtype), (NB, SUB, n_cols)), out)
    return out.reshape(CHUNK, n_cols)


def _placed_vector(slices: list):
    """Four [S] vectors -> [C] (the chunk's gc as the prep kernel writes it)."""
    return _placed([(b, x[:, None]) for b, x in enumerate(slices)], 1)[:, 0]


def _prep_block_row(i, n, k_ref, v_ref, g_ref, beta_ref, x_ref, w_out, u_out, x_out, kd_out, *, use_l2, wk_dtype,
                    cfg, interpret):
    """Kernel 1 for a token at row t = n - 1 of block row i (static): rows 16 i .. 16 i + 15 of w and u."""
    t = n - 1
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
    w_out[...] = w.astype(wk_dtype)  # as the prefill's prep kernel stores w (`_wk_dtype`) for the recurrence
    u_out[...] = u

    if i < NB - 1:
        @pl.when(t == (i + 1) * SUB - 1)  # block row i is complete: cache its tiles
        def _():
            for m in range(i + 1):
                x_out[pl.ds(i * SUB, SUB), pl.ds(m * SUB, SUB)] = x[i, m]
    else:
        @pl.when(t == CHUNK - 1)  # the chunk is complete: kd for the boundary state (as the prefill's prep writes
        def _():  # it), and the next chunk starts empty (caches as `prime` leaves them: a state is its tokens')
            g_last = wy.last(gcs[-1])
            for b in range(NB):
                kd_out[pl.ds(b * SUB, SUB), :] = ck._kd_slice(ks[b], gcs[b], g_last).astype(wk_dtype)
            x_out[...] = jnp.zeros(x_out.shape, jnp.float32)


def _prep_step_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, x_ref, w_out, u_out, x_out, kd_out, **kw):
    """Kernel 1, grid (HV, B): the new token's block row of the prefill's prep (V-independent but for u)."""
    n = len_ref[0]  # tokens in the open chunk, the new one included (0: a row with nothing to do)

    @pl.when(n == 0)
    def _():
        w_out[...] = jnp.zeros(w_out.shape, w_out.dtype)
        u_out[...] = jnp.zeros(u_out.shape, u_out.dtype)

    for i in range(NB):
        pl.when((n > i * SUB) & (n <= (i + 1) * SUB))(functools.partial(
            _prep_block_row, i, n, k_ref, v_ref, g_ref, beta_ref, x_ref, w_out, u_out, x_out, kd_out, **kw))


def _block_row(x, i):
    """Rows 16 i .. 16 i + 15 of x [C, n] (i traced): the other block rows summed in as -0.0, exact in any order on
    the GPU (Triton's reduction has no initial value; in interpret mode XLA's starts from +0.0, so a -0.0 comes out
    +0.0: the same value for ==)."""
    row_block = lax.broadcasted_iota(jnp.int32, (NB, SUB, x.shape[-1]), 0)
    return jnp.sum(jnp.where(row_block == i, x.reshape(NB, SUB, x.shape[-1]), -0.0), axis=0)


def _intra_step_kernel(len_ref, q_ref, k_ref, g_ref, beta_ref, aqk_out, qg_out, *, scale, use_l2, cfg, interpret):
    """Kernel 2, grid (HV, B): the output's V-independent part (`chunk._intra_rows`: Aqk and qg, 64-row as in the
    prefill's output kernel, with its warps), of which it keeps the new token's block row."""
    n = len_ref[0]
    i = jnp.maximum(n - 1, 0) // SUB
    _, gcs, _, _ = ck._chunk_slices(k_ref, g_ref, beta_ref, n, use_l2, start=0)
    valid = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0) < n
    aqk, qg = ck._intra_rows(valid, q_ref, k_ref, lambda: _placed_vector(gcs), scale=scale, use_l2=use_l2, cfg=cfg,
                             interpret=interpret)
    aqk_out[...] = _block_row(aqk, i)
    qg_out[...] = _block_row(qg, i)


def _out_step_kernel(len_ref, k_ref, g_ref, beta_ref, w_ref, u_ref, aqk_ref, qg_ref, kd_ref, s_ref, vn_ref, o_ref,
                     s_out, vn_out, *, cfg, interpret):
    """Kernel 3, grid (V // bv, HV, B): v_new of the block row, the new token's output and, at the chunk's end, the
    boundary state, for one V block."""
    n = len_ref[0]

    @pl.when(n == 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(n > 0)
    def _():
        t = n - 1
        i = t // SUB  # the new token's block row (traced: the placements below are selects, exact for any i)
        K, V = w_ref.shape[-1], u_ref.shape[-1]
        w64 = _placed([(i, w_ref[...])], K, w_ref.dtype)
        u64 = _placed([(i, u_ref[...])], V)
        rows = lax.broadcasted_iota(jnp.int32, (CHUNK, V), 0)
        cached = jnp.where(rows < i * SUB, vn_ref[...], 0.0)  # v_new of the complete block rows above
        s0 = s_ref[...]  # [K, V] of this program's V block
        v_new = ck._v_new(u64, w64, s0, cfg, interpret)
        in_row = (rows >= i * SUB) & (rows < (i + 1) * SUB)
        vn64 = jnp.where(in_row, v_new, cached)  # rows below block row i: zeros (their tokens are padding)
        ht, vt = ck._transposed(cfg)
        o = ck._out_dots(_placed([(i, aqk_ref[...])], CHUNK), _placed([(i, qg_ref[...])], K),
                         lambda: s0.T if ht else s0, lambda: vn64.T if vt else vn64, cfg, interpret)
        # row t: every other term -0.0, which leaves any value as it is, in any order (a signed zero too on the GPU:
        # `_block_row`)
        o_ref[...] = jnp.sum(jnp.where(rows == t, o, -0.0), axis=0).astype(o_ref.dtype)

        @pl.when((t % SUB == SUB - 1) & (t < CHUNK - 1))  # a block row is complete: cache its v_new rows
        def _():
            vn_out[...] = vn64

        @pl.when(t == CHUNK - 1)  # the chunk is complete: the new boundary state, as the recurrence computes it
        def _():
            _, gcs, _, _ = ck._chunk_slices(k_ref, g_ref, beta_ref, n, False, start=0)
            s_out[...] = ck._next_state(s0, wy.last(gcs[-1]), kd_ref[...], vn64, cfg, interpret)
            vn_out[...] = jnp.zeros(vn_out.shape, jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "config"))
def _step_impl(q, k, v, g, beta, state, x_cache, vn_cache, lengths, *, scale, use_qk_l2norm, interpret, config):
    B, _, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // HK
    cfg = ck._checked_config(config, V)
    if cfg["design"] != "split" or cfg["inv"] != "tiled" or cfg["prep_kernels"] != 1:
        raise ValueError("the replay step reproduces the split design with inv='tiled' and one prep kernel")
    if cfg["warps_state"] != cfg["warps_out"]:
        raise ValueError("the replay step's last kernel runs the recurrence's and the output's dots: it needs "
                         "warps_state == warps_out (an MMA's bits depend on the warps sharing it)")
    warps_prep, warps_intra, warps_out = _launch_warps(cfg)
    wk_dtype = ck._wk_dtype(cfg, use_qk_l2norm, interpret)
    bv = min(cfg["bv_replay"], V)  # the last kernel's V block (on the GPU its dots' bits do not depend on it: N)

    def head(*tail):  # a per-(row, value head) array [B, HV, *tail], whole (grid (HV, B))
        return pl.BlockSpec((None, None) + tail, lambda h, b: (b, h) + (0,) * len(tail))

    def cols(*tail):  # the same, its last axis in this program's V block (grid (V // bv, HV, B))
        return pl.BlockSpec((None, None) + tail, lambda j, h, b: (b, h) + (0,) * (len(tail) - 1) + (j,))

    key = pl.BlockSpec((None, CHUNK, None, K), lambda h, b: (b, 0, h // G, 0))
    token = pl.BlockSpec((None, CHUNK, None), lambda h, b: (b, 0, h))
    length = pl.BlockSpec((1,), lambda h, b: (b,))

    # kernel 1, grid (HV, B): the block row of the prep
    w16, u16, x_cache, kd = pl.pallas_call(
        functools.partial(_prep_step_kernel, use_l2=use_qk_l2norm, wk_dtype=wk_dtype, cfg=cfg, interpret=interpret),
        grid=(HV, B),
        in_specs=[length, key, pl.BlockSpec((None, CHUNK, None, V), lambda h, b: (b, 0, h, 0)), token, token,
                  head(CHUNK, CHUNK)],
        out_specs=[head(SUB, K), head(SUB, V), head(CHUNK, CHUNK), head(CHUNK, K)],
        out_shape=[jax.ShapeDtypeStruct((B, HV, SUB, K), wk_dtype), jax.ShapeDtypeStruct((B, HV, SUB, V), jnp.float32),
                   jax.ShapeDtypeStruct(x_cache.shape, jnp.float32),
                   jax.ShapeDtypeStruct((B, HV, CHUNK, K), wk_dtype)],  # written where the chunk completes
        input_output_aliases={5: 2},
        compiler_params=ck._triton_params(warps_prep, 1),
        interpret=interpret,
        name="gdn_replay_prep",
    )(lengths, k, v, g, beta, x_cache)

    # kernel 2, grid (HV, B): the block row of Aqk and qg
    aqk16, qg16 = pl.pallas_call(
        functools.partial(_intra_step_kernel, scale=scale, use_l2=use_qk_l2norm, cfg=cfg, interpret=interpret),
        grid=(HV, B),
        in_specs=[length, key, key, token, token],
        out_specs=[head(SUB, CHUNK), head(SUB, K)],
        out_shape=[jax.ShapeDtypeStruct((B, HV, SUB, CHUNK), jnp.float32),
                   jax.ShapeDtypeStruct((B, HV, SUB, K), jnp.float32)],
        compiler_params=ck._triton_params(warps_intra, 1),
        interpret=interpret,
        name="gdn_replay_intra",
    )(lengths, q, k, g, beta)

    # kernel 3, grid (V // bv, HV, B): v_new, the output row, the boundary state
    def whole(*tail):  # [B, HV, *tail] whole, in a program of grid (V // bv, HV, B)
        return pl.BlockSpec((None, None) + tail, lambda j, h, b: (b, h) + (0,) * len(tail))

    o, state, vn_cache = pl.pallas_call(
        functools.partial(_out_step_kernel, cfg=cfg, interpret=interpret),
        grid=(V // bv, HV, B),
        in_specs=[pl.BlockSpec((1,), lambda j, h, b: (b,)),
                  pl.BlockSpec((None, CHUNK, None, K), lambda j, h, b: (b, 0, h // G, 0)),
                  pl.BlockSpec((None, CHUNK, None), lambda j, h, b: (b, 0, h)),
                  pl.BlockSpec((None, CHUNK, None), lambda j, h, b: (b, 0, h)),
                  whole(SUB, K), cols(SUB, bv), whole(SUB, CHUNK), whole(SUB, K), whole(CHUNK, K), cols(K, bv),
                  cols(CHUNK, bv)],
        out_specs=[cols(bv), cols(K, bv), cols(CHUNK, bv)],
        out_shape=[jax.ShapeDtypeStruct((B, HV, V), v.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32),
                   jax.ShapeDtypeStruct(vn_cache.shape, jnp.float32)],
        input_output_aliases={9: 1, 10: 2},
        compiler_params=ck._triton_params(warps_out, 1),
        interpret=interpret,
        name="gdn_replay_out",
    )(lengths, k, g, beta, w16, u16, aqk16, qg16, kd, state, vn_cache)
    return o, state, x_cache, vn_cache


def _launch_warps(cfg: dict) -> tuple[int, int, int]:
    """Warps of (prep, intra, out): the prefill's kernels' (prep; output; output, which must equal the recurrence's),
    or the benchmark-only `warps_replay` (one for all, or a triple; `chunk.DEFAULT_CONFIG`'s notes)."""
    wr = cfg.get("warps_replay")
    if wr is None:
        return cfg["warps_prep"], cfg["warps_out"], cfg["warps_out"]
    ws = (wr,) * 3 if isinstance(wr, int) else tuple(wr) if isinstance(wr, (tuple, list)) else ()
    if len(ws) != 3 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in ws):
        raise ValueError(f"warps_replay={wr!r}: a positive integer, or three (prep, intra, out)")
    return ws


def _checked(q, k, v, g, beta, state, x_cache, vn_cache, lengths, scale):
    if q.ndim != 4 or k.shape != q.shape or q.shape[1] != CHUNK or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected the open chunk: q, k [B,{CHUNK},HK,K] and v [B,{CHUNK},HV,V]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    B, _, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    want = {"g": (g.shape, (B, CHUNK, HV)), "beta": (beta.shape, (B, CHUNK, HV)), "state": (state.shape, (B, HV, K, V)),
            "x_cache": (x_cache.shape, (B, HV, CHUNK, CHUNK)), "vn_cache": (vn_cache.shape, (B, HV, CHUNK, V)),
            "lengths": (jnp.shape(lengths), (B,))}
    for name, (got, shape) in want.items():
        if tuple(got) != shape:
            raise ValueError(f"{name} must be {list(shape)}; got {list(got)}")
    ck._check_pow2("K", K)
    ck._check_pow2("V", V)
    return float(K**-0.5 if scale is None else scale)


def replay_caches(B: int, HV: int, V: int):
    """Empty caches for rows whose open chunk is empty: x_cache [B, HV, C, C] (the inverse's tiles) and vn_cache
    [B, HV, C, V], fp32."""
    return jnp.zeros((B, HV, CHUNK, CHUNK), jnp.float32), jnp.zeros((B, HV, CHUNK, V), jnp.float32)


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
    scale = _checked(q, k, v, g, beta, state, x_cache, vn_cache, lengths, scale)
    config = None if config is None else tuple(sorted((key, tuple(val) if isinstance(val, list) else val)
                                                      for key, val in dict(config).items()))  # hashable: static
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

    # a loop, not three calls: one call site, whose three kernels compile once
    return lax.fori_loop(1, NB, complete_block_row, replay_caches(B, HV, V))
