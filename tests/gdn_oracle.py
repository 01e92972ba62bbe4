"""Independent float64 NumPy oracle for the gated delta rule, and random realistic inputs.

Written directly from the recurrence (no chunking, no JAX) so it shares no code with what it checks.
"""

from __future__ import annotations

import numpy as np


def _l2n(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_delta_rule_oracle(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, lengths=None):
    """q, k: [B,T,HK,K]; v: [B,T,HV,V]; g, beta: [B,T,HV]. Returns (o [B,T,HV,V], final_state [B,HV,K,V]), float64.

    Outputs at padded positions (t >= lengths[b]) are returned as zeros.
    """
    q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
    B, T, HK, K = q.shape
    HV, V = v.shape[2:]
    r = HV // HK
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = _l2n(q), _l2n(k)
    s = np.zeros((B, HV, K, V)) if initial_state is None else np.array(initial_state, np.float64)
    o = np.zeros((B, T, HV, V))
    lengths = np.full(B, T) if lengths is None else np.asarray(lengths)
    for b in range(B):
        for t in range(int(lengths[b])):
            for h in range(HV):
                kt, qt = k[b, t, h // r], q[b, t, h // r] * scale
                st = s[b, h] * np.exp(g[b, t, h])
                u = beta[b, t, h] * (v[b, t, h] - kt @ st)
                st = st + np.outer(kt, u)
                s[b, h] = st
                o[b, t, h] = qt @ st
    return o, s


def random_gdn_inputs(rng: np.random.Generator, B, T, HK, HV, K, V, dtype=np.float32, *, g_kind="realistic",
                      beta_kind="realistic", with_state=True):
    """Fresh random inputs with realistic gates (never all-zero).

    g_kind: 'realistic' (log-decay from A_log/dt_bias-like draws, mostly in [-1.5, 0)), 'near_zero' (|g| < 1e-3),
    'very_negative' (g in [-30, -10]: the state is all but forgotten each token).
    beta_kind: 'realistic' (sigmoid of normal), 'zero', 'one', 'mixed' (a mix of 0, 1 and sigmoid draws).
    Returns dict(q, k, v, g, beta, initial_state) as NumPy arrays (q/k/v in `dtype`, the rest float32).
    """
    q = rng.standard_normal((B, T, HK, K)).astype(dtype)
    k = rng.standard_normal((B, T, HK, K)).astype(dtype)
    v = rng.standard_normal((B, T, HV, V)).astype(dtype)
    if g_kind == "realistic":
        A = rng.uniform(1.0, 16.0, HV)
        a = rng.standard_normal((B, T, HV)) - 2.0
        g = -A * np.log1p(np.exp(a)) / 4.0
    elif g_kind == "near_zero":
        g = -rng.uniform(0.0, 1e-3, (B, T, HV))
    elif g_kind == "very_negative":
        g = -rng.uniform(10.0, 30.0, (B, T, HV))
    else:
        raise ValueError(g_kind)
    sig = 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV))))
    if beta_kind == "realistic":
        beta = sig
    elif beta_kind == "zero":
        beta = np.zeros((B, T, HV))
    elif beta_kind == "one":
        beta = np.ones((B, T, HV))
    elif beta_kind == "mixed":
        pick = rng.integers(0, 3, (B, T, HV))
        beta = np.where(pick == 0, 0.0, np.where(pick == 1, 1.0, sig))
    else:
        raise ValueError(beta_kind)
    s0 = (rng.standard_normal((B, HV, K, V)) * 0.5).astype(np.float32) if with_state else None
    return dict(q=q, k=k, v=v, g=g.astype(np.float32), beta=beta.astype(np.float32), initial_state=s0)


def rel_err(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))
