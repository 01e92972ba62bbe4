"""Batch-invariant causal attention over a KV cache, for deterministic mode: a Pallas-Triton kernel.

Dimension legend: B batch rows, T query positions, H query heads, HKV key/value heads (H = HKV * R), N cache slots,
Dh head dim, ROWS query rows per program (query positions x the R heads sharing a key/value head).

Grid (Tp * R / ROWS, HKV, B), Tp = T rounded up to a multiple of ROWS / R: one program per tile of ROWS query
rows of one key/value head of one batch row. It reads that row's keys and values in fixed BK-slot blocks, in order,
up to the tile's last position, with an online softmax in fp32 (scores q.k * Dh^-0.5; probabilities rounded to the
value dtype before the p.V dot, fp32 accumulation).
A query's result depends only on its own batch row: the program code is the same whatever B and T are, each query
row's dots are independent of the other rows in its tile, and key blocks past a query's position (which a tile
shared with later queries reads) are masked to exact zeros that leave the softmax state unchanged (m stays,
exp(0) = 1 rescales exactly, p = 0 adds nothing). Padded query rows (T up to a multiple of the tile) get position 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .config import merged_config, static_config
from .invariant import softmax

# Measured on the H200 (BENCHMARKS.md), decode B=64 over 1088 slots: 3 stages 90.5 us (2 stages 123 us; XLA's
# non-invariant attention 284 us).
DEFAULT_CONFIG = dict(bk=64, num_warps=8, num_stages=3)


def attention_reference(q, keys, values, pos):
    """Pure JAX. q: [B, T, H, Dh] (rotated); keys/values: [B, N, HKV, Dh]; pos: [B, T] absolute query positions.

    Causal attention over the cache (a query at pos sees slots 0..pos), softmax in fp32 with an order-fixed sum,
    probabilities rounded to q.dtype before the p.V product. Returns [B, T, H, Dh].
    """
    B, T, H, Dh = q.shape
    N, HKV = keys.shape[1], keys.shape[2]
    qh = q.reshape(B, T, HKV, H // HKV, Dh)
    scores = jnp.einsum("btgrd,bngd->bgrtn", qh, keys.astype(q.dtype),
                        preferred_element_type=jnp.float32) * (Dh**-0.5)  # [B, HKV, R, T, N]
    mask = jnp.arange(N)[None, None, :] <= pos[:, :, None]  # [B, T, N]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = softmax(scores).astype(q.dtype)
    return jnp.einsum("bgrtn,bngd->btgrd", probs, values.astype(q.dtype)).reshape(B, T, H, Dh)


def attention_tiled_reference(q, keys, values, pos, tile: int):
    """Batch-invariant `attention_reference` (pure JAX): queries in fixed tiles of `tile` positions per row, each tile
    through one compiled program (`lax.map`) of one shape, so a query's result depends on neither the batch nor the
    call length."""
    B, T, H, Dh = q.shape
    n_t = -(-T // tile)
    pad = n_t * tile - T
    qt = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(B * n_t, tile, H, Dh)
    pt = jnp.pad(pos, ((0, 0), (0, pad))).reshape(B * n_t, tile)
    rows = jnp.repeat(jnp.arange(B), n_t)

    def one(args):
        qi, pi, b = args
        return attention_reference(qi[None], keys[b][None], values[b][None], pi[None])[0]

    out = jax.lax.map(one, (qt, pt, rows))  # [B*n_t, tile, H, Dh]
    return out.reshape(B, n_t * tile, H, Dh)[:, :T]


def _attention_kernel(pos_ref, q_ref, k_ref, v_ref, o_ref, *, bk, nblocks, scale):
    q = q_ref[...]  # [ROWS, Dh]
    prow = pos_ref[...]  # [ROWS] absolute position of each query row
    rows, dh = q.shape
    hi = jnp.minimum(jnp.max(prow) // bk + 1, nblocks)  # blocks that hold a key some row of the tile can see

    def body(j, carry):
        m, l, acc = carry
        ks = pl.ds(pl.multiple_of(j * bk, bk), bk)
        s = lax.dot_general(q, k_ref[ks, :], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        col = j * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
        s = jnp.where(col <= prow[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        pv = jnp.dot(p.astype(v_ref.dtype), v_ref[ks, :], preferred_element_type=jnp.float32)
        return m_new, l, acc * alpha[:, None] + pv

    init = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, dh), jnp.float32))
    _, l, acc = lax.fori_loop(0, hi, body, init)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("rows", "interpret", "config"))
def _attention_impl(q, keys, values, pos, *, rows, interpret, config):
    cfg = merged_config("attention_invariant", DEFAULT_CONFIG, config, pow2=("bk",))
    B, T, H, Dh = q.shape
    N, HKV = keys.shape[1], keys.shape[2]
    R = H // HKV
    tq = rows // R
    bk = cfg["bk"]
    tp = -(-T // tq) * tq
    npad = -(-N // bk) * bk
    if tp != T:
        q = jnp.pad(q, ((0, 0), (0, tp - T), (0, 0), (0, 0)))
        pos = jnp.pad(pos, ((0, 0), (0, tp - T)))
    if npad != N:
        keys, values = (jnp.pad(x, ((0, 0), (0, npad - N), (0, 0), (0, 0))) for x in (keys, values))
    # rows of one key/value head: (position, r) flattened -> [B, HKV, tp * R, Dh]
    qr = q.reshape(B, tp, HKV, R, Dh).transpose(0, 2, 1, 3, 4).reshape(B, HKV, tp * R, Dh)
    prow = jnp.repeat(pos.astype(jnp.int32), R, axis=1)  # [B, tp * R]
    from jax.experimental.pallas import triton as pltriton

    out = pl.pallas_call(
        functools.partial(_attention_kernel, bk=bk, nblocks=npad // bk, scale=float(Dh) ** -0.5),
        grid=(tp * R // rows, HKV, B),
        in_specs=[
            pl.BlockSpec((None, rows), lambda i, g, b: (b, i)),
            pl.BlockSpec((None, None, rows, Dh), lambda i, g, b: (b, g, i, 0)),
            pl.BlockSpec((None, npad, None, Dh), lambda i, g, b: (b, 0, g, 0)),
            pl.BlockSpec((None, npad, None, Dh), lambda i, g, b: (b, 0, g, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, rows, Dh), lambda i, g, b: (b, g, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, HKV, tp * R, Dh), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]),
        interpret=interpret,
        name="invariant_attention",
    )(prow, qr, keys.astype(q.dtype), values.astype(q.dtype))
    out = out.reshape(B, HKV, tp, R, Dh).transpose(0, 2, 1, 3, 4).reshape(B, tp, H, Dh)
    return out[:, :T] if tp != T else out


def supports(num_heads: int, num_kv_heads: int, head_dim: int, rows: int) -> bool:
    """Whether the kernel handles this head layout with `rows` query rows per program (powers of two)."""
    r = num_heads // num_kv_heads
    pow2 = lambda n: n >= 1 and not n & (n - 1)
    return num_heads % num_kv_heads == 0 and pow2(r) and r <= rows and pow2(rows) and rows >= 16 and pow2(head_dim) \
        and head_dim >= 16


def attention_invariant_pallas(q, keys, values, pos, *, rows: int = 64, interpret: bool = False, config=None):
    """Causal attention of q [B, T, H, Dh] over the cache keys/values [B, N, HKV, Dh]: the query at absolute position
    pos[b, t] ([B, T] int32) sees cache slots 0..pos. Returns [B, T, H, Dh] in q.dtype. `rows` query rows per program
    (query positions x H / HKV): 64 for prefill, 16 for one-token decode. See the module docstring."""
    B, T, H, Dh = q.shape
    if q.size == 0:
        return jnp.zeros(q.shape, q.dtype)
    if keys.ndim != 4 or keys.shape != values.shape or keys.shape[0] != B or keys.shape[3] != Dh:
        raise ValueError(f"expected keys/values [B, N, HKV, Dh] matching q {q.shape}; got {keys.shape}, {values.shape}")
    if pos.shape != (B, T):
        raise ValueError(f"pos must be [B, T]={(B, T)}; got {pos.shape}")
    if not supports(H, keys.shape[2], Dh, rows):
        raise ValueError(f"unsupported layout: H={H}, HKV={keys.shape[2]}, Dh={Dh}, rows={rows} (powers of two, "
                         "H / HKV <= rows, rows >= 16, Dh >= 16)")
    config = static_config(config)
    return _attention_impl(q, keys, values, pos, rows=rows, interpret=bool(interpret), config=config)
