"""Projections. Deterministic mode computes them batch-invariantly (fixed 64-row tiles); otherwise XLA's GEMM."""

from __future__ import annotations

import jax

from pallas_kernels.invariant import row_tiled


def linear(x: jax.Array, w: jax.Array, deterministic: bool) -> jax.Array:
    """x: [..., Din] @ w: [Din, Dout]. Deterministic: each row's result is independent of how many rows share
    the call (XLA's GEMMs change low bits with M: on CPU for some shapes, on an H200 for bf16 at M=128 vs 512)."""
    if deterministic:
        return row_tiled(lambda t: t @ w, x)
    return x @ w
