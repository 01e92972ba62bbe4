"""The split design's state recurrence (`chunk._state_split_kernel`) as a Pallas Mosaic GPU kernel: an experiment
towards moving the kernels off the deprecated Pallas Triton backend (`docs/mosaic_gpu.md`, `docs/speed_gaps.md`).

Dimension legend as in `reference.py`; C = 64 (the chunk), NT = Tp / C, BV = this kernel's V block (64 or 128).

Per program (grid (V // BV, HV, B)) and chunk c, with the state held transposed, S^T [BV, K] fp32:
  h[c]    = S^T                                  (the state at the chunk's start, stored as `states_t=True` has it)
  v_new^T = u^T - S^T w^T                        (= (u - w S)^T; one TF32 wgmma, M = BV, N = C, K = K)
  S^T     = exp(gc_last) S^T + v_new^T kd        (= (exp(gc_last) S + kd^T v_new)^T; one TF32 wgmma, M = BV, N = K,
                                                  K = C, accumulating into the decayed state)
The transposed form is what Mosaic GPU's TF32 wgmma takes: both A operands (S^T, v_new^T) come from shared memory
K-major, and both B operands are K-major as stored (w [C, K] as the prep writes it; kd^T [K, C]).

Why the bits can equal the Triton recurrence's (to be checked on the H200; `scripts/gpu_kernels.py --only mgpu`):
every element is the same products summed over the same axis in the same k order by the same wgmma instruction
family, only with the operands' roles swapped (run 74 found a swapped dot gave the same bits in Triton); Triton
rounds fp32 operands to TF32 to nearest (`cvt.rna.tf32.f32`) while Mosaic GPU hands them to the hardware, which
truncates (runs 106-108), so S^T and v_new^T are rounded to nearest here before they reach shared memory (w and kd
hold fp16 values, exact in TF32); the decayed state is the accumulator the second dot adds into, as Triton feeds it;
exp is Mosaic GPU's exact one (run 108: Triton's bits).

Inputs are the Triton recurrence's, in its layouts; what this kernel needs otherwise (w and kd in fp32, kd and u
transposed, the chunks' last gc, S0 transposed) is made by XLA around it (one pass over w, u, kd: a cost the prep
kernel could take over by storing them so, if the kernel earns its place).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

CHUNK = 64
_SWIZZLE = 128  # bytes: 32 fp32 per swizzled row


def _tf32_rna(x):
    """fp32 rounded to TF32 (10 mantissa bits) to nearest, ties away from zero, as `cvt.rna.tf32.f32` does: add half
    of the dropped part's unit to the magnitude's bits, then clear the 13 low bits (exact for finite values)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return lax.bitcast_convert_type((bits + 0x1000) & jnp.int32(-0x2000), jnp.float32)


