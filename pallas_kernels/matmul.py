"""Batch-invariant matmul for deterministic mode: a Pallas-Triton kernel whose rows' bits never depend on M.

XLA's GEMMs choose their algorithm (tile sizes, split-K) by the problem's M, so a row of `x @ w` changes in the low
bits with the number of rows that share the call. This kernel computes every output tile [BM, BN] the same way
whatever M is: the K axis is reduced in BK-wide steps in a fixed order with an fp32 accumulator, and the few-row
tiling (BM, BN, BK, warps, stages) depends only on the weight's shape. A row's result therefore depends on that row
and the weight alone. From `wide_m` rows on, a many-row tiling (below) takes over with the same per-element
reduction order, so the bits do not change with it (checked on the H200, BENCHMARKS.md run 20).

Grid (ceil(M / BM), ceil(N / BN), S). At decode (M <= BM: one row of tiles) a weight with few column tiles would
leave the GPU nearly idle, so BN is narrowed towards `target_programs` column tiles and, for the rest — and for
skinny weights (e.g. the GDN gate projections, N = 32) — the K axis is split into S fixed slices (S again a function
of K and N only): each program writes an fp32 partial product and the S partials are added in a fixed pairwise
order. Inputs are zero-padded to the tiles (exact: padded K columns add exact zeros, padded rows and columns are
cut off).

At M >= `wide_m` (prefill) the same bits are computed with a tiling made for many rows (`_plan`): the S slices of a
split weight are reduced inside one program, in S accumulators added in the same fixed order (no fp32 partials
through memory), an unsplit weight gets the wide column tiles (BN up to `bn_wide`) that narrow tiles gave up for
decode, and the loads are pipelined deeper (`stages_wide`). Both keep every output element's reduction — the same
BK steps in the same order, each slice from zero, the slices added pairwise (`_sum_fixed_order`), then one
rounding to the output dtype — so which tiling a call takes does not change a row's bits (an MMA element does
not depend on the tile's width; checked on the H200 by `scripts/gpu_kernels.py --only invariant`, rows alone vs
inside M = 2048 for each projection shape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .config import merged_config, static_config

# BM is fixed (never chosen by M); BN and the split S come from the weight's shape (`_tiling`).
# Measured on the H200 (BENCHMARKS.md, run 3, with target_programs=0): bm=128 with 8 warps reaches 0.90-0.98 of
# XLA's bf16 GEMM at M >= 1024 (0.93 at M = 64); bm=64 configurations reached 0.54-0.86.
# target_programs > 0: at decode M <= BM leaves one row of tiles, so BN is narrowed (down to bn_min) towards that
# many column tiles, then K split (up to max_split_target, a fixed power of two) for the rest. Measured inside the
# deterministic model (4-layer 9B slice, decode B=64 / prefill 8k, ms): target_programs=0: 2.58 / 37.9; the
# default (64, bn_min 128, max_split_target 2): 2.11 / 41.3 (run K; 0.83 / 0.84 of normal mode, 0.81 / 0.83 at 32
# layers); target 128 with BN >= 64: 2.07 / 56.3; 64 with BN >= 64 and no split: 2.42 / 46.9. Per kernel (run 6,
# before the many-row tiling below) this tiling reached 73-87% of XLA's bf16 GEMM at M >= 1024.
# wide_m: the M from which `_plan` takes the many-row tiling (0: never); bn_wide: its widest column tile;
# inner_acc: the most accumulator columns (S x BN) one program may hold for an in-kernel split; stages_wide: its
# pipeline stages (the arithmetic does not depend on them). Measured on the H200 (BENCHMARKS.md, run 20), as XLA's
# time / ours at M = 8192 (few-row tiling -> many-row tiling with 3 stages -> with 4): N = 12288: 0.76 -> 0.90 ->
# 0.91; N = 8192: 0.83 -> 0.89 -> 0.93; the split weights N = 4096 (K = 12288 / 4096) and 1024: 0.75 / 0.64 / 0.67
# -> 0.62 / 0.61 / 0.65 -> 0.76 / 0.71 / 0.78 (an in-kernel split pays only with the fourth stage).
DEFAULT_CONFIG = dict(bm=128, bn=256, bk=64, num_warps=8, num_stages=3, split_k_below=8, max_split=16,
                      target_programs=64, bn_min=128, max_split_target=2, wide_m=1024, bn_wide=256, inner_acc=256,
                      stages_wide=4)
BN_CHOICES = (256, 128, 64, 32, 16)


def _matmul_kernel(x_ref, w_ref, o_ref, *, bk, nk, inner, w_rows_out):
    """o = x @ w over this program's K range: `inner` slices of nk // inner BK steps, each accumulated from zero in
    fp32 and added in `_sum_fixed_order`'s order (inner = 1: one accumulator)."""
    bm, bn = o_ref.shape
    dims = (((1,), (1,)), ((), ())) if w_rows_out else (((1,), (0,)), ((), ()))

    def body(i, acc):
        ks = pl.ds(pl.multiple_of(i * bk, bk), bk)
        wb = w_ref[:, ks] if w_rows_out else w_ref[ks, :]
        return acc + lax.dot_general(x_ref[:, ks], wb, dims, preferred_element_type=jnp.float32)

    per = nk // inner
    accs = [lax.fori_loop(s * per, (s + 1) * per, body, jnp.zeros((bm, bn), jnp.float32)) for s in range(inner)]
    o_ref[...] = _sum_fixed_order(accs).astype(o_ref.dtype)


