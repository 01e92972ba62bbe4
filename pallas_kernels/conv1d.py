"""Causal depthwise conv1d + SiLU: a Pallas-Triton kernel for the one-token update (decode), measured against the
XLA path in `jaxgdn.layers.conv` (BENCHMARKS.md, conv1d): slower than XLA's inside compiled decode loops, so XLA
stays the default and this kernel is an option.

Convention (as `jaxgdn.layers.conv`): taps `weight` [KC, C], oldest first; `conv_state` [B, KC-1, C] holds the last
KC-1 pre-conv inputs, oldest first; y = silu(sum_j w[j] * full[j]) with full = concat(conv_state, x) in x.dtype,
accumulated in fp32 in the order j = 0, 1, ..., KC-1 (the same order as the XLA prefill and step).

Prefill conv has no kernel here. XLA fuses the shifted multiply-adds, the SiLU and the cast, but over
concat(conv_state, x), which it builds and reads back: BENCHMARKS.md measured that pass at ~14% of the copy
bandwidth, so a prefill kernel is worth writing (not done); `scripts/gpu_kernels.py` measures it.

Grid (C // BC, B); the state is updated in place (`input_output_aliases`; callers donate it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .config import merged_config, static_config

DEFAULT_CONFIG = dict(bc=1024, num_warps=4, num_stages=1)


def _update_kernel(x_ref, s_ref, w_ref, y_ref, so_ref, *, kc):
    x = x_ref[...]  # [BC] in x.dtype
    rows = [s_ref[j].astype(x.dtype) for j in range(kc - 1)] + [x]
    acc = jnp.zeros(x.shape, jnp.float32)
    for j in range(kc):
        acc = acc + rows[j].astype(jnp.float32) * w_ref[j].astype(jnp.float32)
    y = acc * (1.0 / (1.0 + jnp.exp(-acc)))
    y_ref[...] = y.astype(y_ref.dtype)
    for j in range(kc - 1):
        so_ref[j] = rows[j + 1].astype(so_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def _update_impl(x, conv_state, weight, *, interpret, config):
    cfg = merged_config("causal_conv1d_update", DEFAULT_CONFIG, config, blocks={"bc": x.shape[1]})
    B, C = x.shape
    kc = weight.shape[0]
    bc = min(cfg["bc"], C)
    from jax.experimental.pallas import triton as pltriton

    return pl.pallas_call(
        functools.partial(_update_kernel, kc=kc),
        grid=(C // bc, B),
        in_specs=[
            pl.BlockSpec((None, bc), lambda c, b: (b, c)),
            pl.BlockSpec((None, kc - 1, bc), lambda c, b: (b, 0, c)),
            pl.BlockSpec((kc, bc), lambda c, b: (0, c)),
        ],
        out_specs=[
            pl.BlockSpec((None, bc), lambda c, b: (b, c)),
            pl.BlockSpec((None, kc - 1, bc), lambda c, b: (b, 0, c)),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, C), x.dtype), jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype)],
        input_output_aliases={1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="gdn_conv1d_update",
    )(x, conv_state, weight)


def causal_conv1d_update_pallas(x, conv_state, weight, *, interpret=False, config=None):
    """One token per row. x: [B, C]; conv_state: [B, KC-1, C]; weight: [KC, C].

    Returns (y [B, C] in x.dtype, new_state [B, KC-1, C] in conv_state.dtype), the state updated in place when the
    caller donates it. C must be a multiple of the block (a power of two, default 1024, or C itself if smaller).
    """
    if x.ndim != 2 or conv_state.ndim != 3 or weight.ndim != 2:
        raise ValueError(f"expected x [B,C], conv_state [B,KC-1,C], weight [KC,C]; got {x.shape}, "
                         f"{conv_state.shape}, {weight.shape}")
    B, C = x.shape
    kc = weight.shape[0]
    if conv_state.shape != (B, kc - 1, C) or weight.shape[1] != C:
        raise ValueError(f"shape mismatch: x {x.shape}, conv_state {conv_state.shape}, weight {weight.shape}")
    bc = min(dict(DEFAULT_CONFIG, **dict(config or {}))["bc"], C)
    if bc & (bc - 1) or C % bc:
        raise ValueError(f"C={C} must be a multiple of a power-of-two block (block {bc})")
    config = static_config(config)
    return _update_impl(x, conv_state, weight, interpret=bool(interpret), config=config)
