"""Replay decode over the chunked prefill: one new token per row, computed with the chunked prefill's own arithmetic
(`chunk.py`, split design, inv="tiled"), but only the part of the open chunk the new row needs.

Dimension legend as in `reference.py`; C = 64 (the chunk), S = 16 (a block row of the tiled inverse).

A row's replay state is the fp32 state S0 at the last 64-token grid boundary, the open chunk's inputs (the caller
keeps them: q, k, v, g, beta of the n - 1 tokens since the boundary, the new token at row n - 1), and two caches of
what the open chunk's earlier tokens computed (after the step at row t, row by row up to t; zeros elsewhere):
  x_cache  [B, HV, C, C]  fp32  the tiled inverse X = (I + A)^-1: the tiles of complete block rows, and the rows
                                 <= t of the diagonal tile of the block row in progress;
  vn_cache [B, HV, C, V]  fp32  v_new = u - w S0 of rows <= t.
The step for the token at row t (block row i = t // 16, row r = t - 16 i in it) runs four kernels, split as the
prefill splits its own; between them only the new row's values travel:
  1. `gdn_replay_prep`, grid (HV, B), the prefill prep's warps: row r of the diagonal tile's inverse, one step of
     the prefill's forward substitution (`wy.substitution_step`) from the rows the cache holds; row r of the merged
     tiles from the cached block rows above (`wy.merged_block_row`; every row when the block row completes, and then
     they go into the cache) and of w and u (`chunk._wy_block_row`), w rounded as the prefill stores it; it writes
     only row r of w and u (rows 0 .. r when priming), and where the token completes the chunk (t = 63) the chunk's
     kd as the prefill's prep stores it (`replay_kd` = "prep", the default);
  2. `gdn_replay_intra`, grid (HV // P, B), P = HV // HK value heads of one key head per program (when a power of
     two; else 1), `warps_replay_intra` warps: row t of Aqk and qg for each head, from one 64-row q k^T dot (the
     prefill output kernel's wgmma; on the GPU as column 0 of k q16^T, q16 holding q's row t and zeros, the
     operands' roles swapped: `replay_qk_cols`; in interpret mode as row t of q k^T with q's row t and zeros; its
     operands are the key head's) and each head's decays on that row (`wy.intra`'s operations, element by element;
     on the GPU qg from q's row t alone); not run when priming;
  3. `gdn_replay_out`, grid (V // bv_replay, HV, B): v_new of row t (`chunk._v_new`) and the output row
     (`chunk._out_dots`), as dots on block row i's 16 rows holding the new row (loaded masked) and zeros; by
     default (`replay_s0_dots` = 1) w S0 and qg S0 are one dot, qg's row placed at row r + 8 (mod 16) of w's
     tile, and the output row is taken from there; writes v_new's row into the cache (priming: the rows
     16 i .. t, and no output);
  4. `gdn_replay_state`, grid (V // bv_replay, HV, B // rows), the recurrence's warps, `rows` batch rows per
     program (`replay_state_rows`): where a row's chunk completes (t = 63), the new boundary state
     `chunk._next_state` of the whole chunk (kd loaded from kernel 1's, as the prefill's recurrence loads its own:
     with kd computed here, `replay_kd` = "fold", the dot grouped the k axis into other HMMA k-steps at K = V = 16
     and its boundary states were an ulp off the prefill's on the H200: runs 92-103), written over S0
     (`input_output_aliases`; otherwise nothing is written), and the v_new cache cleared (kernel 1 clears the x
     cache), so that the caches hold exactly what `prime` leaves for the same tokens.
The kernels read the open chunk from separate q, k, v, g, beta arrays or, in place, from the model's packed buffers
(`open_chunk.py`; `chunk_replay_step_packed_pallas`, which also empties a completed chunk's rows of them).
Kernel 4 is its own kernel because its rare branch set the registers of kernel 3 (on the H200's compiler 255 per
thread with it, 198 without: runs 47-48). Each token's work is one row's (since 2026-11-30's runs 46-54; before,
the step recomputed its whole block row every step: the 15-step substitution, v_new of 16 rows), and since runs
55-60 (same day) only that row moves between the kernels: kernel 3 had read 16-row tiles of w, Aqk and qg per V
block, and kernel 2 computed the whole 64-row Aqk once per value head. Runs 62-63 made kernel 3's two S0 dots one
(122 registers per thread on the H200's compiler by ncu, four programs per SM; offline ptxas 80 against 146 for the
two dots) and gave kernel 4 one V block per program (each head's blocks had run one after another). 2026-12-01's
runs 69-75 gave kernel 4 several rows per program on large grids and kernel 2 its q k^T row as a column of k q^T.

Why the bits equal the prefill's: every value is traced by the same helper functions as the prefill's (kernel 2's
decays by the same operations on row t alone), with the same warps (but kernel 2's: 8 against the output kernel's 4,
the same bits on the H200), and the chunked kernels are row-causal bit for bit (a row's results do not depend on
later rows, which are padding here and real tokens in a prefill: the "j < 64 rows" property the GPU script checks).
The dots run on
other shapes than the prefill's: a row of an MMA's result depends only on that row of its first operand, and on the
H200 its bits depend neither on the instruction's N (the V blocks: `bv_replay` against the prefill's 64 / 32 / 128;
BENCHMARKS.md, runs 6, 21, 37) nor on its M (kernel 3's dots on 16 rows against the prefill's 64; runs 46-53),
with exceptions found: a 16-row dot whose first operand was fp16 (w as the prefill stores it) differed from the
64-row one in one element of 560 rows x 128 (runs 48-51), so w reaches kernel 3 in fp32, holding its fp16 values;
q k^T on 16 rows differed (58 rows of 560: runs 48-49), so kernel 2 keeps the prefill's 64 rows. Nor do a row's
bits depend on which row of the tile it sits in (kernel 3's one S0 dot, qg at row r + 8: run 62, and the interpret
tests), nor, on the GPU, does qg's row depend on being taken before or after the product (kernel 2: run 63). In
interpret mode XLA:CPU's dots can round differently for another M or N, so there kernel 3's operands are placed at
rows 16 i .. 16 i + 15 among zeros and the dots run on 64 rows (`_mma_rows`). On the GPU the equality is a property
of the compiled code, checked bitwise on the H200 by `scripts/gpu_kernels.py --only replay_step` and the model's
`gpu_model_bench.py --stages replay_bitwise`, for bf16 q / k / v (the model's); on CPU (interpret mode) by the tests.
With fp32 q / k / v on the H200 the step's rows differed from the prefill's in the last bits (run 49: 401 of 560
rows, 7 of 8 boundary states, in every variant tried): not understood, not used by the model.

`prime` fills the caches for an open chunk that a prefill left behind: kernels 1 and 3 block row by block row in
their priming form, which compute the diagonal tile whole (the prefill's loop) and every row of the block row up to
the last token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from ..config import static_config
from . import chunk as ck
from . import wy
from .open_chunk import Heads, OpenChunk, clear_completed, pow2_divisor
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


class _Loaded:
    """A ref's values loaded before any arithmetic, behind the part of the ref interface the prefill's helpers use —
    `x.at[pl.ds(16 b, 16)]` (a `_Loaded` of that slice), `x[pl.ds(16 b, 16)]` and `x[...]` (values) — so that the
    helpers trace the same operations on the same values and only the loads move up, their latency overlapping
    instead of sitting inside the chain of dots (kernels 1 and 2: 62.7 against 64.5 and 32.4 against 34.5 us per
    step at B=64, 211.4 against 219.2 and 122.7 against 130.9 at B=256; the H200, run 66)."""

    def __init__(self, *, slices=None, value=None):
        self._slices, self._value = slices, value

    @classmethod
    def rows(cls, ref):
        """Every 16-row slice of a [C, ...] ref (a slice no one reads is dead code, so never loaded)."""
        return cls(slices={b * SUB: ref[pl.ds(b * SUB, SUB)] for b in range(NB)})

    @property
    def at(self):
        return _LoadedSlices(self)

    def __getitem__(self, idx):
        return self._value if idx is Ellipsis else self._slices[idx.start]


class _LoadedSlices:
    """`_Loaded.at`: a slice as a `_Loaded`."""

    def __init__(self, loaded: _Loaded):
        self._loaded = loaded

    def __getitem__(self, idx):
        return _Loaded(value=self._loaded[idx])


def _prep_block_row(i, n, k_ref, v_ref, g_ref, beta_ref, x_ref, w_out, u_out, x_out, kd_out, *, prime, use_l2,
                    wk_dtype, cfg, interpret):
    """Kernel 1 for a token at row t = n - 1, row r = t - 16 i of block row i (static): row r of w and u (all rows
    of block row i up to r when priming), as the prefill's prep computes them. Rows of the 16-row tiles other than r
    hold values no later step reads (an MMA's row depends only on that row of its first operand). kd_out (None
    unless `replay_kd` is "prep"): where the token completes the chunk, the chunk's kd as the prefill's prep stores
    it, for kernel 4."""
    t = n - 1
    r = t - i * SUB
    tiles = [(j, m) for j in range(i) for m in range(j + 1)] + [(i, i)]  # the cached tiles this branch reads
    # every load first: the cached tiles this branch reads, and the open chunk's slices (`_Loaded`)
    x_tiles = {jm: x_ref[pl.ds(jm[0] * SUB, SUB), pl.ds(jm[1] * SUB, SUB)] for jm in tiles}
    k_ref, v_ref, g_ref, beta_ref = (_Loaded.rows(ref) for ref in (k_ref, v_ref, g_ref, beta_ref))
    ks, gcs, betas, valids = ck._chunk_slices(k_ref, g_ref, beta_ref, n, use_l2, start=0)
    r16, c16 = wy.tile_iotas()

    def cached(j, m):
        return x_tiles[j, m]

    if prime:  # the whole diagonal tile by the prefill's loop (rows <= r: what the steps to row r cache)
        t_ii = wy.diag_tiles_by_substitution([ks[i]], [gcs[i]], [betas[i]], cfg, interpret)[0]
    else:  # one step of that loop: row r from the rows < r the steps before cached (the loop starts at row 1)
        at = wy.diag_tile_transposed(ks[i], gcs[i], betas[i], r16 < c16, cfg, interpret)
        t_ii = jnp.where(r16 < r, cached(i, i), jnp.where(r16 == c16, 1.0, 0.0).astype(jnp.float32))
        t_ii = jnp.where(r > 0, wy.substitution_step(r, at, t_ii, r16, c16), t_ii)
    x = {(i, i): t_ii}
    for j in range(i):
        for m in range(j + 1):
            x[j, m] = cached(j, m)
    if i:  # row r of the merged tiles (every row when the block row completes: T_ii is whole then)
        x.update(wy.merged_block_row(i, ks, gcs, betas, x, cfg, interpret))
    bks, bvs = ck._wy_rhs_slices(ks, gcs, betas, valids, v_ref)  # (built where each dot reads it instead: 70.6
    # against 64.5 us per step at B=64, the H200, 2026-11-30)
    w, u = ck._wy_block_row(i, x, bks, bvs, cfg, interpret)
    # w's values as the prefill's prep kernel stores them (`_wk_dtype`), held in fp32: kernel 3's 16-row v_new dot on
    # an fp16 w differed from the prefill's 64-row one in one element of 560 rows x 128 (the H200, runs 48-51); on
    # the same values held in fp32, and on 64 rows, it did not (runs 51-53)
    # only the rows kernel 3 reads (r; 0 .. r when priming): the others are left unwritten
    plt.store(w_out.at[...], w.astype(wk_dtype).astype(jnp.float32), mask=_rows_between(w.shape, 0 if prime else r, r))
    plt.store(u_out.at[...], u, mask=_rows_between(u.shape, 0 if prime else r, r))

    if i < NB - 1:
        x_out[pl.ds(i * SUB, SUB), pl.ds(i * SUB, SUB)] = jnp.where(r16 <= r, t_ii, 0.0)  # T_ii's rows so far
        if i:
            @pl.when(r == SUB - 1)  # block row i is complete: its merged tiles too
            def _():
                for m in range(i):
                    x_out[pl.ds(i * SUB, SUB), pl.ds(m * SUB, SUB)] = x[i, m]
    else:
        @pl.when(t < CHUNK - 1)
        def _():
            x_out[pl.ds(i * SUB, SUB), pl.ds(i * SUB, SUB)] = jnp.where(r16 <= r, t_ii, 0.0)

        @pl.when(t == CHUNK - 1)  # the chunk is complete: the next one starts empty (caches as `prime` leaves
        def _():  # them: a state is its tokens')
            x_out[...] = jnp.zeros(x_out.shape, jnp.float32)
            if kd_out is not None:  # stored as `chunk._store_tiled_wy` stores it
                for b, kd in enumerate(_kd_slices(ks, gcs, kd_out.dtype)):
                    kd_out[pl.ds(b * SUB, SUB), :] = kd


def _kd_slices(ks, gcs, dtype):
    """The chunk's kd = k exp(gc_last - gc) in its four 16-row slices, rounded to `dtype` (`chunk._kd_slice`)."""
    g_last = wy.last(gcs[-1])
    return [ck._kd_slice(kb, gc, g_last).astype(dtype) for kb, gc in zip(ks, gcs)]


