"""Token-by-token prefill kernel (`gated_delta.scan`) in interpret mode on CPU, and its dispatcher.

Against the float64 oracle (fp32 inputs: relative Frobenius error <= 2e-5 for outputs and states, interpret mode is
exact fp32; bf16 inputs: outputs <= 8e-3, bf16 output rounding; states <= 2e-5) on fresh random inputs; and bitwise:
a T-token call == T one-token decode-kernel calls with the same launch configuration, a split anywhere (off the
64 grid) == the unsplit call, the same call twice, a row alone == the same row in a batch of other lengths,
in-call checkpoints == separate calls' final states, padded rows bit-identical with o = 0.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.gated_delta.recurrent import recurrent_gated_delta_rule_pallas
from pallas_kernels.gated_delta.scan import fused_recurrent_gated_delta_rule_pallas as scan
from tests.gdn_oracle import gated_delta_rule_oracle, random_gdn_inputs, rel_err

NAMES = ("q", "k", "v", "g", "beta")


def args_of(d, sl=slice(None), dtype=None):
    return [jnp.asarray(d[n][:, sl], dtype if dtype is not None and n in "qkv" else None) for n in NAMES]


@pytest.mark.parametrize("B,T,HK,HV,K,V,g_kind,beta_kind,dtype", [
    (2, 70, 1, 2, 32, 32, "realistic", "realistic", np.float32),   # T % 64 != 0, HV = 2 HK
    (2, 37, 2, 8, 16, 64, "near_zero", "mixed", np.float32),        # HV = 4 HK
    (1, 65, 1, 4, 32, 16, "very_negative", "one", np.float32),
    (2, 63, 2, 4, 16, 32, "realistic", "zero", np.float32),
    (2, 50, 1, 2, 32, 32, "realistic", "mixed", jnp.bfloat16),
])
def test_matches_oracle(B, T, HK, HV, K, V, g_kind, beta_kind, dtype):
    d = random_gdn_inputs(np.random.default_rng(T + HV), B, T, HK, HV, K, V, np.float32, g_kind=g_kind,
                          beta_kind=beta_kind)
    a = args_of(d, dtype=dtype)
    lengths = np.array([T, T // 2 + 1][:B], np.int32)
    o, s = scan(*a, initial_state=jnp.asarray(d["initial_state"]), lengths=jnp.asarray(lengths), interpret=True)
    f64 = [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in a]
    ro, rs = gated_delta_rule_oracle(*f64, initial_state=d["initial_state"], lengths=lengths)
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all() and np.isfinite(np.asarray(s)).all()
    assert rel_err(o, ro) <= (2e-5 if dtype == np.float32 else 8e-3)
    assert rel_err(s, rs) <= 2e-5
    assert not o[1:, lengths[-1]:].any()  # padded positions: o = 0


@pytest.mark.parametrize("config", [{"bv": 16, "num_warps": 1}, {"bv": 16, "num_warps": 2}, {"bv": 8, "num_warps": 1},
                                    {"kslices": 1}, {"kslices": 8, "fma": False}])
def test_equals_decode_kernel_steps_bitwise(config):
    """Same launch configuration in both kernels (what the equality needs on the GPU, where the reductions follow
    the layout; `scripts/gpu_kernels.py --only scan` checks it there per configuration)."""
    d = random_gdn_inputs(np.random.default_rng(1), 2, 21, 2, 4, 32, 32, np.float32, beta_kind="mixed")
    a = args_of(d, dtype=jnp.bfloat16)
    o, s = scan(*a, initial_state=jnp.asarray(d["initial_state"]), interpret=True, config=config)
    st, outs = jnp.asarray(d["initial_state"]), []
    for t in range(21):
        ot, st = recurrent_gated_delta_rule_pallas(*(x[:, t] for x in a), initial_state=st, interpret=True,
                                                   config=config)
        outs.append(np.asarray(ot))
    np.testing.assert_array_equal(np.stack(outs, axis=1), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(st), np.asarray(s))


@pytest.mark.parametrize("config", [{"ahead": 1}, {"ahead": 4}, {"ahead": 3, "bv": 8}])
def test_load_pipeline_leaves_the_bits(config):
    """`ahead` moves the loads, not the arithmetic: any choice == the default, bitwise (rows of different
    lengths; and T = 3, shorter than the pipeline with ahead = 4)."""
    d = random_gdn_inputs(np.random.default_rng(5), 2, 37, 1, 2, 32, 32, np.float32, beta_kind="mixed")
    a = args_of(d, dtype=jnp.bfloat16)
    s0 = jnp.asarray(d["initial_state"])
    n = jnp.asarray([37, 20], jnp.int32)
    base = dict(bv=config.get("bv", 16))
    for sl, stride in ((slice(None), 5), (slice(0, 3), None)):
        kw = dict(initial_state=s0, lengths=n, checkpoint_stride=stride, interpret=True)
        got = scan(*(x[:, sl] for x in a), **kw, config=base)
        want = scan(*(x[:, sl] for x in a), **kw, config={**base, **config})
        assert len(got) == len(want) == (2 if stride is None else 3)
        for x, y in zip(got, want):  # outputs, final states (and in-call checkpoints)
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="ahead"):
        scan(*a, interpret=True, config={"ahead": 0})


def test_splits_batches_and_checkpoints_bitwise():
    d = random_gdn_inputs(np.random.default_rng(2), 3, 90, 1, 2, 32, 32, np.float32)
    a = args_of(d, dtype=jnp.bfloat16)
    s0 = jnp.asarray(d["initial_state"])
    f = jax.jit(lambda *x, s0, n=None, stride=None: scan(*x, initial_state=s0, lengths=n, checkpoint_stride=stride,
                                                         interpret=True), static_argnames=("stride",))
    o, s, ck = f(*a, s0=s0, stride=25)
    o2, s2 = f(*a, s0=s0)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o2))  # the same call twice (and with checkpoints)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s2))
    parts, st = [], s0
    for lo, hi in ((0, 1), (1, 37), (37, 64), (64, 90)):  # off the grid, one token, across 64
        op, st = f(*(x[:, lo:hi] for x in a), s0=st)
        parts.append(np.asarray(op))
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(st), np.asarray(s))
    assert ck.shape == (3, 3, 2, 32, 32)
    for m in range(3):
        _, sm = f(*(x[:, :25 * (m + 1)] for x in a), s0=s0)
        np.testing.assert_array_equal(np.asarray(ck[:, m]), np.asarray(sm))
    lengths = jnp.asarray([90, 41, -3], jnp.int32)  # a negative length counts as 0
    ob, sb = f(*a, s0=s0, n=lengths)
    oa, sa = f(*(x[1:2, :41] for x in a), s0=s0[1:2])
    np.testing.assert_array_equal(np.asarray(ob)[1, :41], np.asarray(oa)[0])  # a row alone == inside the batch
    np.testing.assert_array_equal(np.asarray(sb)[1], np.asarray(sa)[0])
    np.testing.assert_array_equal(np.asarray(sb)[2], np.asarray(s0)[2])  # an empty row: the state bit-identical
    assert not np.asarray(ob)[1, 41:].any() and not np.asarray(ob)[2].any()
    # checkpoints past a row's length: that row's state at its length (padded tokens leave it bit-identical)
    oc, sc, ckb = f(*a, s0=s0, n=lengths, stride=25)
    np.testing.assert_array_equal(np.asarray(oc), np.asarray(ob))
    np.testing.assert_array_equal(np.asarray(sc), np.asarray(sb))
    _, s25 = f(*(x[1:2, :25] for x in a), s0=s0[1:2])
    np.testing.assert_array_equal(np.asarray(ckb)[1, 0], np.asarray(s25)[0])
    for m in (1, 2):
        np.testing.assert_array_equal(np.asarray(ckb)[1, m], np.asarray(sb)[1])
    for m in range(3):
        np.testing.assert_array_equal(np.asarray(ckb)[2, m], np.asarray(s0)[2])


def test_dispatcher_backends():
    """pallas_kernels.fused_recurrent_gated_delta_rule: the reference backend (a scan of the same recurrence)
    splits and batches bitwise too, and agrees with the interpreted kernel within 2e-5 (fp32 inputs)."""
    d = random_gdn_inputs(np.random.default_rng(3), 2, 40, 1, 2, 32, 32, np.float32)
    a = args_of(d)
    s0 = jnp.asarray(d["initial_state"])
    res = {}
    for backend in ("reference", "interpret"):
        f = jax.jit(lambda *x, s0, stride=None: pallas_kernels.fused_recurrent_gated_delta_rule(
            *x, initial_state=s0, checkpoint_stride=stride, backend=backend), static_argnames=("stride",))
        o, s, ck = f(*a, s0=s0, stride=16)
        o1, s1 = f(*(x[:, :23] for x in a), s0=s0)
        o2, s2 = f(*(x[:, 23:] for x in a), s0=s1)
        np.testing.assert_array_equal(np.concatenate([o1, o2], axis=1), np.asarray(o))
        np.testing.assert_array_equal(np.asarray(s2), np.asarray(s))
        _, s16 = f(*(x[:, :16] for x in a), s0=s0)
        np.testing.assert_array_equal(np.asarray(ck[:, 0]), np.asarray(s16))
        oa, sa = f(*(x[:1, :1] for x in a), s0=s0[:1])  # one token, one row == inside the batch
        ob, sb = f(*(x[:, :1] for x in a), s0=s0)
        np.testing.assert_array_equal(np.asarray(oa)[0], np.asarray(ob)[0])
        np.testing.assert_array_equal(np.asarray(sa)[0], np.asarray(sb)[0])
        res[backend] = (np.asarray(o), np.asarray(s))
    for x, y in zip(res["reference"], res["interpret"]):
        assert rel_err(x, y) <= 2e-5


def test_input_checks():
    d = random_gdn_inputs(np.random.default_rng(4), 1, 8, 1, 2, 32, 32, np.float32)
    a = args_of(d)
    with pytest.raises(ValueError, match="checkpoint_stride"):
        scan(*a, checkpoint_stride=0, interpret=True)
    with pytest.raises(ValueError, match="g and beta"):
        scan(*a[:3], a[3][:, :4], a[4], interpret=True)
    with pytest.raises(ValueError, match="initial_state"):
        scan(*a, initial_state=jnp.zeros((1, 2, 32, 16)), interpret=True)
    with pytest.raises(ValueError, match="multiple of key heads"):
        qk = jnp.zeros((1, 8, 2, 32))
        scan(qk, qk, jnp.zeros((1, 8, 3, 32)), jnp.zeros((1, 8, 3)), jnp.zeros((1, 8, 3)), interpret=True)
    with pytest.raises(ValueError, match="bv"):
        scan(*a, interpret=True, config={"bv": 24})


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_one_token_segments_bitwise(backend):
    """checkpoint_stride=1 (every segment one token) and one-token calls give the unsplit call's bits, row alone ==
    in batch included (on CPU XLA inlines a loop of one static trip and rounds it differently with the batch: the
    reference pads one-token segments, the kernel's trip count is a runtime value); a stride must be positive."""
    d = random_gdn_inputs(np.random.default_rng(5), 2, 9, 1, 2, 32, 32, np.float32)
    a = args_of(d)
    s0 = jnp.asarray(d["initial_state"])
    f = jax.jit(lambda *x, s0, stride=None: pallas_kernels.fused_recurrent_gated_delta_rule(
        *x, initial_state=s0, checkpoint_stride=stride, backend=backend), static_argnames=("stride",))
    o, s = f(*a, s0=s0)
    o1, s1, ck = f(*a, s0=s0, stride=1)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o))
    np.testing.assert_array_equal(np.asarray(s1), np.asarray(s))
    for m in (0, 4, 8):
        np.testing.assert_array_equal(np.asarray(ck[:, m]), np.asarray(f(*(x[:, :m + 1] for x in a), s0=s0)[1]))
    oa, sa, ca = f(*(x[:1, :1] for x in a), s0=s0[:1], stride=1)
    ob, sb, cb = f(*(x[:, :1] for x in a), s0=s0, stride=1)
    for x, y in ((oa, ob), (sa, sb), (ca, cb)):
        np.testing.assert_array_equal(np.asarray(x)[0], np.asarray(y)[0])
    with pytest.raises(ValueError, match="checkpoint_stride"):
        pallas_kernels.fused_recurrent_gated_delta_rule(*a, checkpoint_stride=0, backend=backend)


