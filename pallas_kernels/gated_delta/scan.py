"""Token-by-token gated delta rule over a whole prompt (a prefill with the decode arithmetic): a Pallas-Triton
kernel for the H200 (interpretable on CPU).

Dimension legend in `reference.py`. Grid (V // BV, HV, B): one program per (batch row, value head, V block) keeps
its fp32 state block S [K, BV] on chip for the whole call and runs, for t = 0 .. T - 1, exactly the decode
kernel's per-token arithmetic (`recurrent.token_update`: S = exp(g) S; u = beta (v - S^T k);
o = scale (S^T q + (q.k) u); S = S + k u^T, q and k fp32-L2-normalised). Inputs are loaded `ahead` tokens
ahead (default 2) and normalised one token ahead (a software pipeline: none of it depends on S, so its latency
hides behind the chain of state updates).

Why it exists (deterministic mode, `jaxgdn`'s `gdn_prefill="recurrent"`): a chunked prefill and a recurrent decode
compute the same recurrence with different arithmetic, so a decoded state is not bitwise the state a prefill of
the same tokens produces. With this kernel the prefill *is* the recurrence, token by token: a one-token call is
the decode step, and any split of a prompt — on the 64 grid or not — gives the same bits as the unsplit call.
The price is a sequential chain of T steps per program (no tensor cores): BENCHMARKS.md measures it against the
chunked kernels.

Padded tokens (t >= lengths[b]) leave the state bit-identical and give o = 0: the loop over tokens stops at
lengths[b] (clipped to [0, T]; no per-token select over the state block), and a second loop writes their zero
outputs. (Its trip count being a runtime value also keeps interpret mode exact for one-token calls: XLA on CPU
inlines a loop of one static trip and fuses it with its neighbours, which changes the rounding with the batch.)
In-call checkpoints: exact copies of the state after every `checkpoint_stride` tokens (any positive stride).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config import merged_config, static_config
from .recurrent import DEFAULT_CONFIG as _DECODE_CONFIG
from .arith import fma_mode
from .recurrent import _normalized, k_slices, load_slices, store_slices, token_update

# Launch configuration: bv (V block per program: 8 or a power of two >= 16), warps, stages, and the load pipeline. A
# prefill and a one-token call agree bit for bit only under the same bv and warps (the reductions over K follow the
# layout), so the model uses this one for both. Chosen on the H200 (BENCHMARKS.md, runs 10, 12, 14, 17 and 18; HK=16
# HV=32): bv=16 with one warp, with the per-token arithmetic on 4 state slices with FMAs, takes 5.8-5.9 / 7.0 / 22.5 ms
# on (1, 8192) / (8, 4096) / (1, 32768) tokens (the previous arithmetic 6.3-6.4 / 8.1-8.2 / 24.8-24.9; the chunked
# kernels 2.2 / 6.1 / 8.4 then, 1.16 / 3.63 / 4.39 since run 32) and a one-token call 1.27-1.54x the decode kernel at
# B=64, 1.33-1.37x at B=256 (issue 7's bar: <= 1.5x; at B=64 runs 17, 18 and 22 read 1.54, 1.27 and 1.37, the old
# arithmetic 1.26-1.45x). With the previous arithmetic bv=8 was faster at B=1 (5.7 ms) but slower at B=8 and 1.7x at one
# token (with the current one: 10.7 ms at B=1); bv=32 with 2 warps was 1.12-1.18x at one token but 8.2 ms at B=1. The
# kernel is bound by instruction issue (Nsight Compute, previous arithmetic: ~690 per token and warp).
# ahead: how many tokens ahead inputs are loaded (1..8; 1 costs 55%; 4, with the loads carried unconverted, 21-25%
# at bv=16; carrying them unconverted alone changed nothing beyond 3% and was dropped, run 14). It moves the loads,
# not the arithmetic.
# kslices, fma: the per-token arithmetic's (`recurrent.DEFAULT_CONFIG`: the decode kernel's, so that both kernels
# compute the same bits). Runs 17-18, (1, 8192) ms: 4 slices + FMAs 5.8-5.9; 8 slices 6.3; 2 slices 8.0; one slice
# with FMAs 8.7 (the inline-assembly update alone is slower than a separate multiply and add); 4 slices without FMAs
# 6.4; bv=8 with 4 slices 10.7.
DEFAULT_CONFIG = dict(bv=16, num_warps=1, num_stages=1, ahead=2, kslices=_DECODE_CONFIG["kslices"],
                      fma=_DECODE_CONFIG["fma"])


def _scan_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, so_ref, *ck_refs, T, stride, nck,
                 scale, use_l2, ahead, nk, fma, interpret):
    n = len_ref[0]  # valid tokens of this row (<= T): the recurrence runs over t < n only

    def load(t):  # token t's inputs in fp32 (t clamped: a prefetch past the end rereads the last token)
        t = jnp.minimum(t, T - 1)
        one = pl.ds(t, 1)
        return ((load_slices(q_ref, nk, (t,)), load_slices(k_ref, nk, (t,)))
                + tuple(x.astype(jnp.float32) for x in (v_ref[t], g_ref[one], beta_ref[one])))

    def ready(x):  # q, k (nk slices each) normalised (q scaled), q . k, v, g, beta
        return _normalized(x[0], x[1], use_l2, scale, interpret, fma) + x[2:]

    def checkpoint(t, s):  # the state after token t, when t + 1 is a multiple of the stride
        if nck:
            @pl.when(lax.rem(t + 1, stride) == 0)  # (m <= nck: t < T)
            def _():
                store_slices(ck_refs[0], s, (lax.div(t + 1, stride) - 1,))

    def body(t, carry):
        # cur: token t, ready; queue: tokens t + 1 .. t + ahead - 1, as loaded. Token t + ahead is loaded here and
        # token t + 1 normalised: neither depends on s, so their latency hides behind the chain of state updates.
        s, cur, queue = carry
        queue = queue + (load(t + ahead),)
        o, s = token_update(s, *cur, interpret, fma)
        o_ref[t] = o.astype(o_ref.dtype)
        checkpoint(t, s)
        return s, ready(queue[0]), queue[1:]

    init = (load_slices(s_ref, nk), ready(load(0)), tuple(load(i) for i in range(1, ahead)))
    s, _, _ = lax.fori_loop(0, n, body, init)

    def pad(t, carry):  # padded tokens: o = 0, the state untouched
        o_ref[t] = jnp.zeros(o_ref.shape[1:], o_ref.dtype)
        checkpoint(t, s)
        return carry

    lax.fori_loop(n, T, pad, 0)
    store_slices(so_ref, s)


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "checkpoint_stride", "interpret", "config"))
def _scan_impl(q, k, v, g, beta, state, lengths, *, scale, use_qk_l2norm, checkpoint_stride, interpret, config):
    cfg = merged_config("fused_recurrent_gated_delta_rule", DEFAULT_CONFIG, config, blocks={"bv": v.shape[3]},
                        min_block=8)
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // HK
    bv = min(cfg["bv"], V)
    if type(cfg["ahead"]) is not int or not 1 <= cfg["ahead"] <= 8:
        raise ValueError(f"fused_recurrent_gated_delta_rule: ahead={cfg['ahead']!r} must be an integer in 1..8")
    nck = 0 if checkpoint_stride is None else T // checkpoint_stride
    out_specs = [pl.BlockSpec((None, T, None, bv), lambda j, h, b: (b, 0, h, j)),
                 pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j))]
    out_shape = [jax.ShapeDtypeStruct((B, T, HV, V), v.dtype), jax.ShapeDtypeStruct((B, HV, K, V), jnp.float32)]
    if nck:
        out_specs.append(pl.BlockSpec((None, nck, None, K, bv), lambda j, h, b: (b, 0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, nck, HV, K, V), jnp.float32))
    from jax.experimental.pallas import triton as pltriton

    outs = pl.pallas_call(
        functools.partial(_scan_kernel, T=T, stride=checkpoint_stride or 0, nck=nck, scale=scale,
                          use_l2=use_qk_l2norm, ahead=cfg["ahead"], nk=k_slices(K, cfg["kslices"]),
                          fma=fma_mode(cfg["fma"], interpret), interpret=interpret),
        grid=(V // bv, HV, B),
        in_specs=[
            pl.BlockSpec((1,), lambda j, h, b: (b,)),
            pl.BlockSpec((None, T, None, K), lambda j, h, b: (b, 0, h // G, 0)),
            pl.BlockSpec((None, T, None, K), lambda j, h, b: (b, 0, h // G, 0)),
            pl.BlockSpec((None, T, None, bv), lambda j, h, b: (b, 0, h, j)),
            pl.BlockSpec((None, T, None), lambda j, h, b: (b, 0, h)),
            pl.BlockSpec((None, T, None), lambda j, h, b: (b, 0, h)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={6: 1},
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="gdn_scan",
    )(lengths, q, k, v, g, beta, state)
    if checkpoint_stride is None:
        return outs[0], outs[1]
    ck = outs[2] if nck else jnp.zeros((B, 0, HV, K, V), jnp.float32)
    return outs[0], outs[1], ck


def fused_recurrent_gated_delta_rule_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True,
                                            lengths=None, checkpoint_stride=None, interpret=False, config=None):
    """The recurrence token by token over T tokens, with the decode kernel's arithmetic.

    q, k: [B,T,HK,K] (bf16 or fp32); v: [B,T,HV,V]; g: fp32 log-decay [B,T,HV]; beta: [B,T,HV]; initial_state fp32
    [B,HV,K,V] or None (updated in place when donated); lengths int32 [B] or None; checkpoint_stride None or a
    positive int. Returns (o [B,T,HV,V] in v.dtype, final_state fp32 [B,HV,K,V]) or (o, final_state, checkpoints
    [B, T // stride, HV, K, V]: the state after every `stride` tokens). `config`: see DEFAULT_CONFIG.
    """
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [B,T,HK,K] and v [B,T,HV,V]; got {q.shape}, {k.shape}, {v.shape}")
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if T < 1:
        raise ValueError("T must be at least 1")
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B,T,HV]={(B, T, HV)}; got {g.shape}, {beta.shape}")
    if checkpoint_stride is not None and checkpoint_stride <= 0:
        raise ValueError(f"checkpoint_stride must be positive; got {checkpoint_stride}")
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n}: the Pallas-Triton kernel needs a power of two >= 16")
    if initial_state is None:
        initial_state = jnp.zeros((B, HV, K, V), jnp.float32)
    elif initial_state.shape != (B, HV, K, V):
        raise ValueError(f"initial_state must be [B,HV,K,V]={(B, HV, K, V)}; got {initial_state.shape}")
    scale = float(K**-0.5 if scale is None else scale)
    lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
               else jnp.clip(jnp.asarray(lengths, jnp.int32), 0, T))  # the kernel's loops index o with them
    config = static_config(config)
    return _scan_impl(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32), initial_state.astype(jnp.float32),
                      lengths, scale=scale, use_qk_l2norm=bool(use_qk_l2norm), checkpoint_stride=checkpoint_stride,
                      interpret=bool(interpret), config=config)
