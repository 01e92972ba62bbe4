"""Gated grouped-query attention with a fixed-capacity KV cache (Qwen3.5 / Qwen3-Next full-attention layers).

Per head, `q_proj` yields the query and an output gate (interleaved per head); q and k get a zero-centred
RMSNorm over the head dim and partial RoPE; the attention output is multiplied by sigmoid(gate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels

from ..config import ModelConfig
from ..params import AttentionParams
from ..state import AttentionLayerState
from .linear import linear
from .norm import rms_norm
from .rope import apply_rope


def attention(cfg: ModelConfig, p: AttentionParams, x: jax.Array, state: AttentionLayerState, positions: jax.Array,
              lengths: jax.Array | None, det: str | bool = False, decode: bool = False,
              backend: str | None = None):
    """x: [B, T, D]; positions: [B] (first position of this call per row); lengths: [B] or None (= T).

    Writes the valid tokens' keys/values into the cache at positions..positions+lengths-1 and attends causally
    over the cache. `det`: False, or the kernel backend of deterministic mode (batch-invariant projections and
    attention, `pallas_kernels.matmul_invariant` / `attention_invariant`); `decode`: one query per row (the decode
    tiling); `backend`: the kernel backend of the default mode's attention. Returns (y [B, T, D], new_state).
    """
    B, T, _ = x.shape
    H, HKV, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    N = state.keys.shape[1]
    qg = linear(x, p.q_proj, det, col_groups=H).reshape(B, T, H, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:]
    k = linear(x, p.k_proj, det, col_groups=HKV).reshape(B, T, HKV, Dh)
    v = linear(x, p.v_proj, det, col_groups=HKV).reshape(B, T, HKV, Dh)
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

    if det:
        out = pallas_kernels.attention_invariant(q, keys, values, pos, decode=decode,
                                                 backend=None if det is True else det)
    else:
        out = pallas_kernels.cache_attention(q, keys, values, pos, decode=decode, backend=backend)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    return (linear(out.reshape(B, T, H * Dh), p.o_proj, det, row_groups=H),
            AttentionLayerState(keys=keys, values=values))
