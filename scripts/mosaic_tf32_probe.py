"""Do Pallas' Mosaic GPU TF32 wgmma and our Pallas-Triton TF32 dots round alike? A first question for moving the
kernels off the deprecated Triton backend (`docs/mosaic_gpu.md`, `docs/speed_gaps.md`): if a Mosaic GPU dot gives the
bits of the Triton dot on the same fp32 operands, the kernels can move one at a time and the prefill / replay step
bitwise contracts survive each move; if not, the prefill and the replay step must move together.

On the GPU (H200, nothing installed: `PYTHONPATH=. python3 scripts/mosaic_tf32_probe.py`) it multiplies fresh random
fp32 operands A [64, K] and B [K, N] (B stored [N, K], K-major, as TF32 wgmma needs it in both backends) by
  - `mosaic`: one Mosaic GPU kernel, a single warpgroup, A and B copied to swizzled shared memory by TMA, one
    `plgpu.wgmma` chain;
  - `triton64`: a Pallas-Triton kernel running `wy.dot(a, b, "tf32", trans_b=True)` on all 64 rows (a wgmma there);
  - `triton16`: the same on 16-row blocks (mma.sync there: the replay step's form);
  - `mosaic_rna`: the Mosaic GPU kernel on operands rounded to TF32 (to nearest, ties away) beforehand;
and prints, for each pair and against float64 products of the operands rounded to TF32 to nearest (ties away, as
`cvt.rna.tf32.f32`) and toward zero, how many elements differ and by how much. Then (unless --no-ops) it compares
exp, rsqrt and a row sum over 128 between a Pallas-Triton kernel and a Mosaic GPU kernel (`approx_math` off and on).
Exit status 0 whatever it finds: it is a measurement. What it found on the H200 (BENCHMARKS.md, runs 106-108): the
Mosaic GPU wgmma truncates fp32 operands, and on operands rounded to nearest first it gives the Triton dots' bits;
exact exp and rsqrt agree, the fast exp and the row sum's order of additions do not.

With --tile-sums it asks what moving u = X (beta v) into the fused Mosaic GPU recurrence would need
(`docs/speed_gaps.md`, "What is left for the prefill", item 1): block row i of u as the prep computes it
(`chunk._wy_block_row`, Pallas-Triton: one [16, 16] x [16, V] TF32 dot per tile X_im, m <= i, the results added in
order) against a Mosaic GPU kernel computing each tile's product as a 64-row wgmma (the tile at rows 0..15 among
zeros, K = 16, N = --tile-n) on operands rounded to TF32 beforehand, the tiles' products either chained in one
accumulator (`chain`) or each in a fresh accumulator and added in registers in the prep's order (`sum`); then all of
u against one wgmma chain over the whole block lower-triangular X [64, 64] (K = 64). What it found on an H100
(BENCHMARKS.md, runs 192-193): both chains give the prep's u in every element; `sum` does not.

On a CPU (`--lower-only`) it only lowers the Mosaic GPU kernels for an abstract H200 (what the CI checks: the API of
jax 0.11.2 as this script uses it).
"""

from __future__ import annotations

import argparse
import functools

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

SWIZZLE = 128  # bytes: 32 fp32 per swizzled row


def _swizzled(n_cols: int):
    """The shared-memory transforms of an fp32 buffer with `n_cols` columns: 8-row tiles, the widest swizzle its rows
    allow (128 bytes at 32 columns and more)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = plgpu.find_swizzle(n_cols * 32)  # bytes
    return plgpu.TilingTransform((8, swizzle // 4)), plgpu.SwizzleTransform(swizzle)


def _operands_in_smem(a_gmem, b_gmem, a_smem, b_smem, barriers):
    """Both operands into shared memory by TMA, one barrier each, and waited for."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.copy_gmem_to_smem(a_gmem, a_smem, barriers.at[0])
    plgpu.copy_gmem_to_smem(b_gmem, b_smem, barriers.at[1])
    plgpu.barrier_wait(barriers.at[0])
    plgpu.barrier_wait(barriers.at[1])


