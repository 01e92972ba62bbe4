"""Does a dot's row depend on how many rows the dot has? A screen for the replay step's shapes (H200, no interpret).

The replay step (`pallas_kernels/gated_delta/replay.py`) computes one token's row of the prefill's 64-row dots with
dots on the 16 rows of its block row: that gives the prefill's bits only if a row of an MMA's result depends on
nothing but that row of the first operand — not on the instruction's M (Triton picks `mma.sync` for 16 or 32 rows
and `wgmma` for 64 with 4 warps) nor on its warps. This script computes each dot form the step uses on random
inputs with M = 64 (the prefill's shape) and with M = 16 / 32, 1-4 warps (and M = 64 on 8 warps), the blocks of
rows stitched back together, and counts the elements whose bits differ. It also checks the L2 norm of rows, and one
step of the diagonal tile's forward substitution (`wy.substitution_step`, from the rows before it) against the whole
loop (`wy.diag_tiles_by_substitution`).

A screen, not a proof: on 2026-11-30 (run 46) every form but q k^T on bf16-valued keys came out equal here, while the
step's 16-row v_new dot on fp16 w differed from the prefill in one element of 560 rows x 128 (runs 48-51);
`gpu_kernels.py --only replay_step` is the check that counts.

    PYTHONPATH=. python3 scripts/gpu_mma_rows.py [--only NAME] [--instances N] [--interpret]
"""

from __future__ import annotations

import argparse

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta import chunk as ck
from pallas_kernels.gated_delta import wy

C = 64  # the prefill's rows


def dot_form(form: str, x, y):
    """The step's dot forms (TF32, fp32 result): x is the [M, .] first operand, y the second as stored."""
    if form == "qs":  # qg S^T with S stored transposed [bv, K] (the prefill's states_t layout)
        return wy.dot(x, y, "tf32", False, trans_b=True)
    if form == "qs_t":  # the same from S [K, bv], transposed in registers (the replay step's)
        return wy.dot(x, y.T, "tf32", False, trans_b=True)
    if form == "av":  # Aqk v_new, v_new [C, bv] transposed in registers
        return wy.dot(x, y.T, "tf32", False, trans_b=True)
    if form == "ws":  # w S with w rounded to fp16, as the prefill stores it
        return wy.dot(x.astype(jnp.float16).astype(jnp.float32), y, "tf32", False)
    if form == "qk":  # q k^T
        return wy.dot(x, y.astype(jnp.float32), "tf32", False, trans_b=True)
    if form == "l2":  # the L2 norm of rows (y unused)
        return wy.l2norm(x)
    raise ValueError(form)


def rows_of(form, a, b, M, warps, interpret):
    """dot_form over a [N, 64, Ka] in blocks of M rows (one program per block and instance) -> [N, 64, n]."""
    n, _, ka = a.shape
    bshape = b.shape[1:]
    ncol = ka if form == "l2" else bshape[0] if form in ("qs", "qk") else bshape[1]

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = dot_form(form, a_ref[...].astype(jnp.float32), b_ref[...])

    out = pl.pallas_call(
        kernel, grid=(C // M, n),
        in_specs=[pl.BlockSpec((None, M, ka), lambda i, j: (j, i, 0)),
                  pl.BlockSpec((None,) + bshape, lambda i, j: (j, 0, 0))],
        out_specs=pl.BlockSpec((None, M, ncol), lambda i, j: (j, i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, C, ncol), jnp.float32),
        compiler_params=ck._triton_params(warps, 1), interpret=interpret)(a, b)
    return np.asarray(out)


def cases(n: int, rng):
    def rnd(*shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32))

    return {  # name: (form, first operand [n, 64, .], second operand [n, ...])
        "qs": ("qs", rnd(n, C, 128) * 0.1, rnd(n, 64, 128) * 0.3),
        "qs_t": ("qs_t", rnd(n, C, 128) * 0.1, rnd(n, 128, 64) * 0.3),
        "av": ("av", rnd(n, C, 64) * 0.05, rnd(n, 64, 64)),
        "ws": ("ws", rnd(n, C, 128) * 0.2, rnd(n, 128, 64) * 0.3),
        "qk_bf16_keys": ("qk", rnd(n, C, 128) * 0.09, rnd(n, 64, 128).astype(jnp.bfloat16)),
        "qk_unit_keys": ("qk", wy.l2norm(rnd(n, C, 128)) * 0.088, wy.l2norm(rnd(n, 64, 128))),
        "l2_bf16_rows": ("l2", rnd(n, C, 128).astype(jnp.bfloat16), rnd(n, 8, 8)),
    }


