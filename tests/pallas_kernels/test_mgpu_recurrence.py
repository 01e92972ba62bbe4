"""The chunked prefill's state recurrence as a Mosaic GPU kernel (`recurrence_mgpu.py`, the Hopper default beside the
Pallas-Triton recurrence): lowered for an H200 on CPU, and run in Mosaic GPU's interpret mode on CPU against the
float64 oracle of the recurrence and the Triton recurrence (interpret mode) on the prep's outputs for the same inputs;
plus the bitwise properties a prefix cache needs (run twice, a row alone against the row in a batch, the state at
a chunk start against a call that ends there). Whether its bits equal the Triton recurrence's is a GPU question
(`scripts/gpu_mgpu_recurrence.py`); on CPU both compute their dots in fp32 and this kernel rounds S and v_new to
TF32 first, so they agree within the tolerance below, not bit for bit.

Tolerance: relative (max-norm) error <= 2e-3 (TF32 operands: 2^-11 relative rounding of S and v_new per chunk).
The warp-specialised forms run their two warpgroups as threads in the interpreter, which needs at least 3 XLA:CPU
pool threads (`tests/xla_threads.py`, checked below).
Shapes: K = 32, V = 64 (the kernel's V block is 64), two or three chunks.
"""

from __future__ import annotations

import functools
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.recurrence_mgpu import state_recurrence_mgpu
from tests.gdn_oracle import random_gdn_inputs
from tests.xla_threads import xla_cpu_pool_threads

K, V, HK, HV = 32, 64, 1, 2
TOL = 2e-3
WK16 = dict(wk_dtype="float16")  # w and kd stored in fp16, as the prep stores them on the GPU (the kernel's input)


