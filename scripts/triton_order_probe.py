"""Does a written-out model of Triton's summation order reproduce the prep's forward substitution bit for bit?

The replay step's kernel 1 must give the prefill prep's bits, and its diagonal tiles come from `wy.substitution_step`,
whose `jnp.sum` over a [16, 16] tile's rows Triton lowers in an order of its own. A kernel on another backend (the
warp-specialised Mosaic GPU step that issue 7 needs: `docs/speed_gaps.md`) would have to give that order. The
tiles are in the MMA layout (m16n8, warps [1, 4]): a thread holds rows g and g + 8 of a column (g = lane / 4). This
script runs `wy.diag_tiles_by_substitution` — the prep's own code — in a Pallas-Triton kernel with the prep's warps
and layout (checked offline: its TTGIR's tiles are `nvidia_mma` with warps [1, 4], as the prep's, once T_i feeds a
[16, 128] dot) on random keys, gates and betas, and recomputes each tile's 15 steps in NumPy (an FMA through
float64) from the kernel's own A_ii^T under four orders (`tree_sum`), each summing column j's products as
    p_g = a_g t_gn + a_(g+8) t_(g+8)n                              (in the thread)
    s   = butterfly of adds over lane offsets 16, 8, 4           (g xor 4, then g xor 2, then g xor 1)
with both products rounded ("tree"), row g's product fused into an FMA ("g"), row g + 8's ("g8"), or a plain
left-to-right sum instead ("plain"). On a GPU the model matching in every element is the order; on a CPU (interpret
mode, XLA's order) the figures say nothing about Triton, and --lower-only only lowers the kernels for an abstract
H200. On the H200 (BENCHMARKS.md, run 196) "tree" matched every element of 8 draws and "g" did not — although
session 55 had read an FMA there in the PTX that PyPI's Triton 3.6 makes offline (`ptxas_report.py --replay
--dump`): XLA builds its own Triton, so only the GPU's code says.

Then the question for a Mosaic GPU kernel 1: can Mosaic GPU's own `jnp.sum` give those bits? Its row sum of a
WGMMA-layout array shuffles in the other order (lane offsets 4, 8, 16), so the probe's Mosaic GPU kernel runs the 15
steps on the Triton kernel's own A_ii^T with the tile's rows renumbered to make the two trees one
(`MOSAIC_PLACEMENTS`, `_mosaic_kernel`), and counts the elements of its T that differ from the Triton kernel's T
(and, for the "rev" placements, from the models). Zero in every seed for a placement would mean the substitution
can move to Mosaic GPU with the prefill's bits, by that placement. Run 196: "rev" gave model "g" exactly (Mosaic
GPU's multiply carries LLVM's `contract` flag and was fused into the first add), 38 elements off Triton's; "rev_rn"
multiplies by PTX `mul.rn.f32` instead, which nothing may contract: 0 in every seed (run 197, an H100). And the
chain's first input: the gram tiles, fp16 `mma.sync` dots in Triton (m16n8k16), against one fp16 wgmma over the
chunk's 64 keys in Mosaic GPU (`_mosaic_gram_kernel`; its diagonal blocks): equal in every element in run 196.

  PYTHONPATH=. python3 scripts/triton_order_probe.py [--seeds 8] [--lower-only] [--no-mosaic]
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax
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
    product the FMA takes (the other is a rounded product), "tree": the same tree with both products rounded and
    added, "plain": a left-to-right sum of rounded products."""
    a, t = a.astype(np.float32), t.astype(np.float32)
    if fma_row == "plain":
        s = np.zeros(t.shape[1], np.float32)
        for j in range(SUB):
            s = (s + (a[j] * t[j]).astype(np.float32)).astype(np.float32)
        return s
    half = SUB // 2
    if fma_row == "tree":  # no FMA: both products rounded, then added
        p = [((a[g] * t[g]).astype(np.float32) + (a[g + half] * t[g + half]).astype(np.float32)).astype(np.float32)
             for g in range(half)]
    elif fma_row == "g":
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


