"""Chunked (WY/UT, chunk 64) gated delta rule prefill: Pallas-Triton kernels for the H200 (interpretable on CPU).

Two designs (dimension legend in `reference.py`; C = 64, NT = ceil(T / C)); `config["design"]` picks one.

"split" (default: the recurrence kept to two dots per chunk):
1. `_prep_split_kernel`, grid (NT, HV, B), fully parallel: per chunk and value head, fp32 L2-norm of k, masking of
   padded tokens, the in-chunk cumulative log-decay gc, the strictly-lower A[i, j] = beta_i (k_i . k_j)
   exp(gc_i - gc_j) (j < i), its unit-lower inverse X = (I + A)^-1 and w = X (beta exp(gc) k), u = X (beta v),
   kd = k exp(gc_last - gc). By default (inv="tiled", `_tiled_inverse`) all of it on 16-row slices and [16, 16]
   tiles: the diagonal tiles inverted by exact fp32 forward substitution, the rest merged block row by block row,
   w / u / kd 16 rows at a time. u is written in fp32, w and kd in fp16 on the GPU (`_wk_dtype`: bounded by
   construction). prep_kernels=2 writes X to memory (`_inverse_kernel`) and applies it in `_apply_kernel`;
   inv="block16" is the earlier [64, 64] form (diagonal blocks on a [4, 16, 16] stack, block-Neumann merge).
2. `_state_split_kernel`, grid (V // BV, HV, B) (BV = 64; 32 with two load stages on grids of at most 132 programs,
   `_recurrence_blocks`), sequential over chunks with the fp32 state block S [K, BV] on chip:
   writes S at the start of every chunk (h) and v_new = u - w S, then S = exp(gc_last) S + kd^T v_new.
3. `_out_kernel`, grid (NT, HV, B, V // BVO), fully parallel: o = qg h + Aqk v_new with qg = scale q exp(gc) and the
   masked intra-chunk attention Aqk[i, j] = scale q_i . k_j exp(gc_i - gc_j) (j <= i) recomputed from q and k.
   In-call checkpoints are exact copies of h at the requested chunk starts (or of the final state).

"fused" (two kernels: the output computed inside the recurrence, four dots per chunk on the sequential path):
1. `_prep_kernel`: as above plus Aqk and qg, written in fp32.
2. `_state_kernel`: per chunk v_new = u - w S; o = qg S + Aqk v_new; S = exp(gc_last) S + kd^T v_new; stores o, the
   final state and (optionally) the state after every `checkpoint_stride` tokens.

"tiles16" (the diagonal blocks on four 2-D [16, 16] tiles, placed into [64, 64] for the block-Neumann merge; run 4,
slower) was removed when inv="tiled" kept the tiles through the merge. A row-exact configuration (FMA-chain dots)
for an incremental replay kernel was removed: its prefill measured
54-58x the default and its replay step 88x the recurrent kernel (BENCHMARKS.md).

Determinism properties (tested on CPU in interpret mode and on the GPU):
- every chunk's arithmetic depends only on that chunk's (masked) inputs and the incoming fp32 state, with fixed
  tile shapes, so a call split on the 64 grid, the same call twice, and a row alone vs inside a batch agree bit
  for bit, and in-call checkpoints equal separate calls' final states;
- row-causal inside a chunk: masked terms are exact zeros (`where` before `exp`, lower-triangular factors), no
  reduction's order depends on how many rows are real, so a call of j < 64 tokens starting on the grid gives the
  same output rows as the full-chunk call;
- padded tokens (t >= lengths[b], or the tail of the last chunk) get k = q = v = 0, g = 0, beta = 0: they leave the
  state bit-identical (decay exp(0) = 1, zero update).
Every dot states its precision (an fp32 dot in Triton otherwise runs as TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config import merged_config

CHUNK = 64
_SUB = 16  # diagonal block size of the triangular inverse
_EPS = 1e-6

# Precision names -> what each dot does on the GPU. In interpret mode (CPU) every dot is exact fp32 (HIGHEST).
#   "ieee":   fp32 FMA (no tensor cores)          "tf32": TF32 tensor cores (10-bit mantissa inputs)
#   "tf32x3": three TF32 products (~fp32)         "bf16": operands rounded to bf16, fp32 accumulation
_PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16")

# Default configuration (tuned on the H200: see BENCHMARKS.md). Keys:
#   bv: V block of the state kernel; inv: "tiled" (everything on [16, 16] tiles: `_tiled_inverse`; runs 24-25),
#   "block16" (16x16 diagonal blocks by forward substitution on a [4, 16, 16] stack + block-Neumann merge on
#   [64, 64]; the default up to run 23), "doubling" (loop-free: diagonal blocks by repeated squaring; measured
#   slower) or "fwd64" (plain 64-row forward substitution, a slow fallback); warps_* / stages_*: Triton launch
#   parameters;
#   design: "split" or "fused" (module docstring); bv_out: V block of the split design's output kernel;
#   prep_kernels: 1, or 2 (split design: the inverse in its own small kernel, then w / u / kd); wk_dtype: storage
#   of w and kd between prep and recurrence ("auto", "float16", "float32": `_wk_dtype`); diag: the tiled inverse's
#   diagonal tiles by forward substitution ("subst") or loop-free block merging ("merge": not yet timed);
#   p_kk, p_inv, p_wu: prep-kernel dots (gram matrix, inverse merge, w/u); p_ws, p_kv: recurrence dots (w S,
#   k^T v_new); p_qk, p_qs, p_av: output-side dots (q k^T, q S, A v_new) — in the output kernel (split) or in the
#   prep and recurrence kernels (fused).
# Measured on the H200 (BENCHMARKS.md, run 3): split with 4 prep warps was the fastest over (1, 8192, 16, 32) +
# (8, 4096, 16, 32); all configurations kept outputs within 1.8e-3 and states within 8e-4 of the float64 oracle.
# Run 4: prep_kernels=2 (the inverse in its own kernel) took 2.23 + 6.08 ms against 2.42 + 7.19 ms, as accurate.
# Runs 24-25: the tiled inverse in one prep kernel, then fp16 w / kd: 1.31 + 4.41 ms against 1.80 + 6.01 (run 22's
# default), as accurate (states <= 8e-4 of the oracle).
# Benchmark-only keys: only_prep=True (or stop_after="prep") returns the prep kernel's outputs and stops;
# stop_after="inverse" (prep_kernels=2) returns after the inverse kernel; stop_after="state" (split design) returns
# after the recurrence kernel.
# Small grids (split design): when the recurrence's grid (V // bv, HV, B) has at most `small_grid` programs (132:
# one per SM of the H200), it runs with V blocks of `bv_small` and `stages_small` load stages instead — twice the
# programs, loads pipelined — unless the caller's config sets bv or stages_state. Runs 21-22: (1, 8192, 16, 32)
# 1.80 against 2.19 ms, (1, 32768, 16, 32) 6.92-6.99 against 8.30-8.34 (runs 14-15); at (8, 4096) the same setting
# was 2% slower, hence the rule.
# The bits do not depend on it (`_recurrence_blocks`).
DEFAULT_CONFIG = dict(
    design="split", bv_out=128, warps_out=4, stages_out=1, prep_kernels=1, warps_apply=4,
    bv=64, inv="tiled", warps_prep=4, stages_prep=1, warps_state=4, stages_state=1,
    small_grid=132, bv_small=32, stages_small=2, wk_dtype="auto", diag="subst",
    p_kk="tf32", p_inv="tf32x3", p_wu="tf32", p_qk="tf32", p_ws="tf32", p_qs="tf32", p_av="tf32", p_kv="tf32",
)


def _dot(a, b, prec, interpret, *, trans_a=False, trans_b=False):
    """2-D dot with an explicit precision, fp32 result."""
    ca = 0 if trans_a else 1
    cb = 1 if trans_b else 0
    dn = (((ca,), (cb,)), ((), ()))
    if interpret:
        return lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if prec == "bf16":
        return lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dn,
                               preferred_element_type=jnp.float32)
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    if prec == "ieee":
        p = lax.Precision.HIGHEST
    elif prec == "tf32":
        p = lax.Precision.HIGH
    elif prec == "tf32x3":
        p = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        raise ValueError(f"unknown precision {prec!r}; expected one of {_PRECISIONS}")
    return lax.dot_general(a, b, dn, precision=p, preferred_element_type=jnp.float32)


def _l2norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + _EPS)


def _unit_lower_inverse(a, prec, interpret):
    """(I + a)^-1 for a strictly lower [64, 64] fp32 matrix; row i of the result depends only on rows <= i of a.

    Diagonal 16x16 blocks: exact fp32 forward substitution on a [4, 16, 16] stack (elementwise, fixed-order
    reductions over 16). Then, with D the block-diagonal part (inverse Di) and E the strictly block-lower rest,
    N = Di E is nilpotent (N^4 = 0) and (I + a)^-1 = (I - N + N^2 - N^3) Di.
    """
    c, s = CHUNK, _SUB
    nb = c // s
    a4 = a.reshape(nb, s, nb, s)
    bi = lax.broadcasted_iota(jnp.int32, (nb, s, nb, s), 0)
    bj = lax.broadcasted_iota(jnp.int32, (nb, s, nb, s), 2)
    ad = jnp.sum(jnp.where(bi == bj, a4, 0.0), axis=2)  # [nb, s, s] diagonal blocks (exact: one term is non-zero)
    r = lax.broadcasted_iota(jnp.int32, (nb, s, s), 1)
    col = lax.broadcasted_iota(jnp.int32, (nb, s, s), 2)
    t0 = jnp.where(r == col, 1.0, 0.0).astype(jnp.float32)

    def body(i, t):
        arow = jnp.sum(jnp.where(r == i, ad, 0.0), axis=1)  # [nb, s]: a[b, i, :]
        contrib = jnp.sum(arow[:, :, None] * t, axis=1)  # [nb, s]: sum_j a[b, i, j] t[b, j, :]
        return jnp.where(r == i, t - contrib[:, None, :], t)

    t = lax.fori_loop(1, s, body, t0)
    di = jnp.where(bi == bj, jnp.broadcast_to(t[:, :, None, :], (nb, s, nb, s)), 0.0).reshape(c, c)
    return _merge_block_inverse(a, di, prec, interpret)


def _merge_block_inverse(a, di, prec, interpret):
    """(I + a)^-1 from di, the inverse of I plus a's 16x16 diagonal blocks: with E the strictly block-lower part of
    a, N = di E is nilpotent (N^4 = 0) and (I + a)^-1 = (I - N + N^2 - N^3) di."""
    c, s = CHUNK, _SUB
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cc = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    e = jnp.where(row // s > cc // s, a, 0.0)
    n1 = _dot(di, e, prec, interpret)
    n2 = _dot(n1, n1, prec, interpret)
    n3 = _dot(n2, n1, prec, interpret)
    eye = jnp.where(row == cc, 1.0, 0.0).astype(jnp.float32)
    p = eye - n1 + n2 - n3
    return _dot(p, di, prec, interpret)


def _chunk_slices(k_ref, g_ref, beta_ref, length, use_l2):
    """inv="tiled": the chunk as four 16-row slices, loaded straight from the refs: keys [16, K] (fp32, L2-normalised,
    padded rows exact zeros), beta [16] and the cumulative log-decay gc [16] — each slice's own cumsum plus the last
    value of the slice before (this design's gc: the kernel writes it out and every later kernel reads it)."""
    s = _SUB
    iota = lax.broadcasted_iota(jnp.int32, (s,), 0)
    ks, gcs, betas, valids = [], [], [], []
    for b in range(CHUNK // s):
        sl = pl.ds(b * s, s)
        valid = (pl.program_id(0) * CHUNK + b * s + iota) < length
        valids.append(valid)
        ks.append(_load_key(k_ref.at[sl], valid, use_l2))
        gc = jnp.cumsum(jnp.where(valid, g_ref[sl].astype(jnp.float32), 0.0))
        if gcs:
            gc = gc + jnp.sum(jnp.where(iota == s - 1, gcs[-1], 0.0))  # exact: one non-zero term
        gcs.append(gc)
        betas.append(jnp.where(valid, beta_ref[sl].astype(jnp.float32), 0.0))
    return ks, gcs, betas, valids


def _store_tiled_inverse(x_ref, gc_ref, x, gcs):
    """Write the tiled inverse as the [C, C] X (zeros above the diagonal tiles) and gc [C]."""
    s, nb = _SUB, CHUNK // _SUB
    zero = jnp.zeros((s, s), jnp.float32)
    for i in range(nb):
        gc_ref[pl.ds(i * s, s)] = gcs[i]
        for m in range(nb):
            x_ref[pl.ds(i * s, s), pl.ds(m * s, s)] = x[i, m] if m <= i else zero


def _store_tiled_wy(x, ks, gcs, betas, valids, v_ref, w_ref, u_ref, kd_ref, cfg, interpret):
    """w = X (beta exp(gc) k), u = X (beta v) and kd = k exp(gc_last - gc) (as `_apply_wy`), 16 rows at a time from
    the tiled inverse: w_i = sum_{m <= i} X_im (beta exp(gc) k)_m (the tiles above the diagonal are never used)."""
    s, nb = _SUB, CHUNK // _SUB
    iota = lax.broadcasted_iota(jnp.int32, (s,), 0)
    g_last = jnp.sum(jnp.where(iota == s - 1, gcs[-1], 0.0))
    bks = [kb * (beta * jnp.exp(gc))[:, None] for kb, beta, gc in zip(ks, betas, gcs)]
    bvs = [_masked(v_ref.at[pl.ds(m * s, s)], valid) * beta[:, None] for m, (valid, beta) in
           enumerate(zip(valids, betas))]
    for i in range(nb):
        sl = pl.ds(i * s, s)
        w = _dot(x[i, 0], bks[0], cfg["p_wu"], interpret)
        u = _dot(x[i, 0], bvs[0], cfg["p_wu"], interpret)
        for m in range(1, i + 1):
            w = w + _dot(x[i, m], bks[m], cfg["p_wu"], interpret)
            u = u + _dot(x[i, m], bvs[m], cfg["p_wu"], interpret)
        w_ref[sl, :] = w.astype(w_ref.dtype)
        u_ref[sl, :] = u
        kd_ref[sl, :] = (ks[i] * jnp.exp(g_last - gcs[i])[:, None]).astype(kd_ref.dtype)


def _diag_tiles_by_substitution(ks, gcs, betas, cfg, interpret):
    """diag="subst": T_i = (I + A_ii)^-1 of the four diagonal tiles by exact fp32 forward substitution (15 dependent
    steps; A_ii built transposed, so a row of A_ii is a reduction along the tile's second axis and the loop never
    re-lays-out a vector)."""
    s = _SUB
    r16 = lax.broadcasted_iota(jnp.int32, (s, s), 0)
    c16 = lax.broadcasted_iota(jnp.int32, (s, s), 1)
    upper = r16 < c16
    ats = []
    for kb, gc, beta in zip(ks, gcs, betas):  # A_ii^T[r, c] = beta_c k_r . k_c exp(gc_c - gc_r), r < c
        kk_t = _dot(kb, kb * beta[:, None], cfg["p_kk"], interpret, trans_b=True)
        ats.append(jnp.where(upper, kk_t * jnp.exp(jnp.where(upper, gc[None, :] - gc[:, None], 0.0)), 0.0))
    eye16 = jnp.where(r16 == c16, 1.0, 0.0).astype(jnp.float32)

    def body(i, ts):
        out = []
        for at, t in zip(ats, ts):
            arow = jnp.sum(jnp.where(c16 == i, at, 0.0), axis=1)  # [16] over j: A_ii[i, j]
            contrib = jnp.sum(arow[:, None] * t, axis=0)  # [16] over n: sum_j A_ii[i, j] t[j, n]
            out.append(jnp.where(r16 == i, t - contrib[None, :], t))
        return tuple(out)

    return lax.fori_loop(1, s, body, (eye16,) * len(ks))


def _diag_tiles_by_merging(ks, gcs, betas, cfg, interpret):
    """diag="merge" (a candidate, not yet timed on the GPU: run 26 ran out of device time after its accuracy checks,
    which matched "subst" to three digits): T_i = (I + A_ii)^-1 without a loop, by block forward substitution on
    blocks of 2, 4, 8, 16 rows. With D the inverse of I plus A's within-block part at one size, and E A's part inside
    blocks of twice that size but across their two halves, D E is nilpotent of order 2, so (I + A)^-1 at the doubled
    size is D - D E D. Blocks of 2 start exact (D = I - E, a sign flip), then three levels of two [16, 16] dots
    (p_inv). Every factor is lower triangular with exact zeros, so row r depends only on rows <= r (the j < 64 row
    property)."""
    s = _SUB
    r16 = lax.broadcasted_iota(jnp.int32, (s, s), 0)
    c16 = lax.broadcasted_iota(jnp.int32, (s, s), 1)
    lower = r16 > c16
    eye16 = jnp.where(r16 == c16, 1.0, 0.0).astype(jnp.float32)
    ts = []
    for kb, gc, beta in zip(ks, gcs, betas):  # A_ii[r, c] = beta_r k_r . k_c exp(gc_r - gc_c), r > c
        kk = _dot(kb * beta[:, None], kb, cfg["p_kk"], interpret, trans_b=True)
        a = jnp.where(lower, kk * jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
        d = eye16 - jnp.where(r16 // 2 == c16 // 2, a, 0.0)
        for half in (2, 4, 8):
            e = jnp.where((r16 // (2 * half) == c16 // (2 * half)) & (r16 // half != c16 // half), a, 0.0)
            d = d - _dot(d, _dot(e, d, cfg["p_inv"], interpret), cfg["p_inv"], interpret)
        ts.append(d)
    return ts


def _tiled_inverse(ks, gcs, betas, cfg, interpret):
    """X = (I + A)^-1 of one chunk as its ten lower [16, 16] tiles {(i, m): X_im, m <= i} (`_chunk_slices`' inputs).

    Diagonal tiles T_i = (I + A_ii)^-1 by forward substitution or by block merging (`cfg["diag"]`); then, block row
    by block row, X_im = -T_i (sum_{m <= j < i} A_ij X_jm) with sixteen [16, 16] dots (p_inv) — instead of the
    block-Neumann merge's four masked [64, 64] products. Row r of every tile depends only on tokens <= r of the
    chunk (T_i is lower triangular, its zeros exact), so the j < 64 row property holds."""
    nb = CHUNK // _SUB
    ts = (_diag_tiles_by_merging if cfg["diag"] == "merge" else _diag_tiles_by_substitution)(ks, gcs, betas, cfg,
                                                                                           interpret)
    x = {(i, i): ts[i] for i in range(nb)}
    for i in range(1, nb):
        bk = ks[i] * betas[i][:, None]
        a = {j: _dot(bk, ks[j], cfg["p_kk"], interpret, trans_b=True) * jnp.exp(gcs[i][:, None] - gcs[j][None, :])
             for j in range(i)}  # A_ij [16, 16], j < i: every entry strictly below the diagonal
        for m in range(i - 1, -1, -1):
            acc = _dot(a[m], x[m, m], cfg["p_inv"], interpret)
            for j in range(m + 1, i):
                acc = acc + _dot(a[j], x[j, m], cfg["p_inv"], interpret)
            x[i, m] = -_dot(ts[i], acc, cfg["p_inv"], interpret)
    return x


def _unit_lower_inverse_doubling(a, prec, interpret):
    """(I + a)^-1 without loops or reshapes (candidate for speed; measure before making it the default).

    Diagonal 16x16 blocks: with Nd the within-block part of a (nilpotent, Nd^16 = 0),
    (I + Nd)^-1 = (I - Nd)(I + Nd^2)(I + Nd^4)(I + Nd^8); then the same block-Neumann merge as `_unit_lower_inverse`.
    All factors are lower triangular, so row i still depends only on rows <= i. The doubling products can have
    large intermediate entries when keys in a block are nearly parallel (beta ~ 1, g ~ 0), so run it with an
    accurate precision (tf32x3 or ieee).
    """
    c, s = CHUNK, _SUB
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    same = row // s == col // s
    nd = jnp.where(same, a, 0.0)
    e = jnp.where(row // s > col // s, a, 0.0)
    n2 = _dot(nd, nd, prec, interpret)
    n4 = _dot(n2, n2, prec, interpret)
    n8 = _dot(n4, n4, prec, interpret)
    di = _dot(eye - nd, eye + n2, prec, interpret)
    di = _dot(di, eye + n4, prec, interpret)
    di = _dot(di, eye + n8, prec, interpret)
    di = jnp.where(same, di, 0.0)  # exact block-diagonal structure
    n1 = _dot(di, e, prec, interpret)
    n2 = _dot(n1, n1, prec, interpret)
    n3 = _dot(n2, n1, prec, interpret)
    return _dot(eye - n1 + n2 - n3, di, prec, interpret)


def _unit_lower_inverse_fwd64(a):
    """(I + a)^-1 by plain forward substitution over all 64 rows on [64, 64] tiles (exact fp32; slower fallback)."""
    row = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)

    def body(i, t):
        arow = jnp.sum(jnp.where(row == i, a, 0.0), axis=0)  # [C]: a[i, :]
        contrib = jnp.sum(arow[:, None] * t, axis=0)  # [C]: sum_j a[i, j] t[j, :]
        return jnp.where(row == i, t - contrib[None, :], t)

    return lax.fori_loop(1, CHUNK, body, jnp.where(row == col, 1.0, 0.0).astype(jnp.float32))


def _valid_rows(length):
    """[C] bool: which rows of this program's chunk (grid axis 0) are real tokens."""
    iota = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    return (pl.program_id(0) * CHUNK + iota) < length


def _load_key(ref, valid, use_l2):
    """q or k rows [R, K] in fp32: L2-normalised (optional), padded rows exact zeros (`where`: NaN cannot leak)."""
    x = ref[...].astype(jnp.float32)
    if use_l2:
        x = _l2norm(x)
    return jnp.where(valid[:, None], x, 0.0)


def _masked(ref, valid):
    x = ref[...].astype(jnp.float32)
    return jnp.where(valid[:, None] if x.ndim == 2 else valid, x, 0.0)


def _last(x):
    """x[C - 1] of a [C] vector, as a reduction Triton can lower (exact: one non-zero term)."""
    iota = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    return jnp.sum(jnp.where(iota == CHUNK - 1, x, 0.0))


def _causal_decay(gc, strict):
    """exp(gc_i - gc_j) on the (strictly) lower triangle, exact zeros above (`where` before `exp`: no overflow)."""
    row = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    lower = row > col if strict else row >= col
    return lower, jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], 0.0))


def _wy(k, v, beta, gc, cfg, interpret):
    """WY/UT form of one chunk: X = (I + A)^-1 with A[i, j] = beta_i k_i . k_j exp(gc_i - gc_j) (j < i);
    returns w = X (beta exp(gc) k) [C, K], u = X (beta v) [C, V] and kd = k exp(gc_last - gc) [C, K]."""
    return _apply_wy(_wy_inverse(k, beta, gc, cfg, interpret), k, v, beta, gc, cfg, interpret)


def _wy_inverse(k, beta, gc, cfg, interpret):
    """X = (I + A)^-1 [C, C] (see `_wy`)."""
    lower, decay = _causal_decay(gc, strict=True)
    kk = _dot(k * beta[:, None], k, cfg["p_kk"], interpret, trans_b=True)  # [C, C]
    a = jnp.where(lower, kk * decay, 0.0)
    if cfg["inv"] == "fwd64":
        return _unit_lower_inverse_fwd64(a)
    if cfg["inv"] == "doubling":
        return _unit_lower_inverse_doubling(a, cfg["p_inv"], interpret)
    return _unit_lower_inverse(a, cfg["p_inv"], interpret)


def _wy_rhs(k, v, beta, gc):
    """The right-hand sides of w = X (beta exp(gc) k) and u = X (beta v): [C, K] and [C, V]."""
    return k * beta[:, None] * jnp.exp(gc)[:, None], v * beta[:, None]


def _apply_wy(x, k, v, beta, gc, cfg, interpret):
    """(w, u, kd) of `_wy` from the inverse X."""
    bk, bv = _wy_rhs(k, v, beta, gc)
    u = _dot(x, bv, cfg["p_wu"], interpret)
    w = _dot(x, bk, cfg["p_wu"], interpret)
    kd = k * jnp.exp(_last(gc) - gc)[:, None]
    return w, u, kd


def _intra(q, k, gc, cfg, interpret):
    """Masked intra-chunk attention Aqk[i, j] = q_i . k_j exp(gc_i - gc_j) (j <= i) [C, C] and qg = q exp(gc)."""
    lower, decay = _causal_decay(gc, strict=False)
    qk = _dot(q, k, cfg["p_qk"], interpret, trans_b=True)
    return jnp.where(lower, qk * decay, 0.0), q * jnp.exp(gc)[:, None]


def _prep_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kd_ref, aqk_ref, gc_ref, *,
                 scale, use_l2, cfg, interpret):
    """Fused design, parallel part: w, u, kd, gc and the output-side qg, Aqk of one chunk (written in fp32)."""
    valid = _valid_rows(len_ref[0])
    q = _load_key(q_ref, valid, use_l2) * scale  # scale folded into q (padded rows stay exact zeros)
    k = _load_key(k_ref, valid, use_l2)
    gc = jnp.cumsum(_masked(g_ref, valid))  # [C]; padded tokens add exact zeros
    gc_ref[...] = gc
    aqk_ref[...], qg_ref[...] = _intra(q, k, gc, cfg, interpret)
    w_ref[...], u_ref[...], kd_ref[...] = _wy(k, _masked(v_ref, valid), _masked(beta_ref, valid), gc, cfg, interpret)


def _state_kernel(w_ref, u_ref, qg_ref, kd_ref, aqk_ref, gc_ref, s0_ref, o_ref, st_ref, *ck_refs, nt, per, nck, cfg,
                  interpret):
    """Fused design, sequential part: per chunk v_new = u - w S; o = qg S + Aqk v_new; S = exp(gc_last) S + kd^T v_new."""

    def body(c, s):
        sl = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        g_last = _last(gc_ref[sl])
        v_new = u_ref[sl, :] - _dot(w_ref[sl, :], s, cfg["p_ws"], interpret)  # [C, BV]
        o = _dot(qg_ref[sl, :], s, cfg["p_qs"], interpret) + _dot(aqk_ref[sl, :], v_new, cfg["p_av"], interpret)
        o_ref[sl, :] = o.astype(o_ref.dtype)
        s = s * jnp.exp(g_last) + _dot(kd_ref[sl, :], v_new, cfg["p_kv"], interpret, trans_a=True)
        if per:
            m = lax.div(c + 1, per)

            @pl.when((lax.rem(c + 1, per) == 0) & (m <= nck))
            def _():
                ck_refs[0][m - 1] = s

        return s

    s = lax.fori_loop(0, nt, body, s0_ref[...].astype(jnp.float32))
    st_ref[...] = s


def _prep_split_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gc_ref, *, use_l2, cfg,
                       interpret):
    """Split design, parallel part 1: w, u, kd, gc of one chunk (fp32). Needs no q."""
    if cfg["inv"] == "tiled":
        ks, gcs, betas, valids = _chunk_slices(k_ref, g_ref, beta_ref, len_ref[0], use_l2)
        for i, gc in enumerate(gcs):
            gc_ref[pl.ds(i * _SUB, _SUB)] = gc
        _store_tiled_wy(_tiled_inverse(ks, gcs, betas, cfg, interpret), ks, gcs, betas, valids, v_ref, w_ref, u_ref,
                        kd_ref, cfg, interpret)
        return
    valid = _valid_rows(len_ref[0])
    k = _load_key(k_ref, valid, use_l2)
    gc = jnp.cumsum(_masked(g_ref, valid))
    gc_ref[...] = gc
    _store_wy(w_ref, u_ref, kd_ref, _wy(k, _masked(v_ref, valid), _masked(beta_ref, valid), gc, cfg, interpret))


def _store_wy(w_ref, u_ref, kd_ref, wy):
    """Write (w, u, kd), w and kd in their refs' dtype (fp16 storage: `_wk_dtype`)."""
    w, u, kd = wy
    w_ref[...] = w.astype(w_ref.dtype)
    u_ref[...] = u
    kd_ref[...] = kd.astype(kd_ref.dtype)


def _inverse_kernel(len_ref, k_ref, g_ref, beta_ref, x_ref, gc_ref, *, use_l2, cfg, interpret):
    """Split design with prep_kernels=2, part 1: X = (I + A)^-1 [C, C] and gc of one chunk (a small footprint:
    [C, C] tiles and one [C, K] block live, so more programs fit on an SM to hide the inverse's latency)."""
    if cfg["inv"] == "tiled":
        ks, gcs, betas, _ = _chunk_slices(k_ref, g_ref, beta_ref, len_ref[0], use_l2)
        _store_tiled_inverse(x_ref, gc_ref, _tiled_inverse(ks, gcs, betas, cfg, interpret), gcs)
        return
    valid = _valid_rows(len_ref[0])
    gc = jnp.cumsum(_masked(g_ref, valid))
    gc_ref[...] = gc
    x_ref[...] = _wy_inverse(_load_key(k_ref, valid, use_l2), _masked(beta_ref, valid), gc, cfg, interpret)


def _apply_kernel(len_ref, k_ref, v_ref, beta_ref, gc_ref, x_ref, w_ref, u_ref, kd_ref, *, use_l2, cfg, interpret):
    """Split design with prep_kernels=2, part 2: w, u and kd of one chunk from X (two dots, throughput-bound)."""
    valid = _valid_rows(len_ref[0])
    _store_wy(w_ref, u_ref, kd_ref, _apply_wy(x_ref[...], _load_key(k_ref, valid, use_l2), _masked(v_ref, valid),
                                              _masked(beta_ref, valid), gc_ref[...], cfg, interpret))


def _state_split_kernel(w_ref, u_ref, kd_ref, gc_ref, s0_ref, h_ref, vn_ref, st_ref, *, nt, cfg, interpret):
    """Split design, sequential part: only the state recurrence (two dots per chunk). Writes the fp32 state at the
    start of every chunk (h) and v_new = u - w S; the output needs nothing else from the recurrence."""

    def body(c, s):
        sl = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        h_ref[c] = s
        v_new = u_ref[sl, :] - _dot(w_ref[sl, :].astype(jnp.float32), s, cfg["p_ws"], interpret)  # [C, BV]
        vn_ref[sl, :] = v_new
        kd = kd_ref[sl, :].astype(jnp.float32)
        return s * jnp.exp(_last(gc_ref[sl])) + _dot(kd, v_new, cfg["p_kv"], interpret, trans_a=True)

    st_ref[...] = lax.fori_loop(0, nt, body, s0_ref[...].astype(jnp.float32))


def _out_kernel(len_ref, q_ref, k_ref, gc_ref, h_ref, vn_ref, o_ref, *, scale, use_l2, cfg, interpret):
    """Split design, parallel part 2: o = qg S_c + Aqk v_new for one chunk (q k^T recomputed from the inputs)."""
    valid = _valid_rows(len_ref[0])
    q = _load_key(q_ref, valid, use_l2) * scale
    k = _load_key(k_ref, valid, use_l2)
    aqk, qg = _intra(q, k, gc_ref[...], cfg, interpret)
    o = _dot(qg, h_ref[...], cfg["p_qs"], interpret) + _dot(aqk, vn_ref[...], cfg["p_av"], interpret)
    o_ref[...] = o.astype(o_ref.dtype)


def _checked_config(config, V: int) -> dict:
    """DEFAULT_CONFIG updated with `config`, with the choices that would otherwise fail silently checked."""
    cfg = merged_config("chunk_gated_delta_rule", DEFAULT_CONFIG, config,
                        blocks={"bv": V, "bv_out": V, "bv_small": V},
                        extra=("only_prep", "stop_after"))
    if cfg["design"] not in ("split", "fused"):
        raise ValueError(f"unknown design {cfg['design']!r}; expected 'split' or 'fused'")
    if cfg["inv"] not in ("tiled", "block16", "doubling", "fwd64"):
        raise ValueError(f"unknown inv {cfg['inv']!r}; expected 'tiled', 'block16', 'doubling' or 'fwd64'")
    if cfg["inv"] == "tiled" and cfg["design"] != "split":
        raise ValueError("inv='tiled' (the default) needs the split design; the fused design takes inv='block16'")
    if cfg["prep_kernels"] not in (1, 2) or (cfg["prep_kernels"] == 2 and cfg["design"] != "split"):
        raise ValueError(f"prep_kernels={cfg['prep_kernels']!r}: 1, or 2 with the split design")
    if cfg["diag"] not in ("merge", "subst"):
        raise ValueError(f"diag={cfg['diag']!r}: expected 'merge' or 'subst'")
    if cfg["wk_dtype"] not in ("auto", "float16", "float32"):
        raise ValueError(f"wk_dtype={cfg['wk_dtype']!r}: expected 'auto', 'float16' or 'float32'")
    for name, p in cfg.items():
        if name.startswith("p_") and p not in _PRECISIONS:
            raise ValueError(f"{name}={p!r}: expected one of {_PRECISIONS}")
    return cfg


def _recurrence_blocks(cfg: dict, config, B: int, HV: int, V: int, interpret: bool) -> dict:
    """The split design's recurrence launch for this shape: `bv_small` / `stages_small` on a grid of at most
    `small_grid` programs (DEFAULT_CONFIG), unless `config` (the caller's) sets bv or stages_state.

    Bitwise safe on the GPU: every element of v_new = u - w S and of kd^T v_new is one tensor-core dot over the same
    axis (K, or the chunk's 64 rows) in the same order whatever the V block, and pipelining moves loads, not
    arithmetic — so a row alone (a small grid) and the same row in a batch (a large one) still agree bit for bit.
    Checked on the H200 (run 21: bv=32 with 2 stages == the default, outputs and states; `scripts/gpu_kernels.py`
    also checks a row alone against a batch across the switch). Not in interpret mode: there the dots are
    XLA:CPU's, whose rounding does depend on the block width (seen in the tests), and speed is not the point."""
    user = dict(config or ())
    if interpret or cfg["design"] != "split" or "bv" in user or "stages_state" in user:
        return cfg
    if (V // min(cfg["bv"], V)) * HV * B > cfg["small_grid"]:
        return cfg
    return dict(cfg, bv=cfg["bv_small"], stages_state=cfg["stages_small"])


def _wk_dtype(cfg: dict, use_l2: bool, interpret: bool):
    """Storage dtype of the split design's w and kd between the prep and the recurrence kernels.

    "auto" (default): fp16 on the GPU when q/k are L2-normalised, else fp32. With unit keys, beta in [0, 1] and
    log-decays g <= 0, every entry of kd = k exp(gc_last - gc) and of w = X (beta exp(gc) k) lies in [-1, 1] (a row
    of w is beta_i exp(gc_i) k_i carried through the chunk's earlier factors I - beta_j k_j k_j^T, each of norm <= 1),
    so fp16 cannot overflow, and its 10-bit mantissa is the TF32 mantissa the recurrence's dots round them to anyway:
    half the bytes of the recurrence's largest reads, the same accuracy class (BENCHMARKS.md, run 25). In interpret
    mode "auto" keeps fp32, so the CPU tests' exact-fp32 tolerances hold; "float16" forces it (tested on CPU)."""
    choice = cfg["wk_dtype"]
    if choice == "auto":
        return jnp.float16 if use_l2 and not interpret else jnp.float32
    return jnp.float16 if choice == "float16" else jnp.float32


def _check_pow2(name, x, lo=16):
    if x < lo or x & (x - 1):
        raise ValueError(f"{name}={x}: the Pallas-Triton kernels need a power of two >= {lo}")


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "checkpoint_stride", "interpret", "config"))
def _chunk_impl(q, k, v, g, beta, initial_state, lengths, *, scale, use_qk_l2norm, checkpoint_stride, interpret,
                config):
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cfg = _recurrence_blocks(_checked_config(config, V), config, B, HV, V, interpret)
    nt = -(-T // CHUNK)
    tp = nt * CHUNK
    if tp != T:
        pad = tp - T
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    if cfg["design"] == "split":
        return _split_calls(q, k, v, g, beta, initial_state, lengths, T=T, scale=scale, use_l2=use_qk_l2norm,
                            checkpoint_stride=checkpoint_stride, interpret=interpret, cfg=cfg)
    bv = min(cfg["bv"], V)
    nv = V // bv
    f32 = jnp.float32

    cg = _ChunkGrid(q, v)
    prep = pl.pallas_call(
        functools.partial(_prep_kernel, scale=scale, use_l2=use_qk_l2norm, cfg=cfg, interpret=interpret),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.key, cg.value, cg.token, cg.token],
        out_specs=[cg.rows(K), cg.rows(V), cg.rows(K), cg.rows(K), cg.rows(CHUNK), cg.gc],
        # w, u, q * scale * exp(gc), k * exp(gc_last - gc), masked intra-chunk attention, gc
        out_shape=[cg.rows_out(K), cg.rows_out(V), cg.rows_out(K), cg.rows_out(K), cg.rows_out(CHUNK), cg.gc_out],
        compiler_params=_triton_params(cfg["warps_prep"], cfg["stages_prep"]),
        interpret=interpret,
        name="gdn_chunk_prep",
    )
    w, u, qg, kd, aqk, gc = prep(lengths, q, k, v, g, beta)
    if cfg.get("only_prep") or cfg.get("stop_after") == "prep":  # benchmarking hook: the parallel kernel alone
        return w, u, qg, kd, aqk, gc

    per = 0 if checkpoint_stride is None else checkpoint_stride // CHUNK
    nck = 0 if checkpoint_stride is None else T // checkpoint_stride
    out_specs = [
        pl.BlockSpec((None, tp, None, bv), lambda j, h, b: (b, 0, h, j)),
        pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, tp, HV, V), v.dtype), jax.ShapeDtypeStruct((B, HV, K, V), f32)]
    if nck:
        out_specs.append(pl.BlockSpec((None, nck, None, K, bv), lambda j, h, b: (b, 0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, nck, HV, K, V), f32))
    state = pl.pallas_call(
        functools.partial(_state_kernel, nt=nt, per=per if nck else 0, nck=nck, cfg=cfg, interpret=interpret),
        grid=(nv, HV, B),
        in_specs=[
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, CHUNK), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp), lambda j, h, b: (b, h, 0)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_triton_params(cfg["warps_state"], cfg["stages_state"]),
        interpret=interpret,
        name="gdn_chunk_state",
    )
    outs = state(w, u, qg, kd, aqk, gc, initial_state)
    o = outs[0][:, :T] if tp != T else outs[0]
    if checkpoint_stride is None:
        return o, outs[1]
    ck = outs[2] if nck else jnp.zeros((B, 0, HV, K, V), f32)
    return o, outs[1], ck


