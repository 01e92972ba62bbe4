"""The chunked prefill's output kernel as a Mosaic GPU kernel (`output_mgpu.py`, config `output="mosaic"`) and the
Triton kernel that hands it the L2 norms of q and k (`key_norms`): lowered for an H200 on CPU, and run in interpret
mode against the Triton output kernel (interpret mode) on the same recurrence outputs; plus the bitwise properties
(the same call twice, a row alone against the row in a batch) and the refusals. Whether its bits equal the Triton
kernel's is a GPU question (`scripts/gpu_mgpu_output.py`: they do with `output_order="h_acc"`, BENCHMARKS.md run
132); on CPU the Triton kernel's dots are fp32 and this kernel rounds its TF32 operands to nearest first, so they agree
within the tolerance below, not bit for bit.

Tolerance: relative (max-norm) error <= 2e-3 against the Triton kernel (fp32 outputs; TF32 rounding of qg, Aqk,
S and v_new, 2^-11 relative each, and q k^T on fp16 operands).
Shapes: K = V = 64, HV = 2 HK, T = 150 (three chunks, the last partly padding), rows of lengths 150, 97 and 5.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta import output_mgpu, wy
from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.output_mgpu import ORDERS, PADDED, chunk_output_mgpu, key_norms
from tests.gdn_oracle import random_gdn_inputs

K, V, HK, HV, T, TP = 64, 64, 1, 2, 150, 192
LENGTHS = [150, 97, 5]
TOL = 2e-3


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def prefill(d, lengths, checkpoint_stride=None, **config):
    return chunk_gated_delta_rule_pallas(
        *(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=jnp.asarray(d["initial_state"]),
        lengths=jnp.asarray(lengths, jnp.int32), checkpoint_stride=checkpoint_stride, interpret=True,
        config=dict(wk_dtype="float16", **config))


@pytest.fixture(scope="module")
def case():
    """bf16 q and k (the kernel takes 16-bit q and k), fp32 v (so fp32 outputs: the tolerance is not lost in bf16's
    rounding), realistic gates, a non-zero initial state; the recurrence's
    outputs (h, v_new^T) and gc from the Triton kernels, and q, k padded to the chunk grid."""
    d = random_gdn_inputs(np.random.default_rng(11), 3, T, HK, HV, K, V)
    for n in ("q", "k"):
        d[n] = np.asarray(jnp.asarray(d[n], jnp.bfloat16))
    _, _, _, gc = prefill(d, LENGTHS, stop_after="prep")
    h, vn, _ = prefill(d, LENGTHS, stop_after="state")
    pad = ((0, 0), (0, TP - T), (0, 0), (0, 0))
    q, k = (jnp.pad(jnp.asarray(d[n], jnp.bfloat16), pad) for n in ("q", "k"))
    return d, q, k, gc, h, vn


_run = jax.jit(functools.partial(chunk_output_mgpu, scale=K ** -0.5, out_dtype=jnp.bfloat16, interpret=True))
_norms = jax.jit(functools.partial(key_norms, warps=4, interpret=True))


def mgpu(q, k, gc, h, vn, lengths):
    r_q, r_k = _norms(q, k, jnp.asarray(lengths, jnp.int32))
    return np.asarray(_run(q, k, r_q, r_k, gc, h, vn))


@pytest.mark.parametrize("order,dim,out", [(o, 128, jnp.bfloat16) for o in ORDERS] + [("h_acc", 64, jnp.float32)])
def test_lowers_for_an_h200(order, dim, out):
    """The kernel lowers for CUDA (its wgmma shapes, layouts and shared memory are checked here) at the model's
    K = V = 128, in each order of adding its two dots, and at K = V = 64 with fp32 outputs (o in a buffer of its
    own; S_c rounded in one 64-row part)."""
    sds = jax.ShapeDtypeStruct
    B, tp, hk, hv = 2, 256, 2, 4
    args = (sds((B, tp, hk, dim), jnp.bfloat16), sds((B, tp, hk, dim), jnp.bfloat16), sds((B, hk, tp), jnp.float32),
            sds((B, hk, tp), jnp.float32), sds((B, hv, tp), jnp.float32), sds((B, hv, tp // 64, dim, dim), jnp.float32),
            sds((B, hv, dim, tp), jnp.float32))
    fn = jax.jit(functools.partial(chunk_output_mgpu, scale=dim ** -0.5, out_dtype=out, order=order))
    assert "mosaic_gpu" in fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_key_norms(case):
    """r = 1 / sqrt(|x|^2 + eps) for each real row, within 1e-6 of float64 (the row sums' order is the Triton output
    kernel's on the GPU; interpret mode cannot show it); PADDED past each row's length."""
    _, q, k, _, _, _ = case
    r_q, r_k = (np.asarray(x) for x in _norms(q, k, jnp.asarray(LENGTHS, jnp.int32)))
    for x, r in ((q, r_q), (k, r_k)):
        x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)[:, :, 0]
        want = 1.0 / np.sqrt(np.sum(x64 * x64, axis=-1) + wy.EPS)
        real = np.arange(TP)[None, :] < np.asarray(LENGTHS)[:, None]
        assert np.max(np.abs(r[:, 0][real] - want[real]) / want[real]) <= 1e-6
        assert np.all(r[:, 0][~real] == PADDED)


def test_matches_the_triton_output_kernel(case):
    """The whole prefill with output="mosaic" (interpret mode) against the Triton output kernel's: the same final
    state and checkpoints bit for bit (the recurrence is the same kernel), the outputs within the tolerance and not
    all equal (the TF32 rounding is there), padded rows exact zeros."""
    d, *_ = case
    o_m, final_m, ck_m = (np.asarray(x) for x in prefill(d, LENGTHS, output="mosaic", checkpoint_stride=64))
    o_t, final_t, ck_t = (np.asarray(x) for x in prefill(d, LENGTHS, checkpoint_stride=64))
    assert np.array_equal(final_m, final_t) and np.array_equal(ck_m, ck_t)
    assert np.all(np.isfinite(o_m.astype(np.float32)))
    assert rel(o_m, o_t) <= TOL, rel(o_m, o_t)
    assert not np.array_equal(o_m, o_t)
    assert np.all(o_m[1, 97:] == 0) and np.all(o_m[2, 5:] == 0)


def test_same_call_twice_and_row_alone_are_bitwise(case):
    _, q, k, gc, h, vn = case
    batch = mgpu(q, k, gc, h, vn, LENGTHS)
    assert np.array_equal(batch, mgpu(q, k, gc, h, vn, LENGTHS))
    alone = mgpu(q[1:2], k[1:2], gc[1:2], h[1:2], vn[1:2], LENGTHS[1:2])
    assert np.array_equal(alone, batch[1:2])


@pytest.mark.parametrize("kw,match", [(dict(order="sum"), "order"), (dict(qk_dtype=jnp.float32), "qk_dtype"),
                                      (dict(tp=100), "multiple of 64"), (dict(kdim=32), "64 or 128")])
def test_bad_inputs_are_refused(kw, match):
    tp, kdim = kw.pop("tp", 128), kw.pop("kdim", 64)
    q = jnp.zeros((1, tp, 1, kdim), jnp.bfloat16)
    r = jnp.zeros((1, 1, tp))
    with pytest.raises(ValueError, match=match):
        chunk_output_mgpu(q, q, r, r, jnp.zeros((1, 2, tp)), jnp.zeros((1, 2, max(tp // 64, 1), 64, kdim)),
                          jnp.zeros((1, 2, 64, tp)), scale=1.0, out_dtype=jnp.bfloat16, **kw)


@pytest.mark.parametrize("config,match", [({"output": "cuda"}, "output="), ({"output_order": "sum"}, "output_order="),
                                          ({"output": "mosaic", "states_t": False}, "states_t=True"),
                                          ({"output": "mosaic"}, "16-bit")])  # (fp32 q and k here)
def test_bad_output_configs_are_refused(config, match):
    d = random_gdn_inputs(np.random.default_rng(0), 1, 64, HK, HV, K, V)
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), interpret=True,
                                      config=config)


def test_auto_takes_the_triton_output_kernel_off_a_hopper_gpu(case):
    d, *_ = case
    auto = prefill(d, LENGTHS, output="auto")
    triton = prefill(d, LENGTHS)
    assert all(np.array_equal(np.asarray(a), np.asarray(t)) for a, t in zip(auto, triton))


def test_shared_memory_count_and_refusal():
    """`shared_memory_bytes` counts the kernel's buffers as Mosaic GPU does (1 KiB-aligned vectors, 8 bytes a
    barrier): at K = V = 128 with bf16 q and outputs (o through q's buffer) they fit the H200's 232448 bytes; with fp32
    outputs (o in a buffer of its own) they come to 232504, the count the H200 refused in run 132 (for the kernel of
    then, whose 16-bit copy of q took the bytes a bf16 o buffer takes now), so output="mosaic" is refused there."""
    bf16 = jnp.bfloat16
    tiles = 64 * 128 * (2 + 2 + 2 + 4) + 4 * 128 * 128 + 4 * 128 * 64 + 4 * 64 * 64  # q, k, k~, qg; S_c, v_new, Aqk
    assert output_mgpu.shared_memory_bytes(128, 128, bf16, bf16) == tiles + 3 * 1024 + 7 * 8
    assert output_mgpu.shared_memory_bytes(128, 128, bf16, bf16) <= output_mgpu.SMEM_BYTES
    assert output_mgpu.shared_memory_bytes(128, 128, bf16, jnp.float32) == tiles + 64 * 128 * 4 + 3 * 1024 + 7 * 8
    assert output_mgpu.shared_memory_bytes(128, 128, bf16, jnp.float32) == 232504 > output_mgpu.SMEM_BYTES
    d = random_gdn_inputs(np.random.default_rng(0), 1, 64, 1, 2, 128, 128)
    q, k = (jnp.asarray(d[n], bf16) for n in ("q", "k"))
    v, g, beta = (jnp.asarray(d[n]) for n in ("v", "g", "beta"))  # v in fp32: fp32 outputs
    with pytest.raises(ValueError, match="out_dtype=float32"):
        chunk_gated_delta_rule_pallas(q, k, v, g, beta, interpret=True, config={"output": "mosaic"})
    chunk_gated_delta_rule_pallas(q, k, v.astype(bf16), g, beta, interpret=True, config={"output": "mosaic"})


def test_output_fused_into_the_recurrence_is_the_mosaic_output_kernels(case):
    """config output="fused_intra": the output, its qg and Aqk (by the producer warpgroup) computed inside the Mosaic
    GPU recurrence (`state_recurrence_output_intra_mgpu`) from the recurrence's own rounded S^T and v_new^T. It gives
    the outputs and final states of the Mosaic GPU recurrence and output kernels (the same arithmetic on the same
    operands), bitwise in interpret mode, and within TOL of the default prefill. It stores in-call checkpoints itself
    (the exact state at their chunks' starts) and keeps computing the output inside: its outputs, final states and
    checkpoints equal the unfused Mosaic GPU kernels' bit for bit, a checkpoint at the call's end (T = 128 with
    stride 64: the final state) included."""
    d = case[0]
    FUSED = dict(recurrence="mosaic", output="fused_intra")
    fused = [np.asarray(x) for x in prefill(d, LENGTHS, **FUSED)]
    unfused = [np.asarray(x) for x in prefill(d, LENGTHS, recurrence="mosaic", output="mosaic")]
    assert all(np.array_equal(a, b) for a, b in zip(fused, unfused))
    ref = [np.asarray(x) for x in prefill(d, LENGTHS)]
    assert rel(fused[0][:, :T], ref[0]) <= TOL and rel(fused[1], ref[1]) <= TOL
    unfused = dict(recurrence="mosaic", output="mosaic")
    with_ck = [np.asarray(x) for x in prefill(d, LENGTHS, checkpoint_stride=64, **FUSED)]
    want = [np.asarray(x) for x in prefill(d, LENGTHS, checkpoint_stride=64, **unfused)]
    assert with_ck[2].shape == (3, 2, HV, K, V)
    assert all(np.array_equal(a, b) for a, b in zip(with_ck, want))
    first = dict({n: d[n][:, :128] for n in ("q", "k", "v", "g", "beta")}, initial_state=d["initial_state"])
    lengths = [min(n, 128) for n in LENGTHS]
    with_ck = [np.asarray(x) for x in prefill(first, lengths, checkpoint_stride=64, **FUSED)]
    want = [np.asarray(x) for x in prefill(first, lengths, checkpoint_stride=64, **unfused)]
    assert with_ck[2].shape == (3, 2, HV, K, V) and np.array_equal(with_ck[2][:, 1], with_ck[1])
    assert all(np.array_equal(a, b) for a, b in zip(with_ck, want))


def test_fused_kernel_on_three_warpgroups_is_the_two_warpgroup_kernel(case):
    """config fused_warpgroups=3 (default): qg and Aqk computed on a warpgroup of their own, w and kd converted on
    another (`_kernel_ws`'s `intra_warpgroup`): the outputs, final states and in-call checkpoints of the two-warpgroup
    form, bit for bit in interpret mode (where `fused_registers` does not apply); fused_registers="auto" (default) is
    `DEFAULT_REGISTER_SPLIT` with three warpgroups and none with two; a bad register split is refused."""
    from pallas_kernels.gated_delta import chunk
    from pallas_kernels.gated_delta.recurrence_mgpu import DEFAULT_REGISTER_SPLIT

    d = case[0]
    FUSED = dict(recurrence="mosaic", output="fused_intra")
    for stride in (None, 64):
        two = [np.asarray(x) for x in prefill(d, LENGTHS, checkpoint_stride=stride, fused_warpgroups=2, **FUSED)]
        three = [np.asarray(x) for x in prefill(d, LENGTHS, checkpoint_stride=stride, fused_registers=[216, 216, 72],
                                                **FUSED)]
        assert len(two) == len(three) == (2 if stride is None else 3)
        assert all(np.array_equal(a, b) for a, b in zip(two, three)), stride
    regs = lambda **cfg: chunk._fused_registers(chunk._checked_config(cfg, 128))  # noqa: E731
    assert regs() == DEFAULT_REGISTER_SPLIT == (232, 200, 72) and regs(fused_warpgroups=2) is None
    assert regs(fused_registers=[216, 216, 72]) == (216, 216, 72) and regs(fused_registers=None) is None
    for bad, wgs in (([216, 216, 80], 3), ([216, 216, 70], 3), ([216, 216, 72], 2), ([256, 16, 232], 3),
                     ([256, 144, 104], 3), ([160, 168, 168], 3), ([168, 160, 176], 3)):  # (increases below 168)
        with pytest.raises(ValueError, match="fused_registers"):
            prefill(d, LENGTHS, fused_warpgroups=wgs, fused_registers=bad, **FUSED)
    with pytest.raises(ValueError, match="fused_warpgroups"):
        prefill(d, LENGTHS, fused_warpgroups=4, **FUSED)


def test_output_fused_row_alone_and_split_on_the_grid(case):
    """The fused kernel's bitwise properties: a row alone equals the row in the batch, and a prefill split at 128
    (on the grid; the second call continuing from the first's final state) equals the unsplit call's outputs and
    final state."""
    d = case[0]
    FUSED = dict(recurrence="mosaic", output="fused_intra")
    batch = [np.asarray(x) for x in prefill(d, LENGTHS, **FUSED)]
    one = {n: d[n][1:2] for n in ("q", "k", "v", "g", "beta", "initial_state")}
    alone = [np.asarray(x) for x in prefill(one, LENGTHS[1:2], **FUSED)]
    assert np.array_equal(alone[0], batch[0][1:2]) and np.array_equal(alone[1], batch[1][1:2])
    first = {n: d[n][:, :128] for n in ("q", "k", "v", "g", "beta")}
    o1, s1 = prefill(dict(first, initial_state=d["initial_state"]), [min(n, 128) for n in LENGTHS], **FUSED)
    rest = {n: d[n][:, 128:] for n in ("q", "k", "v", "g", "beta")}
    o2, s2 = prefill(dict(rest, initial_state=np.asarray(s1)), [max(n - 128, 0) for n in LENGTHS], **FUSED)
    for r, n in enumerate(LENGTHS):
        got = np.concatenate([np.asarray(o1)[r], np.asarray(o2)[r]])[:n]
        assert np.array_equal(got, batch[0][r, :n]), r
    assert np.array_equal(np.asarray(s2), batch[1])


@pytest.mark.parametrize("wgs", [3, 2])
def test_skip_padding_in_the_fused_kernel_changes_no_bit(wgs, monkeypatch):
    """Config skip_padding with the output inside the recurrence: a program runs its row's chunks up to the last one
    holding a token, stores zeros as the output of the chunks after it and the caller takes the final state as their
    checkpoints; the prep before it leaves the chunks of padding after a row's first unwritten (asked of it here:
    `padding_read=False`; interpret mode fills what a kernel leaves unwritten with NaN, so a read of one would show).
    Rows of lengths 128 (two of four chunks run), 100, 0 (one chunk run), 165 and 256 (all run), NaN in the padding:
    the outputs, final states and checkpoints (every chunk) equal the full loop's as bytes (a zero's sign counts), on
    three warpgroups and on two."""
    from pallas_kernels.gated_delta import chunk

    d = random_gdn_inputs(np.random.default_rng(5), 5, 256, HK, HV, K, V, beta_kind="mixed")
    for n in ("q", "k"):
        d[n] = np.array(jnp.asarray(d[n], jnp.bfloat16))
    lengths = [128, 100, 0, 165, 256]
    for r, n in enumerate(lengths):
        for name in ("q", "k", "v", "g"):
            d[name][r, n:] = np.nan
    asked, prep_one_call = [], chunk._prep_one_call

    def spy(*args, **kwargs):
        asked.append(kwargs["padding_read"])
        return prep_one_call(*args, **kwargs)

    monkeypatch.setattr(chunk, "_prep_one_call", spy)
    got = {skip: [np.asarray(x) for x in prefill(d, lengths, checkpoint_stride=64, recurrence="mosaic",
                                                 output="fused_intra", fused_warpgroups=wgs, skip_padding=skip)]
           for skip in (False, True)}
    assert asked == [True, False]  # (traced once each: the first calls of these configurations in the process)
    for name, a, b in zip(("o", "final", "checkpoints"), got[False], got[True]):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), name
    assert np.isfinite(got[True][1]).all() and np.isfinite(got[True][2]).all()
    assert not got[True][0][0, 128:].any() and not got[True][0][2].any()  # the chunks not run: zeros


def test_prep_leaves_padding_unwritten_past_a_rows_first_chunk_where_asked():
    """`chunk._prep_one_call(padding_read=False)` (the prep before the fused recurrence under skip_padding): a chunk
    of padding only is written (as zeros) where it is its row's first, since the fused recurrence runs at least one
    chunk of every row, and left unwritten after it (NaN here: interpret mode's fill); every chunk holding a token is
    the same bytes as with padding_read=True (which writes zeros in every chunk of padding)."""
    from pallas_kernels.gated_delta import chunk

    d = random_gdn_inputs(np.random.default_rng(8), 3, 256, HK, HV, K, V, beta_kind="mixed")
    x = [jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")]
    lengths = jnp.asarray([0, 70, 256], jnp.int32)
    cfg = chunk._checked_config({"wk_dtype": "float16"}, V)
    outs = {read: [np.asarray(a) for a in chunk._prep_one_call(*x, lengths, use_l2=True, interpret=True, cfg=cfg,
                                                                padding_read=read)] for read in (True, False)}
    for name, full, part in zip(("w", "u", "kd", "gc"), outs[True], outs[False]):
        live = [(0, slice(0, 64)), (1, slice(0, 128)), (2, slice(0, 256))]  # (row, tokens of its chunks run)
        for r, rows in live:
            assert np.array_equal(full[r, :, rows].view(np.uint8), part[r, :, rows].view(np.uint8)), (name, r)
        assert not full[0].any() and not full[1, :, 128:].any(), name  # padding_read=True: zeros
        assert np.isnan(part[0, :, 64:]).all() and np.isnan(part[1, :, 128:]).all(), name  # not written


def test_fused_kernel_lowers_for_an_h200_at_the_models_head_size():
    """The recurrence that computes the output, its qg and Aqk inside lowers for CUDA at K = V = 128, bf16 q, k and
    outputs, with and without in-call checkpoints, on two warpgroups and on three (with a register split) (the
    shared-memory budget, which the lowering checks: ~219 KiB, q and k unioned with their fp16 copies and qg held in
    w's buffer)."""
    from pallas_kernels.gated_delta.recurrence_mgpu import state_recurrence_output_intra_mgpu

    sds = jax.ShapeDtypeStruct
    B, H, T, D = 2, 4, 256, 128
    rec = (sds((B, H, T, D), jnp.float16), sds((B, H, T, D), jnp.float32), sds((B, H, T, D), jnp.float16),
           sds((B, H, T), jnp.float32), sds((B, H, D, D), jnp.float32))
    intra = (sds((B, T, 2, D), jnp.bfloat16), sds((B, T, 2, D), jnp.bfloat16), sds((B, 2, T), jnp.float32),
             sds((B, 2, T), jnp.float32))
    for per, wgs, regs in ((None, 2, None), (2, 2, None), (None, 3, None), (2, 3, (216, 216, 72))):
        fn = jax.jit(functools.partial(state_recurrence_output_intra_mgpu, out_dtype=jnp.bfloat16, scale=D ** -0.5,
                                       checkpoint_chunks=per, warpgroups=wgs, registers=regs))
        text = fn.trace(*rec, *intra).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text and ("setmaxnreg" in text) == (regs is not None)
    for per in (None, 2):  # with the rows' lengths (chunk config skip_padding): a loop of each row's own length
        fn = jax.jit(lambda *a, per=per: state_recurrence_output_intra_mgpu(
            *a[:-1], out_dtype=jnp.bfloat16, scale=D ** -0.5, checkpoint_chunks=per, warpgroups=3,
            registers=(232, 200, 72), lengths=a[-1]))
        lowered = fn.trace(*rec, *intra, sds((B,), jnp.int32)).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()


def test_auto_computes_the_output_inside_the_recurrence_on_large_gpu_grids():
    """output="auto" (default): "fused_intra" where the Mosaic GPU recurrence runs (not in interpret mode) on a grid
    of at least `fused_min_programs` programs (V / 64 x HV x B) at K = V = 128, else the output kernel (False);
    explicit "fused_intra" keeps in-call checkpoints inside the kernel; it does not apply off the Mosaic GPU
    recurrence or where the output's arithmetic does not fit (fp32 q and k here); the removed "fused" is refused."""
    from pallas_kernels.gated_delta import chunk

    bf16 = jnp.bfloat16

    def pick(B, HV=32, K=128, V=128, recurrence="mosaic", interpret=False, dtypes=(bf16, bf16), **config):
        cfg = chunk._checked_config(dict(config), V)
        return chunk._output_in_recurrence(cfg, recurrence, B, HV, K, V, True, dtypes, bf16, interpret)

    assert pick(8) is True and pick(2) is True  # 512, 128 programs
    assert pick(1) is False and pick(3, HV=16, fused_min_programs=97) is False  # 64, 96
    assert pick(1, fused_min_programs=64) is True and pick(1, V=64, fused_min_programs=32) is False
    assert pick(8, K=64) is False and pick(16, V=64) is False  # (head sizes not run on a GPU)
    assert pick(8, K=64, output="fused_intra") is True
    assert pick(8, interpret=True) is False and pick(8, recurrence="triton") is False
    assert pick(8, dtypes=(jnp.float32, jnp.float32)) is False
    assert pick(1, output="fused_intra", interpret=True) is True
    assert pick(8, output="triton") is False and pick(8, output="mosaic") is False
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="fused_min_programs"):
            chunk._checked_config(dict(fused_min_programs=bad), 128)
    with pytest.raises(ValueError, match="'fused' was removed"):
        chunk._checked_config(dict(output="fused"), 128)


@pytest.mark.parametrize("change,match", [(dict(qk_dtype=jnp.float32), "qk_dtype"),
                                          (dict(checkpoint_chunks=0), "checkpoint_chunks"),
                                          (dict(lengths=np.zeros(2, np.int32)), "lengths must be int32"),
                                          (dict(lengths=np.zeros(1, np.float32)), "lengths must be int32"),
                                          (dict(q_shape=(1, 128, 3, 64)), "HK dividing"),
                                          (dict(warpgroups=4), "warpgroups is 2 or 3"),
                                          (dict(registers=(216, 216, 72)), "registers is None or"),
                                          (dict(warpgroups=3, registers=(256, 144, 104)), "registers is None or")])
def test_fused_intra_refuses_bad_inputs(change, match):
    """`state_recurrence_output_intra_mgpu` refuses a 4-byte qk_dtype, a checkpoint interval below 1, key heads
    that do not divide the value heads, a warpgroup count other than 2 or 3, a register split without three
    warpgroups or over the register file and lengths other than int32 [B], before any lowering."""
    from pallas_kernels.gated_delta.recurrence_mgpu import state_recurrence_output_intra_mgpu

    B, H, T, D = 1, 4, 128, 64
    f16, f32 = jnp.float16, jnp.float32
    qs = change.pop("q_shape", (B, T, 2, D))
    w = jnp.zeros((B, H, T, D), f16)
    q = jnp.zeros(qs, jnp.bfloat16)
    r = jnp.zeros((B, qs[2], T), f32)
    with pytest.raises(ValueError, match=match):
        state_recurrence_output_intra_mgpu(w, jnp.zeros((B, H, T, D), f32), w, jnp.zeros((B, H, T), f32),
                                           jnp.zeros((B, H, D, D), f32), q, q, r, r, scale=D ** -0.5,
                                           out_dtype=jnp.bfloat16, **change)
