"""Kernel entry points the model calls. Each routes through `backend.resolve_backend` to the pure-JAX
reference or to the Pallas kernel (compiled, or interpreted on CPU). Shapes: see `gated_delta.reference`."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .backend import resolve_backend
from .gated_delta import reference as _ref

TP_AXIS = "tp"  # the tensor-parallel mesh axis (`jaxgdn.sharding`): heads are split over it


def _tp_mesh(num_key_heads: int):
    """The mesh set with `jax.set_mesh` when it has a "tp" axis of size > 1 dividing the key heads (each shard then
    holds whole key groups), else None. The Pallas kernels run per shard inside `shard_map` over it: XLA cannot
    split a Pallas call itself and would gather its inputs onto every device instead."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or TP_AXIS not in mesh.axis_names:
        return None
    tp = mesh.shape[TP_AXIS]
    return mesh if tp > 1 and num_key_heads % tp == 0 else None


def _per_shard(fn, mesh, args, in_specs, out_specs):
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*args)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, lengths=None,
                           checkpoint_stride=None, backend: str | None = None):
    """Chunked gated delta rule (prefill). q, k: [B,T,HK,K]; v: [B,T,HV,V]; g, beta: [B,T,HV].

    g is a log-decay (g <= 0, as the GDN gates compute it) and beta a gate in [0, 1]. The GPU kernel relies on it
    when `use_qk_l2norm=True`: it then stores two intermediates in fp16, whose every entry those ranges keep in
    [-1, 1] (`gated_delta.chunk._wk_dtype`). With g > 0 or beta > 2 they can overflow. Outside those ranges, call
    `gated_delta.chunk.chunk_gated_delta_rule_pallas` with `config={"wk_dtype": "float32"}`.

    Returns (o [B,T,HV,V], final_state fp32 [B,HV,K,V]), plus checkpoints [B,T//stride,HV,K,V] when
    `checkpoint_stride` is given.
    """
    kw = dict(scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, lengths=lengths,
              checkpoint_stride=checkpoint_stride)
    return _prefill(q, k, v, g, beta, kw, backend, _ref.chunk_gated_delta_rule_reference,
                    ("chunk", "chunk_gated_delta_rule_pallas"))


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True,
                                     lengths=None, checkpoint_stride=None, backend: str | None = None):
    """The recurrence token by token over a whole call (a prefill with the decode arithmetic; fla's name).
    q, k: [B,T,HK,K]; v: [B,T,HV,V]; g, beta: [B,T,HV]. Returns (o [B,T,HV,V], final_state fp32 [B,HV,K,V]), plus
    checkpoints [B,T//stride,HV,K,V] (the state after every `checkpoint_stride` tokens, any positive stride).

    Any split of a call gives the same bits as the unsplit call, and on the Pallas backends each token is bitwise
    what the decode kernel computes under the same launch configuration (`gated_delta.scan`; the defaults differ).
    Padded tokens (lengths) leave the state bit-identical, o = 0.
    """
    kw = dict(scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, lengths=lengths,
              checkpoint_stride=checkpoint_stride)
    return _prefill(q, k, v, g, beta, kw, backend, _ref.recurrent_gated_delta_rule_reference,
                    ("scan", "fused_recurrent_gated_delta_rule_pallas"))