class _ChunkGrid:
    """Grid (NT, HV, B) of the chunk-parallel kernels (prep, inverse, apply) and their operands' BlockSpecs, for
    inputs q/k [B, Tp, HK, K], v [B, Tp, HV, V], g/beta [B, Tp, HV] and per-chunk outputs [B, HV, Tp, n]."""

    def __init__(self, q, v):
        self.B, self.tp, hk, self.K = q.shape
        self.HV, self.V = v.shape[2], v.shape[3]
        g = self.HV // hk
        self.grid = (self.tp // CHUNK, self.HV, self.B)
        self.lengths = pl.BlockSpec((1,), lambda c, h, b: (b,))
        self.key = pl.BlockSpec((None, CHUNK, None, self.K), lambda c, h, b: (b, c, h // g, 0))
        self.value = pl.BlockSpec((None, CHUNK, None, self.V), lambda c, h, b: (b, c, h, 0))
        self.token = pl.BlockSpec((None, CHUNK, None), lambda c, h, b: (b, c, h))
        self.gc = pl.BlockSpec((None, None, CHUNK), lambda c, h, b: (b, h, c))
        self.gc_out = jax.ShapeDtypeStruct((self.B, self.HV, self.tp), jnp.float32)

    def rows(self, n):
        """BlockSpec of a per-chunk [B, HV, Tp, n] array."""
        return pl.BlockSpec((None, None, CHUNK, n), lambda c, h, b: (b, h, c, 0))

    def rows_out(self, n, dtype=jnp.float32):
        return jax.ShapeDtypeStruct((self.B, self.HV, self.tp, n), dtype)


def _split_calls(q, k, v, g, beta, initial_state, lengths, *, T, scale, use_l2, checkpoint_stride, interpret, cfg):
    """The split design's pallas_calls (inputs already padded to the grid): prep (one kernel, or two with
    prep_kernels=2) -> recurrence -> output."""
    if cfg["prep_kernels"] == 2:
        w, u, kd, gc = _prep_two_calls(q, k, v, g, beta, lengths, use_l2=use_l2, interpret=interpret, cfg=cfg)
    else:
        w, u, kd, gc = _prep_one_call(q, k, v, g, beta, lengths, use_l2=use_l2, interpret=interpret, cfg=cfg)
    if cfg.get("only_prep") or cfg.get("stop_after") in ("prep", "inverse"):
        return tuple(x for x in (w, u, kd, gc) if x is not None)
    return _recurrence_and_output(q, k, v, w, u, kd, gc, initial_state, lengths, T=T, scale=scale, use_l2=use_l2,
                                  checkpoint_stride=checkpoint_stride, interpret=interpret, cfg=cfg)


def _prep_one_call(q, k, v, g, beta, lengths, *, use_l2, interpret, cfg):
    """The split design's prep kernel: (w, u, kd, gc)."""
    cg = _ChunkGrid(q, v)
    wk = _wk_dtype(cfg, use_l2, interpret)
    return pl.pallas_call(
        functools.partial(_prep_split_kernel, use_l2=use_l2, cfg=cfg, interpret=interpret),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.value, cg.token, cg.token],
        out_specs=[cg.rows(cg.K), cg.rows(cg.V), cg.rows(cg.K), cg.gc],
        out_shape=[cg.rows_out(cg.K, wk), cg.rows_out(cg.V), cg.rows_out(cg.K, wk), cg.gc_out],
        compiler_params=_triton_params(cfg["warps_prep"], cfg["stages_prep"]),
        interpret=interpret,
        name="gdn_chunk_prep",
    )(lengths, k, v, g, beta)


def _prep_two_calls(q, k, v, g, beta, lengths, *, use_l2, interpret, cfg):
    """prep_kernels=2: the inverse (and gc) in one kernel, w / u / kd in a second; X goes through memory (fp32)."""
    cg = _ChunkGrid(q, v)
    wk = _wk_dtype(cfg, use_l2, interpret)
    x, gc = pl.pallas_call(
        functools.partial(_inverse_kernel, use_l2=use_l2, cfg=cfg, interpret=interpret),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.token, cg.token],
        out_specs=[cg.rows(CHUNK), cg.gc],
        out_shape=[cg.rows_out(CHUNK), cg.gc_out],
        compiler_params=_triton_params(cfg["warps_prep"], cfg["stages_prep"]),
        interpret=interpret,
        name="gdn_chunk_inverse",
    )(lengths, k, g, beta)
    if cfg.get("stop_after") == "inverse":  # benchmarking hook: the inverse kernel alone (X in place of w)
        return x, None, None, gc
    w, u, kd = pl.pallas_call(
        functools.partial(_apply_kernel, use_l2=use_l2, cfg=cfg, interpret=interpret),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.value, cg.token, cg.gc, cg.rows(CHUNK)],
        out_specs=[cg.rows(cg.K), cg.rows(cg.V), cg.rows(cg.K)],
        out_shape=[cg.rows_out(cg.K, wk), cg.rows_out(cg.V), cg.rows_out(cg.K, wk)],
        compiler_params=_triton_params(cfg["warps_apply"], 1),
        interpret=interpret,
        name="gdn_chunk_apply",
    )(lengths, k, v, beta, gc, x)
    return w, u, kd, gc


