"""`pallas_kernels.invariant.row_tiled`, the fixed-tile loop of deterministic mode's XLA path (the reference backend's
matmuls, and the MoE block on every backend): a row's bits never depend on how many rows share the call, alone
(one tile, which XLA inlines) or in a larger call (a loop), with the caller's own operations around it. The case
that once broke it (a 1-ulp logprob, 2026-12-01) is the model-level `tests/test_replay.py` generate == score test of
the tiny MoE model; these small blocks did not reproduce it without the fix, so they guard the contract, not that
bug."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.invariant import row_tiled


def _moe_like(w1, w2, w3):
    """A row-wise block with contractible multiply-adds (SwiGLU-like), as the MoE's experts compute."""
    return lambda t: (jax.nn.silu(t @ w1) * (t @ w2)) @ w3 + t * 0.5


@pytest.mark.parametrize("n_rows", [1, 4, 64, 65, 300])
def test_rows_equal_inside_any_call(n_rows):
    rng = np.random.default_rng(n_rows)
    w = [jnp.asarray(rng.standard_normal(s) / 8, jnp.float32) for s in ((32, 48), (32, 48), (48, 32))]
    fn = _moe_like(*w)
    big = jnp.asarray(rng.standard_normal((2, 200, 32)), jnp.float32)
    call = jax.jit(lambda a: a * 0.7 + row_tiled(fn, a))  # a caller's multiply-add around the tiles
    whole = call(big)  # 400 rows: 7 tiles
    rows = big.reshape(400, 32)[93:93 + n_rows]  # rows 93.. of the call: they start mid-tile
    part = call(rows)  # the same rows alone
    assert part.shape == (n_rows, 32) and whole.shape == (2, 200, 32)
    np.testing.assert_array_equal(np.asarray(part), np.asarray(whole.reshape(400, 32)[93:93 + n_rows]))
    ref = np.asarray(rows * 0.7 + fn(rows))  # plain XLA on the rows: the same values within fp32 rounding
    np.testing.assert_allclose(np.asarray(part), ref, rtol=1e-5, atol=1e-5)


def test_fn_must_keep_the_rows():
    with pytest.raises(ValueError, match="must map"):
        row_tiled(lambda t: t.sum(0), jnp.ones((3, 8)))
