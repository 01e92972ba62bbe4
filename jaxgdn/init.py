"""Random parameters for a config: the embedded tiny models (tests, demo) and shape-only full-size builds."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from .config import LINEAR, ModelConfig
from .params import AttentionParams, GDNParams, LayerParams, MLPParams, ModelParams, MoEParams


def _mlp(key, d, i, dtype, scale):
    k1, k2, k3 = jax.random.split(key, 3)
    return MLPParams(gate_proj=(jax.random.normal(k1, (d, i)) * scale).astype(dtype),
                     up_proj=(jax.random.normal(k2, (d, i)) * scale).astype(dtype),
                     down_proj=(jax.random.normal(k3, (i, d)) * scale).astype(dtype))


def random_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.05) -> ModelParams:
    """Random parameters of realistic magnitude (no zero/one inits that could hide a formula bug).

    Norm weights are drawn around 0 (zero-centred norms) or 1 (gated norm); A_log ~ log U(1, 16)."""
    c = config
    D = c.hidden_size
    normal = lambda k, shape, s=scale: (jax.random.normal(k, shape) * s).astype(dtype)  # noqa: E731
    # 16 keys per layer were too few for a GDN layer with an MoE MLP (17): more follow from a folded key, so that
    # models that fit the first 4 + 16 per layer (the tiny presets) keep their weights
    keys = itertools.chain(jax.random.split(key, 4 + 16 * c.num_layers),
                           jax.random.split(jax.random.fold_in(key, 1), 4 + 16 * c.num_layers))
    layers = []
    for i, kind in enumerate(c.layer_types):
        if kind == LINEAR:
            HV = c.linear_num_value_heads
            mixer = GDNParams(
                in_proj_qkv=normal(next(keys), (D, c.gdn_conv_dim)),
                in_proj_z=normal(next(keys), (D, c.gdn_value_dim)),
                in_proj_b=normal(next(keys), (D, HV)),
                in_proj_a=normal(next(keys), (D, HV)),
                conv_weight=normal(next(keys), (c.linear_conv_kernel_dim, c.gdn_conv_dim), 0.3),
                A_log=jnp.log(jax.random.uniform(next(keys), (HV,), minval=1.0, maxval=16.0)),
                dt_bias=jax.random.normal(next(keys), (HV,)),
                norm_weight=(1.0 + jax.random.normal(next(keys), (c.linear_value_head_dim,)) * 0.1).astype(dtype),
                out_proj=normal(next(keys), (c.gdn_value_dim, D)))
        else:
            H, HKV, Dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
            mixer = AttentionParams(
                q_proj=normal(next(keys), (D, H * 2 * Dh)), k_proj=normal(next(keys), (D, HKV * Dh)),
                v_proj=normal(next(keys), (D, HKV * Dh)), o_proj=normal(next(keys), (H * Dh, D)),
                q_norm=normal(next(keys), (Dh,), 0.1), k_norm=normal(next(keys), (Dh,), 0.1))
        if c.is_moe_layer(i):
            E, I = c.num_experts, c.moe_intermediate_size
            ff = MoEParams(router=normal(next(keys), (D, E), 0.5), gate_proj=normal(next(keys), (E, D, I)),
                           up_proj=normal(next(keys), (E, D, I)), down_proj=normal(next(keys), (E, I, D)),
                           shared=_mlp(next(keys), D, c.shared_expert_intermediate_size, dtype, scale),
                           shared_gate=normal(next(keys), (D, 1), 0.5))
        else:
            ff = _mlp(next(keys), D, c.intermediate_size, dtype, scale)
        layers.append(LayerParams(input_norm=normal(next(keys), (D,), 0.1), mixer=mixer,
                                  post_attention_norm=normal(next(keys), (D,), 0.1), mlp=ff))
    return ModelParams(
        embed=normal(next(keys), (c.vocab_size, D), 1.0), layers=tuple(layers),
        final_norm=normal(next(keys), (D,), 0.1),
        lm_head=None if c.tie_word_embeddings else normal(next(keys), (D, c.vocab_size)))
