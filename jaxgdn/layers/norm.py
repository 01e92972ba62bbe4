"""RMSNorms. Statistics in fp32 with an order-fixed sum (shape-invariant); results cast back to the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.invariant import tree_sum


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm (Qwen3.5 / Qwen3-Next): normalise in fp32, scale by (1 + w). x: [..., D]; w: [D]."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(tree_sum(xf * xf)[..., None] / x.shape[-1] + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """GDN output norm: plain-w RMSNorm of x, times SiLU(gate) in fp32. x, gate: [..., V]; w: [V]."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(tree_sum(xf * xf)[..., None] / x.shape[-1] + eps)
    y = weight * xf.astype(dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)