def _tiling(K: int, N: int, cfg: dict) -> tuple[int, int, int, int]:
    """(BM, BN, BK, S) from the weight's shape and the config only (never from M).

    BN: the largest of BN_CHOICES (up to cfg["bn"]) that divides N — or, when none does, any (N is padded) — and
    still gives `split_k_below` column tiles; when no choice gives that many (N <= 8 * 16 or so), the smallest
    choice covering N, and K is then split into S fixed slices (each keeping >= 4 BK steps, at most max_split).
    With target_programs, for weights wide enough: the widest BN >= bn_min giving that many column tiles (else
    the narrowest such BN), then S (at most max_split_target) towards that many programs."""
    bk = cfg["bk"]
    choices = [b for b in BN_CHOICES if b <= cfg["bn"]]
    pool = [b for b in choices if N % b == 0] or choices
    enough = [b for b in pool if -(-N // b) >= cfg["split_k_below"]]
    bn = enough[0] if enough else min((b for b in pool if b >= N), default=pool[0])
    nk = -(-K // bk)
    split = 1

    def split_to(programs, most):  # S a power of two dividing nk, each slice keeping >= 4 BK steps
        s = 1
        while (-(-N // bn)) * s < programs and s * 2 <= most and nk % (s * 2) == 0 and nk // (s * 2) >= 4:
            s *= 2
        return s

    wide = [b for b in pool if b >= cfg["bn_min"]]
    if cfg["target_programs"] and enough and wide:
        bn = next((b for b in wide if -(-N // b) >= cfg["target_programs"]), min(wide[-1], bn))
        split = split_to(cfg["target_programs"], cfg["max_split_target"])
    elif not enough:
        split = split_to(float("inf"), cfg["max_split"])
    return cfg["bm"], bn, bk, split


def _plan(M: int, K: int, N: int, cfg: dict) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, BK, grid slices, in-kernel slices, pipeline stages) for an M-row product. Below `wide_m` rows:
    `_tiling`, its S slices as grid programs. From `wide_m` rows on, the same S (a row's bits depend on it) but
    reduced inside each program when S x BN <= inner_acc (else still on the grid), and, for S = 1, the widest
    BN <= bn_wide dividing N into >= split_k_below tiles (the tiling without `target_programs`) — or the few-row
    BN when that is wider."""
    bm, bn, bk, split = _tiling(K, N, cfg)
    if not cfg["wide_m"] or M < cfg["wide_m"]:
        return bm, bn, bk, split, 1, cfg["num_stages"]
    stages = cfg["stages_wide"]
    if split > 1:
        return (bm, bn, bk, 1, split, stages) if split * bn <= cfg["inner_acc"] else (bm, bn, bk, split, 1, stages)
    wide = [b for b in BN_CHOICES if b <= cfg["bn_wide"] and N % b == 0 and N // b >= cfg["split_k_below"]]
    return bm, max([bn] + wide[:1]), bk, 1, 1, stages


def _sum_fixed_order(parts):
    """S partial products (a sequence, S a power of two) -> their sum by pairwise halving: part i + part i + S/2,
    repeated — elementwise adds in one fixed order, whether the parts come from the grid (through memory) or from
    one program's accumulators."""
    parts = list(parts)
    while len(parts) > 1:
        h = len(parts) // 2
        parts = [parts[i] + parts[i + h] for i in range(h)]
    return parts[0]


@functools.partial(jax.jit, static_argnames=("interpret", "config", "out_dtype", "w_rows_out"))
def _matmul_impl(x, w, *, interpret, config, out_dtype, w_rows_out):
    cfg = merged_config("matmul_invariant", DEFAULT_CONFIG, config, pow2=("bm", "bn", "bk", "bn_wide"))
    for key, least in (("wide_m", 0), ("inner_acc", 1), ("stages_wide", 1)):
        if type(cfg[key]) is not int or cfg[key] < least:
            raise ValueError(f"matmul_invariant: {key}={cfg[key]!r} must be an integer >= {least}")
    M, K = x.shape
    N = w.shape[0] if w_rows_out else w.shape[1]
    bm, bn, bk, split, inner, stages = _plan(M, K, N, cfg)
    mp, kp, np_ = -(-M // bm) * bm, -(-K // bk) * bk, -(-N // bn) * bn
    ks = kp // split  # K columns per grid slice
    if (mp, kp) != (M, K):
        x = jnp.pad(x, ((0, mp - M), (0, kp - K)))
    if (kp, np_) != (K, N):
        w = jnp.pad(w, ((0, np_ - N), (0, kp - K)) if w_rows_out else ((0, kp - K), (0, np_ - N)))
    w_spec = (pl.BlockSpec((bn, ks), lambda i, j, s: (j, s)) if w_rows_out
              else pl.BlockSpec((ks, bn), lambda i, j, s: (s, j)))
    from jax.experimental.pallas import triton as pltriton

    out = pl.pallas_call(
        functools.partial(_matmul_kernel, bk=bk, nk=ks // bk, inner=inner, w_rows_out=w_rows_out),
        grid=(mp // bm, np_ // bn, split),
        in_specs=[pl.BlockSpec((bm, ks), lambda i, j, s: (i, s)), w_spec],
        out_specs=pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j)),
        out_shape=jax.ShapeDtypeStruct((split, mp, np_), out_dtype if split == 1 else jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=stages),
        interpret=interpret,
        name="invariant_matmul",
    )(x, w)
    out = out[0] if split == 1 else _sum_fixed_order(out).astype(out_dtype)
    return out[:M, :N] if (mp, np_) != (M, N) else out


def matmul_invariant_pallas(x: jax.Array, w: jax.Array, *, interpret: bool = False, config=None,
                            out_dtype=None, w_transposed: bool = False) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in `out_dtype` (default x.dtype; fp32 accumulation), every row computed
    independently of the others (see the module docstring). x and w must share a dtype. `w_transposed`: w is given
    as [N, K] (e.g. a tied embedding used as the output head), read in place rather than transposed in memory."""
    N = w.shape[0] if w_transposed else w.shape[-1]
    if w.ndim != 2 or x.shape[-1] != w.shape[1 if w_transposed else 0]:
        want = "[N, K]" if w_transposed else "[K, N]"
        raise ValueError(f"expected x [..., K] and w {want}; got {x.shape} and {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype; got {x.dtype} and {w.dtype}")
    lead = x.shape[:-1]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if x.size == 0 or N == 0:
        return jnp.zeros(lead + (N,), out_dtype)
    config = static_config(config)
    y = _matmul_impl(x.reshape(-1, x.shape[-1]), w, interpret=bool(interpret), config=config, out_dtype=out_dtype,
                     w_rows_out=bool(w_transposed))
    return y.reshape(lead + (N,))
