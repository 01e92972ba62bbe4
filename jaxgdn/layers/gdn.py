"""Gated DeltaNet token mixer: projections, causal conv, gates, the gated delta rule (through the kernel
dispatcher in `pallas_kernels.api`), gated RMSNorm, output projection."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import CHUNK
from pallas_kernels.gated_delta.open_chunk import split_packed

from ..config import ModelConfig
from ..params import GDNParams
from ..state import GDNLayerState
from .conv import causal_conv1d, causal_conv1d_step
from .linear import linear
from .norm import gated_rms_norm


def _split_qkv(cfg: ModelConfig, mixed: jax.Array):
    """[..., C] -> q, k [..., HK, K], v [..., HV, V]. C holds G = cfg.gdn_qkv_groups groups of [q_g | k_g | v_g]
    (G = 1: Hugging Face's [q | k | v]); slicing inside a group keeps a split by whole groups local to each shard."""
    return split_packed(mixed, _heads(cfg), cfg.gdn_qkv_groups)


def _heads(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(HK, K, HV, V) of the GDN layer."""
    return (cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_num_value_heads,
            cfg.linear_value_head_dim)


def _input_projection(cfg: ModelConfig, x: jax.Array, det: str | bool):
    """x @ w for the GDN input projections (q/k/v, z, a, b), whose columns tensor parallelism splits with the key
    heads (`linear`'s col_groups)."""
    return lambda w: linear(x, w, det, col_groups=cfg.linear_num_key_heads)


def _output(cfg: ModelConfig, p: GDNParams, o: jax.Array, z: jax.Array, det: str | bool) -> jax.Array:
    """o: [..., HV, V] core output; z: [..., HV*V] gate. Returns [..., D]."""
    z = z.reshape(o.shape)
    y = gated_rms_norm(o.astype(z.dtype), z, p.norm_weight, cfg.rms_norm_eps)
    return linear(y.reshape(*y.shape[:-2], cfg.gdn_value_dim), p.out_proj, det,
                  row_groups=cfg.linear_num_key_heads)  # split with the key heads, as the input projections


def _gather_rows(x: jax.Array, idx: jax.Array, valid: jax.Array) -> jax.Array:
    """x: [B, S, ...]; idx, valid: [B, W] -> [B, W, ...] rows x[b, idx[b, w]], zero where not valid."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    shape = idx.shape + (1,) * (x.ndim - 2)
    out = jnp.take_along_axis(x, idx.reshape(shape), axis=1)
    return jnp.where(valid.reshape(shape), out, jnp.zeros((), x.dtype))


def _splice(open_buf, new, open_len, lengths, width):
    """[B, 64, ...] open chunk (open_len valid) ++ [B, T, ...] new (lengths valid) -> [B, width, ...], zero-padded."""
    t = jnp.arange(width)[None, :]
    from_new = t - open_len[:, None]
    a = _gather_rows(open_buf, jnp.broadcast_to(t, from_new.shape), t < open_len[:, None])
    b = _gather_rows(new, from_new, (from_new >= 0) & (from_new < lengths[:, None]))
    return a + b  # disjoint supports: exact


def gdn_prefill(cfg: ModelConfig, p: GDNParams, x: jax.Array, state: GDNLayerState, lengths: jax.Array,
                position: jax.Array, backend: str | None, checkpoint_stride: int | None = None, det: str | bool = False,
                form: str = "chunked"):
    """x: [B, T, D]; lengths, position: [B]. Returns (y [B, T, D], new_state, checkpoints or None).

    Recurrent mode (state.open_qkv is None): the chunked rule (`form="chunked"`) or the token-by-token one
    (`form="recurrent"`: the decode arithmetic, `pallas_kernels.fused_recurrent_gated_delta_rule`) runs from the
    state at `position`.
    Replay mode: it runs from the last grid boundary over the open chunk followed by the new tokens, so the
    result is bitwise what an unsplit prefill computes (the kernel is row-causal inside a chunk), whatever
    `position` is; the state keeps the newest boundary state, the new open chunk and the replay step's caches for
    it (`pallas_kernels.chunk_replay_prime`). One-token calls (decode) run `pallas_kernels.chunk_replay_step`
    instead: only the new token's part of the open chunk, with the same arithmetic, where that is verified
    (`pallas_kernels.replay_step_matches_prefill`: on the GPU, heads of K = V = 16, 64 or 128); elsewhere they run the
    chunked kernel over the open chunk and the token, as longer calls do: the prefill's kernel on the same chunk (a
    completed chunk's state is the prefill's by construction; a partial chunk's output rows rest on the kernel's
    row-causality, which the H200 checks cover at K = V = 128 (`gpu_kernels.py`'s j < 64 rows) and, through this
    path, at 16: BENCHMARKS.md, runs 95 and 97-98, before the tiny presets moved to the step), at the cost of a
    chunk per token.

    Checkpoints: a GDNLayerState whose leaves carry an extra axis M: conv [B, M, KC-1, C], recurrent
    [B, M, HV, K, V] — every `checkpoint_stride` tokens from the call's start (recurrent mode) or from the last
    grid boundary (replay mode); see `model.prefill_chunk` for their positions.
    """
    if form not in ("chunked", "recurrent"):
        raise ValueError(f"form must be 'chunked' or 'recurrent'; got {form!r}")
    B, T, _ = x.shape
    replay = state.open_qkv is not None
    proj = _input_projection(cfg, x, det)
    pre = proj(p.in_proj_qkv)
    g, beta = pallas_kernels.gdn_gates(p.A_log, proj(p.in_proj_a), p.dt_bias, proj(p.in_proj_b))
    z = proj(p.in_proj_z)
    if not replay:
        ends = None
        if checkpoint_stride is not None:
            m = T // checkpoint_stride
            ends = jnp.broadcast_to(checkpoint_stride * jnp.arange(1, m + 1), (B, m))
        conv = causal_conv1d(pre, state.conv, p.conv_weight, lengths, ends)
        q, k, v = _split_qkv(cfg, conv[0])
        rule = (pallas_kernels.fused_recurrent_gated_delta_rule if form == "recurrent"
                else pallas_kernels.chunk_gated_delta_rule)
        out = rule(q, k, v, g, beta, initial_state=state.recurrent, lengths=lengths,
                   checkpoint_stride=checkpoint_stride, backend=backend)
        ckpt = None if checkpoint_stride is None else GDNLayerState(conv=conv[2], recurrent=out[2])
        new_state = GDNLayerState(conv=conv[1], recurrent=out[1])
        return _output(cfg, p, out[0], z, det), new_state, ckpt

    open_len = position % CHUNK  # [B] tokens since the boundary
    width = -(-(CHUNK - 1 + T) // CHUNK) * CHUNK
    stride = checkpoint_stride
    ends = None
    if stride is not None:  # conv checkpoints at the same points as the GDN ones (relative to the boundary)
        ends = stride * jnp.arange(1, width // stride + 1)[None, :] - open_len[:, None]
    conv = causal_conv1d(pre, state.conv, p.conv_weight, lengths, ends)
    gates = jnp.stack([g, beta], axis=2)  # [B, T, 2, HV]
    if stride is None and T == 1 and pallas_kernels.replay_step_matches_prefill(cfg.linear_key_head_dim,
                                                                                cfg.linear_value_head_dim, backend):
        return _replay_one_token(cfg, p, conv, gates, z, state, open_len, lengths, backend, det)
    qkv_all = _splice(state.open_qkv, conv[0], open_len, lengths, width)  # [B, W, C]
    gates_all = _splice(state.open_gates, gates, open_len, lengths, width)  # [B, W, 2, HV]
    total = open_len + lengths
    n_full = total // CHUNK  # boundaries crossed
    tail = CHUNK * n_full[:, None] + jnp.arange(CHUNK)[None, :]  # rows of the new open chunk
    tail_valid = tail < total[:, None]
    tail_qkv, tail_gates = _gather_rows(qkv_all, tail, tail_valid), _gather_rows(gates_all, tail, tail_valid)

    def rule(qkv, gts, init, lens, stride):
        q, k, v = _split_qkv(cfg, qkv)
        return pallas_kernels.chunk_gated_delta_rule(q, k, v, gts[:, :, 0], gts[:, :, 1], initial_state=init,
                                                     lengths=lens, checkpoint_stride=stride, backend=backend)

    ckpt_states = None
    if stride is None and width <= 2 * CHUNK:
        # Short calls: one pass; the new boundary is the in-call state at the last boundary crossed.
        o_all, _, boundaries = rule(qkv_all, gates_all, state.recurrent, total, CHUNK)  # [B, W/64, HV, K, V]
        newest = jnp.take_along_axis(boundaries, jnp.maximum(n_full - 1, 0)[:, None, None, None, None], axis=1)[:, 0]
        recurrent = jnp.where((n_full > 0)[:, None, None, None], newest, state.recurrent)
    else:
        # Long calls: the full chunks in one pass (its final state is the new boundary: padding leaves the state
        # bit-identical), then the open tail from that boundary; no state per chunk is kept beyond `stride`'s.
        out = rule(qkv_all, gates_all, state.recurrent, CHUNK * n_full, stride)
        o_full, recurrent = out[0], out[1]
        ckpt_states = out[2] if stride is not None else None
        o_tail, _ = rule(tail_qkv, tail_gates, recurrent, total - CHUNK * n_full, None)  # [B, 64, HV, V]
        in_tail = jnp.arange(width)[None, :] - CHUNK * n_full[:, None]  # [B, W] row within the tail chunk
        o_all = jnp.where((in_tail < 0)[..., None, None], o_full,
                          _gather_rows(o_tail, in_tail, jnp.ones_like(in_tail, bool)))
    o = _gather_rows(o_all, open_len[:, None] + jnp.arange(T)[None, :], jnp.ones((B, T), bool))
    tq, tk, tv = _split_qkv(cfg, tail_qkv)  # the replay step's caches for the new open chunk
    open_x, open_vnew = pallas_kernels.chunk_replay_prime(tq, tk, tv, tail_gates[:, :, 0], tail_gates[:, :, 1],
                                                          recurrent, total - CHUNK * n_full, backend=backend)
    new_state = GDNLayerState(conv=conv[1], recurrent=recurrent, open_qkv=tail_qkv, open_gates=tail_gates,
                              open_x=open_x, open_vnew=open_vnew)
    ckpt = None
    if stride is not None:  # at grid points the open chunk is empty: no buffers (`state.at_boundary`)
        ckpt = GDNLayerState(conv=conv[2], recurrent=ckpt_states)
    return _output(cfg, p, o, z, det), new_state, ckpt


def _replay_one_token(cfg: ModelConfig, p: GDNParams, conv, gates, z, state: GDNLayerState, open_len, lengths,
                      backend, det):
    """`gdn_prefill`'s one-token calls in replay mode (decode): the replay step computes the new token's row of the
    open chunk with the prefill's arithmetic, reusing what the chunk's earlier tokens cached; when the token fills
    the chunk, the new boundary state (otherwise the boundary and the state array are left as they are).

    The open chunk's buffers hold zeros after their open_len valid rows (`GDNLayerState`), so the new token is one
    row written at open_len (a scatter of B rows instead of the splice and gathers over [B, 64, C] that longer
    calls use); the step reads the buffers as they are and empties the rows whose chunk the token completes, in
    place (`pallas_kernels.chunk_replay_step_packed`: no q / k / v copies, and no pass of XLA's scatter over the
    whole buffer; BENCHMARKS.md, run 71)."""
    B = open_len.shape[0]
    rows = jnp.arange(B)
    active = lengths > 0  # a row with no token (lengths 0) writes zeros where it already holds them
    qkv_all = state.open_qkv.at[rows, open_len].set(jnp.where(active[:, None], conv[0][:, 0], 0))
    gates_all = state.open_gates.at[rows, open_len].set(jnp.where(active[:, None, None], gates[:, 0], 0))
    # the kernels read q, k and v out of the packed buffer, and the step empties the rows whose chunk it completes,
    # in place (`pallas_kernels.chunk_replay_step_packed`)
    o_new, recurrent, open_x, open_vnew, open_qkv, open_gates = pallas_kernels.chunk_replay_step_packed(
        qkv_all, gates_all, state.recurrent, state.open_x, state.open_vnew, open_len + lengths, heads=_heads(cfg),
        groups=cfg.gdn_qkv_groups, backend=backend)
    new_state = GDNLayerState(conv=conv[1], recurrent=recurrent, open_qkv=open_qkv, open_gates=open_gates,
                              open_x=open_x, open_vnew=open_vnew)
    return _output(cfg, p, o_new[:, None], z, det), new_state, None


def gdn_decode(cfg: ModelConfig, p: GDNParams, x: jax.Array, state: GDNLayerState, backend: str | None,
               det: str | bool = False):
    """One token per row through the recurrent kernel (gates fused). x: [B, D]. Returns (y [B, D], new_state)."""
    proj = _input_projection(cfg, x, det)
    mixed, conv_state = causal_conv1d_step(proj(p.in_proj_qkv), state.conv, p.conv_weight)
    q, k, v = _split_qkv(cfg, mixed)
    o, recurrent = pallas_kernels.recurrent_gated_delta_rule(
        q, k, v, proj(p.in_proj_a), proj(p.in_proj_b), initial_state=state.recurrent,
        A_log=p.A_log, dt_bias=p.dt_bias, backend=backend)
    return _output(cfg, p, o, proj(p.in_proj_z), det), GDNLayerState(conv=conv_state, recurrent=recurrent)
