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
from .linear import linear
from .norm import rms_norm
from .rope import apply_rope


def _attend(q, keys, values, pos, n_rep: int):
    """q: [B, T, H, Dh] (rotated); keys/values: [B, N, HKV, Dh]; pos: [B, T] absolute query positions.

    Causal attention over the cache (a query at pos sees keys 0..pos), softmax in fp32. Returns [B, T, H, Dh].
    """
    B, T, H, Dh = q.shape
    N, HKV = keys.shape[1], keys.shape[2]
    qh = q.reshape(B, T, HKV, n_rep, Dh)
    scores = jnp.einsum("btgrd,bngd->bgrtn", qh, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (Dh**-0.5)  # [B, HKV, n_rep, T, N]
    mask = jnp.arange(N)[None, None, :] <= pos[:, :, None]  # [B, T, N]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = softmax(scores).astype(q.dtype)
    return jnp.einsum("bgrtn,bngd->btgrd", probs, values.astype(q.dtype)).reshape(B, T, H, Dh)


def _attend_tiled(q, keys, values, pos, n_rep: int, tile: int):
    """Batch-invariant `_attend`: queries in fixed tiles of `tile` per row, each tile through one compiled
    program (`lax.map`) of one shape, so a query's result depends on neither the batch nor the call length."""
    B, T, H, Dh = q.shape
    n_t = -(-T // tile)
    pad = n_t * tile - T
    qt = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B * n_t, tile, H, Dh)
    pt = jnp.pad(pos, ((0, 0), (0, pad))).reshape(B * n_t, tile)
    rows = jnp.repeat(jnp.arange(B), n_t)

    def one(args):
        qi, pi, b = args
        return _attend(qi[None], keys[b][None], values[b][None], pi[None], n_rep)[0]

    out = jax.lax.map(one, (qt, pt, rows))  # [B*n_t, tile, H, Dh]
    return out.reshape(B, n_t * tile, H, Dh)[:, :T]


def attention(cfg: ModelConfig, p: AttentionParams, x: jax.Array, state: AttentionLayerState, positions: jax.Array,
              lengths: jax.Array | None, det: bool = False, query_tile: int = 64):
    """x: [B, T, D]; positions: [B] (first position of this call per row); lengths: [B] or None (= T).

    Writes the valid tokens' keys/values into the cache at positions..positions+lengths-1 and attends causally
    over the cache. `det`: batch-invariant computation (projections in fixed row tiles, queries in fixed tiles of
    `query_tile`). Returns (y [B, T, D], new_state).
    """
    B, T, _ = x.shape
    H, HKV, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    N = state.keys.shape[1]
    qg = linear(x, p.q_proj, det).reshape(B, T, H, 2 * Dh)
    q, gate = qg[..., :Dh], qg[..., Dh:]
    k = linear(x, p.k_proj, det).reshape(B, T, HKV, Dh)
    v = linear(x, p.v_proj, det).reshape(B, T, HKV, Dh)
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

    n_rep = H // HKV
    out = _attend_tiled(q, keys, values, pos, n_rep, query_tile) if det else _attend(q, keys, values, pos, n_rep)
    out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(out.dtype)
    return linear(out.reshape(B, T, H * Dh), p.o_proj, det), AttentionLayerState(keys=keys, values=values)
