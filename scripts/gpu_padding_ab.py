"""The prep's stores of padding chunks before the fused recurrence, measured: under `skip_padding` the fused recurrence
(output "fused_intra") runs a row's chunks only up to its last token (at least one), so the prep leaves the chunks of
padding after a row's first unwritten (`chunk._prep_split_kernel`'s `padding_read=False`, as built). Against it, in
one process on the same inputs: "written" (the prep writing zeros in every chunk of padding: the behaviour before,
`_prep_one_call` swapped to ask for it) and "no_skip" (config `skip_padding=False`: every chunk computed).

Run on the GPU machine from the repo root (nothing to install):
  PYTHONPATH=. python3 scripts/gpu_padding_ab.py [--shapes B,T,HK,HV;...] [--reps 3] [--full] [--out DIR]
Rows of mixed lengths (`gpu_prefill_configs.ragged_lengths`: row b about (b + 1) / B of T), or full rows with
--full (nothing to skip: "as_built" and "written" are then the same program's work). Checks: each variant's outputs
and final state against "no_skip"'s, element by element (`compare`). Timing: medians of 5 x 10 back-to-back calls,
--reps rounds, the variants taking turns (reversed every other round). Each variant is traced and compiled ahead of
time under its swap (`gpu_prep_ablate.swapped`). results.json into --out (also when a `timeout` stops it).
`--interpret` runs the kernels in interpret mode with the Mosaic GPU recurrence, output "fused_intra" (the CPU
plumbing test; its times mean nothing).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta import chunk
from scripts.gpu_mgpu_recurrence import compare, inputs, log, run_and_save
from scripts.gpu_prefill_configs import _shapes, ragged_lengths
from scripts.gpu_prep_ablate import swapped, timed_in_turns

SHAPES = [(8, 4096, 16, 32), (4, 4096, 16, 32), (2, 8192, 16, 32)]
VARIANTS = ("as_built", "written", "no_skip")


_PREP_ONE_CALL = chunk._prep_one_call


def _written(*args, **kwargs):
    """`chunk._prep_one_call` writing every chunk of padding (what it did before `padding_read`)."""
    return _PREP_ONE_CALL(*args, **dict(kwargs, padding_read=True))


def compiled_prefill(variant, args, interpret):
    """The whole prefill (q, k, v, g, beta, lengths) under `variant`, traced and compiled now (later swaps cannot
    reach it)."""
    cfg = {"skip_padding": variant != "no_skip"}
    if interpret:  # "auto" keeps the Triton recurrence and the output kernel in interpret mode
        cfg.update(recurrence="mosaic", output="fused_intra", wk_dtype="float16")

    def f(q, k, v, g, beta, lengths):
        return chunk.chunk_gated_delta_rule_pallas(q, k, v, g, beta, lengths=lengths, config=cfg, interpret=interpret)

    with swapped({(chunk, "_prep_one_call"): _written} if variant == "written" else {}):
        return jax.jit(f).lower(*args).compile()


def run(shapes, reps, full, interpret, results):
    for shp in shapes:
        q, k, v, g, beta, _, _ = inputs(*shp)
        lengths = ragged_lengths(shp[0], shp[1]) if not full else jnp.full((shp[0],), shp[1], jnp.int32)
        args = (q, k, v, g, beta, lengths)
        progs = {n: compiled_prefill(n, args, interpret) for n in VARIANTS}
        outs = {n: progs[n](*args) for n in VARIANTS}
        for n in VARIANTS[:-1]:
            for name, a, b in zip(("o", "final"), outs[n], outs["no_skip"]):
                c = dict(compare(name, a, b), shape=shp, variant=n, lengths=[int(x) for x in lengths])
                results["checks"].append(c)
                log(f"{str(shp):>22s} {n:>10s} {name:>6s} {'EQUAL' if c['equal'] else 'DIFFER'}"
                    f" ({c.get('differ', '?')} of {c.get('of', '?')} differ)")
        del outs
        ms = timed_in_turns(progs, args, reps, interpret)
        row = dict(shape=shp, full=full, lengths=[int(x) for x in lengths],
                   ms={n: float(np.median(t)) for n, t in ms.items()},
                   spread={n: [min(t), max(t)] for n, t in ms.items()})
        for n in VARIANTS:
            log(f"{str(shp):>22s} {n:>10s} {row['ms'][n]:.3f} ms [{min(ms[n]):.3f}-{max(ms[n]):.3f}]"
                f" ({row['ms'][n] / row['ms']['written']:.3f}x written)")
        results["timing"].append(row)
        del q, k, v, g, beta


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="", help="B,T,HK,HV separated by ';' (default: 8,4096;4,4096;2,8192 at 16,32)")
    ap.add_argument("--reps", type=int, default=3, help="rounds of the variants taking turns")
    ap.add_argument("--full", action="store_true", help="full rows (nothing to skip) instead of mixed lengths")
    ap.add_argument("--interpret", action="store_true", help="interpret mode (CPU plumbing test; times meaningless)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: at least 1")
    shapes = _shapes(args.shapes, SHAPES, "--shapes")

    def body(results):
        results["meta"].update(reps=args.reps, full=args.full, interpret=args.interpret)
        run(shapes, args.reps, args.full, args.interpret, results)

    run_and_save(args.out, body)


if __name__ == "__main__":
    main()
