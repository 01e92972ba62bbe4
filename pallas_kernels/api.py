"""Kernel entry points the model calls. Each routes through `backend.resolve_backend` to the pure-JAX
reference or to the Pallas kernel (compiled, or interpreted on CPU). Shapes: see `gated_delta.reference`.

The gated delta rule, attention and matmul entry points check their arguments before any kernel runs, on shapes,
dtypes and Python values only, and raise `jaxgdn.InputError` (a ValueError) naming the bad one; every entry point
that takes a `backend` raises it for an unknown one too. On the Pallas backends ("pallas", "interpret") the GDN head
sizes K and V must be powers of two >= 16, what the kernels need (the "reference" backend takes any)."""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .backend import BACKENDS, resolve_backend
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


# ---- argument checks: on shapes, dtypes and Python values only (trace-time; no device work, no host reads) ----


def _input_error(message: str) -> Exception:
    """jaxgdn's InputError (a ValueError), imported here: jaxgdn imports this package."""
    from jaxgdn.errors import InputError

    return InputError(message)


def _backend(backend) -> str:
    """`resolve_backend(backend)`, with an unknown backend an InputError (resolve_backend's is a plain ValueError)."""
    try:
        return resolve_backend(backend)
    except (TypeError, ValueError):  # TypeError: an unhashable or otherwise odd value
        raise _input_error(f"unknown kernel backend {backend!r}; expected one of {BACKENDS} or None") from None


def _array(name: str, x, kind: str = "floating"):
    """x itself when it is an array (jax, NumPy, or a tracer) of the `kind` of dtype ("floating" or "integer");
    InputError naming `name` otherwise."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise _input_error(f"{name} must be an array (jax or NumPy); got {type(x).__name__}")
    ok = (jnp.issubdtype(x.dtype, jnp.floating) if kind == "floating"
          else jnp.issubdtype(x.dtype, jnp.integer) and x.dtype != jnp.bool_)
    if not ok:
        raise _input_error(f"{name} must have {'a floating' if kind == 'floating' else 'an integer'} dtype; got "
                           f"{x.dtype}")
    return x


def _int_array(name: str, x):
    """An integer array argument (lengths, pos): a Python list or tuple of ints is taken as a NumPy array."""
    if isinstance(x, (list, tuple)):
        x = np.asarray(x) if len(x) else np.zeros((0,), np.int32)
    return _array(name, x, "integer")


def _shape(name: str, x, want: tuple, what: str):
    if tuple(x.shape) != tuple(want):
        raise _input_error(f"{name} must be {what}={tuple(want)}; got {tuple(x.shape)}")


def _flag(name: str, x) -> bool:
    """A bool argument (a string such as "False" would otherwise read as true)."""
    if not isinstance(x, (bool, np.bool_)):
        raise _input_error(f"{name} must be a bool; got {x!r}")
    return bool(x)


def _count(name: str, x, least: int = 0) -> int:
    """An integer argument >= least (Python or NumPy integer, not a bool: `jaxgdn.errors.index_value`), as a Python
    int."""
    from jaxgdn.errors import index_value  # (here: jaxgdn imports this package)

    try:
        n = index_value(x)
    except TypeError:
        raise _input_error(f"{name} must be an integer; got {x!r}") from None
    if n < least:
        raise _input_error(f"{name} must be >= {least}; got {n}")
    return n


def _checked_scale(scale, backend: str):
    """scale: None (K^-0.5) or a finite real number; the Pallas kernels compile it in, so there it must be
    concrete. Returned as given (the kernels and the reference convert it themselves)."""
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)):
        raise _input_error(f"scale must be a real number; got {scale!r}")
    if isinstance(scale, jax.core.Tracer):
        if backend != "reference":
            raise _input_error("scale must be a concrete number on the Pallas backends (it is compiled into the "
                               "kernels); got a traced value")
        if scale.shape != () or not jnp.issubdtype(scale.dtype, jnp.number) \
                or jnp.issubdtype(scale.dtype, jnp.complexfloating):
            raise _input_error(f"scale must be a real scalar; got {scale.dtype}{list(scale.shape)}")
        return scale
    if isinstance(scale, (int, float, np.integer, np.floating)):
        value = float(scale)
    elif hasattr(scale, "shape") and hasattr(scale, "dtype"):
        if scale.shape != () or not (jnp.issubdtype(scale.dtype, jnp.floating)
                                     or jnp.issubdtype(scale.dtype, jnp.integer)) or scale.dtype == jnp.bool_:
            raise _input_error(f"scale must be a real scalar; got {scale.dtype}{list(scale.shape)}")
        if backend == "reference" and not isinstance(scale, np.ndarray):
            return scale  # a concrete jax scalar: not read back to the host here (the reference multiplies by it)
        value = float(scale)
    else:
        raise _input_error(f"scale must be a real number; got {scale!r}")
    if not math.isfinite(value):
        raise _input_error(f"scale must be finite; got {value}")
    return scale


def _checked_state(name: str, x, want: tuple, what: str = "[B,HV,K,V]"):
    """An fp32 state or cache of shape `want` (a NumPy float64 array counts as fp32 where JAX runs in 32 bits)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise _input_error(f"{name} must be an fp32 array {what}; got {type(x).__name__}")
    if jax.dtypes.canonicalize_dtype(x.dtype) != jnp.float32:
        raise _input_error(f"{name} must be fp32 {what}={tuple(want)}; got {x.dtype}")
    _shape(name, x, want, f"fp32 {what}")
    return x


