"""The per-chunk algebra of the chunked prefill (WY/UT form, chunk 64): value-level functions that the Pallas
kernels of `chunk.py` trace (in interpret mode on CPU, every dot exact fp32).

Per chunk and value head (dimension legend in `reference.py`; C = 64): A[i, j] = beta_i (k_i . k_j) exp(gc_i - gc_j)
for j < i, X = (I + A)^-1 (unit lower triangular), w = X (beta exp(gc) k), u = X (beta v), kd = k exp(gc_last - gc),
and the output side's masked attention Aqk and qg. The inverse comes in four forms (`chunk.DEFAULT_CONFIG["inv"]`):
`tiled_inverse` on [16, 16] tiles (the default), `inverse_block16` on [64, 64] with a block-Neumann merge,
`inverse_doubling` and `inverse_fwd64`. Every form is row-causal: row i depends only on rows <= i, through exact
zeros, so a call of j < 64 tokens gives the same rows as the full chunk. Every dot states its precision (`dot`).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from .reference import CHUNK

SUB = 16  # diagonal block size of the triangular inverse
EPS = 1e-6

# Precision names -> what each dot does on the GPU. In interpret mode (CPU) every dot is exact fp32 (HIGHEST).
#   "ieee":   fp32 FMA (no tensor cores)          "tf32": TF32 tensor cores (10-bit mantissa inputs)
#   "tf32x3": three TF32 products (~fp32)         "bf16": operands rounded to bf16, fp32 accumulation
#   "bf16x3": three bf16 dots of the operands' halves (a = a_hi + a_lo, both bf16; every product exact in fp32,
#             only a_lo b_lo dropped: ~2^-16 relative), fp32 accumulation
#   "fp16":   operands rounded to fp16 (TF32's 10-bit mantissa at bf16's rate; finite only below 65504 in magnitude:
#             the default gram tiles on L2-normalised keys, `chunk._gram_precision`), fp32 accumulation
PRECISIONS = ("ieee", "tf32", "tf32x3", "bf16", "bf16x3", "fp16")


def dot(a, b, prec, interpret, *, trans_a=False, trans_b=False):
    """2-D dot with an explicit precision, fp32 result."""
    ca = 0 if trans_a else 1
    cb = 1 if trans_b else 0
    dn = (((ca,), (cb,)), ((), ()))
    if interpret:
        return lax.dot_general(a, b, dn, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    if prec in ("bf16", "fp16"):  # operands rounded to the 16-bit type, one tensor-core dot
        dt = jnp.bfloat16 if prec == "bf16" else jnp.float16
        return lax.dot_general(a.astype(dt), b.astype(dt), dn, preferred_element_type=jnp.float32)
    if prec == "bf16x3":  # (a_hi b_lo + a_lo b_hi) + a_hi b_hi, in that order
        (a_hi, a_lo), (b_hi, b_lo) = bf16_halves(a), bf16_halves(b)
        small = (lax.dot_general(a_hi, b_lo, dn, preferred_element_type=jnp.float32)
                 + lax.dot_general(a_lo, b_hi, dn, preferred_element_type=jnp.float32))
        return small + lax.dot_general(a_hi, b_hi, dn, preferred_element_type=jnp.float32)
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    if prec == "ieee":
        p = lax.Precision.HIGHEST
    elif prec == "tf32":
        p = lax.Precision.HIGH
    elif prec == "tf32x3":
        p = lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    else:
        raise ValueError(f"unknown precision {prec!r}; expected one of {PRECISIONS}")
    return lax.dot_general(a, b, dn, precision=p, preferred_element_type=jnp.float32)


def bf16_halves(x):
    """x (fp32) as hi + lo, both bf16: hi = x rounded to bf16, lo = the rest rounded to bf16."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x.astype(jnp.float32) - hi.astype(jnp.float32)).astype(jnp.bfloat16)