def _rows_between(shape, first, last):
    """[R, n] bool: rows first .. last (static or traced)."""
    rows = lax.broadcasted_iota(jnp.int32, shape, 0)
    return (rows >= first) & (rows <= last)


def _prep_step_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, x_ref, w_out, u_out, x_out, *kd_out, **kw):
    """Kernel 1, grid (HV, B): the new token's row of the prefill's prep (V-independent but for u; every row of its
    block row up to it when priming), in the branch of its block row (static: each block row has its own tiles).
    (Kernel 2's work inside this kernel took 131 us per step at B=64 against 65 + 45 for the two: the H200,
    2026-11-30.)"""
    n = len_ref[0]  # tokens in the open chunk, the new one included (0: a row with nothing to do, nothing written)
    for i in range(NB):
        pl.when((n > i * SUB) & (n <= (i + 1) * SUB))(functools.partial(
            _prep_block_row, i, n, k_ref, v_ref, g_ref, beta_ref, x_ref, w_out, u_out, x_out,
            kd_out[0] if kd_out else None, **kw))


def _block_row(x, i):
    """Rows 16 i .. 16 i + 15 of x [C, n] (i traced): the other block rows summed in as -0.0, exact in any order on
    the GPU (Triton's reduction has no initial value; in interpret mode XLA's starts from +0.0, so a -0.0 comes out
    +0.0: the same value for ==)."""
    row_block = lax.broadcasted_iota(jnp.int32, (NB, SUB, x.shape[-1]), 0)
    return jnp.sum(jnp.where(row_block == i, x.reshape(NB, SUB, x.shape[-1]), -0.0), axis=0)


