"""Reductions whose per-row result never depends on the array's shape.

XLA's row reductions pick a vectorisation by shape: on CPU, `jnp.sum(x, -1)` of row 0 differs between an
[8, 16] and a [1000, 16] array. Everything whose result must be bitwise equal however a prompt is split or
batched (norms, softmax, the chunk's cumulative gates) sums in an order fixed by these functions: a pairwise
tree over the last axis made of elementwise adds, which XLA does not reassociate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tree_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in a fixed pairwise order. [..., n] -> [...].

    The axis is zero-padded to a power of two first, so trailing zeros never change the result: a masked
    softmax over a KV cache sums the same way whatever the cache's capacity.
    """
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (width - n,), x.dtype)], axis=-1)
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def prefix_sum(x: jax.Array) -> jax.Array:
    """Inclusive cumulative sum over the last axis (Hillis-Steele: log2(n) elementwise adds, fixed order)."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        pad = jnp.zeros_like(x[..., :shift])
        x = x + jnp.concatenate([pad, x[..., : n - shift]], axis=-1)
        shift *= 2
    return x


def log_softmax(x: jax.Array) -> jax.Array:
    """log_softmax over the last axis, in fp32, with an order-fixed sum (max is exact in any order)."""
    x = x.astype(jnp.float32)
    z = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return z - jnp.log(tree_sum(jnp.exp(z)))[..., None]


def softmax(x: jax.Array) -> jax.Array:
    """softmax over the last axis, in fp32, with an order-fixed sum. Rows of all -inf give NaN, as jax.nn does."""
    x = x.astype(jnp.float32)
    e = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    return e / tree_sum(e)[..., None]


def row_tiled(fn, x: jax.Array, tile: int = 64) -> jax.Array:
    """Apply a row-wise `fn` ([tile, D] -> [tile, ...], one array) to x [..., D] in fixed tiles of `tile` rows.

    The tiles run through `lax.map`, so every row is computed by one compiled program of one shape, whatever
    the number of rows: a row's result cannot depend on how many other rows (batch size, prompt length,
    padding) share the call. XLA's own GEMMs pick their blocking by M, which does change low bits.

    Each tile enters and leaves `fn` through an optimization barrier. With one tile XLA drops the loop and inlines
    its body into the caller, where, without the barriers, it may fuse `fn`'s first and last operations with the
    caller's (the zero padding, a residual add) and contract or simplify them differently than inside the loop a
    many-tile call runs: seen on 2026-12-01 on XLA:CPU, where a decode step of 4 rows (one tile) and a 264-token
    teacher-forced score (many tiles) of the tiny MoE model gave one token's logprob 1 ulp apart
    (`tests/test_replay.py`). With the barriers `fn` is compiled on its own either way, and they agree bit for bit.
    (Hiding the trip count from XLA, so that the loop is never inlined, fixed it too, but a while loop of unknown
    trip count is one XLA:GPU checks with the host every iteration; not measured.)
    """
    lead, d = x.shape[:-1], x.shape[-1]
    rows = 1
    for n in lead:
        rows *= n
    n_tiles = max(1, -(-rows // tile))
    flat = x.reshape(rows, d)
    flat = jnp.concatenate([flat, jnp.zeros((n_tiles * tile - rows, d), x.dtype)], axis=0)
    barrier = jax.lax.optimization_barrier
    y = jax.lax.map(lambda t: barrier(fn(barrier(t))), flat.reshape(n_tiles, tile, d))  # [n_tiles, tile, ...]
    if y.shape[1:2] != (tile,):
        raise ValueError(f"row_tiled: fn must map [{tile}, {d}] rows to [{tile}, ...], got {y.shape[1:]}")
    y = y.reshape((n_tiles * tile,) + y.shape[2:])[:rows]
    return y.reshape(lead + y.shape[1:])
