"""Pure-JAX reference for the gated delta rule: the oracle for the kernels and their fallback.

Dimension legend (used in shape comments throughout the project):
  B  batch rows            T  tokens in a call         C  chunk length (64)
  HK key/query heads       HV value heads (a multiple of HK; value head h reads key head h // (HV // HK))
  K  key head dim          V  value head dim

The recurrence, per value head, with state S of shape [K, V] (always fp32):
  S' = exp(g_t) * S
  S  = S' + k_t (beta_t * (v_t - S'^T k_t))^T
  o_t = scale * S^T q_t                      (q, k L2-normalised in fp32 first, eps 1e-6)

`chunk_gated_delta_rule_reference` computes it chunk by chunk (WY/UT form, chunk 64) under `lax.scan`, so a
call split on the 64-token grid runs exactly the same per-chunk arithmetic as the unsplit call: the two are
bitwise equal. Every dot states its precision (HIGHEST): on GPU a default fp32 dot would run as TF32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..invariant import prefix_sum, tree_sum

CHUNK = 64
_HI = jax.lax.Precision.HIGHEST


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(tree_sum(x * x)[..., None] + eps)


def gdn_gates(A_log: jax.Array, a: jax.Array, dt_bias: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """GDN gates in fp32: g = -exp(A_log) * softplus(a + dt_bias) (log-decay), beta = sigmoid(b).

    A_log, dt_bias: [HV]; a, b: [..., HV]. Returns g, beta: [..., HV] fp32.
    """
    a = a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    return g, beta


def _expand_heads(x: jax.Array, hv: int) -> jax.Array:
    """[..., HK, D] -> [..., HV, D]: value head h reads key head h // (HV // HK)."""
    hk = x.shape[-2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    return jnp.repeat(x, hv // hk, axis=-2)


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, lengths):
    """Validate, normalise, mask padding. Returns fp32 q, k, v [B,T,HV,*], g, beta [B,T,HV], state, scale."""
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [B,T,HK,K] and v [B,T,HV,V]; got {q.shape}, {k.shape}, {v.shape}")
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B,T,HV]={(B, T, HV)}; got {g.shape}, {beta.shape}")
    scale = K**-0.5 if scale is None else scale
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = _expand_heads(q * scale, HV)
    k = _expand_heads(k, HV)
    v = v.astype(jnp.float32)
    g = g.astype(jnp.float32)
    beta = beta.astype(jnp.float32)
    if lengths is not None:
        valid = jnp.arange(T)[None, :] < lengths[:, None]  # [B,T]
        # Padded tokens: decay exp(0) = 1 exactly and a zero key, so the state is bit-identical.
        k = jnp.where(valid[..., None, None], k, 0.0)
        v = jnp.where(valid[..., None, None], v, 0.0)
        g = jnp.where(valid[..., None], g, 0.0)
        beta = jnp.where(valid[..., None], beta, 0.0)
    if initial_state is None:
        initial_state = jnp.zeros((B, HV, K, V), jnp.float32)
    elif initial_state.shape != (B, HV, K, V):
        raise ValueError(f"initial_state must be [B,HV,K,V]={(B, HV, K, V)}; got {initial_state.shape}")
    return q, k, v, g, beta, initial_state.astype(jnp.float32)


def gated_delta_step_reference(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm=True):
    """One token per row. q, k: [B,HK,K]; v: [B,HV,V]; g, beta: [B,HV]; state fp32 [B,HV,K,V].

    Returns (o [B,HV,V] in v.dtype, new_state fp32 [B,HV,K,V]).
    """
    o, s = recurrent_gated_delta_rule_reference(
        q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
        scale=scale, initial_state=state, use_qk_l2norm=use_qk_l2norm)
    return o[:, 0], s


