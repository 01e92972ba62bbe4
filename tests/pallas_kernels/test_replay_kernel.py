"""Replay decode kernel (interpret mode on CPU): token by token, bitwise what the exact-configuration prefill
computes for the same positions — outputs at every step, the boundary state at every grid boundary — when it
continues a prefill that ended anywhere inside a chunk; plus skipped rows, grouped column layouts and input checks.
Tiny shapes (K = V = 32)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import CHUNK, EXACT_CONFIG, chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.replay import replay_gated_delta_step_pallas
from tests.gdn_oracle import random_gdn_inputs

K = V = 32


def mixed(q, k, v, groups):
    """[B, T, HK, K], [B, T, HK, K], [B, T, HV, V] -> [B, T, C_mix]: G groups of [q_g | k_g | v_g]."""
    B, T, HK, _ = q.shape
    HV = v.shape[2]
    parts = []
    for gi in range(groups):
        ks = slice(gi * HK // groups, (gi + 1) * HK // groups)
        vs = slice(gi * HV // groups, (gi + 1) * HV // groups)
        parts += [q[:, :, ks].reshape(B, T, -1), k[:, :, ks].reshape(B, T, -1), v[:, :, vs].reshape(B, T, -1)]
    return np.concatenate(parts, axis=-1)


def prefill(d, a, b, s0, **kw):
    return chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n][:, a:b]) for n in ("q", "k", "v", "g", "beta")),
                                         initial_state=s0, interpret=True, config=EXACT_CONFIG, **kw)


def replay_run(d, p, T, groups=1):
    """Prefill tokens [0, p) as the model does in replay mode (full chunks, then the open tail with X and v_new),
    then replay-decode tokens [p, T) one by one. Returns (outputs [B, T - p, HV, V], boundary states by position)."""
    B = d["q"].shape[0]
    s = jnp.asarray(d["initial_state"])
    boundary = p // CHUNK * CHUNK
    if boundary:
        _, s = prefill(d, 0, boundary, s)
    HV = d["v"].shape[2]
    open_x = jnp.zeros((B, HV, CHUNK, CHUNK), jnp.float32)
    open_vn = jnp.zeros((B, HV, CHUNK, V), jnp.float32)
    mix = mixed(d["q"], d["k"], d["v"], groups)
    gates = np.stack([d["g"], d["beta"]], axis=2).astype(np.float32)  # [B, T, 2, HV]
    rng = np.random.default_rng(5)  # rows not yet written hold junk: the kernel must never read them
    open_qkv = rng.standard_normal((B, CHUNK, mix.shape[-1])).astype(np.float32)
    open_g = rng.standard_normal((B, CHUNK, 2, HV)).astype(np.float32)
    if p > boundary:
        _, _, x, vn = prefill(d, boundary, p, s, return_open=True)
        open_x, open_vn = x, vn
        open_qkv[:, : p - boundary] = mix[:, boundary:p]
        open_g[:, : p - boundary] = gates[:, boundary:p]
    step = jax.jit(replay_gated_delta_step_pallas, static_argnames=("groups", "interpret"), donate_argnums=(2, 3, 4))
    outs, states = [], {}
    for t in range(p, T):
        i = t % CHUNK
        open_qkv[:, i] = mix[:, t]
        open_g[:, i] = gates[:, t]
        o, s, open_x, open_vn = step(jnp.asarray(open_qkv), jnp.asarray(open_g), s, open_x, open_vn,
                                     jnp.full((B,), i, jnp.int32), groups=groups, interpret=True)
        outs.append(np.asarray(o))
        if i == CHUNK - 1:
            states[t + 1] = np.asarray(s)
    return np.stack(outs, axis=1), states


@pytest.mark.parametrize("p,T,HK,HV,groups,g_kind,beta_kind", [
    (0, 70, 1, 2, 1, "realistic", "realistic"),
    (50, 140, 2, 4, 1, "near_zero", "mixed"),
    (64, 133, 2, 4, 2, "very_negative", "one"),
])
def test_replay_equals_prefill_bitwise(p, T, HK, HV, groups, g_kind, beta_kind):
    d = random_gdn_inputs(np.random.default_rng(p + T), 2, T, HK, HV, K, V, np.float32, g_kind=g_kind,
                          beta_kind=beta_kind)
    o_full, s_full, ck = prefill(d, 0, T, jnp.asarray(d["initial_state"]), checkpoint_stride=CHUNK)
    o_rep, states = replay_run(d, p, T, groups)
    np.testing.assert_array_equal(o_rep, np.asarray(o_full)[:, p:])  # every decoded token, bitwise
    assert states, "the run should cross a grid boundary"
    for pos, s in states.items():
        np.testing.assert_array_equal(s, np.asarray(ck)[:, pos // CHUNK - 1])  # boundary states, bitwise


def test_skipped_rows_and_input_checks():
    d = random_gdn_inputs(np.random.default_rng(3), 2, 64, 1, 2, K, V, np.float32)
    s0 = jnp.asarray(d["initial_state"])
    mix = jnp.asarray(mixed(d["q"], d["k"], d["v"], 1))
    gates = jnp.asarray(np.stack([d["g"], d["beta"]], axis=2))
    x = jnp.zeros((2, 2, CHUNK, CHUNK))
    vn = jnp.zeros((2, 2, CHUNK, V))
    o, s, x1, vn1 = replay_gated_delta_step_pallas(mix, gates, s0, x, vn, jnp.asarray([63, -1]), interpret=True)
    np.testing.assert_array_equal(np.asarray(s)[1], np.asarray(s0)[1])  # row 1 skipped: untouched
    assert not np.array_equal(np.asarray(s)[0], np.asarray(s0)[0])  # row 0 closed its chunk: a new boundary
    np.testing.assert_array_equal(np.asarray(x1)[1], 0)
    with pytest.raises(ValueError, match="open_x"):
        replay_gated_delta_step_pallas(mix, gates, s0, x[:, :, :32], vn, jnp.asarray([0, 0]), interpret=True)
    with pytest.raises(ValueError, match="groups"):
        replay_gated_delta_step_pallas(mix, gates, s0, x, vn, jnp.asarray([0, 0]), groups=3, interpret=True)
    with pytest.raises(ValueError, match="columns"):
        replay_gated_delta_step_pallas(mix[..., :-8], gates, s0, x, vn, jnp.asarray([0, 0]), interpret=True)


def test_return_open_needs_the_exact_configuration():
    d = random_gdn_inputs(np.random.default_rng(4), 1, 10, 1, 2, K, V, np.float32)
    with pytest.raises(ValueError, match="exact"):
        chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), interpret=True,
                                      return_open=True)
    with pytest.raises(ValueError, match="exact"):
        chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), interpret=True,
                                      config=dict(EXACT_CONFIG, p_qk="tf32"))


def test_dispatcher_routes_exact_prefill_and_replay_step():
    """pallas_kernels.chunk_gated_delta_rule(exact=True) and replay_gated_delta_step go to the same kernels as
    above (bitwise), and refuse the reference backend."""
    import pallas_kernels

    d = random_gdn_inputs(np.random.default_rng(6), 1, 20, 1, 2, K, V, np.float32)
    args = [jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")]
    s0 = jnp.asarray(d["initial_state"])
    o, s, x, vn = pallas_kernels.chunk_gated_delta_rule(*args, initial_state=s0, exact=True, backend="interpret")
    o2, s2, x2, vn2 = prefill(d, 0, 20, s0, return_open=True)
    for a, b in ((o, o2), (s, s2), (x, x2), (vn, vn2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="Pallas backend"):
        pallas_kernels.chunk_gated_delta_rule(*args, exact=True, backend="reference")
    mix = jnp.asarray(mixed(d["q"], d["k"], d["v"], 1))[:, :1].repeat(CHUNK, axis=1)
    gates = jnp.zeros((1, CHUNK, 2, 2), jnp.float32)
    with pytest.raises(ValueError, match="Pallas backend"):
        pallas_kernels.replay_gated_delta_step(mix, gates, s0, x[:, :, :CHUNK], vn[:, :, :CHUNK],
                                               jnp.zeros((1,), jnp.int32), backend="reference")
    out = pallas_kernels.replay_gated_delta_step(mix, gates, s0, x, vn, jnp.zeros((1,), jnp.int32),
                                                 backend="interpret")
    assert out[0].shape == (1, 2, V) and np.isfinite(np.asarray(out[0])).all()
