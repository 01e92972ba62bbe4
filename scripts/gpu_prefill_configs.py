"""Two or more configurations of the chunked prefill side by side on the GPU: their bits against the first one, then
their times, interleaved in one process, with and without in-call checkpoints (what the prefix cache asks for).

Run on the GPU machine from the repo root (nothing to install):
  PYTHONPATH=. python3 scripts/gpu_prefill_configs.py --configs '{"triton": {"output": "triton"}, "default": {}}'
      [--stride 256] [--shapes B,T,HK,HV;...] [--timing-shapes B,T,HK,HV;...] [--no-checks] [--no-stride-timing]
      [--ragged] [--out DIR]
Checks (bf16 q / k / v, realistic gates, a random initial state, rows of different lengths, shapes (2, 300, 2, 4),
(3, 1000, 16, 32), (1, 8192, 16, 32)): each configuration's outputs and final state without checkpoints, and its
outputs, final state and checkpoints every --stride tokens, against the first configuration's, element by element.
Timing: the four bar shapes of issue 3, or --timing-shapes (full rows, no initial state), each configuration timed
without and with checkpoints every --stride tokens; medians of 7 x 10 back-to-back calls (`gpu_kernels.bench_jax`),
the configurations taking turns per shape. Exit status 0 whatever it finds (a measurement); results.json into --out,
also when a `timeout` stops it (what ran is kept). --ragged: checks and timing on rows of mixed lengths
(`ragged_lengths`), for configurations that treat chunks of padding apart (`skip_padding`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from scripts.gpu_kernels import bench_jax
from scripts.gpu_mgpu_recurrence import CHECK_SHAPES, compare, inputs, log, run_and_save

TIMING_SHAPES = [(1, 8192, 32, 32), (1, 8192, 16, 32), (8, 4096, 16, 32), (1, 32768, 16, 32)]


def prefill(cfg, stride):
    return jax.jit(functools.partial(chunk_gated_delta_rule_pallas, config=cfg or None, checkpoint_stride=stride))


def ragged_lengths(B: int, T: int):
    """--ragged: row b holds about (b + 1) / B of the T tokens, off the 64 grid but for row 0, the last row full: a
    batch of mixed lengths padded to the longest (rows b < B - 1 end in chunks of padding only)."""
    return jnp.asarray([T if b == B - 1 else max(1, T * (b + 1) // B - (23 * b) % 64) for b in range(B)], jnp.int32)


def checks(configs, stride, shapes, results, ragged=False):
    """Without and with checkpoints every `stride` tokens (a configuration may take other kernels with them)."""
    names = list(configs)
    for shp in shapes:
        q, k, v, g, beta, s0, lengths = inputs(*shp)
        if ragged:
            lengths = ragged_lengths(shp[0], shp[1])
        for st in (None, stride):
            outs = {n: prefill(configs[n], st)(q, k, v, g, beta, initial_state=s0, lengths=lengths) for n in names}
            for n in names[1:]:
                rows = [compare(part, a, b)
                        for part, a, b in zip(("o", "final", "checkpoints"), outs[n], outs[names[0]])]
                for r in rows:
                    log(f"{str(shp):>22s} {n:>14s} {'' if st is None else f'ck{st}':>6s} {r['name']:>12s} "
                        f"{'EQUAL' if r['equal'] else 'DIFFER'} {r.get('differ', '')} of {r.get('of', '')}")
                results["checks"].append(dict(shape=shp, config=n, stride=st, rows=rows))


def timing(configs, stride, shapes, results, ragged=False):
    for shp in shapes:
        q, k, v, g, beta, _, _ = inputs(*shp)
        lengths = ragged_lengths(shp[0], shp[1]) if ragged else None
        row = dict(shape=shp, ms={}, lengths=None if lengths is None else lengths.tolist())
        for st in (None, stride) if stride else (None,):
            for n, cfg in configs.items():
                f = prefill(cfg, st)
                row["ms"][f"{n}{'' if st is None else f' ck{st}'}"] = bench_jax(
                    lambda *a, f=f: f(*a, lengths=lengths), q, k, v, g, beta, n=10) * 1e3
        base = {st: row["ms"][f"{next(iter(configs))}{'' if st is None else f' ck{st}'}"]
                for st in ((None, stride) if stride else (None,))}
        log(f"{str(shp):>22s} " + ", ".join(
            f"{name} {ms:.3f} ms ({ms / base[stride if ' ck' in name else None]:.3f}x)"
            for name, ms in row["ms"].items()))
        results["timing"].append(row)
        del q, k, v, g, beta


def _shapes(text: str, default, flag: str):
    """'B,T,HK,HV;...' as a list of 4-tuples of positive ints (HK dividing HV), or `default` for ''."""
    if not text:
        return default
    try:
        shapes = [tuple(int(x) for x in part.split(",")) for part in text.split(";")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 4 or min(s) < 1 or s[3] % s[2] for s in shapes):
        raise SystemExit(f"{flag} {text!r}: shapes B,T,HK,HV (positive ints, HK dividing HV) separated by ';'")
    return shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True, help="JSON {name: config overrides}; the first is the baseline")
    ap.add_argument("--stride", type=int, default=256, help="checkpoint stride (a multiple of 64)")
    ap.add_argument("--shapes", default="", help="check shapes B,T,HK,HV separated by ';' (default: a fixed set)")
    ap.add_argument("--timing-shapes", default="",
                    help="timing shapes B,T,HK,HV separated by ';' (default: issue 3's four bar shapes)")
    ap.add_argument("--no-checks", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-stride-timing", action="store_true", help="time without checkpoints only")
    ap.add_argument("--ragged", action="store_true",
                    help="checks and timing on rows of mixed lengths (`ragged_lengths`: row b about (b + 1) / B of "
                         "T, padding chunks after it) instead of the fixed lengths (checks) and full rows (timing)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    configs = json.loads(args.configs)
    if not isinstance(configs, dict) or len(configs) < 2 or not all(isinstance(c, dict) for c in configs.values()):
        raise SystemExit("--configs: a JSON object of at least two {name: {config key: value}} entries")
    if args.stride <= 0 or args.stride % 64:
        raise SystemExit(f"--stride {args.stride}: a positive multiple of 64")
    shapes = _shapes(args.shapes, CHECK_SHAPES, "--shapes")
    timing_shapes = _shapes(args.timing_shapes, TIMING_SHAPES, "--timing-shapes")

    def body(results):
        results["meta"]["configs"] = configs
        if not args.no_checks:
            checks(configs, args.stride, shapes, results, args.ragged)
        if not args.no_timing:
            timing(configs, None if args.no_stride_timing else args.stride, timing_shapes, results, args.ragged)

    run_and_save(args.out, body)


if __name__ == "__main__":
    main()
