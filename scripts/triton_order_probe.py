"""Does a written-out model of Triton's summation order reproduce the prep's forward substitution bit for bit?

The replay step's kernel 1 must give the prefill prep's bits, and its diagonal tiles come from `wy.substitution_step`,
whose `jnp.sum` over a [16, 16] tile's rows Triton lowers in an order of its own. A kernel on another backend (the
warp-specialised Mosaic GPU step that issue 7 needs: `docs/speed_gaps.md`) would have to write that order out. Read
from the prep's PTX for sm_90a (`ptxas_report.py --replay --dump`, 2026-12-07): the tiles are in the MMA layout
(m16n8, warps [1, 4]), a thread holds rows g and g + 8 of a column (g = lane / 4), and the sum over a column j is
    p_g = fma(a_g, t_gn, a_(g+8) t_(g+8)n)                         (in the thread: the add contracted into an FMA)
    s   = butterfly of adds over lane offsets 16, 8, 4           (g xor 4, then g xor 2, then g xor 1)
(`tree_sum`). This script runs `wy.diag_tiles_by_substitution` — the prep's own code — in a Pallas-Triton kernel
with the prep's warps on random keys, gates and betas, and recomputes each tile's 15 steps in NumPy (the FMA
through float64) from the kernel's own A_ii^T under three orders: the model above, the model with the FMA on row
g + 8, and a plain left-to-right sum. On a GPU the model matching in every element is the order; on a CPU
(interpret mode, XLA's order) the figures say nothing about Triton, and --lower-only only lowers the kernel for an
abstract H200. The probe's
kernel takes the prep's layout (checked offline: its TTGIR's tiles are `nvidia_mma` with warps [1, 4], as the
prep's, once T_i feeds a [16, 128] dot, and its PTX has the same FMA-then-butterfly sums). Not yet run on a GPU
(written 2026-12-07; no device time was left that session).

  PYTHONPATH=. python3 scripts/triton_order_probe.py [--seeds 8] [--lower-only]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta import chunk as ck
from pallas_kernels.gated_delta import wy

SUB = wy.SUB
K = 128


def fma32(a, b, c):
    """fp32 fma(a, b, c): a * b is exact in float64 (24 + 24 bits); the sum rounded to float64 and then to float32
    differs from one rounding only where the first lands on a float32 halfway point (about one sum in 2^29), and such
    an element would show as a difference, not hide one."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def tree_sum(a, t, fma_row: str):
    """sum_j a[j] t[j, :] (a [16], t [16, 16] fp32) in the modelled Triton order; fma_row "g" or "g8": which row's
    product the FMA takes (the other is a rounded product), "plain": a left-to-right sum of rounded products."""
    a, t = a.astype(np.float32), t.astype(np.float32)
    if fma_row == "plain":
        s = np.zeros(t.shape[1], np.float32)
        for j in range(SUB):
            s = (s + (a[j] * t[j]).astype(np.float32)).astype(np.float32)
        return s
    half = SUB // 2
    if fma_row == "g":
        p = [fma32(a[g], t[g], (a[g + half] * t[g + half]).astype(np.float32)) for g in range(half)]
    else:
        p = [fma32(a[g + half], t[g + half], (a[g] * t[g]).astype(np.float32)) for g in range(half)]
    for bit in (4, 2, 1):  # lane offsets 16, 8, 4: row groups g xor 4, g xor 2, g xor 1
        p = [(p[g] + p[g ^ bit]).astype(np.float32) for g in range(half)]
    return p[0]


def substitution_model(at, fma_row: str):
    """T = (I + A)^-1 of one tile by `wy.substitution_step`'s 15 steps, each sum in `tree_sum`'s order, from
    A^T (`at`, the kernel's own values)."""
    t = np.eye(SUB, dtype=np.float32)
    for i in range(1, SUB):
        arow = at[:, i]  # A[i, j] = A^T[j, i] (an exact extraction in the kernel too)
        t[i] = (t[i] - tree_sum(arow, t, fma_row)).astype(np.float32)
    return t


def _kernel(k_ref, gc_ref, beta_ref, at_ref, t_ref, w_ref, *, cfg, interpret):
    """The prep's code on four 16-row slices: A_ii^T (`wy.diag_tile_transposed`) and T_i
    (`wy.diag_tiles_by_substitution`), written out, and T_i times the slice's keys (a [16, 128] dot, as the prep's
    w = X (beta k) is: Triton lays the tiles out for their dots)."""
    ks = [k_ref[pl.ds(b * SUB, SUB), :] for b in range(4)]
    gcs = [gc_ref[pl.ds(b * SUB, SUB)] for b in range(4)]
    betas = [beta_ref[pl.ds(b * SUB, SUB)] for b in range(4)]
    r16, c16 = wy.tile_iotas()
    for b in range(4):
        at_ref[b] = wy.diag_tile_transposed(ks[b], gcs[b], betas[b], r16 < c16, cfg, interpret)
    for b, t in enumerate(wy.diag_tiles_by_substitution(ks, gcs, betas, cfg, interpret)):
        t_ref[b] = t
        w_ref[b] = wy.dot(t, ks[b], cfg["p_inv"], interpret)


def substitution_call(interpret: bool):
    cfg = ck._checked_config(None, K, True, K**-0.5)
    warps = cfg["warps_prep"]
    return jax.jit(pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((4, SUB, SUB), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((4, SUB, K), jnp.float32)],
        compiler_params=ck._triton_params(warps, 1), interpret=interpret, name="triton_order_probe"))


def inputs(seed: int):
    """l2-normalised keys [64, K] fp32 (as the prep normalises them), a realistic cumulative log-decay and betas."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((4 * SUB, K)).astype(np.float32)
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    g = -np.exp(rng.uniform(-6, 0, 4 * SUB)).astype(np.float32)
    gc = np.concatenate([np.cumsum(g[b * SUB:(b + 1) * SUB]) for b in range(4)]).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal(4 * SUB)))).astype(np.float32)
    return jnp.asarray(k), jnp.asarray(gc), jnp.asarray(beta)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--lower-only", action="store_true", help="lower the kernel for an abstract H200 and stop")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be at least 1; got {args.seeds}")
    if args.lower_only:
        from scripts.mosaic_tf32_probe import _lowered
        call = substitution_call(interpret=False)
        print("lowered:", _lowered(call, *inputs(0)))
        return 0
    on_gpu = jax.default_backend() == "gpu"
    call = substitution_call(interpret=not on_gpu)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); interpret={not on_gpu}")
    totals = {"g": 0, "g8": 0, "plain": 0}
    for seed in range(args.seeds):
        at, t, _ = (np.asarray(x) for x in call(*inputs(seed)))
        differ = {o: sum(int(np.sum(substitution_model(at[b], o) != t[b])) for b in range(4)) for o in totals}
        for o, n in differ.items():
            totals[o] += n
        print(f"seed {seed}: elements differing from the kernel's T (of {4 * SUB * SUB}): "
              + ", ".join(f"{o} {n}" for o, n in differ.items()), flush=True)
    print("totals over seeds:", totals, "of", args.seeds * 4 * SUB * SUB)
    return 0


if __name__ == "__main__":
    sys.exit(main())
