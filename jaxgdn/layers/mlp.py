"""SwiGLU MLP and the Qwen3-Next mixture of experts (softmax router, top-k, optional renormalisation, shared
expert behind a sigmoid gate)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import expert_down
from pallas_kernels.invariant import row_tiled, softmax, tree_sum

from ..config import ModelConfig
from ..params import MLPParams, MoEParams
from .linear import linear


def _swiglu(p: MLPParams, x: jax.Array) -> jax.Array:
    """x: [..., D] -> [..., I]: silu(gate(x)) * up(x)."""
    return jax.nn.silu(x @ p.gate_proj) * (x @ p.up_proj)


def mlp(p: MLPParams, x: jax.Array) -> jax.Array:
    """x: [..., D] -> [..., D]: down(silu(gate(x)) * up(x))."""
    return _swiglu(p, x) @ p.down_proj


def moe(cfg: ModelConfig, p: MoEParams, x: jax.Array, fixed_order: bool = False) -> jax.Array:
    """x: [..., D] -> [..., D].

    Routing in fp32: softmax over E experts, top-Ek, renormalised when `norm_topk_prob`. The reference
    evaluates every expert densely and combines with a [.., E] weight row that is zero off the top-k: simple
    and exact, but E times the expert FLOPs (fine for tests and modest E; a grouped kernel is future work).
    `fixed_order` (deterministic mode): the routed and shared experts' down projections, whose rows tensor
    parallelism splits, add the devices' partial products in a fixed order (`pallas_kernels.expert_down`).
    """
    logits = (x @ p.router).astype(jnp.float32)  # [..., E]
    probs = softmax(logits)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)  # [..., Ek]
    if cfg.norm_topk_prob:
        top_w = top_w / tree_sum(top_w)[..., None]
    top_w = top_w.astype(x.dtype)
    # [.., E]: zero off the top-k (one-hot rows are disjoint, so this sum is exact in any order)
    combine = jnp.sum(jax.nn.one_hot(top_i, cfg.num_experts, dtype=x.dtype) * top_w[..., None], axis=-2)
    h = jax.nn.silu(jnp.einsum("...d,edi->...ei", x, p.gate_proj)) * jnp.einsum("...d,edi->...ei", x, p.up_proj)
    if fixed_order:
        expert_out = expert_down(h, p.down_proj, fixed_order=True)  # [.., E, D]
        shared_out = expert_down(_swiglu(p.shared, x)[..., None, :], p.shared.down_proj[None],
                                 fixed_order=True)[..., 0, :]
    else:
        expert_out = jnp.einsum("...ei,eid->...ed", h, p.down_proj)  # [.., E, D]
        shared_out = mlp(p.shared, x)
    routed = tree_sum(jnp.swapaxes(expert_out * combine[..., None], -1, -2))  # fixed expert order
    shared = shared_out * jax.nn.sigmoid(x @ p.shared_gate)
    return routed + shared


def feed_forward(cfg: ModelConfig, p: MLPParams | MoEParams, x: jax.Array, det: str | bool = False) -> jax.Array:
    """x: [..., D]. `det`: False, or the kernel backend of deterministic mode, where no token's result depends on
    the others: the dense MLP's three projections each go through `linear`'s batch-invariant matmul (down_proj's rows
    are the ones tensor parallelism splits). The mixture of experts runs in fixed 64-token tiles on every backend,
    its down projections summing the devices' partials in a fixed order on meshes of more than 2 devices."""
    if isinstance(p, MoEParams):
        fn = lambda t: moe(cfg, p, t, fixed_order=bool(det))  # noqa: E731
        return row_tiled(fn, x) if det else fn(x)
    if not det:
        return mlp(p, x)
    i = cfg.intermediate_size  # tensor parallelism splits gate / up columns and down rows by it
    h = jax.nn.silu(linear(x, p.gate_proj, det, col_groups=i)) * linear(x, p.up_proj, det, col_groups=i)
    return linear(h, p.down_proj, det, row_groups=i)
