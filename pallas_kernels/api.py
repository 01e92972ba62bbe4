"""Kernel entry points the model calls. Each routes through `backend.resolve_backend` to the pure-JAX
reference or to the Pallas kernel (compiled, or interpreted on CPU). Shapes: see `gated_delta.reference`."""

from __future__ import annotations

from .backend import resolve_backend
from .gated_delta import reference as _ref


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, lengths=None,
                           checkpoint_stride=None, backend: str | None = None):
    """Chunked gated delta rule (prefill). q, k: [B,T,HK,K]; v: [B,T,HV,V]; g, beta: [B,T,HV].

    Returns (o [B,T,HV,V], final_state fp32 [B,HV,K,V]), plus checkpoints [B,T//stride,HV,K,V] when
    `checkpoint_stride` is given.
    """
    kw = dict(scale=scale, initial_state=initial_state, use_qk_l2norm=use_qk_l2norm, lengths=lengths,
              checkpoint_stride=checkpoint_stride)
    backend = resolve_backend(backend)
    if backend == "reference":
        return _ref.chunk_gated_delta_rule_reference(q, k, v, g, beta, **kw)
    from .gated_delta.chunk import chunk_gated_delta_rule_pallas

    return chunk_gated_delta_rule_pallas(q, k, v, g, beta, interpret=backend == "interpret", **kw)


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

    return recurrent_gated_delta_rule_pallas(q, k, v, g, beta, initial_state=initial_state, scale=scale,
                                             use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias,
                                             interpret=backend == "interpret")
