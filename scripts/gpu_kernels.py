"""GPU check + benchmark of the jaxgdn Pallas kernels (H200): correctness against the float64 oracle, bitwise
properties without interpret mode, then timing beside fla-core 0.6.0 and the pure-JAX reference, in one process.

Run on the GPU machine from the repo root (fla-core installed into /tmp/site from a carried wheel):
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.:/tmp/site python3 scripts/gpu_kernels.py [--quick] [--out DIR]
      [--skip accuracy,equality,bitwise,decode_checks,ceilings,sweep,prefill,reference,decode,breakdown,conv1d,
              invariant,replay_step,replay_step_checks,replay_step_timing,replay,scan] [--only SECTIONS]
      [--configs NAMES] [--replay-batches 64,256] [--replay-schedules default,concurrent]
      [--prefill-shapes B,T,HK,HV;...]
      [--chunk-checks twice,split,alone,checkpoints,prefix,small_grid]
(replay_step: the replay step's kernels over the chunked prefill, bitwise against one prefill, and its step time against
 the decode kernel (replay_step_checks: the checks alone; replay_step_timing: the timing alone, at --replay-batches,
 under XLA's default schedule and the model's concurrent one, --replay-schedules);
 replay: the earlier replay, the chunked kernels over the whole open chunk each step, at the kernel level; scan:
 the token-by-token prefill kernel, bitwise against the decode kernel, and its prefill and one-token times.)
(fla wheel: `pip download --no-deps fla-core==0.6.0 -d .whl` here; on the GPU machine
 `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl`; FlashQLA and its needs: unpack
 the carried `.whl/flashqla_site.tar.xz` into /tmp/site, BENCHMARKS.md says how it is made.)
Prints tables and writes results.json into --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# fla-core 0.6.0 hands chunk_gated_delta_rule to FlashQLA whenever flash_qla is importable (its backend registry);
# the "fla" column is fla's own Triton kernels, so that dispatch is off unless asked for (FLA_FLASH_QLA=1).
os.environ.setdefault("FLA_FLASH_QLA", "0")

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta import chunk as chunk_mod
from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.recurrent import recurrent_gated_delta_rule_pallas
from pallas_kernels.gated_delta.reference import (chunk_gated_delta_rule_reference, gated_delta_step_reference,
                                                  gdn_gates)
from tests.gdn_oracle import gated_delta_rule_oracle, random_gdn_inputs, rel_err

RESULTS: dict = {"checks": {}, "prefill": [], "decode": [], "configs": [], "ceilings": {}, "errors": []}
FAILS: list = []


def log(*a):
    print(*a, flush=True)


def check(name, ok, detail=""):
    RESULTS["checks"][name] = {"ok": bool(ok), "detail": str(detail)}
    log(f"[{'PASS' if ok else 'FAIL'}] {name} {detail}")
    if not ok:
        FAILS.append(name)


def section(fn):
    @functools.wraps(fn)
    def wrapped(*a, **kw):
        log(f"\n=== {fn.__name__} ===")
        t0 = time.time()
        try:
            return fn(*a, **kw)
        except Exception as e:  # keep going: one broken section must not hide the others
            traceback.print_exc()
            RESULTS["errors"].append(f"{fn.__name__}: {type(e).__name__}: {e}"[:2000])
            FAILS.append(fn.__name__)
        finally:
            log(f"--- {fn.__name__}: {time.time() - t0:.1f} s")
    return wrapped


def bench_jax(f, *args, n=20, reps=7):
    """Median seconds per call of back-to-back (pipelined) calls; compile excluded."""
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def bench_state_loop(loop, args, state, steps_per_call, inner=5, reps=7):
    """Median seconds per step of `loop(*args, state) -> state` (a compiled loop of `steps_per_call` steps whose
    state is donated), called `inner` times back to back per repetition. Returns (seconds, final state)."""
    state = jax.block_until_ready(loop(*args, state))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            state = loop(*args, state)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / (inner * steps_per_call))
    return statistics.median(times), state


def bench_state_calls(step, args, state, n=50):
    """Seconds per call of `step(*args, state) -> (out, state)`, back to back (pipelined; the state donated).
    Returns (seconds, last out, final state)."""
    out, state = step(*args, state)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(n):
        out, state = step(*args, state)
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / n, out, state


def bf16(x):
    return jnp.asarray(x, jnp.bfloat16)


# ----------------------------------------------------------------------------------------------- correctness
def dev_inputs(d, dtype=jnp.bfloat16):
    return dict(q=jnp.asarray(d["q"], dtype), k=jnp.asarray(d["k"], dtype), v=jnp.asarray(d["v"], dtype),
                g=jnp.asarray(d["g"]), beta=jnp.asarray(d["beta"]),
                s0=None if d["initial_state"] is None else jnp.asarray(d["initial_state"]))


def call_chunk(x, sl=slice(None), s0="x", lengths=None, stride=None, config=None):
    s0 = x["s0"] if isinstance(s0, str) else s0
    out = chunk_gated_delta_rule_pallas(x["q"][:, sl], x["k"][:, sl], x["v"][:, sl], x["g"][:, sl],
                                        x["beta"][:, sl], initial_state=s0,
                                        lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32),
                                        checkpoint_stride=stride, config=config)
    return tuple(np.asarray(jax.block_until_ready(o)) for o in out)


def oracle_of(x, lengths=None):
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    return gated_delta_rule_oracle(f64(x["q"]), f64(x["k"]), f64(x["v"]), f64(x["g"]), f64(x["beta"]),
                                   initial_state=None if x["s0"] is None else f64(x["s0"]), lengths=lengths)


@section
def chunk_accuracy(configs):
    """bf16 inputs, K = V = 128, against the float64 oracle fed the same (bf16-rounded) inputs. Bar: 2e-3."""
    rng = np.random.default_rng(0)
    cases = [
        ("T130_len_HV2HK", dict(B=2, T=130, HK=2, HV=4), dict(), [130, 77]),
        ("T1_g0_beta1", dict(B=2, T=1, HK=1, HV=2), dict(g_kind="near_zero", beta_kind="one"), None),
        ("T63_g0_beta0", dict(B=1, T=63, HK=1, HV=4), dict(g_kind="near_zero", beta_kind="zero"), None),
        ("T65_verynegative_mixed", dict(B=1, T=65, HK=1, HV=4), dict(g_kind="very_negative", beta_kind="mixed"),
         None),
        ("T256_realistic_beta1", dict(B=1, T=256, HK=2, HV=4), dict(beta_kind="one"), None),
        ("T128_repeated_keys_beta1_g0", dict(B=1, T=128, HK=1, HV=2), dict(g_kind="near_zero", beta_kind="one"),
         None),
        # random keys with g ~ 0 and beta = 1 (added 2026-12-02 after run 109 measured the default at 2.03e-3 on the
        # output of such a case, just over the bar, of which the bf16 rounding of the exact output alone is 1.67e-3;
        # this draw: 2.000e-3, run 110 — at the bar)
        ("T128_random_keys_beta1_g0", dict(B=1, T=128, HK=1, HV=2), dict(g_kind="near_zero", beta_kind="one"),
         None),
    ]
    acc = {}
    for ci, (name, shp, kinds, lengths) in enumerate(cases):
        d = random_gdn_inputs(rng, shp["B"], shp["T"], shp["HK"], shp["HV"], 128, 128, np.float32, **kinds)
        if name.startswith("T1_"):
            d["g"][:] = 0.0  # g exactly 0
        if "repeated" in name:  # adversarial for the inverse: identical keys in every chunk
            d["k"][:] = d["k"][:, :1]
        x = dev_inputs(d)
        ro, rs = oracle_of(x, lengths)
        lens = lengths or [shp["T"]] * shp["B"]
        for cname, cfg in configs.items():
            if cname != "default" and ci not in (0, 4, 5, 6):
                continue  # other configs: four cases only (compile time)
            try:
                o, s = call_chunk(x, lengths=lengths, config=cfg)
            except Exception as e:
                log(f"config {cname} failed on {name}: {type(e).__name__}: {str(e)[:400]}")
                acc.setdefault(cname, {})[name] = None
                continue
            finite = bool(np.isfinite(o.astype(np.float32)).all() and np.isfinite(s).all())
            eo = max(rel_err(o[b, :n], ro[b, :n]) for b, n in enumerate(lens) if n)
            es = rel_err(s, rs)
            acc.setdefault(cname, {})[name] = (eo, es, finite)
            if cname == "default":
                check(f"chunk accuracy {name}", finite and eo <= 2e-3 and es <= 2e-3,
                      f"out rel {eo:.2e} state rel {es:.2e} finite={finite}")
            else:
                log(f"  config {cname:>12s} {name}: out {eo:.2e} state {es:.2e} finite={finite}")
    RESULTS["chunk_accuracy"] = {c: {k: v for k, v in a.items()} for c, a in acc.items()}
    return acc


CHUNK_CHECKS = ("twice", "split", "alone", "checkpoints", "prefix", "small_grid")  # chunk_bitwise's, in order


@section
def chunk_bitwise(config=None, tag="default", checks=CHUNK_CHECKS):
    """The chunked prefill's bitwise properties on the GPU (`checks`, a subset of CHUNK_CHECKS; --chunk-checks):
    twice: the same call twice; split: a call split on the 64 grid == unsplit; alone: a row alone == the row in a
    batch (lengths 512 / 300 / 37); checkpoints: in-call checkpoints == separate calls' final states; prefix: the first
    j < 64 rows of a chunk == the full chunk's rows; small_grid: rows alone (B = 1 at HV = 32: a small grid's
    launch) == the same rows in a batch of 4 (a large grid's: the fused kernel). Each distinct call shape compiles
    anew, which is most of the section's time (~7 s per shape on an H100)."""
    rng = np.random.default_rng(1)
    d = random_gdn_inputs(rng, 3, 512, 2, 4, 128, 128, np.float32, beta_kind="mixed")
    x = dev_inputs(d)
    o, s = call_chunk(x, config=config) if {"twice", "split"} & set(checks) else (None, None)
    if "twice" in checks:
        o2, s2 = call_chunk(x, config=config)
        check(f"[{tag}] chunk same call twice", np.array_equal(o, o2) and np.array_equal(s, s2))
    if "split" in checks:
        ok = True
        for cut in (64, 192, 448):
            o1, s1 = call_chunk(x, sl=slice(0, cut), config=config)
            o3, s3 = call_chunk(x, sl=slice(cut, None), s0=jnp.asarray(s1), config=config)
            ok &= np.array_equal(o1, o[:, :cut]) and np.array_equal(o3, o[:, cut:]) and np.array_equal(s3, s)
        check(f"[{tag}] chunk split on the 64 grid == unsplit", ok)
    lengths = [512, 300, 37]
    if {"alone", "checkpoints"} & set(checks):
        ol, sl_, ck = call_chunk(x, lengths=lengths, stride=128, config=config)
    if "alone" in checks:
        ok = True
        for b, n in enumerate(lengths):
            xb = {k_: (None if v_ is None else v_[b: b + 1]) for k_, v_ in x.items()}
            oa, sa = call_chunk(xb, sl=slice(0, n), config=config)
            ok &= np.array_equal(oa[0], ol[b, :n]) and np.array_equal(sa[0], sl_[b])
        check(f"[{tag}] chunk row alone == row in batch (lengths 512/300/37)", ok)
    if "checkpoints" in checks:
        ok = True
        for i in range(ck.shape[1]):
            end = 128 * (i + 1)
            _, se = call_chunk(x, sl=slice(0, end), lengths=[min(n, end) for n in lengths], config=config)
            ok &= np.array_equal(ck[:, i], se)
        check(f"[{tag}] chunk checkpoints (stride 128) == separate calls' final states",
              ok and ck.dtype == np.float32)
    if "prefix" in checks:
        ok = True
        for start in (0, 256):
            s_start = x["s0"] if start == 0 else jnp.asarray(call_chunk(x, sl=slice(0, start), config=config)[1])
            of, _ = call_chunk(x, sl=slice(start, start + 64), s0=s_start, config=config)
            for j in (1, 2, 7, 33, 63):
                oj, _ = call_chunk(x, sl=slice(start, start + j), s0=s_start, config=config)
                ok &= np.array_equal(oj, of[:, :j])
        check(f"[{tag}] chunk j<64 rows == full-chunk rows (j=1,2,7,33,63; at 0 and 256)", ok)
    if "small_grid" in checks and not {"bv", "stages_state"} & set(config or {}):
        # the recurrence's launch and the output's kernel follow the grid (chunk._recurrence_blocks,
        # fused_min_programs): rows alone (B=1, HV=32: 64 programs) == the same rows in a batch of 4 (256), the
        # Qwen3.5 head shape. Each row alone is a B=1 call of the batch's T with its length: one shape, one compile
        # (rows sliced to their lengths, a shape each, ran this check past its stage's time limit in runs 174, 175
        # and 178; calls of other lengths are the `split` and `alone` checks' business).
        x = dev_inputs(random_gdn_inputs(rng, 4, 256, 16, 32, 128, 128, np.float32, beta_kind="mixed"))
        lengths = [256, 200, 64, 1]
        ob, sb = call_chunk(x, lengths=lengths, config=config)
        ok = True
        for b, n in enumerate(lengths):
            xb = {k_: (None if v_ is None else v_[b: b + 1]) for k_, v_ in x.items()}
            oa, sa = call_chunk(xb, lengths=[n], config=config)
            ok &= np.array_equal(oa[0, :n], ob[b, :n]) and np.array_equal(sa[0], sb[b])
        check(f"[{tag}] chunk row alone (small-grid launch, its length on T=256) == row in a batch of 4 (HV=32)", ok)


@section
def config_equality(configs):
    """Which configurations compute the default's bits (outputs and final state, lengths 512/300/37, a non-zero
    initial state): a configuration chosen by shape (e.g. a V block for small grids) must, or a row alone and the
    same row in a batch could differ."""
    rng = np.random.default_rng(3)
    x = dev_inputs(random_gdn_inputs(rng, 3, 512, 2, 4, 128, 128, np.float32, beta_kind="mixed"))
    ref = call_chunk(x, lengths=[512, 300, 37])
    out = {}
    for name, cfg in configs.items():
        if name == "default":
            continue
        got = call_chunk(x, lengths=[512, 300, 37], config=cfg)
        out[name] = [bool(np.array_equal(a, b)) for a, b in zip(got, ref)]
        log(f"  {name:>16s}: outputs {'==' if out[name][0] else '!='} default, state "
            f"{'==' if out[name][1] else '!='} default")
    RESULTS["config_equality"] = out


@section
def decode_checks():
    rng = np.random.default_rng(2)
    B, HK, HV, K, V = 4, 2, 8, 128, 128
    d = random_gdn_inputs(rng, B, 3, HK, HV, K, V, np.float32, beta_kind="mixed")
    x = dev_inputs(d)
    ro, rs = oracle_of(x)
    s = x["s0"]
    eo = 0.0
    for t in range(3):
        o, s = recurrent_gated_delta_rule_pallas(x["q"][:, t], x["k"][:, t], x["v"][:, t], x["g"][:, t],
                                                 x["beta"][:, t], initial_state=s)
        eo = max(eo, rel_err(np.asarray(o), ro[:, t]))
    es = rel_err(np.asarray(s), rs)
    check("decode accuracy (3 steps, bf16 q/k/v) vs oracle", eo <= 2e-3 and es <= 2e-3, f"out {eo:.2e} state {es:.2e}")
    # g = 0, beta in {0, 1}
    for bk in ("zero", "one"):
        d2 = random_gdn_inputs(rng, 2, 1, 1, 2, K, V, np.float32, g_kind="near_zero", beta_kind=bk)
        d2["g"][:] = 0.0
        x2 = dev_inputs(d2)
        ro2, rs2 = oracle_of(x2)
        o2, s2 = recurrent_gated_delta_rule_pallas(x2["q"][:, 0], x2["k"][:, 0], x2["v"][:, 0], x2["g"][:, 0],
                                                   x2["beta"][:, 0], initial_state=x2["s0"])
        o2, s2 = np.asarray(o2), np.asarray(s2)
        ok = np.isfinite(o2.astype(np.float32)).all() and np.isfinite(s2).all()
        check(f"decode g=0 beta={bk}", ok and rel_err(o2, ro2[:, 0]) <= 2e-3 and rel_err(s2, rs2) <= 2e-3,
              f"out {rel_err(o2, ro2[:, 0]):.2e} state {rel_err(s2, rs2):.2e}")
    # fused gates
    a = jnp.asarray(rng.standard_normal((B, HV)) * 3, jnp.float32)
    b = jnp.asarray(rng.standard_normal((B, HV)) * 3, jnp.float32)
    A_log = jnp.asarray(rng.uniform(-1, 2, HV), jnp.float32)
    dtb = jnp.asarray(rng.standard_normal(HV), jnp.float32)
    g, beta = gdn_gates(A_log, a, dtb, b)
    args = (x["q"][:, 0], x["k"][:, 0], x["v"][:, 0])
    o1, s1 = recurrent_gated_delta_rule_pallas(*args, g, beta, initial_state=x["s0"])
    o3, s3 = recurrent_gated_delta_rule_pallas(*args, a, b, initial_state=x["s0"], A_log=A_log, dt_bias=dtb)
    check("decode fused gates == unfused", rel_err(np.asarray(s3), np.asarray(s1)) <= 1e-6,
          f"state rel {rel_err(np.asarray(s3), np.asarray(s1)):.1e}")
    # batch invariance and run-to-run
    o1b, s1b = recurrent_gated_delta_rule_pallas(*args, g, beta, initial_state=x["s0"])
    ok = np.array_equal(np.asarray(o1), np.asarray(o1b)) and np.array_equal(np.asarray(s1), np.asarray(s1b))
    for r in range(B):
        oa, sa = recurrent_gated_delta_rule_pallas(*(t[r: r + 1] for t in args), g[r: r + 1], beta[r: r + 1],
                                                   initial_state=x["s0"][r: r + 1])
        ok &= np.array_equal(np.asarray(oa)[0], np.asarray(o1)[r]) and np.array_equal(np.asarray(sa)[0],
                                                                                     np.asarray(s1)[r])
    check("decode run-to-run and row alone == row in batch (bitwise)", ok)
    # in place under donation: the output state reuses the input buffer
    f = jax.jit(lambda q, k, v, g_, b_, s_: recurrent_gated_delta_rule_pallas(q, k, v, g_, b_, initial_state=s_),
                donate_argnums=5)
    s_in = jnp.array(x["s0"])
    ptr = s_in.unsafe_buffer_pointer()
    _, s_out = f(*args, g, beta, s_in)
    check("decode in place (donated state buffer reused)", s_out.unsafe_buffer_pointer() == ptr and s_in.is_deleted())


# ----------------------------------------------------------------------------------------------- timing
def make_prefill(B, T, HK, HV, K=128, V=128, seed=0):
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (B, T, HK, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HK, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HV, V), jnp.bfloat16)
    A = jax.random.uniform(ks[3], (HV,), minval=1.0, maxval=16.0)
    a = jax.random.normal(ks[4], (B, T, HV)) - 2.0
    g = (-A * jax.nn.softplus(a) / 4.0).astype(jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, HV))).astype(jnp.bfloat16).astype(jnp.float32)
    return q, k, v, g, beta