def mosaic_dot(a, b_t):
    """a [M, K] fp32, b_t [N, K] fp32 -> a @ b_t.T [M, N] fp32: one Mosaic GPU kernel, one TF32 wgmma chain (M a
    multiple of 64, K of 32, N of 8; `docs/mosaic_gpu.md`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    M, K = a.shape
    N = b_t.shape[0]
    swizzled = (plgpu.TilingTransform((8, SWIZZLE // 4)), plgpu.SwizzleTransform(SWIZZLE))
    out_swizzled = _swizzled(N)  # the output's rows may be narrower than 128 bytes

    def kernel(a_gmem, b_gmem, out_gmem, a_smem, b_smem, o_smem, barriers):
        _operands_in_smem(a_gmem, b_gmem, a_smem, b_smem, barriers)

        def with_accumulator(acc):
            plgpu.wgmma(acc, a_smem, b_smem.T)  # fp32 operands: TF32; B K-major (stored [N, K])
            o_smem[...] = acc[...]  # reading the accumulator waits for the wgmma
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, out_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(with_accumulator, plgpu.ACC((M, N), jnp.float32))

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
        scratch_types=[plgpu.SMEM((M, K), jnp.float32, transforms=swizzled),
                       plgpu.SMEM((N, K), jnp.float32, transforms=swizzled),
                       plgpu.SMEM((M, N), jnp.float32, transforms=out_swizzled),
                       plgpu.Barrier(num_barriers=2)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(a, b_t)


def mosaic_tile_sums(x_tiles, b_t, *, chained: bool):
    """x_tiles [n, 64, 16] fp32 (each a [16, 16] tile at rows 0..15, zeros below), b_t [n, N, 16] fp32 (K-major) ->
    sum_m x_tiles[m] @ b_t[m].T [64, N]: one Mosaic GPU kernel, one warpgroup, one TF32 wgmma per tile (K = 16:
    64-byte swizzle); `chained`: every wgmma into one accumulator, else each into a fresh one, the results added in
    registers in m's order (`chunk._wy_block_row`'s order: ((p0 + p1) + p2) + ...)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    n, M, K = x_tiles.shape
    N = b_t.shape[1]
    tiled, out_tiled = _swizzled(K), _swizzled(N)  # K = 16: 64-byte rows

    def kernel(a_gmem, b_gmem, out_gmem, a_smem, b_smem, o_smem, barriers):
        _operands_in_smem(a_gmem, b_gmem, a_smem, b_smem, barriers)
        if chained:
            def with_accumulator(acc):
                for m in range(n):
                    plgpu.wgmma(acc, a_smem.at[m], b_smem.at[m].T)
                o_smem[...] = acc[...]
            pl.run_scoped(with_accumulator, plgpu.ACC((M, N), jnp.float32))
        else:
            total = None
            for m in range(n):
                def one(acc, m=m):
                    plgpu.wgmma(acc, a_smem.at[m], b_smem.at[m].T)
                    return acc[...]
                part = pl.run_scoped(one, plgpu.ACC((M, N), jnp.float32))
                total = part if total is None else total + part
            o_smem[...] = total
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, out_gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((M, N), jnp.float32),
        scratch_types=[plgpu.SMEM((n, M, K), jnp.float32, transforms=tiled),
                       plgpu.SMEM((n, N, K), jnp.float32, transforms=tiled),
                       plgpu.SMEM((M, N), jnp.float32, transforms=out_tiled),
                       plgpu.Barrier(num_barriers=2)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(x_tiles, b_t)


def triton_block_row(x, bk, bv, i: int):
    """w and u of block row i as the prep computes them: `chunk._wy_block_row` in a Pallas-Triton kernel (4 warps,
    the prep's default precision "tf32"). x [NB, NB, 16, 16] (tile (i, m) at x[i, m]), bk [NB, 16, K], bv [NB, 16, V]
    -> (w [16, K], u [16, V])."""
    from jax.experimental.pallas import triton as plt

    from pallas_kernels.gated_delta import chunk as ck

    def kernel(x_ref, bk_ref, bv_ref, w_ref, u_ref):
        tiles = {(i, m): x_ref[i, m] for m in range(i + 1)}
        bks = [bk_ref[m] for m in range(i + 1)]
        bvs = [bv_ref[m] for m in range(i + 1)]
        w, u = ck._wy_block_row(i, tiles, bks, bvs, ck.DEFAULT_CONFIG, False)
        w_ref[...] = w
        u_ref[...] = u

    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((16, bk.shape[-1]), f32), jax.ShapeDtypeStruct((16, bv.shape[-1]), f32)),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(x, bk, bv)


