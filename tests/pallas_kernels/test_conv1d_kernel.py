"""Conv1d one-token update kernel (interpret mode on CPU) against the XLA step in `jaxgdn.layers.conv` and NumPy.

Tolerances: fp32 inputs, max abs error <= 1e-6 against the XLA step and float64 NumPy (relative to O(1) values);
bf16 inputs, outputs within one bf16 ulp-ish (rel 8e-3); the shifted state is exact (bitwise) in both cases.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.conv1d import causal_conv1d_update_pallas


def numpy_step(x, state, w):
    full = np.concatenate([state.astype(np.float64), x.astype(np.float64)[:, None]], axis=1)  # [B, KC, C]
    acc = np.einsum("bjc,jc->bc", full, w.astype(np.float64))
    return acc / (1.0 + np.exp(-acc)), full[:, 1:]


@pytest.mark.parametrize("B,C,KC,dtype", [(3, 64, 4, np.float32), (2, 128, 4, jnp.bfloat16), (1, 32, 2, np.float32)])
def test_update_matches_numpy_and_xla(B, C, KC, dtype):
    rng = np.random.default_rng(B * C + KC)
    x = jnp.asarray(rng.standard_normal((B, C)), dtype)
    s = jnp.asarray(rng.standard_normal((B, KC - 1, C)), dtype)
    w = jnp.asarray(rng.standard_normal((KC, C)) * 0.5, jnp.float32)
    y, s1 = causal_conv1d_update_pallas(x, s, w, interpret=True, config={"bc": 32})
    ry, rs = numpy_step(np.asarray(x, np.float64), np.asarray(s, np.float64), np.asarray(w))
    y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    assert np.array_equal(np.asarray(s1), np.asarray(jnp.asarray(rs, dtype)))  # the shift is exact
    if dtype == np.float32:
        assert np.max(np.abs(y - ry)) <= 1e-6
    else:
        assert np.linalg.norm(y - ry) / np.linalg.norm(ry) <= 8e-3
    try:
        from jaxgdn.layers.conv import causal_conv1d_step
    except ImportError:  # the model package is optional for this test
        return
    xy, xs = causal_conv1d_step(x, s, w)
    assert np.array_equal(np.asarray(xs), np.asarray(s1))
    if dtype == np.float32:
        assert np.max(np.abs(np.asarray(xy, np.float64) - y)) <= 1e-6
    else:
        assert np.linalg.norm(np.asarray(jnp.asarray(xy, jnp.float32), np.float64) - y) / np.linalg.norm(ry) <= 8e-3


def test_update_in_place_under_donation():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    s = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    expect = numpy_step(np.asarray(x), np.asarray(jnp.array(s)), np.asarray(w))[1]
    f = jax.jit(lambda x, s, w: causal_conv1d_update_pallas(x, s, w, interpret=True), donate_argnums=1)
    _, s1 = f(x, s, w)
    assert s.is_deleted()
    assert np.array_equal(np.asarray(s1), expect.astype(np.float32))