def _prefill(q, k, v, g, beta, kw: dict, backend: str | None, reference, kernel_name: tuple[str, str]):
    """A prefill rule on the chosen backend: the pure-JAX `reference`, or the Pallas kernel `kernel_name` (module in
    `gated_delta`, function; imported on first use) called directly, or per shard in `shard_map` under a
    tensor-parallel mesh (heads split; each shard runs the kernel on its heads)."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return reference(q, k, v, g, beta, **kw)
    kernel = getattr(importlib.import_module(f".gated_delta.{kernel_name[0]}", __package__), kernel_name[1])
    interpret = backend == "interpret"
    mesh = _tp_mesh(q.shape[2])
    if mesh is None:
        return kernel(q, k, v, g, beta, interpret=interpret, **kw)
    B, T, HV = v.shape[:3]
    s0 = kw["initial_state"]
    s0 = jnp.zeros((B, HV, q.shape[3], v.shape[3]), jnp.float32) if s0 is None else s0
    lengths = jnp.full((B,), T, jnp.int32) if kw["lengths"] is None else jnp.asarray(kw["lengths"], jnp.int32)

    def shard(q, k, v, g, beta, s0, lengths):
        return kernel(q, k, v, g, beta, interpret=interpret, **dict(kw, initial_state=s0, lengths=lengths))

    h = P(None, None, TP_AXIS)  # [B, T, H, ...]
    out = (h, P(None, TP_AXIS)) + ((h,) if kw["checkpoint_stride"] is not None else ())
    return _per_shard(shard, mesh, (q, k, v, g, beta, s0, lengths), (h, h, h, h, h, P(None, TP_AXIS), P()), out)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state, scale=None, use_qk_l2norm=True, A_log=None,
                               dt_bias=None, backend: str | None = None):
    """One recurrent step per row (decode). q, k: [B,HK,K]; v: [B,HV,V]; g, beta: [B,HV] — or, with A_log and
    dt_bias ([HV]) given, the raw `a` and `b` from which the gates are computed in fp32.

    Returns (o [B,HV,V], new_state fp32 [B,HV,K,V]).
    """
    backend = resolve_backend(backend)
    if backend == "reference":
        if A_log is not None:
            g, beta = _ref.gdn_gates(A_log, g, dt_bias, beta)
        return _ref.gated_delta_step_reference(q, k, v, g, beta, initial_state, scale=scale,
                                               use_qk_l2norm=use_qk_l2norm)
    from .gated_delta.recurrent import recurrent_gated_delta_rule_pallas

    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=backend == "interpret")
    mesh = _tp_mesh(q.shape[1])
    if mesh is None:
        return recurrent_gated_delta_rule_pallas(q, k, v, g, beta, initial_state=initial_state, A_log=A_log,
                                                 dt_bias=dt_bias, **kw)
    h = P(None, TP_AXIS)  # [B, H, ...]
    if A_log is None:
        return _per_shard(lambda q, k, v, g, beta, s: recurrent_gated_delta_rule_pallas(
            q, k, v, g, beta, initial_state=s, **kw), mesh, (q, k, v, g, beta, initial_state), (h,) * 6, (h, h))
    return _per_shard(lambda q, k, v, g, beta, s, a, d: recurrent_gated_delta_rule_pallas(
        q, k, v, g, beta, initial_state=s, A_log=a, dt_bias=d, **kw), mesh,
        (q, k, v, g, beta, initial_state, A_log, dt_bias), (h,) * 6 + (P(TP_AXIS), P(TP_AXIS)), (h, h))


def _sharded() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and TP_AXIS in mesh.axis_names and mesh.shape[TP_AXIS] > 1


def _sum_in_device_order(part, tp: int):
    """Inside `shard_map`: every device's fp32 partial all-gathered and added in device order — a fixed order,
    where an all-reduce's order can depend on the message size (NCCL), i.e. on the batch."""
    parts = jax.lax.all_gather(part, TP_AXIS)  # [tp, ...]
    acc = parts[0]
    for i in range(1, tp):
        acc = acc + parts[i]
    return acc


def _local_matmul_invariant(x, w, backend: str, out_dtype=None, w_transposed: bool = False):
    """The batch-invariant product on one device (no mesh logic)."""
    if backend == "reference":
        from .invariant import row_tiled

        wk = w.T if w_transposed else w
        return row_tiled(lambda t: jnp.dot(t, wk, preferred_element_type=out_dtype or x.dtype), x)
    from .matmul import matmul_invariant_pallas

    return matmul_invariant_pallas(x, w, interpret=backend == "interpret", out_dtype=out_dtype,
                                   w_transposed=w_transposed)


