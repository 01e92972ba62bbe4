"""The split design's output kernel (`chunk._out_kernel`) as a Pallas Mosaic GPU kernel, and the Triton kernel that
hands it the L2 norms of q and k (`key_norms`).

Dimension legend as in `reference.py`; C = 64 (the chunk), NT = Tp / C, G = HV / HK.

Per program (grid (NT, HV, B)), chunk c of value head h of row b, with S_c the state at the chunk's start (h[c],
stored transposed by the recurrence: [V, K]) and v_new^T [V, C] (the recurrence's outputs, `states_t=True`):
  q~   = q r_q scale, k~ = k r_k (r = 1 / |x|: L2-normalised; padded rows exact zeros)
  Aqk  = (q~ k~^T) * exp(gc_i - gc_j) on j <= i, zeros above   (one 16-bit wgmma, `p_qk`: 64 x 64 x K)
  qg   = q~ exp(gc)
  o    = qg S_c + Aqk v_new                                     (two TF32 wgmmas, M = C, N = V, K = K and C)
The K-major B operands TF32 wgmma needs are the layouts the recurrence already writes: S_c as h[c] = S_c^T [V, K],
v_new as v_new^T [V, C]; k~ [C, K] as stored is K-major for q~ k~^T.

Why the L2 norms come from a Triton kernel: on the H200 a row sum of 128 products in Mosaic GPU adds in another order
than Triton's (run 108: 16-25 rows of 64 differ in the last bit), and the output's bits must stay the Triton kernel's
(the replay step computes its output rows with Triton's arithmetic: `replay.py`). `key_norms` computes
r = rsqrt(sum(x^2) + eps) per row of q and k with the output kernel's own code on the output kernel's tiles and warps
(`wy.rnorm`, [C, K] tiles, `warps_out`), so its sums are the Triton output kernel's; rows past a row's length get -1
(r is positive otherwise), which the kernel here reads as "padded": x r where r >= 0, else exact zeros, as
`chunk._load_key`'s `where` has it. The rest is element-wise (exact in both backends: Mosaic GPU's `exp` is Triton's,
run 108) or dots: Triton rounds fp32 operands to TF32 to nearest and Mosaic GPU's wgmma truncates them (runs 106-108),
so qg, Aqk, S_c and v_new are rounded to nearest here (`_tf32_rna`) before the TF32 wgmmas read them. The two dots
are added as the H200's Triton code adds them: qg S_c is the initial accumulator of Aqk v_new (`order="h_acc"`, the
default; "add", their results added, and "vn_acc", the other way round, differ from it in a few elements in 10^4-10^5).
Checked on the H200 (`scripts/gpu_mgpu_output.py`, BENCHMARKS.md run 132): the Triton output kernel's bits in every
element on three shapes, but 1.11-1.16x its time with `key_norms` (211 KiB of shared memory then, 195 KiB since q~
is the q k^T wgmma's register operand: one program per SM, its loads overlapped with nothing), so the prefill's
default stays the Triton kernel (chunk config `output`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta import wy
from pallas_kernels.gated_delta.recurrence_mgpu import _tf32_rna

CHUNK = 64
_SWIZZLE = 128  # bytes
ORDERS = ("add", "h_acc", "vn_acc")
PADDED = -1.0  # `key_norms`' value for a row past its row's length


def _norms_kernel(len_ref, q_ref, k_ref, rq_ref, rk_ref):
    """r = rsqrt(sum(x^2) + eps) of each row of one chunk of q and of k ([C, K] tiles, as `chunk._out_kernel` loads
    them), PADDED past the row's length."""
    valid = (pl.program_id(0) * CHUNK + lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)) < len_ref[0]
    rq_ref[...] = jnp.where(valid, wy.rnorm(q_ref[...].astype(jnp.float32))[:, 0], PADDED)
    rk_ref[...] = jnp.where(valid, wy.rnorm(k_ref[...].astype(jnp.float32))[:, 0], PADDED)


