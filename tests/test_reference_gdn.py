"""The pure-JAX gated delta rule (chunked WY form and recurrent form) against the independent float64 oracle.

Tolerances (fp32 inputs): outputs and final states within a norm-wise relative error of 1e-5 of the oracle, and
chunked within 1e-5 of recurrent. Bitwise claims (padding, length-0 rows, on-grid splits, checkpoints) use
np.array_equal.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pallas_kernels
from pallas_kernels.gated_delta.reference import (CHUNK, chunk_gated_delta_rule_reference,
                                                  gated_delta_step_reference, gdn_gates,
                                                  recurrent_gated_delta_rule_reference)
from tests.gdn_oracle import gated_delta_rule_oracle, random_gdn_inputs

chunk = jax.jit(chunk_gated_delta_rule_reference, static_argnames=("checkpoint_stride",))
recurrent = jax.jit(recurrent_gated_delta_rule_reference)

B, K, V = 2, 16, 32  # K != V so a transposed state would not go unnoticed
RTOL = 1e-5  # fp32 vs float64 oracle, norm-wise relative error
RTOL_BF16_OUT = 4e-3  # bf16 outputs: one bf16 rounding (2^-8) of fp32-exact values


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_rel_close(x, ref, tol, what):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert x.shape == ref.shape, f"{what}: shape {x.shape} != {ref.shape}"
    err, scale = float(np.linalg.norm(x - ref)), float(np.linalg.norm(ref))
    # The 1e-30 floor only matters when the reference is (numerically) all zero, e.g. a state fully forgotten.
    ok = err <= tol * scale + 1e-30
    assert ok, f"{what}: rel err {err / max(scale, 1e-30):.3g} > {tol:g}"


def as_jax(d):
    return {k: (None if v is None else jnp.asarray(v)) for k, v in d.items()}


# (T, HK, HV): T % 64 != 0 except where split tests need it; HV = HK, 2*HK and 4*HK (GVA).
SHAPES = [(1, 2, 2), (63, 1, 2), (65, 2, 4), (130, 2, 8)]


@pytest.mark.parametrize("beta_kind", ["realistic", "zero", "one", "mixed"])
@pytest.mark.parametrize("g_kind", ["realistic", "near_zero", "very_negative"])
@pytest.mark.parametrize("T,HK,HV", SHAPES)
def test_chunked_and_recurrent_match_oracle(rng, T, HK, HV, g_kind, beta_kind):
    d = random_gdn_inputs(rng, B, T, HK, HV, K, V, g_kind=g_kind, beta_kind=beta_kind, with_state=True)
    assert np.any(d["initial_state"] != 0)
    o_ref, s_ref = gated_delta_rule_oracle(**d)
    a = as_jax(d)
    o_c, s_c = chunk(**a)
    o_r, s_r = recurrent(**a)
    assert s_c.dtype == s_r.dtype == jnp.float32 and o_c.dtype == o_r.dtype == jnp.float32
    tag = f"T={T} HK={HK} HV={HV} g={g_kind} beta={beta_kind}"
    assert_rel_close(o_r, o_ref, RTOL, f"recurrent output vs oracle ({tag})")
    assert_rel_close(s_r, s_ref, RTOL, f"recurrent final state vs oracle ({tag})")
    assert_rel_close(o_c, o_ref, RTOL, f"chunked output vs oracle ({tag})")
    assert_rel_close(s_c, s_ref, RTOL, f"chunked final state vs oracle ({tag})")
    assert_rel_close(o_c, o_r, RTOL, f"chunked vs recurrent output ({tag})")
    assert_rel_close(s_c, s_r, RTOL, f"chunked vs recurrent final state ({tag})")


def test_no_initial_state_is_a_zero_state(rng):
    T, HK, HV = 65, 2, 4
    d = random_gdn_inputs(rng, B, T, HK, HV, K, V, with_state=False)
    a = as_jax(d)
    o_none, s_none = chunk(**a)
    o_zero, s_zero = chunk(**{**a, "initial_state": jnp.zeros((B, HV, K, V), jnp.float32)})
    assert np.array_equal(o_none, o_zero) and np.array_equal(s_none, s_zero)
    o_ref, s_ref = gated_delta_rule_oracle(**d)
    assert_rel_close(o_none, o_ref, RTOL, "chunked output, no initial state")
    assert_rel_close(s_none, s_ref, RTOL, "chunked state, no initial state")


def test_initial_state_matters(rng):
    """A non-zero initial state must change outputs (guards against an ignored initial_state)."""
    T, HK, HV = 65, 2, 4
    a = as_jax(random_gdn_inputs(rng, B, T, HK, HV, K, V))
    o1, s1 = chunk(**a)
    o0, s0 = chunk(**{**a, "initial_state": jnp.zeros_like(a["initial_state"])})
    assert max(float(jnp.max(jnp.abs(o1 - o0))), float(jnp.max(jnp.abs(s1 - s0)))) > 1e-3


@pytest.mark.parametrize("ref_fn", ["chunked", "recurrent"])
def test_per_row_lengths(rng, ref_fn):
    """Rows of lengths 65 and 30 in one T=65 call (the padded row's chunk has 34 padded tokens), then lengths 0 and
    65: padded tokens leave states bit-identical; a length-0 row keeps its initial state bit for bit."""
    fn = chunk if ref_fn == "chunked" else recurrent
    T, HK, HV = 65, 2, 4
    d = random_gdn_inputs(rng, B, T, HK, HV, K, V)
    a = as_jax(d)
    lengths = np.array([65, 30], np.int32)
    o, s = fn(**a, lengths=jnp.asarray(lengths))
    # The padded row equals the same row run alone (B=1, T=30, no padding), bitwise.
    alone = {k: v[1:2, :30] if k != "initial_state" else v[1:2] for k, v in a.items()}
    o_b, s_b = fn(**alone)
    assert np.array_equal(s[1:2], s_b), "padded row: state differs from the row alone"
    assert np.array_equal(o[1:2, :30], o_b), "padded row: outputs differ from the row alone"
    # The full row equals a call without lengths, bitwise.
    o_full, s_full = fn(**a)
    assert np.array_equal(s[0], s_full[0]) and np.array_equal(o[0], o_full[0])
    # A length-0 row: state bit-identical to its initial state; the other row unaffected.
    o0, s0 = fn(**a, lengths=jnp.asarray([0, 65], jnp.int32))
    assert np.array_equal(s0[0], d["initial_state"][0]), "a length-0 row changed its state"
    assert np.array_equal(s0[1], s_full[1])
    # Garbage in the padded tail changes nothing.
    noisy = dict(d)
    pad = np.arange(T)[None, :] >= lengths[:, None]  # [B, T]
    for name in ("q", "k", "v"):
        noisy[name] = np.where(pad[..., None, None], rng.standard_normal(d[name].shape) * 5, d[name]).astype(np.float32)
    noisy["g"] = np.where(pad[..., None], -7.0, d["g"]).astype(np.float32)
    noisy["beta"] = np.where(pad[..., None], 0.9, d["beta"]).astype(np.float32)
    o2, s2 = fn(**as_jax(noisy), lengths=jnp.asarray(lengths))
    assert np.array_equal(s2, s), "padding content leaked into a state"
    assert np.array_equal(o2[0], o[0]) and np.array_equal(o2[1, :30], o[1, :30]), "padding leaked into outputs"
    # And against the oracle (which ignores t >= lengths[b]).
    o_ref, s_ref = gated_delta_rule_oracle(**d, lengths=lengths)
    assert_rel_close(s, s_ref, RTOL, f"{ref_fn} state with lengths vs oracle")
    assert_rel_close(np.where(pad[..., None, None], 0.0, o), o_ref, RTOL, f"{ref_fn} valid outputs with lengths")


@settings(max_examples=20, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(0, 65), min_size=B, max_size=B), seed=st.integers(0, 2**32 - 1))
def test_lengths_property(lengths, seed):
    """Any per-row lengths (one compiled shape, T=65): rows of full length equal the call without lengths, rows of
    length 0 keep their initial state, and every state is within rel err 1e-5 of the oracle (chunked and
    recurrent), bit for bit the same whatever the padded tokens hold."""
    rng = np.random.default_rng(seed)
    T, HK, HV = 65, 2, 4
    d = random_gdn_inputs(rng, B, T, HK, HV, K, V)
    a = as_jax(d)
    lens = np.array(lengths, np.int32)
    o, s = chunk(**a, lengths=jnp.asarray(lens))
    o_r, s_r = recurrent(**a, lengths=jnp.asarray(lens))
    _, s_full = chunk(**a)
    pad = np.arange(T)[None, :] >= lens[:, None]
    noisy = {**d, "k": np.where(pad[..., None, None], 3.0, d["k"]).astype(np.float32),
             "g": np.where(pad[..., None], -2.0, d["g"]).astype(np.float32)}
    _, s_noisy = chunk(**as_jax(noisy), lengths=jnp.asarray(lens))
    assert np.array_equal(s_noisy, s)
    _, s_ref = gated_delta_rule_oracle(**d, lengths=lens)
    for b, L in enumerate(lens):
        if L == T:
            assert np.array_equal(s[b], s_full[b])
        if L == 0:
            assert np.array_equal(s[b], d["initial_state"][b]) and np.array_equal(s_r[b], d["initial_state"][b])
        assert_rel_close(s[b], s_ref[b], RTOL, f"chunked state, row {b}, length {L}")
        assert_rel_close(s_r[b], s_ref[b], RTOL, f"recurrent state, row {b}, length {L}")


def test_split_on_grid_is_bitwise(rng):
    """Chunked: a call split at a multiple of 64 gives the same final state and later outputs, bit for bit."""
    T, HK, HV = 130, 2, 8
    a = as_jax(random_gdn_inputs(rng, B, T, HK, HV, K, V))
    o, s = chunk(**a)
    for split in (64, 128):
        head = {k: v[:, :split] if k != "initial_state" else v for k, v in a.items()}
        o1, s1 = chunk(**head)
        tail = {k: v[:, split:] if k != "initial_state" else s1 for k, v in a.items()}
        o2, s2 = chunk(**tail)
        assert np.array_equal(s2, s), f"split at {split}: final state differs"
        assert np.array_equal(o1, o[:, :split]), f"split at {split}: first-part outputs differ"
        assert np.array_equal(o2, o[:, split:]), f"split at {split}: later outputs differ"


def test_checkpoint_stride_states_equal_separate_calls(rng):
    T, HK, HV = 130, 2, 8
    a = as_jax(random_gdn_inputs(rng, B, T, HK, HV, K, V))
    o, s = chunk(**a)
    o_ck, s_ck, ck = chunk(**a, checkpoint_stride=64)
    assert ck.shape == (B, T // 64, HV, K, V) and ck.dtype == jnp.float32
    assert np.array_equal(o_ck, o) and np.array_equal(s_ck, s)
    for i in range(T // 64):
        end = 64 * (i + 1)
        _, s_end = chunk(**{k: v[:, :end] if k != "initial_state" else v for k, v in a.items()})
        assert np.array_equal(ck[:, i], s_end), f"checkpoint {i} differs from the final state of a call ending at {end}"
    with pytest.raises(ValueError, match="multiple of 64"):
        chunk_gated_delta_rule_reference(**a, checkpoint_stride=96)


@pytest.mark.parametrize("ref_fn", ["chunked", "recurrent"])
def test_bf16_inputs(rng, ref_fn):
    """bf16 q, k, v: outputs come back bf16 (within one bf16 rounding of the oracle on the same bf16 values,
    rel err <= 4e-3); the state stays fp32 and within 1e-5 of the oracle."""
    fn = chunk if ref_fn == "chunked" else recurrent
    T, HK, HV = 65, 2, 4
    d = random_gdn_inputs(rng, B, T, HK, HV, K, V)
    a = as_jax(d)
    for name in ("q", "k", "v"):
        a[name] = a[name].astype(jnp.bfloat16)
    o, s = fn(**a)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    exact = {**d, **{n: np.asarray(a[n].astype(jnp.float32)) for n in ("q", "k", "v")}}
    o_ref, s_ref = gated_delta_rule_oracle(**exact)
    assert_rel_close(o, o_ref, RTOL_BF16_OUT, f"{ref_fn} bf16 output")
    assert_rel_close(s, s_ref, RTOL, f"{ref_fn} bf16-input state")


def test_single_step_equals_recurrent_first_token(rng):
    HK, HV = 2, 2
    d = as_jax(random_gdn_inputs(rng, B, 1, HK, HV, K, V))
    o1, s1 = recurrent(**d)
    o2, s2 = jax.jit(gated_delta_step_reference)(d["q"][:, 0], d["k"][:, 0], d["v"][:, 0], d["g"][:, 0],
                                                 d["beta"][:, 0], d["initial_state"])
    assert np.array_equal(o2, o1[:, 0]) and np.array_equal(s2, s1)


def test_gates_formula(rng):
    HV = 4
    A_log = np.log(rng.uniform(1, 16, HV)).astype(np.float32)
    dt_bias = rng.standard_normal(HV).astype(np.float32)
    a = rng.standard_normal((3, 5, HV)).astype(np.float32) * 3
    b = rng.standard_normal((3, 5, HV)).astype(np.float32) * 3
    g, beta = gdn_gates(jnp.asarray(A_log), jnp.asarray(a).astype(jnp.bfloat16), jnp.asarray(dt_bias),
                        jnp.asarray(b).astype(jnp.bfloat16))
    assert g.dtype == jnp.float32 and beta.dtype == jnp.float32, "gates must be fp32 even for bf16 inputs"
    a64 = np.asarray(jnp.asarray(a).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    b64 = np.asarray(jnp.asarray(b).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
    g_ref = -np.exp(A_log.astype(np.float64)) * np.log1p(np.exp(a64 + dt_bias))
    beta_ref = 1 / (1 + np.exp(-b64))
    assert np.all(np.asarray(g) < 0)
    assert np.max(np.abs(np.asarray(g) - g_ref) / np.abs(g_ref)) <= 1e-5, "g rel err > 1e-5"
    assert np.max(np.abs(np.asarray(beta) - beta_ref)) <= 1e-6, "beta abs err > 1e-6"


def test_dispatcher_reference_backend(rng):
    T, HK, HV = 1, 2, 2
    a = as_jax(random_gdn_inputs(rng, B, T, HK, HV, K, V))
    o1, s1 = chunk(**a)
    o2, s2 = jax.jit(lambda **kw: pallas_kernels.chunk_gated_delta_rule(**kw, backend="reference"))(**a)
    assert np.array_equal(o1, o2) and np.array_equal(s1, s2)
    # Decode entry point with raw a, b and A_log / dt_bias: gates computed in fp32 inside.
    A_log = jnp.log(jnp.asarray(rng.uniform(1, 16, HV), jnp.float32))
    dt_bias = jnp.asarray(rng.standard_normal(HV), jnp.float32)
    ra = jnp.asarray(rng.standard_normal((B, HV)), jnp.float32)
    rb = jnp.asarray(rng.standard_normal((B, HV)), jnp.float32)
    q, k, v = a["q"][:, 0], a["k"][:, 0], a["v"][:, 0]
    o3, s3 = jax.jit(lambda *xs: pallas_kernels.recurrent_gated_delta_rule(
        *xs[:5], initial_state=xs[5], A_log=xs[6], dt_bias=xs[7], backend="reference"))(
        q, k, v, ra, rb, a["initial_state"], A_log, dt_bias)
    g, beta = gdn_gates(A_log, ra, dt_bias, rb)
    o4, s4 = recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                       initial_state=a["initial_state"])
    # Same math, separately compiled programs (fusion may differ): within 1e-6 max abs.
    assert float(jnp.max(jnp.abs(o3 - o4[:, 0]))) <= 1e-6 and float(jnp.max(jnp.abs(s3 - s4))) <= 1e-6
    with pytest.raises(ValueError, match="backend"):
        pallas_kernels.chunk_gated_delta_rule(**a, backend="cuda-magic")


def test_shape_validation(rng):
    a = as_jax(random_gdn_inputs(rng, B, 5, 2, 4, K, V))
    with pytest.raises(ValueError, match="g and beta"):
        chunk_gated_delta_rule_reference(**{**a, "g": a["g"][..., :3]})
    with pytest.raises(ValueError, match="multiple of key heads"):
        chunk_gated_delta_rule_reference(**{**a, "v": a["v"][:, :, :3], "g": a["g"][..., :3],
                                            "beta": a["beta"][..., :3], "initial_state": a["initial_state"][:, :3]})
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule_reference(**{**a, "initial_state": a["initial_state"][:, :, :8]})


def test_chunk_constant_is_64():
    assert CHUNK == 64 == pallas_kernels.CHUNK
