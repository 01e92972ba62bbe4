"""The chunked prefill's output kernel as a Mosaic GPU kernel (`pallas_kernels/gated_delta/output_mgpu.py`, config
`output="mosaic"`) against the Pallas-Triton one (`chunk._out_kernel`, `output="triton"`), on the H200: bitwise on
the same inputs, then timed.

Run on the GPU machine from the repo root (nothing to install):
  PYTHONPATH=. python3 scripts/gpu_mgpu_output.py [--shapes B,T,HK,HV;...] [--orders add,h_acc,...] [--no-timing]
      [--out DIR]
For each check shape (fresh random bf16 q, k, v, realistic gates, a random initial state, rows of different
lengths) it runs the whole prefill with the Triton output kernel and with the Mosaic GPU one in each of its orders
of adding its two dots (`output_mgpu.ORDERS`), with in-call checkpoints every 128 tokens, and prints how many
elements of the output differ and the largest difference relative to the largest element (the prep and the
recurrence are the same kernels in every call, so the final states and checkpoints must be equal too). Then it
times, on the sweep's shapes: the prefill stopped after the recurrence (`stop_after="state"`), the whole prefill with
each output kernel, and their differences (each output kernel alone, with `key_norms` for the Mosaic GPU one).
Exit status 0 whatever it finds (a measurement); results.json into --out.
"""

from __future__ import annotations

import functools
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.output_mgpu import ORDERS
from scripts.gpu_kernels import bench_jax
from scripts.gpu_mgpu_recurrence import (  # the recurrence script's shapes, inputs, comparison and command line
    TIMING_SHAPES, attempt, compare, inputs, log, run_and_save, script_args)


def prefill(config, q, k, v, g, beta, s0, lengths, checkpoint_stride=None):
    return chunk_gated_delta_rule_pallas(q, k, v, g, beta, initial_state=s0, lengths=lengths, config=config,
                                         checkpoint_stride=checkpoint_stride)


CONFIGS = {"triton": dict(output="triton"), **{f"mosaic {o}": dict(output="mosaic", output_order=o) for o in ORDERS}}


def checks(shapes, results):
    fns = {n: jax.jit(functools.partial(prefill, c, checkpoint_stride=128)) for n, c in CONFIGS.items()}
    for shp in shapes:
        args = inputs(*shp)
        o_t, final_t, ck_t = fns["triton"](*args)
        for name, fn in fns.items():
            if name == "triton":
                continue
            out = attempt(results, shp, ("config", name), fn, *args)
            if out is None:
                continue
            o_m, final_m, ck_m = out
            rows = [compare(n, a, b) for n, a, b in (("o", o_m, o_t), ("final", final_m, final_t),
                                                    ("checkpoints", ck_m, ck_t))]
            again = fn(*args)[0]
            rows.append(dict(name="twice", equal=bool(np.array_equal(np.asarray(again), np.asarray(o_m)))))
            if shp[0] > 1:  # the last row alone == the same row in the batch
                alone = fn(*(x[-1:] for x in args))[0]
                rows.append(dict(name="row alone", equal=bool(np.array_equal(np.asarray(alone),
                                                                             np.asarray(o_m)[-1:]))))
            for r in rows:
                log(f"{str(shp):>22s} {name:>14s} {r['name']:>11s} {'EQUAL' if r['equal'] else 'DIFFER'} "
                    + (f"{r['differ']} of {r['of']}, max |diff| / max |x| {r['max_rel']:.2e}" if "differ" in r
                       else ""))
            results["checks"].append(dict(shape=shp, config=name, rows=rows))


def timing(shapes, results, orders):
    """Medians of 7 x 10 back-to-back calls (`gpu_kernels.bench_jax`)."""
    bench = functools.partial(bench_jax, n=10)
    names = ["triton"] + [f"mosaic {o}" for o in orders]
    for shp in shapes:
        args = inputs(*shp)[:-1] + (jnp.full((shp[0],), shp[1], jnp.int32),)
        t_state = bench(jax.jit(functools.partial(prefill, dict(stop_after="state"))), *args)
        row = dict(shape=shp, state_ms=t_state * 1e3, prefill_ms={})
        for name in names:
            try:
                row["prefill_ms"][name] = bench(jax.jit(functools.partial(prefill, CONFIGS[name])), *args) * 1e3
            except Exception as e:
                log(f"{str(shp):>22s} {name}: FAILED: {type(e).__name__}: {str(e)[:300]}")
        tri = row["prefill_ms"].get("triton", float("nan"))
        log(f"{str(shp):>22s} up to the recurrence {row['state_ms']:.3f} ms | "
            + ", ".join(f"{n}: prefill {ms:.3f} ms ({ms / tri:.3f}x), output {ms - row['state_ms']:.3f} ms"
                        for n, ms in row["prefill_ms"].items()))
        results["timing"].append(row)
        del args


def main():
    args, shapes = script_args(lambda ap: ap.add_argument(
        "--orders", default="h_acc", help="comma list of the orders to time (default: h_acc, the kernel's default)"))
    orders = [o for o in args.orders.split(",") if o]
    if set(orders) - set(ORDERS):
        raise SystemExit(f"--orders {args.orders!r}: expected a comma list of {ORDERS}")

    def body(results):
        checks(shapes, results)
        if not args.no_timing:
            timing(TIMING_SHAPES, results, orders)

    run_and_save(args.out, body)


if __name__ == "__main__":
    main()