def matmul_invariant(x, w, *, backend: str | None = None, row_groups: int | None = None,
                     col_groups: int | None = None, w_transposed: bool = False):
    """Batch-invariant x [..., K] @ w [K, N] for deterministic mode: no row's result depends on the other rows.

    "reference": XLA's GEMM on fixed 64-row tiles through `lax.map` (one compiled shape); "pallas"/"interpret": the
    fixed-tile Pallas kernel (`pallas_kernels.matmul`). Under a tensor-parallel mesh (XLA cannot split a Pallas
    call: it would gather the weight onto every device) the product runs per shard inside `shard_map` where the
    caller says how tensor parallelism splits w:
    - `col_groups=n`: w's columns are split by n groups (heads, the MLP's intermediate index, the vocabulary) when
      the mesh size divides n: each device multiplies x by its own columns, and the output stays split over them.
    - `row_groups=n`: w's rows are split by n groups (attention o_proj, GDN out_proj, MLP down_proj) when the mesh
      size divides n: each device multiplies its K slice into an fp32 partial; on 2 devices the partials are
      all-reduced (p0 + p1 = p1 + p0 in any order), on more they are all-gathered and added in device order — a
      fixed order, where an all-reduce's order can depend on the message size (NCCL), i.e. on the batch.
    Any other product under a mesh (a split the mesh does not divide) takes the reference path, which XLA
    partitions. Per shard the tile choice follows the shard's weight shape, so a sharded model is batch-invariant on
    its mesh but not bitwise equal to the unsharded one. `w_transposed`: w is [N, K] (a tied embedding as the
    output head; its rows, the vocabulary, are then the `col_groups`).
    """
    backend = resolve_backend(backend)
    if not _sharded():
        return _local_matmul_invariant(x, w, backend, w_transposed=w_transposed)
    mesh = jax.sharding.get_abstract_mesh()
    tp = mesh.shape[TP_AXIS]
    rest = [None] * (x.ndim - 1)
    if row_groups and row_groups % tp == 0 and not w_transposed and x.shape[-1] % tp == 0:
        def shard(xs, ws):  # xs [..., K / tp], ws [K / tp, N]
            part = _local_matmul_invariant(xs, ws, backend, jnp.float32)
            total = jax.lax.psum(part, TP_AXIS) if tp == 2 else _sum_in_device_order(part, tp)
            return total.astype(x.dtype)

        return _per_shard(shard, mesh, (x, w), (P(*rest, TP_AXIS), P(TP_AXIS, None)), P())
    n = w.shape[0] if w_transposed else w.shape[1]
    if col_groups and col_groups % tp == 0 and n % tp == 0:
        def shard(xs, ws):  # xs [..., K] (whole), ws [K, N / tp] (or [N / tp, K])
            return _local_matmul_invariant(xs, ws, backend, w_transposed=w_transposed)

        wspec = P(TP_AXIS, None) if w_transposed else P(None, TP_AXIS)
        return _per_shard(shard, mesh, (x, w), (P(*rest, None), wspec), P(*rest, TP_AXIS))
    return _local_matmul_invariant(x, w, "reference", w_transposed=w_transposed)


def expert_down(h, w, *, fixed_order: bool = False):
    """Each expert's down projection: h [..., E, I] @ w [E, I, D] -> [..., E, D] (h's dtype, fp32 accumulation).

    `fixed_order` (deterministic mode) under a tensor-parallel mesh of more than 2 devices, which splits w's I rows:
    each device's fp32 partial product is all-gathered and the partials are added in device order, as
    `matmul_invariant` does for the dense row-split projections (an all-reduce's order can depend on the message
    size). Otherwise XLA's einsum (and, on a mesh, its all-reduce)."""
    mesh = jax.sharding.get_abstract_mesh()
    tp = mesh.shape[TP_AXIS] if _sharded() else 1
    if not fixed_order or tp <= 2 or h.shape[-1] % tp:
        return _expert_product(h, w).astype(h.dtype)

    def shard(hs, ws):  # hs [..., E, I / tp], ws [E, I / tp, D]
        return _sum_in_device_order(_expert_product(hs, ws), tp).astype(h.dtype)

    hspec = P(*([None] * (h.ndim - 1) + [TP_AXIS]))
    return _per_shard(shard, mesh, (h, w), (hspec, P(None, TP_AXIS, None)), P())