def _kernel(k_ref, gc_ref, beta_ref, at_ref, t_ref, w_ref, kk_ref, *, cfg, interpret):
    """The prep's code on four 16-row slices: A_ii^T (`wy.diag_tile_transposed`) and T_i
    (`wy.diag_tiles_by_substitution`), written out, and T_i times the slice's keys (a [16, 128] dot, as the prep's
    w = X (beta k) is: Triton lays the tiles out for their dots)."""
    ks = [k_ref[pl.ds(b * SUB, SUB), :] for b in range(4)]
    gcs = [gc_ref[pl.ds(b * SUB, SUB)] for b in range(4)]
    betas = [beta_ref[pl.ds(b * SUB, SUB)] for b in range(4)]
    r16, c16 = wy.tile_iotas()
    for b in range(4):
        at_ref[b] = wy.diag_tile_transposed(ks[b], gcs[b], betas[b], r16 < c16, cfg, interpret)
        kk_ref[b] = wy.dot(ks[b], ks[b] * betas[b][:, None], cfg["p_kk"], interpret, trans_b=True)  # its gram dot
    for b, t in enumerate(wy.diag_tiles_by_substitution(ks, gcs, betas, cfg, interpret)):
        t_ref[b] = t
        w_ref[b] = wy.dot(t, ks[b], cfg["p_inv"], interpret)


def substitution_call(interpret: bool):
    cfg = ck._checked_config(None, K, True, K**-0.5)
    warps = cfg["warps_prep"]
    return jax.jit(pl.pallas_call(
        functools.partial(_kernel, cfg=cfg, interpret=interpret),
        out_shape=[jax.ShapeDtypeStruct((4, SUB, SUB), jnp.float32)] * 2
        + [jax.ShapeDtypeStruct((4, SUB, K), jnp.float32), jax.ShapeDtypeStruct((4, SUB, SUB), jnp.float32)],
        compiler_params=ck._triton_params(warps, 1), interpret=interpret, name="triton_order_probe"))


