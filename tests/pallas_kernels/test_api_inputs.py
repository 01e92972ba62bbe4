"""The public kernel API (`pallas_kernels.api`) on bad and edge-case input: a clear `jaxgdn.InputError` naming the
argument (checked on shapes, dtypes and Python values, before any kernel compiles), the same on every backend;
and the edge cases it answers without running a kernel (no tokens, no rows). Tiny shapes; few compiles."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxgdn.errors import InputError

B, T, HK, HV, K, V, C = 2, 5, 2, 4, 16, 16, 64
BACKENDS = ("reference", "interpret")
PREFILLS = (pk.chunk_gated_delta_rule, pk.fused_recurrent_gated_delta_rule)


def _gdn(b=B, t=T, hk=HK, hv=HV, dtype=jnp.float32, seed=0):
    r = np.random.default_rng(seed)
    q, k = (jnp.asarray(r.standard_normal((b, t, hk, K)), dtype) for _ in range(2))
    v = jnp.asarray(r.standard_normal((b, t, hv, V)), dtype)
    g = jnp.asarray(-r.random((b, t, hv)), jnp.float32)
    beta = jnp.asarray(r.random((b, t, hv)), jnp.float32)
    return q, k, v, g, beta


def _state(b=B, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(1).standard_normal((b, HV, K, V)), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", PREFILLS)
def test_prefill_refuses_bad_arrays(rule, backend):
    """Integer q or v (o came back int32: the output in v's integer dtype), a list, a non-fp32 state (silently
    cast), mismatched shapes: InputError naming the argument."""
    q, k, v, g, beta = _gdn()
    cases = [
        (dict(v=v.astype(jnp.int32)), "v must have a floating dtype"),
        (dict(q=q.astype(jnp.int32), k=k.astype(jnp.int32)), "q must have a floating dtype"),
        (dict(q=np.asarray(q).tolist()), "q must be an array"),
        (dict(initial_state=_state(dtype=jnp.bfloat16)), "initial_state must be fp32"),
        (dict(initial_state=_state().astype(jnp.int32)), "initial_state must be fp32"),
        (dict(initial_state=_state()[:, :2]), r"initial_state must be fp32 \[B,HV,K,V\]=\(2, 4, 16, 16\)"),
        (dict(q=q[:, 0], k=k[:, 0]), r"q must be \[B,T,HK,K\]"),
        (dict(k=k[..., :8]), "k must have q's shape"),
        (dict(v=v[:1]), "v must be"),
        (dict(g=g[:1]), r"g must be \[B,T,HV\]"),
        (dict(beta=beta[..., :3]), r"beta must be \[B,T,HV\]"),
        (dict(v=v[:, :, :3], g=g[..., :3], beta=beta[..., :3]), "multiple of key heads"),
    ]
    for change, match in cases:
        args = {**dict(q=q, k=k, v=v, g=g, beta=beta), **change}
        with pytest.raises(InputError, match=match):
            rule(**args, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", PREFILLS)
def test_prefill_refuses_bad_options(rule, backend):
    """lengths of another batch (the Pallas kernels read the first B and ignored the rest), of a float or bool
    dtype (truncated), 0-d or 2-d; a scale that is a string (read as float("0.5") by the kernels, a crash on the
    reference), NaN or an array; a string flag ("False" read as True); a non-integer checkpoint stride."""
    a = _gdn()
    cases = [
        (dict(lengths=jnp.array([5, 3, 1])), r"lengths must be \[B\]=\(2,\)"),
        (dict(lengths=jnp.array([[5], [3]])), r"lengths must be \[B\]"),
        (dict(lengths=jnp.array(5)), r"lengths must be \[B\]"),
        (dict(lengths=jnp.array([4.7, 3.2])), "lengths must have an integer dtype"),
        (dict(lengths=jnp.array([True, False])), "lengths must have an integer dtype"),
        (dict(lengths=[4.5, 3]), "lengths must have an integer dtype"),
        (dict(scale="0.5"), "scale must be a real number"),
        (dict(scale=True), "scale must be a real number"),
        (dict(scale=float("nan")), "scale must be finite"),
        (dict(scale=np.float32("inf")), "scale must be finite"),
        (dict(scale=jnp.ones(2)), "scale must be a real scalar"),
        (dict(use_qk_l2norm="False"), "use_qk_l2norm must be a bool"),
        (dict(use_qk_l2norm=None), "use_qk_l2norm must be a bool"),
        (dict(checkpoint_stride=64.0), "checkpoint_stride must be an integer"),
        (dict(checkpoint_stride="64"), "checkpoint_stride must be an integer"),
        (dict(checkpoint_stride=True), "checkpoint_stride must be an integer"),
        (dict(checkpoint_stride=0), "checkpoint_stride must be >= 1"),
    ]
    if rule is pk.chunk_gated_delta_rule:
        cases.append((dict(checkpoint_stride=32), "checkpoint_stride must be a positive multiple of 64"))
    for kw, match in cases:
        with pytest.raises(InputError, match=match):
            rule(*a, **kw, backend=backend)


def test_traced_scale_on_the_pallas_backend():
    """The kernels compile the scale in: a traced one was a ConcretizationTypeError from inside the kernel module."""
    a = _gdn()
    f = jax.jit(lambda s: pk.chunk_gated_delta_rule(*a, scale=s, backend="interpret"))
    with pytest.raises(InputError, match="scale must be a concrete number"):
        f(0.25)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", PREFILLS)
def test_prefill_of_no_tokens_or_no_rows(rule, backend):
    """T = 0 or B = 0: o empty, the state as given (fp32), checkpoints empty — where the Pallas kernels failed deep
    inside the interpreter ("slice slice_sizes must be less than or equal to operand shape"), the token-by-token
    reference with "range() arg 3 must not be zero" and the scan kernel refused T = 0."""
    s0 = _state()
    o, s = rule(*_gdn(t=0), initial_state=s0, backend=backend)
    assert o.shape == (B, 0, HV, V) and o.dtype == jnp.float32
    assert s.dtype == jnp.float32 and np.array_equal(np.asarray(s), np.asarray(s0))
    o, s, ck = rule(*_gdn(t=0, dtype=jnp.bfloat16), lengths=[0, 0], checkpoint_stride=np.int64(64),
                    backend=backend)
    assert o.shape == (B, 0, HV, V) and o.dtype == jnp.bfloat16
    assert ck.shape == (B, 0, HV, K, V) and not np.asarray(s).any()
    o, s, ck = rule(*_gdn(b=0, t=130), checkpoint_stride=64, backend=backend)
    assert o.shape == (0, 130, HV, V) and s.shape == (0, HV, K, V) and ck.shape == (0, 2, HV, K, V)


def test_lengths_as_a_python_list():
    """A list of lengths: the Pallas kernels took it, the reference failed ("list indices must be integers or
    slices, not tuple")."""
    a = _gdn()
    s0 = _state()
    want = pk.fused_recurrent_gated_delta_rule(*a, initial_state=s0, lengths=jnp.array([5, 3]), backend="reference")
    got = pk.fused_recurrent_gated_delta_rule(*a, initial_state=s0, lengths=[5, 3], backend="reference")
    for x, y in zip(got, want):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def _step_args(b=B):
    r = np.random.default_rng(2)
    q, k = (jnp.asarray(r.standard_normal((b, HK, K)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.standard_normal((b, HV, V)), jnp.float32)
    g = jnp.asarray(-r.random((b, HV)), jnp.float32)
    beta = jnp.asarray(r.random((b, HV)), jnp.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_step_refuses_bad_input(backend):
    """A_log without dt_bias (an AttributeError on the reference), gate parameters of the wrong shape (broadcast
    silently on the reference: dt_bias [B,HV] was accepted), a bf16 state (accepted by the reference, refused by
    the kernel), a prefill-shaped call (the reference's message spoke of [B,T,HK,K]), int v."""
    q, k, v, g, beta = _step_args()
    s0, hv = _state(), jnp.zeros((HV,))
    f = pk.recurrent_gated_delta_rule
    with pytest.raises(InputError, match="A_log and dt_bias go together"):
        f(q, k, v, g, beta, initial_state=s0, A_log=hv, backend=backend)
    with pytest.raises(InputError, match=r"A_log must be \[HV\]"):
        f(q, k, v, g, beta, initial_state=s0, A_log=hv[:2], dt_bias=hv, backend=backend)
    with pytest.raises(InputError, match=r"dt_bias must be \[HV\]"):
        f(q, k, v, g, beta, initial_state=s0, A_log=hv, dt_bias=jnp.zeros((B, HV)), backend=backend)
    with pytest.raises(InputError, match="initial_state must be fp32"):
        f(q, k, v, g, beta, initial_state=s0.astype(jnp.bfloat16), backend=backend)
    with pytest.raises(InputError, match=r"q must be \[B,HK,K\]"):
        f(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None], initial_state=s0, backend=backend)
    with pytest.raises(InputError, match=r"g must be \[B,HV\]"):
        f(q, k, v, g[:, :2], beta, initial_state=s0, backend=backend)
    with pytest.raises(InputError, match="v must have a floating dtype"):
        f(q, k, v.astype(jnp.int32), g, beta, initial_state=s0, backend=backend)
    with pytest.raises(InputError, match="use_qk_l2norm must be a bool"):
        f(q, k, v, g, beta, initial_state=s0, use_qk_l2norm="no", backend=backend)
    # no rows, and no state (zeros, as the reference took it; the kernel failed on None.shape)
    o, s = f(*_step_args(b=0), initial_state=None, backend=backend)
    assert o.shape == (0, HV, V) and s.shape == (0, HV, K, V) and s.dtype == jnp.float32


def _chunk_args(b=B, t=C):
    return _gdn(b=b, t=t, seed=3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replay_refuses_bad_input(backend):
    """The reference backend took an open chunk of 63 tokens (and answered NaN), caches of the wrong shape or
    dtype (passed back as they came), and `chunk_replay_prime` checked nothing there; the interpreter failed on a
    bf16 vn_cache inside pallas_call ("input_output_aliases ... different abstract value"); float lengths were
    truncated on both."""
    x = _chunk_args()
    s0 = _state()
    xc, vc = pk.replay_caches(B, HV, V)
    lengths = jnp.array([3, 64])
    step, prime = pk.chunk_replay_step, pk.chunk_replay_prime
    with pytest.raises(InputError, match="open chunk of 64 tokens"):
        step(*_chunk_args(t=63), s0, xc, vc, lengths, backend=backend)
    with pytest.raises(InputError, match="x_cache must be fp32"):
        step(*x, s0, xc[:, :2], vc, lengths, backend=backend)
    with pytest.raises(InputError, match="vn_cache must be fp32"):
        step(*x, s0, xc, vc.astype(jnp.bfloat16), lengths, backend=backend)
    with pytest.raises(InputError, match="state must be fp32"):
        step(*x, s0.astype(jnp.bfloat16), xc, vc, lengths, backend=backend)
    with pytest.raises(InputError, match="lengths must have an integer dtype"):
        step(*x, s0, xc, vc, jnp.array([3.0, 64.0]), backend=backend)
    with pytest.raises(InputError, match=r"lengths must be \[B\]"):
        step(*x, s0, xc, vc, jnp.array(3), backend=backend)
    with pytest.raises(InputError, match="scale must be a real number"):
        step(*x, s0, xc, vc, lengths, scale="x", backend=backend)
    with pytest.raises(InputError, match="open chunk of 64 tokens"):
        prime(*_chunk_args(t=5), s0, [3, 4], backend=backend)
    with pytest.raises(InputError, match=r"g must be \[B,64,HV\]"):
        prime(*x[:3], x[3][:1], x[4], s0, [3, 4], backend=backend)
    with pytest.raises(InputError, match="state must be fp32"):
        prime(*x, s0[:, :2], [3, 4], backend=backend)
    with pytest.raises(InputError, match=r"lengths must be \[B\]"):
        prime(*x, s0, [3, 4, 5], backend=backend)
    # no rows: nothing runs
    o, s, xc0, vc0 = step(*_chunk_args(b=0), _state(b=0), *pk.replay_caches(0, HV, V), [], backend=backend)
    assert o.shape == (0, HV, V) and s.shape == (0, HV, K, V)


def test_replay_step_row_of_no_tokens_is_zeros_on_the_reference():
    """lengths[b] = 0: "the row is left as it is, its output zeros" — the reference backend returned q_0 S (the
    chunked rule's output at a padded position) there; the interpreter gives zeros."""
    x = _chunk_args()
    s0 = _state()
    xc, vc = pk.replay_caches(B, HV, V)
    o, s, _, _ = pk.chunk_replay_step(*x, s0, xc, vc, [0, 5], backend="reference")
    assert not np.asarray(o[0]).any() and np.asarray(o[1]).any()
    assert np.array_equal(np.asarray(s), np.asarray(s0))


def test_replay_kernel_refuses_a_bf16_cache():
    """The Pallas entry point itself (`gated_delta.replay`): a ValueError naming the cache, not pallas_call's
    aliasing error."""
    from pallas_kernels.gated_delta.replay import chunk_replay_step_pallas

    xc, vc = pk.replay_caches(B, HV, V)
    with pytest.raises(ValueError, match="vn_cache must be fp32"):
        chunk_replay_step_pallas(*_chunk_args(), _state(), xc, vc.astype(jnp.bfloat16), jnp.array([3, 64]),
                                 interpret=True)


def test_replay_caches_refuses_bad_sizes():
    for args, match in (((-1, HV, V), "B must be >= 0"), ((2.5, HV, V), "B must be an integer"),
                        (("2", HV, V), "B must be an integer"), ((B, 0, V), "HV must be >= 1")):
        with pytest.raises(InputError, match=match):
            pk.replay_caches(*args)
    xc, vc = pk.replay_caches(np.int64(2), HV, V)
    assert xc.shape == (2, HV, C, C) and vc.shape == (2, HV, C, V)


def _attention_args():
    r = np.random.default_rng(4)
    q = jnp.asarray(r.standard_normal((B, 3, 4, 16)), jnp.float32)
    keys, values = (jnp.asarray(r.standard_normal((B, 10, 2, 16)), jnp.float32) for _ in range(2))
    pos = jnp.broadcast_to(jnp.arange(3, dtype=jnp.int32) + 5, (B, 3))
    return q, keys, values, pos


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attend", [pk.cache_attention, pk.attention_invariant])
def test_attention_refuses_bad_input(attend, backend):
    """keys of one row for a batch of two (broadcast silently on the reference), query heads not a multiple of the
    key/value heads (a reshape error), float positions (truncated), a string flag, q of rank 3 (an IndexError), an
    empty cache (a reduction or slice error), integer q (an integer result)."""
    q, keys, values, pos = _attention_args()
    cases = [
        ((q, keys[:1], values[:1], pos), "keys must be"),
        ((q[:, :, :3], keys, values, pos), "multiple of key/value heads"),
        ((q[..., :8], keys, values, pos), "keys must be"),
        ((q, keys, values[:, :5], pos), "values must be"),
        ((q, keys, values, pos.astype(jnp.float32)), "pos must have an integer dtype"),
        ((q, keys, values, pos[:, 0]), r"pos must be \[B,T\]"),
        ((q[:, 0], keys, values, pos), r"q must be \[B,T,H,Dh\]"),
        ((q, keys[:, :0], values[:, :0], pos), "no cache slot"),
        ((q.astype(jnp.int32), keys, values, pos), "q must have a floating dtype"),
    ]
    for args, match in cases:
        with pytest.raises(InputError, match=match):
            attend(*args, decode=False, backend=backend)
    with pytest.raises(InputError, match="decode must be a bool"):
        attend(q, keys, values, pos, decode="no", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_matmul_refuses_bad_shapes(backend):
    """The reference took w of rank 1 or 3 (jnp.dot's semantics), and a mismatched K or a rank-0 x failed inside
    XLA or with an IndexError; a string w_transposed was read as True."""
    x = jnp.ones((3, 5, 32), jnp.float32)
    w = jnp.ones((32, 16), jnp.float32)
    for args, kw in (((x, w[None]), {}), ((x, w[:, 0]), {}), ((x, w[:16]), {}), ((jnp.float32(1), w), {}),
                     ((x, w), dict(w_transposed=True))):
        with pytest.raises(InputError, match=r"expected x \[\.\.\., K\] and w"):
            pk.matmul_invariant(*args, **kw, backend=backend)
    with pytest.raises(InputError, match="w_transposed must be a bool"):
        pk.matmul_invariant(x, w.T, w_transposed="True", backend=backend)
    with pytest.raises(InputError, match="row_groups must be an integer"):
        pk.matmul_invariant(x, w, row_groups="4", backend=backend)


def _packed_args(b=B, hk=HK, k_dim=K, hv=HV, v_dim=V):
    """The packed open chunk (qkv [B,64,2 HK K + HV V], gates [B,64,2,HV]), the boundary state and the caches."""
    r = np.random.default_rng(5)
    qkv = jnp.asarray(r.standard_normal((b, C, 2 * hk * k_dim + hv * v_dim)), jnp.float32)
    gates = jnp.asarray(r.random((b, C, 2, hv)), jnp.float32)
    state = jnp.zeros((b, hv, k_dim, v_dim), jnp.float32)
    x_cache, vn_cache = pk.replay_caches(b, hv, v_dim)
    return qkv, gates, state, x_cache, vn_cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_step_refuses_bad_input(backend):
    """`chunk_replay_step_packed` checked almost nothing: float lengths were truncated, use_qk_l2norm="False" read as
    True on the interpreter (`bool("False")`), a qkv one column short a TypeError (reference) or a plain ValueError
    (interpreter), malformed heads or groups a TypeError from `Heads(*heads)` or the reshape. Now as
    `chunk_replay_step`: InputError naming the argument, before any kernel compiles."""
    qkv, gates, s0, xc, vc = _packed_args()
    lengths = jnp.array([3, 64])
    base = dict(qkv=qkv, gates=gates, state=s0, x_cache=xc, vn_cache=vc, lengths=lengths, heads=(HK, K, HV, V),
                groups=1)
    cases = [
        (dict(lengths=np.array([1.5, 2.0])), "lengths must have an integer dtype"),
        (dict(lengths=[3.0, 4]), "lengths must have an integer dtype"),
        (dict(lengths=jnp.array([True, False])), "lengths must have an integer dtype"),
        (dict(lengths=[3, 4, 5]), r"lengths must be \[B\]=\(2,\)"),
        (dict(use_qk_l2norm="False"), "use_qk_l2norm must be a bool"),
        (dict(use_qk_l2norm=1), "use_qk_l2norm must be a bool"),
        (dict(scale="0.5"), "scale must be a real number"),
        (dict(scale=float("inf")), "scale must be finite"),
        (dict(qkv=qkv[:, :, :-1]), r"qkv must be \[B,64,2\*HK\*K\+HV\*V\]=\[B,64,128\]"),
        (dict(qkv=qkv[:, :63]), r"qkv must be \[B,64,"),
        (dict(qkv=qkv[0]), r"qkv must be \[B,64,"),
        (dict(qkv=qkv.astype(jnp.int32)), "qkv must have a floating dtype"),
        (dict(qkv=np.asarray(qkv).tolist()), "qkv must be an array"),
        (dict(gates=gates[:, :, :1]), r"gates must be \[B,64,2,HV\]=\(2, 64, 2, 4\)"),
        (dict(gates=gates[:1]), r"gates must be \[B,64,2,HV\]"),
        (dict(gates=gates.astype(jnp.int32)), "gates must have a floating dtype"),
        (dict(heads=(HK, K, HV)), r"heads must be \(HK, K, HV, V\), four integers"),
        (dict(heads=16), r"heads must be \(HK, K, HV, V\), four integers"),
        (dict(heads="2416"), r"heads must be \(HK, K, HV, V\), four integers"),
        (dict(heads=(HK, 16.0, HV, V)), r"heads\[1\] \(K\) must be an integer"),
        (dict(heads=(HK, K, "4", V)), r"heads\[2\] \(HV\) must be an integer"),
        (dict(heads=(0, K, HV, V)), r"heads\[0\] \(HK\) must be >= 1"),
        (dict(heads=(3, K, HV, V)), r"value heads \(4\) must be a multiple of key heads \(3\)"),
        (dict(groups="1"), "groups must be an integer"),
        (dict(groups=True), "groups must be an integer"),
        (dict(groups=0), "groups must be >= 1"),
        (dict(groups=4), r"groups \(4\) must divide the key heads \(2\) and the value heads \(4\)"),
        (dict(state=s0.astype(jnp.bfloat16)), "state must be fp32"),
        (dict(state=s0[:, :2]), r"state must be fp32 \[B,HV,K,V\]"),
        (dict(x_cache=xc[:, :2]), r"x_cache must be fp32 \[B,HV,64,64\]"),
        (dict(vn_cache=vc.astype(jnp.bfloat16)), "vn_cache must be fp32"),
    ]
    for change, match in cases:
        with pytest.raises(InputError, match=match):
            pk.chunk_replay_step_packed(**{**base, **change}, backend=backend)


def _every_entry_point(backend):
    """Each public function of `pallas_kernels.api` that takes `backend`, called on valid tiny input."""
    gdn, step, chunk = _gdn(), _step_args(), _chunk_args()
    s0 = _state()
    xc, vc = pk.replay_caches(B, HV, V)
    q, keys, values, pos = _attention_args()
    return {
        "chunk_gated_delta_rule": lambda: pk.chunk_gated_delta_rule(*gdn, backend=backend),
        "fused_recurrent_gated_delta_rule": lambda: pk.fused_recurrent_gated_delta_rule(*gdn, backend=backend),
        "recurrent_gated_delta_rule": lambda: pk.recurrent_gated_delta_rule(*step, initial_state=s0,
                                                                            backend=backend),
        "matmul_invariant": lambda: pk.matmul_invariant(jnp.ones((3, 32)), jnp.ones((32, 16)), backend=backend),
        "cache_attention": lambda: pk.cache_attention(q, keys, values, pos, decode=False, backend=backend),
        "attention_invariant": lambda: pk.attention_invariant(q, keys, values, pos, decode=False, backend=backend),
        "replay_step_matches_prefill": lambda: pk.replay_step_matches_prefill(K, V, backend=backend),
        "chunk_replay_step": lambda: pk.chunk_replay_step(*chunk, s0, xc, vc, [3, 4], backend=backend),
        "chunk_replay_step_packed": lambda: pk.chunk_replay_step_packed(*_packed_args(), [3, 4],
                                                                        heads=(HK, K, HV, V), groups=1,
                                                                        backend=backend),
        "chunk_replay_prime": lambda: pk.chunk_replay_prime(*chunk, s0, [3, 4], backend=backend),
    }


@pytest.mark.parametrize("backend", ["gpu", "Pallas", "", 1, ["reference"]])
def test_unknown_backend_is_an_input_error(backend):
    """`backend="gpu"` raised resolve_backend's builtin ValueError from every entry point: `except
    jaxgdn.InputError` missed it. Now an InputError (still a ValueError) naming the backend and the choices."""
    for name, call in _every_entry_point(backend).items():
        with pytest.raises(InputError, match=r"unknown kernel backend .*expected one of \('reference', 'pallas', "
                                             r"'interpret'\) or None") as err:
            call()
        assert isinstance(err.value, ValueError), name


def _heads_of(k_dim, v_dim, t):
    r = np.random.default_rng(6)
    q, k = (jnp.asarray(r.standard_normal((B, t, HK, k_dim)), jnp.float32) for _ in range(2))
    v = jnp.asarray(r.standard_normal((B, t, HV, v_dim)), jnp.float32)
    g = jnp.asarray(-r.random((B, t, HV)), jnp.float32)
    beta = jnp.asarray(r.random((B, t, HV)), jnp.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("k_dim,v_dim,bad", [(24, 16, "K=24"), (16, 8, "V=8"), (16, 48, "V=48"), (8, 16, "K=8")])
def test_pallas_backends_refuse_head_sizes_the_kernels_cannot_run(k_dim, v_dim, bad):
    """K or V not a power of two >= 16 passed the API's checks on the Pallas backends, then failed inside the
    kernels with a builtin ValueError (`chunk._check_pow2`, and the same test in scan.py, recurrent.py, replay.py).
    Now an InputError up front, from every GDN entry point on "interpret" (and "pallas": the same check)."""
    match = bad + r": the head sizes K and V must be powers of two >= 16 on the Pallas backends"
    prefill, chunk = _heads_of(k_dim, v_dim, T), _heads_of(k_dim, v_dim, C)
    step = tuple(x[:, 0] for x in prefill)
    s0 = jnp.zeros((B, HV, k_dim, v_dim), jnp.float32)
    xc, vc = pk.replay_caches(B, HV, v_dim)
    calls = [
        lambda: pk.chunk_gated_delta_rule(*prefill, backend="interpret"),
        lambda: pk.fused_recurrent_gated_delta_rule(*prefill, backend="interpret"),
        lambda: pk.chunk_gated_delta_rule(*_heads_of(k_dim, v_dim, 0), backend="interpret"),  # T = 0 too
        lambda: pk.recurrent_gated_delta_rule(*step, initial_state=s0, backend="interpret"),
        lambda: pk.chunk_replay_step(*chunk, s0, xc, vc, [3, 4], backend="interpret"),
        lambda: pk.chunk_replay_prime(*chunk, s0, [3, 4], backend="interpret"),
        lambda: pk.chunk_replay_step_packed(*_packed_args(k_dim=k_dim, v_dim=v_dim), [3, 4],
                                            heads=(HK, k_dim, HV, v_dim), groups=1, backend="interpret"),
        lambda: pk.recurrent_gated_delta_rule(*step, initial_state=s0, backend="pallas"),
    ]
    for call in calls:
        with pytest.raises(InputError, match=match):
            call()


def test_reference_backend_takes_any_head_size():
    """The rule is the Pallas kernels'; the reference backend keeps running K = 24, V = 8."""
    prefill = _heads_of(24, 8, T)
    s0 = jnp.zeros((B, HV, 24, 8), jnp.float32)
    o, s = pk.recurrent_gated_delta_rule(*(x[:, 0] for x in prefill), initial_state=s0, backend="reference")
    assert o.shape == (B, HV, 8) and s.shape == (B, HV, 24, 8)
    o, s = pk.chunk_gated_delta_rule(*prefill, initial_state=s0, backend="reference")
    assert o.shape == (B, T, HV, 8) and np.isfinite(np.asarray(o)).all()
    xc, vc = pk.chunk_replay_prime(*_heads_of(24, 8, C), s0, [3, 4], backend="reference")
    assert xc.shape == (B, HV, C, C) and vc.shape == (B, HV, C, 8)