def _expert_product(h, w):
    """h [..., E, I] @ w [E, I, D] -> fp32 [..., E, D], accumulated in fp32. On the CPU, operands that are not both
    fp32 are multiplied as fp32 copies: XLA:CPU (jax 0.11.2) has no batched bf16 x bf16 -> fp32 dot for this layout
    ("Unsupported element type for DotThunk::Execute", found 2026-12-01 running the bf16 MoE in deterministic
    mode), and a product of two bf16 numbers is exact in fp32. Elsewhere (the GPU) the operands as they are."""
    spec = "...ei,eid->...ed"

    def native(h, w):
        return jnp.einsum(spec, h, w, preferred_element_type=jnp.float32)

    def as_fp32(h, w):
        return jnp.einsum(spec, h.astype(jnp.float32), w.astype(jnp.float32), preferred_element_type=jnp.float32,
                          precision=jax.lax.Precision.HIGHEST)

    if h.dtype == w.dtype == jnp.float32:
        return native(h, w)
    return jax.lax.platform_dependent(h, w, cpu=as_fp32, default=native)


def _by_heads(local, fallback, q, keys, values, pos):
    """local(q, keys, values, pos) off a tensor-parallel mesh; on one, per shard inside `shard_map` when the mesh
    splits both the query and the KV heads (each shard keeps whole query groups), else `fallback`, which XLA
    partitions (a Pallas call it cannot split: it would gather the inputs onto every device)."""
    if not _sharded():
        return local(q, keys, values, pos)
    mesh = jax.sharding.get_abstract_mesh()
    tp = mesh.shape[TP_AXIS]
    if q.shape[2] % tp or keys.shape[2] % tp:
        return fallback(q, keys, values, pos)
    heads = P(None, None, TP_AXIS, None)
    return _per_shard(local, mesh, (q, keys, values, pos), (heads, heads, heads, P()), heads)


def cache_attention(q, keys, values, pos, *, decode: bool, backend: str | None = None):
    """Causal attention over a KV cache (default mode). q [B,T,H,Dh]; keys/values [B,N,HKV,Dh]; pos [B,T].

    "reference": `attention_reference` (XLA; the [T, N] scores materialised per head); "pallas"/"interpret": the
    Pallas kernel of `attention_invariant` (3.1x faster than XLA's at decode, B=64, on the H200 — BENCHMARKS.md;
    prefill: faster inside the deterministic model, not timed alone); head layouts the kernel does not support take
    `attention_reference`, and under a tensor-parallel mesh the kernel runs per shard when the mesh splits the heads.
    """
    from . import attention as _att  # the submodule (the package exports no name `attention`)

    backend = resolve_backend(backend)
    if backend == "reference":
        return _att.attention_reference(q, keys, values, pos)

    return _by_heads(lambda *a: _attention_pallas(*a, decode, backend, _att.attention_reference),
                     _att.attention_reference, q, keys, values, pos)


def attention_invariant(q, keys, values, pos, *, decode: bool, backend: str | None = None):
    """Batch-invariant causal attention over a KV cache for deterministic mode. q [B,T,H,Dh]; keys/values
    [B,N,HKV,Dh]; pos [B,T] absolute query positions. Returns [B,T,H,Dh].

    "reference": `attention_tiled_reference` (queries in fixed tiles of 64 positions, or of 1 for `decode`, through
    `lax.map`); "pallas"/"interpret": the Pallas kernel (`pallas_kernels.attention`: 64 query rows per program, 16
    for `decode`). Head layouts the kernel does not support take the reference path; under a tensor-parallel mesh
    the kernel runs per shard when the mesh splits both the query and the KV heads, else the reference path runs.
    """
    backend = resolve_backend(backend)
    if backend == "reference":
        return _attention_tiled(q, keys, values, pos, decode)
    tiled = lambda *a: _attention_tiled(*a, decode)  # noqa: E731
    return _by_heads(lambda *a: _attention_pallas(*a, decode, backend, tiled), tiled, q, keys, values, pos)


def _attention_tiled(q, keys, values, pos, decode: bool):
    """The batch-invariant reference: queries in fixed tiles of 64 positions (1 for `decode`) through `lax.map`."""
    from . import attention as _att

    return _att.attention_tiled_reference(q, keys, values, pos, tile=1 if decode else 64)