def to_torch(x):
    import torch
    try:
        return torch.from_dlpack(x)
    except Exception:
        return torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).cuda().to(
            torch.bfloat16 if x.dtype == jnp.bfloat16 else torch.float32)


def prefill_model(B, T, HK, HV, K, V, bv):
    """FLOPs of the split design's dots (the tiled inverse's sixteen [16, 16] merge dots counted once, not per TF32
    pass) and its DRAM bytes as of run 25's default: inputs (k read by the prep and output kernels, q and v by one),
    the intermediates written once and read once (gc, u and v_new in fp32, w and kd in fp16 per token; the fp32
    state h per chunk), the bf16 output and the final state. `bv` is not used (q/k reads per V block hit L2)."""
    C = 64
    nt = -(-T // C)
    nch = B * HV * nt
    flops_prep = 2 * C * C * K + 16 * 2 * 16 ** 3 + 2 * C * C * K + 2 * C * C * V  # kk^T, merge, w, u
    flops_state = 2 * 2 * C * K * V  # w S, kd^T v_new
    flops_out = 2 * C * C * K + 2 * C * K * V + 2 * C * C * V  # q k^T, q h, A v_new
    flops = nch * (flops_prep + flops_state + flops_out)
    useful = nch * (2 * C * C * K + 2 * C * C * K + 2 * C * C * V + flops_state + flops_out)
    inputs = B * T * (HK * K * 2 * 3 + HV * V * 2 + HV * 8)
    inter = 2 * (B * T * HV * (4 * (1 + 2 * V) + 2 * 2 * K) + nch * K * V * 4)
    out = B * T * HV * V * 2 + B * HV * K * V * 4
    return flops, useful, inputs + inter + out


@section
def ceilings():
    import torch
    import triton
    x = torch.empty(2 ** 29, dtype=torch.float32, device="cuda")  # 2 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), quantiles=[0.5])
    ms = ms[0] if isinstance(ms, (list, tuple)) else ms
    copy_tbs = 2 * x.numel() * 4 / (ms * 1e-3) / 1e12
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms2 = triton.testing.do_bench(lambda: a @ a, quantiles=[0.5])
    ms2 = ms2[0] if isinstance(ms2, (list, tuple)) else ms2
    mm = 2 * 8192 ** 3 / (ms2 * 1e-3) / 1e12
    xj = jnp.zeros((2 ** 29,), jnp.float32)
    cp = jax.jit(lambda z: z + 1.0)
    t = bench_jax(cp, xj, n=10)
    jax_copy = 2 * 2 ** 29 * 4 / t / 1e12
    RESULTS["ceilings"] = dict(copy_TBps_torch=copy_tbs, copy_TBps_jax=jax_copy, bf16_matmul_TFLOPs=mm)
    log(f"copy (torch 2 GiB) {copy_tbs:.2f} TB/s; jax elementwise {jax_copy:.2f} TB/s; bf16 8192^3 {mm:.0f} TFLOP/s")


def fla_prefill_fn(q, k, v, g, beta, module="fla"):
    """fla-core's chunk_gated_delta_rule (its Triton kernels: FLA_FLASH_QLA=0, set above), or (module="flash_qla")
    FlashQLA's, which takes the same arguments (intra-card context parallelism on: its default)."""
    if module == "flash_qla":
        from flash_qla import chunk_gated_delta_rule as fla_chunk
    else:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    tq, tk, tv, tg = to_torch(q), to_torch(k), to_torch(v), to_torch(g)
    tb = to_torch(beta.astype(jnp.bfloat16))
    K = q.shape[-1]

    def run():
        return fla_chunk(tq, tk, tv, tg, tb, scale=K ** -0.5, initial_state=None, output_final_state=True,
                         use_qk_l2norm_in_kernel=True)
    return run


def do_bench_ms(fn):
    import triton
    r = triton.testing.do_bench(fn, quantiles=[0.5])
    return r[0] if isinstance(r, (list, tuple)) else r


@section
def config_sweep(configs, accuracy):
    """Time candidate configurations on two shapes; return the fastest that meets the accuracy bars."""
    shapes = [(1, 8192, 16, 32), (8, 4096, 16, 32)]
    rows = {}
    for shp in shapes:
        q, k, v, g, beta = make_prefill(*shp)
        for cname, cfg in configs.items():
            f = jax.jit(functools.partial(chunk_gated_delta_rule_pallas, config=cfg))
            try:
                t = bench_jax(f, q, k, v, g, beta, n=10, reps=5)
            except Exception as e:
                log(f"  {cname}: {type(e).__name__}: {str(e)[:300]}")
                continue
            rows.setdefault(cname, {})[str(shp)] = t * 1e3
            log(f"  {str(shp):>22s} {cname:>14s} {t * 1e3:8.3f} ms")
        del q, k, v, g, beta
    RESULTS["configs"] = rows
    best, best_t = "default", float("inf")
    for cname, r in rows.items():
        acc = accuracy.get(cname, {}) if accuracy else {}
        # outputs are bf16 (their rounding alone is ~1.7e-3 relative): bar 2e-3; states (fp32) 1e-3
        good = acc and all(a is not None and a[0] <= 2e-3 and a[1] <= 1e-3 and a[2] for a in acc.values())
        tot = sum(r.values()) if len(r) == len(shapes) else float("inf")
        log(f"  {cname:>14s} total {tot:8.3f} ms accurate={bool(good)}")
        if good and tot < best_t:
            best, best_t = cname, tot
    log(f"best config: {best}")
    RESULTS["best_config"] = best
    return best


PREFILL_TIMING_SHAPES = ((1, 8192, 32, 32), (1, 8192, 16, 32), (8, 4096, 16, 32), (1, 32768, 16, 32))  # issue 3's


@section
def prefill_timing(cfg_name, cfg, with_reference=True, shapes=PREFILL_TIMING_SHAPES):
    log(f"{'shape (B,T,HK,HV)':>22s} {'ours ms':>9s} {'fla ms':>9s} {'ours/fla':>9s} {'ref ms':>9s}  rel(o) vs fla")
    for shp in shapes:
        q, k, v, g, beta = make_prefill(*shp)
        f = jax.jit(functools.partial(chunk_gated_delta_rule_pallas, config=cfg))
        t_ours = bench_jax(f, q, k, v, g, beta, n=10)
        try:
            fla_run = fla_prefill_fn(q, k, v, g, beta)
            t_fla = do_bench_ms(fla_run) * 1e-3
            fo, fs = fla_run()
            o, s = f(q, k, v, g, beta)
            diff_o = rel_err(np.asarray(o.astype(jnp.float32)), fo.float().cpu().numpy())
            diff_s = rel_err(np.asarray(s), fs.float().cpu().numpy())
        except Exception as e:
            log(f"fla failed: {type(e).__name__}: {str(e)[:300]}")
            fla_run, t_fla, diff_o, diff_s = None, float("nan"), float("nan"), float("nan")
        t_qla, t_fla2 = float("nan"), float("nan")
        try:  # FlashQLA 0.1.3 when installed (BENCHMARKS.md: how to carry its wheels); then fla again, to show drift
            qla_run = fla_prefill_fn(q, k, v, g, beta, module="flash_qla")
            qla_run()  # compile (TileLang) before timing
            t_qla = do_bench_ms(qla_run) * 1e-3
            t_fla2 = do_bench_ms(fla_run) * 1e-3 if fla_run else float("nan")
            qo, qs = qla_run()
            o, s = f(q, k, v, g, beta)
            log(f"  flash_qla {str(shp)}: {t_qla * 1e3:.3f} ms; ours / flash_qla {t_ours / t_qla:.2f}; fla again "
                f"{t_fla2 * 1e3:.3f} ms; rel vs ours: o "
                f"{rel_err(np.asarray(o.astype(jnp.float32)), qo.float().cpu().numpy()):.1e}"
                f" S {rel_err(np.asarray(s), qs.float().cpu().numpy()):.1e}")
        except Exception as e:
            log(f"  flash_qla unavailable: {type(e).__name__}: {str(e)[:200]}")
        t_ref = float("nan")
        if with_reference:
            try:
                fr = jax.jit(chunk_gated_delta_rule_reference)
                t_ref = bench_jax(fr, q, k, v, g, beta, n=3, reps=3)
            except Exception as e:
                log(f"reference failed: {type(e).__name__}: {str(e)[:200]}")
        flops, useful, nbytes = prefill_model(*shp, 128, 128, dict(chunk_mod.DEFAULT_CONFIG, **(cfg or {}))["bv"])
        row = dict(shape=shp, config=cfg_name, ours_ms=t_ours * 1e3, fla_ms=t_fla * 1e3, ratio=t_ours / t_fla,
                   flash_qla_ms=t_qla * 1e3, fla_again_ms=t_fla2 * 1e3,
                   ref_ms=t_ref * 1e3, rel_o_vs_fla=diff_o, rel_state_vs_fla=diff_s, flops=flops,
                   useful_flops=useful, bytes=nbytes,
                   achieved_TFLOPs=flops / t_ours / 1e12, achieved_TBps=nbytes / t_ours / 1e12)
        RESULTS["prefill"].append(row)
        log(f"{str(shp):>22s} {t_ours * 1e3:9.3f} {t_fla * 1e3:9.3f} {t_ours / t_fla:9.2f} {t_ref * 1e3:9.2f}  "
            f"o {diff_o:.1e} S {diff_s:.1e}  [{flops / t_ours / 1e12:.0f} TFLOP/s, {nbytes / t_ours / 1e12:.2f} TB/s]")
        del q, k, v, g, beta


@section
def decode_timing(configs):
    import torch
    nstep = 20
    log(f"{'B':>4s} {'config':>14s} {'kernel us':>10s} {'TB/s':>6s} {'call us':>8s} {'lat us':>8s}")
    for B in (1, 64, 256):
        HK, HV, K, V = 16, 32, 128, 128
        key = jax.random.PRNGKey(B)
        ks = jax.random.split(key, 6)
        q = jax.random.normal(ks[0], (B, HK, K), jnp.bfloat16)
        k = jax.random.normal(ks[1], (B, HK, K), jnp.bfloat16)
        v = jax.random.normal(ks[2], (B, HV, V), jnp.bfloat16)
        g = -jax.nn.softplus(jax.random.normal(ks[3], (B, HV)))
        beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, HV)))
        s0 = jax.random.normal(ks[5], (B, HV, K, V), jnp.float32) * 0.1
        state_bytes = 2 * B * HV * K * V * 4
        for cname, cfg in configs.items():
            kern = functools.partial(recurrent_gated_delta_rule_pallas, config=cfg)

            @functools.partial(jax.jit, donate_argnums=5)
            def loop(q, k, v, g, beta, s):
                return jax.lax.fori_loop(0, nstep, lambda i, s: kern(q, k, v, g, beta, initial_state=s)[1], s,
                                         unroll=True)

            step = jax.jit(lambda q, k, v, g, beta, s: kern(q, k, v, g, beta, initial_state=s), donate_argnums=5)
            try:
                t_kernel, s = bench_state_loop(loop, (q, k, v, g, beta), jnp.array(s0), nstep)
                # per call, pipelined and latency (block each call)
                t_call, o, s = bench_state_calls(step, (q, k, v, g, beta), s)
                lats = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    o, s = step(q, k, v, g, beta, s)
                    jax.block_until_ready(o)
                    lats.append(time.perf_counter() - t0)
                t_lat = statistics.median(lats)
            except Exception as e:
                log(f"  B={B} {cname}: {type(e).__name__}: {str(e)[:300]}")
                continue
            tbs = state_bytes / t_kernel / 1e12
            RESULTS["decode"].append(dict(B=B, impl="ours", config=cname, kernel_us=t_kernel * 1e6, TBps=tbs,
                                          call_us=t_call * 1e6, latency_us=t_lat * 1e6))
            log(f"{B:4d} {cname:>14s} {t_kernel * 1e6:10.1f} {tbs:6.2f} {t_call * 1e6:8.1f} {t_lat * 1e6:8.1f}")
        # fla
        try:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_rec
            tq, tk, tv = to_torch(q[:, None]), to_torch(k[:, None]), to_torch(v[:, None])
            tg, tb = to_torch(g[:, None]), to_torch(beta[:, None])
            ts0 = to_torch(s0).clone()

            def run():
                return fla_rec(tq, tk, tv, g=tg, beta=tb, scale=K ** -0.5, initial_state=ts0,
                               output_final_state=True, use_qk_l2norm_in_kernel=True)
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(nstep):
                    run()
            graph.replay()
            torch.cuda.synchronize()
            t_kernel = do_bench_ms(graph.replay) * 1e-3 / nstep
            t_call = do_bench_ms(run) * 1e-3
            lats = []
            for _ in range(50):
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                lats.append(time.perf_counter() - t0)
            t_lat = statistics.median(lats)
            fo, fs = run()
            o_ours, s_ours = recurrent_gated_delta_rule_pallas(q, k, v, g, beta, initial_state=jnp.array(s0))
            d_s = rel_err(np.asarray(s_ours), fs.float().cpu().numpy())
            tbs = state_bytes / t_kernel / 1e12
            RESULTS["decode"].append(dict(B=B, impl="fla", kernel_us=t_kernel * 1e6, TBps=tbs, call_us=t_call * 1e6,
                                          latency_us=t_lat * 1e6, rel_state_vs_ours=d_s))
            log(f"{B:4d} {'fla':>14s} {t_kernel * 1e6:10.1f} {tbs:6.2f} {t_call * 1e6:8.1f} {t_lat * 1e6:8.1f}"
                f"   (state rel diff vs ours {d_s:.1e})")
        except Exception as e:
            traceback.print_exc()
            log(f"  fla decode failed: {type(e).__name__}: {str(e)[:300]}")
        # pure-JAX reference step
        try:
            fr = jax.jit(lambda q, k, v, g, beta, s: gated_delta_step_reference(q, k, v, g, beta, s),
                         donate_argnums=5)
            t_call, _, _ = bench_state_calls(fr, (q, k, v, g, beta), jnp.array(s0))
            RESULTS["decode"].append(dict(B=B, impl="jax-reference", call_us=t_call * 1e6,
                                          TBps=state_bytes / t_call / 1e12))
            log(f"{B:4d} {'jax-ref':>14s} {'':>10s} {state_bytes / t_call / 1e12:6.2f} {t_call * 1e6:8.1f}")
        except Exception as e:
            log(f"  reference decode failed: {type(e).__name__}: {str(e)[:300]}")