def _recurrence_and_output(q, k, v, w, u, kd, gc, initial_state, lengths, *, T, scale, use_l2, checkpoint_stride,
                           interpret, cfg):
    """The split design's recurrence and output kernels, and the in-call checkpoints."""
    B, tp, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // HK
    nt = tp // CHUNK
    bv = min(cfg["bv"], V)
    bvo = min(cfg["bv_out"], V)
    f32 = jnp.float32
    h, vn, final = pl.pallas_call(
        functools.partial(_state_split_kernel, nt=nt, cfg=cfg, interpret=interpret),
        grid=(V // bv, HV, B),
        in_specs=[
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp), lambda j, h, b: (b, h, 0)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, nt, K, bv), lambda j, h, b: (b, h, 0, 0, j)),
            pl.BlockSpec((None, None, tp, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, HV, nt, K, V), f32),  # state at the start of every chunk
            jax.ShapeDtypeStruct((B, HV, tp, V), f32),  # v_new
            jax.ShapeDtypeStruct((B, HV, K, V), f32),  # final state
        ],
        compiler_params=_triton_params(cfg["warps_state"], cfg["stages_state"]),
        interpret=interpret,
        name="gdn_chunk_state",
    )(w, u, kd, gc, initial_state)
    if cfg.get("stop_after") == "state":
        return h, vn, final

    o = pl.pallas_call(
        functools.partial(_out_kernel, scale=scale, use_l2=use_l2, cfg=cfg, interpret=interpret),
        grid=(nt, HV, B, V // bvo),
        in_specs=[
            pl.BlockSpec((1,), lambda c, h, b, j: (b,)),
            pl.BlockSpec((None, CHUNK, None, K), lambda c, h, b, j: (b, c, h // G, 0)),
            pl.BlockSpec((None, CHUNK, None, K), lambda c, h, b, j: (b, c, h // G, 0)),
            pl.BlockSpec((None, None, CHUNK), lambda c, h, b, j: (b, h, c)),
            pl.BlockSpec((None, None, None, K, bvo), lambda c, h, b, j: (b, h, c, 0, j)),
            pl.BlockSpec((None, None, CHUNK, bvo), lambda c, h, b, j: (b, h, c, j)),
        ],
        out_specs=pl.BlockSpec((None, CHUNK, None, bvo), lambda c, h, b, j: (b, c, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, tp, HV, V), v.dtype),
        compiler_params=_triton_params(cfg["warps_out"], cfg["stages_out"]),
        interpret=interpret,
        name="gdn_chunk_out",
    )(lengths, q, k, gc, h, vn)
    o = o[:, :T] if tp != T else o
    if checkpoint_stride is None:
        return o, final
    # the state after m * per chunks is the state at the start of chunk m * per (or the final state): exact copies
    per = checkpoint_stride // CHUNK
    idx = [m * per for m in range(1, T // checkpoint_stride + 1)]
    parts = [h[:, :, i] for i in idx if i < nt] + [final for i in idx if i >= nt]
    ck = jnp.stack(parts, axis=1) if parts else jnp.zeros((B, 0, HV, K, V), f32)
    return o, final, ck


def _triton_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True,
                                  lengths=None, checkpoint_stride=None, interpret=False, config=None):
    """Chunked gated delta rule (prefill) with Pallas kernels. Shapes and semantics: `reference.py`.

    q, k: [B,T,HK,K] (bf16 or fp32); v: [B,T,HV,V]; g: fp32 log-decay [B,T,HV]; beta: [B,T,HV];
    initial_state fp32 [B,HV,K,V] or None; lengths int32 [B] or None; checkpoint_stride None or a multiple of 64.
    Returns (o [B,T,HV,V] in v.dtype, final_state fp32 [B,HV,K,V]) or (o, final_state, checkpoints
    [B, T // stride, HV, K, V]). `config` (a dict, see DEFAULT_CONFIG) overrides launch/precision choices.
    """
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [B,T,HK,K] and v [B,T,HV,V]; got {q.shape}, {k.shape}, {v.shape}")
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B,T,HV]={(B, T, HV)}; got {g.shape}, {beta.shape}")
    if checkpoint_stride is not None and (checkpoint_stride <= 0 or checkpoint_stride % CHUNK):
        raise ValueError(f"checkpoint_stride must be a positive multiple of {CHUNK}; got {checkpoint_stride}")
    _check_pow2("K", K)
    _check_pow2("V", V)
    scale = float(K**-0.5 if scale is None else scale)
    if initial_state is None:
        initial_state = jnp.zeros((B, HV, K, V), jnp.float32)
    elif initial_state.shape != (B, HV, K, V):
        raise ValueError(f"initial_state must be [B,HV,K,V]={(B, HV, K, V)}; got {initial_state.shape}")
    lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
               else jnp.clip(jnp.asarray(lengths, jnp.int32), 0, T))  # a negative length: an empty row
    config = None if config is None else tuple(sorted(dict(config).items()))
    return _chunk_impl(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
                       initial_state.astype(jnp.float32), lengths, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                       checkpoint_stride=checkpoint_stride, interpret=bool(interpret), config=config)
