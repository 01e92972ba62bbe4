"""The speculative segmented recurrence (`recurrence_mgpu.segmented_recurrence`, chunk config `recurrence_segments`)
on the H200: its bitwise claim, then its time beside fla-core 0.6.0.

Run on the GPU machine from the repo root (fla-core from a carried wheel, as `scripts/gpu_kernels.py` says):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-0.6.0-py3-none-any.whl
  PYTHONPATH=.:/tmp/site python3 scripts/gpu_segments.py --out $OUT [--skip checks,hlo,timing]

checks: on shapes whose grid leaves SMs idle, three kinds of gates (`GATES`: the sweep's, which forget within a
  chunk or two; "slow", a model-like slow decay; "keep", which never forget within a segment), P = 2 and 4
  segments, windows 1 and 4, a random initial state and rows of different lengths: the recurrence alone
  (h, v_new, final state) and the whole prefill (outputs, final state, in-call checkpoints) against one segment,
  bit for bit; each line says which boundary checks passed.
hlo: the compiled segmented prefill holds no copy of h or v_new (the window and rest launches write in place).
timing: the prefill at issue 3's four shapes, today's default (segments "auto") against one segment, and fla in the
  same process; the recurrence alone with and without segments; and at (1, 32768) the gates that never pass a check
  (the worst case: what the segments cost when they cannot help).
Exit status 1 if a check fails; results.json into --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("FLA_FLASH_QLA", "0")  # fla's own Triton kernels (scripts/gpu_kernels.py says why)

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.recurrence_mgpu import segmented_recurrence
from scripts.gpu_kernels import bench_jax, do_bench_ms, fla_prefill_fn

CHECK_SHAPES = [(1, 8192, 16, 32), (2, 4096, 4, 8), (1, 4224, 16, 16)]  # (B, T, HK, HV); 66 chunks at the last
BAR_SHAPES = [(1, 8192, 32, 32), (1, 8192, 16, 32), (8, 4096, 16, 32), (1, 32768, 16, 32)]
GATES = ("sweep", "slow", "keep")
RESULTS: dict = {"checks": [], "hlo": {}, "timing": [], "recurrence": [], "worst": []}
FAILS: list = []


def log(*a):
    print(*a, flush=True)


def inputs(B, T, HK, HV, gates="sweep", K=128, V=128, seed=0):
    """bf16 q, k, v; gates: "sweep" (`gpu_kernels.make_prefill`'s: g = -A softplus(n - 2) / 4, A in [1, 16]),
    "slow" (A in [0.02, 0.2]: a chunk's decay 0.6-0.95, beta a sigmoid) or "keep" (g = -1e-4, beta = 0.01); a random
    initial state; row lengths T, T - 100, ..."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (B, T, HK, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HK, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HV, V), jnp.bfloat16)
    lo, hi = (0.02, 0.2) if gates == "slow" else (1.0, 16.0)
    A = jax.random.uniform(ks[3], (HV,), minval=lo, maxval=hi)
    g = (-A * jax.nn.softplus(jax.random.normal(ks[4], (B, T, HV)) - 2.0) / 4.0).astype(jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, HV))).astype(jnp.bfloat16).astype(jnp.float32)
    if gates == "keep":
        g, beta = jnp.full_like(g, -1e-4), jnp.full_like(beta, 0.01)
    s0 = jax.random.normal(ks[6], (B, HV, K, V), jnp.float32) * 0.1
    lengths = jnp.asarray([T - 100 * i for i in range(B)], jnp.int32)
    return q, k, v, g, beta, s0, lengths


@functools.lru_cache(maxsize=None)
def prefill_fn(segments, window=4, stop=None, checkpoints=True):
    config = dict(recurrence_segments=segments, segment_window=window)
    if stop:
        config["stop_after"] = stop
    kw = dict(checkpoint_stride=1024) if checkpoints else {}
    return jax.jit(lambda q, k, v, g, beta, s0, lengths: chunk_gated_delta_rule_pallas(
        q, k, v, g, beta, initial_state=s0, lengths=lengths, config=config, **kw))


@functools.lru_cache(maxsize=None)
def recurrence_fn(segments, window):
    return jax.jit(functools.partial(segmented_recurrence, segments=segments, window=window))


def bitwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def checks():
    for shp in CHECK_SHAPES:
        for gates in GATES:
            x = inputs(*shp, gates=gates)
            prep = prefill_fn(1, stop="prep", checkpoints=False)(*x)
            nt = prep[0].shape[2] // 64
            want_rec = recurrence_fn(1, 1)(*prep, x[5])
            want = prefill_fn(1)(*x)
            for P, win in ((2, 1), (2, 4), (4, 1)):
                if nt % P:
                    continue
                *rec, passed = recurrence_fn(P, win)(*prep, x[5])
                ok_rec = all(bitwise(a, b) for a, b in zip(rec, want_rec[:3]))
                got = prefill_fn(P, win)(*x)
                ok_pre = all(bitwise(a, b) for a, b in zip(got, want))
                row = dict(shape=shp, gates=gates, segments=P, window=win, passed=np.asarray(passed).tolist(),
                           recurrence_bitwise=ok_rec, prefill_bitwise=ok_pre)
                RESULTS["checks"].append(row)
                ok = ok_rec and ok_pre
                if not ok:
                    FAILS.append(row)
                log(f"[{'PASS' if ok else 'FAIL'}] {shp} gates={gates} segments={P} window={win}: recurrence "
                    f"{'==' if ok_rec else '!='}, prefill {'==' if ok_pre else '!='} one segment (bitwise); boundary "
                    f"checks passed: {np.asarray(passed).tolist()}")