def _mma_rows(x16, *, i, interpret):
    """An operand's block row i [16, n] as the MMA takes it: as it is on the GPU (a row of an MMA's result depends
    only on that row of its first operand, not on the instruction's M: checked on the H200), placed at rows 16 i ..
    16 i + 15 of [64, n] among zeros in interpret mode (XLA:CPU's dots round differently for another M, so the
    tests run the prefill's 64-row shapes)."""
    return _placed([(i, x16)], x16.shape[-1], x16.dtype) if interpret else x16


def _intra_step_kernel(len_ref, q_ref, k_ref, *refs, scale, use_l2, cfg, interpret):
    """Kernel 2, grid (HV // P, B), P value heads of one key head per program (P = HV // HK when a power of two,
    else 1): the new token's row t of Aqk and qg for each. q k^T is the prefill output kernel's 64-row dot
    (`chunk._intra_rows`; on the block row's 16 rows of q, 58 of 560 rows differed from the prefill's on the H200:
    runs 48-49), with q's row t loaded and the others zeros (a row of an MMA's result depends only on that row of
    its first operand) — on the GPU as column 0 of k q16^T instead (the same 64-row wgmma, k the first operand: the
    same bits, run 74; `replay_qk_cols`); its operands are the key head's, so it runs once for the P value heads,
    and each head's decays follow on row t alone (`wy.intra`'s operations). refs: P gate refs g [C], then the
    outputs aqk [P, C] and qg [P, K]."""
    *g_refs, aqk_out, qg_out = refs
    n = len_ref[0]
    t = jnp.maximum(n - 1, 0)
    rows = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    q_row = rows == t
    g_refs = [_Loaded.rows(g_ref) for g_ref in g_refs]  # the gates' loads before q's and k's and any arithmetic
    q = plt.load(q_ref.at[...], mask=jnp.broadcast_to(q_row[:, None], q_ref.shape), other=0).astype(jnp.float32)
    q = jnp.where(q_row[:, None], wy.l2norm(q) if use_l2 else q, 0.0) * scale  # `chunk._load_key`'s, on row t
    k = ck._load_key(k_ref, rows < n, use_l2)
    cols = cfg["replay_qk_cols"] is True or (cfg["replay_qk_cols"] == "auto" and not interpret)
    q_t = None if interpret and not cols else _row(q, t)  # [K]
    if cols:  # k (q_t and zeros)^T: [C, 16], its column 0 = row t of q k^T (`replay_qk_cols`; the H200: the bits of
        # the 64-row q k^T's row t, run 74)
        q16 = jnp.where(lax.broadcasted_iota(jnp.int32, (SUB, q.shape[1]), 0) == 0, q_t[None, :], 0.0)
        qk_c = wy.dot(k, q16, cfg["p_qk"], interpret, trans_b=True)
        qk_t = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, qk_c.shape, 1) == 0, qk_c, -0.0), axis=1)
    else:
        qk_t = _row(wy.dot(q, k, cfg["p_qk"], interpret, trans_b=True), t)  # [C]: row t of q k^T
    lower = rows <= t  # row t of `wy.causal_decay`'s mask (strict=False)
    for j, g_ref in enumerate(g_refs):
        gc = _placed_vector(_gc_slices(g_ref, n))
        gc_t = _row(gc[:, None], t)  # [1]
        # row t of `wy.intra`'s Aqk and qg element by element: the same operations on the same values. (On XLA:CPU,
        # row t of q times exp(gc_t) differed from that row of q exp(gc) over the chunk, so interpret mode takes
        # the row of the product; on the H200 the row's own product has the prefill's bits: BENCHMARKS.md, run 63.)
        aqk_out[j] = jnp.where(lower, qk_t * jnp.exp(jnp.where(lower, gc_t - gc, 0.0)), 0.0)
        qg_out[j] = _row(q * jnp.exp(gc)[:, None], t) if interpret else q_t * jnp.exp(gc_t)


