"""`pallas_kernels.invariant.row_tiled`, the fixed-tile loop of deterministic mode's XLA path (the reference backend's
matmuls, and the MoE block on every backend): a row's bits never depend on how many rows share the call."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant import row_tiled


def _moe_like(w1, w2, w3):
    """A row-wise block with contractible multiply-adds (SwiGLU-like), as the MoE's experts compute."""
    return lambda t: (jax.nn.silu(t @ w1) * (t @ w2)) @ w3 + t * 0.5


def test_single_tile_stays_a_loop():
    """One tile (a decode step's rows) must be compiled as the loop body, not inlined into the caller, where XLA
    may fuse and contract it differently (the 2026-12-01 1-ulp logprob difference, tests/test_replay.py)."""
    rng = np.random.default_rng(0)
    w = [jnp.asarray(rng.standard_normal(s) / 8, jnp.float32) for s in ((32, 48), (32, 48), (48, 32))]
    x = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    hlo = jax.jit(lambda a: row_tiled(_moe_like(*w), a)).lower(x).compile().as_text()
    assert re.search(r" while\(%", hlo)  # an HLO while instruction, not just a "while" in op metadata


@pytest.mark.parametrize("n_rows", [1, 4, 64, 65, 300])
def test_rows_equal_inside_any_call(n_rows):
    rng = np.random.default_rng(n_rows)
    w = [jnp.asarray(rng.standard_normal(s) / 8, jnp.float32) for s in ((32, 48), (32, 48), (48, 32))]
    fn = _moe_like(*w)
    big = jnp.asarray(rng.standard_normal((2, 200, 32)), jnp.float32)
    whole = jax.jit(lambda a: row_tiled(fn, a))(big)  # 400 rows: 7 tiles
    rows = big.reshape(400, 32)[93:93 + n_rows]  # rows 93.. of the call: they start mid-tile
    part = jax.jit(lambda a: row_tiled(fn, a))(rows)  # the same rows alone
    assert part.shape == (n_rows, 32) and whole.shape == (2, 200, 32)
    np.testing.assert_array_equal(np.asarray(part), np.asarray(whole.reshape(400, 32)[93:93 + n_rows]))
    ref = np.asarray(fn(rows))  # plain XLA on the rows: the same values within fp32 rounding
    np.testing.assert_allclose(np.asarray(part), ref, rtol=1e-5, atol=1e-5)


def test_fn_must_keep_the_rows():
    with pytest.raises(ValueError, match="must map"):
        row_tiled(lambda t: t.sum(0), jnp.ones((3, 8)))
