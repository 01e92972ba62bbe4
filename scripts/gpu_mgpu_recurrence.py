"""The chunked prefill's state recurrence as a Mosaic GPU kernel (`pallas_kernels/gated_delta/recurrence_mgpu.py`)
against today's Pallas-Triton one (`chunk._state_split_kernel`), on the H200: bitwise on the same inputs, then timed.

Run on the GPU machine from the repo root (nothing to install):
  PYTHONPATH=. python3 scripts/gpu_mgpu_recurrence.py [--shapes B,T,HK,HV;...] [--no-timing] [--out DIR]
For each shape it runs the prefill's prep kernel once (fresh random bf16 q, k, v, realistic gates, a random initial
state, rows of different lengths on the check shapes), feeds its w, u, kd, gc to both recurrences and prints, for h
(the state at every chunk start), v_new and the final state, how many elements differ and the largest difference
relative to the largest element, for each form of the Mosaic GPU kernel (`FORMS`: on one warpgroup; warp-specialised;
warp-specialised with u transposed by the producer, the default). Then it times, on the sweep's shapes: the
Triton recurrence (the prefill stopped after the recurrence, less the prefill stopped after the prep: `stop_after`)
and each Mosaic GPU form on the prep's outputs (with the XLA transpose of their final state).
Exit status 0 whatever it finds (a measurement); results.json into --out.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import signal
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.recurrence_mgpu import state_recurrence_mgpu
from scripts.gpu_kernels import bench_jax

CHECK_SHAPES = [(2, 300, 2, 4), (3, 1000, 16, 32), (1, 8192, 16, 32)]
TIMING_SHAPES = [(1, 8192, 16, 32), (8, 4096, 16, 32), (1, 32768, 16, 32), (2, 8192, 16, 32)]


def log(*a):
    print(*a, flush=True)


def inputs(B, T, HK, HV, K=128, V=128, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (B, T, HK, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HK, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HV, V), jnp.bfloat16)
    A = jax.random.uniform(ks[3], (HV,), minval=1.0, maxval=16.0)
    g = (-A * jax.nn.softplus(jax.random.normal(ks[4], (B, T, HV)) - 2.0) / 4.0).astype(jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(ks[5], (B, T, HV))).astype(jnp.float32)
    s0 = jax.random.normal(ks[6], (B, HV, K, V), jnp.float32) * 0.1
    lengths = jnp.asarray([T - (37 * i) % max(T // 2, 1) for i in range(B)], jnp.int32)
    return q, k, v, g, beta, s0, lengths


def prefill(stop, q, k, v, g, beta, s0, lengths):
    """The prefill stopped after the prep or after the recurrence, with the Triton recurrence (the default on a
    Hopper GPU is the Mosaic GPU one)."""
    return chunk_gated_delta_rule_pallas(q, k, v, g, beta, initial_state=s0, lengths=lengths,
                                         config=dict(stop_after=stop, recurrence="triton"))


FORMS = {"one warpgroup": False, "warp-specialised": True, "ws, u by producer": "u"}  # (warp_specialised=...)


def jitted():
    """(prep, Triton recurrence, {form: Mosaic GPU recurrence}), each under jax.jit."""
    return (jax.jit(functools.partial(prefill, "prep")), jax.jit(functools.partial(prefill, "state")),
            {name: jax.jit(functools.partial(state_recurrence_mgpu, warp_specialised=ws))
             for name, ws in FORMS.items()})


def compare(name, a, b):
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return dict(name=name, shape_a=a.shape, shape_b=b.shape, equal=False)
    diff = a != b
    scale = float(np.max(np.abs(b))) or 1.0
    return dict(name=name, equal=bool(not diff.any()), differ=int(diff.sum()), of=int(diff.size),
                max_rel=float(np.max(np.abs(a.astype(np.float64) - b)) / scale))


def checks(shapes, results):
    prep, state, forms = jitted()
    for shp in shapes:
        q, k, v, g, beta, s0, lengths = inputs(*shp)
        w, u, kd, gc = prep(q, k, v, g, beta, s0, lengths)
        h_t, vn_t, final_t = state(q, k, v, g, beta, s0, lengths)
        for form, mgpu in forms.items():
            out = attempt(results, shp, ("form", form), mgpu, w, u, kd, gc, s0)
            if out is None:
                continue
            h_m, vn_m, final_m = out
            rows = [compare(n, a, b) for n, a, b in (("h", h_m, h_t), ("v_new", vn_m, vn_t),
                                                    ("final", final_m, final_t))]
            again = mgpu(w, u, kd, gc, s0)
            rows.append(dict(name="mgpu twice", equal=all(np.array_equal(np.asarray(x), np.asarray(y))
                                                           for x, y in zip(again, (h_m, vn_m, final_m)))))
            for r in rows:
                log(f"{str(shp):>22s} {form:>16s} {r['name']:>10s} {'EQUAL' if r['equal'] else 'DIFFER'} "
                    + (f"{r['differ']} of {r['of']}, max |diff| / max |x| {r['max_rel']:.2e}" if "differ" in r
                       else ""))
            results["checks"].append(dict(shape=shp, form=form, rows=rows))


def timing(shapes, results):
    """Medians of 7 x 10 back-to-back calls (`gpu_kernels.bench_jax`)."""
    prep, state, forms = jitted()
    bench = functools.partial(bench_jax, n=10)
    for shp in shapes:
        q, k, v, g, beta, s0, _ = inputs(*shp)
        lengths = jnp.full((shp[0],), shp[1], jnp.int32)
        args = (q, k, v, g, beta, s0, lengths)
        t_prep = bench(prep, *args)
        t_state = bench(state, *args)
        w, u, kd, gc = prep(*args)
        row = dict(shape=shp, prep_ms=t_prep * 1e3, triton_recurrence_ms=(t_state - t_prep) * 1e3,
                   mgpu_recurrence_ms={})
        for form, mgpu in forms.items():
            try:
                row["mgpu_recurrence_ms"][form] = bench(mgpu, w, u, kd, gc, s0) * 1e3
            except Exception as e:
                log(f"{str(shp):>22s} {form}: FAILED: {type(e).__name__}: {str(e)[:200]}")
        log(f"{str(shp):>22s} prep {row['prep_ms']:.3f} ms | recurrence: Triton {row['triton_recurrence_ms']:.3f}, "
            + ", ".join(f"Mosaic GPU {form} {ms:.3f} ms ({ms / row['triton_recurrence_ms']:.2f}x)"
                        for form, ms in row["mgpu_recurrence_ms"].items()))
        results["timing"].append(row)
        del q, k, v, g, beta, s0, w, u, kd, gc


def attempt(results, shp, label, fn, *args):
    """fn(*args), or None when it fails: a kernel form that does not compile is logged and recorded in
    results["checks"] under `label` (key, name), and the caller goes on with the others."""
    try:
        return fn(*args)
    except Exception as e:
        log(f"{str(shp):>22s} {label[1]:>16s} FAILED: {type(e).__name__}: {str(e)[:600]}")
        results["checks"].append({"shape": shp, label[0]: label[1], "error": f"{type(e).__name__}: {e}"})
        return None


def script_args(extra=None):
    """The Mosaic GPU scripts' command line (this one and `gpu_mgpu_output.py`): --out, --shapes (B,T,HK,HV groups
    separated by ';', default CHECK_SHAPES) and --no-timing, plus what `extra(parser)` adds. Returns (args, shapes);
    a malformed --shapes stops the run before any device work."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--shapes", default="", help="check shapes B,T,HK,HV separated by ';' (default: a fixed set)")
    ap.add_argument("--no-timing", action="store_true")
    if extra:
        extra(ap)
    args = ap.parse_args()
    try:
        shapes = ([tuple(int(n) for n in s.split(",")) for s in args.shapes.split(";")] if args.shapes
                  else CHECK_SHAPES)
        if not all(len(shp) == 4 and min(shp) > 0 for shp in shapes):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--shapes {args.shapes!r}: expected B,T,HK,HV groups of positive integers separated by ';'")
    return args, shapes


def run_and_save(out: str, body) -> None:
    """`body(results)` with results = {meta, checks: [], timing: []}, then results.json in `out` (also when body
    raises, or the process gets SIGTERM, as `timeout` sends: what ran is kept)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    results = dict(meta=dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                             jax=jax.__version__, device=jax.devices()[0].device_kind), checks=[], timing=[])
    log(json.dumps(results["meta"]))
    t0 = time.time()
    try:
        body(results)
    finally:
        results["seconds"] = time.time() - t0
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "results.json"), "w") as fh:
            json.dump(results, fh, indent=1, default=str)


def main():
    args, shapes = script_args()

    def body(results):
        checks(shapes, results)
        if not args.no_timing:
            timing(TIMING_SHAPES, results)

    run_and_save(args.out, body)


if __name__ == "__main__":
    main()