@section
def prefill_breakdown(cfg):
    """Time the kernels cumulatively: prep alone, prep + recurrence, all (split design; fused: prep + rest)."""
    split = dict(cfg or {}).get("design", "split") == "split"
    two = dict(chunk_mod.DEFAULT_CONFIG, **(cfg or {}))["prep_kernels"] == 2
    stops = (["inverse"] if split and two else []) + (["prep", "state", None] if split else ["prep", None])
    for shp in [(1, 8192, 16, 32), (8, 4096, 16, 32), (1, 32768, 16, 32)]:
        q, k, v, g, beta = make_prefill(*shp)
        row = dict(shape=shp)
        prev = 0.0
        for stop in stops:
            c = dict(cfg or {}, stop_after=stop) if stop else cfg
            f = jax.jit(functools.partial(chunk_gated_delta_rule_pallas, config=c))
            t = bench_jax(f, q, k, v, g, beta, n=10)
            row[f"{stop or 'out'}_ms"] = (t - prev) * 1e3
            prev = t
        row["total_ms"] = prev * 1e3
        RESULTS.setdefault("breakdown", []).append(row)
        log(f"{str(shp):>22s} " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k.endswith("_ms")))
        fla_kernel_times(shp, q, k, v, g, beta)
        del q, k, v, g, beta


def fla_kernel_times(shp, q, k, v, g, beta, calls=10):
    """fla's chunk_gated_delta_rule per CUDA kernel (torch.profiler, device time per call), beside our breakdown:
    where its time goes. Skipped when fla is not installed."""
    try:
        run = fla_prefill_fn(q, k, v, g, beta)
        run()
    except ImportError:
        return
    except Exception as e:  # a diagnostic: fla failing here must not fail our breakdown
        log(f"  fla breakdown skipped: {type(e).__name__}: {e}")
        return
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                run()
            torch.cuda.synchronize()
    except Exception as e:  # the profiler is a diagnostic: its failure must not fail the breakdown
        log(f"  fla breakdown skipped: {type(e).__name__}: {e}")
        return
    times = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.key and not e.key.startswith(("cudaLaunch", "cudaDevice", "Memcpy", "Memset")):
            times[e.key] = times.get(e.key, 0.0) + t / calls / 1e3
    RESULTS.setdefault("fla_breakdown", []).append(dict(shape=shp, kernels_ms=times))
    ranked = sorted(times.items(), key=lambda x: -x[1])
    log(f"{'fla ' + str(shp):>26s} " + ", ".join(f"{n[:60]} {t:.3f}" for n, t in ranked if t >= 0.005)
        + f"; total {sum(times.values()):.3f}")