def prep_outputs(d, lengths, stop="prep"):
    """The Triton prep's w, u, kd, gc (stop="prep") or its recurrence's h, v_new^T, final state ("state"), interpret
    mode, w and kd stored in fp16."""
    return chunk_gated_delta_rule_pallas(
        *(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=jnp.asarray(d["initial_state"]),
        lengths=jnp.asarray(lengths, jnp.int32), interpret=True, config=dict(stop_after=stop, **WK16))


_mgpu_interpreted = jax.jit(functools.partial(state_recurrence_mgpu, interpret=True))  # one compile per shape


def mgpu(w, u, kd, gc, s0):
    return tuple(np.asarray(x) for x in _mgpu_interpreted(w, u, kd, gc, s0))


def oracle(w, u, kd, gc, s0):
    """float64 recurrence: h[c] = S, v_new = u - w S, S = exp(gc_last) S + kd^T v_new; returns (h [B,HV,NT,V,K],
    v_new^T [B,HV,V,Tp], final [B,HV,K,V]) in the kernel's layouts."""
    w, u, kd, gc, S = (np.asarray(x, np.float64) for x in (w, u, kd, gc, s0))
    hs, vns = [], []
    for c in range(w.shape[2] // 64):
        sl = slice(64 * c, 64 * c + 64)
        hs.append(np.swapaxes(S, -1, -2))
        vn = u[:, :, sl] - w[:, :, sl] @ S
        vns.append(vn)
        S = np.exp(gc[:, :, 64 * c + 63])[..., None, None] * S + np.swapaxes(kd[:, :, sl], -1, -2) @ vn
    return np.stack(hs, 2), np.swapaxes(np.concatenate(vns, 2), -1, -2), S


def rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


@pytest.fixture(scope="module")
def case():
    """Three rows of different lengths (T = 150: not a multiple of 64; the last row mostly padding), a non-zero
    initial state (a prefill that continues a state), realistic gates."""
    d = random_gdn_inputs(np.random.default_rng(7), 3, 150, HK, HV, K, V)
    lengths = [150, 97, 5]
    return d, lengths, prep_outputs(d, lengths)


@pytest.mark.parametrize("warp_specialised", [False, True, "u"])
def test_lowers_for_an_h200_at_the_models_head_size(warp_specialised):
    """The kernel lowers for CUDA at K = V = 128 (the shared-memory budget and wgmma shapes are checked here), in
    each form."""
    sds = jax.ShapeDtypeStruct
    args = (sds((2, 4, 256, 128), jnp.float16), sds((2, 4, 256, 128), jnp.float32),
            sds((2, 4, 256, 128), jnp.float16), sds((2, 4, 256), jnp.float32), sds((2, 4, 128, 128), jnp.float32))
    fn = jax.jit(functools.partial(state_recurrence_mgpu, warp_specialised=warp_specialised))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_matches_the_oracle_and_the_triton_recurrence(case):
    d, lengths, (w, u, kd, gc) = case
    got = mgpu(w, u, kd, gc, d["initial_state"])
    want = oracle(w, u, kd, gc, d["initial_state"])
    triton = [np.asarray(x) for x in prep_outputs(d, lengths, stop="state")]
    for name, g, o, t in zip(("h", "v_new", "final"), got, want, triton):
        assert g.shape == o.shape == t.shape, name
        assert np.all(np.isfinite(g)), name
        assert rel(g, o) <= TOL, (name, rel(g, o))
        assert rel(g, t) <= TOL, (name, rel(g, t))
    assert rel(got[0], want[0]) > 0  # the operands really are rounded (not an fp32 copy of the reference)


def test_same_call_twice_is_bitwise(case):
    d, _, (w, u, kd, gc) = case
    a, b = mgpu(w, u, kd, gc, d["initial_state"]), mgpu(w, u, kd, gc, d["initial_state"])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("form", [False, True])
def test_every_form_is_bitwise_the_default_one(case, form):
    """The one-warpgroup form (False: it converts w and kd between its dots), the warp-specialised one (True: a
    second warpgroup converts them while the first runs the chain) and the default ("u": the second warpgroup also
    transposes u) run the same arithmetic: the same bits."""
    d, _, (w, u, kd, gc) = case
    other = jax.jit(functools.partial(state_recurrence_mgpu, interpret=True, warp_specialised=form))
    got = [np.asarray(x) for x in other(w, u, kd, gc, d["initial_state"])]
    assert all(np.array_equal(x, y) for x, y in zip(got, mgpu(w, u, kd, gc, d["initial_state"])))


def test_row_alone_equals_row_in_batch(case):
    d, _, (w, u, kd, gc) = case
    batch = mgpu(w, u, kd, gc, d["initial_state"])
    alone = mgpu(w[1:2], u[1:2], kd[1:2], gc[1:2], d["initial_state"][1:2])
    assert all(np.array_equal(x[1:2], y) for x, y in zip(batch, alone))


def test_chunk_start_state_equals_a_call_that_ends_there(case):
    """h at chunk c (a checkpoint the prefix cache would take) is bitwise the final state of the same recurrence
    run over the first c chunks only."""
    d, _, (w, u, kd, gc) = case
    h, _, _ = mgpu(w, u, kd, gc, d["initial_state"])
    _, _, final = mgpu(w[:, :, :128], u[:, :, :128], kd[:, :, :128], gc[:, :, :128], d["initial_state"])
    assert np.array_equal(np.swapaxes(h[:, :, 2], -1, -2), final)


def test_padded_rows_leave_the_state_unchanged(case):
    """Row 2 has 5 tokens: its last two chunks are padding (w, u, kd zero, gc flat), so its state after chunk 0 is
    carried through them bit for bit."""
    d, _, (w, u, kd, gc) = case
    h, _, final = mgpu(w, u, kd, gc, d["initial_state"])
    assert np.array_equal(h[2, :, 1], h[2, :, 2])
    assert np.array_equal(np.swapaxes(h[2, :, 2], -1, -2), final[2])


@pytest.mark.parametrize("shape,dtype,match", [((1, 2, 100, K), jnp.float16, "multiple of 64"),
                                                ((1, 2, 128, 48), jnp.float16, "of 32"),
                                                ((1, 2, 128, K), jnp.float32, "fp16")])
def test_bad_inputs_are_refused(shape, dtype, match):
    B, H, T, k = shape
    w = jnp.zeros((B, H, T, k), dtype)
    with pytest.raises(ValueError, match=match):
        state_recurrence_mgpu(w, jnp.zeros((B, H, T, V)), w, jnp.zeros((B, H, T)), jnp.zeros((B, H, k, V)))


def run_prefill(d, lengths, recurrence, **kw):
    out = chunk_gated_delta_rule_pallas(
        *(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=jnp.asarray(d["initial_state"]),
        lengths=jnp.asarray(lengths, jnp.int32), interpret=True, config=dict(recurrence=recurrence, **WK16), **kw)
    return [np.asarray(x) for x in out]


def test_prefill_with_the_mosaic_recurrence(case):
    """config recurrence="mosaic" (interpret mode: Mosaic GPU's interpreter) gives the prefill's outputs and states
    within the tolerance of the default, and its in-call checkpoints equal the final states of calls that end there,
    bit for bit."""
    d, lengths, _ = case
    o, final, ck = run_prefill(d, lengths, "mosaic", checkpoint_stride=64)
    o_ref, final_ref, ck_ref = run_prefill(d, lengths, "triton", checkpoint_stride=64)
    assert rel(o, o_ref) <= TOL and rel(final, final_ref) <= TOL and rel(ck, ck_ref) <= TOL
    part = {n: d[n][:, :128] for n in ("q", "k", "v", "g", "beta")}
    _, final_128 = run_prefill(dict(part, initial_state=d["initial_state"]), [min(n, 128) for n in lengths], "mosaic")
    assert np.array_equal(ck[:, 1], final_128)


def test_auto_takes_the_triton_recurrence_off_a_hopper_gpu(case):
    d, lengths, _ = case
    auto = run_prefill(d, lengths, "auto")
    triton = run_prefill(d, lengths, "triton")
    assert all(np.array_equal(a, t) for a, t in zip(auto, triton))


@pytest.mark.parametrize("config,match", [({"recurrence": "cuda"}, "recurrence="),
                                          ({"recurrence": "mosaic", "states_t": False, **WK16}, "states_t=True"),
                                          ({"recurrence": "mosaic"}, "fp16"),  # (interpret mode stores fp32)
                                          ({"recurrence_ws": "yes"}, "recurrence_ws=")])
def test_bad_recurrence_configs_are_refused(case, config, match):
    d, lengths, _ = case
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), interpret=True,
                                      config=config)


@pytest.mark.skipif(sys.platform != "linux", reason="counts the pool's threads in /proc")
def test_the_interpreter_has_the_xla_cpu_threads_its_warpgroups_need():
    """The warp-specialised forms above run in Mosaic GPU's interpreter as two threads (three for the fused kernel's
    three-warpgroup form) whose callbacks share XLA:CPU's pool; with fewer than 3 (4) pool threads they can deadlock
    (`tests/xla_threads.py`). conftest.py sets PJRT_NPROC before JAX starts; this checks that it took effect in this
    process."""
    jnp.ones(3).block_until_ready()  # (the CPU backend exists)
    assert xla_cpu_pool_threads() >= 4
