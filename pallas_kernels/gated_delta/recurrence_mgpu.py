"""The split design's state recurrence (`chunk._state_split_kernel`) as a Pallas Mosaic GPU kernel: the first
kernel off the deprecated Pallas Triton backend (`docs/mosaic_gpu.md`), and the chunked prefill's recurrence on a
Hopper GPU by default (`chunk.py`, config `recurrence`).

Dimension legend as in `reference.py`; C = 64 (the chunk), NT = Tp / C, BV = 64 (this kernel's V block: shared
memory holds no more).

Per program (grid (V // BV, HV, B)) and chunk c, with the state held transposed, S^T [BV, K] fp32:
  h[c]    = S^T                                  (the state at the chunk's start, stored as `states_t=True` has it)
  v_new^T = u^T - S^T w^T                        (= (u - w S)^T; one TF32 wgmma, M = BV, N = C, K = K)
  S^T     = exp(gc_last) S^T + v_new^T kd        (= (exp(gc_last) S + kd^T v_new)^T; one TF32 wgmma, M = BV, N = K,
                                                  K = C, accumulating into the decayed state)
The transposed form is what Mosaic GPU's TF32 wgmma takes (no transposed fp32 operands): both A operands (S^T,
v_new^T) come from shared memory K-major, and so do both B operands (w [C, K] as the prep stores it; kd^T [K, C],
transposed on its way into shared memory). The kernel reads the Triton recurrence's inputs in their layouts (w and kd
in fp16 as the prep stores them on the GPU, converted in shared memory while a dot runs; u [Tp, V] read transposed) and
writes its outputs in the layouts the output kernel reads.

Three forms (`warp_specialised`, chunk config `recurrence_ws`): one warpgroup per program (False: `_kernel`),
converting w and kd in shared memory between its own dots; or two (`_kernel_ws`), a producer warpgroup loading and
converting w and kd (True), and also transposing u ("u", the default), while the consumer warpgroup runs the chain.
The same arithmetic, the same bits (run 130); "u" takes 0.85-0.94x the one-warpgroup form's time (BENCHMARKS.md).
(A form holding the state untransposed, S [K, 32], so that V blocks of 32 fit and small grids get twice the
programs — chunk config `recurrence_form="s"` — took 1.02-1.03x the default's prefill time at B = 1 on an H100 with
the same bits, runs 179-182; removed on 2026-12-06, branch experiment/s50-s-form-prep-chunks has it.)
`state_recurrence_output_intra_mgpu` runs the `True` form with the output computed in the kernel instead of h and
v_new stored, its qg and Aqk computed on the producer warpgroup or (the default) on a third warpgroup of their own
(`_kernel_ws`'s `intra` and `intra_warpgroup`; config `output="fused_intra"`, and the prefill's default on grids of
at least 128 programs: `chunk._output_in_recurrence`). (An earlier form
read qg and Aqk from memory, written by a kernel of their own: config `output="fused"`, run 163; removed on
2026-12-06, commit 45423e3 has it.)

Why the bits equal the Triton recurrence's (checked on the H200: `scripts/gpu_mgpu_recurrence.py`, BENCHMARKS.md
runs 126-130): every element is the same products summed over the same axis in the same k order by TF32 wgmma
instructions in both, only with the operands' roles swapped (run 74 had found a swapped dot giving the same bits in
Triton); Triton rounds fp32 operands to TF32 to nearest (`cvt.rna.tf32.f32`) while Mosaic GPU hands them to the
hardware, which truncates (runs 106-108), so S^T and v_new^T are rounded to nearest here before they reach shared
memory (fp16 w and kd are TF32 values already); the decayed state is the accumulator the second dot adds into, as
Triton feeds it; exp is Mosaic GPU's exact one (run 108: Triton's bits).
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


def _rows(c):
    """Chunk c's rows of a [.., Tp, ..] array."""
    return pl.ds(c * CHUNK, CHUNK)


