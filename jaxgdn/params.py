"""Typed parameter pytrees (NamedTuples: leaves flatten in declaration order).

Matrices are stored [in, out] (used as `x @ w`); the checkpoint loader transposes Hugging Face's [out, in].
Shapes use the legend in `jaxgdn.shapes`.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


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


# ==== a digest of the weights (the prefix cache's numerics key) ===================================================

_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)  # odd multipliers: each step below is a bijection of uint32


@jax.jit
def _leaf_sums(x: jax.Array) -> jax.Array:
    """Two uint32 sums [2] over one array's bit patterns, each element mixed with its flat index first (so that a
    changed or a moved element changes them). Sums of integers wrap exactly modulo 2**32 in any order: the same
    result on any device, mesh or reduction tree."""
    x = jnp.ravel(x)
    width = x.dtype.itemsize
    if width not in (1, 2, 4):
        x = x.astype(jnp.float32)  # (float64 under x64: its fp32 rounding is what the model computes with anyway)
        width = 4
    bits = lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[width]).astype(jnp.uint32)
    idx = lax.iota(jnp.uint32, x.size)
    h = bits * jnp.uint32(_MIX[0]) + idx
    h = (h ^ (h >> 15)) * jnp.uint32(_MIX[1])
    h = (h ^ (h >> 13)) * jnp.uint32(_MIX[2])
    h = h ^ (h >> 16)
    return jnp.stack([jnp.sum(h, dtype=jnp.uint32), jnp.sum(h * (idx | jnp.uint32(1)), dtype=jnp.uint32)])


def weights_digest(params) -> str:
    """A 16-hex-digit digest of a parameter pytree: its structure, every leaf's shape and dtype, and two position-mixed
    sums of every leaf's bits (`_leaf_sums`), computed where the weights live and hashed on the host with SHA-256
    (for the 9B shape's 17.9 GB of bf16 weights on the H200: 2.3 s on first use, compiles included, then 54 ms;
    `BENCHMARKS.md`, run 150). `Model.weights_digest` computes it once per model object. Equal weights give equal
    digests on any device or mesh; a change of one element always changes it (a bijection of the element's bits,
    then an exact sum); changes of several elements could cancel in both 32-bit sums, by chance only. Not a
    cryptographic hash: it tells checkpoints of one architecture apart (a fine-tune, an RL policy update), not a
    forger's."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        raise TypeError("weights_digest reads the weights' values: call it outside jit / grad")
    # One compiled program per distinct leaf shape and dtype (~20 at 9B, where one program over all ~400 leaves
    # took 8.9 s to compile on the H200), each launched per leaf, asynchronously; one transfer at the end.
    sums = np.asarray(jax.device_get([_leaf_sums(x) for x in leaves])) if leaves else np.zeros((0, 2))
    h = hashlib.sha256(str(treedef).encode())
    for x, s in zip(leaves, sums):
        h.update(f"{tuple(x.shape)}:{np.dtype(x.dtype).name};".encode())
        h.update(np.asarray(s, np.uint32).tobytes())
    return h.hexdigest()[:16]
