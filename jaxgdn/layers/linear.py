"""Projections. Deterministic mode computes them batch-invariantly (`pallas_kernels.matmul_invariant`: fixed
tiles); otherwise XLA's GEMM."""

from __future__ import annotations

import jax

import pallas_kernels


def linear(x: jax.Array, w: jax.Array, det: str | bool, rows_split: bool = False,
           w_transposed: bool = False) -> jax.Array:
    """x: [..., Din] @ w: [Din, Dout]. `det`: False, or the kernel backend of deterministic mode: each row's result
    is then independent of how many rows share the call (XLA's GEMMs change low bits with M: on CPU for some
    shapes, on an H200 for bf16 at M=128 vs 512). `rows_split`: tensor parallelism splits w's rows (the output
    projections); in deterministic mode on a mesh of more than 2 devices their partial sums are then added in a
    fixed device order (`pallas_kernels.matmul_invariant`). `w_transposed`: w is given as [Dout, Din] (a tied
    embedding as the output head)."""
    if det:
        return pallas_kernels.matmul_invariant(x, w, backend=None if det is True else det, rows_split=rows_split,
                                               w_transposed=w_transposed)
    return x @ (w.T if w_transposed else w)