def _kernel(w_gmem, u_gmem, kd_gmem, gl_gmem, s0_gmem, h_gmem, vn_gmem, sf_gmem,
            w_s, u_s, kd_s, gl_s, sa_s, va_s, h_s, vn_s, bars, *, nt: int, bv: int, interpret: bool):
    """One program: V block j of value head h of row b, every chunk in order (module docstring). GMEM refs:
    w [B, HV, Tp, K], u^T [B, HV, V, Tp], kd^T [B, HV, K, Tp], the chunks' last gc [B, HV, NT4] (NT4 = NT rounded
    up to a multiple of 4: TMA's 16-byte rule), S0^T [B, HV, V, K]; outputs h [B, HV, NT, V, K], v_new^T
    [B, HV, V, Tp], the final S^T [B, HV, V, K]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    j, hv, b = lax.axis_index("j"), lax.axis_index("h"), lax.axis_index("b")
    cols = pl.ds(j * bv, bv)
    w_bar, u_bar, kd_bar, gl_bar, s0_bar = (bars.at[i] for i in range(5))

    def load_chunk(c, w_too=True, u_too=True, kd_too=True):
        rows = pl.ds(c * CHUNK, CHUNK)
        if w_too:
            plgpu.copy_gmem_to_smem(w_gmem.at[b, hv, rows, :], w_s, w_bar)
        if u_too:
            plgpu.copy_gmem_to_smem(u_gmem.at[b, hv, cols, rows], u_s, u_bar)
        if kd_too:
            plgpu.copy_gmem_to_smem(kd_gmem.at[b, hv, :, rows], kd_s, kd_bar)

    plgpu.copy_gmem_to_smem(s0_gmem.at[b, hv, cols, :], h_s, s0_bar)
    plgpu.copy_gmem_to_smem(gl_gmem.at[b, hv, :], gl_s, gl_bar)
    load_chunk(0)
    plgpu.barrier_wait(s0_bar)
    plgpu.barrier_wait(gl_bar)
    s_init = plgpu.layout_cast(h_s[...], plgpu.Layout.WGMMA)

    def body(c, s):
        more = c + 1 < nt
        # h[c] = S^T (unrounded) and the first dot's A operand (rounded to nearest); h[c-1]'s store has read h_s
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        h_s[...] = s
        sa_s[...] = _tf32_rna(s)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_s, h_gmem.at[b, hv, c, cols, :])

        plgpu.barrier_wait(w_bar)

        def ws_dot(acc):
            plgpu.wgmma(acc, sa_s, w_s.T)  # S^T w^T = (w S)^T [BV, C]
            return acc[...]  # (reading waits for the wgmma)

        ws = pl.run_scoped(ws_dot, plgpu.ACC((bv, CHUNK), jnp.float32))

        @pl.when(more)
        def _():
            load_chunk(c + 1, u_too=False, kd_too=False)

        plgpu.barrier_wait(u_bar)
        v = u_s[...] - ws  # v_new^T [BV, C]
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # v_new[c-1]'s store has read vn_s
        vn_s[...] = v
        va_s[...] = _tf32_rna(v)
        plgpu.commit_smem()  # (also: every thread's read of u_s is done before its next copy lands)
        plgpu.copy_smem_to_gmem(vn_s, vn_gmem.at[b, hv, cols, pl.ds(c * CHUNK, CHUNK)])

        @pl.when(more)
        def _():
            load_chunk(c + 1, w_too=False, kd_too=False)

        decay = jnp.exp(lax.broadcast_in_dim(gl_s[c], s.shape, ()))
        plgpu.barrier_wait(kd_bar)

        def kv_dot(acc):
            plgpu.wgmma(acc, va_s, kd_s.T)  # += v_new^T kd = (kd^T v_new)^T [BV, K]

        if interpret:  # (the CPU interpreter has no accumulator given a value: the add after the dot)
            s_next = s * decay + pl.run_scoped(lambda acc: (kv_dot(acc), acc[...])[1],
                                               plgpu.ACC((bv, s.shape[1]), jnp.float32))
        else:
            s_next = pl.run_state(kv_dot)(plgpu.ACC.init(s * decay))

        @pl.when(more)
        def _():
            load_chunk(c + 1, w_too=False, u_too=False)

        return s_next

    s_final = lax.fori_loop(0, nt, body, s_init)
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    h_s[...] = s_final
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_s, sf_gmem.at[b, hv, cols, :])
    plgpu.wait_smem_to_gmem(0)


def _check_shapes(tp: int, K: int, V: int, bv: int) -> None:
    if tp % CHUNK or bv != 64 or V % bv or K % 32:
        raise ValueError(f"state_recurrence_mgpu: Tp ({tp}) must be a multiple of {CHUNK}, bv ({bv}) 64 (shared "
                         f"memory), V ({V}) a multiple of it and K ({K}) of 32")


def mgpu_operands(w, u, kd, gc, initial_state):
    """The kernel's operands from the Triton recurrence's inputs (`state_recurrence_mgpu`), made by XLA: w and kd^T
    in fp32 (TF32 values), u^T, each chunk's last gc (padded to a multiple of 4 chunks), S0^T."""
    B, HV, tp, _ = w.shape
    nt = tp // CHUNK
    f32 = jnp.float32
    g_last = gc.reshape(B, HV, nt, CHUNK)[..., -1]
    g_last = jnp.pad(g_last, ((0, 0), (0, 0), (0, -(-nt // 4) * 4 - nt)))
    # w and kd are the dots' B operands, which the wgmma would truncate: rounded to nearest as Triton's dots round
    # them (a no-op on the fp16 values the GPU default stores)
    return (_tf32_rna(w.astype(f32)), jnp.swapaxes(u, -1, -2), jnp.swapaxes(_tf32_rna(kd.astype(f32)), -1, -2),
            g_last, jnp.swapaxes(initial_state.astype(f32), -1, -2))


def state_recurrence_mgpu_call(w, u_t, kd_t, g_last, s0_t, *, bv: int = 64, interpret: bool = False):
    """The kernel on `mgpu_operands`' operands. Returns h [B, HV, NT, V, K], v_new^T [B, HV, V, Tp] and the final
    state transposed [B, HV, V, K]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    B, HV, tp, K = w.shape
    V = u_t.shape[2]
    _check_shapes(tp, K, V, bv)
    nt = tp // CHUNK
    f32 = jnp.float32
    swizzled = (plgpu.TilingTransform((8, _SWIZZLE // 4)), plgpu.SwizzleTransform(_SWIZZLE))

    def smem(*shape):
        return plgpu.SMEM(shape, f32, transforms=swizzled)

    params = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    return plgpu.kernel(
        functools.partial(_kernel, nt=nt, bv=bv, interpret=interpret),
        out_type=[jax.ShapeDtypeStruct((B, HV, nt, V, K), f32), jax.ShapeDtypeStruct((B, HV, V, tp), f32),
                  jax.ShapeDtypeStruct((B, HV, V, K), f32)],
        scratch_types=[smem(CHUNK, K), smem(bv, CHUNK), smem(K, CHUNK), plgpu.SMEM(g_last.shape[-1:], f32),
                       smem(bv, K), smem(bv, CHUNK), smem(bv, K), smem(bv, CHUNK), plgpu.Barrier(num_barriers=5)],
        grid=(V // bv, HV, B),
        grid_names=("j", "h", "b"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **params,
    )(w, u_t, kd_t, g_last, s0_t)


def state_recurrence_mgpu(w, u, kd, gc, initial_state, *, bv: int = 64, interpret: bool = False):
    """The split design's recurrence on the Triton recurrence's inputs (`chunk._state_split_kernel`): w [B, HV, Tp, K]
    and kd [B, HV, Tp, K] as the prep stores them, u fp32 [B, HV, Tp, V], gc fp32 [B, HV, Tp], the initial state
    fp32 [B, HV, K, V]. Returns what that kernel returns with `states_t=True`: h [B, HV, NT, V, K] (the state at each
    chunk's start, transposed), v_new^T [B, HV, V, Tp] and the final state [B, HV, K, V]."""
    _check_shapes(w.shape[2], w.shape[3], u.shape[3], bv)
    h, vn_t, s_t = state_recurrence_mgpu_call(*mgpu_operands(w, u, kd, gc, initial_state), bv=bv,
                                              interpret=interpret)
    return h, vn_t, jnp.swapaxes(s_t, -1, -2)