def tile_sums_probe(seeds: int, n_cols: int) -> None:
    """u's block row i = 1..3 by the prep (Triton) against Mosaic GPU's two forms, and all four block rows against one
    Mosaic GPU wgmma chain over the whole [64, 64] X (`mosaic_dot`, K = 64), fresh random operands: X tiles as
    an inverse's entries (N(0, 1) / 4, its diagonal tiles unit lower-triangular) and beta v rows (bf16 values times
    beta in (0, 1)), V = 128, Mosaic's N = `n_cols` (the fused kernel's V block: its first columns compared)."""
    for seed in range(seeds):
        rng = np.random.default_rng(200 + seed)
        x = (rng.standard_normal((4, 4, 16, 16)) / 4).astype(np.float32)
        for m in range(4):
            x[m, m] = np.tril(x[m, m], -1) + np.eye(16, dtype=np.float32)
        v = rng.standard_normal((4, 16, 128)).astype(jnp.bfloat16).astype(np.float32)
        beta = rng.uniform(0.0, 1.0, (4, 16, 1)).astype(np.float32)
        bv = (v * beta).astype(np.float32)
        bk = (rng.standard_normal((4, 16, 128)) / 11).astype(np.float32)
        prep = []  # u's block rows as the prep computes them
        for i in range(4):
            _, u = (np.asarray(t) for t in jax.jit(functools.partial(triton_block_row, i=i))(x, bk, bv))
            prep.append(u[:, :n_cols])
            if i == 0:
                continue
            tiles = np.zeros((i + 1, 64, 16), np.float32)
            for m in range(i + 1):
                tiles[m, :16] = tf32_rna(x[i, m])
            b_t = np.stack([tf32_rna(bv[m][:, :n_cols].T) for m in range(i + 1)])  # [n, N, 16]
            exact = sum(tiles[m, :16].astype(np.float64) @ b_t[m].astype(np.float64).T for m in range(i + 1))
            print(f"tile sums, seed {seed}, block row {i} ({i + 1} tiles, N = {n_cols}):", flush=True)
            for chained in (True, False):
                got = np.asarray(jax.jit(functools.partial(mosaic_tile_sums, chained=chained))(
                    jnp.asarray(tiles), jnp.asarray(b_t)))[:16]
                compare(f"mosaic {'chain' if chained else 'sum'} vs prep", got, u[:, :n_cols])
            compare("prep vs rna-rounded fp64", u[:, :n_cols], exact.astype(np.float32))
        # all of u at once: one wgmma chain over the whole block lower-triangular X (K = 64: each block row's tiles in
        # m's order, then zeros), as the fused recurrence would run it
        x_whole = np.zeros((64, 64), np.float32)
        for i in range(4):
            for m in range(i + 1):
                x_whole[16 * i:16 * i + 16, 16 * m:16 * m + 16] = x[i, m]
        b_whole = np.concatenate(list(bv), axis=0)[:, :n_cols].T  # [N, 64], K-major
        got = np.asarray(jax.jit(mosaic_dot)(jnp.asarray(tf32_rna(x_whole)), jnp.asarray(tf32_rna(b_whole))))
        print(f"tile sums, seed {seed}, all of u by one [64, 64] x [64, {n_cols}] wgmma chain:", flush=True)
        compare("mosaic whole X vs prep", got, np.concatenate(prep, axis=0))


