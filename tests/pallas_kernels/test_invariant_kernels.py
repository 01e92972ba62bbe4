"""Deterministic-mode kernels (interpret mode on CPU): the fixed-tile matmul and the causal attention over a KV cache.

Accuracy against float64 NumPy (tolerances stated per test); batch invariance bitwise: a row's result alone equals
the same row inside larger calls of other sizes and contents.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.attention import attention_invariant_pallas
from pallas_kernels.matmul import matmul_invariant_pallas


def _np(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("K,N,dtype", [(96, 80, jnp.bfloat16), (64, 256, jnp.float32), (200, 48, jnp.bfloat16)])
def test_matmul_matches_float64_and_is_row_invariant(K, N, dtype):
    rng = np.random.default_rng(K + N)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), dtype)
    x = jnp.asarray(rng.standard_normal((150, K)), dtype)
    y = matmul_invariant_pallas(x, w, interpret=True)
    assert y.shape == (150, N) and y.dtype == dtype
    ref = _np(x) @ _np(w)
    # bf16 output rounding: 2^-8 relative; fp32 (exact fp32 dots in interpret mode): 1e-5
    tol = 8e-3 if dtype == jnp.bfloat16 else 1e-5
    assert np.abs(_np(y) - ref).max() <= tol * np.abs(ref).max()
    for m, rows in [(1, [7]), (3, [0, 1, 149]), (65, list(range(40, 105)))]:
        part = matmul_invariant_pallas(x[np.array(rows)], w, interpret=True)
        assert part.shape == (m, N)
        assert np.array_equal(np.asarray(part), np.asarray(y)[rows]), m
    # leading dims are flattened: [B, T, K]
    y3 = matmul_invariant_pallas(x[:120].reshape(4, 30, K), w, interpret=True)
    assert np.array_equal(np.asarray(y3).reshape(120, N), np.asarray(y)[:120])


def test_matmul_rejects_bad_input():
    with pytest.raises(ValueError, match="share a dtype"):
        matmul_invariant_pallas(jnp.ones((2, 8), jnp.float32), jnp.ones((8, 4), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match=r"\[K, N\]"):
        matmul_invariant_pallas(jnp.ones((2, 8)), jnp.ones((9, 4)), interpret=True)


def attention_f64(q, keys, values, pos):
    """float64 causal attention over the cache: [B, T, H, Dh]."""
    q, keys, values = _np(q), _np(keys), _np(values)
    B, T, H, Dh = q.shape
    R = H // keys.shape[2]
    out = np.zeros(q.shape)
    for b in range(B):
        for t in range(T):
            n = int(pos[b, t]) + 1
            for h in range(H):
                s = keys[b, :n, h // R] @ q[b, t, h] * Dh**-0.5
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ values[b, :n, h // R]
    return out


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(5)
    B, T, H, HKV, Dh, N = 3, 45, 4, 2, 32, 130
    q = rng.standard_normal((B, T, H, Dh))
    k = rng.standard_normal((B, N, HKV, Dh))
    v = rng.standard_normal((B, N, HKV, Dh))
    pos = np.stack([np.arange(T) + s for s in (0, 70, 85)]).astype(np.int32)  # last row reaches slot 129
    return q, k, v, pos


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [16, 64])
def test_attention_matches_float64(cache, dtype, tol, rows):
    """Tolerance (max abs error; outputs are O(1)): fp32 1e-5; bf16 2e-2 (bf16 inputs, probabilities and output)."""
    q, k, v = (jnp.asarray(x, dtype) for x in cache[:3])
    pos = jnp.asarray(cache[3])
    o = attention_invariant_pallas(q, k, v, pos, rows=rows, interpret=True)
    assert o.shape == q.shape and o.dtype == dtype
    assert np.abs(_np(o) - attention_f64(q, k, v, cache[3])).max() <= tol


@pytest.mark.parametrize("rows", [16, 64])
def test_attention_is_batch_and_split_invariant(cache, rows):
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in cache[:3])
    pos = jnp.asarray(cache[3])
    o = np.asarray(attention_invariant_pallas(q, k, v, pos, rows=rows, interpret=True))
    # one query alone (decode-shaped), and a slice of one row, equal the same queries inside the full call
    for b, t in [(0, 0), (1, 44), (2, 17)]:
        one = attention_invariant_pallas(q[b:b + 1, t:t + 1], k[b:b + 1], v[b:b + 1], pos[b:b + 1, t:t + 1],
                                         rows=rows, interpret=True)
        assert np.array_equal(np.asarray(one)[0, 0], o[b, t]), (b, t)
    part = attention_invariant_pallas(q[1:, 10:33], k[1:], v[1:], pos[1:, 10:33], rows=rows, interpret=True)
    assert np.array_equal(np.asarray(part), o[1:, 10:33])


@pytest.mark.parametrize("decode", [False, True])
def test_api_attention_entry_points_take_the_kernel_or_their_fallback(cache, decode):
    """`cache_attention` (default mode) and `attention_invariant` (deterministic mode), "interpret" backend: on a
    supported head layout the kernel's bits; on an unsupported one (3 query heads per KV head) each mode's own
    fallback — XLA's attention for the default mode, the fixed-tile reference for deterministic mode — bit for bit
    (at decode the two fallbacks compute the same bits: tiles of one query). And a layout the prefill kernel takes
    but the decode kernel does not (32 query heads per KV head: more than its 16 rows) goes to the kernel at prefill,
    to the fallback at decode."""
    from pallas_kernels import api
    from pallas_kernels.attention import attention_reference, attention_tiled_reference

    q, k, v = (jnp.asarray(x, jnp.float32) for x in cache[:3])
    pos = jnp.asarray(cache[3])
    if decode:
        q, pos = q[:, -1:], pos[:, -1:]
    rows = 16 if decode else 64
    kernel = np.asarray(attention_invariant_pallas(q, k, v, pos, rows=rows, interpret=True))
    for fn in (api.cache_attention, api.attention_invariant):
        assert np.array_equal(np.asarray(fn(q, k, v, pos, decode=decode, backend="interpret")), kernel)
    q3 = jnp.concatenate([q, q[:, :, :2]], axis=2)  # 6 query heads over 2 KV heads
    assert np.array_equal(np.asarray(api.cache_attention(q3, k, v, pos, decode=decode, backend="interpret")),
                          np.asarray(attention_reference(q3, k, v, pos)))
    assert np.array_equal(np.asarray(api.attention_invariant(q3, k, v, pos, decode=decode, backend="interpret")),
                          np.asarray(attention_tiled_reference(q3, k, v, pos, tile=1 if decode else 64)))
    q32, k1, v1 = jnp.repeat(q[:1, -2:, :1], 32, axis=2), k[:1, :, :1], v[:1, :, :1]  # 32 query heads, 1 KV head
    got = np.asarray(api.cache_attention(q32, k1, v1, pos[:1, -2:], decode=decode, backend="interpret"))
    want = (attention_reference(q32, k1, v1, pos[:1, -2:]) if decode else
            attention_invariant_pallas(q32, k1, v1, pos[:1, -2:], rows=64, interpret=True))
    assert np.array_equal(got, np.asarray(want))


def test_attention_rejects_unsupported_layouts():
    q = jnp.ones((1, 2, 6, 32))
    kv = jnp.ones((1, 8, 2, 32))
    with pytest.raises(ValueError, match="unsupported layout"):  # 3 query heads per key head
        attention_invariant_pallas(q, kv, kv, jnp.zeros((1, 2), jnp.int32), interpret=True)


def test_matmul_split_k_for_skinny_weights():
    """A weight with few column tiles splits K into fixed slices (fp32 partials, fixed-order sum): still within
    bf16 rounding of float64 and bitwise row-invariant; the split depends on the weight only."""
    from pallas_kernels.matmul import DEFAULT_CONFIG, _tiling

    assert _tiling(4096, 32, DEFAULT_CONFIG)[3] == 16 and _tiling(4096, 12288, DEFAULT_CONFIG)[3] == 1
    assert _tiling(512, 16, DEFAULT_CONFIG)[3] == 2  # 8 BK steps: two slices of 4
    rng = np.random.default_rng(9)
    w = jnp.asarray(rng.standard_normal((512, 16)) / np.sqrt(512), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((140, 512)), jnp.bfloat16)
    y = matmul_invariant_pallas(x, w, interpret=True)
    ref = _np(x) @ _np(w)
    assert np.abs(_np(y) - ref).max() <= 8e-3 * np.abs(ref).max()
    for rows in ([3], [0, 139], list(range(5, 70))):
        assert np.array_equal(np.asarray(matmul_invariant_pallas(x[np.array(rows)], w, interpret=True)),
                              np.asarray(y)[rows])


def test_matmul_transposed_weight_empty_input_and_many_slices():
    """w given as [N, K] (a tied embedding as the output head) equals w.T given as [K, N], bitwise; empty inputs
    give empty outputs; a 16-slice split K (K = 4096, N = 32) stays within bf16 rounding of float64."""
    rng = np.random.default_rng(13)
    w = jnp.asarray(rng.standard_normal((96, 200)) / 10, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((70, 200)), jnp.bfloat16)
    a = matmul_invariant_pallas(x, w, interpret=True, w_transposed=True)
    b = matmul_invariant_pallas(x, jnp.asarray(np.asarray(w).T), interpret=True)
    assert a.shape == (70, 96) and np.array_equal(np.asarray(a), np.asarray(b))
    assert matmul_invariant_pallas(x[:0], w, interpret=True, w_transposed=True).shape == (0, 96)
    from pallas_kernels.matmul import DEFAULT_CONFIG, _tiling

    assert _tiling(4096, 32, DEFAULT_CONFIG)[3] == 16
    w2 = jnp.asarray(rng.standard_normal((4096, 32)) / 64, jnp.bfloat16)
    x2 = jnp.asarray(rng.standard_normal((3, 4096)), jnp.bfloat16)
    y2 = matmul_invariant_pallas(x2, w2, interpret=True, out_dtype=jnp.float32)
    ref = _np(x2) @ _np(w2)
    assert y2.dtype == jnp.float32 and np.abs(np.asarray(y2) - ref).max() <= 1e-4 * np.abs(ref).max()


def test_kernel_configs_are_checked():
    """A block that would leave part of an output unwritten, or a tile Triton cannot load, is refused up front."""
    from pallas_kernels.conv1d import causal_conv1d_update_pallas
    from pallas_kernels.gated_delta.recurrent import recurrent_gated_delta_rule_pallas

    x = jnp.ones((4, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="bn=24 must be a power of two"):
        matmul_invariant_pallas(x, jnp.ones((64, 64), jnp.bfloat16), interpret=True, config={"bn": 24})
    for bad in ({"stages_wide": 0}, {"wide_m": -1}, {"inner_acc": 0}, {"bn_wide": 96}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            matmul_invariant_pallas(x, jnp.ones((64, 64), jnp.bfloat16), interpret=True, config=bad)
    with pytest.raises(ValueError, match="unknown config keys"):
        attention_invariant_pallas(jnp.ones((1, 2, 4, 32)), jnp.ones((1, 8, 2, 32)), jnp.ones((1, 8, 2, 32)),
                                   jnp.zeros((1, 2), jnp.int32), interpret=True, config={"block": 64})
    with pytest.raises(ValueError, match="48"):
        causal_conv1d_update_pallas(x, jnp.ones((4, 3, 64), jnp.bfloat16), jnp.ones((4, 64)), interpret=True,
                                    config={"bc": 48})
    with pytest.raises(ValueError, match="bv=96"):
        recurrent_gated_delta_rule_pallas(
            jnp.ones((1, 1, 32)), jnp.ones((1, 1, 32)), jnp.ones((1, 2, 128)), jnp.zeros((1, 2)), jnp.zeros((1, 2)),
            initial_state=jnp.zeros((1, 2, 32, 128)), interpret=True, config={"bv": 96})


@pytest.mark.parametrize("K,N,conf", [
    (256, 1024, dict(target_programs=16, split_k_below=4)),  # unsplit: BN 128 for few rows, 256 for many
    (1024, 512, dict(target_programs=16)),                    # split in 2: on the grid for few rows, in-kernel for many
    (1024, 64, {}),                                           # split in 4
    (500, 72, dict(max_split=2)),                             # N and K padded to the tiles
])
def test_matmul_many_row_tiling_gives_the_same_bits(K, N, conf):
    """From `wide_m` rows on, the product takes another tiling (`_plan`: a split weight's slices reduced in-kernel
    in the same order, wide column tiles); a row's bits must not change: rows alone (few-row tiling) == the same
    rows inside a 200-row call (many-row tiling), and the plans differ (so the test compares two tilings)."""
    from pallas_kernels.matmul import DEFAULT_CONFIG, _plan

    conf = dict(conf, wide_m=128)
    cfg = dict(DEFAULT_CONFIG, **conf)
    assert _plan(200, K, N, cfg)[:5] != _plan(65, K, N, cfg)[:5]  # the tiles or the split's place differ
    assert _plan(200, K, N, dict(cfg, wide_m=0)) == _plan(65, K, N, cfg)
    rng = np.random.default_rng(K + N)
    w = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((200, K)), jnp.bfloat16)
    y = np.asarray(matmul_invariant_pallas(x, w, interpret=True, config=conf))
    ref = _np(x) @ _np(w)
    assert np.abs(y.astype(np.float64) - ref).max() <= 8e-3 * np.abs(ref).max()  # bf16 output rounding
    for rows in ([3], [0, 199], list(range(5, 70))):
        part = matmul_invariant_pallas(x[np.array(rows)], w, interpret=True, config=conf)
        assert np.array_equal(np.asarray(part), y[rows]), rows