def _chunks_run(lengths, nt: int):
    """The chunks a row of `lengths` tokens runs under `skip` (`state_recurrence_output_intra_mgpu`'s `lengths`): up
    to the last one holding a token, at least one, at most nt (a scalar in the kernel, [B] in its caller)."""
    return jnp.maximum(1, jnp.minimum(nt, (lengths + CHUNK - 1) // CHUNK))


def _kernel(w_gmem, u_gmem, kd_gmem, gc_gmem, s0_gmem, h_gmem, vn_gmem, sf_gmem,
            w16_s, w_s, kd16_s, kd_s, u_s, gc_s, sa_s, va_s, h_s, vn_s, bars, *, nt: int, bv: int, interpret: bool):
    """One program: V block j of value head h of row b, every chunk in order (module docstring). GMEM refs, the
    Triton recurrence's layouts: w, kd fp16 [B, HV, Tp, K] (as the prep stores them), u fp32 [B, HV, Tp, V], gc fp32
    [B, HV, Tp], S0 fp32 [B, HV, K, V]; outputs h [B, HV, NT, V, K], v_new^T [B, HV, V, Tp] and the final S^T
    [B, HV, V, K].

    Per chunk c the loads of chunk c + 1 are in flight (TMA) while c computes; w and kd arrive in fp16 and are
    converted to fp32 (TF32 values) in shared memory, each while a dot runs that does not read its buffer: kd(c)
    during the first dot of c, w(c + 1) during the second (w(0) before the loop)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    j, hv, b = lax.axis_index("j"), lax.axis_index("h"), lax.axis_index("b")
    cols = pl.ds(j * bv, bv)
    out = _Stores(h_gmem, vn_gmem, sa_s, va_s, h_s, vn_s, b, hv, cols)
    w_bar, kd_bar, u_bar, gc_bar, s0_bar = (bars.at[i] for i in range(5))

    def load_w(c):
        plgpu.copy_gmem_to_smem(w_gmem.at[b, hv, _rows(c), :], w16_s, w_bar)

    def load_kd(c):
        plgpu.copy_gmem_to_smem(kd_gmem.at[b, hv, _rows(c), :], kd16_s, kd_bar)

    def load_u_gc(c):
        plgpu.copy_gmem_to_smem(u_gmem.at[b, hv, _rows(c), cols], u_s, u_bar)
        plgpu.copy_gmem_to_smem(gc_gmem.at[b, hv, _rows(c)], gc_s, gc_bar)

    def convert_w(wait=True):  # w [C, K] as the first dot's B operand (K-major as stored; fp16 values are TF32's)
        if wait:
            plgpu.barrier_wait(w_bar)
        w_s[...] = w16_s[...].astype(jnp.float32)

    def convert_kd():  # kd^T [K, C] as the second dot's B operand
        plgpu.barrier_wait(kd_bar)
        kd_s[...] = kd16_s.T[...].astype(jnp.float32)

    plgpu.copy_gmem_to_smem(s0_gmem.at[b, hv, :, cols], kd_s, s0_bar)  # S0 [K, BV], through kd^T's buffer
    load_w(0)
    load_kd(0)
    load_u_gc(0)
    plgpu.barrier_wait(s0_bar)
    s_init = plgpu.layout_cast(kd_s.T[...], plgpu.Layout.WGMMA)  # S0^T [BV, K]
    convert_w()

    def body(c, s):
        more = c + 1 < nt
        out.h(c, s)  # (its commit also covers w(c)'s conversion, every read of w's staging buffer and, at c = 0, S0)

        load_w(lax.select(more, c + 1, c))  # (the last chunk loads its own again: every dot's conversion waits)

        def ws_dot(acc):
            plgpu.wgmma(acc, sa_s, w_s.T)  # S^T w^T = (w S)^T [BV, C]
            convert_kd()  # kd(c), while the dot runs (the second dot of c - 1, which read kd_s, is done)
            return acc[...]  # (reading waits for the wgmma)

        ws = pl.run_scoped(ws_dot, plgpu.ACC((bv, CHUNK), jnp.float32))
        plgpu.barrier_wait(u_bar)
        v = plgpu.layout_cast(u_s.T[...], plgpu.Layout.WGMMA) - ws  # v_new^T [BV, C]
        plgpu.barrier_wait(gc_bar)
        decay = jnp.exp(lax.broadcast_in_dim(gc_s[CHUNK - 1], s.shape, ()))
        out.v_new(c, v)  # (its commit also covers kd(c)'s conversion, every read of u, gc and kd's staging buffers)

        @pl.when(more)
        def _():
            load_u_gc(c + 1)
            load_kd(c + 1)

        plgpu.barrier_wait(w_bar)  # (here: a barrier's index does not lower inside run_state, jax 0.11.2)

        def kv_dot(acc):
            plgpu.wgmma(acc, va_s, kd_s.T)  # += v_new^T kd = (kd^T v_new)^T [BV, K]
            convert_w(wait=False)  # w(c + 1), while the dot runs (the first dot of c, which read w_s, is done)

        return _decayed_plus(kv_dot, s, decay, interpret)

    _store_final(lax.fori_loop(0, nt, body, s_init), h_s, sf_gmem.at[b, hv, cols, :])


class _Stores:
    """How a program hands on S^T (the state at chunk c's start) and v_new[c]^T: each rounded to TF32 to nearest into
    its dot's A operand buffer (`sa_s`, `va_s`), and, unrounded, out through a buffer of its own (`h_s`, `vn_s`) to h
    and v_new in memory, as the Triton recurrence stores them. With no outputs for them (`h_gmem` None: the output
    computed in the kernel, `_kernel_ws`'s `intra`) the operands only.

    Each store is a TMA bulk group; a buffer is written again once at most one group (the last one issued, which
    never reads it) is pending: `wait_smem_to_gmem(1)` before each write. Each method ends with its shared-memory
    writes committed. (Run 158 measured h and v_new stored from the rounded buffers instead, 48 KiB less written per
    chunk: the same bits downstream but no faster in the prefill, run 159; removed, BENCHMARKS.md.)"""

    def __init__(self, h_gmem, vn_gmem, sa_s, va_s, h_s, vn_s, b, hv, cols):
        self.h_gmem, self.vn_gmem = h_gmem, vn_gmem
        self.sa_s, self.va_s, self.h_s, self.vn_s = sa_s, va_s, h_s, vn_s
        self.b, self.hv, self.cols = b, hv, cols

    def h(self, c, s):
        """S^T [BV, K] at chunk c's start: the first dot's operand and h[c]."""
        self._hand_on(s, self.sa_s, self.h_s,
                      None if self.h_gmem is None else self.h_gmem.at[self.b, self.hv, c, self.cols, :])

    def v_new(self, c, v):
        """v_new^T [BV, C] of chunk c: the second dot's operand and v_new[c]^T."""
        self._hand_on(v, self.va_s, self.vn_s, None if self.vn_gmem is None
                      else self.vn_gmem.at[self.b, self.hv, self.cols, pl.ds(c * CHUNK, CHUNK)])

    @staticmethod
    def _hand_on(x, operand_s, own_s, dst):
        """x rounded into `operand_s`; unrounded through `own_s` to `dst` (a GMEM slice) unless `dst` is None."""
        from jax.experimental.pallas import mosaic_gpu as plgpu

        if dst is not None:
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the previous store from own_s has read it
            own_s[...] = x
        operand_s[...] = _tf32_rna(x)
        plgpu.commit_smem()
        if dst is not None:
            plgpu.copy_smem_to_gmem(own_s, dst)


def _decayed_plus(kv_dot, s, decay, interpret: bool):
    """decay * S^T + the second dot (`kv_dot(acc)` issues it): on the GPU the decayed state is the wgmma's initial
    accumulator, as Triton feeds it; the CPU interpreter has no accumulator given a value, so there the add follows
    the dot."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if interpret:
        return s * decay + pl.run_scoped(lambda acc: (kv_dot(acc), acc[...])[1], plgpu.ACC(s.shape, jnp.float32))
    return pl.run_state(kv_dot)(plgpu.ACC.init(s * decay))


def _out_dots(*args):
    """`output_mgpu._out_dots` (imported here, where it is used: output_mgpu imports this module)."""
    from .output_mgpu import _out_dots as dots
    return dots(*args)


def _intra(*args, **kwargs):
    """`output_mgpu._intra` (imported here, where it is used, as `_out_dots` is)."""
    from .output_mgpu import _intra as intra
    return intra(*args, **kwargs)


def _store_final(s_final, h_s, dst):
    """The final S^T [BV, K] through h's buffer (once h[NT - 1]'s store has read it) to `dst`; waits for every store."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    plgpu.wait_smem_to_gmem(1, wait_read_only=True)
    h_s[...] = s_final
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(h_s, dst)
    plgpu.wait_smem_to_gmem(0)


def _kernel_ws(w_gmem, u_gmem, kd_gmem, gc_gmem, s0_gmem, *refs, nt: int, bv: int, interpret: bool,
               intra: bool = False, groups: int = 1, scale: float = 1.0, ck_per: int = 0,
               intra_warpgroup: bool = False, registers: tuple[int, int, int] | None = None, skip: bool = False):
    """`_kernel`'s arithmetic on two warpgroups (`warp_specialised=True`): warpgroup 1 loads w and kd and converts
    them to fp32 in shared memory, so that warpgroup 0 runs the recurrence's chain without the conversions in it.
    The same buffers as `_kernel`; `ready` ([w, kd], arrived by the producer when the fp32 buffer holds chunk c's
    operand) and `free` ([w, kd], arrived by the consumer when the dot that read it is done, and for kd once more
    after S0, which arrives through kd's fp32 buffer, is in registers) hand the two fp32 buffers back and forth, so
    the producer converts w(c + 1) while the consumer finishes chunk c and kd(c + 1) while it starts chunk c + 1.

    With `ut` (`warp_specialised="u"`: ut_s [BV, C] fp32 and gc_s [2, C]) the producer also loads u and gc and
    transposes u into ut_s, which the consumer reads untransposed (`ready` / `free` gain a third barrier for it; gc
    alternates between two slots, so that gc(c + 1) can land while the consumer has yet to read gc(c)).

    `intra` (`state_recurrence_output_intra_mgpu`; the `True` form, no `ut`): the output computed in the kernel
    instead of h and v_new stored. Per chunk, after its second dot, the consumer computes o = qg S_c + Aqk v_new
    from qg and Aqk and the rounded S^T and v_new^T its own dots read (sa_s, va_s), as `output_mgpu._out_dots` does
    in the output kernel, and stores it; qg and Aqk are computed by the producer (`output_mgpu._intra`, the output
    kernel's own code, for value head hv's key head hv // `groups`, q scaled by `scale`). The refs after the
    inputs are then q, k [B, Tp, HK, K] (16-bit), r_q, r_k fp32 [B, HK, Tp] (`output_mgpu.key_norms`; in), the
    final state and o [B, Tp, HV, V] (out), and the buffers: the `True` form's, with qg held in
    w's fp32 buffer (free from chunk c's first dot until w(c + 1) is written, which waits for c's output dots), then
    aqk_s, o_s, q as loaded, k as loaded in a `RefUnion` with its 16-bit copy for q k^T, the producer's own r_q,
    r_k and gc(c); `ready` and `free` gain a third barrier (qg and Aqk of c written; the output dots of c done); the
    final state leaves through w's buffer. With
    `ck_per` (> 0) an output after o, ck [B, HV, M, V, K], takes the exact state S^T at the start of every chunk
    c = m ck_per (0 < c < NT; M = (NT - 1) // ck_per), as h[c] holds it: written unrounded through sa_s and stored
    before sa_s takes the rounded S^T (the consumer waits for that store to read it).

    `intra_warpgroup` (with `intra`): three warpgroups; warpgroup 1 converts w and kd only (the `True` form's
    producer, w(c) written once c - 1's output dots are done with w's buffer), warpgroup 2 loads q, k, the norms and
    gc and computes qg and Aqk, writing Aqk(c) once c - 1's output dots are done and qg(c) once c's first dot is done
    with w's buffer. The same buffers, barriers and arithmetic; only which warpgroup runs what. `registers`:
    (consumer, warpgroup 2, warpgroup 1) registers per thread (`setmaxnreg`: `REGISTER_SPLIT_RULE`), or None
    (no `setmaxnreg`: every warpgroup gets what ptxas allots for 384 threads, at most 168 each).

    `skip` (with `intra`): an input after r_k, the rows' lengths int32 [B]; a program runs its row's chunks up to the
    last one holding a token (at least one) and stores zeros as the output of the chunks after them (padding only,
    where the full loop's updates would leave the state as it is and its outputs are zeros); the checkpoints of those
    chunks are not stored (the caller takes the final state for them)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if intra:
        q_gmem, k_gmem, rq_gmem, rk_gmem, *refs = refs
        len_gmem = refs.pop(0) if skip else None
        sf_gmem, o_gmem, *refs = refs
        ck_gmem = refs.pop(0) if ck_per else None
        (w16_s, w_s, kd16_s, kd_s, u_s, gc_s, sa_s, va_s, aqk_s, o_s, q_s, k_union, rq_s, rk_s, gcp_s, bars,
         ready, free) = refs
        k_s, k16_s = k_union
        qg_s = w_s
        h_gmem = vn_gmem = h_s = vn_s = None
        ut = []
    else:
        (h_gmem, vn_gmem, sf_gmem, w16_s, w_s, kd16_s, kd_s, u_s, gc_s, sa_s, va_s, h_s, vn_s, bars, ready, free,
         *ut) = refs
    j, hv, b = lax.axis_index("j"), lax.axis_index("h"), lax.axis_index("b")
    wg = lax.axis_index("wg")
    # the chunks this program runs: all nt, or with `skip` its row's up to the last one holding a token (at least one)
    nt_run = _chunks_run(len_gmem[b], nt) if skip else nt
    cols = pl.ds(j * bv, bv)
    out = _Stores(h_gmem, vn_gmem, sa_s, va_s, h_s, vn_s, b, hv, cols)
    w_bar, kd_bar, u_bar, gc_bar, s0_bar = (bars.at[i] for i in range(5))
    w_ready, kd_ready = ready.at[0], ready.at[1]
    w_free, kd_free = free.at[0], free.at[1]
    if intra:
        intra_bars = tuple(bars.at[i] for i in range(5, 10))  # q, k, r_q, r_k, gc (the producer's)
        intra_ready, out_free = ready.at[2], free.at[2]
        hk = hv // groups

        def load_intra(c):
            srcs = (q_gmem.at[b, rows(c), hk, :], k_gmem.at[b, rows(c), hk, :], rq_gmem.at[b, hk, rows(c)],
                    rk_gmem.at[b, hk, rows(c)], gc_gmem.at[b, hv, rows(c)])
            for src, dst, bar in zip(srcs, (q_s, k_s, rq_s, rk_s, gcp_s), intra_bars):
                plgpu.copy_gmem_to_smem(src, dst, bar)
    ut_s = ut[0] if ut else None
    if ut:
        u_ready, u_free = ready.at[2], free.at[2]

    rows = _rows

    def load_u_gc(c):
        plgpu.copy_gmem_to_smem(u_gmem.at[b, hv, rows(c), cols], u_s, u_bar)
        plgpu.copy_gmem_to_smem(gc_gmem.at[b, hv, rows(c)], gc_s.at[c % 2] if ut else gc_s, gc_bar)

    def convert_kd_then_load(c, more):  # (the producers') kd(c) into kd^T's fp32 buffer, then kd(c + 1)'s load
        plgpu.barrier_wait(kd_bar)
        plgpu.barrier_wait(kd_free)  # the consumer's second dot of c - 1 (at c = 0: its read of S0) is done
        kd_s[...] = kd16_s.T[...].astype(jnp.float32)  # kd^T [K, C]
        plgpu.commit_smem()
        plgpu.barrier_arrive(kd_ready)

        @pl.when(more)
        def _():
            plgpu.copy_gmem_to_smem(kd_gmem.at[b, hv, rows(c + 1), :], kd16_s, kd_bar)

    def convert_w_then_load(c, more):  # (the `intra` producers') w(c) into w's fp32 buffer, then w(c + 1)'s load
        plgpu.barrier_wait(w_bar)
        w = w16_s[...].astype(jnp.float32)  # w [C, K] (fp16 values are TF32's)

        @pl.when(c > 0)
        def _():
            plgpu.barrier_wait(out_free)  # the output dots of c - 1 are done with w_s (qg) and aqk_s

        w_s[...] = w
        plgpu.commit_smem()
        plgpu.barrier_arrive(w_ready)

        @pl.when(more)
        def _():
            plgpu.copy_gmem_to_smem(w_gmem.at[b, hv, rows(c + 1), :], w16_s, w_bar)

    def intra_then_load(c):  # (the `intra` producers') qg, Aqk of chunk c, whose loads were issued; then c + 1's loads
        qg, aqk = _intra(q_s, k_s, rq_s, rk_s, gcp_s, k16_s, intra_bars, scale, interpret=interpret, aliased=True)
        plgpu.commit_smem()  # every thread has read q, k, the norms and gc (and the q k^T wgmma is done)
        load_intra(jnp.minimum(c + 1, nt_run - 1))
        return qg, aqk

    def hand_on_qg(c, qg):  # (the `intra` producers') qg(c) into w's buffer once c's first dot is done with it;
        plgpu.barrier_wait(w_free)  # then qg and Aqk of chunk c + 1
        qg_s[...] = qg
        plgpu.commit_smem()
        plgpu.barrier_arrive(intra_ready)
        return intra_then_load(jnp.minimum(c + 1, nt_run - 1))

    def _intra_producer():
        """The producer of the `intra` form, a chunk ahead: qg(c + 1) and Aqk(c + 1) are computed (in registers) while
        the consumer finishes chunk c; w(c + 1) and Aqk(c + 1) are written once c's output dots are done with w_s
        (where qg(c) is) and aqk_s, kd(c + 1) once c's second dot is done with kd_s, qg(c + 1) once the first dot of
        c + 1 is done with w_s. The loads of chunk c + 2's q, k, norms and gc follow the computation of c + 1 (the
        last chunk is loaded and computed again at the end: every load is waited for)."""
        plgpu.copy_gmem_to_smem(w_gmem.at[b, hv, rows(0), :], w16_s, w_bar)
        plgpu.copy_gmem_to_smem(kd_gmem.at[b, hv, rows(0), :], kd16_s, kd_bar)
        load_intra(0)

        def body(c, qg_aqk):
            qg, aqk = qg_aqk
            more = c + 1 < nt_run
            convert_w_then_load(c, more)
            aqk_s[...] = aqk
            convert_kd_then_load(c, more)
            return hand_on_qg(c, qg)

        lax.fori_loop(0, nt_run, body, intra_then_load(0))
        for bar in intra_bars:  # the last loads issued
            plgpu.barrier_wait(bar)
        plgpu.barrier_wait(kd_free)
        plgpu.barrier_wait(out_free)

    def _producer():
        plgpu.copy_gmem_to_smem(w_gmem.at[b, hv, rows(0), :], w16_s, w_bar)
        plgpu.copy_gmem_to_smem(kd_gmem.at[b, hv, rows(0), :], kd16_s, kd_bar)
        if ut:
            load_u_gc(0)

        @pl.loop(0, nt_run)
        def _(c):
            more = c + 1 < nt_run
            plgpu.barrier_wait(w_bar)

            @pl.when(c > 0)
            def _():
                plgpu.barrier_wait(w_free)  # the consumer's first dot of c - 1 is done with w_s

            w_s[...] = w16_s[...].astype(jnp.float32)  # w [C, K] (fp16 values are TF32's)
            plgpu.commit_smem()
            plgpu.barrier_arrive(w_ready)

            @pl.when(more)
            def _():
                plgpu.copy_gmem_to_smem(w_gmem.at[b, hv, rows(c + 1), :], w16_s, w_bar)

            if ut:
                plgpu.barrier_wait(u_bar)
                plgpu.barrier_wait(gc_bar)
                t = plgpu.layout_cast(u_s.T[...], plgpu.Layout.WGMMA)  # u^T [BV, C]

                @pl.when(c > 0)
                def _():
                    plgpu.barrier_wait(u_free)  # the consumer has read ut_s and gc(c - 1)

                ut_s[...] = t
                plgpu.commit_smem()
                plgpu.barrier_arrive(u_ready)

                @pl.when(more)
                def _():
                    load_u_gc(c + 1)

            convert_kd_then_load(c, more)

        plgpu.barrier_wait(w_free)  # the last chunk's dots (every arrival observed before the barriers go)
        plgpu.barrier_wait(kd_free)
        if ut:
            plgpu.barrier_wait(u_free)

    def _convert_producer():
        """Warpgroup 1 of the three-warpgroup `intra` form: w(c) into w's fp32 buffer once the output dots of c - 1
        are done with it (qg(c - 1) lives there), kd(c) into kd^T's once the second dot of c - 1 is done."""
        if registers:
            plgpu.set_max_registers(registers[2], action="decrease")
        plgpu.copy_gmem_to_smem(w_gmem.at[b, hv, rows(0), :], w16_s, w_bar)
        plgpu.copy_gmem_to_smem(kd_gmem.at[b, hv, rows(0), :], kd16_s, kd_bar)

        @pl.loop(0, nt_run)
        def _(c):
            more = c + 1 < nt_run
            convert_w_then_load(c, more)
            convert_kd_then_load(c, more)

        plgpu.barrier_wait(kd_free)  # the last chunk's (every arrival observed before the barriers go)
        plgpu.barrier_wait(out_free)

    def _intra_only_producer():
        """Warpgroup 2 of the three-warpgroup `intra` form: qg and Aqk a chunk ahead, as `_intra_producer` computes
        them, written once the buffers are free (Aqk(c) after c - 1's output dots, qg(c) after c's first dot)."""
        if registers:
            plgpu.set_max_registers(registers[1], action="increase")
        load_intra(0)

        def body(c, qg_aqk):
            qg, aqk = qg_aqk

            @pl.when(c > 0)
            def _():
                plgpu.barrier_wait(out_free)  # the output dots of c - 1 are done with aqk_s

            aqk_s[...] = aqk
            return hand_on_qg(c, qg)

        lax.fori_loop(0, nt_run, body, intra_then_load(0))
        for bar in intra_bars:  # the last loads issued
            plgpu.barrier_wait(bar)
        plgpu.barrier_wait(out_free)

    if intra_warpgroup:
        pl.when(wg == 1)(_convert_producer)
        pl.when(wg == 2)(_intra_only_producer)
    else:
        pl.when(wg == 1)(_intra_producer if intra else _producer)

    @pl.when(wg == 0)
    def _consumer():
        if registers:
            plgpu.set_max_registers(registers[0], action="increase")
        plgpu.copy_gmem_to_smem(s0_gmem.at[b, hv, :, cols], kd_s, s0_bar)  # S0 [K, BV], through kd^T's buffer
        if not ut:
            load_u_gc(0)
        plgpu.barrier_wait(s0_bar)
        s_init = plgpu.layout_cast(kd_s.T[...], plgpu.Layout.WGMMA)  # S0^T [BV, K]
        plgpu.barrier_arrive(kd_free)

        def body(c, s):
            if intra and ck_per:
                @pl.when(jnp.logical_and(c % ck_per == 0, c > 0))
                def _():  # the exact state at a checkpoint (sa_s is free: c - 1's output dots are done)
                    sa_s[...] = s
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(sa_s, ck_gmem.at[b, hv, c // ck_per - 1, cols, :])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            out.h(c, s)
            plgpu.barrier_wait(w_ready)

            def ws_dot(acc):
                plgpu.wgmma(acc, sa_s, w_s.T)  # S^T w^T = (w S)^T [BV, C]
                return acc[...]

            ws = pl.run_scoped(ws_dot, plgpu.ACC((bv, CHUNK), jnp.float32))
            plgpu.barrier_arrive(w_free)
            if ut:
                plgpu.barrier_wait(u_ready)
                v = plgpu.layout_cast(ut_s[...], plgpu.Layout.WGMMA) - ws  # v_new^T [BV, C]
                g_last = gc_s[c % 2, CHUNK - 1]
                plgpu.barrier_arrive(u_free)
            else:
                plgpu.barrier_wait(u_bar)
                v = plgpu.layout_cast(u_s.T[...], plgpu.Layout.WGMMA) - ws  # v_new^T [BV, C]
            if not ut:
                plgpu.barrier_wait(gc_bar)
                g_last = gc_s[CHUNK - 1]
            decay = jnp.exp(lax.broadcast_in_dim(g_last, s.shape, ()))
            out.v_new(c, v)

            if not ut:
                @pl.when(c + 1 < nt_run)
                def _():
                    load_u_gc(c + 1)

            plgpu.barrier_wait(kd_ready)

            def kv_dot(acc):
                plgpu.wgmma(acc, va_s, kd_s.T)  # += v_new^T kd = (kd^T v_new)^T [BV, K]

            if intra and not interpret:  # the second dot and the output's two in flight together, one wait for all
                plgpu.barrier_wait(intra_ready)

                def three_dots(accs):
                    acc_s, acc_o = accs
                    kv_dot(acc_s)
                    plgpu.wgmma(acc_o, qg_s, sa_s.T)  # o = qg S_c (onto zeros, as a fresh accumulator) ...
                    plgpu.wgmma(acc_o, aqk_s, va_s.T)  # ... + Aqk v_new: `_out_dots`' "h_acc" order

                s_next, o = pl.run_state(three_dots)((plgpu.ACC.init(s * decay),
                                                      plgpu.ACC.init(jnp.zeros((CHUNK, bv), jnp.float32))))
                plgpu.barrier_arrive(kd_free)
            else:
                s_next = _decayed_plus(kv_dot, s, decay, interpret)
                plgpu.barrier_arrive(kd_free)
                if intra:  # o = qg S_c + Aqk v_new [C, BV] from the chain's own rounded operands
                    plgpu.barrier_wait(intra_ready)
                    o = _out_dots(qg_s, sa_s, aqk_s, va_s, "h_acc", interpret)
            if intra:
                plgpu.barrier_arrive(out_free)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o(c - 1)'s store has read o_s
                o_s[...] = o.astype(o_s.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_s, o_gmem.at[b, rows(c), hv, cols])
            return s_next

        _store_final(lax.fori_loop(0, nt_run, body, s_init), qg_s if intra else h_s, sf_gmem.at[b, hv, cols, :])
        if skip:
            @pl.when(nt_run < nt)
            def _():  # the output of the chunks of padding only: zeros (o_s is free: every store has completed)
                o_s[...] = plgpu.layout_cast(jnp.zeros((CHUNK, bv), o_s.dtype), plgpu.Layout.WGMMA)
                plgpu.commit_smem()

                @pl.loop(nt_run, nt)
                def _(c):
                    plgpu.copy_smem_to_gmem(o_s, o_gmem.at[b, rows(c), hv, cols])

                plgpu.wait_smem_to_gmem(0)


def _smem(*shape, dtype=jnp.float32):
    """A shared-memory buffer swizzled as the wgmma takes its operands (128-byte rows; narrower at tiny K)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    swizzle = min(_SWIZZLE, shape[-1] * jnp.dtype(dtype).itemsize)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def _check_fp16(fn: str, w, kd) -> None:
    """w and kd arrive in fp16, as the prep stores them on the GPU (`chunk._wk_dtype`): fp32 staging buffers would not
    fit shared memory."""
    if w.dtype != jnp.float16 or kd.dtype != jnp.float16:
        raise ValueError(f"{fn}: w and kd must be fp16 (the prep's GPU storage, `chunk._wk_dtype`); got {w.dtype}, "
                         f"{kd.dtype}")


def _check_shapes(tp: int, K: int, V: int, bv: int) -> None:
    if tp % CHUNK or bv != 64 or V % bv or K % 32:
        raise ValueError(f"state_recurrence_mgpu: Tp ({tp}) must be a multiple of {CHUNK}, bv ({bv}) 64 (shared "
                         f"memory), V ({V}) a multiple of it and K ({K}) of 32")


def state_recurrence_mgpu(w, u, kd, gc, initial_state, *, bv: int = 64, warp_specialised: bool | str = "u",
                          interpret: bool = False):
    """The split design's recurrence on the Triton recurrence's inputs (`chunk._state_split_kernel`): w [B, HV, Tp, K]
    and kd [B, HV, Tp, K] in fp16 as the prep stores them on the GPU, u fp32 [B, HV, Tp, V], gc fp32 [B, HV, Tp], the
    initial state fp32 [B, HV, K, V]. Returns what that kernel returns with `states_t=True`: h [B, HV, NT, V, K]
    (the state at each chunk's start, transposed), v_new^T [B, HV, V, Tp] and the final state [B, HV, K, V].
    `warp_specialised`: the kernel's form (module docstring), False, True or "u" (default); the same bits."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    B, HV, tp, K = w.shape
    V = u.shape[-1]
    _check_shapes(tp, K, V, bv)
    _check_fp16("state_recurrence_mgpu", w, kd)
    nt = tp // CHUNK
    f32 = jnp.float32
    smem = _smem
    params = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    if warp_specialised not in (False, True, "u"):
        raise ValueError(f"state_recurrence_mgpu: warp_specialised is False, True or 'u', not {warp_specialised!r}")
    body, extra, gc_shape = _kernel, [], (CHUNK,)
    if warp_specialised:
        body = _kernel_ws
        n_bars = 3 if warp_specialised == "u" else 2
        extra = [plgpu.Barrier(num_barriers=n_bars), plgpu.Barrier(num_barriers=n_bars)]
        if warp_specialised == "u":
            extra.append(smem(bv, CHUNK))
            gc_shape = (2, CHUNK)
        params.update(num_threads=2, thread_name="wg")
    h, vn_t, s_t = plgpu.kernel(
        functools.partial(body, nt=nt, bv=bv, interpret=interpret),
        out_type=[jax.ShapeDtypeStruct((B, HV, nt, V, K), f32), jax.ShapeDtypeStruct((B, HV, V, tp), f32),
                  jax.ShapeDtypeStruct((B, HV, V, K), f32)],
        scratch_types=[smem(CHUNK, K, dtype=w.dtype), smem(CHUNK, K), smem(CHUNK, K, dtype=w.dtype), smem(K, CHUNK),
                       smem(CHUNK, bv), plgpu.SMEM(gc_shape, f32), smem(bv, K), smem(bv, CHUNK), smem(bv, K),
                       smem(bv, CHUNK), plgpu.Barrier(num_barriers=5), *extra],
        grid=(V // bv, HV, B),
        grid_names=("j", "h", "b"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **params,
    )(w, u.astype(f32), kd, gc.astype(f32), initial_state.astype(f32))
    return h, vn_t, jnp.swapaxes(s_t, -1, -2)


# The three-warpgroup kernel starts with 168 registers per thread (65536 / 384, in multiples of 8); `setmaxnreg`
# raises the consumer's and the qg / Aqk warpgroup's and lowers the w / kd warpgroup's. PTX leaves an increase below
# the current count, or a decrease above it, undefined.
# The split chunk config fused_registers="auto" takes with three warpgroups: the fastest of the five tried at
# (8, 4096, 16, 32) on an H100 (2026-12-06, BENCHMARKS.md runs 171-172: 2.414-2.415 ms against 2.439 for 216 / 216 /
# 72, 2.452 for 240 / 192 / 72, 2.425 for 224 / 208 / 72, 2.426 for 232 / 216 / 56, 2.605 with no split).
DEFAULT_REGISTER_SPLIT = (232, 200, 72)
REGISTER_SPLIT_RULE = ("three multiples of 8 (consumer, qg / Aqk warpgroup, w / kd warpgroup): the first two in "
                       "[168, 256], the third in [24, 168], adding up to at most 504")


def valid_register_split(registers) -> bool:
    """Whether `registers` is a (consumer, qg / Aqk, w / kd) split `setmaxnreg` can take (`REGISTER_SPLIT_RULE`)."""
    if not isinstance(registers, (tuple, list)) or len(registers) != 3:
        return False
    if any(type(r) is not int or r % 8 for r in registers):
        return False
    up, mid, down = registers
    return 168 <= up <= 256 and 168 <= mid <= 256 and 24 <= down <= 168 and up + mid + down <= 504


def state_recurrence_output_intra_mgpu(w, u, kd, gc, initial_state, q, k, r_q, r_k, *, scale: float, out_dtype,
                                       qk_dtype=jnp.float16, checkpoint_chunks: int | None = None, bv: int = 64,
                                       warpgroups: int = 2, registers: tuple[int, int, int] | None = None,
                                       lengths=None, interpret: bool = False):
    """The recurrence with the whole output computed inside it (`_kernel_ws`'s `intra`; the warp-specialised form
    without the producer's u transpose, for shared memory): w, u, kd, gc, initial_state as `state_recurrence_mgpu`
    takes them; h and v_new never go through memory; qg and Aqk are computed by a producer warpgroup from q, k
    [B, Tp, HK, K] (16-bit, as the prep reads them) and their norms' reciprocals r_q, r_k fp32 [B, HK, Tp]
    (`output_mgpu.key_norms`), with the output kernel's own code (`output_mgpu._intra`: `scale` on q, `qk_dtype` the
    q k^T operands). Returns (o [B, Tp, HV, V] in `out_dtype`, the final state fp32
    [B, HV, K, V]), and with `checkpoint_chunks` (n > 0) the exact state at the start of every chunk c = m n inside
    the call (0 < c < NT), fp32 [B, (NT - 1) // n, HV, K, V]: the states the unfused recurrence stores in h there.
    `warpgroups`: 2 (one producer warpgroup converts w and kd and computes qg and Aqk) or 3 (one for each:
    `_kernel_ws`'s `intra_warpgroup`), the same bits; `registers` (with 3): per-thread registers of the consumer, the
    qg / Aqk and the w / kd warpgroups (`setmaxnreg`), or None. (The prefill calls it with 3 and
    `DEFAULT_REGISTER_SPLIT` by default: chunk config `fused_warpgroups`, `fused_registers`.)
    `lengths` (int32 [B], or None: every chunk): a row's chunks past the last one holding a token (`_chunks_run`) are
    padding only, whose updates (the prep computes w = u = kd = 0, gc = 0 there) would leave the state as it is; they
    are neither loaded nor run — their outputs are stored as zeros and their checkpoints are the final state (chunk
    config `skip_padding`; the prep then leaves those chunks of w, u, kd and gc unwritten)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    B, HV, tp, K = w.shape
    V = u.shape[-1]
    HK = q.shape[2]
    _check_shapes(tp, K, V, bv)
    _check_fp16("state_recurrence_output_intra_mgpu", w, kd)
    if (q.shape != k.shape or q.shape[:2] != (B, tp) or q.shape[3] != K or HV % HK
            or r_q.shape != (B, HK, tp) or r_k.shape != r_q.shape or jnp.dtype(q.dtype).itemsize != 2):
        raise ValueError(f"state_recurrence_output_intra_mgpu: q, k must be 16-bit [{B}, {tp}, HK, {K}] with HK "
                         f"dividing {HV}, r_q, r_k [{B}, HK, {tp}]; got q {q.shape} {q.dtype}, k {k.shape}, r_q "
                         f"{r_q.shape}, r_k {r_k.shape}")
    if lengths is not None and (jnp.shape(lengths) != (B,) or jnp.result_type(lengths) != jnp.int32):
        raise ValueError(f"state_recurrence_output_intra_mgpu: lengths must be int32 [{B}] or None; got "
                         f"{jnp.shape(lengths)} {jnp.result_type(lengths)}")
    if jnp.dtype(qk_dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"state_recurrence_output_intra_mgpu: qk_dtype is float16 or bfloat16 (k's copy shares "
                         f"its memory), not {jnp.dtype(qk_dtype).name}")
    nt = tp // CHUNK
    if checkpoint_chunks is not None and (type(checkpoint_chunks) is not int or checkpoint_chunks < 1):
        raise ValueError(f"state_recurrence_output_intra_mgpu: checkpoint_chunks must be a positive int or None; got "
                         f"{checkpoint_chunks!r}")
    if warpgroups not in (2, 3):
        raise ValueError(f"state_recurrence_output_intra_mgpu: warpgroups is 2 or 3, not {warpgroups!r}")
    if registers is not None:
        registers = tuple(registers)
        if not valid_register_split(registers) or warpgroups != 3:
            raise ValueError(f"state_recurrence_output_intra_mgpu: registers is None or, with warpgroups=3, "
                             f"{REGISTER_SPLIT_RULE}; got {registers!r}")
    n_ck = (nt - 1) // checkpoint_chunks if checkpoint_chunks else 0
    per = checkpoint_chunks if n_ck else 0  # (none inside the call: the kernel stores none)
    f32 = jnp.float32
    params = dict(interpret=plgpu.InterpretGPUParams()) if interpret else {}
    vec = plgpu.SMEM((CHUNK,), f32)
    ck_type = [jax.ShapeDtypeStruct((B, HV, n_ck, V, K), f32)] if per else []
    s_t, o, *ck = plgpu.kernel(
        functools.partial(_kernel_ws, nt=nt, bv=bv, interpret=interpret, intra=True, groups=HV // HK,
                          scale=float(scale), ck_per=per, intra_warpgroup=warpgroups == 3, skip=lengths is not None,
                          registers=None if interpret else registers),
        out_type=[jax.ShapeDtypeStruct((B, HV, V, K), f32), jax.ShapeDtypeStruct((B, tp, HV, V), out_dtype),
                  *ck_type],
        scratch_types=[_smem(CHUNK, K, dtype=w.dtype), _smem(CHUNK, K), _smem(CHUNK, K, dtype=w.dtype),
                       _smem(K, CHUNK), _smem(CHUNK, bv), plgpu.SMEM((CHUNK,), f32), _smem(bv, K), _smem(bv, CHUNK),
                       _smem(CHUNK, CHUNK), _smem(CHUNK, bv, dtype=out_dtype),
                       _smem(CHUNK, K, dtype=q.dtype),
                       plgpu.RefUnion(_smem(CHUNK, K, dtype=k.dtype), _smem(CHUNK, K, dtype=qk_dtype)),
                       vec, vec, vec,
                       plgpu.Barrier(num_barriers=10), plgpu.Barrier(num_barriers=3), plgpu.Barrier(num_barriers=3)],
        grid=(V // bv, HV, B),
        grid_names=("j", "h", "b"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        num_threads=warpgroups, thread_name="wg",
        **params,
    )(w, u.astype(f32), kd, gc.astype(f32), initial_state.astype(f32), q, k, r_q, r_k,
      *([] if lengths is None else [lengths]))
    out = (o, jnp.swapaxes(s_t, -1, -2))
    if checkpoint_chunks is None:
        return out
    if not per:
        return out + (jnp.zeros((B, 0, HV, K, V), f32),)
    ck = jnp.swapaxes(ck[0], -1, -2).transpose(0, 2, 1, 3, 4)  # [B, M, HV, K, V]
    if lengths is not None:  # the checkpoints of chunks not run: the final state (not stored by the kernel)
        stored = (jnp.arange(1, n_ck + 1) * per)[None, :] < _chunks_run(lengths, nt)[:, None]  # [B, M]
        ck = jnp.where(stored[:, :, None, None, None], ck, out[1][:, None])
    return out + (ck,)
