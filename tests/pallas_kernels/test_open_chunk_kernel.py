"""Open-chunk replay step (interpret mode on CPU): token by token, bitwise what the default-configuration prefill
computes for the same positions — the output at every step and the boundary state where a chunk fills — when it
continues a prefill that ended anywhere inside a chunk; grouped column layouts, junk in the unused rows, the
dispatcher (reference and interpret backends) and input checks. Tiny shapes (K = V = 32)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import CHUNK, chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.open_chunk import replay_open_chunk_pallas
from tests.gdn_oracle import random_gdn_inputs
from tests.pallas_kernels.test_replay_kernel import mixed

K = V = 32


def prefill(d, a, b, s0, **kw):
    return chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n][:, a:b]) for n in ("q", "k", "v", "g", "beta")),
                                         initial_state=s0, interpret=True, **kw)


def replay_run(d, p, T, groups=1, step_fn=None):
    """Prefill tokens [0, p) (full chunks, as the model's replay mode does), then decode [p, T) one token at a
    time with the open-chunk step. Returns (outputs [B, T - p, HV, V], boundary states by position)."""
    B = d["q"].shape[0]
    s = jnp.asarray(d["initial_state"])
    boundary = p // CHUNK * CHUNK
    if boundary:
        _, s = prefill(d, 0, boundary, s)
    mix = mixed(d["q"], d["k"], d["v"], groups)
    gates = np.stack([d["g"], d["beta"]], axis=2).astype(np.float32)  # [B, T, 2, HV]
    rng = np.random.default_rng(5)  # rows past the new token hold junk: the kernel must mask them
    open_qkv = rng.standard_normal((B, CHUNK, mix.shape[-1])).astype(mix.dtype)
    open_g = rng.standard_normal((B, CHUNK, 2, gates.shape[-1])).astype(np.float32)
    open_qkv[:, : p - boundary] = mix[:, boundary:p]
    open_g[:, : p - boundary] = gates[:, boundary:p]
    step = step_fn or jax.jit(lambda *a: replay_open_chunk_pallas(*a, groups=groups, interpret=True),
                              donate_argnums=(2,))
    outs, states = [], {}
    for t in range(p, T):
        i = t % CHUNK
        open_qkv[:, i] = mix[:, t]
        open_g[:, i] = gates[:, t]
        o, s = step(jnp.asarray(open_qkv), jnp.asarray(open_g), s, jnp.full((B,), i + 1, jnp.int32))
        outs.append(np.asarray(o))
        if i == CHUNK - 1:
            states[t + 1] = np.asarray(s)
    return np.stack(outs, axis=1), states


@pytest.mark.parametrize("p,T,HK,HV,groups,g_kind,beta_kind,dtype", [
    (0, 70, 1, 2, 1, "realistic", "realistic", np.float32),
    (50, 133, 2, 4, 1, "near_zero", "mixed", np.float32),
    (64, 131, 2, 4, 2, "very_negative", "one", np.float32),
    (61, 66, 1, 4, 1, "realistic", "zero", jnp.bfloat16),
])
def test_open_chunk_step_equals_prefill_bitwise(p, T, HK, HV, groups, g_kind, beta_kind, dtype):
    d = random_gdn_inputs(np.random.default_rng(p + T), 2, T, HK, HV, K, V, dtype, g_kind=g_kind,
                          beta_kind=beta_kind)
    o_full, _, ck = prefill(d, 0, T, jnp.asarray(d["initial_state"]), checkpoint_stride=CHUNK)
    o_rep, states = replay_run(d, p, T, groups)
    assert o_rep.dtype == np.asarray(o_full).dtype
    np.testing.assert_array_equal(o_rep, np.asarray(o_full)[:, p:])  # every decoded token, bitwise
    assert states, "the run should cross a grid boundary"
    for pos, s in states.items():
        np.testing.assert_array_equal(s, np.asarray(ck)[:, pos // CHUNK - 1])  # boundary states, bitwise


def test_rows_with_open_chunks_keep_their_state():
    """Rows whose chunk is not full keep the boundary state bit for bit; a full row gets the next one; the row
    count of the batch does not change a row's bits."""
    d = random_gdn_inputs(np.random.default_rng(3), 3, 64, 1, 2, K, V, np.float32)
    s0 = jnp.asarray(d["initial_state"])
    mix = jnp.asarray(mixed(d["q"], d["k"], d["v"], 1))
    gates = jnp.asarray(np.stack([d["g"], d["beta"]], axis=2))
    lengths = jnp.asarray([64, 17, 1], jnp.int32)
    o, s = replay_open_chunk_pallas(mix, gates, s0, lengths, interpret=True)
    np.testing.assert_array_equal(np.asarray(s)[1:], np.asarray(s0)[1:])
    _, s_pre = prefill(d, 0, 64, s0)
    np.testing.assert_array_equal(np.asarray(s)[0], np.asarray(s_pre)[0])
    o1, s1 = replay_open_chunk_pallas(mix[1:2], gates[1:2], s0[1:2], lengths[1:2], interpret=True)
    np.testing.assert_array_equal(np.asarray(o1)[0], np.asarray(o)[1])  # a row alone == inside the batch
    np.testing.assert_array_equal(np.asarray(s1)[0], np.asarray(s0)[1])


def test_dispatcher_reference_and_interpret_agree_with_their_prefills():
    """pallas_kernels.replay_open_chunk: each backend reproduces its own prefill bitwise (the reference backend
    through the pure-JAX chunked rule), and the two backends agree within tolerance (2e-5, fp32 inputs)."""
    import pallas_kernels

    d = random_gdn_inputs(np.random.default_rng(6), 2, 64, 1, 2, K, V, np.float32)
    s0 = jnp.asarray(d["initial_state"])
    args = [jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")]
    mix = jnp.asarray(mixed(d["q"], d["k"], d["v"], 1))
    gates = jnp.asarray(np.stack([d["g"], d["beta"]], axis=2))
    lengths = jnp.asarray([64, 30], jnp.int32)
    outs = {}
    for backend in ("reference", "interpret"):
        o, s = pallas_kernels.replay_open_chunk(mix, gates, s0, lengths, backend=backend)
        o_pre, s_pre = pallas_kernels.chunk_gated_delta_rule(*args, initial_state=s0, lengths=lengths,
                                                             backend=backend)
        np.testing.assert_array_equal(np.asarray(o)[0], np.asarray(o_pre)[0, 63])
        np.testing.assert_array_equal(np.asarray(o)[1], np.asarray(o_pre)[1, 29])
        np.testing.assert_array_equal(np.asarray(s)[0], np.asarray(s_pre)[0])
        np.testing.assert_array_equal(np.asarray(s)[1], np.asarray(s0)[1])
        outs[backend] = (np.asarray(o), np.asarray(s))
    for a, b in zip(outs["reference"], outs["interpret"]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


def test_input_checks():
    d = random_gdn_inputs(np.random.default_rng(4), 2, 64, 1, 2, K, V, np.float32)
    s0 = jnp.asarray(d["initial_state"])
    mix = jnp.asarray(mixed(d["q"], d["k"], d["v"], 1))
    gates = jnp.asarray(np.stack([d["g"], d["beta"]], axis=2))
    n = jnp.asarray([1, 1], jnp.int32)
    with pytest.raises(ValueError, match="groups"):
        replay_open_chunk_pallas(mix, gates, s0, n, groups=3, interpret=True)
    with pytest.raises(ValueError, match="columns"):
        replay_open_chunk_pallas(mix[..., :-8], gates, s0, n, interpret=True)
    with pytest.raises(ValueError, match="open_qkv"):
        replay_open_chunk_pallas(mix[:, :32], gates, s0, n, interpret=True)
    with pytest.raises(ValueError, match="open_gates"):
        replay_open_chunk_pallas(mix, gates[:, :, :1], s0, n, interpret=True)
    with pytest.raises(ValueError, match="lengths"):
        replay_open_chunk_pallas(mix, gates, s0, n[:1], interpret=True)
    with pytest.raises(ValueError, match="fp32"):
        replay_open_chunk_pallas(mix, gates, s0.astype(jnp.bfloat16), n, interpret=True)
    with pytest.raises(ValueError, match="inv"):
        replay_open_chunk_pallas(mix, gates, s0, n, interpret=True, config={"inv": "tiles16"})