def substitution_rows_differ(n: int, rng, interpret: bool) -> int:
    """Elements of rows 1..15 of T = (I + A_ii)^-1 where one substitution step from the loop's earlier rows differs
    from the loop (n random [16, 128] key slices)."""
    cfg = dict(ck.DEFAULT_CONFIG)
    kb = wy.l2norm(jnp.asarray(rng.standard_normal((n, 16, 128)), jnp.float32))
    gc = jnp.cumsum(-jnp.abs(jnp.asarray(rng.standard_normal((n, 16)), jnp.float32)) * 0.3, axis=1)
    beta = jax.nn.sigmoid(jnp.asarray(rng.standard_normal((n, 16)), jnp.float32))
    tile = pl.BlockSpec((None, 16, 128), lambda *g: (g[-1], 0, 0))
    vec = pl.BlockSpec((None, 16), lambda *g: (g[-1], 0))

    def loop_kernel(k_ref, g_ref, b_ref, o_ref):
        o_ref[...] = wy.diag_tiles_by_substitution([k_ref[...]], [g_ref[...]], [b_ref[...]], cfg, interpret)[0]

    loop = pl.pallas_call(loop_kernel, grid=(n,), in_specs=[tile, vec, vec],
                          out_specs=pl.BlockSpec((None, 16, 16), lambda j: (j, 0, 0)),
                          out_shape=jax.ShapeDtypeStruct((n, 16, 16), jnp.float32),
                          compiler_params=ck._triton_params(4, 1), interpret=interpret)(kb, gc, beta)

    def step_kernel(k_ref, g_ref, b_ref, t_ref, o_ref):
        r = pl.program_id(0) + 1
        r16, c16 = wy.tile_iotas()
        at = wy.diag_tile_transposed(k_ref[...], g_ref[...], b_ref[...], r16 < c16, cfg, interpret)
        t = jnp.where(r16 < r, t_ref[...], jnp.where(r16 == c16, 1.0, 0.0).astype(jnp.float32))
        o_ref[...] = wy.substitution_step(r, at, t, r16, c16)

    step = pl.pallas_call(step_kernel, grid=(15, n),
                          in_specs=[tile, vec, vec, pl.BlockSpec((None, 16, 16), lambda i, j: (j, 0, 0))],
                          out_specs=pl.BlockSpec((None, None, 16, 16), lambda i, j: (i, j, 0, 0)),
                          out_shape=jax.ShapeDtypeStruct((15, n, 16, 16), jnp.float32),
                          compiler_params=ck._triton_params(4, 1), interpret=interpret)(kb, gc, beta, loop)
    loop, step = np.asarray(loop), np.asarray(step)
    return sum(int((step[r - 1][:, r].view(np.uint32) != loop[:, r].view(np.uint32)).sum()) for r in range(1, 16))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated case names (default: all, and the substitution)")
    ap.add_argument("--instances", type=int, default=512, help="random instances per case")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU: plumbing only)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    only = [c for c in args.only.split(",") if c]
    results = {}
    for name, (form, a, b) in cases(args.instances, rng).items():
        if only and name not in only:
            continue
        full = rows_of(form, a, b, C, 4, args.interpret).view(np.uint32)
        for M, warps in ((16, 4), (16, 2), (16, 1), (32, 4), (64, 8)):
            got = rows_of(form, a, b, M, warps, args.interpret).view(np.uint32)
            differ = int((got != full).sum())
            results[f"{name} M={M} warps={warps}"] = differ
            print(f"{name:14s} M={M:2d} warps={warps}: {'equal' if not differ else 'DIFFER'} "
                  f"({differ} of {full.size} elements differ from M=64, 4 warps)", flush=True)
    if not only or "substitution" in only:
        differ = substitution_rows_differ(args.instances, rng, args.interpret)
        results["substitution step"] = differ
        print(f"one substitution step against the loop: {'equal' if not differ else 'DIFFER'} ({differ} elements)")
    return results


if __name__ == "__main__":
    main()