def _token_step(s, xs):
    """One token for every (row, value head): s fp32 [B,HV,K,V]; xs = q, k [B,HV,K], v [B,HV,V], g, beta [B,HV]
    (fp32, q scaled). The kernels' arithmetic (`recurrent.token_update`): with S = exp(g) s, u = beta (v - S^T k),
    o = S^T q + (q . k) u, s' = S + k u^T. The reductions over K are fixed-order trees (`tree_sum`), so a row's
    result does not depend on the batch's shape."""
    qt, kt, vt, gt, bt = xs
    s = s * jnp.exp(gt)[..., None, None]
    st = jnp.swapaxes(s, -1, -2)  # [B,HV,V,K]
    kv = tree_sum(st * kt[..., None, :])  # [B,HV,V]
    sq = tree_sum(st * qt[..., None, :])  # [B,HV,V]
    u = bt[..., None] * (vt - kv)
    o = sq + tree_sum(qt * kt)[..., None] * u
    return s + kt[..., :, None] * u[..., None, :], o


def _scan_segment(s, xs):
    """`_token_step` over a segment of tokens (leading axis). A one-token segment runs as a two-token scan whose
    second token is all zeros (its state is dropped): XLA inlines a one-trip loop and fuses it with the
    neighbouring ops, and on CPU that changes the rounding with the batch size; a real loop keeps the arithmetic
    every longer call runs."""
    if xs[0].shape[0] != 1:
        return jax.lax.scan(_token_step, s, xs)

    def step(s, x):
        s, o = _token_step(s, x)
        return s, (o, s)

    _, (o, states) = jax.lax.scan(step, s, tuple(jnp.concatenate([x, jnp.zeros_like(x)]) for x in xs))
    return states[0], o[:1]


def recurrent_gated_delta_rule_reference(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True,
                                         lengths=None, checkpoint_stride=None):
    """Token-by-token recurrence (fp32). Shapes as the chunked form; returns (o [B,T,HV,V], final_state), plus the
    states after every `checkpoint_stride` tokens [B, T // stride, HV, K, V] when a stride is given (exact copies:
    the scan runs segment by segment)."""
    if checkpoint_stride is not None and (not isinstance(checkpoint_stride, int) or checkpoint_stride <= 0):
        raise ValueError(f"checkpoint_stride must be a positive int; got {checkpoint_stride!r}")
    out_dtype = v.dtype
    q, k, v, g, beta, s = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, lengths)
    T = q.shape[1]
    if lengths is not None:  # padded tokens: o = 0 (their q is zeroed too)
        q = jnp.where((jnp.arange(T)[None, :] < lengths[:, None])[..., None, None], q, 0.0)
    stride = checkpoint_stride or T
    outs, cks = [], []
    for start in range(0, T, stride):
        xs = tuple(jnp.moveaxis(x[:, start:start + stride], 1, 0) for x in (q, k, v, g, beta))
        s, o = _scan_segment(s, xs)
        outs.append(jnp.moveaxis(o, 0, 1))
        if start + stride <= T:
            cks.append(s)
    o = jnp.concatenate(outs, axis=1).astype(out_dtype)
    if checkpoint_stride is None:
        return o, s
    B, HV, K, V = s.shape
    return o, s, (jnp.stack(cks, axis=1) if cks else jnp.zeros((B, 0, HV, K, V), jnp.float32))