def test_state_slices_and_fma_options():
    """The state block is held in `kslices` row slices of >= 16 rows (fewer slices for a small K); a bad choice
    is refused. The slices change the reductions' order, so results differ in the low bits only (fp32 inputs:
    within 1e-6 of one slice; interpret mode has no FMAs, `fma` is a GPU choice)."""
    from pallas_kernels.gated_delta.recurrent import k_slices

    assert [k_slices(128, n) for n in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert k_slices(32, 4) == 2 and k_slices(16, 4) == 1
    d = random_gdn_inputs(np.random.default_rng(8), 2, 12, 1, 2, 64, 32, np.float32, beta_kind="mixed")
    a = args_of(d)
    s0 = jnp.asarray(d["initial_state"])
    o1, s1 = scan(*a, initial_state=s0, interpret=True, config={"kslices": 1})
    o4, s4 = scan(*a, initial_state=s0, interpret=True, config={"kslices": 4})
    assert rel_err(np.asarray(o4), np.asarray(o1)) <= 1e-6 and rel_err(np.asarray(s4), np.asarray(s1)) <= 1e-6
    for bad in ({"kslices": 3}, {"kslices": 0}, {"fma": "yes"}):
        with pytest.raises(ValueError, match="kslices|fma"):
            scan(*a, initial_state=s0, interpret=True, config=bad)
