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
    full = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, KC-1+T, C]
    w = weight.astype(jnp.float32)
    acc = sum(full[:, j:j + T].astype(jnp.float32) * w[j] for j in range(kc))
    y = jax.nn.silu(acc).astype(x.dtype)
    ends = jnp.full((B,), T, jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    idx = ends[:, None] + jnp.arange(kc - 1)[None, :]  # [B, KC-1] rows of `full`
    new_state = jnp.take_along_axis(full, idx[..., None], axis=1)
    if checkpoint_ends is None:
        return y, new_state
    B, M = checkpoint_ends.shape
    rows = jnp.clip(checkpoint_ends[..., None] + jnp.arange(kc - 1), 0, T + kc - 2).reshape(B, M * (kc - 1))
    ckpt = jnp.take_along_axis(full, rows[..., None], axis=1).reshape(B, M, kc - 1, C)
    return y, new_state, ckpt


def causal_conv1d_step(x: jax.Array, conv_state: jax.Array, weight: jax.Array):
    """One token. x: [B, C]; conv_state: [B, KC-1, C]. Returns (y [B, C], new_state)."""
    full = jnp.concatenate([conv_state.astype(x.dtype), x[:, None]], axis=1)  # [B, KC, C]
    w = weight.astype(jnp.float32)
    acc = sum(full[:, j].astype(jnp.float32) * w[j] for j in range(weight.shape[0]))  # same order as prefill
    return jax.nn.silu(acc).astype(x.dtype), full[:, 1:]
