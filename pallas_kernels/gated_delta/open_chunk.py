"""Replay decode step on the default prefill arithmetic: the open chunk recomputed in one fused kernel — a
Pallas-Triton kernel for the H200 (interpretable on CPU).

Dimension legend as in `reference.py`; C = 64 (the chunk); n = lengths[b], the open chunk's valid rows after the
new token was appended (the new token is row n - 1).

Why this reproduces a prefill: the chunked prefill (`chunk.py`, split design) is row-causal inside a chunk — masked
terms are exact zeros and no reduction's order depends on how many rows are real — so the rows < n of a chunk
holding n valid tokens are bitwise the rows a longer call computes for them. A decode step can therefore recompute
the whole open chunk from the boundary state S (the state at the chunk's start) and keep row n - 1. The default
path for that (`chunk_gated_delta_rule` on the open chunk) runs four kernels and moves ~10x the state's bytes per
step through memory (w, u, kd, the per-chunk states h, v_new, the final state, a checkpoint copy). This kernel
runs the same arithmetic, call for call, in one program per (value head, batch row) and touches memory once:

  1. gc = cumsum(masked g); k L2-normalised; X = (I + A)^-1   (`_inverse_kernel`: `_wy_inverse`)
  2. w, u, kd                                                    (`_apply_kernel`: `_apply_wy`)
  3. v_new = u - w S                                             (`_state_split_kernel`)
  4. o = qg S + Aqk v_new; row n - 1 written                     (`_out_kernel`: `_intra`)
  5. where n = 64 (the chunk is full): the next boundary state S exp(gc_63) + kd^T v_new, written in place
     (`input_output_aliases`; other rows' states are not written: callers donate the state).

Every step is the same helper function the prefill kernels call, with the same tile shapes and warps, except
that the dots of steps 3 and 5 run over the full V = 128 columns where the recurrence kernel takes V blocks of
`bv` (64): an MMA output element accumulates over K in the same order whatever N is, which the GPU script checks
(`scripts/gpu_kernels.py --only replay_chunk`: bitwise against the prefill on the H200). On CPU (interpret mode)
the tests check the same equality.

Cost per step: the state is read once and written once per 64 tokens, against read + write every step for the
recurrent kernel; the compute is one 64-row chunk of the prefill per (row, head).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .chunk import (CHUNK, DEFAULT_CONFIG as CHUNK_CONFIG, _apply_wy, _dot, _intra, _last, _load_key, _triton_params,
                    _wy_inverse)

# The prefill configuration whose arithmetic this kernel repeats; its warps are the prefill kernels' (all 4).
_SUPPORTED_INV = ("block16", "doubling", "fwd64")


def _columns(groups: int, HK: int, K: int, HV: int, V: int):
    """Column offsets in the mixed buffer [.., C_mix] (G groups of [q_g | k_g | v_g], the model's in_proj_qkv
    layout) of key head hk's q and k and value head h's v."""
    cg = (2 * HK * K + HV * V) // groups
    hkg, hvg = HK // groups, HV // groups

    def q_col(hk):
        return (hk // hkg) * cg + (hk % hkg) * K

    def k_col(hk):
        return (hk // hkg) * cg + hkg * K + (hk % hkg) * K

    def v_col(h):
        return (h // hvg) * cg + 2 * hkg * K + (h % hvg) * V

    return q_col, k_col, v_col


def _open_chunk_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, so_ref, *, scale, use_l2, cfg,
                       interpret):
    n = len_ref[0]
    iota = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    valid = iota < n
    # 1-2. the prep kernels' arithmetic
    gc = jnp.cumsum(jnp.where(valid, g_ref[...].astype(jnp.float32), 0.0))
    k = _load_key(k_ref, valid, use_l2)
    beta = jnp.where(valid, beta_ref[...].astype(jnp.float32), 0.0)
    x = _wy_inverse(k, beta, gc, cfg, interpret)
    v = jnp.where(valid[:, None], v_ref[...].astype(jnp.float32), 0.0)
    w, u, kd = _apply_wy(x, k, v, beta, gc, cfg, interpret)
    # 3. the recurrence kernel's v_new
    s = s_ref[...].astype(jnp.float32)  # [K, V]
    v_new = u - _dot(w, s, cfg["p_ws"], interpret)
    # 4. the output kernel's arithmetic; row n - 1 picked exactly (-0.0 elsewhere: x + -0.0 == x for every x)
    q = _load_key(q_ref, valid, use_l2) * scale
    aqk, qg = _intra(q, k, gc, cfg, interpret)
    o = _dot(qg, s, cfg["p_qs"], interpret) + _dot(aqk, v_new, cfg["p_av"], interpret)
    o_ref[...] = jnp.sum(jnp.where((iota == n - 1)[:, None], o, -0.0), axis=0).astype(o_ref.dtype)

    @pl.when(n == CHUNK)
    def _():  # 5. the chunk is full: the recurrence kernel's next state
        so_ref[...] = s * jnp.exp(_last(gc)) + _dot(kd, v_new, cfg["p_kv"], interpret, trans_a=True)


@functools.partial(jax.jit, static_argnames=("groups", "scale", "use_qk_l2norm", "interpret", "config", "num_warps"))
def _open_chunk_impl(open_qkv, open_gates, state, lengths, *, groups, scale, use_qk_l2norm, interpret, config,
                     num_warps):
    cfg = dict(CHUNK_CONFIG, **dict(config or ()))
    B, HV, K, V = state.shape
    HK = (open_qkv.shape[2] - HV * V) // (2 * K)
    G = HV // HK
    q_col, k_col, v_col = _columns(groups, HK, K, HV, V)
    return pl.pallas_call(
        functools.partial(_open_chunk_kernel, scale=scale, use_l2=use_qk_l2norm, cfg=cfg, interpret=interpret),
        grid=(HV, B),
        in_specs=[
            pl.BlockSpec((1,), lambda h, b: (b,)),
            pl.BlockSpec((None, CHUNK, K), lambda h, b: (b, 0, q_col(h // G) // K)),
            pl.BlockSpec((None, CHUNK, K), lambda h, b: (b, 0, k_col(h // G) // K)),
            pl.BlockSpec((None, CHUNK, V), lambda h, b: (b, 0, v_col(h) // V)),
            pl.BlockSpec((None, CHUNK, None, None), lambda h, b: (b, 0, 0, h)),
            pl.BlockSpec((None, CHUNK, None, None), lambda h, b: (b, 0, 1, h)),
            pl.BlockSpec((None, None, K, V), lambda h, b: (b, h, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, V), lambda h, b: (b, h, 0)),
            pl.BlockSpec((None, None, K, V), lambda h, b: (b, h, 0, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, HV, V), open_qkv.dtype), jax.ShapeDtypeStruct((B, HV, K, V), jnp.float32)],
        input_output_aliases={6: 1},
        compiler_params=_triton_params(num_warps or cfg["warps_out"], 1),
        interpret=interpret,
        name="gdn_replay_open_chunk",
    )(lengths, open_qkv, open_qkv, open_qkv, open_gates, open_gates, state)


def replay_open_chunk_pallas(open_qkv, open_gates, state, lengths, *, groups: int = 1, scale=None,
                             use_qk_l2norm=True, interpret=False, config=None, num_warps=None):
    """One replay decode step per row: the default prefill's output for the newest token of the open chunk.

    open_qkv [B, C, C_mix]: the open chunk's post-conv q|k|v (G = `groups` groups of [q_g | k_g | v_g]) with the
    new token at row lengths[b] - 1; rows >= lengths[b] are ignored (masked). open_gates [B, C, 2, HV]: g and beta,
    likewise. state fp32 [B, HV, K, V]: the state at the chunk's start (the last grid boundary). lengths int32 [B]
    in [1, 64]. config: the prefill configuration to reproduce (`chunk.DEFAULT_CONFIG` by default; its
    precisions and `inv` matter). num_warps: the kernel's warps (default: the prefill's output-kernel warps, 4;
    a launch choice, checked bitwise on the GPU by `scripts/gpu_kernels.py --only replay_chunk`).

    Returns (o [B, HV, V] in open_qkv's dtype, state): o bitwise the output `chunk_gated_delta_rule_pallas` gives
    that token (same config) when it prefills the chunk from the same boundary state; the state replaced, where
    lengths[b] == 64, by the prefill's state after the chunk (in place when donated), unchanged elsewhere.
    """
    if state.ndim != 4 or state.dtype != jnp.float32:
        raise ValueError(f"state must be fp32 [B,HV,K,V]; got {state.dtype} {state.shape}")
    B, HV, K, V = state.shape
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name}={n}: the Pallas-Triton kernel needs a power of two >= 16")
    if open_qkv.ndim != 3 or open_qkv.shape[:2] != (B, CHUNK):
        raise ValueError(f"open_qkv must be [B, {CHUNK}, C_mix] with B={B}; got {open_qkv.shape}")
    rest = open_qkv.shape[2] - HV * V
    if rest <= 0 or rest % (2 * K) or HV % (rest // (2 * K)):
        raise ValueError(f"open_qkv's {open_qkv.shape[2]} columns do not hold q, k [HK*{K}] and v [{HV}*{V}]")
    HK = rest // (2 * K)
    if groups < 1 or HK % groups or HV % groups:
        raise ValueError(f"groups={groups} must divide the key heads ({HK}) and the value heads ({HV})")
    cg = open_qkv.shape[2] // groups
    if cg % K or (2 * (HK // groups) * K) % V or cg % V:
        raise ValueError(f"the buffer's column groups ({cg}) do not align with K={K} and V={V} blocks")
    if open_gates.shape != (B, CHUNK, 2, HV):
        raise ValueError(f"open_gates must be {(B, CHUNK, 2, HV)}; got {open_gates.shape}")
    if num_warps is not None and (not isinstance(num_warps, int) or num_warps < 1):
        raise ValueError(f"num_warps={num_warps!r} must be a positive integer")
    if jnp.shape(lengths) != (B,):
        raise ValueError(f"lengths must be [B]=({B},); got {jnp.shape(lengths)}")
    cfg = dict(CHUNK_CONFIG, **dict(config or ()))
    if cfg["design"] != "split" or cfg["exact"] or cfg["inv"] not in _SUPPORTED_INV:
        raise ValueError(f"the open-chunk replay repeats the split design's default arithmetic (inv in "
                         f"{_SUPPORTED_INV}, exact=False); got design={cfg['design']!r}, inv={cfg['inv']!r}, "
                         f"exact={cfg['exact']!r}")
    scale = float(K**-0.5 if scale is None else scale)
    config = None if config is None else tuple(sorted(dict(config).items()))
    return _open_chunk_impl(open_qkv, open_gates.astype(jnp.float32), state, jnp.asarray(lengths, jnp.int32),
                            groups=groups, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                            interpret=bool(interpret), config=config, num_warps=num_warps)