def _attention_pallas(q, keys, values, pos, decode: bool, backend: str, fallback):
    """The Pallas attention kernel on one device (64 query rows per program, 16 for `decode`), or
    `fallback(q, keys, values, pos)` for head layouts it does not support."""
    from . import attention as _att

    rows = 16 if decode else 64
    if not _att.supports(q.shape[2], keys.shape[2], q.shape[3], rows):
        return fallback(q, keys, values, pos)
    return _att.attention_invariant_pallas(q, keys, values, pos, rows=rows, interpret=backend == "interpret")


# GDN head sizes (K, V) at which the H200 checks found the replay step's output rows and boundary states bitwise the
# chunked prefill's (`scripts/gpu_kernels.py --only replay_step --replay-dims ...`, HK = 16, HV = 32, bf16 q / k / v;
# BENCHMARKS.md, runs 93-94 and 103). (16, 16), the tiny presets' heads, since run 103: before it kernel 4 computed a
# completing chunk's kd itself, and its kd^T v_new dot grouped the k axis into other HMMA k-steps than the prefill
# recurrence's (runs 91-102: every boundary state an ulp off); it now loads kernel 1's kd as the recurrence loads
# its own (`chunk.DEFAULT_CONFIG["replay_kd"]`), and the tiny presets' model-level replay checks pass on the step.
REPLAY_STEP_VERIFIED_HEADS = frozenset({(16, 16), (64, 64), (128, 128)})


def replay_step_matches_prefill(K: int, V: int, backend: str | None = None) -> bool:
    """Whether `chunk_replay_step` is known to give the chunked prefill's bits for GDN heads of K x V: on the
    reference and interpret backends always (the CPU tests check it, tiny heads included); with the Pallas kernels
    on the GPU only for the head sizes the H200 checks cover, `REPLAY_STEP_VERIFIED_HEADS` (Qwen3.5's and
    Qwen3-Next's GDN heads are 128 x 128). Where it is False the model runs a one-token call through the chunked
    kernel instead (`jaxgdn/layers/gdn.py`)."""
    return resolve_backend(backend) != "pallas" or (K, V) in REPLAY_STEP_VERIFIED_HEADS


def chunk_replay_step(q, k, v, g, beta, state, x_cache, vn_cache, lengths, *, scale=None, use_qk_l2norm=True,
                      backend: str | None = None):
    """One replay decode step per row over the chunked prefill: the new token's output computed with the chunked
    prefill's arithmetic on the open chunk (`gated_delta.replay`).

    q, k: [B,64,HK,K], v: [B,64,HV,V], g, beta: [B,64,HV]: the open chunk since the last grid boundary with the new
    token last, lengths[b] (1..64) tokens valid (0: the row is left as it is, its output zeros); state: fp32
    [B,HV,K,V] at that boundary; x_cache [B,HV,64,64] and vn_cache [B,HV,64,V], fp32:
    what the open chunk's earlier tokens computed (`replay_caches`; `chunk_replay_prime` after a prefill). Caches
    are the backend's: the reference backend leaves them zeros, so a state off the grid continues on the backend
    that made it. Returns (o [B,HV,V] of the new token; the state, the new boundary state where lengths == 64; the
    caches). On the reference backend the step runs the reference chunked rule over the open chunk and the caches
    pass through unused. The output row and states are bitwise what the same backend's chunked prefill computes
    (on the GPU: checked for bf16 q, k, v and the heads `replay_step_matches_prefill` names; `gated_delta/replay.py`).
    """
    backend = resolve_backend(backend)
    lengths = jnp.asarray(lengths, jnp.int32)
    if backend == "reference":
        o_all, final = _ref.chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=state,
                                                             use_qk_l2norm=use_qk_l2norm, lengths=lengths)
        o = jnp.take_along_axis(o_all, jnp.maximum(lengths - 1, 0)[:, None, None, None], axis=1)[:, 0]
        return o, jnp.where((lengths == q.shape[1])[:, None, None, None], final, state), x_cache, vn_cache
    from .gated_delta.replay import chunk_replay_step_pallas

    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=backend == "interpret")
    mesh = _tp_mesh(q.shape[2])
    args = (q, k, v, g, beta, state, x_cache, vn_cache, lengths)
    if mesh is None:
        return chunk_replay_step_pallas(*args, **kw)
    t, h = P(None, None, TP_AXIS), P(None, TP_AXIS)  # [B, 64, H, ...] and [B, H, ...]
    return _per_shard(lambda *a: chunk_replay_step_pallas(*a, **kw), mesh, args, (t,) * 5 + (h,) * 3 + (P(),),
                      (h,) * 4)