def _chunk_step(s, xs):
    """One 64-token chunk of the WY/UT form. s: [B,HV,K,V]; xs per chunk: q,k [B,HV,C,K], v [B,HV,C,V],
    g,beta [B,HV,C]."""
    q, k, v, g, beta = xs
    C = q.shape[-2]
    gc = prefix_sum(g)  # [B,HV,C]
    row = jnp.arange(C)[:, None]
    col = jnp.arange(C)[None, :]
    lower_incl = row >= col
    lower_strict = row > col
    # decay[i, j] = exp(gc_i - gc_j) for j <= i; masked entries exactly zero (where before exp: no overflow).
    diff = gc[..., :, None] - gc[..., None, :]
    decay = jnp.where(lower_incl, jnp.exp(jnp.where(lower_incl, diff, 0.0)), 0.0)  # [B,HV,C,C]
    kk = jnp.einsum("bhik,bhjk->bhij", k, k, precision=_HI)
    a = jnp.where(lower_strict, beta[..., :, None] * kk * decay, 0.0)
    # T = (I + A)^-1, lower triangular with unit diagonal.
    eye = jnp.eye(C, dtype=jnp.float32)
    t = jax.scipy.linalg.solve_triangular(eye + a, jnp.broadcast_to(eye, a.shape), lower=True, unit_diagonal=True)
    u = jnp.einsum("bhij,bhjv->bhiv", t, beta[..., None] * v, precision=_HI)  # [B,HV,C,V]
    w = jnp.einsum("bhij,bhjk->bhik", t, (beta * jnp.exp(gc))[..., None] * k, precision=_HI)  # [B,HV,C,K]
    v_new = u - jnp.einsum("bhik,bhkv->bhiv", w, s, precision=_HI)
    qk = jnp.where(lower_incl, jnp.einsum("bhik,bhjk->bhij", q, k, precision=_HI) * decay, 0.0)
    o = (jnp.einsum("bhik,bhkv->bhiv", q * jnp.exp(gc)[..., None], s, precision=_HI)
         + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=_HI))
    g_last = gc[..., -1]
    # Decay from token i to the chunk end, as an exclusive suffix sum rather than g_last - gc_i: the difference of
    # two large cumulative sums loses ~1e-4 when g is very negative, and trailing padding (g = 0) must add exactly 0.
    to_end = jnp.concatenate([jnp.flip(prefix_sum(jnp.flip(g[..., 1:], -1)), -1), jnp.zeros_like(g[..., :1])], -1)
    k_tail = k * jnp.exp(to_end)[..., None]
    s = s * jnp.exp(g_last)[..., None, None] + jnp.einsum("bhik,bhiv->bhkv", k_tail, v_new, precision=_HI)
    return s, (o, s)


def chunk_gated_delta_rule_reference(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True,
                                     lengths=None, checkpoint_stride=None):
    """Chunked (WY/UT, chunk 64) gated delta rule in fp32.

    q, k: [B,T,HK,K]; v: [B,T,HV,V]; g (log-decay), beta: [B,T,HV]; initial_state fp32 [B,HV,K,V] or None;
    lengths int32 [B] or None: tokens t >= lengths[b] are padding and leave row b's state bit-identical.
    checkpoint_stride: None or a multiple of 64: also return the state after every `checkpoint_stride` tokens,
    [B, T // stride, HV, K, V], each bitwise equal to the final state of a call ending there.
    Returns (o [B,T,HV,V] in v.dtype, final_state fp32 [B,HV,K,V]) or (o, final_state, checkpoints).
    """
    if checkpoint_stride is not None and (checkpoint_stride <= 0 or checkpoint_stride % CHUNK):
        raise ValueError(f"checkpoint_stride must be a positive multiple of {CHUNK}; got {checkpoint_stride}")
    out_dtype = v.dtype
    B, T = q.shape[:2]
    q, k, v, g, beta, s0 = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, lengths)
    n = -(-T // CHUNK)
    pad = n * CHUNK - T

    def chunks(x):  # [B,T,HV,*] -> [n,B,HV,C,*] ; [B,T,HV] -> [n,B,HV,C]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((B, n, CHUNK) + x.shape[2:])
        x = jnp.moveaxis(x, 1, 0)  # [n,B,C,HV,...]
        return jnp.swapaxes(x, 2, 3)

    s, (o, states) = jax.lax.scan(_chunk_step, s0, tuple(chunks(x) for x in (q, k, v, g, beta)))
    HV, V = o.shape[2], o.shape[4]
    o = jnp.moveaxis(jnp.swapaxes(o, 2, 3), 0, 1).reshape(B, n * CHUNK, HV, V)  # [n,B,HV,C,V] -> [B,T',HV,V]
    o = o[:, :T].astype(out_dtype)
    if checkpoint_stride is None:
        return o, s
    per = checkpoint_stride // CHUNK
    m = T // checkpoint_stride
    ckpt = jnp.moveaxis(states[per - 1: m * per: per], 0, 1) if m else jnp.zeros((B, 0) + s.shape[1:], jnp.float32)
    return o, s, ckpt