def key_norms(q, k, lengths, *, warps: int, interpret: bool):
    """(r_q, r_k) fp32 [B, HK, Tp]: the L2 norms' reciprocals of q and k [B, Tp, HK, K] (Tp a multiple of C), rows
    past `lengths` [B] PADDED. A Pallas Triton kernel with `warps` warps (the Triton output kernel's `warps_out`: its
    row sums add in the order of that kernel's)."""
    from jax.experimental.pallas import triton as pltriton

    B, tp, HK, K = q.shape
    key = pl.BlockSpec((None, CHUNK, None, K), lambda c, h, b: (b, c, h, 0))
    norm = pl.BlockSpec((None, None, CHUNK), lambda c, h, b: (b, h, c))
    out = jax.ShapeDtypeStruct((B, HK, tp), jnp.float32)
    return pl.pallas_call(
        _norms_kernel,
        grid=(tp // CHUNK, HK, B),
        in_specs=[pl.BlockSpec((1,), lambda c, h, b: (b,)), key, key],
        out_specs=[norm, norm],
        out_shape=[out, out],
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="gdn_chunk_norms",
    )(lengths, q, k)


def _kernel(q_gmem, k_gmem, rq_gmem, rk_gmem, gc_gmem, h_gmem, vn_gmem, o_gmem,
            q_s, k_s, rq_s, rk_s, gc_s, h_s, vn_s, k16_s, qg_s, aqk_s, bars, *o_s, groups: int, scale: float,
            order: str, interpret: bool):
    """One program: chunk c of value head h of row b (module docstring). GMEM refs: q, k [B, Tp, HK, K] (16-bit),
    r_q, r_k fp32 [B, HK, Tp] (`key_norms`), gc fp32 [B, HV, Tp], h fp32 [B, HV, NT, V, K] (transposed states),
    v_new^T fp32 [B, HV, V, Tp]; output o [B, Tp, HV, V]. Every load is issued first; S_c and v_new, the largest,
    land while q k^T and the decays are computed. `o_s`: o's staging buffer, or none, when o goes out through q's
    (the same dtype and shape: free once q is normalised)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    c, hv, b = lax.axis_index("c"), lax.axis_index("h"), lax.axis_index("b")
    hk = hv // groups
    rows = pl.ds(c * CHUNK, CHUNK)
    q_bar, k_bar, rq_bar, rk_bar, gc_bar, h_bar, vn_bar = (bars.at[i] for i in range(7))
    plgpu.copy_gmem_to_smem(q_gmem.at[b, rows, hk, :], q_s, q_bar)
    plgpu.copy_gmem_to_smem(rq_gmem.at[b, hk, rows], rq_s, rq_bar)
    plgpu.copy_gmem_to_smem(k_gmem.at[b, rows, hk, :], k_s, k_bar)
    plgpu.copy_gmem_to_smem(rk_gmem.at[b, hk, rows], rk_s, rk_bar)
    plgpu.copy_gmem_to_smem(gc_gmem.at[b, hv, rows], gc_s, gc_bar)
    plgpu.copy_gmem_to_smem(h_gmem.at[b, hv, c], h_s, h_bar)
    plgpu.copy_gmem_to_smem(vn_gmem.at[b, hv, :, rows], vn_s, vn_bar)
    qg_s[...], aqk_s[...] = _intra(q_s, k_s, rq_s, rk_s, gc_s, k16_s, (q_bar, k_bar, rq_bar, rk_bar, gc_bar),
                                   scale, interpret=interpret)
    wgmma_layout = plgpu.Layout.WGMMA
    plgpu.barrier_wait(h_bar)
    for r0 in range(0, h_s.shape[0], CHUNK):  # S_c rounded in place, 64 rows at a time (registers)
        part = pl.ds(r0, CHUNK)
        h_s.at[part][...] = _tf32_rna(plgpu.layout_cast(h_s.at[part][...], wgmma_layout))
    plgpu.barrier_wait(vn_bar)
    vn_s[...] = _tf32_rna(plgpu.layout_cast(vn_s[...], wgmma_layout))
    plgpu.commit_smem()
    o = _out_dots(qg_s, h_s, aqk_s, vn_s, order, interpret)
    o_s = o_s[0] if o_s else q_s
    o_s[...] = o.astype(o_s.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_s, o_gmem.at[b, rows, hv, :])
    plgpu.wait_smem_to_gmem(0)


def _intra(q_s, k_s, rq_s, rk_s, gc_s, k16_s, bars, scale: float, *, interpret: bool, aliased: bool = False):
    """The output's V-independent part of one chunk (module docstring): (qg = q~ exp(gc) [C, K], Aqk [C, C]) in
    registers, for the caller to store where and when it can, both rounded to TF32 to nearest (the TF32 wgmmas'
    operands), from q, k (16-bit, as loaded), their norms' reciprocals and gc, each waited for on its barrier of
    `bars` (q, k, r_q, r_k, gc). k~ goes to `k16_s` (k16_s's dtype: `p_qk`) for the 16-bit q k^T wgmma, whose q~
    operand is read from registers (the same wgmma, no copy through shared memory: the same bits as from shared
    memory on an H100, 2026-12-06; the CPU interpreter's wgmma reads shared memory only, so there an fp32 dot of the
    same 16-bit values computes it: the products are exact, the order of their sum XLA's). `aliased`: `k16_s` shares
    memory with `k_s` (a `plgpu.RefUnion`), so k~ is written once the whole warpgroup has read k (`commit_smem`'s
    warpgroup barrier)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    q_bar, k_bar, rq_bar, rk_bar, gc_bar = bars
    f32 = jnp.float32
    wgmma_layout = plgpu.Layout.WGMMA
    row_vec, col_vec = wgmma_layout.reduce(1), wgmma_layout.reduce(0)

    def normalised(x_s, r_s, x_bar, r_bar):  # x r, exact zeros on padded rows (`chunk._load_key`)
        plgpu.barrier_wait(x_bar)
        plgpu.barrier_wait(r_bar)
        x = plgpu.layout_cast(x_s[...], wgmma_layout).astype(f32)
        r = lax.broadcast_in_dim(plgpu.load(r_s, layout=row_vec), x.shape, [0])
        return jnp.where(r >= 0.0, x * r, 0.0)

    k_n = normalised(k_s, rk_s, k_bar, rk_bar)
    if aliased:
        plgpu.commit_smem()
    k16_s[...] = k_n.astype(k16_s.dtype)
    q_n = normalised(q_s, rq_s, q_bar, rq_bar) * scale
    plgpu.barrier_wait(gc_bar)
    gc_row = plgpu.load(gc_s, layout=row_vec)
    plgpu.commit_smem()

    # q~ k~^T [C, C], 16-bit operands (`p_qk`), q~ from registers
    if interpret:  # (the interpreter's wgmma takes shared-memory operands only)
        qk = lax.dot_general(q_n.astype(k16_s.dtype).astype(f32), k16_s[...].astype(f32), (((1,), (1,)), ((), ())),
                             precision=lax.Precision.HIGHEST)
    else:
        def qk_dot(acc):
            plgpu.wgmma(acc, q_n.astype(k16_s.dtype), k16_s.T)
            return acc[...]

        qk = pl.run_scoped(qk_dot, plgpu.ACC((CHUNK, CHUNK), f32))
    row = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wgmma_layout)
    col = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wgmma_layout)
    lower = row >= col
    gc_i = lax.broadcast_in_dim(gc_row, (CHUNK, CHUNK), [0])
    gc_j = lax.broadcast_in_dim(plgpu.load(gc_s, layout=col_vec), (CHUNK, CHUNK), [1])
    decay = jnp.exp(jnp.where(lower, gc_i - gc_j, 0.0))  # (`wy.causal_decay`)
    return (_tf32_rna(q_n * lax.broadcast_in_dim(jnp.exp(gc_row), q_n.shape, [0])),
            _tf32_rna(jnp.where(lower, qk * decay, 0.0)))


def _out_dots(qg_s, h_s, aqk_s, vn_s, order: str, interpret: bool):
    """qg S_c + Aqk v_new [C, V] as `order` adds them (module docstring); the CPU interpreter has no accumulator
    given a value, so there the accumulating orders add after the dot."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    shape = (qg_s.shape[0], h_s.shape[0])

    def h_dot(acc):
        plgpu.wgmma(acc, qg_s, h_s.T)

    def vn_dot(acc):
        plgpu.wgmma(acc, aqk_s, vn_s.T)

    def alone(dot):
        return pl.run_scoped(lambda acc: (dot(acc), acc[...])[1], plgpu.ACC(shape, jnp.float32))

    if order == "add" or interpret:
        return alone(h_dot) + alone(vn_dot)
    first, second = (h_dot, vn_dot) if order == "h_acc" else (vn_dot, h_dot)
    return pl.run_state(second)(plgpu.ACC.init(alone(first)))


SMEM_BYTES = 232448  # the H200's shared memory per block (227 KiB), as Mosaic GPU counts it


def _reuses_q(K: int, V: int, q_dtype, out_dtype) -> bool:
    return (jnp.dtype(out_dtype), V) == (jnp.dtype(q_dtype), K)


def shared_memory_bytes(K: int, V: int, q_dtype, out_dtype, qk_dtype=jnp.float16) -> int:
    """The kernel's scratch in bytes as Mosaic GPU counts it (its buffers, vectors and barriers; `chunk._output_kernel`
    takes the kernel where this is at most SMEM_BYTES): at K = V = 128 with bf16 q and outputs 195 KiB, o going out
    through q's buffer (211 KiB up to 2026-12-06, when q~ went through a 16-bit copy in shared memory for q k^T); with
    fp32 outputs, in a buffer of their own, 56 bytes over (232504, the count the H200 refused in run 132)."""
    qi, oi, ki = (jnp.dtype(d).itemsize for d in (q_dtype, out_dtype, qk_dtype))
    tiles = CHUNK * K * (2 * qi + ki + 4) + 4 * V * K + 4 * V * CHUNK + 4 * CHUNK * CHUNK
    own_o = 0 if _reuses_q(K, V, q_dtype, out_dtype) else CHUNK * V * oi
    vectors = 3 * 1024  # r_q, r_k, gc: 256 bytes each, every buffer aligned to 1 KiB
    return tiles + own_o + vectors + 7 * 8


def _check(q, h, vn, order):
    B, tp, HK, K = q.shape
    V = h.shape[-2]
    if tp % CHUNK or K % 64 or V % 64 or K > 128 or V > 128 or h.shape[-1] != K or vn.shape[-2:] != (V, tp):
        raise ValueError(f"chunk_output_mgpu: Tp ({tp}) must be a multiple of {CHUNK}, K ({K}) and V ({V}) 64 or 128 "
                         f"(shared memory, wgmma shapes), h [.., NT, V, K] and v_new^T [.., V, Tp]; got h "
                         f"{h.shape}, v_new^T {vn.shape}")
    if order not in ORDERS:
        raise ValueError(f"chunk_output_mgpu: order is one of {ORDERS}, not {order!r}")


def chunk_output_mgpu(q, k, r_q, r_k, gc, h, vn_t, *, scale: float, out_dtype, qk_dtype=jnp.float16,
                      order: str = "h_acc", interpret: bool = False):
    """o [B, Tp, HV, V] in `out_dtype` from q, k [B, Tp, HK, K] (bf16 or fp32), their norms' reciprocals r_q, r_k
    fp32 [B, HK, Tp] (`key_norms`), gc fp32 [B, HV, Tp], h fp32 [B, HV, NT, V, K] and v_new^T fp32 [B, HV, V, Tp]
    (the recurrence's outputs with `states_t=True`). `qk_dtype`: the operands of q k^T (fp16 or bf16: `p_qk`);
    `order`: how the two output dots are added (module docstring)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    B, tp, HK, K = q.shape
    HV, nt, V = h.shape[1], h.shape[2], h.shape[3]
    _check(q, h, vn_t, order)
    if jnp.dtype(qk_dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"chunk_output_mgpu: qk_dtype is float16 or bfloat16, not {jnp.dtype(qk_dtype).name}")
    f32 = jnp.float32

    def smem(*shape, dtype=f32):  # swizzled as the wgmma takes its operands
        item = jnp.dtype(dtype).itemsize
        swizzle = min(_SWIZZLE, shape[-1] * item)
        return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // item)),
                                                    plgpu.SwizzleTransform(swizzle)))

    params = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    o_s = [] if _reuses_q(K, V, q.dtype, out_dtype) else [smem(CHUNK, V, dtype=out_dtype)]
    return plgpu.kernel(
        functools.partial(_kernel, groups=HV // HK, scale=float(scale), order=order, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((B, tp, HV, V), out_dtype),
        scratch_types=[smem(CHUNK, K, dtype=q.dtype), smem(CHUNK, K, dtype=k.dtype), plgpu.SMEM((CHUNK,), f32),
                       plgpu.SMEM((CHUNK,), f32), plgpu.SMEM((CHUNK,), f32), smem(V, K), smem(V, CHUNK),
                       smem(CHUNK, K, dtype=qk_dtype), smem(CHUNK, K),
                       smem(CHUNK, CHUNK), plgpu.Barrier(num_barriers=7), *o_s],
        grid=(nt, HV, B),
        grid_names=("c", "h", "b"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **params,
    )(q, k, r_q, r_k, gc.astype(f32), h, vn_t)