def hlo():
    """Copies in the compiled segmented prefill whose shape is h's or v_new's (the in-place launches must not
    copy them)."""
    B, T, HK, HV = 1, 32768, 16, 32
    x = inputs(B, T, HK, HV)
    text = prefill_fn(2, checkpoints=False).lower(*x).compile().as_text()
    nt = T // 64
    shapes = [f"f32[{B},{HV},{nt},128,128]", f"f32[{B},{HV},128,{T}]"]
    copies = [ln.strip()[:160] for ln in text.splitlines() if re.search(r"= f32\[[^]]*\][^ ]* copy\(", ln)
              and any(s in ln for s in shapes)]
    RESULTS["hlo"] = dict(copies_of_h_or_v_new=copies)
    ok = not copies
    if not ok:
        FAILS.append("hlo")
    log(f"[{'PASS' if ok else 'FAIL'}] compiled segmented prefill at {(B, T, HK, HV)}: {len(copies)} copies of h or "
        f"v_new {copies[:2]}")


def timing(with_fla: bool):
    log(f"{'shape (B,T,HK,HV)':>22s} {'auto ms':>9s} {'P=1 ms':>9s} {'fla ms':>9s} {'auto/fla':>9s} {'P=1/fla':>9s}")
    for shp in BAR_SHAPES:
        q, k, v, g, beta, s0, _ = inputs(*shp)
        s0 = jnp.zeros_like(s0)  # (fla's timing has no initial state; ours gets a zero one)
        lengths = jnp.full((shp[0],), shp[1], jnp.int32)
        args = (q, k, v, g, beta, s0, lengths)
        t_auto = bench_jax(prefill_fn("auto", checkpoints=False), *args) * 1e3
        t_one = bench_jax(prefill_fn(1, checkpoints=False), *args) * 1e3
        t_fla = float("nan")
        if with_fla:
            try:
                t_fla = do_bench_ms(fla_prefill_fn(q, k, v, g, beta))
            except Exception as e:  # noqa: BLE001 (a measurement: report and go on)
                log(f"fla failed: {type(e).__name__}: {str(e)[:200]}")
        row = dict(shape=shp, auto_ms=t_auto, one_segment_ms=t_one, fla_ms=t_fla)
        RESULTS["timing"].append(row)
        log(f"{str(shp):>22s} {t_auto:9.3f} {t_one:9.3f} {t_fla:9.3f} {t_auto / t_fla:9.2f} {t_one / t_fla:9.2f}")
    log("\nthe recurrence alone (on the prep's outputs, sweep gates):")
    for shp in [(1, 8192, 16, 32), (1, 32768, 16, 32)]:
        x = inputs(*shp)
        prep = prefill_fn(1, stop="prep", checkpoints=False)(*x)
        times = {f"P={P} window={w}": bench_jax(recurrence_fn(P, w), *prep, x[5]) * 1e3
                 for P, w in ((1, 1), (2, 1), (2, 4), (2, 8))}
        RESULTS["recurrence"].append(dict(shape=shp, **times))
        log(f"  {shp}: " + ", ".join(f"{k} {t:.3f} ms" for k, t in times.items()))
    log("\nthe worst case, gates that never pass a check ('keep'), (1, 32768, 16, 32):")
    x = inputs(1, 32768, 16, 32, gates="keep")
    prep = prefill_fn(1, stop="prep", checkpoints=False)(*x)
    row = dict(prefill_auto_ms=bench_jax(prefill_fn("auto", checkpoints=False), *x) * 1e3,
               prefill_one_ms=bench_jax(prefill_fn(1, checkpoints=False), *x) * 1e3,
               recurrence_P2_ms=bench_jax(recurrence_fn(2, 4), *prep, x[5]) * 1e3,
               recurrence_P1_ms=bench_jax(recurrence_fn(1, 1), *prep, x[5]) * 1e3)
    RESULTS["worst"].append(row)
    log("  " + ", ".join(f"{k} {t:.3f}" for k, t in row.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip", default="", help="comma-separated: checks, hlo, timing")
    ap.add_argument("--no-fla", action="store_true")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if skip - {"checks", "hlo", "timing"}:
        ap.error(f"--skip: unknown sections {sorted(skip - {'checks', 'hlo', 'timing'})}")
    log(jax.devices()[0].device_kind, jax.__version__, datetime.datetime.now(datetime.timezone.utc).isoformat())
    for name, fn in (("checks", checks), ("hlo", hlo), ("timing", lambda: timing(not args.no_fla))):
        if name in skip:
            continue
        log(f"\n=== {name} ===")
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (report, save what there is)
            FAILS.append(f"{name}: {type(e).__name__}: {e}")
            log(f"[FAIL] {name}: {type(e).__name__}: {str(e)[:2000]}")
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(dict(RESULTS, fails=[str(x) for x in FAILS]), f, indent=1, default=str)
    log(f"\n{len(FAILS)} failures")
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