def rnorm(x):
    """1 / sqrt(|x_i|^2 + eps) of each row of x [R, D], as [R, 1] (the one place its row sums are written: the
    Mosaic GPU output kernel takes them from a Triton kernel that calls this, `output_mgpu.key_norms`)."""
    return lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + EPS)


def l2norm(x):
    return x * rnorm(x)


def inverse_block16(a, prec, interpret):
    """(I + a)^-1 for a strictly lower [64, 64] fp32 matrix; row i of the result depends only on rows <= i of a.

    Diagonal 16x16 blocks: exact fp32 forward substitution on a [4, 16, 16] stack (elementwise, fixed-order
    reductions over 16). Then, with D the block-diagonal part (inverse Di) and E the strictly block-lower rest,
    N = Di E is nilpotent (N^4 = 0) and (I + a)^-1 = (I - N + N^2 - N^3) Di.
    """
    c, s = CHUNK, SUB
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
    return merge_block_inverse(a, di, prec, interpret)


def merge_block_inverse(a, di, prec, interpret):
    """(I + a)^-1 from di, the inverse of I plus a's 16x16 diagonal blocks: with E the strictly block-lower part of
    a, N = di E is nilpotent (N^4 = 0) and (I + a)^-1 = (I - N + N^2 - N^3) di."""
    c, s = CHUNK, SUB
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    cc = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    e = jnp.where(row // s > cc // s, a, 0.0)
    n1 = dot(di, e, prec, interpret)
    n2 = dot(n1, n1, prec, interpret)
    n3 = dot(n2, n1, prec, interpret)
    eye = jnp.where(row == cc, 1.0, 0.0).astype(jnp.float32)
    p = eye - n1 + n2 - n3
    return dot(p, di, prec, interpret)


def diag_tiles_by_substitution(ks, gcs, betas, cfg, interpret):
    """T_i = (I + A_ii)^-1 of the four diagonal tiles by exact fp32 forward substitution (15 dependent
    steps; A_ii built transposed, so a row of A_ii is a reduction along the tile's second axis and the steps never
    re-lay-out a vector). Step i computes row i from rows < i (`substitution_step`: the replay step runs one step
    per token, from the rows its cache holds).

    The steps are unrolled in Python (a static row index), not a `fori_loop`: the same operations and the same bits
    (the H200, 2026-12-01: outputs and final states equal at (8, 4096) and (1, 32768)), and the prep kernel ~7%
    faster there (1.27 -> 1.19 ms at (8, 4096); BENCHMARKS.md, run 86): the forward substitution was ~30% of the
    prep's time (run 85's ablation), and unrolled, the compiler can schedule each step's row extraction, which does
    not depend on the previous step, ahead of it."""
    r16, c16 = tile_iotas()
    upper = r16 < c16
    ats = [diag_tile_transposed(kb, gc, beta, upper, cfg, interpret) for kb, gc, beta in zip(ks, gcs, betas)]
    ts = [jnp.where(r16 == c16, 1.0, 0.0).astype(jnp.float32)] * len(ks)
    for i in range(1, SUB):
        ts = [substitution_step(i, at, t, r16, c16) for at, t in zip(ats, ts)]
    return tuple(ts)


def tile_iotas():
    """(row, column) indices of a [16, 16] tile."""
    return lax.broadcasted_iota(jnp.int32, (SUB, SUB), 0), lax.broadcasted_iota(jnp.int32, (SUB, SUB), 1)


def diag_tile_transposed(kb, gc, beta, upper, cfg, interpret):
    """A_ii^T [16, 16] of one 16-row slice: A_ii^T[r, c] = beta_c k_r . k_c exp(gc_c - gc_r) where `upper` (r < c),
    else 0."""
    kk_t = dot(kb, kb * beta[:, None], cfg["p_kk"], interpret, trans_b=True)
    return jnp.where(upper, kk_t * jnp.exp(jnp.where(upper, gc[None, :] - gc[:, None], 0.0)), 0.0)


def substitution_step(i, at, t, r16, c16):
    """Row i (static or traced, >= 1) of T = (I + A_ii)^-1 from its rows < i, given A_ii^T (`at`): t holds those rows,
    and identity rows from i on; returns t with row i filled in. Row i depends only on rows < i (A_ii strictly
    lower). r16, c16: `tile_iotas()`."""
    arow = jnp.sum(jnp.where(c16 == i, at, 0.0), axis=1)  # [16] over j: A_ii[i, j]
    contrib = jnp.sum(arow[:, None] * t, axis=0)  # [16] over n: sum_j A_ii[i, j] t[j, n]
    return jnp.where(r16 == i, t - contrib[None, :], t)


def tiled_inverse(ks, gcs, betas, cfg, interpret):
    """X = (I + A)^-1 of one chunk as its ten lower [16, 16] tiles {(i, m): X_im, m <= i}, from the chunk's 16-row
    slices (`chunk._chunk_slices`).

    Diagonal tiles T_i = (I + A_ii)^-1 by forward substitution (`diag_tiles_by_substitution`); then, block row
    by block row, X_im = -T_i (sum_{m <= j < i} A_ij X_jm) with sixteen [16, 16] dots (p_inv) — instead of the
    block-Neumann merge's four masked [64, 64] products. Row r of every tile depends only on tokens <= r of the
    chunk (T_i is lower triangular, its zeros exact), so the j < 64 row property holds."""
    nb = CHUNK // SUB
    ts = diag_tiles_by_substitution(ks, gcs, betas, cfg, interpret)
    x = {(i, i): ts[i] for i in range(nb)}
    for i in range(1, nb):
        x.update(merged_block_row(i, ks, gcs, betas, x, cfg, interpret))
    return x


def merged_block_row(i, ks, gcs, betas, x, cfg, interpret):
    """Block row i of the tiled inverse below its diagonal: {(i, m): X_im, m < i} from T_i = x[i, i] and the earlier
    block rows x[j, m] (m <= j < i). One function for the prefill (`tiled_inverse`) and the replay step
    (`replay.py`, earlier block rows from its cache), so both trace the same operations."""
    bk = ks[i] * betas[i][:, None]
    a = {j: dot(bk, ks[j], cfg["p_kk"], interpret, trans_b=True) * jnp.exp(gcs[i][:, None] - gcs[j][None, :])
         for j in range(i)}  # A_ij [16, 16], j < i: every entry strictly below the diagonal
    out = {}
    for m in range(i - 1, -1, -1):
        acc = dot(a[m], x[m, m], cfg["p_inv"], interpret)
        for j in range(m + 1, i):
            acc = acc + dot(a[j], x[j, m], cfg["p_inv"], interpret)
        out[i, m] = -dot(x[i, i], acc, cfg["p_inv"], interpret)
    return out


def inverse_doubling(a, prec, interpret):
    """(I + a)^-1 without loops or reshapes (candidate for speed; measure before making it the default).

    Diagonal 16x16 blocks: with Nd the within-block part of a (nilpotent, Nd^16 = 0),
    (I + Nd)^-1 = (I - Nd)(I + Nd^2)(I + Nd^4)(I + Nd^8); then the same block-Neumann merge as `inverse_block16`.
    All factors are lower triangular, so row i still depends only on rows <= i. The doubling products can have
    large intermediate entries when keys in a block are nearly parallel (beta ~ 1, g ~ 0), so run it with an
    accurate precision (tf32x3 or ieee).
    """
    c, s = CHUNK, SUB
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    eye = jnp.where(row == col, 1.0, 0.0).astype(jnp.float32)
    same = row // s == col // s
    nd = jnp.where(same, a, 0.0)
    e = jnp.where(row // s > col // s, a, 0.0)
    n2 = dot(nd, nd, prec, interpret)
    n4 = dot(n2, n2, prec, interpret)
    n8 = dot(n4, n4, prec, interpret)
    di = dot(eye - nd, eye + n2, prec, interpret)
    di = dot(di, eye + n4, prec, interpret)
    di = dot(di, eye + n8, prec, interpret)
    di = jnp.where(same, di, 0.0)  # exact block-diagonal structure
    n1 = dot(di, e, prec, interpret)
    n2 = dot(n1, n1, prec, interpret)
    n3 = dot(n2, n1, prec, interpret)
    return dot(eye - n1 + n2 - n3, di, prec, interpret)


def inverse_fwd64(a):
    """(I + a)^-1 by plain forward substitution over all 64 rows on [64, 64] tiles (exact fp32; slower fallback)."""
    row = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)

    def body(i, t):
        arow = jnp.sum(jnp.where(row == i, a, 0.0), axis=0)  # [C]: a[i, :]
        contrib = jnp.sum(arow[:, None] * t, axis=0)  # [C]: sum_j a[i, j] t[j, :]
        return jnp.where(row == i, t - contrib[None, :], t)

    return lax.fori_loop(1, CHUNK, body, jnp.where(row == col, 1.0, 0.0).astype(jnp.float32))


def last(x):
    """The last element of a 1-D vector, as a reduction Triton can lower (exact: one non-zero term)."""
    n = x.shape[0]
    iota = lax.broadcasted_iota(jnp.int32, (n,), 0)
    return jnp.sum(jnp.where(iota == n - 1, x, 0.0))


def causal_decay(gc, strict):
    """exp(gc_i - gc_j) on the (strictly) lower triangle, exact zeros above (`where` before `exp`: no overflow)."""
    row = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0)
    col = lax.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1)
    lower = row > col if strict else row >= col
    return lower, jnp.exp(jnp.where(lower, gc[:, None] - gc[None, :], 0.0))


