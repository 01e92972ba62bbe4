"""One-token recurrent gated delta rule (decode): a Pallas-Triton kernel for the H200 (interpretable on CPU).

Grid (V // BV, HV, B): one program per (batch row, value head, V block). Each program reads its fp32 state block
S [K, BV] once, applies
    S = exp(g) S;  u = beta (v - S^T k);  o = scale (S^T q + (q.k) u);  S = S + k u^T   (q, k fp32-L2-normalised)
with elementwise fp32 arithmetic — the block held in row slices so that the reductions over K start with FMAs
across slices, then fixed-order reductions (no tensor cores: no TF32 rounding) — and writes S back once, in place
(`input_output_aliases`; callers donate the state). With `A_log`/`dt_bias` given, `g` and `beta`
carry the raw `a` and `b` and the gates are computed inside in fp32: g = -exp(A_log) softplus(a + dt_bias),
beta = sigmoid(b). The per-token arithmetic (`token_update`) is shared with the token-by-token prefill kernel
(`scan.py`), which under the same launch configuration gives the same bits (tested on CPU and on the H200).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config import merged_config, static_config
from ..invariant import tree_sum
from .arith import fma as _fma
from .arith import fma_mode

_EPS = 1e-6
# Measured on the H200 (BENCHMARKS.md, run 12), kernel-only, B=64/256: bv=64, 4 warps 3.49/3.71 TB/s; 8 warps
# 3.46/3.68; bv=32, 4 warps 3.34/3.54; bv=128, 8 warps 2.60/2.78. bv may also be 8 (no dots here; the scan kernel's
# configurations). Run 19, the current arithmetic (4 slices, FMAs): 3.47/3.78 TB/s, against 3.31/3.69 for the
# previous one (kslices=1, fma=False) and 3.44/3.66 with 8 slices in the same run.
# kslices: the state block held in that many row slices (`k_slices`), so that the reductions over K combine the
# slices with FMAs before reducing; fma: FMAs (one rounding) in those slice combinations and in the state update.
# Both change the bits, so the scan kernel shares them (its DEFAULT_CONFIG takes them from here).
DEFAULT_CONFIG = dict(bv=64, num_warps=4, num_stages=1, kslices=4, fma=True)


def _softplus(x):
    # log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), as jax.nn.softplus (logaddexp(x, 0)).
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def _ksum(x, interpret):
    """Sum over axis 0 (K). On the GPU Triton's reduction (its order follows the layout, fixed by the launch
    configuration); in interpret mode a fixed pairwise tree (`invariant.tree_sum`): XLA's CPU reductions pick
    their order by context, so a loop body and a single step could otherwise differ in the last bit."""
    return tree_sum(jnp.moveaxis(x, 0, -1)) if interpret else jnp.sum(x, axis=0)


def _slice_dot(xs, ys, fused):
    """sum_i xs[i] * ys[i] over the K slices, elementwise: one multiply, then FMAs in slice order."""
    acc = xs[0] * ys[0]
    for x, y in zip(xs[1:], ys[1:]):
        acc = _fma(x, y, acc, fused)
    return acc


def k_slices(K: int, kslices: int) -> int:
    """How many row slices a state block [K, BV] is held in: `kslices` (config), fewer when a slice would have
    under 16 rows. Fixed by K and the config, so every kernel with the same config slices alike."""
    if type(kslices) is not int or kslices < 1 or kslices & (kslices - 1):
        raise ValueError(f"kslices={kslices!r} must be a power of two >= 1")
    return max(1, min(kslices, K // 16))


def _normalized(q, k, use_l2, scale, interpret=False, fused=False):
    """fp32 q, k as tuples of K slices [K / n], L2-normalised (optional); q scaled. Returns (q, k, qk [1] = q . k),
    qk for `token_update`."""
    if use_l2:
        q = tuple(x * lax.rsqrt(_ksum(_slice_dot(q, q, fused), interpret) + _EPS) for x in q)
        k = tuple(x * lax.rsqrt(_ksum(_slice_dot(k, k, fused), interpret) + _EPS) for x in k)
    q = tuple(x * scale for x in q)
    return q, k, _ksum(_slice_dot(q, k, fused), interpret)[None]


def token_update(s, q, k, qk, v, g, beta, interpret=False, fused=False):
    """One token of the recurrence on a state block held in n row slices: s, a tuple of fp32 [K / n, BV]; q
    (normalised, scaled), k: tuples of [K / n]; qk [1] = q . k (from `_normalized`); v [BV]; g, beta [1], all fp32.
    Returns (o [BV] fp32, s as a tuple of slices).

    With S the decayed state exp(g) s: u = beta (v - S^T k), s' = S + k u^T, and o = s'^T q computed as
    S^T q + (q . k) u. The two reductions over K read S only, so they are independent of each other and of the
    update (a shorter dependency chain per token than reducing s' after the update), and q . k comes off the
    chain. Each reduction first combines the slices elementwise (`_slice_dot`: FMAs on the GPU), then reduces
    the [K / n, BV] result; the update is one FMA per element. The decode kernel and the token-by-token prefill
    kernel (`gated_delta.scan`) both call this, so that with the same launch configuration they compute the same
    bits. fused: the slice combinations and the state update as FMAs (`arith.fma`); the output's sq + qk u and the
    normalisation's scaling stay a separate multiply and add."""
    a = jnp.exp(g)[:, None]  # [1, 1]
    s = tuple(x * a for x in s)  # [K / n, BV] each
    kv = _ksum(_slice_dot(s, tuple(x[:, None] for x in k), fused), interpret)  # [BV]
    sq = _ksum(_slice_dot(s, tuple(x[:, None] for x in q), fused), interpret)  # [BV]
    u = beta * (v - kv)
    return sq + qk * u, tuple(_fma(x[:, None], u[None, :], y, fused) for x, y in zip(k, s))


def load_slices(ref, n, index=()):
    """ref[*index, rows of slice i] for i < n, in fp32: a [K] vector or a [K, BV] block as n row slices."""
    K = ref.shape[len(index)]
    kn = K // n
    return tuple(ref[(*index, pl.ds(i * kn, kn))].astype(jnp.float32) for i in range(n))


def store_slices(ref, xs, index=()):
    """Write n row slices [K / n, BV] into ref[*index] ([K, BV])."""
    kn = xs[0].shape[0]
    for i, x in enumerate(xs):
        ref[(*index, pl.ds(i * kn, kn))] = x


def _decode_kernel(*refs, scale, use_l2, fused, n, fma, interpret):
    if fused:
        q_ref, k_ref, v_ref, g_ref, beta_ref, alog_ref, dtb_ref, s_ref, o_ref, so_ref = refs
    else:
        q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, so_ref = refs
    q, k, qk = _normalized(load_slices(q_ref, n), load_slices(k_ref, n), use_l2, scale, interpret,
                           fma)  # n x [K / n], n x [K / n], [1]
    v = v_ref[...].astype(jnp.float32)  # [BV]
    g = g_ref[...].astype(jnp.float32)  # [1]
    beta = beta_ref[...].astype(jnp.float32)
    if fused:
        g = -jnp.exp(alog_ref[...].astype(jnp.float32)) * _softplus(g + dtb_ref[...].astype(jnp.float32))
        beta = 1.0 / (1.0 + jnp.exp(-beta))
    o, s = token_update(load_slices(s_ref, n), q, k, qk, v, g, beta, interpret, fma)
    store_slices(so_ref, s)
    o_ref[...] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "fused", "interpret", "config"))
