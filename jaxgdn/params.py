"""Typed parameter pytrees (NamedTuples: leaves flatten in declaration order).

Matrices are stored [in, out] (used as `x @ w`); the checkpoint loader transposes Hugging Face's [out, in].
Shapes use the legend in `jaxgdn.shapes`.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import jax


class GDNParams(NamedTuple):
    in_proj_qkv: jax.Array  # [D, C]  channels q (HK*K), k (HK*K), v (HV*V); grouped per shard when gdn_qkv_groups > 1
    in_proj_z: jax.Array  # [D, HV*V]  output gate of the gated norm
    in_proj_b: jax.Array  # [D, HV]  -> beta = sigmoid(b)
    in_proj_a: jax.Array  # [D, HV]  -> g = -exp(A_log) * softplus(a + dt_bias)
    conv_weight: jax.Array  # [KC, C]  depthwise causal conv taps, oldest first
    A_log: jax.Array  # [HV] fp32
    dt_bias: jax.Array  # [HV] fp32
    norm_weight: jax.Array  # [V]  gated RMSNorm (plain w)
    out_proj: jax.Array  # [HV*V, D]


class AttentionParams(NamedTuple):
    q_proj: jax.Array  # [D, H*2*Dh]  per head: query (Dh) then gate (Dh)
    k_proj: jax.Array  # [D, HKV*Dh]
    v_proj: jax.Array  # [D, HKV*Dh]
    o_proj: jax.Array  # [H*Dh, D]
    q_norm: jax.Array  # [Dh]  zero-centred (1 + w)
    k_norm: jax.Array  # [Dh]


class MLPParams(NamedTuple):
    gate_proj: jax.Array  # [D, I]
    up_proj: jax.Array  # [D, I]
    down_proj: jax.Array  # [I, D]


class MoEParams(NamedTuple):
    router: jax.Array  # [D, E]
    gate_proj: jax.Array  # [E, D, I]
    up_proj: jax.Array  # [E, D, I]
    down_proj: jax.Array  # [E, I, D]
    shared: MLPParams  # shared expert
    shared_gate: jax.Array  # [D, 1]  sigmoid gate of the shared expert


class LayerParams(NamedTuple):
    input_norm: jax.Array  # [D]  zero-centred
    mixer: Union[GDNParams, AttentionParams]
    post_attention_norm: jax.Array  # [D]  zero-centred
    mlp: Union[MLPParams, MoEParams]


class ModelParams(NamedTuple):
    embed: jax.Array  # [Vocab, D]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [D]  zero-centred
    lm_head: jax.Array | None  # [D, Vocab]; None when tied to `embed`
