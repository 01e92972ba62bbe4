"""Full-size Qwen3.5-9B under jax.eval_shape: parameters, state and logits shapes/dtypes without allocating."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn.init import random_params
from jaxgdn.state import AttentionLayerState, GDNLayerState

B, N, T = 2, 1024, 128


def live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays())


@pytest.fixture(scope="module")
def abstract():
    """(config, model with abstract params, abstract state, prefill outputs, decode outputs, bytes allocated)."""
    cfg = jaxgdn.config.qwen3_5_9b()
    before = live_bytes()
    params = jax.eval_shape(lambda: random_params(cfg, jax.random.key(0), jnp.bfloat16))
    model = jaxgdn.Model(params=params, config=cfg, dtype=jnp.bfloat16)
    state = jax.eval_shape(lambda: model.init_state(batch_size=B, capacity=N))
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    lens = jax.ShapeDtypeStruct((B,), jnp.int32)
    pre_state, pre_logits = jax.eval_shape(jaxgdn.prefill_chunk, model, state, tok, lens)
    dec_state, dec_logits = jax.eval_shape(jaxgdn.decode_step, model, pre_state, jax.ShapeDtypeStruct((B,), jnp.int32))
    allocated = live_bytes() - before
    return cfg, model, state, (pre_state, pre_logits), (dec_state, dec_logits), allocated


def test_config_is_qwen3_5_9b_text_shape():
    cfg = jaxgdn.config.qwen3_5_9b()
    assert cfg.hidden_size == 4096 and cfg.num_layers == 32
    assert cfg.attention_layers == tuple(range(3, 32, 4)), "every 4th layer is full attention"
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 32)
    assert cfg.linear_key_head_dim == cfg.linear_value_head_dim == 128
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (16, 4, 256)
    assert cfg.rotary_dim == 64  # a quarter of the head


def test_nothing_allocated(abstract):
    *_, allocated = abstract
    assert allocated < 1 << 20, f"eval_shape allocated {allocated} bytes of device arrays"


def test_params_are_abstract_and_billions(abstract):
    cfg, model, *_ = abstract
    leaves = jax.tree.leaves(model.params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    n = sum(int(np.prod(x.shape)) for x in leaves)
    # Independent count from the config (untied head, dense MLP everywhere).
    D, V, I = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    HV = cfg.linear_num_value_heads
    gdn = (D * cfg.gdn_conv_dim + D * cfg.gdn_value_dim + 2 * D * HV + cfg.linear_conv_kernel_dim * cfg.gdn_conv_dim
           + 2 * HV + cfg.linear_value_head_dim + cfg.gdn_value_dim * D)
    H, HKV, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = D * H * 2 * Dh + 2 * D * HKV * Dh + H * Dh * D + 2 * Dh
    per_layer_common = 3 * D * I + 2 * D
    expected = (2 * V * D + D + len(cfg.gdn_layers) * gdn + len(cfg.attention_layers) * attn
                + cfg.num_layers * per_layer_common)
    assert n == expected
    assert 8e9 < n < 10e9
    gdn_p = model.params.layers[0].mixer
    assert gdn_p.A_log.dtype == jnp.float32 and gdn_p.dt_bias.dtype == jnp.float32
    assert model.params.embed.dtype == jnp.bfloat16


def test_state_shapes(abstract):
    cfg, _, state, *_ = abstract
    C = 2 * 16 * 128 + 32 * 128
    for i, layer in enumerate(state.layers):
        if i % 4 == 3:
            assert isinstance(layer, AttentionLayerState)
            assert layer.keys.shape == layer.values.shape == (B, N, 4, 256)
            assert layer.keys.dtype == jnp.bfloat16
        else:
            assert isinstance(layer, GDNLayerState)
            assert layer.recurrent.shape == (B, 32, 128, 128) and layer.recurrent.dtype == jnp.float32
            assert layer.conv.shape == (B, 3, C) and layer.conv.dtype == jnp.bfloat16
    assert state.position.shape == state.provenance.shape == (B,)


def test_prefill_and_decode_shapes(abstract):
    cfg, _, state, (pre_state, pre_logits), (dec_state, dec_logits), _ = abstract
    assert pre_logits.shape == (B, T, cfg.vocab_size) and pre_logits.dtype == jnp.float32
    assert dec_logits.shape == (B, cfg.vocab_size) and dec_logits.dtype == jnp.float32
    for s in (pre_state, dec_state):  # the state functions keep the state's structure, shapes and dtypes
        assert jax.tree.structure(s) == jax.tree.structure(state)
        for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(state)):
            assert (a.shape, a.dtype) == (b.shape, b.dtype)
