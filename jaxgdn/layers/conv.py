"""Causal depthwise conv1d + SiLU with an explicit state of the last KC-1 inputs (XLA).

Taps are stored [KC, C], oldest first: y[t] = silu(sum_j w[j] * x[t - (KC-1) + j]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv1d(x: jax.Array, conv_state: jax.Array, weight: jax.Array, lengths: jax.Array | None = None,
                  checkpoint_ends: jax.Array | None = None):
    """Multi-token conv. x: [B, T, C]; conv_state: [B, KC-1, C]; weight: [KC, C]; lengths: [B] or None.

    Returns (y [B, T, C] in x.dtype, new_state [B, KC-1, C]): the last KC-1 *valid* inputs of each row, exact;
    with `checkpoint_ends` ([B, M] tokens of this call absorbed at each checkpoint, 1..T) also the conv state at
    each of those points, [B, M, KC-1, C].
    """
    kc = weight.shape[0]
    B, T, C = x.shape
    state = conv_state.astype(x.dtype)
    w = weight.astype(jnp.float32)
    # tap j reads full[t + j] with full = [state | x]; each shifted view is its own concatenation of slices so that
    # XLA fuses them all into the one pass that writes y (x read once; `full` is never materialised)
    acc = sum(_shifted(state, x, j, T).astype(jnp.float32) * w[j] for j in range(kc))
    y = jax.nn.silu(acc).astype(x.dtype)
    ends = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    new_state = _rows_of_full(state, x, ends[:, None] + jnp.arange(kc - 1)[None, :])
    if checkpoint_ends is None:
        return y, new_state
    B, M = checkpoint_ends.shape
    rows = jnp.clip(checkpoint_ends[..., None] + jnp.arange(kc - 1), 0, T + kc - 2).reshape(B, M * (kc - 1))
    ckpt = _rows_of_full(state, x, rows).reshape(B, M, kc - 1, C)
    return y, new_state, ckpt


def _shifted(state: jax.Array, x: jax.Array, j: int, T: int) -> jax.Array:
    """full[:, j:j + T] for full = concat(state, x) along time ([B, KC-1, C] and [B, T, C])."""
    k1 = state.shape[1]
    if j == k1:
        return x
    head = state[:, j:]
    if T <= k1 - j:
        return head[:, :T]
    return jnp.concatenate([head, x[:, :T - (k1 - j)]], axis=1)


def _rows_of_full(state: jax.Array, x: jax.Array, rows: jax.Array) -> jax.Array:
    """full[b, rows[b, i]] for full = concat(state, x) along time; rows [B, R] in [0, KC-1+T). Two small gathers."""
    k1, T = state.shape[1], x.shape[1]
    from_x = jnp.take_along_axis(x, jnp.clip(rows - k1, 0, T - 1)[..., None], axis=1)
    from_state = jnp.take_along_axis(state, jnp.clip(rows, 0, k1 - 1)[..., None], axis=1)
    return jnp.where((rows >= k1)[..., None], from_x, from_state)


def causal_conv1d_step(x: jax.Array, conv_state: jax.Array, weight: jax.Array):
    """One token. x: [B, C]; conv_state: [B, KC-1, C]. Returns (y [B, C], new_state)."""
    full = jnp.concatenate([conv_state.astype(x.dtype), x[:, None]], axis=1)  # [B, KC, C]
    w = weight.astype(jnp.float32)
    acc = sum(full[:, j].astype(jnp.float32) * w[j] for j in range(weight.shape[0]))  # same order as prefill
    return jax.nn.silu(acc).astype(x.dtype), full[:, 1:]
