"""Layers against NumPy (float64) formulas: causal conv1d with state, zero-centred and gated RMSNorm, partial
RoPE, SwiGLU MLP, Qwen3-Next MoE, gated GQA attention with a KV cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn.layers.attention import attention
from jaxgdn.layers.conv import causal_conv1d, causal_conv1d_step
from jaxgdn.layers.mlp import mlp, moe
from jaxgdn.layers.norm import gated_rms_norm, rms_norm
from jaxgdn.layers.rope import apply_rope
from jaxgdn.params import AttentionParams, MLPParams, MoEParams
from jaxgdn.state import AttentionLayerState

f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731


def silu(x):
    return x / (1 + np.exp(-x))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def max_abs(a, b) -> float:
    return float(np.max(np.abs(f64(a) - f64(b))))


# ---- causal depthwise conv1d + SiLU ----------------------------------------------------------------------------

KC, C, TC = 4, 24, 10
conv_multi = jax.jit(causal_conv1d)
conv_step = jax.jit(causal_conv1d_step)


def conv_inputs(rng, B=3):
    x = rng.standard_normal((B, TC, C)).astype(np.float32)
    s0 = rng.standard_normal((B, KC - 1, C)).astype(np.float32)
    w = (rng.standard_normal((KC, C)) * 0.3).astype(np.float32)
    return x, s0, w


def conv_numpy(x, s0, w):
    """y[t, c] = silu(sum_j w[j, c] * full[t + j, c]) with full = state ++ x (taps oldest first)."""
    full = np.concatenate([f64(s0), f64(x)], axis=1)
    T = x.shape[1]
    acc = sum(full[:, j:j + T] * f64(w)[j] for j in range(w.shape[0]))
    return silu(acc), full[:, -(w.shape[0] - 1):]


def test_conv_matches_numpy(rng):
    x, s0, w = conv_inputs(rng)
    y, s = conv_multi(x, s0, w)
    y_ref, s_ref = conv_numpy(x, s0, w)
    assert max_abs(y, y_ref) <= 1e-5, "conv output: max abs diff > 1e-5"
    assert np.array_equal(s, s_ref.astype(np.float32)), "conv state must be the exact last KC-1 inputs"


def test_conv_multi_token_equals_step_by_step(rng):
    x, s0, w = conv_inputs(rng)
    y, s = conv_multi(x, s0, w)
    st, ys = jnp.asarray(s0), []
    for t in range(TC):
        yt, st = conv_step(x[:, t], st, w)
        ys.append(yt)
    # Same taps, same fp32 accumulation order: bitwise.
    assert np.array_equal(y, jnp.stack(ys, axis=1)), "multi-token conv output != step-by-step"
    assert np.array_equal(s, st), "multi-token conv state != step-by-step state"


@pytest.mark.parametrize("L", [0, 1, 2, 5, TC])
def test_conv_padded_state_equals_unpadded(rng, L):
    """A row of length L in a padded call keeps exactly the state of an unpadded call of its L tokens (L < KC-1
    included: then part of the old state survives)."""
    x, s0, w = conv_inputs(rng)
    lengths = np.array([L, TC, 3], np.int32)
    y, s = conv_multi(x, s0, w, jnp.asarray(lengths))
    for b, n in enumerate(lengths):
        y_b, s_b = conv_multi(x[b:b + 1, :n], s0[b:b + 1], w)
        assert np.array_equal(s[b:b + 1], s_b), f"row {b} (length {n}): state differs from the unpadded call"
        assert np.array_equal(y[b:b + 1, :n], y_b), f"row {b} (length {n}): valid outputs differ"
    if L == 0:
        assert np.array_equal(s[0], s0[0])


# ---- norms -----------------------------------------------------------------------------------------------------

def test_rms_norm_zero_centred(rng):
    x = (rng.standard_normal((3, 5, 64)) * 2).astype(np.float32)
    w = (rng.standard_normal(64) * 0.1).astype(np.float32)
    eps = 1e-6
    ref = f64(x) / np.sqrt(np.mean(f64(x) ** 2, -1, keepdims=True) + eps) * (1 + f64(w))
    y = jax.jit(rms_norm, static_argnums=2)(x, w, eps)
    assert y.dtype == jnp.float32
    assert max_abs(y, ref) <= 1e-5, "rms_norm (1+w): max abs diff > 1e-5"
    yb = rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), eps)
    assert yb.dtype == jnp.bfloat16
    assert max_abs(yb, ref) <= 2e-2 * np.abs(ref).max(), "bf16 rms_norm beyond 2e-2 of the output scale"


def test_gated_rms_norm_plain_weight(rng):
    x = (rng.standard_normal((3, 5, 4, 16)) * 2).astype(np.float32)
    z = (rng.standard_normal((3, 5, 4, 16)) * 2).astype(np.float32)
    w = (1 + rng.standard_normal(16) * 0.1).astype(np.float32)
    eps = 1e-6
    n = f64(x) / np.sqrt(np.mean(f64(x) ** 2, -1, keepdims=True) + eps)
    ref = f64(w) * n * silu(f64(z))
    y = jax.jit(gated_rms_norm, static_argnums=3)(x, z, w, eps)
    assert max_abs(y, ref) <= 1e-5, "gated_rms_norm: max abs diff > 1e-5"


# ---- partial RoPE ----------------------------------------------------------------------------------------------

def rope_numpy(x, pos, rd, theta):
    x = f64(x)
    inv = theta ** (-np.arange(0, rd, 2) / rd)
    ang = f64(pos)[..., None] * inv  # [B,T,rd/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, :, None]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, :, None]
    r = x[..., :rd]
    half = rd // 2
    rot = np.concatenate([-r[..., half:], r[..., :half]], -1)
    return np.concatenate([r * cos + rot * sin, x[..., rd:]], -1)


@pytest.mark.parametrize("rd", [4, 16])
def test_partial_rope(rng, rd):
    B, T, H, Dh = 2, 7, 3, 16
    x = rng.standard_normal((B, T, H, Dh)).astype(np.float32)
    pos = (rng.integers(0, 300, (B, 1)) + np.arange(T)[None]).astype(np.int32)
    y = jax.jit(apply_rope, static_argnums=(2, 3))(x, pos, rd, 10000.0)
    # fp32 angles of positions < 310: absolute error of a few 1e-5.
    assert max_abs(y, rope_numpy(x, pos, rd, 10000.0)) <= 1e-4, "partial RoPE: max abs diff > 1e-4"
    assert np.array_equal(y[..., rd:], x[..., rd:]), "dims beyond the rotary dim must pass through unchanged"
    y0 = apply_rope(x, np.zeros_like(pos), rd, 10000.0)
    assert np.array_equal(y0, x), "position 0 must be the identity"


# ---- MLP and MoE -----------------------------------------------------------------------------------------------

def test_swiglu_mlp(rng):
    D, I = 16, 24
    p = MLPParams(*(jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32) for s in [(D, I), (D, I), (I, D)]))
    x = rng.standard_normal((5, D)).astype(np.float32)
    ref = (silu(f64(x) @ f64(p.gate_proj)) * (f64(x) @ f64(p.up_proj))) @ f64(p.down_proj)
    assert max_abs(mlp(p, jnp.asarray(x)), ref) <= 1e-5, "SwiGLU MLP: max abs diff > 1e-5"


def moe_numpy(cfg, p, x):
    """Token by token: softmax router, top-k (descending), optional renormalisation, shared expert gate."""
    x = f64(x)
    P = jax.tree.map(f64, p)
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        xt = x[n]
        probs = softmax(xt @ P.router)
        top = np.argsort(-probs)[:cfg.num_experts_per_tok]
        w = probs[top]
        if cfg.norm_topk_prob:
            w = w / w.sum()
        for wj, e in zip(w, top):
            out[n] += wj * ((silu(xt @ P.gate_proj[e]) * (xt @ P.up_proj[e])) @ P.down_proj[e])
        sh = (silu(xt @ P.shared.gate_proj) * (xt @ P.shared.up_proj)) @ P.shared.down_proj
        out[n] += sh / (1 + np.exp(-(xt @ P.shared_gate)[0]))
    return out


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_matches_numpy_loop(rng, norm_topk):
    cfg = dataclasses.replace(jaxgdn.tiny_qwen3_next(), norm_topk_prob=norm_topk)
    D, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    r = lambda *s, sc=0.2: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    p = MoEParams(router=r(D, E, sc=0.5), gate_proj=r(E, D, I), up_proj=r(E, D, I), down_proj=r(E, I, D),
                  shared=MLPParams(r(D, Is), r(D, Is), r(Is, D)), shared_gate=r(D, 1, sc=0.3))
    x = rng.standard_normal((2, 6, D)).astype(np.float32)
    y = jax.jit(moe, static_argnums=0)(cfg, p, x)
    ref = moe_numpy(cfg, p, x.reshape(-1, D)).reshape(x.shape)
    assert y.shape == x.shape
    assert max_abs(y, ref) <= 1e-5, f"MoE (norm_topk_prob={norm_topk}): max abs diff > 1e-5"


@pytest.mark.parametrize("fixed_order", [False, True])
def test_moe_runs_in_bf16_with_fp32_expert_sums(rng, fixed_order):
    """A bf16 MoE on the CPU, as deterministic mode runs it (fixed_order: the down projections through
    `pallas_kernels.expert_down`, fp32 accumulation): it runs (XLA:CPU has no batched bf16 x bf16 -> fp32 dot; until
    2026-12-01 it failed with "Unsupported element type for DotThunk::Execute") and stays within bf16's rounding of
    the float64 loop (2e-2 of the largest output: a dozen bf16 roundings of the activations on the way)."""
    cfg = jaxgdn.tiny_qwen3_next()
    D, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    r = lambda *s, sc=0.2: jnp.asarray(rng.standard_normal(s) * sc, jnp.bfloat16)  # noqa: E731
    p = MoEParams(router=r(D, E, sc=0.5), gate_proj=r(E, D, I), up_proj=r(E, D, I), down_proj=r(E, I, D),
                  shared=MLPParams(r(D, Is), r(D, Is), r(Is, D)), shared_gate=r(D, 1, sc=0.3))
    x = jnp.asarray(rng.standard_normal((3, 5, D)), jnp.bfloat16)
    y = jax.jit(moe, static_argnums=(0, 3))(cfg, p, x, fixed_order)
    ref = moe_numpy(cfg, p, np.asarray(x, np.float32).reshape(-1, D)).reshape(x.shape)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    assert max_abs(y, ref) <= 2e-2 * np.abs(ref).max()


def test_moe_uses_only_top_k_experts(rng):
    """Perturbing an expert that no token routes to changes nothing (bitwise); perturbing a chosen one does."""
    cfg = jaxgdn.tiny_qwen3_next()
    D, E, I, Is = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    r = lambda *s, sc=0.2: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    router = np.array(r(D, E, sc=0.5))
    x = rng.standard_normal((8, D)).astype(np.float32)
    x[:, 0] = 1.0  # a constant feature: a large negative router weight on it keeps expert 0 out of every top-k
    router[0, 0] = -100.0
    p = MoEParams(router=jnp.asarray(router), gate_proj=r(E, D, I), up_proj=r(E, D, I), down_proj=r(E, I, D),
                  shared=MLPParams(r(D, Is), r(D, Is), r(Is, D)), shared_gate=r(D, 1))
    logits = f64(x) @ f64(router)
    top = np.argsort(-logits, -1)[:, :cfg.num_experts_per_tok]
    assert not np.any(top == 0), "test setup: expert 0 should be unused"
    y = moe(cfg, p, x)
    p_unused = p._replace(down_proj=p.down_proj.at[0].add(1.0))
    assert np.array_equal(moe(cfg, p_unused, x), y)
    used = int(top[0, 0])
    p_used = p._replace(down_proj=p.down_proj.at[used].add(1.0))
    assert max_abs(moe(cfg, p_used, x), y) > 1e-3


# ---- gated attention with a KV cache ---------------------------------------------------------------------------

def attention_numpy(cfg, p, x, keys0, values0, start, lengths):
    """Per row b: q/gate interleaved per head, (1+w) q/k norms, partial RoPE at start[b]+t, causal GQA over the
    first start[b] cached tokens plus the new valid ones, output * sigmoid(gate), o_proj."""
    P = jax.tree.map(f64, p)
    x = f64(x)
    B, T, D = x.shape
    H, HKV, Dh, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps
    rep = H // HKV
    norm = lambda u, w: u / np.sqrt(np.mean(u * u, -1, keepdims=True) + eps) * (1 + w)  # noqa: E731
    out = np.zeros((B, T, D))
    new_keys, new_values = f64(keys0).copy(), f64(values0).copy()
    for b in range(B):
        L = int(lengths[b])
        qg = (x[b] @ P.q_proj).reshape(T, H, 2 * Dh)
        q, gate = norm(qg[..., :Dh], P.q_norm), qg[..., Dh:].reshape(T, H * Dh)
        k = norm((x[b] @ P.k_proj).reshape(T, HKV, Dh), P.k_norm)
        v = (x[b] @ P.v_proj).reshape(T, HKV, Dh)
        pos = (start[b] + np.arange(T))[None]
        q = rope_numpy(q[None], pos, cfg.rotary_dim, cfg.rope_theta)[0]
        k = rope_numpy(k[None], pos, cfg.rotary_dim, cfg.rope_theta)[0]
        K_all = np.concatenate([f64(keys0)[b, :start[b]], k[:L]], 0)
        V_all = np.concatenate([f64(values0)[b, :start[b]], v[:L]], 0)
        new_keys[b, start[b]:start[b] + L] = k[:L]
        new_values[b, start[b]:start[b] + L] = v[:L]
        for t in range(L):
            n = start[b] + t + 1
            o = np.zeros((H, Dh))
            for h in range(H):
                sc = K_all[:n, h // rep] @ q[t, h] * Dh**-0.5
                o[h] = softmax(sc) @ V_all[:n, h // rep]
            out[b, t] = (o.reshape(-1) * (1 / (1 + np.exp(-gate[t])))) @ P.o_proj
    return out, new_keys, new_values


def test_gated_attention_with_cache(rng):
    cfg = jaxgdn.tiny_qwen3_5()
    D, H, HKV, Dh, N, B, T = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, 32, 2, 6
    r = lambda *s, sc=0.2: jnp.asarray(rng.standard_normal(s) * sc, jnp.float32)  # noqa: E731
    p = AttentionParams(q_proj=r(D, H * 2 * Dh), k_proj=r(D, HKV * Dh), v_proj=r(D, HKV * Dh), o_proj=r(H * Dh, D),
                        q_norm=r(Dh, sc=0.1), k_norm=r(Dh, sc=0.1))
    start = np.array([9, 0], np.int32)
    lengths = np.array([6, 4], np.int32)
    keys0 = np.asarray(rng.standard_normal((B, N, HKV, Dh)), np.float32)
    values0 = np.asarray(rng.standard_normal((B, N, HKV, Dh)), np.float32)
    for b in range(B):  # slots at or beyond a row's position hold garbage that must never be read
        keys0[b, start[b]:] = 1e3
        values0[b, start[b]:] = -1e3
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    y, st = jax.jit(attention, static_argnums=0)(cfg, p, x, AttentionLayerState(jnp.asarray(keys0),
                                                                                 jnp.asarray(values0)),
                                                 jnp.asarray(start), jnp.asarray(lengths))
    y_ref, k_ref, v_ref = attention_numpy(cfg, p, x, keys0, values0, start, lengths)
    valid = (np.arange(T)[None] < lengths[:, None])[..., None]
    assert max_abs(np.where(valid, y, 0), np.where(valid, y_ref, 0)) <= 1e-5, "attention output: max abs diff > 1e-5"
    assert max_abs(st.keys, k_ref) <= 1e-5, "cached keys: max abs diff > 1e-5"
    assert max_abs(st.values, v_ref) <= 1e-5, "cached values: max abs diff > 1e-5"
    # Slots not written (beyond start+length) keep their old content bitwise: padded tokens are dropped.
    for b in range(B):
        e = start[b] + lengths[b]
        assert np.array_equal(st.keys[b, e:], keys0[b, e:]) and np.array_equal(st.values[b, e:], values0[b, e:])
