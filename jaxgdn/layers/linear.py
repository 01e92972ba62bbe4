"""Projections. Deterministic mode computes them batch-invariantly (`pallas_kernels.matmul_invariant`: fixed
tiles); otherwise XLA's GEMM."""

from __future__ import annotations

import jax

import pallas_kernels


def linear(x: jax.Array, w: jax.Array, det: str | bool, rows_split: bool = False, col_groups: int | None = None,
           w_transposed: bool = False) -> jax.Array:
    """x: [..., Din] @ w: [Din, Dout]. `det`: False, or the kernel backend of deterministic mode: each row's result
    is then independent of how many rows share the call (XLA's GEMMs change low bits with M: on CPU for some
    shapes, on an H200 for bf16 at M=128 vs 512). `rows_split`: tensor parallelism splits w's rows (the output
    projections); `col_groups=n`: it splits w's columns by n groups (heads, intermediate index, vocabulary) where
    the mesh size divides n. In deterministic mode on a mesh either runs the fixed-tile product per shard, the
    row-split partial sums added in a fixed device order (`pallas_kernels.matmul_invariant`); default mode leaves
    them to XLA's partitioner. `w_transposed`: w is given as [Dout, Din] (a tied embedding as the output head)."""
    if det:
        return pallas_kernels.matmul_invariant(x, w, backend=None if det is True else det, rows_split=rows_split,
                                               col_groups=col_groups, w_transposed=w_transposed)
    return x @ (w.T if w_transposed else w)