def _gc_slices(g_ref, n):
    """The open chunk's gc in its four 16-row slices, as `chunk._chunk_slices` computes them (n valid rows)."""
    gcs = []
    for b in range(NB):
        valid = b * SUB + lax.broadcasted_iota(jnp.int32, (SUB,), 0) < n
        gcs.append(ck._gc_slice(g_ref.at[pl.ds(b * SUB, SUB)], valid, gcs[-1] if gcs else None))
    return gcs


def _row(x, t):
    """Row t (traced) of x [C, n]: every other row summed in as -0.0, exact in any order (`_block_row`)."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == t, x, -0.0), axis=0)


def _out_step_kernel(len_ref, w_ref, u_ref, *refs, prime, cfg, interpret):
    """Kernel 3, grid (V // bv, HV, B): v_new of the new row (of block row i's rows up to it when priming) and the
    new token's output (not when priming: `prime` keeps only the caches), for one V block. The dots are the
    prefill's on the 16 rows of block row i, with only the rows this call computes loaded (kernels 1 and 2 write
    nothing else) and zeros elsewhere: a row of an MMA's result depends only on that row of its first operand, not
    on the instruction's M (the H200, 2026-11-30) or N, nor on the row's place in the tile (`replay_s0_dots` = 1:
    qg's row beside w's in one dot with S0). refs: (aqk [C] and qg [K] of row t, unless priming), the
    state block s [K, bv], the v_new cache [C, bv]; then the outputs (o [bv], unless priming) and the cache."""
    if prime:
        s_ref, vn_ref, vn_out = refs
    else:
        aqk_ref, qg_ref, s_ref, vn_ref, o_ref, vn_out = refs
    n = len_ref[0]

    if not prime:
        @pl.when(n == 0)
        def _():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(n > 0)
    def _():
        t = n - 1
        i = t // SUB  # the new token's block row and its row in it (traced: the placements below are selects)
        r = t - i * SUB
        bv = u_ref.shape[-1]
        r0 = 0 if prime else r  # the rows this call computes: r0 .. r of block row i
        s0 = s_ref[...]  # [K, bv] of this program's V block
        rows_of = functools.partial(_mma_rows, i=i, interpret=interpret)
        w = plt.load(w_ref.at[...], mask=_rows_between(w_ref.shape, r0, r), other=0.0)
        u = plt.load(u_ref.at[...], mask=_rows_between(u_ref.shape, r0, r), other=0.0)
        one_dot = cfg["replay_s0_dots"] == 1 and not prime
        if one_dot:  # qg's row goes into w's tile at row r2 (another row than r): one dot with S0 gives both rows
            r2 = (r + SUB // 2) % SUB
            w = jnp.where(lax.broadcasted_iota(jnp.int32, w.shape, 0) == r2, qg_ref[...][None, :], w)
        ws = wy.dot(rows_of(w), s0, cfg["p_ws"], interpret)  # `chunk._v_new`'s dot: [16, bv] (interpret: [64, bv])
        v = rows_of(u) - ws
        v = _block_row(v, i) if interpret else v
        if not prime:
            rows = lax.broadcasted_iota(jnp.int32, (CHUNK, bv), 0)
            cached = plt.load(vn_ref.at[...], mask=rows < t, other=0.0)  # rows < t (zeros from t on)
            vn64 = jnp.where(rows == t, _placed([(i, v)], bv), cached)
            ht, vt = ck._transposed(cfg)
            if one_dot:  # `chunk._out_dots` with its first dot's row r2 taken from ws
                at_r2 = functools.partial(_at_row, r=r2)
                o = ws + wy.dot(rows_of(at_r2(aqk_ref[...])), vn64.T if vt else vn64, cfg["p_av"], interpret,
                                trans_b=vt)
                o_row = (t - r + r2) if interpret else r2
            else:
                at_r = functools.partial(_at_row, r=r)
                o = ck._out_dots(rows_of(at_r(aqk_ref[...])), rows_of(at_r(qg_ref[...])), lambda: s0.T if ht else s0,
                                 lambda: vn64.T if vt else vn64, cfg, interpret)
                o_row = t if interpret else r
            # row o_row: every other term -0.0, which leaves any value as it is, in any order (a signed zero too on
            # the GPU: `_block_row`)
            o_ref[...] = _row(o, o_row).astype(o_ref.dtype)
        # v_new of block row i's rows this call computed into the cache (at t = 63, for kernel 4)
        block = pl.ds(pl.multiple_of(i * SUB, SUB), SUB)
        plt.store(vn_out.at[block, :], v, mask=_rows_between(v.shape, r0, r))


def _at_row(x, r):
    """x [n] as row r (traced) of a [16, n] tile, zeros elsewhere (exact: a select)."""
    rows = lax.broadcasted_iota(jnp.int32, (SUB, x.shape[-1]), 0)
    return jnp.where(rows == r, jnp.broadcast_to(x[None, :], rows.shape), 0.0)


class _RowRef:
    """One batch row of a ref that holds every row ([B, ...]: kernel 4's programs pick their rows inside), behind the
    part of the ref interface the prefill's helpers use — `x.at[pl.ds(..)]`, `x[...]`, `x[...] = value`, `x.shape` —
    each access one index into the whole ref (Pallas' Triton lowering takes one indexer per load or store)."""

    def __init__(self, ref, index: tuple):
        self._ref, self._index = ref, index

    @property
    def shape(self):  # an integer index drops its axis, a slice keeps its size
        kept = tuple(idx.size for idx in self._index if isinstance(idx, pl.Slice))
        return kept + tuple(self._ref.shape[len(self._index):])

    @property
    def at(self):
        return _RowRefSlices(self)

    def _full(self, idx):
        return self._index if idx is Ellipsis else self._index + (idx if isinstance(idx, tuple) else (idx,))

    def __getitem__(self, idx):
        return self._ref[self._full(idx)]

    def __setitem__(self, idx, value):
        self._ref[self._full(idx)] = value


class _RowRefSlices:
    """`_RowRef.at`: a slice of the row as a `_RowRef`."""

    def __init__(self, row_ref: _RowRef):
        self._row_ref = row_ref

    def __getitem__(self, idx):
        return _RowRef(self._row_ref._ref, self._row_ref._full(idx))


def _fold_row(n, k_ref, g_ref, s_ref, vn_ref, kd_ref, s_out, vn_out, *, use_l2, wk_dtype, cfg, interpret):
    """Where the row's chunk completes (n = 64), its new boundary state's V block from the whole chunk's v_new (the
    cache) as the prefill computes it — kd as its prep kernel does (stored in `_wk_dtype`), the update as its
    recurrence does — and the cache's block cleared; elsewhere nothing. The refs are the row's (`_RowRef`). kd_ref:
    None (`replay_kd` "fold": kd computed here from k and g) or kernel 1's kd of the chunk ("prep"), loaded as the
    prefill's recurrence loads its kd."""

    @pl.when(n == CHUNK)
    def _():
        gcs = _gc_slices(g_ref, n)
        g_last = wy.last(gcs[-1])
        if kd_ref is None:
            iota = lax.broadcasted_iota(jnp.int32, (SUB,), 0)
            ks = [ck._load_key(k_ref.at[pl.ds(b * SUB, SUB)], b * SUB + iota < n, use_l2) for b in range(NB)]
            kd = _placed(list(enumerate(_kd_slices(ks, gcs, wk_dtype))), k_ref.shape[-1], wk_dtype)
        else:
            kd = kd_ref[...]
        s_out[...] = ck._next_state(s_ref[...], g_last, kd, vn_ref[...], cfg, interpret)
        vn_out[...] = jnp.zeros(vn_out.shape, jnp.float32)


def _state_step_kernel(len_ref, k_ref, g_ref, s_ref, vn_ref, *refs, rows, **kw):
    """Kernel 4, grid (V // bv, HV, B // rows): the boundary states of the rows whose chunk this step completes,
    for one V block of one value head, over `rows` consecutive batch rows per program (`_fold_row` for each). The
    refs hold every row ([B, ...]); the program loads its rows' lengths at once and returns at once when none of them
    completes. Its own kernel: in kernel 3 this rare branch set the registers of the whole kernel (on the H200: 255
    per thread against 198). One row per program (rows = 1) had most programs find nothing to do at two programs per
    SM: 13.9 us per step at B=64 and 41.8 at B=256 for one completing row in 64 (the H200, run 67)."""
    kd_ref, s_out, vn_out = refs if len(refs) == 3 else (None,) + refs  # kd: `replay_kd` "prep"
    first = pl.program_id(2) * rows
    iota = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    lens = len_ref[pl.ds(first, rows)]  # rows divides B

    @pl.when(jnp.max(jnp.where(lens == CHUNK, 1, 0)) > 0)
    def _():
        def one(m, carry):
            row = first + m
            n = jnp.sum(jnp.where(iota == m, lens, 0))
            at = functools.partial(_RowRef, index=(row,))
            _fold_row(n, at(k_ref), at(g_ref), at(s_ref), at(vn_ref), None if kd_ref is None else at(kd_ref),
                      at(s_out), at(vn_out), **kw)
            return carry

        lax.fori_loop(0, rows, one, 0)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "interpret", "config", "prime", "packed"))