# The Mosaic GPU side. Its row sum of a [64, N] WGMMA-layout array (`fragmented_array.reduce`, jax 0.11.2, read
# 2026-12-07) adds a thread's two rows m and m + 8 in registers, then shuffles over lane offsets 4, 8, 16 (row groups
# m xor 1, m xor 2, m xor 4: the other way round from Triton's 16, 8, 4), then adds the four warps' partial sums
# through shared memory. With a tile's 16 rows placed in rows 0-15 (warp 0; rows 16-63 zeros, whose partial sums
# +0 add exactly) and row groups renumbered by reversing their three bits, Mosaic GPU's tree is Triton's: its first
# shuffle pairs m xor 1, which is Triton's g xor 4, and so on. The in-thread add is the other question: Triton's
# rounds both products (model "tree", H200 run 196), while Mosaic GPU's multiply carries LLVM's `contract` flag and
# was fused into that add (model "g" in run 196). The placements: row g at m and g + 8 at m + 8 ("rev"), the other
# way round ("rev_swap"), no renumbering ("identity"; Mosaic GPU's own tree), and "rev" with each product rounded on
# its own by PTX `mul.rn.f32`, which nothing may contract into an FMA ("rev_rn"). Each maps a tile row (0-15) to a
# row of the 64.
_REV3 = (0, 4, 2, 6, 1, 5, 3, 7)
_REV = tuple(_REV3[j % 8] + 8 * (j // 8) for j in range(SUB))
MOSAIC_PLACEMENTS = {
    "rev": _REV,
    "rev_swap": tuple(_REV3[j % 8] + 8 * (1 - j // 8) for j in range(SUB)),
    "identity": tuple(range(SUB)),
    "rev_rn": _REV,
}
MOSAIC_ROWS = 64  # the WGMMA layout's rows: 16 per warp of the warpgroup


def _mul_rn(x, y):
    """x * y ([64, 16] WGMMA-layout fp32 arrays) by PTX `mul.rn.f32`, through `plgpu.inline_mgpu`: Mosaic GPU's own
    multiply carries LLVM's `contract` flag, so the add after it may absorb it into an FMA."""
    from jax.experimental.mosaic import gpu as mgpu
    from jax.experimental.pallas import mosaic_gpu as plgpu

    wgmma = plgpu.Layout.WGMMA

    @plgpu.inline_mgpu(arg_types=(wgmma, wgmma),
                       return_type=plgpu.ShapeDtypeStruct(x.shape, jnp.float32, layout=wgmma))
    def mul(ctx, a, b):
        return a._pointwise(mgpu.FragmentedArray._lift_fast_instr("mul.rn.f32"), b)

    return mul(x, y)


def _mosaic_kernel(am_gmem, t0_gmem, t_gmem, am_s, t_s, bars, *, rows: tuple, rn: bool = False):
    """One tile per program: the 15 substitution steps of `wy.substitution_step` (row i of T = row i minus
    sum_j A[i, j] T[j, :]) on T placed in rows `rows` of a [64, 16] WGMMA-layout array (zeros elsewhere), A's rows
    given placed the same way along am's second axis (am [16, 64]: am[i, rows[j]] = A[i, j])."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b = lax.axis_index("b")
    plgpu.copy_gmem_to_smem(am_gmem.at[b], am_s, bars.at[0])
    plgpu.copy_gmem_to_smem(t0_gmem.at[b], t_s, bars.at[1])
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    wgmma = plgpu.Layout.WGMMA
    shape = (MOSAIC_ROWS, SUB)
    t = plgpu.layout_cast(t_s[...], wgmma)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=wgmma)
    for i in range(1, SUB):
        a = plgpu.load(am_s.at[i], layout=wgmma.reduce(1))  # A[i, :] along the rows
        a = lax.broadcast_in_dim(a, shape, [0])
        contrib = jnp.sum(_mul_rn(a, t) if rn else a * t, axis=0)
        t = jnp.where(row == rows[i], t - lax.broadcast_in_dim(contrib, shape, [1]), t)
    t_s[...] = t
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(t_s, t_gmem.at[b])
    plgpu.wait_smem_to_gmem(0)


def mosaic_substitution_call(placement: str, interpret: bool, tiles: int = 4):
    """A jitted Pallas Mosaic GPU call: (am [tiles, 16, 64], t0 [tiles, 64, 16]) -> T placed [tiles, 64, 16]
    (`_mosaic_kernel`; `mosaic_inputs` builds its inputs, `mosaic_tiles` reads its output)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.gated_delta.recurrence_mgpu import _smem

    params = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return jax.jit(plgpu.kernel(
        functools.partial(_mosaic_kernel, rows=MOSAIC_PLACEMENTS[placement],
                          rn=placement.endswith("_rn") and not interpret),  # (interpret mode: no PTX)
        out_type=jax.ShapeDtypeStruct((tiles, MOSAIC_ROWS, SUB), jnp.float32),
        scratch_types=[plgpu.SMEM((SUB, MOSAIC_ROWS), jnp.float32), _smem(MOSAIC_ROWS, SUB),
                       plgpu.Barrier(num_barriers=2)],
        grid=(tiles,), grid_names=("b",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **params))


def mosaic_inputs(at: np.ndarray, placement: str):
    """(am, t0) for `mosaic_substitution_call` from the tiles' A^T [tiles, 16, 16]: A's rows and the identity placed."""
    rows = np.asarray(MOSAIC_PLACEMENTS[placement])
    n = at.shape[0]
    am = np.zeros((n, SUB, MOSAIC_ROWS), np.float32)
    am[:, :, rows] = np.swapaxes(at, 1, 2)  # am[b, i, rows[j]] = A[i, j] = A^T[j, i]
    t0 = np.zeros((n, MOSAIC_ROWS, SUB), np.float32)
    t0[:, rows, :] = np.eye(SUB, dtype=np.float32)
    return jnp.asarray(am), jnp.asarray(t0)


def mosaic_tiles(t_placed: np.ndarray, placement: str) -> np.ndarray:
    """T [tiles, 16, 16] from the kernel's placed [tiles, 64, 16]."""
    return np.asarray(t_placed)[:, np.asarray(MOSAIC_PLACEMENTS[placement]), :]


def _mosaic_gram_kernel(k_gmem, kb_gmem, g_gmem, k_s, kb_s, g_s, bars):
    """G = k16 (beta k)16^T [64, 64] by one fp16 wgmma (M = 64, N = 64, K = 128), fp32 accumulation: the four
    slices' gram tiles are its diagonal [16, 16] blocks, as Triton's fp16 `mma.sync` dots compute them
    (`wy.diag_tile_transposed`'s kk_t, `p_kk` "fp16")."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.copy_gmem_to_smem(k_gmem, k_s, bars.at[0])
    plgpu.copy_gmem_to_smem(kb_gmem, kb_s, bars.at[1])
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])

    def gram(acc):
        plgpu.wgmma(acc, k_s, kb_s.T)
        return acc[...]

    g_s[...] = pl.run_scoped(gram, plgpu.ACC((4 * SUB, 4 * SUB), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(g_s, g_gmem)
    plgpu.wait_smem_to_gmem(0)


def mosaic_gram_call(interpret: bool):
    """A jitted Pallas Mosaic GPU call: (k16, (beta k)16), fp16 [64, K] each -> G fp32 [64, 64]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from pallas_kernels.gated_delta.recurrence_mgpu import _smem

    params = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    c = 4 * SUB
    return jax.jit(plgpu.kernel(
        _mosaic_gram_kernel, out_type=jax.ShapeDtypeStruct((c, c), jnp.float32),
        scratch_types=[_smem(c, K, dtype=jnp.float16), _smem(c, K, dtype=jnp.float16), _smem(c, c),
                       plgpu.Barrier(num_barriers=2)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup), **params))


def gram_inputs(k, beta):
    """The fp16 operands of the gram dot as Triton rounds them: k and beta k (fp32 products) to nearest fp16."""
    k = np.asarray(k, np.float32)
    kb = k * np.asarray(beta, np.float32)[:, None]
    return jnp.asarray(k.astype(np.float16)), jnp.asarray(kb.astype(np.float16))


def gram_diagonal(g) -> np.ndarray:
    """The four diagonal [16, 16] blocks of G [64, 64]."""
    g = np.asarray(g)
    return np.stack([g[b * SUB:(b + 1) * SUB, b * SUB:(b + 1) * SUB] for b in range(4)])


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
    ap.add_argument("--lower-only", action="store_true", help="lower the kernels for an abstract H200 and stop")
    ap.add_argument("--no-mosaic", action="store_true", help="the Triton kernel and the NumPy models only")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds must be at least 1; got {args.seeds}")
    if args.lower_only:
        from scripts.mosaic_tf32_probe import _lowered, cuda_text, lowered_as
        call = substitution_call(interpret=False)
        print("lowered:", _lowered(call, *inputs(0)))
        at0 = np.triu(np.full((4, SUB, SUB), 0.1, np.float32), 1)
        for placement in MOSAIC_PLACEMENTS:
            text = cuda_text(mosaic_substitution_call(placement, False), *mosaic_inputs(at0, placement))
            print(f"Mosaic GPU ({placement}) lowered:", lowered_as(text)
                  + f"; mul.rn.f32 in its code: {'mul.rn.f32' in text}")
        k, _, beta = inputs(0)
        print("Mosaic GPU gram lowered:", _lowered(mosaic_gram_call(False), *gram_inputs(k, beta)))
        return 0
    on_gpu = jax.default_backend() == "gpu"
    call = substitution_call(interpret=not on_gpu)
    mosaic = {} if args.no_mosaic else {p: mosaic_substitution_call(p, not on_gpu) for p in MOSAIC_PLACEMENTS}
    gram = None if args.no_mosaic else mosaic_gram_call(not on_gpu)
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}); interpret={not on_gpu}")
    totals = {}
    for seed in range(args.seeds):
        k, gc, beta = inputs(seed)
        at, t, _, kk = (np.asarray(x) for x in call(k, gc, beta))
        models = {o: np.stack([substitution_model(a, o) for a in at]) for o in ("g", "g8", "tree", "plain")}
        differ = {o: int(np.sum(m != t)) for o, m in models.items()}
        for p, fn in mosaic.items():  # the Mosaic GPU kernel on the Triton kernel's own A^T, against its T
            tm = mosaic_tiles(fn(*mosaic_inputs(at, p)), p)
            differ[f"mosaic_{p}"] = int(np.sum(tm != t))
            if p.startswith("rev"):  # and against the models: which in-thread add Mosaic GPU's code makes
                for o in ("g", "g8", "tree"):
                    differ[f"mosaic_{p}~{o}"] = int(np.sum(models[o] != tm))
        if gram is not None:  # the gram tiles: Mosaic GPU's fp16 wgmma against the Triton kernel's fp16 dots
            differ["mosaic_gram"] = int(np.sum(gram_diagonal(gram(*gram_inputs(k, beta))) != kk))
        for o, n in differ.items():
            totals[o] = totals.get(o, 0) + n
        print(f"seed {seed}: elements differing from the Triton kernel's T (mosaic_gram: its gram tiles; of "
              f"{4 * SUB * SUB} each): "
              + ", ".join(f"{o} {n}" for o, n in differ.items()), flush=True)
    print("totals over seeds:", totals, "of", args.seeds * 4 * SUB * SUB)
    return 0


if __name__ == "__main__":
    sys.exit(main())