def wy_form(k, v, beta, gc, cfg, interpret):
    """WY/UT form of one chunk: X = (I + A)^-1 with A[i, j] = beta_i k_i . k_j exp(gc_i - gc_j) (j < i);
    returns w = X (beta exp(gc) k) [C, K], u = X (beta v) [C, V] and kd = k exp(gc_last - gc) [C, K]."""
    return apply_wy(wy_inverse(k, beta, gc, cfg, interpret), k, v, beta, gc, cfg, interpret)


def wy_inverse(k, beta, gc, cfg, interpret):
    """X = (I + A)^-1 [C, C] (see `wy_form`)."""
    lower, decay = causal_decay(gc, strict=True)
    kk = dot(k * beta[:, None], k, cfg["p_kk"], interpret, trans_b=True)  # [C, C]
    a = jnp.where(lower, kk * decay, 0.0)
    if cfg["inv"] == "fwd64":
        return inverse_fwd64(a)
    if cfg["inv"] == "doubling":
        return inverse_doubling(a, cfg["p_inv"], interpret)
    return inverse_block16(a, cfg["p_inv"], interpret)


def wy_rhs(k, v, beta, gc):
    """The right-hand sides of w = X (beta exp(gc) k) and u = X (beta v): [C, K] and [C, V]."""
    return k * beta[:, None] * jnp.exp(gc)[:, None], v * beta[:, None]


def apply_wy(x, k, v, beta, gc, cfg, interpret):
    """(w, u, kd) of `wy_form` from the inverse X."""
    bk, bv = wy_rhs(k, v, beta, gc)
    u = dot(x, bv, cfg["p_wu"], interpret)
    w = dot(x, bk, cfg["p_wu"], interpret)
    kd = k * jnp.exp(last(gc) - gc)[:, None]
    return w, u, kd


def intra(q, k, gc, cfg, interpret):
    """Masked intra-chunk attention Aqk[i, j] = q_i . k_j exp(gc_i - gc_j) (j <= i) [C, C] and qg = q exp(gc)."""
    lower, decay = causal_decay(gc, strict=False)
    qk = dot(q, k, cfg["p_qk"], interpret, trans_b=True)
    return jnp.where(lower, qk * decay, 0.0), q * jnp.exp(gc)[:, None]
