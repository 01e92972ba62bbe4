"""The replay step over the chunked prefill (`pallas_kernels/gated_delta/replay.py`, interpret mode on CPU): decoding
token by token with it gives, bit for bit, the output rows and boundary states of one chunked prefill of the whole
sequence, from prompts the chunked kernels prefilled and `prime` left open; its caches equal `prime`'s for the
same tokens. (On the H200: `scripts/gpu_kernels.py --only replay_step`.)"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.replay import chunk_replay_prime_pallas, chunk_replay_step_pallas, replay_caches
from tests.gdn_oracle import random_gdn_inputs

K = V = 32
C = 64


def _window(x, start, n):
    """Rows start[b] .. start[b] + 63 of x [B, T, ...], zero from n[b] on."""
    out = np.zeros((x.shape[0], C) + x.shape[2:], x.dtype)
    for b in range(x.shape[0]):
        rows = x[b, start[b]:start[b] + n[b]]
        out[b, :len(rows)] = rows
    return jnp.asarray(out)


def _inputs(rng, B, T, HK, HV, dtype=np.float32, v_dim=None, **kw):
    d = random_gdn_inputs(rng, B=B, T=T, HK=HK, HV=HV, K=K, V=v_dim or V, with_state=True, **kw)
    return {n: np.asarray(d[n], dtype if n in "qkv" else np.float32) for n in ("q", "k", "v", "g", "beta")}, \
        np.asarray(d["initial_state"], np.float32)


def _chunk(x, s0, lengths, stride=None, config=None):
    out = chunk_gated_delta_rule_pallas(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                        initial_state=jnp.asarray(s0), lengths=jnp.asarray(lengths, jnp.int32),
                                        checkpoint_stride=stride, interpret=True, config=config)
    return tuple(np.asarray(o) for o in out)


def _open(x, start, n):
    return [_window(x[name], start, n) for name in ("q", "k", "v", "g", "beta")]


def _decode(x, s0, prompt, steps, config=None):
    """Prefill to each row's last grid boundary, prime the open rest, then `steps` replay steps. Returns the outputs
    [B, steps, HV, V], the boundary states crossed {(row, position): state} and the final (state, caches). config:
    the step's, the prefill's and prime's (the prefill ignores the step's launch keys)."""
    prompt = np.asarray(prompt)
    bnd = prompt // C * C
    _, s = _chunk(x, s0, bnd, config=config)
    s = jnp.asarray(s)
    xc, vc = chunk_replay_prime_pallas(*_open(x, bnd, prompt - bnd), s, jnp.asarray(prompt - bnd), interpret=True,
                                       config=config)
    step = jax.jit(lambda *a: chunk_replay_step_pallas(*a, interpret=True, config=config))
    outs, crossed, pos = [], {}, prompt.copy()
    for _ in range(steps):
        start = pos // C * C
        n = pos - start + 1
        o, s, xc, vc = step(*_open(x, start, n), s, xc, vc, jnp.asarray(n, jnp.int32))
        outs.append(np.asarray(o))
        for b in np.flatnonzero(n == C):
            crossed[b, int(pos[b]) + 1] = np.asarray(s[b])
        pos += 1
    return np.stack(outs, axis=1), crossed, (s, xc, vc)


@pytest.mark.parametrize("HK,HV,dtype,g_kind,beta_kind,prompt,steps,v_dim,config", [
    (1, 2, np.float32, "realistic", "realistic", (70, 37, 0), 100, V, None),  # HV = 2 HK; a row from an empty state
    (1, 4, jnp.bfloat16, "near_zero", "mixed", (63, 5), 75, V, None),  # HV = 4 HK, bf16 inputs, beta 0 / 1 / sigmoid
    (2, 2, np.float32, "very_negative", "one", (16, 47), 50, V, None),  # a row starting exactly on a block row
    (1, 3, np.float32, "realistic", "realistic", (40, 50), 30, V, None),  # HV = 3 HK: kernel 2 per value head
    (1, 2, np.float32, "realistic", "mixed", (37, 70), 60, 128, None),  # V = 128: the last kernels' two V blocks of 64
    # per row and head (the one-kernel step of runs 36-37 raced on a shared tile cache here; now kernel 1 owns it)
    (1, 2, jnp.bfloat16, "realistic", "mixed", (37, 70, 8), 75, 128, {"replay_s0_dots": 2}),  # kernel 3's w S0 and
    # qg S0 as two dots
    (2, 4, jnp.bfloat16, "realistic", "realistic", (60, 3), 70, V, {"replay_kd": "fold"}),  # kernel 4 computing kd
    # itself (the default before run 103) instead of loading kernel 1's
    # the gram tiles as one bf16 dot (the default before run 114; now one fp16 dot: `chunk._gram_precision`), in the
    # prefill, prime and step alike
    (1, 2, jnp.bfloat16, "near_zero", "one", (45, 20), 60, V, {"p_kk": "bf16"}),
])
def test_replay_steps_equal_one_prefill_bitwise(HK, HV, dtype, g_kind, beta_kind, prompt, steps, v_dim, config):
    rng = np.random.default_rng(HV + steps)
    B, T = len(prompt), max(prompt) + steps
    x, s0 = _inputs(rng, B, T, HK, HV, dtype, v_dim=v_dim, g_kind=g_kind, beta_kind=beta_kind)
    o_full, _, cks = _chunk(x, s0, np.asarray(prompt) + steps, stride=C, config=config)
    outs, crossed, _ = _decode(x, s0, prompt, steps, config=config)
    for b, p in enumerate(prompt):
        assert np.array_equal(outs[b], o_full[b, p:p + steps]), b  # every decoded row, bitwise
    assert len(crossed) >= B  # every row crossed a boundary
    for (b, p), st in crossed.items():
        assert np.array_equal(st, cks[b, p // C - 1]), (b, p)  # the new boundary == the prefill's state there


def test_caches_after_steps_equal_prime_and_a_row_alone_equals_the_batch():
    rng = np.random.default_rng(7)
    prompt, steps = np.array([50, 12]), 60  # row 0 crosses 64 (caches cleared) and refills; row 1 fills block rows
    x, s0 = _inputs(rng, 2, 130, 1, 2)
    outs, _, (s, xc, vc) = _decode(x, s0, prompt, steps)
    end = prompt + steps
    bnd = end // C * C
    _, s_ref = _chunk(x, s0, bnd)
    xp, vp = chunk_replay_prime_pallas(*_open(x, bnd, end - bnd), jnp.asarray(s_ref), jnp.asarray(end - bnd),
                                       interpret=True)
    assert np.array_equal(np.asarray(s), s_ref)  # the boundary state
    assert np.array_equal(np.asarray(xc), np.asarray(xp)) and np.array_equal(np.asarray(vc), np.asarray(vp))
    alone, _, _ = _decode({n: a[1:] for n, a in x.items()}, s0[1:], prompt[1:], steps)
    assert np.array_equal(alone[0], outs[1])


def test_empty_rows_are_untouched_and_output_zero():
    rng = np.random.default_rng(3)
    x, s0 = _inputs(rng, 2, C, 1, 2)
    xc, vc = replay_caches(2, 2, V)
    xc, vc = xc + 1.0, vc + 2.0  # anything: a row with nothing to do must leave it
    o, s, xc2, vc2 = chunk_replay_step_pallas(*(jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")),
                                              jnp.asarray(s0), xc, vc, jnp.asarray([0, 0]), interpret=True)
    assert np.array_equal(np.asarray(o), np.zeros_like(np.asarray(o)))
    assert np.array_equal(np.asarray(s), s0)
    assert np.array_equal(np.asarray(xc2), np.asarray(xc)) and np.array_equal(np.asarray(vc2), np.asarray(vc))


def test_bad_shapes_are_refused():
    rng = np.random.default_rng(4)
    x, s0 = _inputs(rng, 1, C, 1, 2)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")]
    xc, vc = replay_caches(1, 2, V)
    with pytest.raises(ValueError, match="open chunk"):
        chunk_replay_step_pallas(*[a[:, :32] for a in args], jnp.asarray(s0), xc, vc, jnp.asarray([3]),
                                 interpret=True)
    with pytest.raises(ValueError, match="vn_cache"):
        chunk_replay_step_pallas(*args, jnp.asarray(s0), xc, vc[:, :, :32], jnp.asarray([3]), interpret=True)
    with pytest.raises(ValueError, match="warps"):
        chunk_replay_step_pallas(*args, jnp.asarray(s0), xc, vc, jnp.asarray([3]), interpret=True,
                                 config={"warps_out": 8})


def test_launch_keys_take_effect_and_are_checked():
    """`bv_replay` (the last kernel's V block) and the benchmark-only `warps_replay` are accepted and checked: other
    warps (also kernel 2's own, `warps_replay_intra`) give the same bits (interpret mode ignores warps: this
    checks the plumbing; the H200 runs check the bits, test_cuda_lowering the launches), V = 64 in blocks of 16 and
    kernel 2's q k^T row as a column of k q^T (`replay_qk_cols`, the GPU's form) the same values to 1e-5 (XLA:CPU's
    dots round differently for other shapes; the GPU's MMAs do not: `gpu_kernels.py --only replay_step`; the dot
    shapes: test_cuda_lowering), and bad values of each are refused (a list of warps, as JSON gives it, is
    taken)."""
    rng = np.random.default_rng(5)
    x, s0 = _inputs(rng, 2, C, 1, 2, v_dim=64)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")] + [jnp.asarray(s0)]
    xc, vc = chunk_replay_prime_pallas(*args, jnp.asarray([20, 47]), interpret=True)
    lengths = jnp.asarray([21, 48])  # the second row completes block row 2: the v_new cache is written
    want = chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True)
    for cfg in ({"warps_replay": (8, 4, 4)}, {"warps_replay": 8}, {"warps_replay_intra": 4}):
        got = chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True, config=cfg)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want)), cfg
    for cfg in ({"bv_replay": 16}, {"replay_qk_cols": True}):
        got = chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True, config=cfg)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)
    assert not np.array_equal(np.asarray(want[3]), np.asarray(vc))
    with pytest.raises(ValueError, match="bv_replay"):
        chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True, config={"bv_replay": 24})
    for bad in ({"replay_s0_dots": 3}, {"replay_s0_dots": 1, "p_qs": "ieee"}, {"replay_qk_cols": "yes"},
                {"replay_qk_cols": 2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True, config=bad)
    with pytest.raises(ValueError, match="warps_replay_intra"):
        chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True, config={"warps_replay_intra": 0})
    for bad in (0, -3, (8, 4), (8, 4, 0), "8"):
        with pytest.raises(ValueError, match="warps_replay"):
            chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True, config={"warps_replay": bad})
    listed = chunk_replay_step_pallas(*args, xc, vc, lengths, interpret=True, config={"warps_replay": [8, 4, 4]})
    assert np.array_equal(np.asarray(listed[0]), np.asarray(want[0]))  # a JSON list, as gpu_profile's --config gives


def test_one_substitution_step_per_row_equals_the_loop():
    """The step computes row r of the diagonal tile's inverse from the rows < r its cache holds
    (`wy.substitution_step`, once per token) where the prefill runs the whole loop (`wy.diag_tiles_by_substitution`):
    row for row the same bits (here jitted on CPU; on the H200 the bitwise replay checks cover it)."""
    from pallas_kernels.gated_delta import wy
    from pallas_kernels.gated_delta.chunk import DEFAULT_CONFIG

    rng = np.random.default_rng(9)
    kb = np.asarray(wy.l2norm(jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)))
    gc = np.cumsum(-np.abs(rng.standard_normal(16)) * 0.3).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal(16)))).astype(np.float32)
    cfg = dict(DEFAULT_CONFIG)
    loop = np.asarray(jax.jit(lambda *a: wy.diag_tiles_by_substitution([a[0]], [a[1]], [a[2]], cfg, True)[0])(
        kb, gc, beta))

    @jax.jit
    def step(kb, gc, beta, cached, r):
        r16, c16 = wy.tile_iotas()
        at = wy.diag_tile_transposed(kb, gc, beta, r16 < c16, cfg, True)
        t = jnp.where(r16 < r, cached, jnp.where(r16 == c16, 1.0, 0.0))
        return wy.substitution_step(r, at, t, r16, c16)

    cached = np.eye(16, dtype=np.float32)
    for r in range(1, 16):
        cached = np.where(np.arange(16)[:, None] <= r, np.asarray(step(kb, gc, beta, cached, r)), cached)
    assert np.array_equal(cached, loop)
    assert not np.array_equal(loop, np.eye(16, dtype=np.float32))  # a real inverse, not the identity


def test_boundary_states_of_rows_completing_together_whatever_the_rows_per_program():
    """Kernel 4 looks after `replay_state_rows` batch rows per program (the largest power of two <= it dividing B):
    three of four rows completing their chunk in the same step — one per program by default ("auto" on a small
    grid), all in one program with 4, two per program with 2, and with kd from kernel 1 or computed in kernel 4
    (`replay_kd`) — give the same bits, each row's new boundary state
    equals the prefill's, the row that does not complete keeps its state and caches, and bad values are refused."""
    rng = np.random.default_rng(9)
    x, s0 = _inputs(rng, 4, C, 1, 2)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")] + [jnp.asarray(s0)]
    lengths = np.asarray([64, 64, 30, 64])
    xc, vc = chunk_replay_prime_pallas(*args, jnp.asarray(lengths - 1), interpret=True)
    outs = [chunk_replay_step_pallas(*args, xc, vc, jnp.asarray(lengths), interpret=True, config=cfg)
            for cfg in (None, {"replay_state_rows": 4}, {"replay_state_rows": 2}, {"replay_kd": "fold"},
                        {"replay_kd": "prep", "replay_state_rows": 4})]
    for got in outs[1:]:
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, outs[0]))
    _, s_ref = _chunk(x, s0, lengths)
    st, vn = np.asarray(outs[0][1]), np.asarray(outs[0][3])
    for b in (0, 1, 3):
        assert np.array_equal(st[b], s_ref[b]), b  # the prefill's state after the whole chunk
        assert not vn[b].any(), b  # the next chunk starts with an empty v_new cache
    assert np.array_equal(st[2], s0[2]) and vn[2].any()  # row 2 (30 tokens) keeps its boundary and its cache
    for bad in (0, -1, 2.0, True, "many"):
        with pytest.raises(ValueError, match="replay_state_rows"):
            chunk_replay_step_pallas(*args, xc, vc, jnp.asarray(lengths), interpret=True,
                                     config={"replay_state_rows": bad})
    for bad in ("kernel1", None, 1, "auto"):
        with pytest.raises(ValueError, match="replay_kd"):
            chunk_replay_step_pallas(*args, xc, vc, jnp.asarray(lengths), interpret=True, config={"replay_kd": bad})