def _step_impl(q, k, v, g, beta, state, x_cache, vn_cache, lengths, *, scale, use_qk_l2norm, interpret, config,
               prime=False, packed=None):
    """The step's four kernels (three when priming). packed: None (q, k, v, g, beta separate arrays) or (Heads,
    groups) when q is k is v = the packed qkv buffer and g is beta = the gates buffer (`open_chunk.py`)."""
    src = (OpenChunk.separate(q, k, v, g, beta) if packed is None
           else OpenChunk(q, k, v, g, beta, Heads(*packed[0]), packed[1]))
    B = src.batch
    HK, K, HV, V = src.heads
    G = HV // HK
    cfg = ck._checked_config(config, V, use_qk_l2norm, scale)
    if cfg["design"] != "split" or cfg["inv"] != "tiled" or cfg["prep_kernels"] != 1:
        raise ValueError("the replay step reproduces the split design with inv='tiled' and one prep kernel")
    if cfg["replay_s0_dots"] not in (1, 2) or (cfg["replay_s0_dots"] == 1 and cfg["p_ws"] != cfg["p_qs"]):
        raise ValueError(f"replay_s0_dots={cfg['replay_s0_dots']!r}: 2, or 1 when p_ws == p_qs (one dot computes "
                         f"w S0 and qg S0)")
    per = cfg["replay_state_rows"]
    if per != "auto" and (not isinstance(per, int) or isinstance(per, bool) or per < 1):
        raise ValueError(f"replay_state_rows={per!r}: 'auto' or a positive integer (kernel 4's batch rows per "
                         f"program)")
    if not (cfg["replay_qk_cols"] == "auto" or isinstance(cfg["replay_qk_cols"], bool)):
        raise ValueError(f"replay_qk_cols={cfg['replay_qk_cols']!r}: 'auto', True or False")
    kd_mode = cfg["replay_kd"]
    if kd_mode not in ("fold", "prep"):
        raise ValueError(f"replay_kd={kd_mode!r}: 'prep' or 'fold' (where kernel 4 takes a completing chunk's kd "
                         f"from)")
    kd_from_prep = kd_mode == "prep" and not prime  # (priming never completes a chunk)
    if cfg["warps_state"] != cfg["warps_out"]:
        raise ValueError("the replay step's kernel 3 runs the recurrence's v_new dot and the output's dots: it needs "
                         "warps_state == warps_out (the prefill runs them with those warps)")
    warps_prep, warps_intra, warps_out = _launch_warps(cfg)
    wk_dtype = ck._wk_dtype(cfg, use_qk_l2norm, interpret)
    bv = min(cfg["bv_replay"], V)  # kernels 3 and 4's V block (on the GPU their dots' bits do not depend on it: N)

    def head(*tail):  # a per-(row, value head) array [B, HV, *tail], whole (grid (HV, B))
        return pl.BlockSpec((None, None) + tail, lambda h, b: (b, h) + (0,) * len(tail))

    def cols(*tail):  # the same, its last axis in this program's V block (grid (V // bv, HV, B))
        return pl.BlockSpec((None, None) + tail, lambda j, h, b: (b, h) + (0,) * (len(tail) - 1) + (j,))

    key_of_head = lambda h, b: (b, h // G)  # noqa: E731 (grid (HV, B): the row and the value head's key head)
    value_head = lambda h, b: (b, h)  # noqa: E731
    length = pl.BlockSpec((1,), lambda h, b: (b,))

    # kernel 1, grid (HV, B): the new row of the prep (and a completing chunk's kd with replay_kd "prep")
    kd_out = [(head(CHUNK, K), jax.ShapeDtypeStruct((B, HV, CHUNK, K), wk_dtype))] if kd_from_prep else []
    w16, u16, x_cache, *kd_chunk = pl.pallas_call(
        functools.partial(_prep_step_kernel, prime=prime, use_l2=use_qk_l2norm, wk_dtype=wk_dtype, cfg=cfg,
                          interpret=interpret),
        grid=(HV, B),
        in_specs=[length, src.spec("k", key_of_head), src.spec("v", value_head), src.spec("g", value_head),
                  src.spec("beta", value_head), head(CHUNK, CHUNK)],
        out_specs=[head(SUB, K), head(SUB, V), head(CHUNK, CHUNK)] + [spec for spec, _ in kd_out],
        out_shape=[jax.ShapeDtypeStruct((B, HV, SUB, K), jnp.float32),  # w: its `_wk_dtype` values (kernel 3)
                   jax.ShapeDtypeStruct((B, HV, SUB, V), jnp.float32),
                   jax.ShapeDtypeStruct(x_cache.shape, jnp.float32)] + [shape for _, shape in kd_out],
        input_output_aliases={5: 2},
        compiler_params=ck._triton_params(warps_prep, 1),
        interpret=interpret,
        name="gdn_replay_prep",
    )(lengths, src.k, src.v, src.g, src.beta, x_cache)

    row_ops = []
    if not prime:  # kernel 2, grid (HV // P, B): the new token's row of Aqk and qg (the output's; priming skips it),
        P = G if G & (G - 1) == 0 else 1  # P value heads per program, those of one key head (when a power of two)

        def heads(*tail):  # [B, HV, *tail], the program's P value heads
            return pl.BlockSpec((None, P) + tail, lambda p, b: (b, p) + (0,) * len(tail))

        key_p = lambda p, b: (b, p * P // G)  # noqa: E731 (the program's key head)
        gates = [src.spec("g", lambda p, b, j=j: (b, p * P + j)) for j in range(P)]
        row_ops = pl.pallas_call(
            functools.partial(_intra_step_kernel, scale=scale, use_l2=use_qk_l2norm, cfg=cfg, interpret=interpret),
            grid=(HV // P, B),
            in_specs=[pl.BlockSpec((1,), lambda p, b: (b,)), src.spec("q", key_p), src.spec("k", key_p)] + gates,
            out_specs=[heads(CHUNK), heads(K)],
            out_shape=[jax.ShapeDtypeStruct((B, HV, CHUNK), jnp.float32),
                       jax.ShapeDtypeStruct((B, HV, K), jnp.float32)],
            compiler_params=ck._triton_params(warps_intra, 1),
            interpret=interpret,
            name="gdn_replay_intra",
        )(lengths, src.q, src.k, *([src.g] * P))

    # kernel 3's operands, grid (V // bv, HV, B)
    def whole(*tail):  # [B, HV, *tail] whole, in a program of grid (V // bv, HV, B)
        return pl.BlockSpec((None, None) + tail, lambda j, h, b: (b, h) + (0,) * len(tail))

    row_length = pl.BlockSpec((1,), lambda j, h, b: (b,))
    state_specs = [cols(K, bv), cols(CHUNK, bv)]
    out_specs, out_shape = [cols(CHUNK, bv)], [jax.ShapeDtypeStruct(vn_cache.shape, jnp.float32)]
    if not prime:
        out_specs = [cols(bv)] + out_specs
        out_shape = [jax.ShapeDtypeStruct((B, HV, V), v.dtype)] + out_shape

    # kernel 3, grid (V // bv, HV, B): v_new and the output row
    res = pl.pallas_call(
        functools.partial(_out_step_kernel, prime=prime, cfg=cfg, interpret=interpret),
        grid=(V // bv, HV, B),
        in_specs=[row_length, whole(SUB, K), cols(SUB, bv)] + [whole(CHUNK), whole(K)][:len(row_ops)] + state_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={4 + len(row_ops): len(out_shape) - 1},
        compiler_params=ck._triton_params(warps_out, 1),
        interpret=interpret,
        name="gdn_replay_out",
    )(lengths, w16, u16, *row_ops, state, vn_cache)
    if prime:  # an open chunk (< 64 tokens): never complete; no output
        return None, state, x_cache, res[0]
    o, vn_cache = res
    if cfg.get("stop_after") == "out":  # benchmark hook: kernel 4 not run (a completing row's v_new stays readable)
        return o, state, x_cache, vn_cache

    # kernel 4, grid (V // bv, HV, B // rows): the boundary state where the chunk completes
    rows = cfg["replay_state_rows"]  # the largest power of two <= it dividing B: a program's rows are one block
    rows = pow2_divisor(B, (1 if B * HV * (V // bv) <= 4096 else 16) if rows == "auto" else rows)
    def every(*tail):  # [B, HV, *tail]: every row, this program's value head, its last axis in its V block
        return pl.BlockSpec((B, None) + tail, lambda j, h, s: (0, h) + (0,) * (len(tail) - 1) + (j,))

    state_rows = [every(K, bv), every(CHUNK, bv)]  # [B, K, bv], [B, C, bv]
    state, vn_cache = pl.pallas_call(
        functools.partial(_state_step_kernel, rows=rows, use_l2=use_qk_l2norm, wk_dtype=wk_dtype, cfg=cfg,
                          interpret=interpret),
        grid=(V // bv, HV, B // rows),
        in_specs=[pl.BlockSpec((B,), lambda j, h, s: (0,)), src.spec("k", lambda j, h, s: (0, h // G), rows=B),
                  src.spec("g", lambda j, h, s: (0, h), rows=B)] + state_rows
        + [pl.BlockSpec((B, None, CHUNK, K), lambda j, h, s: (0, h, 0, 0))] * len(kd_chunk),
        out_specs=state_rows,
        out_shape=[jax.ShapeDtypeStruct(state.shape, jnp.float32), jax.ShapeDtypeStruct(vn_cache.shape, jnp.float32)],
        input_output_aliases={3: 0, 4: 1},
        compiler_params=ck._triton_params(cfg["warps_state"], 1),
        interpret=interpret,
        name="gdn_replay_state",
    )(lengths, src.k, src.g, state, vn_cache, *kd_chunk)
    return o, state, x_cache, vn_cache


def _launch_warps(cfg: dict) -> tuple[int, int, int]:
    """Warps of (prep, intra, out): the prefill's prep kernel's, `warps_replay_intra` (4 since run 74's column form;
    the bits the same on the H200 for every count tried) and the output kernel's (which must equal the
    recurrence's); or the benchmark-only `warps_replay` (one for all, or a triple; `chunk.DEFAULT_CONFIG`'s notes)."""
    wr = cfg.get("warps_replay")
    if wr is None:
        return cfg["warps_prep"], cfg["warps_replay_intra"], cfg["warps_out"]
    ws = (wr,) * 3 if isinstance(wr, int) else tuple(wr) if isinstance(wr, (tuple, list)) else ()
    if len(ws) != 3 or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in ws):
        raise ValueError(f"warps_replay={wr!r}: a positive integer, or three (prep, intra, out)")
    return ws


def _checked(q, k, v, g, beta, state, x_cache, vn_cache, lengths, scale):
    if q.ndim != 4 or k.shape != q.shape or q.shape[1] != CHUNK or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected the open chunk: q, k [B,{CHUNK},HK,K] and v [B,{CHUNK},HV,V]; got {q.shape}, "
                         f"{k.shape}, {v.shape}")
    heads = Heads(q.shape[2], q.shape[3], v.shape[2], v.shape[3])
    B, HV = q.shape[0], heads.HV
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (B, CHUNK, HV):
            raise ValueError(f"{name} must be {[B, CHUNK, HV]}; got {list(x.shape)}")
    return _checked_rest(heads, B, state, x_cache, vn_cache, lengths, scale)


def _checked_rest(heads: Heads, B: int, state, x_cache, vn_cache, lengths, scale):
    """The head shape, the boundary state, the caches and lengths checked; returns the scale."""
    HK, K, HV, V = heads
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    want = {"state": (state.shape, (B, HV, K, V)), "x_cache": (x_cache.shape, (B, HV, CHUNK, CHUNK)),
            "vn_cache": (vn_cache.shape, (B, HV, CHUNK, V)), "lengths": (jnp.shape(lengths), (B,))}
    for name, (got, shape) in want.items():
        if tuple(got) != shape:
            raise ValueError(f"{name} must be {list(shape)}; got {list(got)}")
    for name, cache in (("x_cache", x_cache), ("vn_cache", vn_cache)):  # updated in place: fp32 in, fp32 out
        if jax.dtypes.canonicalize_dtype(cache.dtype) != jnp.float32:
            raise ValueError(f"{name} must be fp32; got {cache.dtype}")
    ck._check_pow2("K", K)
    ck._check_pow2("V", V)
    return float(K**-0.5 if scale is None else scale)


def replay_caches(B: int, HV: int, V: int):
    """Empty caches for rows whose open chunk is empty: x_cache [B, HV, C, C] (the inverse's tiles) and vn_cache
    [B, HV, C, V], fp32."""
    return jnp.zeros((B, HV, CHUNK, CHUNK), jnp.float32), jnp.zeros((B, HV, CHUNK, V), jnp.float32)


def chunk_replay_step_pallas(q, k, v, g, beta, state, x_cache, vn_cache, lengths, *, scale=None, use_qk_l2norm=True,
                             interpret=False, config=None, _prime=False):
    """One replay decode step per row over the chunked prefill (module docstring).

    q, k: [B, 64, HK, K] and v: [B, 64, HV, V], g, beta: [B, 64, HV]: the open chunk, lengths[b] tokens valid in row b
    (the new one last; rows after it are ignored: padding); state: fp32 [B, HV, K, V] at the boundary; x_cache,
    vn_cache: the caches (`replay_caches`, `chunk_replay_prime_pallas`). lengths[b] = 0: nothing is computed for the
    row (its output is zeros, its state and caches unchanged).
    Returns (o [B, HV, V] of the new token, in v.dtype; state: the new boundary state where lengths == 64, else the
    same; x_cache, vn_cache updated). The state and caches are updated in place when the caller donates them.
    """
    scale = _checked(q, k, v, g, beta, state, x_cache, vn_cache, lengths, scale)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, CHUNK)
    return _step_impl(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), state.astype(jnp.float32),
                      x_cache, vn_cache, lengths, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                      interpret=bool(interpret), config=static_config(config), prime=bool(_prime))


def chunk_replay_step_packed_pallas(qkv, gates, state, x_cache, vn_cache, lengths, *, heads, groups: int,
                                    scale=None, use_qk_l2norm=True, interpret=False, config=None):
    """`chunk_replay_step_pallas` on the model's packed open-chunk buffers (`open_chunk.py`), which the kernels read
    in place (the same bits: only the addresses differ), and which come back with the rows whose chunk completed
    emptied, in place when the caller donates them.

    qkv: [B, 64, 2 HK K + HV V] in `groups` groups of [q_g | k_g | v_g]; gates: [B, 64, 2, HV] (g, beta), fp32;
    heads: (HK, K, HV, V). Returns (o, state, x_cache, vn_cache) as `chunk_replay_step_pallas` does, then (qkv,
    gates) with rows where lengths == 64 zeroed (the next chunk starts empty)."""
    heads = Heads(*heads)
    OpenChunk.packed(qkv, gates, heads, groups)  # checks the buffers' shapes and layout
    scale = _checked_rest(heads, qkv.shape[0], state, x_cache, vn_cache, lengths, scale)
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, CHUNK)
    gates = gates.astype(jnp.float32)
    o, state, x_cache, vn_cache = _step_impl(
        qkv, qkv, qkv, gates, gates, state.astype(jnp.float32), x_cache, vn_cache, lengths, scale=scale,
        use_qk_l2norm=bool(use_qk_l2norm), interpret=bool(interpret), config=static_config(config),
        packed=(tuple(heads), int(groups)))
    # the clearing writes the buffers the kernels read: computed from their outputs (a barrier ties them), it comes
    # after their reads by data dependence, so XLA writes in place instead of copying the buffers around it
    done, o, state, x_cache, vn_cache = lax.optimization_barrier((lengths, o, state, x_cache, vn_cache))
    qkv, gates = clear_completed(qkv, gates, done, interpret=bool(interpret))
    return o, state, x_cache, vn_cache, qkv, gates


def chunk_replay_prime_pallas(q, k, v, g, beta, state, lengths, *, scale=None, use_qk_l2norm=True, interpret=False,
                              config=None):
    """The caches for open chunks a prefill left (lengths[b] < 64 tokens of q, k, v, g, beta [B, 64, ...] after the
    boundary state `state`): what the steps to row lengths[b] - 1 leave, block row by block row — the step's
    kernels in their priming form, which compute the diagonal tile whole (the prefill's loop) and every row of the
    block row up to the last. Returns (x_cache, vn_cache)."""
    B, HV, V = v.shape[0], v.shape[2], v.shape[3]
    lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, CHUNK - 1)

    def block_row(i, caches):  # block row i's rows the row reaches (0: nothing to do)
        reach = jnp.where(lengths > i * SUB, jnp.minimum(lengths, (i + 1) * SUB), 0)
        return chunk_replay_step_pallas(q, k, v, g, beta, state, *caches, reach, scale=scale,
                                        use_qk_l2norm=use_qk_l2norm, interpret=interpret, config=config,
                                        _prime=True)[2:]

    # a loop, not four calls: one call site, whose three kernels compile once
    return lax.fori_loop(0, NB, block_row, replay_caches(B, HV, V))