def _checked_head_sizes(K: int, V: int, backend: str):
    """On the Pallas backends the GDN head sizes K and V must be powers of two >= 16: the rule every Pallas GDN
    kernel checks (`gated_delta.chunk._check_pow2`, which the replay kernels call too, and the same test in
    `gated_delta.scan` and `gated_delta.recurrent`), refused here before any of them runs. The reference backend
    takes any size."""
    if backend == "reference":
        return
    for name, n in (("K", K), ("V", V)):
        if n < 16 or n & (n - 1):
            raise _input_error(f"{name}={n}: the head sizes K and V must be powers of two >= 16 on the Pallas "
                               f"backends (backend {backend!r}); the 'reference' backend takes any size")


def _checked_heads(q, k, v, lead: str, backend: str):
    """q, k [*lead, HK, K] and v [*lead, HV, V] (lead "B,T" or "B"), HV a multiple of HK, K and V sizes the
    backend's kernels run (`_checked_head_sizes`): returns the lead shape and (HK, K, HV, V)."""
    n = len(lead.split(",")) + 2
    for name, x in (("q", q), ("k", k), ("v", v)):
        _array(name, x)
    if q.ndim != n:
        raise _input_error(f"q must be [{lead},HK,K]; got shape {tuple(q.shape)}")
    if tuple(k.shape) != tuple(q.shape):
        raise _input_error(f"k must have q's shape [{lead},HK,K]={tuple(q.shape)}; got {tuple(k.shape)}")
    if v.ndim != n or tuple(v.shape[:n - 2]) != tuple(q.shape[:n - 2]):
        raise _input_error(f"v must be [{lead},HV,V] with q's {lead}={tuple(q.shape[:n - 2])}; got shape "
                           f"{tuple(v.shape)}")
    HK, K, HV, V = q.shape[-2], q.shape[-1], v.shape[-2], v.shape[-1]
    if HK < 1 or HV % HK:
        raise _input_error(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    _checked_head_sizes(K, V, backend)
    return tuple(q.shape[:n - 2]), (HK, K, HV, V)


def _checked_gates(g, beta, want: tuple, what: str, g_name: str = "g", beta_name: str = "beta"):
    for name, x in ((g_name, g), (beta_name, beta)):
        _array(name, x)
        _shape(name, x, want, what)


def _checked_prefill(q, k, v, g, beta, kw: dict, backend: str, stride_multiple: int) -> dict:
    """The prefill rules' arguments checked; returns kw with lengths as int32, the flag as a bool and the stride as
    a Python int."""
    (B, T), (HK, K, HV, V) = _checked_heads(q, k, v, "B,T", backend)
    _checked_gates(g, beta, (B, T, HV), "[B,T,HV]")
    if kw["initial_state"] is not None:
        _checked_state("initial_state", kw["initial_state"], (B, HV, K, V))
    lengths = kw["lengths"]
    if lengths is not None:
        lengths = _int_array("lengths", lengths)
        _shape("lengths", lengths, (B,), "[B]")
        lengths = jnp.asarray(lengths, jnp.int32)
    stride = kw["checkpoint_stride"]
    if stride is not None:
        stride = _count("checkpoint_stride", stride, 1)
        if stride % stride_multiple:
            raise _input_error(f"checkpoint_stride must be a positive multiple of {stride_multiple}; got {stride}")
    return dict(kw, lengths=lengths, checkpoint_stride=stride,
                use_qk_l2norm=_flag("use_qk_l2norm", kw["use_qk_l2norm"]),
                scale=_checked_scale(kw["scale"], backend))


def _empty_prefill(q, v, kw: dict):
    """A prefill of no tokens (T = 0) or no rows (B = 0): o empty, the state as given (fp32), no checkpoints' work."""
    B, T, HV, V = v.shape
    K = q.shape[3]
    s0 = kw["initial_state"]
    state = jnp.zeros((B, HV, K, V), jnp.float32) if s0 is None else jnp.asarray(s0, jnp.float32)
    out = (jnp.zeros((B, T, HV, V), v.dtype), state)
    stride = kw["checkpoint_stride"]
    return out if stride is None else out + (jnp.zeros((B, T // stride, HV, K, V), jnp.float32),)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, lengths=None,
                           checkpoint_stride=None, backend: str | None = None):
    """Chunked gated delta rule (prefill). q, k: [B,T,HK,K]; v: [B,T,HV,V]; g, beta: [B,T,HV].

    g is a log-decay (g <= 0, as the GDN gates compute it) and beta a gate in [0, 1]. The GPU kernel relies on it
    when `use_qk_l2norm=True`: it then stores two intermediates in fp16, whose every entry those ranges keep in
    [-1, 1] (`gated_delta.chunk._wk_dtype`). With g > 0 or beta > 2 they can overflow. Outside those ranges, call
    `gated_delta.chunk.chunk_gated_delta_rule_pallas` with `config={"wk_dtype": "float32"}`.

    q, k, v, g and beta have floating dtypes; scale: None (K^-0.5) or a finite number; initial_state: None (zeros)
    or fp32 [B,HV,K,V]; lengths: None or integers [B] (tokens t >= lengths[b] are padding; a length below 0 counts
    as 0, above T as T); checkpoint_stride: None or a positive multiple of 64; use_qk_l2norm: a bool; backend: None,
    "reference", "pallas" or "interpret". On the Pallas backends K and V must be powers of two >= 16 (the reference
    takes any). Bad arguments raise `jaxgdn.InputError` (a ValueError) naming them. T = 0 or B = 0: nothing runs,
    the state comes back as is.

    Returns (o [B,T,HV,V] in v.dtype, final_state fp32 [B,HV,K,V]), plus checkpoints fp32 [B,T//stride,HV,K,V]
    when `checkpoint_stride` is given. o at padded positions: zeros on the Pallas backends, not specified on the
    reference backend (which computes it from the unchanged state).
    """
    kw = dict(scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, lengths=lengths,
              checkpoint_stride=checkpoint_stride)
    return _prefill(q, k, v, g, beta, kw, backend, _ref.chunk_gated_delta_rule_reference,
                    ("chunk", "chunk_gated_delta_rule_pallas"), stride_multiple=_ref.CHUNK)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True,
                                     lengths=None, checkpoint_stride=None, backend: str | None = None):
    """The recurrence token by token over a whole call (a prefill with the decode arithmetic; fla's name).
    q, k: [B,T,HK,K]; v: [B,T,HV,V]; g, beta: [B,T,HV]. Returns (o [B,T,HV,V], final_state fp32 [B,HV,K,V]), plus
    checkpoints [B,T//stride,HV,K,V] (the state after every `checkpoint_stride` tokens, any positive stride).

    Any split of a call gives the same bits as the unsplit call, and on the Pallas backends each token is bitwise
    what the decode kernel computes under the same launch configuration (`gated_delta.scan`; the defaults differ).
    Padded tokens (lengths) leave the state bit-identical, o = 0. Arguments as `chunk_gated_delta_rule`'s (o in
    v.dtype; bad ones raise `jaxgdn.InputError`), but checkpoint_stride any positive integer.
    """
    kw = dict(scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, lengths=lengths,
              checkpoint_stride=checkpoint_stride)
    return _prefill(q, k, v, g, beta, kw, backend, _ref.recurrent_gated_delta_rule_reference,
                    ("scan", "fused_recurrent_gated_delta_rule_pallas"), stride_multiple=1)


def _prefill(q, k, v, g, beta, kw: dict, backend: str | None, reference, kernel_name: tuple[str, str], *,
             stride_multiple: int):
    """A prefill rule on the chosen backend: the pure-JAX `reference`, or the Pallas kernel `kernel_name` (module in
    `gated_delta`, function; imported on first use) called directly, or per shard in `shard_map` under a
    tensor-parallel mesh (heads split; each shard runs the kernel on its heads). The arguments are checked first
    (InputError), and a call of no tokens or no rows returns the state as it is without running anything."""
    backend = _backend(backend)
    kw = _checked_prefill(q, k, v, g, beta, kw, backend, stride_multiple)
    if v.shape[0] == 0 or v.shape[1] == 0:
        return _empty_prefill(q, v, kw)
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

    q, k, v, g, beta, A_log and dt_bias have floating dtypes; initial_state: fp32 [B,HV,K,V], or None (zeros);
    scale: None (K^-0.5) or a finite number; use_qk_l2norm: a bool; on the Pallas backends K and V powers of two
    >= 16. Bad arguments raise `jaxgdn.InputError`.

    Returns (o [B,HV,V] in v.dtype, new_state fp32 [B,HV,K,V]).
    """
    backend = _backend(backend)
    (B,), (HK, K, HV, V) = _checked_heads(q, k, v, "B", backend)
    fused = A_log is not None
    if fused != (dt_bias is not None):
        raise _input_error("A_log and dt_bias go together (both given: g and beta are the raw a and b)")
    _checked_gates(g, beta, (B, HV), "[B,HV]", *(("g (the raw a)", "beta (the raw b)") if fused else ()))
    if fused:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            _array(name, x)
            _shape(name, x, (HV,), "[HV]")
    if initial_state is None:
        initial_state = jnp.zeros((B, HV, K, V), jnp.float32)
    _checked_state("initial_state", initial_state, (B, HV, K, V))
    if initial_state.dtype != jnp.float32:  # a NumPy float64 array (the kernel takes fp32 only)
        initial_state = jnp.asarray(initial_state, jnp.float32)
    scale = _checked_scale(scale, backend)
    use_qk_l2norm = _flag("use_qk_l2norm", use_qk_l2norm)
    if B == 0:
        return jnp.zeros((0, HV, V), v.dtype), jnp.asarray(initial_state, jnp.float32)
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
    output head; its rows, the vocabulary, are then the `col_groups`). Shapes that do not fit, or a non-bool
    `w_transposed`, raise `jaxgdn.InputError`.
    """
    backend = _backend(backend)
    w_transposed = _flag("w_transposed", w_transposed)
    for name, a in (("x", x), ("w", w)):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise _input_error(f"{name} must be an array (jax or NumPy); got {type(a).__name__}")
    want = "[N, K]" if w_transposed else "[K, N]"
    if x.ndim < 1 or w.ndim != 2 or x.shape[-1] != w.shape[1 if w_transposed else 0]:
        raise _input_error(f"expected x [..., K] and w {want}; got {tuple(x.shape)} and {tuple(w.shape)}")
    for name, n in (("row_groups", row_groups), ("col_groups", col_groups)):
        if n is not None:
            _count(name, n)
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


def _checked_attention(q, keys, values, pos, decode):
    """q [B,T,H,Dh], keys and values [B,N,HKV,Dh] (floating; H a multiple of HKV; N >= 1 unless there is no query),
    pos integers [B,T] (a Python list taken), decode a bool: returns (pos, decode)."""
    for name, x in (("q", q), ("keys", keys), ("values", values)):
        _array(name, x)
    if q.ndim != 4:
        raise _input_error(f"q must be [B,T,H,Dh]; got shape {tuple(q.shape)}")
    B, T, H, Dh = q.shape
    if keys.ndim != 4 or keys.shape[0] != B or keys.shape[3] != Dh:
        raise _input_error(f"keys must be [B,N,HKV,Dh] with q's B={B} and Dh={Dh}; got shape {tuple(keys.shape)}")
    _shape("values", values, keys.shape, "keys' shape [B,N,HKV,Dh]")
    N, HKV = keys.shape[1], keys.shape[2]
    if HKV < 1 or H % HKV:
        raise _input_error(f"query heads ({H}) must be a multiple of key/value heads ({HKV})")
    if N == 0 and q.size:
        raise _input_error("keys and values hold no cache slot (N = 0): a query would attend to nothing")
    if isinstance(pos, (list, tuple)):
        pos = jnp.asarray(_int_array("pos", pos))
    _array("pos", pos, "integer")
    _shape("pos", pos, (B, T), "[B,T]")
    return pos, _flag("decode", decode)


def cache_attention(q, keys, values, pos, *, decode: bool, backend: str | None = None):
    """Causal attention over a KV cache (default mode). q [B,T,H,Dh]; keys/values [B,N,HKV,Dh]; pos [B,T].

    "reference": `attention_reference` (XLA; the [T, N] scores materialised per head); "pallas"/"interpret": the
    Pallas kernel of `attention_invariant` (3.1x faster than XLA's at decode, B=64, on the H200 — BENCHMARKS.md;
    prefill: faster inside the deterministic model, not timed alone); head layouts the kernel does not support take
    `attention_reference`, and under a tensor-parallel mesh the kernel runs per shard when the mesh splits the heads.
    q, keys, values floating, H a multiple of HKV; pos integers; decode a bool (bad arguments: `jaxgdn.InputError`).
    Returns [B,T,H,Dh] in q.dtype.
    """
    from . import attention as _att  # the submodule (the package exports no name `attention`)

    backend = _backend(backend)
    pos, decode = _checked_attention(q, keys, values, pos, decode)
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
    Arguments checked as `cache_attention`'s (`jaxgdn.InputError`).
    """
    backend = _backend(backend)
    pos, decode = _checked_attention(q, keys, values, pos, decode)
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
    return _backend(backend) != "pallas" or (K, V) in REPLAY_STEP_VERIFIED_HEADS


def _checked_replay(q, k, v, g, beta, state, lengths, scale, use_qk_l2norm, backend: str, caches=None):
    """The open chunk q, k [B,64,HK,K], v [B,64,HV,V], g, beta [B,64,HV]; the fp32 boundary state [B,HV,K,V]; the
    fp32 caches x_cache [B,HV,64,64] and vn_cache [B,HV,64,V] when given; lengths integers [B]. Returns (B, HV, V,
    lengths as int32, scale, use_qk_l2norm as a bool)."""
    (B, T), (HK, K, HV, V) = _checked_heads(q, k, v, "B,T", backend)
    if T != _ref.CHUNK:
        raise _input_error(f"q, k and v must hold the open chunk of {_ref.CHUNK} tokens ([B,{_ref.CHUNK},H,D]); got "
                           f"T={T}")
    _checked_gates(g, beta, (B, T, HV), "[B,64,HV]")
    _checked_state("state", state, (B, HV, K, V))
    if caches is not None:
        _checked_state("x_cache", caches[0], (B, HV, _ref.CHUNK, _ref.CHUNK), "[B,HV,64,64]")
        _checked_state("vn_cache", caches[1], (B, HV, _ref.CHUNK, V), "[B,HV,64,V]")
    lengths = _int_array("lengths", lengths)
    _shape("lengths", lengths, (B,), "[B]")
    return (B, HV, V, jnp.asarray(lengths, jnp.int32), _checked_scale(scale, backend),
            _flag("use_qk_l2norm", use_qk_l2norm))


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
    q, k, v, g, beta have floating dtypes, lengths an integer one (Python lists taken); scale, use_qk_l2norm and
    (on the Pallas backends) K and V as `chunk_gated_delta_rule`'s. Bad arguments raise `jaxgdn.InputError` naming
    them.
    """
    backend = _backend(backend)
    B, HV, V, lengths, scale, use_qk_l2norm = _checked_replay(q, k, v, g, beta, state, lengths, scale, use_qk_l2norm,
                                                              backend, caches=(x_cache, vn_cache))
    if B == 0:
        return jnp.zeros((0, HV, V), v.dtype), state, x_cache, vn_cache
    if backend == "reference":
        o_all, final = _ref.chunk_gated_delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=state,
                                                             use_qk_l2norm=use_qk_l2norm, lengths=lengths)
        o = jnp.take_along_axis(o_all, jnp.maximum(lengths - 1, 0)[:, None, None, None], axis=1)[:, 0]
        o = jnp.where((lengths > 0)[:, None, None], o, jnp.zeros((), o.dtype))  # lengths 0: zeros, as documented
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


def _checked_packed(qkv, gates, state, x_cache, vn_cache, lengths, heads, groups, backend: str):
    """`chunk_replay_step_packed`'s buffers and sizes checked as `_checked_replay` checks the separate arrays' (the
    scale and flag are the caller's to check): heads four integers >= 1 (HV a multiple of HK; K and V as the backend
    needs), groups an integer >= 1 dividing HK and HV, qkv floating [B,64,2*HK*K+HV*V], gates floating [B,64,2,HV],
    the fp32 state [B,HV,K,V] and caches [B,HV,64,64], [B,HV,64,V], lengths integers [B]. Returns (heads as
    `open_chunk.Heads`, groups as an int, lengths as int32)."""
    from .gated_delta import open_chunk as oc

    try:
        items = None if isinstance(heads, (str, bytes)) else tuple(heads)
    except TypeError:
        items = None
    if items is None or len(items) != 4:
        raise _input_error(f"heads must be (HK, K, HV, V), four integers; got {heads!r}")
    HK, K, HV, V = (_count(f"heads[{i}] ({n})", items[i], 1) for i, n in enumerate(("HK", "K", "HV", "V")))
    if HV % HK:
        raise _input_error(f"heads: value heads ({HV}) must be a multiple of key heads ({HK})")
    _checked_head_sizes(K, V, backend)
    groups = _count("groups", groups, 1)
    if HK % groups or HV % groups:
        raise _input_error(f"groups ({groups}) must divide the key heads ({HK}) and the value heads ({HV})")
    C = 2 * HK * K + HV * V
    _array("qkv", qkv)
    if qkv.ndim != 3 or tuple(qkv.shape[1:]) != (_ref.CHUNK, C):
        raise _input_error(f"qkv must be [B,{_ref.CHUNK},2*HK*K+HV*V]=[B,{_ref.CHUNK},{C}] for heads "
                           f"{(HK, K, HV, V)}; got {tuple(qkv.shape)}")
    B = qkv.shape[0]
    _array("gates", gates)
    _shape("gates", gates, (B, _ref.CHUNK, 2, HV), f"[B,{_ref.CHUNK},2,HV]")
    _checked_state("state", state, (B, HV, K, V))
    _checked_state("x_cache", x_cache, (B, HV, _ref.CHUNK, _ref.CHUNK), "[B,HV,64,64]")
    _checked_state("vn_cache", vn_cache, (B, HV, _ref.CHUNK, V), "[B,HV,64,V]")
    lengths = _int_array("lengths", lengths)
    _shape("lengths", lengths, (B,), "[B]")
    return oc.Heads(HK, K, HV, V), groups, jnp.asarray(lengths, jnp.int32)


def chunk_replay_step_packed(qkv, gates, state, x_cache, vn_cache, lengths, *, heads, groups: int, scale=None,
                             use_qk_l2norm=True, backend: str | None = None):
    """`chunk_replay_step` on the open chunk as a model keeps it: qkv [B,64,2·HK·K + HV·V] in `groups` groups of
    [q_g | k_g | v_g] and gates [B,64,2,HV] (g, beta; fp32); heads = (HK, K, HV, V). The Pallas kernels read the
    buffers in place (`gated_delta/open_chunk.py`; no q / k / v copies). Returns (o, state, x_cache, vn_cache) as
    `chunk_replay_step` does, then (qkv, gates) with the rows whose chunk completed (lengths == 64) zeroed — in place
    on the Pallas backends when the caller donates them.

    heads: four integers >= 1 (HV a multiple of HK); groups: an integer >= 1 dividing HK and HV; qkv and gates have
    floating dtypes; state, caches, lengths, scale, use_qk_l2norm and (on the Pallas backends) K and V as
    `chunk_replay_step`'s. Bad arguments raise `jaxgdn.InputError` naming them, before any kernel runs."""
    from .gated_delta import open_chunk as oc

    backend = _backend(backend)
    heads, groups, lengths = _checked_packed(qkv, gates, state, x_cache, vn_cache, lengths, heads, groups, backend)
    kw = dict(scale=_checked_scale(scale, backend), use_qk_l2norm=_flag("use_qk_l2norm", use_qk_l2norm))

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
    ([B,64,...]) after the boundary `state` (fp32 [B,HV,K,V]). Returns (x_cache, vn_cache); zeros on the reference
    backend. Arguments checked as `chunk_replay_step`'s (`jaxgdn.InputError`)."""
    backend = _backend(backend)
    B, HV, V, lengths, scale, use_qk_l2norm = _checked_replay(q, k, v, g, beta, state, lengths, scale, use_qk_l2norm,
                                                              backend)
    if backend == "reference" or B == 0:
        return replay_caches(B, HV, V)
    from .gated_delta.replay import chunk_replay_prime_pallas

    kw = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, interpret=backend == "interpret")
    mesh = _tp_mesh(q.shape[2])
    args = (q, k, v, g, beta, state, lengths)
    if mesh is None:
        return chunk_replay_prime_pallas(*args, **kw)
    t, h = P(None, None, TP_AXIS), P(None, TP_AXIS)
    return _per_shard(lambda *a: chunk_replay_prime_pallas(*a, **kw), mesh, args, (t,) * 5 + (h, P()), (h, h))


def replay_caches(B: int, HV: int, V: int):
    """Empty caches of `chunk_replay_step` (x_cache, vn_cache: fp32 zeros) for B rows, HV value heads of width V."""
    from .gated_delta.replay import replay_caches as empty

    return empty(_count("B", B), _count("HV", HV, 1), _count("V", V, 1))