def _pack(x, groups):
    """The open chunk's q, k, v [B, 64, H, D] as the model packs them: `groups` groups of [q_g | k_g | v_g]."""
    B, HK, HV = x["q"].shape[0], x["q"].shape[2], x["v"].shape[2]
    parts = []
    for gi in range(groups):
        for name, H in (("q", HK), ("k", HK), ("v", HV)):
            per = H // groups
            parts.append(np.asarray(x[name])[:, :, gi * per:(gi + 1) * per].reshape(B, C, -1))
    return jnp.asarray(np.concatenate(parts, axis=-1)), jnp.asarray(np.stack([x["g"], x["beta"]], axis=2))


@pytest.mark.parametrize("HK,HV,groups,backend", [(2, 4, 1, "interpret"), (2, 4, 2, "interpret"),
                                                  (1, 3, 1, "interpret"), (2, 4, 2, "reference")])
def test_packed_step_equals_the_step_on_separate_arrays(HK, HV, groups, backend):
    """`chunk_replay_step_packed` (the model's packed q|k|v and gates buffers, read in place by the kernels'
    block specs) gives the bits of `chunk_replay_step` on the arrays sliced out, Hugging Face's layout (1 group)
    and the grouped one, and comes back with the buffers of the rows whose chunk completed zeroed, the others
    untouched (a Pallas kernel; XLA's select where the gates' row is not a power-of-two block, HV = 3); the
    reference backend likewise."""
    from pallas_kernels import chunk_replay_step, chunk_replay_step_packed

    rng = np.random.default_rng(HV + groups)
    B = 4
    x, s0 = _inputs(rng, B, C, HK, HV, jnp.bfloat16)
    lengths = np.asarray([64, 20, 64, 1])
    for name in ("q", "k", "v"):  # the model's buffers hold zeros after the valid rows
        for b in range(B):
            x[name][b, lengths[b]:] = 0
    qkv, gates = _pack(x, groups)
    args = [jnp.asarray(x[n]) for n in ("q", "k", "v", "g", "beta")] + [jnp.asarray(s0)]
    xc, vc = chunk_replay_prime_pallas(*args, jnp.asarray(lengths - 1), interpret=True)
    want = chunk_replay_step(*args, xc, vc, jnp.asarray(lengths), backend=backend)
    got = chunk_replay_step_packed(qkv, gates, jnp.asarray(s0), xc, vc, jnp.asarray(lengths),
                                   heads=(HK, K, HV, V), groups=groups, backend=backend)
    for a, b in zip(got[:4], want):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    done = lengths == C
    assert not np.asarray(got[4])[done].any() and not np.asarray(got[5])[done].any()
    assert np.array_equal(np.asarray(got[4])[~done], np.asarray(qkv)[~done])
    assert np.array_equal(np.asarray(got[5])[~done], np.asarray(gates)[~done])


def test_packed_step_refuses_bad_buffers():
    from pallas_kernels import chunk_replay_step_packed
    from pallas_kernels.gated_delta.open_chunk import Heads, packable

    rng = np.random.default_rng(12)
    x, s0 = _inputs(rng, 2, C, 2, 4)
    qkv, gates = _pack(x, 2)
    xc, vc = replay_caches(2, 4, V)
    kw = dict(heads=(2, K, 4, V), groups=2, backend="interpret")
    with pytest.raises(ValueError, match="qkv must be"):
        chunk_replay_step_packed(qkv[:, :, :-1], gates, jnp.asarray(s0), xc, vc, jnp.asarray([3, 4]), **kw)
    with pytest.raises(ValueError, match="gates must be"):
        chunk_replay_step_packed(qkv, gates[:, :, :1], jnp.asarray(s0), xc, vc, jnp.asarray([3, 4]), **kw)
    assert packable(Heads(2, 32, 4, 32), 2) and not packable(Heads(2, 32, 4, 32), 3)
    assert not packable(Heads(1, 16, 1, 48), 1)  # v's columns start at 32: not a multiple of 48
