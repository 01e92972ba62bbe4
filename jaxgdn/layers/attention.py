"""Gated grouped-query attention with a fixed-capacity KV cache (Qwen3.5 / Qwen3-Next full-attention layers).

Per head, `q_proj` yields the query and an output gate (interleaved per head); q and k get a zero-centred
RMSNorm over the head dim and partial RoPE; the attention output is multiplied by sigmoid(gate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.invariant import softmax

from ..config import ModelConfig
from ..params import AttentionParams
from ..state import AttentionLayerState
from .norm import rms_norm
from .rope import apply_rope


def attention(cfg: ModelConfig, p: AttentionParams, x: jax.Array, state: AttentionLayerState, positions: jax.Array,
              lengths: jax.Array | None):
    """x: [B, T, D]; positions: [B] (first position of this call per row); lengths: [B] or None (= T).

    Writes the valid tokens' keys/values into the cache at positions..positions+lengths-1 and attends causally
    over the cache. Returns (y [B, T, D], new_state).
    """
    B, T, _ = x.shape
    H, HKV, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    N = state.keys.shape[1]
    qg = (x @ p.q_proj).reshape(B, T, H, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:]
    k = (x @ p.k_proj).reshape(B, T, HKV, Dh)
    v = (x @ p.v_proj).reshape(B, T, HKV, Dh)
    q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
    k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    pos = positions[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
    q = apply_rope(q, pos, cfg.rotary_dim, cfg.rope_theta)
    k = apply_rope(k, pos, cfg.rotary_dim, cfg.rope_theta)

    # Scatter valid tokens into the cache; padded tokens get index N and are dropped.
    valid = jnp.ones((B, T), bool) if lengths is None else jnp.arange(T)[None, :] < lengths[:, None]
    slot = jnp.where(valid, pos, N)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, T))
    keys = state.keys.at[rows, slot].set(k.astype(state.keys.dtype), mode="drop")
    values = state.values.at[rows, slot].set(v.astype(state.values.dtype), mode="drop")

    # Causal attention over the cache: query at pos sees keys 0..pos.
    qh = q.reshape(B, T, HKV, H // HKV, Dh)
    scores = jnp.einsum("btgrd,bngd->bgrtn", qh, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (Dh**-0.5)  # [B, HKV, H/HKV, T, N]
    mask = jnp.arange(N)[None, None, :] <= pos[:, :, None]  # [B, T, N]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = softmax(scores).astype(x.dtype)
    out = jnp.einsum("bgrtn,bngd->btgrd", probs, values.astype(x.dtype)).reshape(B, T, H, Dh)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    return out.reshape(B, T, H * Dh) @ p.o_proj, AttentionLayerState(keys=keys, values=values)