def triton_dot(a, b_t, rows: int):
    """The same product by a Pallas-Triton kernel, `rows` rows of A per program, through our kernels' own dot
    (`wy.dot`, precision "tf32")."""
    from jax.experimental.pallas import triton as plt

    from pallas_kernels.gated_delta import wy

    M, K = a.shape
    N = b_t.shape[0]

    def kernel(a_ref, b_ref, o_ref):
        o_ref[...] = wy.dot(a_ref[...], b_ref[...], "tf32", False, trans_b=True)

    return pl.pallas_call(
        kernel, grid=(M // rows,),
        in_specs=[pl.BlockSpec((rows, K), lambda i: (i, 0)), pl.BlockSpec((N, K), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((rows, N), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((M, N), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(a, b_t)


def _ops_out_type(M: int, N: int):
    """exp and rsqrt [M, N], the row sums [M]: fp32."""
    f32 = jnp.float32
    return jax.ShapeDtypeStruct((M, N), f32), jax.ShapeDtypeStruct((M, N), f32), jax.ShapeDtypeStruct((M,), f32)


def mosaic_ops(x, *, approx: bool):
    """x [M, N] fp32 -> (exp(x), rsqrt(|x| + 1e-6), the row sums [M]) by one Mosaic GPU kernel (one warpgroup, the
    values in the WGMMA register layout; `approx`: `CompilerParams(approx_math=...)`)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    M, N = x.shape

    def kernel(x_gmem, e_gmem, r_gmem, s_gmem, x_smem, e_smem, r_smem, s_smem, barrier):
        plgpu.copy_gmem_to_smem(x_gmem, x_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        v = plgpu.layout_cast(x_smem[...], plgpu.Layout.WGMMA)
        e_smem[...] = jnp.exp(v)
        r_smem[...] = jax.lax.rsqrt(jnp.abs(v) + 1e-6)
        s_smem[...] = jnp.sum(v, axis=1)
        plgpu.commit_smem()
        for smem, gmem in ((e_smem, e_gmem), (r_smem, r_gmem), (s_smem, s_gmem)):
            plgpu.copy_smem_to_gmem(smem, gmem)
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        kernel,
        out_type=_ops_out_type(M, N),
        scratch_types=[plgpu.SMEM((M, N), jnp.float32)] * 3 + [plgpu.SMEM((M,), jnp.float32),
                                                               plgpu.Barrier(num_barriers=1)],
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=approx),
    )(x)


def triton_ops(x):
    """The same three by a Pallas-Triton kernel on 4 warps (the operations our kernels trace: `jnp.exp`,
    `lax.rsqrt`, `jnp.sum` along a row, as `wy.l2norm`)."""
    from jax.experimental.pallas import triton as plt

    M, N = x.shape

    def kernel(x_ref, e_ref, r_ref, s_ref):
        v = x_ref[...]
        e_ref[...] = jnp.exp(v)
        r_ref[...] = jax.lax.rsqrt(jnp.abs(v) + 1e-6)
        s_ref[...] = jnp.sum(v, axis=1)

    return pl.pallas_call(
        kernel,
        out_shape=_ops_out_type(M, N),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )(x)


def ops_probe(seeds: int) -> None:
    """Elementwise and reduction bits: Triton against Mosaic GPU (approx_math off and on), x ~ U(-100, 3) (exp
    reaches fp32's subnormal range below -87.34: it prints how many of those results Triton's exp left non-zero —
    all of them on the H200, run 108) and a row sum over 128."""
    for seed in range(seeds):
        x = jnp.asarray(np.random.default_rng(100 + seed).uniform(-100.0, 3.0, (64, 128)).astype(np.float32))
        tri = [np.asarray(o) for o in jax.jit(triton_ops)(x)]
        print(f"ops, seed {seed}:", flush=True)
        for approx in (False, True):
            mos = [np.asarray(o) for o in jax.jit(lambda y, a=approx: mosaic_ops(y, approx=a))(x)]
            for name, m, t in zip(("exp", "rsqrt", "row sum"), mos, tri):
                compare(f"{name}: mosaic{' approx' if approx else ''} vs triton", m, t)
        subnormal = np.asarray(x) < -87.34
        print(f"  ({subnormal.sum()} inputs below -87.34; triton's exp there: {np.count_nonzero(tri[0][subnormal])} "
              f"non-zero)", flush=True)


def tf32_rz(x: np.ndarray) -> np.ndarray:
    """fp32 -> TF32 by dropping the 13 low mantissa bits (toward zero), as fp32."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def tf32_rna(x: np.ndarray) -> np.ndarray:
    """fp32 -> the nearest TF32 value, ties away from zero (`cvt.rna.tf32.f32`), as fp32 (finite inputs): half a
    TF32 ulp added to the magnitude's bits, then cut."""
    return tf32_rz((np.asarray(x, np.float32).view(np.uint32) + np.uint32(0x1000)).view(np.float32))


def cuda_text(fn, *avals) -> str:
    """`fn`'s program lowered for CUDA here (an exception if it does not lower), as text. Under an abstract H200 mesh:
    Pallas-Triton's lowering needs a GPU's kind."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType

    h200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=h200)):
        return jax.jit(fn).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


def lowered_as(text: str) -> str:
    """What a program's CUDA text (`cuda_text`) holds: a Mosaic GPU custom call, Pallas-Triton's GPU call or none."""
    if "mosaic_gpu" in text:
        return "lowered, a Mosaic GPU custom call"
    return "lowered, " + ("a GPU custom call" if "custom_call @__gpu" in text else "no GPU call")


def _lowered(fn, *avals) -> str:
    """Whether `fn` lowers for CUDA here (an exception if not), and to what (`lowered_as`)."""
    return lowered_as(cuda_text(fn, *avals))


def compare(name: str, x: np.ndarray, y: np.ndarray) -> dict:
    differ = x != y
    scale = np.abs(y).max()
    row = dict(pair=name, differ=int(differ.sum()), of=int(x.size),
               max_abs=float(np.abs(x - y).max()), max_rel=float(np.abs(x - y).max() / scale))
    print(f"{name:>28s}: {row['differ']:6d} of {row['of']} elements differ; max |diff| {row['max_abs']:.3g} "
          f"({row['max_rel']:.3g} of max |value|)", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lower-only", action="store_true", help="only lower the Mosaic GPU kernels for CUDA (on a CPU)")
    ap.add_argument("--shapes", default="128,64;64,64;128,16", help="K,N pairs, ';'-separated (M = 64)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--no-ops", action="store_true", help="skip the elementwise / reduction comparison")
    ap.add_argument("--tile-sums", action="store_true",
                    help="only the tile-sum probe: u's block row by the prep against Mosaic GPU wgmmas (docstring)")
    ap.add_argument("--tile-n", type=int, default=64, help="the Mosaic GPU tile-sum kernel's N (a V block)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(n) for n in kn.split(",")) for kn in args.shapes.split(";")]
    if args.lower_only and args.tile_sums:
        for n in (2, 4):
            sds = (jax.ShapeDtypeStruct((n, 64, 16), jnp.float32),
                   jax.ShapeDtypeStruct((n, args.tile_n, 16), jnp.float32))
            for chained in (True, False):
                print(f"tile sums, {n} tiles, chained={chained}: "
                      f"{_lowered(functools.partial(mosaic_tile_sums, chained=chained), *sds)}")
        f32 = jnp.float32
        avals = (jax.ShapeDtypeStruct((4, 4, 16, 16), f32), jax.ShapeDtypeStruct((4, 16, 128), f32),
                 jax.ShapeDtypeStruct((4, 16, 128), f32))
        print(f"tile sums, the prep's block row 3 (Pallas-Triton): "
              f"{_lowered(functools.partial(triton_block_row, i=3), *avals)}")
        return 0
    if args.tile_sums:
        print(jax.devices()[0].device_kind, jax.__version__, flush=True)
        tile_sums_probe(args.seeds, args.tile_n)
        return 0
    if args.lower_only:
        for K, N in shapes:
            sds = (jax.ShapeDtypeStruct((64, K), jnp.float32), jax.ShapeDtypeStruct((N, K), jnp.float32))
            print(f"K={K} N={N}: {_lowered(mosaic_dot, *sds)}")
        if not args.no_ops:
            x = jax.ShapeDtypeStruct((64, 128), jnp.float32)
            for approx in (False, True):
                print(f"ops (approx_math={approx}): {_lowered(lambda y, a=approx: mosaic_ops(y, approx=a), x)}")
        return 0
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for K, N in shapes:
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            a = rng.standard_normal((64, K)).astype(np.float32)
            b_t = rng.standard_normal((N, K)).astype(np.float32)
            a_j, b_j = jnp.asarray(a), jnp.asarray(b_t)
            got = {"mosaic": np.asarray(jax.jit(mosaic_dot)(a_j, b_j)),
                   # the operands rounded to TF32 (nearest, ties away) before the Mosaic GPU kernel sees them
                   "mosaic_rna": np.asarray(jax.jit(mosaic_dot)(jnp.asarray(tf32_rna(a)), jnp.asarray(tf32_rna(b_t)))),
                   "triton64": np.asarray(jax.jit(lambda x, y: triton_dot(x, y, 64))(a_j, b_j)),
                   "triton16": np.asarray(jax.jit(lambda x, y: triton_dot(x, y, 16))(a_j, b_j))}
            exact = {how: (cut(a).astype(np.float64) @ cut(b_t).astype(np.float64).T).astype(np.float32)
                     for how, cut in (("rna", tf32_rna), ("rz", tf32_rz))}
            print(f"K={K} N={N} seed {seed}:", flush=True)
            for x, y in (("mosaic", "triton64"), ("mosaic", "triton16"), ("triton16", "triton64"),
                         ("mosaic_rna", "triton64"), ("mosaic_rna", "triton16")):
                compare(f"{x} vs {y}", got[x], got[y])
            for x in got:
                for how, want in exact.items():
                    compare(f"{x} vs {how}-rounded fp64", got[x], want)
    if not args.no_ops:
        ops_probe(args.seeds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