def _decode_impl(q, k, v, g, beta, state, A_log, dt_bias, *, scale, use_qk_l2norm, fused, interpret, config):
    cfg = merged_config("recurrent_gated_delta_rule", DEFAULT_CONFIG, config, blocks={"bv": v.shape[2]},
                        min_block=8)
    B, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    G = HV // HK
    bv = min(cfg["bv"], V)
    nv = V // bv
    g = g.reshape(B, HV, 1)
    beta = beta.reshape(B, HV, 1)
    in_specs = [
        pl.BlockSpec((None, None, K), lambda j, h, b: (b, h // G, 0)),
        pl.BlockSpec((None, None, K), lambda j, h, b: (b, h // G, 0)),
        pl.BlockSpec((None, None, bv), lambda j, h, b: (b, h, j)),
        pl.BlockSpec((None, None, 1), lambda j, h, b: (b, h, 0)),
        pl.BlockSpec((None, None, 1), lambda j, h, b: (b, h, 0)),
    ]
    args = [q, k, v, g, beta]
    if fused:
        in_specs += [pl.BlockSpec((None, 1), lambda j, h, b: (h, 0))] * 2
        args += [A_log.astype(jnp.float32).reshape(HV, 1), dt_bias.astype(jnp.float32).reshape(HV, 1)]
    in_specs.append(pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)))
    args.append(state)
    from jax.experimental.pallas import triton as pltriton

    o, new_state = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, use_l2=use_qk_l2norm, fused=fused,
                          n=k_slices(K, cfg["kslices"]), fma=fma_mode(cfg["fma"], interpret), interpret=interpret),
        grid=(nv, HV, B),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, bv), lambda j, h, b: (b, h, j)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, HV, V), v.dtype), jax.ShapeDtypeStruct((B, HV, K, V), jnp.float32)],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="gdn_decode",
    )(*args)
    return o, new_state


def recurrent_gated_delta_rule_pallas(q, k, v, g, beta, *, initial_state, scale=None, use_qk_l2norm=True,
                                      A_log=None, dt_bias=None, interpret=False, config=None):
    """One recurrent step per row. q, k: [B,HK,K]; v: [B,HV,V]; g, beta: [B,HV] (or raw a, b with A_log/dt_bias
    [HV]); initial_state fp32 [B,HV,K,V], updated in place when the caller donates it (inside the caller's jit, or
    `jax.jit(..., donate_argnames=...)`). Returns (o [B,HV,V] in v.dtype, new_state).
    """
    if q.ndim != 3 or k.shape != q.shape or v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"expected q, k [B,HK,K] and v [B,HV,V]; got {q.shape}, {k.shape}, {v.shape}")
    B, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if g.shape != (B, HV) or beta.shape != (B, HV):
        raise ValueError(f"g and beta must be [B,HV]={(B, HV)}; got {g.shape}, {beta.shape}")
    if initial_state.shape != (B, HV, K, V) or initial_state.dtype != jnp.float32:
        raise ValueError(f"initial_state must be fp32 [B,HV,K,V]={(B, HV, K, V)}; got "
                         f"{initial_state.dtype} {initial_state.shape}")
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n}: the Pallas-Triton kernel needs a power of two >= 16")
    fused = A_log is not None
    if fused != (dt_bias is not None):
        raise ValueError("A_log and dt_bias go together")
    scale = float(K**-0.5 if scale is None else scale)
    config = static_config(config)
    return _decode_impl(q, k, v, g, beta, initial_state, A_log, dt_bias, scale=scale,
                        use_qk_l2norm=bool(use_qk_l2norm), fused=fused, interpret=bool(interpret), config=config)