def chunk_replay_step_packed(qkv, gates, state, x_cache, vn_cache, lengths, *, heads, groups: int, scale=None,
                             use_qk_l2norm=True, backend: str | None = None):
    """`chunk_replay_step` on the open chunk as a model keeps it: qkv [B,64,2·HK·K + HV·V] in `groups` groups of
    [q_g | k_g | v_g] and gates [B,64,2,HV] (g, beta; fp32); heads = (HK, K, HV, V). The Pallas kernels read the
    buffers in place (`gated_delta/open_chunk.py`; no q / k / v copies). Returns (o, state, x_cache, vn_cache) as
    `chunk_replay_step` does, then (qkv, gates) with the rows whose chunk completed (lengths == 64) zeroed — in place
    on the Pallas backends when the caller donates them."""
    from .gated_delta import open_chunk as oc

    backend = resolve_backend(backend)
    heads = oc.Heads(*heads)
    lengths = jnp.asarray(lengths, jnp.int32)
    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)

    def split_then_step():  # q, k, v sliced out (copies), then the step on separate arrays
        q, k, v = oc.split_packed(qkv, heads, groups)
        out = chunk_replay_step(q, k, v, gates[:, :, 0], gates[:, :, 1], state, x_cache, vn_cache, lengths,
                                backend=backend, **kw)
        return out + oc.clear_by_select(qkv, gates, lengths)

    mesh = _tp_mesh(heads.HK)
    tp = 1 if mesh is None else mesh.shape[TP_AXIS]
    local = oc.Heads(heads.HK // tp, heads.HK_dim, heads.HV // tp, heads.HV_dim)
    if backend == "reference" or groups % tp or not oc.packable(local, groups // tp):
        return split_then_step()
    from .gated_delta.replay import chunk_replay_step_packed_pallas

    kw.update(heads=local, groups=groups // tp, interpret=backend == "interpret")
    args = (qkv, gates, state, x_cache, vn_cache, lengths)
    if mesh is None:
        return chunk_replay_step_packed_pallas(*args, **kw)
    h = P(None, TP_AXIS)
    return _per_shard(lambda *a: chunk_replay_step_packed_pallas(*a, **kw), mesh, args,
                      (P(None, None, TP_AXIS), P(None, None, None, TP_AXIS), h, h, h, P()),
                      (h,) * 4 + (P(None, None, TP_AXIS), P(None, None, None, TP_AXIS)))


def chunk_replay_prime(q, k, v, g, beta, state, lengths, *, scale=None, use_qk_l2norm=True,
                       backend: str | None = None):
    """The caches of `chunk_replay_step` for open chunks a prefill left: lengths[b] (0..63) tokens of q, k, v, g, beta
    ([B,64,...]) after the boundary `state`. Returns (x_cache, vn_cache); zeros on the reference backend."""
    backend = resolve_backend(backend)
    if backend == "reference":
        return replay_caches(v.shape[0], v.shape[2], v.shape[3])
    from .gated_delta.replay import chunk_replay_prime_pallas

    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=backend == "interpret")
    lengths = jnp.asarray(lengths, jnp.int32)
    mesh = _tp_mesh(q.shape[2])
    args = (q, k, v, g, beta, state, lengths)
    if mesh is None:
        return chunk_replay_prime_pallas(*args, **kw)
    t, h = P(None, None, TP_AXIS), P(None, TP_AXIS)
    return _per_shard(lambda *a: chunk_replay_prime_pallas(*a, **kw), mesh, args, (t,) * 5 + (h, P()), (h, h))


def replay_caches(B: int, HV: int, V: int):
    """Empty caches of `chunk_replay_step` (x_cache, vn_cache: fp32 zeros) for B rows, HV value heads of width V."""
    from .gated_delta.replay import replay_caches as empty

    return empty(B, HV, V)
