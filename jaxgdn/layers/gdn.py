"""Gated DeltaNet token mixer: projections, causal conv, gates, the gated delta rule (through the kernel
dispatcher in `pallas_kernels.api`), gated RMSNorm, output projection."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels

from ..config import ModelConfig
from ..params import GDNParams
from ..state import GDNLayerState
from .conv import causal_conv1d, causal_conv1d_step
from .linear import linear
from .norm import gated_rms_norm


def _split_qkv(cfg: ModelConfig, mixed: jax.Array):
    """[..., C] -> q, k [..., HK, K], v [..., HV, V]."""
    kd = cfg.gdn_key_dim
    lead = mixed.shape[:-1]
    q = mixed[..., :kd].reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    k = mixed[..., kd:2 * kd].reshape(*lead, cfg.linear_num_key_heads, cfg.linear_key_head_dim)
    v = mixed[..., 2 * kd:].reshape(*lead, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    return q, k, v


def _output(cfg: ModelConfig, p: GDNParams, o: jax.Array, z: jax.Array, det: bool) -> jax.Array:
    """o: [..., HV, V] core output; z: [..., HV*V] gate. Returns [..., D]."""
    z = z.reshape(o.shape)
    y = gated_rms_norm(o.astype(z.dtype), z, p.norm_weight, cfg.rms_norm_eps)
    return linear(y.reshape(*y.shape[:-2], cfg.gdn_value_dim), p.out_proj, det)


def gdn_prefill(cfg: ModelConfig, p: GDNParams, x: jax.Array, state: GDNLayerState, lengths: jax.Array | None,
                backend: str | None, checkpoint_stride: int | None = None, det: bool = False):
    """x: [B, T, D]. Returns (y [B, T, D], new_state, checkpoints or None).

    Checkpoints (with `checkpoint_stride`): the layer state after every `stride` tokens, as a GDNLayerState whose
    leaves carry an extra axis: conv [B, M, KC-1, C], recurrent [B, M, HV, K, V] (M = T // stride).
    """
    conv = causal_conv1d(linear(x, p.in_proj_qkv, det), state.conv, p.conv_weight, lengths, checkpoint_stride)
    mixed, conv_state = conv[0], conv[1]
    q, k, v = _split_qkv(cfg, mixed)
    g, beta = pallas_kernels.gdn_gates(p.A_log, linear(x, p.in_proj_a, det), p.dt_bias, linear(x, p.in_proj_b, det))
    out = pallas_kernels.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state.recurrent, lengths=lengths,
                                                checkpoint_stride=checkpoint_stride, backend=backend)
    o, recurrent = out[0], out[1]
    ckpt = None if checkpoint_stride is None else GDNLayerState(conv=conv[2], recurrent=out[2])
    return _output(cfg, p, o, linear(x, p.in_proj_z, det), det), GDNLayerState(conv=conv_state, recurrent=recurrent), ckpt


def gdn_decode(cfg: ModelConfig, p: GDNParams, x: jax.Array, state: GDNLayerState, backend: str | None,
               det: bool = False):
    """One token per row through the recurrent kernel (gates fused). x: [B, D]. Returns (y [B, D], new_state)."""
    mixed, conv_state = causal_conv1d_step(linear(x, p.in_proj_qkv, det), state.conv, p.conv_weight)
    q, k, v = _split_qkv(cfg, mixed)
    o, recurrent = pallas_kernels.recurrent_gated_delta_rule(
        q, k, v, linear(x, p.in_proj_a, det), linear(x, p.in_proj_b, det), initial_state=state.recurrent,
        A_log=p.A_log, dt_bias=p.dt_bias, backend=backend)
    return _output(cfg, p, o, linear(x, p.in_proj_z, det), det), GDNLayerState(conv=conv_state, recurrent=recurrent)
