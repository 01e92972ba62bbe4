"""Projections. Deterministic mode computes them batch-invariantly (`pallas_kernels.matmul_invariant`: fixed
tiles); otherwise XLA's GEMM."""

from __future__ import annotations

import jax

import pallas_kernels


def linear(x: jax.Array, w: jax.Array, det: str | bool, row_groups: int | None = None,
           col_groups: int | None = None, w_transposed: bool = False) -> jax.Array:
    """x: [..., Din] @ w: [Din, Dout]. `det`: False, or the kernel backend of deterministic mode: each row's result
    is then independent of how many rows share the call (XLA's GEMMs change low bits with M: on CPU for some
    shapes, on an H200 for bf16 at M=128 vs 512). How tensor parallelism splits w, where the mesh size divides the
    number of groups: `row_groups=n`, its rows by n groups (the output projections: heads, intermediate index);
    `col_groups=n`, its columns (the input projections, the output head: heads, intermediate index, vocabulary).
    Deterministic mode on a mesh then runs the fixed-tile product per shard (`pallas_kernels.matmul_invariant`:
    row-split partial sums all-reduced on 2 devices, added in a fixed device order on more); default mode leaves
    the product to XLA's partitioner. `w_transposed`: w is given as [Dout, Din] (a tied embedding as the output
    head)."""
    if det:
        return pallas_kernels.matmul_invariant(x, w, backend=None if det is True else det, row_groups=row_groups,
                                               col_groups=col_groups, w_transposed=w_transposed)
    return x @ (w.T if w_transposed else w)