@section
def invariant_kernels():
    """Deterministic-mode kernels: the fixed-tile matmul and the KV-cache attention. Bitwise: rows alone == the same
    rows inside larger calls; speed against XLA's (non-invariant) GEMM and attention, per config."""
    from pallas_kernels.attention import attention_invariant_pallas, attention_reference
    from pallas_kernels.matmul import matmul_invariant_pallas
    ks = jax.random.split(jax.random.PRNGKey(7), 8)
    K, N = 4096, 12288
    w = (jax.random.normal(ks[0], (K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(ks[1], (2048, K), jnp.bfloat16)
    full = np.asarray(matmul_invariant_pallas(x, w))
    ok = all(np.array_equal(np.asarray(matmul_invariant_pallas(x[-m:], w)), full[-m:])
             for m in (1, 7, 64, 100, 128, 512, 1024))
    check("invariant matmul: last m rows alone == inside M=2048 (m = 1, 7, 64, 100, 128, 512, 1024)", ok)
    # every projection shape of the model: rows computed with the decode tiling (M < wide_m) == the same rows
    # inside a prefill-sized call (the many-row tiling: in-kernel split, wide column tiles)
    from pallas_kernels.matmul import DEFAULT_CONFIG as MM_DEFAULT, _plan
    # (4096, 16): the a/b gate projections' per-shard shape on a 2-GPU mesh (16 slices, in-kernel for many rows)
    for (Kp, Np) in [(4096, 8192), (4096, 4096), (4096, 1024), (4096, 32), (4096, 16), (4096, 12288),
                     (12288, 4096)]:
        wp = (jax.random.normal(ks[0], (Kp, Np), jnp.float32) * 0.02).astype(jnp.bfloat16)
        xp = jax.random.normal(ks[1], (2048, Kp), jnp.bfloat16)
        fullp = np.asarray(matmul_invariant_pallas(xp, wp))
        ok = all(np.array_equal(np.asarray(matmul_invariant_pallas(xp[-m:], wp)), fullp[-m:]) for m in (1, 64, 300))
        check(f"invariant matmul K={Kp} N={Np}: rows alone (plan {_plan(1, Kp, Np, MM_DEFAULT)}) == inside M=2048 "
              f"(plan {_plan(2048, Kp, Np, MM_DEFAULT)})", ok)
        del wp, xp
    xla = np.asarray(jax.jit(lambda a, b: a @ b)(x, w))
    xla_m = np.asarray(jax.jit(lambda a, b: a @ b)(x[-128:], w))
    log(f"  control: XLA row block alone == inside (M=128 vs 2048): {np.array_equal(xla_m, xla[-128:])}")
    err = float(np.abs(full.astype(np.float32) - xla.astype(np.float32)).max())
    log(f"  invariant vs XLA max abs diff {err:.3e}")
    mm_configs = {"default": None, "narrow": dict(wide_m=0), "inner_only": dict(bn_wide=128),
                  "wide_s3": dict(stages_wide=3), "s4": dict(num_stages=4)}
    rows = {}
    for (M, K, N) in [(64, 4096, 12288), (1024, 4096, 12288), (8192, 4096, 12288), (8192, 12288, 4096),
                      (1024, 12288, 4096), (8192, 4096, 8192), (8192, 4096, 4096), (8192, 4096, 1024)]:
        a = jax.random.normal(ks[2], (M, K), jnp.bfloat16)
        b = (jax.random.normal(ks[3], (K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
        t_x = bench_jax(jax.jit(lambda a, b: a @ b), a, b, n=10, reps=5)
        line = f"  matmul M={M} K={K} N={N}: XLA {t_x * 1e6:8.1f} us ({2 * M * K * N / t_x / 1e12:5.0f} TFLOP/s)"
        for cname, cfg in mm_configs.items():
            try:
                t = bench_jax(jax.jit(functools.partial(matmul_invariant_pallas, config=cfg)), a, b, n=10, reps=5)
            except Exception as e:
                log(f"  matmul config {cname} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.setdefault(cname, {})[f"{M}x{K}x{N}"] = t_x / t
            line += f" | {cname} {t_x / t:.2f}"
        log(line + "  (XLA time / ours)")
        RESULTS.setdefault("invariant_matmul_xla_us", {})[f"{M}x{K}x{N}"] = t_x * 1e6
    RESULTS["invariant_matmul_vs_xla"] = rows
    # attention: decode (B=64, context 1088, rows 16) and prefill (T=8192, rows 64), Qwen3.5-9B heads
    H, HKV, Dh = 16, 4, 256
    for name, B, T, Ncap, rws in [("decode", 64, 1, 1088, 16), ("prefill", 1, 8192, 8192, 64)]:
        q = jax.random.normal(ks[4], (B, T, H, Dh), jnp.bfloat16)
        kc = jax.random.normal(ks[5], (B, Ncap, HKV, Dh), jnp.bfloat16)
        vc = jax.random.normal(ks[6], (B, Ncap, HKV, Dh), jnp.bfloat16)
        pos = (jnp.full((B, T), 1023, jnp.int32) if T == 1
               else jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
        ref = np.asarray(jax.jit(attention_reference)(q, kc, vc, pos)).astype(np.float32)
        t_x = bench_jax(jax.jit(attention_reference), q, kc, vc, pos, n=10, reps=5)
        line = f"  attention {name}: XLA {t_x * 1e6:8.1f} us"
        for cname, cfg in {"default": None, "bk32": dict(bk=32), "w4": dict(num_warps=4),
                           "s1": dict(num_stages=1), "s3": dict(num_stages=3)}.items():
            f = jax.jit(functools.partial(attention_invariant_pallas, rows=rws, config=cfg))
            try:
                out = np.asarray(f(q, kc, vc, pos)).astype(np.float32)
                t = bench_jax(f, q, kc, vc, pos, n=10, reps=5)
            except Exception as e:
                log(f"  attention config {cname} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            err = float(np.abs(out - ref).max())
            RESULTS.setdefault("invariant_attention", []).append(dict(case=name, config=cname, us=t * 1e6,
                                                                      xla_us=t_x * 1e6, max_abs_vs_xla=err))
            line += f" | {cname} {t * 1e6:.1f} us (err {err:.1e})"
            if cname == "default":
                if T == 1:
                    one = np.asarray(f(q[5:6], kc[5:6], vc[5:6], pos[5:6])).astype(np.float32)
                    check("invariant attention decode: row alone == row 5 of B=64", np.array_equal(one[0], out[5]))
                else:
                    part = np.asarray(f(q[:, 4096:4096 + 65], kc, vc, pos[:, 4096:4096 + 65])).astype(np.float32)
                    check("invariant attention prefill: 65 queries alone == inside T=8192",
                          np.array_equal(part, out[:, 4096:4096 + 65]))
                check(f"invariant attention {name}: close to XLA (max abs <= 2e-2)", err <= 2e-2, f"{err:.2e}")
        log(line)
        del q, kc, vc


def open_chunk_inputs(B, seed, HK=16, HV=32, K=128, V=128):
    """Random open chunks for the replay timings: q, k, v [B, 64, H, .] bf16, realistic g, beta, a boundary state and
    lengths in 1..64 (rows at mixed phases)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 7)
    q = jax.random.normal(ks[0], (B, 64, HK, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, 64, HK, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, 64, HV, V), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, 64, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, 64, HV)))
    s0 = jax.random.normal(ks[5], (B, HV, K, V), jnp.float32) * 0.1
    return q, k, v, g, beta, s0, jax.random.randint(ks[6], (B,), 1, 65)


# How the replay step's timing compiles its loops: "default", XLA's own schedule (runs 189-196 timed this), and
# "concurrent", jaxgdn's COMPILER_OPTIONS (`jaxgdn.model.jit`: the command buffers' CONCURRENT schedule, which
# starts kernel 2 beside kernel 1, and no excess precision) — the schedule the model's decode runs under.
SCHEDULES = ("default", "concurrent")


def schedule_options(schedule: str) -> dict:
    """`jax.jit`'s compiler_options for a schedule of SCHEDULES."""
    from jaxgdn.model import COMPILER_OPTIONS

    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    return dict(COMPILER_OPTIONS) if schedule == "concurrent" else {}


def decode_kernel_loop(nstep, schedule="default"):
    """`nstep` recurrent decode-kernel steps (on the chunk's first token) in one compiled loop, the state donated:
    the replay timings' reference."""
    @functools.partial(jax.jit, donate_argnums=5, compiler_options=schedule_options(schedule))
    def rec_loop(q, k, v, g, beta, s):
        return jax.lax.fori_loop(0, nstep, lambda i, s: recurrent_gated_delta_rule_pallas(
            q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], initial_state=s)[1], s, unroll=True)
    return rec_loop


@section
def replay_timing():
    """Replay decode at the kernel level: one step = the chunked kernel over the open chunk (64 rows, row b holding
    lengths[b] <= 64 real tokens) from the boundary state, with the in-call checkpoint at 64 (what `jaxgdn`'s replay
    decode called per GDN layer before the replay step kernel), against the recurrent decode kernel; both as 20 steps
    in one compiled loop."""
    nstep = 20
    for B in (64, 256):
        q, k, v, g, beta, s0, lengths = open_chunk_inputs(B, seed=B + 1)
        state_bytes = 2 * B * s0[0].size * 4

        def timed_loop(loop, *args):
            return bench_state_loop(loop, args[:-1], args[-1], nstep, inner=1)[0]

        t_rec = timed_loop(decode_kernel_loop(nstep), q, k, v, g, beta, s0 + 0)
        row = dict(B=B, recurrent_us=t_rec * 1e6)
        for design in ("split", "fused"):
            cfg = None if design == "split" else dict(design="fused", prep_kernels=1, inv="block16")  # split: the
            # model's default

            @jax.jit
            def rep_loop(q, k, v, g, beta, s, cfg=cfg):
                def step(i, s):
                    o, _, ck = chunk_gated_delta_rule_pallas(q, k, v, g, beta, initial_state=s, lengths=lengths,
                                                             checkpoint_stride=64, config=cfg)
                    return ck[:, 0] + 0 * o[:, 0, :, :1, None].astype(jnp.float32)  # keep o live
                return jax.lax.fori_loop(0, nstep, step, s, unroll=True)

            t = timed_loop(rep_loop, q, k, v, g, beta, s0 + 0)
            row[f"replay_{design}_us"] = t * 1e6
            log(f"B={B}: recurrent {t_rec * 1e6:.1f} us ({state_bytes / t_rec / 1e12:.2f} TB/s); replay ({design}) "
                f"{t * 1e6:.1f} us = {t / t_rec:.2f}x recurrent")
        RESULTS.setdefault("replay_kernel", []).append(row)


def _open_window(x, start, n):
    """Rows start[b] .. start[b] + 63 of x [B, T, ...] per row, zero from n[b] on (the replay step's open chunk)."""
    from jaxgdn.layers.gdn import _gather_rows  # the model's own row gather (its open-chunk splice uses it)

    rows = jnp.arange(64)[None, :]
    return _gather_rows(x, start[:, None] + rows, rows < n[:, None])


def pack_open_chunk(q, k, v, g, beta, groups):
    """The open chunk as the model keeps it: qkv [B, 64, 2 HK K + HV V] in `groups` groups of [q_g | k_g | v_g]
    and gates [B, 64, 2, HV]."""
    B, C = q.shape[:2]
    split = lambda a: a.reshape(B, C, groups, -1)  # noqa: E731 (a group's heads' channels, contiguous)
    qkv = jnp.concatenate([split(q), split(k), split(v)], axis=-1).reshape(B, C, -1)
    return qkv, jnp.stack([g, beta], axis=2)


def replay_decode_run(x, prompt, steps, rows=None, config=None, packed=None):
    """Prefill each row to prompt[b] (chunked kernels to the last grid boundary, `prime` on the rest), then `steps`
    replay steps (packed = G: the step on the model's packed buffers in G groups, `chunk_replay_step_packed_pallas`).
    Returns (outputs [B, steps, HV, V], {(row, position): state at every boundary crossed})."""
    from pallas_kernels.gated_delta import replay as rp

    rows = slice(None) if rows is None else rows
    q, k, v, g, beta = (x[n][rows] for n in ("q", "k", "v", "g", "beta"))
    prompt = jnp.asarray(prompt, jnp.int32)
    bnd = (prompt // 64) * 64
    _, s = chunk_gated_delta_rule_pallas(q, k, v, g, beta, lengths=bnd)
    win = jax.jit(lambda start, n: tuple(_open_window(a, start, n) for a in (q, k, v, g, beta)))
    xc, vc = rp.chunk_replay_prime_pallas(*win(bnd, prompt - bnd), s, prompt - bnd, config=config)
    step = jax.jit(functools.partial(rp.chunk_replay_step_pallas, config=config), donate_argnums=(5, 6, 7))
    if packed is not None:
        heads = (q.shape[2], q.shape[3], v.shape[2], v.shape[3])
        step_packed = jax.jit(functools.partial(rp.chunk_replay_step_packed_pallas, config=config, heads=heads,
                                                groups=packed), donate_argnums=(2, 3, 4))

        def step(q, k, v, g, beta, s, xc, vc, n):  # noqa: F811 (the packed form of the same step)
            return step_packed(*pack_open_chunk(q, k, v, g, beta, packed), s, xc, vc, n)[:4]
    outs, crossed, pos = [], {}, np.asarray(prompt)
    for _ in range(steps):
        start = (pos // 64) * 64
        n = pos - start + 1
        o, s, xc, vc = step(*win(jnp.asarray(start), jnp.asarray(n)), s, xc, vc, jnp.asarray(n, jnp.int32))
        outs.append(np.asarray(o))
        for b in np.flatnonzero(n == 64):
            crossed[b, int(pos[b]) + 1] = np.asarray(s[b])
        pos = pos + 1
    return np.stack(outs, axis=1), crossed


@section
def replay_step_checks(dims=((128, 128),), names=None):
    """The replay step (`gated_delta/replay.py`) against the chunked prefill, bitwise, at HK=16 HV=32 and each (K, V)
    of `dims` (--replay-dims): rows prefilled to 70 / 37 / 128 / 5 tokens then 140 steps each (every row crosses two
    boundaries); each step's output row == the same row of one prefill of prompt + 140 tokens; the state at every
    boundary crossed == that prefill's in-call checkpoint there; and row 0 decoded alone (a small grid) == row 0 in
    the batch. The packed-buffer forms are checked at the first (K, V)."""
    for i, (K, V) in enumerate(dims):
        _replay_step_checks(K, V, packed=i == 0, names=names)


def replay_configs(names, table):
    """The entries of `table` (REPLAY_STEP_CONFIGS and REPLAY_STEP_TIMING_ONLY) that --replay-configs names (None:
    all)."""
    return dict(table) if names is None else {n: c for n, c in table.items() if n in names}


def _replay_step_checks(K, V, packed, names=None):
    prompt, steps = np.array([70, 37, 128, 5]), 140
    B, T = len(prompt), int(prompt.max()) + steps
    x = dev_inputs(random_gdn_inputs(np.random.default_rng(11), B=B, T=T, HK=16, HV=32, K=K, V=V,
                                     with_state=False))
    kv = "" if (K, V) == (128, 128) else f" at K, V = {K}, {V}"
    o_full, _, cks = call_chunk(x, s0=None, lengths=prompt + steps, stride=64)
    want = np.stack([o_full[b, prompt[b]:prompt[b] + steps] for b in range(B)])
    for name, cfg in replay_configs(names, REPLAY_STEP_CONFIGS).items():  # the prefill's default configuration,
        # the step's launch varied
        outs, crossed = replay_decode_run(x, prompt, steps, config=cfg)
        bad = [(b, i) for b in range(B) for i in range(steps) if not np.array_equal(outs[b, i], want[b, i])]
        diff = np.abs(outs.astype(np.float32) - want.astype(np.float32)).max()
        blocks = sorted({int(prompt[b] + i) % 64 // 16 for b, i in bad})  # which block rows of the open chunk differ
        check(f"replay step [{name}]{kv} outputs == prefill rows (4 rows x 140 steps)", not bad,
              f"{len(bad)} differ, first {bad[:4]}, in block rows {blocks}; max |diff| {diff:.3g}")
        st_bad = [key for key, st in crossed.items() if not np.array_equal(st, cks[key[0], key[1] // 64 - 1])]
        st_diff = max((float(np.abs(st - cks[key[0], key[1] // 64 - 1]).max()) for key, st in crossed.items()),
                      default=0.0)
        check(f"replay step [{name}]{kv} boundary states == prefill checkpoints", not st_bad and len(crossed) >= 8,
              f"{len(crossed)} crossings, {len(st_bad)} differ: {st_bad[:4]}; max |diff| {st_diff:.3g}")
        if cfg is None:
            alone, _ = replay_decode_run(x, prompt[:1], 70, rows=slice(0, 1))
            check(f"replay step{kv}: row alone == row in batch", np.array_equal(alone[0], outs[0, :70]))
            for groups in ((16, 1) if packed else ()):  # the model's packed buffers (grouped layout, Hugging Face's)
                p_outs, p_crossed = replay_decode_run(x, prompt, steps, packed=groups)
                same = np.array_equal(p_outs, outs) and p_crossed.keys() == crossed.keys() and all(
                    np.array_equal(p_crossed[key], crossed[key]) for key in crossed)
                check(f"replay step{kv} on packed buffers ({groups} groups) == on separate arrays (outputs, states)",
                      same)


def new_token_row(x, src, i):
    """x [B, 64, ...] with row i % 64 overwritten by row (i + 1) % 64 of src (another buffer, as the model's one-row
    scatter writes a row computed elsewhere): a step's inputs change as decoding's do. (Until 2026-11-30's
    run 51 the timing loop fed every step the same q and k, and XLA hoisted the step's kernel that reads only those
    out of the loop: `gdn_replay_intra` ran once per loop, not per step. Until 2026-12-01's run 78 the row came from
    x itself: the step took the same time either way, 169.4 / 170.1 us at B=64 in runs 77 / 78.)"""
    row = i % 64
    return jax.lax.dynamic_update_slice_in_dim(x, jax.lax.dynamic_slice_in_dim(src, (row + 1) % 64, 1, 1), row, 1)


def _bar(ratio: float) -> str:
    """Issue 7's bar on the replay step: <= 1.5x the recurrent decode kernel's time."""
    return "met" if ratio <= 1.5 else "not met"


@section
def replay_step_timing(batches=(64, 256), names=None, schedules=SCHEDULES):
    """The replay step against the recurrent decode kernel at HK=16 HV=32 K=V=128, B=64 and 256, rows at mixed
    phases of the open chunk (lengths 1..64, fixed over the loop: a row at 64 writes its boundary state every step),
    20 steps in one compiled loop with the state and caches donated, timed with one loop per call and with five back
    to back (the host's dispatch overlapping the device: since 2026-12-01's run 77; issue 7's bar is read on these);
    and each kernel's device time per step, from a profile of the same loop. Both loops are compiled under each of
    `schedules` (SCHEDULES: XLA's default, and the model's "concurrent" COMPILER_OPTIONS), in the same process."""
    from pallas_kernels.gated_delta import replay as rp
    from scripts.gpu_model_bench import profiled_kernels

    nstep = 20
    for B in batches:
        q, k, v, g, beta, s0, lengths = open_chunk_inputs(B, seed=B + 7)
        q_src, k_src = q[:, ::-1] + 0, k[:, ::-1] + 0  # the new tokens' rows (any rows will do)
        for schedule in schedules:
            rec_loop = decode_kernel_loop(nstep, schedule)
            t_rec = bench_state_loop(rec_loop, (q, k, v, g, beta), s0 + 0, nstep, inner=1)[0]
            # the same loops called 5 times back to back per repetition: the host's dispatch and sync (once per
            # call, inside the figures above: up to 2026-12-01's run 75 the only ones) overlap the device's work
            t_rec5 = bench_state_loop(rec_loop, (q, k, v, g, beta), s0 + 0, nstep, inner=5)[0]
            for name, cfg in replay_configs(names, {**REPLAY_STEP_CONFIGS, **REPLAY_STEP_TIMING_ONLY}).items():
                _replay_step_row(B, schedule, name, cfg, (q, k, v, g, beta, s0, lengths), (q_src, k_src), nstep,
                                 t_rec, t_rec5, rp, profiled_kernels)


def replay_step_loop(cfg, lengths, nstep: int, schedule: str = "default"):
    """`nstep` replay steps of the rows' open chunks (`lengths`, fixed) in one compiled loop under `schedule`:
    (v, g, beta, q_src, k_src, carry) -> carry, carry = (state, x cache, v_new cache, q, k) donated, each step's q and
    k taking a new row from q_src and k_src (`new_token_row`), as decoding writes one token per step. (o is an output
    of the kernel that also writes the v_new cache: computed and written every step, as the recurrent loop's o; until
    2026-11-30 UTC 21:00 the loop summed it, ~7 us per step.)"""
    from pallas_kernels.gated_delta import replay as rp

    @functools.partial(jax.jit, donate_argnums=5, compiler_options=schedule_options(schedule))
    def step_loop(v, g, beta, q_src, k_src, carry):
        def body(i, c):
            s, xc, vc, q, k = c
            q, k = (new_token_row(x, x_src, i) for x, x_src in ((q, q_src), (k, k_src)))
            _, s, xc, vc = rp.chunk_replay_step_pallas(q, k, v, g, beta, s, xc, vc, lengths, config=cfg)
            return s, xc, vc, q, k
        return jax.lax.fori_loop(0, nstep, body, carry, unroll=True)
    return step_loop


def _replay_step_row(B, schedule, name, cfg, inputs, srcs, nstep, t_rec, t_rec5, rp, profiled_kernels):
    """`replay_step_timing` for one batch size, schedule and configuration: the step loop profiled and timed, a row
    of RESULTS["replay_step"] logged (prime's time under the default schedule only: one call, no loop)."""
    q, k, v, g, beta, s0, lengths = inputs
    q_src, k_src = srcs
    xc, vc = rp.chunk_replay_prime_pallas(q, k, v, g, beta, s0, lengths - 1, config=cfg)
    step_loop = replay_step_loop(cfg, lengths, nstep, schedule)
    tag = f"B={B} [{name}, {schedule} schedule]"
    # where the step's device time goes, kernel by kernel (one loop under jax.profiler)
    per = profiled_kernels(lambda: step_loop(v, g, beta, q_src, k_src, (s0 + 0, xc + 0, vc + 0, q + 0, k + 0)), 12)
    ours = [(n, t) for n, t, _ in per if n.startswith("gdn_replay")]
    other = sum(t for n, t, _ in per if not n.startswith("gdn_replay"))
    RESULTS.setdefault("replay_step_profile", []).append(
        dict(B=B, config=name, schedule=schedule, kernels={n[:80]: t / nstep for n, t, _ in per}))
    log(f"{tag} device time per step: " + ", ".join(f"{n} {t / nstep:.1f} us" for n, t in ours)
        + f"; other kernels {other / nstep:.1f} us (with the copies this profiled call makes of its arguments, "
        f"outside the loop)")
    carry5 = (s0 + 0, xc + 0, vc + 0, q + 0, k + 0)  # (the loop donates its carry)
    t_step = bench_state_loop(step_loop, (v, g, beta, q_src, k_src), (s0 + 0, xc, vc, q + 0, k + 0), nstep,
                              inner=1)[0]
    t_step5 = bench_state_loop(step_loop, (v, g, beta, q_src, k_src), carry5, nstep, inner=5)[0]
    row = dict(B=B, config=name, schedule=schedule, recurrent_us=t_rec * 1e6, replay_step_us=t_step * 1e6,
               ratio=t_step / t_rec, recurrent_us_x5=t_rec5 * 1e6, replay_step_us_x5=t_step5 * 1e6,
               ratio_x5=t_step5 / t_rec5)
    prime_note = ""
    if schedule == "default":
        prime = jax.jit(functools.partial(rp.chunk_replay_prime_pallas, config=cfg))
        row["prime_us"] = bench_jax(prime, q, k, v, g, beta, s0, lengths - 1, n=5) * 1e6
        prime_note = f"; prime (open chunks of 0..63 tokens) {row['prime_us']:.1f} us"
    RESULTS.setdefault("replay_step", []).append(row)
    log(f"{tag}: one loop per call: recurrent decode kernel {t_rec * 1e6:.1f} us; replay step {t_step * 1e6:.1f} us "
        f"= {t_step / t_rec:.2f}x ({_bar(t_step / t_rec)}); five loops per call (dispatch overlapped): "
        f"{t_rec5 * 1e6:.1f} / {t_step5 * 1e6:.1f} us = {t_step5 / t_rec5:.2f}x ({_bar(t_step5 / t_rec5)})"
        + prime_note)


# the replay step's configurations checked and timed. Run 39 timed the two-kernel step at bv 32 (the recurrence's V
# block then: 6.41x against 4.88x at B=64), run 40 the three-kernel step at bv_replay 32 and 16 (3.74x and 4.38x
# against the default's 3.30x), run 42 other warps ({"warps_replay": (8, 4, 4)}, (4, 4, 8) and 8: 4.11x, 4.99x,
# 5.48x against 3.78x); all with bits PASS. 2026-11-30 UTC 20:30-21:00 (the new token's row only): bv_replay 128
# (251.4 against 248.5 us at B=64), bv_replay 32 (227.3 against 225.9), kernel 2 with 4 warps (237.0 against 227.3
# with 8, now the default), kernel 2 inside kernel 1 (250.5 against 237.0), kernel 1's right-hand sides built where
# read (238.1 against 225.9), kernel 4 on two heads per program (33.3 against 18.4 us for that kernel); bits PASS for
# all. Run 62 (2026-11-30 UTC 23:07): kernel 3's two dots with S0 as one ({"replay_s0_dots": 1}, the default since:
# 212.6 against 222.1 us at B=64, 692.7 against 724.6 at B=256), with bv_replay 32 (209.1 / 743.4) and with prep
# and intra on 8 warps ({"warps_replay": (8, 8, 4)}: prep 99.5 against 64.6 us per step); run 64 (UTC 23:22) kernel
# 1 as four launches, one per block row, each with its branch's registers (an option then, removed: prep 72.6
# against 64.6 us per step at B=64, 203.0 against 219.8 at B=256); run 65 (UTC 23:25) kernel 3 loading the v_new
# cache before its S0 dot (an option then, removed: 66.7 against 60.3 us at B=64, 240.6 against 218.6 at B=256),
# kernel 3 on 8 warps ({"warps_replay": (4, 8, 8)}: 61.8 / 227.3) and both (67.6 / 250.3); run 66 (UTC 23:33)
# kernels 1 and 2 with their loads first (an option then, the default since: prep 62.7 against 64.5 us at B=64,
# 211.4 against 219.2 at B=256; intra 32.4 / 122.7 against 34.5 / 130.9); run 68 (UTC 23:44) kernel 2 loading k
# before q too (intra 41.7 / 165.8 us), kernel 3 loading S0 before its branch on n (59.7 / 218.1 against 60.3 /
# 218.6: noise), kernel 1's loads before its branches (prep 85.6 / 306.2 against 62.4 / 211.3); none kept, bits PASS
# for all. Run 69 (2026-12-01 UTC 01:30) kernel 4 on (V block, head, rows) grids, each program looking after
# `replay_state_rows` rows (1: 13.9 / 42.0 us per step at B=64 / 256; 4: 22.0 / 27.6; 16: 16.9 / 24.1), whence the
# "auto" default (1 on grids of <= 4096 programs, else 16; run 71: 14.0 / 24.1); bits PASS for all. Run 72 (UTC
# 01:53) kernels 1 and 2 as one launch on the prep's 4 warps, each program running one of them (an option then,
# removed: 104.3 against 63.6 + 32.5 us per step at B=64, 378.6 against 214.5 + 123.4 at B=256); run 73 (UTC
# 01:56) kernel 1's merged tiles in the order m = 0 .. i - 1 with w's and u's terms after each (an option then,
# removed: prep 63.3 / 212.0 against 63.6 / 214.8 us); bits PASS for both. Run 74 (UTC 02:02) kernel 2's q k^T
# row as column 0 of k q16^T ({"replay_qk_cols": True}: intra 27.3 / 104.6 against 32.2 / 121.3 us at B=64 / 256)
# and the same on 4 warps (18.2 / 64.4: the default since); bits PASS for both.
# Run 77 (2026-12-01 UTC 04:35) kernel 4 on V blocks of 16 (an option then, removed: 21.9 / 47.4 against 13.9 /
# 24.1 us at B=64 / 256), kernel 1 on 2 warps ({"warps_replay": (2, 4, 4)}: prep 76.6 / 210.3 against 62.6 /
# 211.4) and kernel 2 normalising q's block row [16, K] instead of 64 rows, its row t at column r of k q16^T (an
# option then, removed: intra 18.6 / 66.0 against 18.2 / 64.6); bits PASS for all three.
# Run 79 (UTC 04:48) kernel 1 computing row t's decays exp(gc_t - gc) and exp(gc_t) for kernel 2, which then
# loaded them instead of the gates (an option then, removed: intra 16.5 / 62.1 against 18.2 / 64.7 us at B=64 / 256,
# prep 63.7 / 214.9 against 62.4 / 211.8; the step 167.5 / 557.2 against 167.5 / 558.0 with five loops per call);
# bits PASS.
# Run 99 (2026-12-02 UTC 03:18): kernels 1 and 3 as one launch, grid (HV, B) ({"replay_fuse": "prep_out"}, and
# "prep_out_fold" with kernel 4's fold inside; branch experiment/fuse-prep-out): bits PASS, slower — 191.7 / 213.6
# against 169.2 us per step at B=64, 597.5 / 658.7 against 561.6 at B=256 (five loops per call).
# Run 103 (2026-12-02 UTC 05:51): kernel 4 loading kernel 1's kd ({"replay_kd": "prep"}, the default since; "fold"
# before): state 11.8 / 21.2 against 13.9 / 24.4 us per step at B=64 / 256, the step 166.3 / 554.9 against 167.4 /
# 557.1; bits PASS at K = V = 16 (where "fold" fails), 64 and 128.
# Add candidates here.
# Run 136 (2026-12-04 UTC 03:29, under XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT): kernels 1 and 3
# launched once per group of batch rows, in 2 / 4 / 8 groups (an option then, `replay_batch_groups`, removed; commit
# 2f10ef8), every kernel 1 first, so that the concurrent schedule could run one group's kernel 3 (S0 reads) beside the
# next group's kernel 1 (the latency chain): 171.2 / 176.8 / 224.8 against 154.9 us per step at B=64, 544.2 / 554.9 /
# 544.1 against 539.3 at B=256 (five loops per call). A group's kernel 1 takes more than its share (45.7 and 42.1 us for
# two halves against 71.3 for the batch at B=64): its time is waves of one program's latency, and the next group's
# programs fill the SMs before the previous group's kernel 3 gets them. Bits PASS for 2 and 4.
# Run 145 (2026-12-04 UTC 14:39, under the same flag): kernel 1 as four launches, one per block row, independent of
# each other (each read the x cache and wrote its own w, u and new tiles; a small kernel then merged the tiles into
# the cache), so that the schedule could run them side by side, each with its branch's registers (an option then,
# `replay_prep_launches`, removed; commit e0d245b): 162.2 against 153.2 us per step at B=64, 542.8 against 528.6 at
# B=256 (five loops per call). Side by side each launch slowed the others: 9.6 + 17.9 + 27.7 + 47.8 us of device time
# for block rows 0-3 at B=64 (one launch: 69.6), plus 5.6 for the merge. Bits PASS.
REPLAY_STEP_CONFIGS = {"default": None}
# timed only (their prefill arithmetic is not the default's, so the checks above do not apply): the gram tiles as
# one bf16 dot (`chunk_configs`' gram_bf16, the default before run 114; run 115: the step's kernel 1 63.0 against
# three bf16 dots' 75.8 us at B = 64, the default then; run 118: 62.9 against the fp16 dot's 62.8, the default since
# run 117). Run 111 timed the tiles in TF32 ({"p_kk": "tf32"}: 83.5 against 64.3 us for one bf16 dot), run 113 on
# the raw keys (69.4 against 64.0); run 120: gram_bf16 164.9 against the default's 164.5 us per step at B = 64.
# qk_tf32: kernel 2's row of q k^T in TF32, the default before run 122 (now one fp16 dot: `chunk._qk_precision`)
REPLAY_STEP_TIMING_ONLY = {"qk_tf32": dict(p_qk="tf32")}


SCAN_CONFIGS = {"bv16_w1": dict(bv=16, num_warps=1), "bv8_w1": dict(bv=8, num_warps=1),
                # the per-token arithmetic (default: the state in 4 row slices, FMAs): the previous one (one slice,
                # separate multiply and add; runs 12-16), FMAs alone, and other slice counts
                "bv16_w1_old": dict(bv=16, num_warps=1, kslices=1, fma=False),
                "bv16_w1_k1": dict(bv=16, num_warps=1, kslices=1), "bv16_w1_k2": dict(bv=16, num_warps=1, kslices=2),
                "bv16_w1_k8": dict(bv=16, num_warps=1, kslices=8), "bv8_w1_k8": dict(bv=8, num_warps=1, kslices=8),
                # run 18 also timed FMAs in the reductions only (an option since dropped): slower, 7.5 ms at B=1
                "bv16_w1_k4_nofma": dict(bv=16, num_warps=1, fma=False),
                "bv16_w2": dict(bv=16, num_warps=2), "bv32_w1": dict(bv=32, num_warps=1),
                "bv32_w2": dict(bv=32, num_warps=2), "bv64_w4": dict(bv=64, num_warps=4),
                # when the loads are issued (same arithmetic): ahead = tokens loaded ahead (run 14 also timed the
                # loads carried unconverted, an option since dropped)
                "bv16_w1_a1": dict(bv=16, num_warps=1, ahead=1), "bv16_w1_a4": dict(bv=16, num_warps=1, ahead=4),
                "bv8_w1_a4": dict(bv=8, num_warps=1, ahead=4)}
DECODE_KEYS = ("bv", "num_warps", "num_stages", "kslices", "fma")  # the decode kernel's configuration
# (run 7 also timed bv64_w1, bv64_w2 and bv128_w4: 24-204 ms at B=1 T=8192, dropped)


@section
def scan(small=False, names=None):
    """The token-by-token prefill kernel (`gated_delta.scan`, the recurrence with the decode arithmetic):
    1. bitwise, per launch config: a T-token call == T one-token decode-kernel calls with the same config (outputs
       and state); a split off the 64 grid == the unsplit call; in-call checkpoints (stride 50) == the split
       calls' states; a row alone == the same row in a batch with other lengths; accuracy against float64 (2e-3);
    2. prefill time on the issue's shapes per config, beside the chunked default in the same run;
    3. a one-token call (what the model's replay decode runs with gdn_prefill="recurrent") in a compiled loop of 20
       steps at B = 64 and 256, against the decode kernel (default config)."""
    from pallas_kernels.gated_delta.scan import fused_recurrent_gated_delta_rule_pallas as scan_fn
    B, T, HK, HV, K, V = (2, 70, 1, 2, 32, 32) if small else (3, 70, 16, 32, 128, 128)
    d = random_gdn_inputs(np.random.default_rng(21), B, T, HK, HV, K, V, np.float32, beta_kind="mixed")
    x = dev_inputs(d)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    lengths = jnp.asarray([T, 41, 9][:B], jnp.int32)
    unknown = sorted(set(names or ()) - set(SCAN_CONFIGS))
    if unknown:
        raise ValueError(f"unknown scan configs {unknown}; known: {sorted(SCAN_CONFIGS)}")
    configs = {n: SCAN_CONFIGS[n] for n in (names or SCAN_CONFIGS)}
    if small:
        configs = {"bv16_w1": SCAN_CONFIGS["bv16_w1"]}
    ro, rs = oracle_of(x)
    for name, cfg in configs.items():
        f = jax.jit(functools.partial(scan_fn, config=cfg), static_argnames=("checkpoint_stride",))
        o, s = f(*args, initial_state=x["s0"])
        st, outs = x["s0"], []
        step = jax.jit(functools.partial(recurrent_gated_delta_rule_pallas,
                                         config={k_: v_ for k_, v_ in cfg.items() if k_ in DECODE_KEYS}))
        for t in range(T):
            ot, st = step(*(a[:, t] for a in args), initial_state=st)
            outs.append(np.asarray(ot))
        ok_dec = np.array_equal(np.stack(outs, 1), np.asarray(o)) and np.array_equal(np.asarray(st), np.asarray(s))
        o1, s1 = f(*(a[:, :37] for a in args), initial_state=x["s0"])
        o2, s2 = f(*(a[:, 37:] for a in args), initial_state=s1)
        ok_split = np.array_equal(np.concatenate([o1, o2], 1), np.asarray(o)) and np.array_equal(s2, s)
        _, _, ck = f(*args, initial_state=x["s0"], checkpoint_stride=50)
        _, s50 = f(*(a[:, :50] for a in args), initial_state=x["s0"])
        ok_ck = np.array_equal(np.asarray(ck[:, 0]), np.asarray(s50))
        st, outs1 = x["s0"], []
        for t in range(T):  # one-token calls (the model's replay decode) == the T-token call
            ot, st = f(*(a[:, t:t + 1] for a in args), initial_state=st)
            outs1.append(np.asarray(ot))
        ok_one = np.array_equal(np.concatenate(outs1, 1), np.asarray(o)) and np.array_equal(st, s)
        o1a, s1a = f(*(a[:1, :1] for a in args), initial_state=x["s0"][:1])
        o1b, s1b = f(*(a[:, :1] for a in args), initial_state=x["s0"])
        ok_one = ok_one and np.array_equal(o1a[0], o1b[0]) and np.array_equal(s1a[0], s1b[0])
        ob, sb = f(*args, initial_state=x["s0"], lengths=lengths)
        oa, sa = f(*(a[1:2, :41] for a in args), initial_state=x["s0"][1:2])
        ok_row = (np.array_equal(np.asarray(ob)[1, :41], np.asarray(oa)[0]) and np.array_equal(sb[1], sa[0])
                  and not np.asarray(ob)[1, 41:].any())
        eo, es = rel_err(np.asarray(o, np.float32), ro), rel_err(np.asarray(s), rs)
        check(f"scan {name}: == {T} decode-kernel steps == {T} one-token calls, split at 37, checkpoint at 50, row "
              f"alone == in batch (bitwise); accuracy <= 2e-3",
              ok_dec and ok_one and ok_split and ok_ck and ok_row and eo <= 2e-3 and es <= 2e-3,
              f"decode={ok_dec} one-token={ok_one} split={ok_split} ckpt={ok_ck} row={ok_row} err out {eo:.1e} "
              f"state {es:.1e}")
    if small:
        return
    for shp in [(1, 8192, 16, 32), (8, 4096, 16, 32), (1, 32768, 16, 32)]:
        q, k, v, g, beta = make_prefill(*shp)
        row = dict(shape=shp)
        row["chunked_ms"] = bench_jax(jax.jit(chunk_gated_delta_rule_pallas), q, k, v, g, beta, n=5, reps=5) * 1e3
        for name, cfg in configs.items():
            row[f"{name}_ms"] = bench_jax(jax.jit(functools.partial(scan_fn, config=cfg)), q, k, v, g, beta,
                                          n=3, reps=3) * 1e3
        log(f"prefill {shp}: chunked {row['chunked_ms']:.2f} ms | " +
            " | ".join(f"{n} {row[n + '_ms']:.2f}" for n in configs))
        RESULTS.setdefault("scan_prefill", []).append(row)
        del q, k, v, g, beta
    nstep = 20
    for B in (64, 256):
        ks = jax.random.split(jax.random.PRNGKey(B), 6)
        q1 = jax.random.normal(ks[0], (B, 1, HK, K), jnp.bfloat16)
        v1 = jax.random.normal(ks[1], (B, 1, HV, V), jnp.bfloat16)
        g1 = -jax.nn.softplus(jax.random.normal(ks[2], (B, 1, HV)))
        b1 = jax.nn.sigmoid(jax.random.normal(ks[3], (B, 1, HV)))
        s0 = jax.random.normal(ks[4], (B, HV, K, V), jnp.float32) * 0.1
        state_bytes = 2 * B * HV * K * V * 4

        @functools.partial(jax.jit, donate_argnums=4)
        def rec_loop(q, k, v, g, s):
            return jax.lax.fori_loop(0, nstep, lambda i, s: recurrent_gated_delta_rule_pallas(
                q[:, 0], k[:, 0], v[:, 0], g[:, 0], b1[:, 0], initial_state=s)[1], s)

        t_rec, _ = bench_state_loop(rec_loop, (q1, q1, v1, g1), s0 + 0, nstep, inner=2)
        row = dict(B=B, recurrent_us=t_rec * 1e6, recurrent_TBps=state_bytes / t_rec / 1e12)
        log(f"B={B}: decode kernel {t_rec * 1e6:.1f} us/step ({state_bytes / t_rec / 1e12:.2f} TB/s)")
        for name, cfg in configs.items():
            @functools.partial(jax.jit, donate_argnums=4)
            def sc_loop(q, k, v, g, carry, cfg=cfg):
                def body(i, c):  # o kept live through a small sum (not a pass over the state)
                    o, s = scan_fn(q, k, v, g, b1, initial_state=c[0], config=cfg)
                    return s, c[1] + o[:, 0].astype(jnp.float32)
                return jax.lax.fori_loop(0, nstep, body, carry)

            t, _ = bench_state_loop(sc_loop, (q1, q1, v1, g1), (s0 + 0, jnp.zeros((B, HV, V), jnp.float32)),
                                    nstep, inner=2)
            row[f"scan_{name}_us"] = t * 1e6
            log(f"  one-token scan {name}: {t * 1e6:.1f} us/step = {t / t_rec:.2f}x the decode kernel "
                f"({state_bytes / t / 1e12:.2f} TB/s)")
        RESULTS.setdefault("scan_decode", []).append(row)


@section
def conv1d_timing():
    """XLA prefill conv (jaxgdn.layers.conv) against the copy roofline; one-token update: XLA vs the Pallas kernel."""
    from jaxgdn.layers.conv import causal_conv1d, causal_conv1d_step
    from pallas_kernels.conv1d import causal_conv1d_update_pallas
    C, KC = 8192, 4  # Qwen3.5-9B GDN conv channels: 2 * 16 * 128 + 32 * 128
    w = jax.random.normal(jax.random.PRNGKey(0), (KC, C), jnp.float32) * 0.3
    for B, T in [(1, 8192), (8, 4096)]:
        x = jax.random.normal(jax.random.PRNGKey(1), (B, T, C), jnp.bfloat16)
        s = jnp.zeros((B, KC - 1, C), jnp.bfloat16)
        f = jax.jit(lambda x, s, w: causal_conv1d(x, s, w))
        t = bench_jax(f, x, s, w, n=20)
        nbytes = 2 * B * T * C * 2
        RESULTS.setdefault("conv1d", []).append(dict(kind="prefill-xla", B=B, T=T, us=t * 1e6,
                                                     TBps=nbytes / t / 1e12))
        log(f"conv prefill XLA B={B} T={T}: {t * 1e6:.1f} us, {nbytes / t / 1e12:.2f} TB/s (x read + y written)")
    for B in (64, 256):
        x = jax.random.normal(jax.random.PRNGKey(2), (B, C), jnp.bfloat16)
        for name, fn in (("xla", lambda x, s, w: causal_conv1d_step(x, s, w)),
                         ("pallas", lambda x, s, w: causal_conv1d_update_pallas(x, s, w))):
            step = jax.jit(fn, donate_argnums=1)

            @functools.partial(jax.jit, donate_argnums=1)
            def loop(x, s, w, fn=fn):
                return jax.lax.fori_loop(0, 20, lambda i, s: fn(x, s, w)[1], s, unroll=True)
            # the state is the middle argument: bind x and w around it
            t_k, s = bench_state_loop(lambda s: loop(x, s, w), (), jnp.zeros((B, KC - 1, C), jnp.bfloat16), 20)
            t_c, _, _ = bench_state_calls(lambda s: step(x, s, w), (), s)
            RESULTS.setdefault("conv1d", []).append(dict(kind=f"update-{name}", B=B, kernel_us=t_k * 1e6,
                                                         call_us=t_c * 1e6))
            log(f"conv update {name:>6s} B={B}: in-loop {t_k * 1e6:.1f} us/step, per call {t_c * 1e6:.1f} us")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ap.add_argument("--only", default="", help="comma list of sections to run (overrides --skip)")
    ap.add_argument("--scan-configs", default="", help="comma list of SCAN_CONFIGS names (default: all)")
    ap.add_argument("--replay-dims", default="128,128", help="replay_step's checks at these K,V (';'-separated)")
    ap.add_argument("--replay-batches", default="64,256", help="replay_step_timing's batch sizes (comma list)")
    ap.add_argument("--replay-schedules", default=",".join(SCHEDULES),
                    help=f"replay_step_timing's compile schedules (comma list of {', '.join(SCHEDULES)})")
    ap.add_argument("--replay-configs", default="", help="comma list of the replay step's configs to check and time "
                    "(REPLAY_STEP_CONFIGS, REPLAY_STEP_TIMING_ONLY; default: all)")
    ap.add_argument("--configs", default="", help="comma list of prefill configs to sweep (default: all)")
    ap.add_argument("--no-default-bitwise", action="store_true",
                    help="run the bitwise checks only for the sweep's winner and --pick (the default's were run "
                         "before); none run when the default wins and nothing is picked")
    ap.add_argument("--pick", default="", help="time this prefill config in the prefill and breakdown sections "
                                                "instead of the sweep's pick (e.g. when accuracy was not run)")
    ap.add_argument("--decode-configs", default="", help="comma list of decode configs besides the default "
                                                          "(default: all)")
    ap.add_argument("--chunk-config", default="", help="JSON dict overriding the chunked prefill's DEFAULT_CONFIG "
                    "(`gated_delta/chunk.py`) for this run: every section's default is then that configuration")
    ap.add_argument("--prefill-shapes", default="", help="the prefill section's shapes B,T,HK,HV separated by ';' "
                    "(default: issue 3's four)")
    ap.add_argument("--chunk-checks", default=",".join(CHUNK_CHECKS), help="the bitwise section's chunk checks, a "
                    f"comma list of {', '.join(CHUNK_CHECKS)} (default: all; each compiles its own shapes)")
    args = ap.parse_args()
    chunk_checks = tuple(filter(None, args.chunk_checks.split(",")))
    if not chunk_checks or set(chunk_checks) - set(CHUNK_CHECKS):
        raise SystemExit(f"--chunk-checks: unknown {sorted(set(chunk_checks) - set(CHUNK_CHECKS))}; known: "
                         f"{', '.join(CHUNK_CHECKS)}")
    try:
        prefill_shapes = tuple(tuple(int(n) for n in s.split(",")) for s in args.prefill_shapes.split(";")
                               ) if args.prefill_shapes else PREFILL_TIMING_SHAPES
        if not all(len(s) == 4 and min(s) > 0 for s in prefill_shapes):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--prefill-shapes {args.prefill_shapes!r}: expected B,T,HK,HV groups of positive integers "
                         "separated by ';' (e.g. 1,32768,16,32;8,4096,16,32)")
    try:
        replay_dims = tuple(tuple(int(n) for n in kv.split(",")) for kv in args.replay_dims.split(";"))
        if not all(len(kv) == 2 and all(n >= 16 and n & (n - 1) == 0 for n in kv) for kv in replay_dims):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--replay-dims {args.replay_dims!r}: expected K,V pairs separated by ';', powers of two "
                         ">= 16 (e.g. 16,16;128,128)")
    replay_names = set(filter(None, args.replay_configs.split(","))) or None
    known = {*REPLAY_STEP_CONFIGS, *REPLAY_STEP_TIMING_ONLY}
    if replay_names and replay_names - known:  # (a typo must not silently time nothing)
        raise SystemExit(f"--replay-configs: unknown {sorted(replay_names - known)}; known: {sorted(known)}")
    schedules = [x for x in args.replay_schedules.split(",") if x]
    if not schedules or set(schedules) - set(SCHEDULES):
        raise SystemExit(f"--replay-schedules: unknown {sorted(set(schedules) - set(SCHEDULES))}; known: "
                         f"{list(SCHEDULES)}")
    skip = set(filter(None, args.skip.split(",")))
    every = {"accuracy", "bitwise", "equality", "decode_checks", "ceilings", "sweep", "prefill", "decode",
             "breakdown", "conv1d", "invariant", "replay", "reference", "scan", "replay_step", "replay_step_checks",
             "replay_step_timing"}
    named = skip | set(filter(None, args.only.split(",")))
    if named - every:  # a typo must not silently skip a section
        raise SystemExit(f"unknown sections {sorted(named - every)}; known: {sorted(every)}")
    if args.only:
        skip = every - set(args.only.split(","))
    if args.chunk_config:  # before anything is traced (the kernels read their defaults at trace time)
        from scripts.gpu_model_bench import apply_default_config
        RESULTS["chunk_config"] = apply_default_config(chunk_mod.DEFAULT_CONFIG, args.chunk_config, "--chunk-config")
    t_start = time.time()
    RESULTS["meta"] = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           argv=sys.argv, jax=jax.__version__, devices=[str(d) for d in jax.devices()],
                           device_kind=jax.devices()[0].device_kind, host=platform.node())
    try:
        import torch, triton
        RESULTS["meta"].update(torch=torch.__version__, triton=triton.__version__)
        import fla
        RESULTS["meta"]["fla"] = getattr(fla, "__version__", "?")
        RESULTS["meta"]["FLA_FLASH_QLA"] = os.environ.get("FLA_FLASH_QLA")
    except Exception as e:
        log(f"torch/triton/fla import: {e}")
    try:
        import flash_qla
        RESULTS["meta"]["flash_qla"] = getattr(flash_qla, "__version__", "?")
    except Exception as e:
        log(f"flash_qla not importable (its column is skipped): {type(e).__name__}: {e}")
    log(json.dumps(RESULTS["meta"]))

    # Earlier rounds' candidates keep their meaning: measured against the one-kernel prep with the block-Neumann
    # inverse (`old`) or against the two-kernel prep (`old2`, the default up to run 23); w and kd in fp32 then
    # (`f32`: up to run 24); and the prep's dot precisions before run 34 (`pre34`: gram tiles TF32, merge TF32x3).
    pre34 = lambda **kw: dict(dict(p_kk="tf32", p_inv="tf32x3"), **kw)  # noqa: E731
    f32 = lambda **kw: pre34(**dict(dict(wk_dtype="float32"), **kw))  # noqa: E731
    old = lambda **kw: f32(**dict(dict(prep_kernels=1, inv="block16"), **kw))  # noqa: E731
    old2 = lambda **kw: f32(**dict(dict(prep_kernels=2, inv="block16"), **kw))  # noqa: E731
    chunk_configs = {  # "default" is DEFAULT_CONFIG (split design: one prep kernel with the tiled inverse, recurrence,
        # output)
        "default": None,
        "block16": old(),
        "fused": old(design="fused"),
        "fused_bv32_s2": old(design="fused", bv=32, stages_state=2),
        "bv32": old(bv=32),
        "bv16": old(bv=16),
        "s2": old(stages_state=2),
        "bv32_s2": old(bv=32, stages_state=2),
        "bv16_s2": old(bv=16, stages_state=2),
        "bv32_w8": old(bv=32, warps_state=8),
        "doubling": old(inv="doubling"),
        "state_x3": old(p_ws="tf32x3", p_kv="tf32x3"),
        "prep2": old2(),
        "prep2_w2": old2(warps_prep=2),
        "prep2_bv32_s2": old2(bv=32, stages_state=2),
        # run 24 (the tiled inverse, w and kd in fp32): tiled = two prep kernels (X through memory), tiled1 = one
        "tiled": f32(prep_kernels=2),
        "tiled_tf32": f32(prep_kernels=2, p_inv="tf32"),
        "tiled_w2": f32(prep_kernels=2, warps_prep=2),
        "tiled1": f32(),
        "tiled1_tf32": f32(p_inv="tf32"),
        "tiled1_w8": f32(warps_prep=8),
        # run 25 candidates, against the default
        "wk32": dict(wk_dtype="float32"),
        "bv128_w8": dict(bv=128, warps_state=8),
        "out_w8": dict(warps_out=8),
        "out_bv64": dict(bv_out=64),
        "out_bv64_w2": dict(bv_out=64, warps_out=2),
        # runs 27-31 (2026-11-30; BENCHMARKS.md) timed merge (the loop-free diagonal tiles, removed in 075cc1f) and
        # fused_t*, out_c*/prep_c*/loops_c4_s2, heads2*, lean* at commits 8196e24-629a62b: all slower than the
        # default, their kernel options removed (27e4073).
        # run 32: h and v_new written transposed for the output kernel's TF32 dots (states_t, now the default); the
        # layout before it
        "states_v": dict(states_t=False),
        # only one of the two transposed (the recurrence's cost on small grids: run 32, 14-15% at B=1); run 34: the
        # same bits, slower than both transposed (h_t 5.03, v_new_t 5.42 against 4.79 ms over the two shapes)
        "h_t": dict(states_t="h"),
        "v_new_t": dict(states_t="v_new"),
        # run 34: the prep's gram tiles in bf16 alone (4.39 ms) and with the inverse's merge in TF32 (4.27 ms, the
        # default since); "pre34" is the default before it (4.79 ms)
        "kk_bf16": pre34(p_kk="bf16"),
        "pre34": pre34(),
        # 2026-12-02 (runs 111-113): the gram tiles k k^T more accurate than the default's bf16 dots on the
        # L2-normalised keys (which put random keys with g ~ 0, beta = 1 at the output's 2e-3 bar): as three bf16
        # dots of the keys' hi / lo halves (run 113: +8-9%), and in TF32 (run 111); run 113 also timed them on the raw
        # bf16 keys, scaled by 1 / ||k|| after the dot (+17-23%, branch experiment/gram-raw)
        # (runs 114-116: bf16x3 the default; since run 117 the default is one fp16 dot on the normalised keys, as
        # accurate and as fast as gram_bf16, the one bf16 dot before run 114)
        "gram_bf16x3": dict(p_kk="bf16x3"),
        "gram_bf16": dict(p_kk="bf16"),
        "kk_tf32": dict(p_kk="tf32"),
        # 2026-12-03: the output kernel's q k^T (and the replay step's row of it) as one fp16 dot, both operands
        # L2-normalised as the gram tiles' are (then times the scale K^-0.5 on q): run 121, 4.008 against 4.097 ms
        # over the sweep's shapes, as accurate; the default since run 122 (`chunk._qk_precision`). qk_tf32: the dot
        # before
        "qk_tf32": dict(p_qk="tf32"),
        # run 33 also timed rec_t (the recurrence on the transposed state, u / kd written transposed; commit 629e150):
        # other bits than the default, mma.sync dots at bv 32, not faster — removed
        # run 78 (2026-12-01 UTC 04:41) timed kd_t (an option then, removed): kd stored transposed by the prep ([K, C]
        # per chunk), so the recurrence's kd^T v_new read its first operand from shared memory as loaded, without the
        # transposed copy through registers — the same bits (both equality checks), slower: the recurrence 0.532 /
        # 1.245 / 2.077 against 0.497 / 1.146 / 1.885 ms at (1, 8192) / (8, 4096) / (1, 32768)
        # run 82 (2026-12-01 UTC 08:24) timed the recurrence's gc loaded a chunk ahead (`gc_ahead`, an option then,
        # now the code), kd^T stored in fp32 by the prep and copied asynchronously into shared memory by the
        # recurrence as its dot reads it (`kd_t`, an option then, removed: no faster), and both with 3 load stages and
        # V blocks of 16 on small grids; all with the default's bits. Since run 83, the default takes V blocks of 16
        # with 3 stages on grids of at most `tiny_grid` programs with them (B=1 at HV=32); "no_tiny" is the launch
        # before it (V blocks of 32, 2 stages)
        "no_tiny": dict(tiny_grid=0),
        # 2026-12-02 (run 93 on): the state update exp(gc_last) S + kd^T v_new rounded as `state_update` says — the
        # default "mul_add" (a multiply no compiler contracts, then the add), one FMA, or the compiler's choice
        # (the code before)
        "state_fma": dict(state_update="fma"),
        "state_auto": dict(state_update="auto"),
        # 2026-12-03 (run 130 on): the Mosaic GPU recurrence warp-specialised (a second warpgroup converts w and kd;
        # "_u": and transposes u)
        "mgpu_ws": dict(recurrence_ws=True),
        "mgpu_ws_u": dict(recurrence_ws="u"),
        # 2026-12-03 (run 132 on): the output kernel on Mosaic GPU (`output_mgpu.py`) in its default order (qg S_c
        # the accumulator of Aqk v_new), and in the two others ("_add": the dots' results added; "_vn": v_new's
        # term the accumulator)
        # run 159 (2026-12-05) timed stores_tf32 (the Mosaic GPU recurrence storing h and v_new rounded to TF32, an
        # option then): the default's bits, 0.99-1.03x its time — removed. Run 163: "out_fused" (the output computed
        # inside the recurrence from qg and Aqk in memory): the default's bits, 0.97-1.07x its time — removed on
        # 2026-12-06 (form B below computes them inside)
        # 2026-12-06 (run 168 on): qg and Aqk computed inside the recurrence too, by its producer warpgroup
        # (docs/speed_gaps.md, item 0's form B)
        "out_fused_intra": dict(output="fused_intra"),
        "mgpu_out": dict(output="mosaic"),
        "mgpu_out_add": dict(output="mosaic", output_order="add"),
        "mgpu_out_vn": dict(output="mosaic", output_order="vn_acc"),
    }
    if args.quick:
        chunk_configs = {"default": None}
    if args.configs:
        unknown = set(args.configs.split(",")) - set(chunk_configs)
        if unknown:
            raise SystemExit(f"unknown prefill configs {sorted(unknown)}; known: {sorted(chunk_configs)}")
        chunk_configs = {n: chunk_configs[n] for n in ["default"] + args.configs.split(",")}
    if args.pick and args.pick not in chunk_configs:
        raise SystemExit(f"--pick {args.pick!r} is not among the configs: {sorted(chunk_configs)}")
    decode_configs = {
        "old_arith": dict(kslices=1, fma=False), "k1_fma": dict(kslices=1), "k8": dict(kslices=8),
        "bv32_w4": dict(bv=32, num_warps=4), "bv16_w2": dict(bv=16, num_warps=2), "bv32_w2": dict(bv=32, num_warps=2),
        "bv64_w4": dict(bv=64, num_warps=4), "bv64_w8": dict(bv=64, num_warps=8), "bv128_w8": dict(bv=128, num_warps=8),
        "bv32_w8": dict(bv=32, num_warps=8), "bv64_w2": dict(bv=64, num_warps=2),
        "bv128_w4": dict(bv=128, num_warps=4), "bv64_w1": dict(bv=64, num_warps=1), "bv32_w1": dict(bv=32, num_warps=1),
    }
    if args.decode_configs:
        unknown = set(args.decode_configs.split(",")) - set(decode_configs)
        if unknown:
            raise SystemExit(f"unknown decode configs {sorted(unknown)}; known: {sorted(decode_configs)}")
        decode_configs = {n: decode_configs[n] for n in args.decode_configs.split(",")}
    decode_configs = {"default": None, **decode_configs}
    acc = None
    if "accuracy" not in skip:
        acc = chunk_accuracy(chunk_configs)
    if "bitwise" not in skip and not args.no_default_bitwise:
        chunk_bitwise(checks=chunk_checks)
    if "equality" not in skip and len(chunk_configs) > 1:
        config_equality(chunk_configs)
    if "decode_checks" not in skip:
        decode_checks()
    if "ceilings" not in skip:
        ceilings()
    best = "default"
    if "sweep" not in skip and len(chunk_configs) > 1:
        best = config_sweep(chunk_configs, acc) or "default"
        if best != "default" and "bitwise" not in skip:
            chunk_bitwise(chunk_configs[best], tag=best, checks=chunk_checks)
    if args.pick:
        if args.pick != best and "bitwise" not in skip:
            chunk_bitwise(chunk_configs[args.pick], tag=args.pick, checks=chunk_checks)
        best = args.pick
    if "prefill" not in skip:
        prefill_timing(best, chunk_configs[best], with_reference="reference" not in skip, shapes=prefill_shapes)
    if "decode" not in skip:
        decode_timing(decode_configs)
    if "breakdown" not in skip:
        prefill_breakdown(chunk_configs[best])
    if "conv1d" not in skip:
        conv1d_timing()
    if "invariant" not in skip:
        invariant_kernels()
    if "replay_step" not in skip or "replay_step_checks" not in skip:  # its checks and timing
        # ("replay_step_checks": the checks alone, "replay_step_timing": the timing alone)
        replay_step_checks(replay_dims, replay_names)
    if "replay_step" not in skip or "replay_step_timing" not in skip:
        replay_step_timing(tuple(int(b) for b in args.replay_batches.split(",")), replay_names, tuple(schedules))
    if "replay" not in skip:
        replay_timing()
    if "scan" not in skip:
        scan(names=[n for n in args.scan_configs.split(",") if n] or None)
    RESULTS["fails"] = FAILS
    RESULTS["wall_s"] = time.time() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1, default=str)
    log(f"\nFAILS: {FAILS}\nwall {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
