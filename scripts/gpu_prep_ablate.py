"""Where the chunked prefill's prep kernel spends its time: the prep alone (config `only_prep`), as built and with parts
of its work skipped or replaced — timing only: every variant but `as_built` computes wrong values.

Run on the GPU machine from the repo root (nothing to install):
  PYTHONPATH=. python3 scripts/gpu_prep_ablate.py [--shapes B,T,HK,HV;...] [--variants NAMES] [--config JSON]
      [--reps 3] [--out DIR]
Variants (`VARIANTS`): as_built; no_substitution (the diagonal tiles' inverse replaced by I - A_ii^T: no forward
substitution); no_merge (the tiles below the diagonal replaced by the diagonal ones: no merge dots, no off-diagonal
gram tiles); diag_wu (w and u from the diagonal tile only: one dot each per block row instead of up to four); no_u (u
not stored, so its dots go too); no_kd (kd not stored); no_l2 (k not L2-normalised); copy (the prep's loads and
stores and nothing else: its memory floor). Each variant is traced and compiled ahead of time with its functions
swapped in (`swapped`), then put back, so the compiled programs stay apart: the drivers of runs 177-178 compiled
each variant with jitted functions, and `jax.clear_caches()` between variants sent the earlier ones back to tracing
under the last variant's swaps (BENCHMARKS.md). Timing: medians of 5 x 10 back-to-back calls, --reps rounds, the
variants taking turns (reversed every other round). results.json into --out (also when a `timeout` stops it).
`--interpret` runs the kernels in interpret mode (the CPU plumbing test; its times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta import chunk, wy
from scripts.gpu_kernels import bench_jax
from scripts.gpu_mgpu_recurrence import inputs, log, run_and_save
from scripts.gpu_prefill_configs import _shapes

SHAPES = [(8, 4096, 16, 32), (1, 32768, 16, 32)]
f32 = jnp.float32


def _no_substitution(ks, gcs, betas, cfg, interpret):
    r16, c16 = wy.tile_iotas()
    eye = jnp.where(r16 == c16, 1.0, 0.0).astype(f32)
    return tuple(eye - wy.diag_tile_transposed(kb, gc, b, r16 < c16, cfg, interpret)
                 for kb, gc, b in zip(ks, gcs, betas))


def _no_merge(i, ks, gcs, betas, x, cfg, interpret):
    return {(i, m): x[i, i] for m in range(i)}


def _diag_wu(i, x, bks, bvs, cfg, interpret):
    return wy.dot(x[i, i], bks[i], cfg["p_wu"], interpret), wy.dot(x[i, i], bvs[i], cfg["p_wu"], interpret)


def _store_skipping(skip):
    """`chunk._store_tiled_wy` without the stores named in `skip` ({"u", "kd"})."""
    def store(x, ks, gcs, betas, valids, v_ref, w_ref, u_ref, kd_ref, cfg, interpret):
        s = wy.SUB
        g_last = wy.last(gcs[-1])
        bks, bvs = chunk._wy_rhs_slices(ks, gcs, betas, valids, v_ref)
        for i in range(chunk.CHUNK // s):
            sl = pl.ds(i * s, s)
            w, u = chunk._wy_block_row(i, x, bks, bvs, cfg, interpret)
            w_ref[sl, :] = w.astype(w_ref.dtype)
            if "u" not in skip:
                u_ref[sl, :] = u
            if "kd" not in skip:
                kd_ref[sl, :] = chunk._kd_slice(ks[i], gcs[i], g_last).astype(kd_ref.dtype)
    return store


def _copy_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gc_ref, *, use_l2, cfg, interpret,
                 padding_read=True):
    k = k_ref[...].astype(f32) * beta_ref[...].astype(f32)[:, None]
    w_ref[...] = k.astype(w_ref.dtype)
    kd_ref[...] = (k * 2.0).astype(kd_ref.dtype)
    u_ref[...] = v_ref[...].astype(f32)
    gc_ref[...] = g_ref[...].astype(f32)


_LOAD_KEY = chunk._load_key
VARIANTS = {  # name -> {(module, function name): replacement}
    "as_built": {},
    "no_substitution": {(wy, "diag_tiles_by_substitution"): _no_substitution},
    "no_merge": {(wy, "merged_block_row"): _no_merge},
    "diag_wu": {(chunk, "_wy_block_row"): _diag_wu},
    "no_u": {(chunk, "_store_tiled_wy"): _store_skipping({"u"})},
    "no_kd": {(chunk, "_store_tiled_wy"): _store_skipping({"kd"})},
    "no_l2": {(chunk, "_load_key"): lambda ref, valid, use_l2: _LOAD_KEY(ref, valid, False)},
    "copy": {(chunk, "_prep_split_kernel"): _copy_kernel},
}


@contextlib.contextmanager
def swapped(swaps):
    """The functions in `swaps` replaced while the block runs (tracing and compiling), then put back; JAX's caches
    cleared on the way in and out, or a trace made under other swaps is reused (the kernels' traces are cached:
    without the clearing, every variant after the second computed the second's values, the CPU test saw)."""
    old = {key: getattr(*key) for key in swaps}
    try:
        for (module, name), fn in swaps.items():
            setattr(module, name, fn)
        jax.clear_caches()
        yield
    finally:
        for (module, name), fn in old.items():
            setattr(module, name, fn)
        jax.clear_caches()


def compiled_prep(variant, args, config, interpret):
    """The prep alone under `variant`, traced and compiled now (a `jax.stages.Compiled`: later swaps cannot reach
    it)."""
    cfg = dict(config or {}, only_prep=True)
    f = functools.partial(chunk.chunk_gated_delta_rule_pallas, config=cfg, interpret=interpret)
    with swapped(VARIANTS[variant]):
        return jax.jit(f).lower(*args).compile()


def timed_in_turns(progs, args, reps, interpret):
    """ms per call of each compiled program in `progs` ({name: program}) on `args`: --reps rounds of medians of 5 x 10
    back-to-back calls (one call in interpret mode), the programs taking turns, reversed every other round. Returns
    {name: [ms per round]}."""
    names = list(progs)
    ms = {n: [] for n in names}
    calls, inner = (1, 1) if interpret else (10, 5)
    for r in range(reps):
        for n in (names if r % 2 == 0 else names[::-1]):
            ms[n].append(bench_jax(progs[n], *args, n=calls, reps=inner) * 1e3)
    return ms


def ablate(shapes, variants, config, reps, interpret, results):
    for shp in shapes:
        q, k, v, g, beta, _, _ = inputs(*shp)
        args = (q, k, v, g, beta)
        progs = {n: compiled_prep(n, args, config, interpret) for n in variants}
        # what each compiled variant computes, read after all were compiled: distinct programs give distinct w
        sums = {n: float(jnp.sum(jnp.abs(p(*args)[0].astype(f32)))) for n, p in progs.items()}
        ms = timed_in_turns(progs, args, reps, interpret)
        row = dict(shape=shp, ms={n: float(np.median(t)) for n, t in ms.items()}, spread={n: [min(t), max(t)]
                   for n, t in ms.items()}, w_abs_sum=sums)
        base = row["ms"].get("as_built")
        for n in variants:
            rel = f" ({row['ms'][n] / base:.3f}x as built)" if base else ""
            log(f"{str(shp):>22s} {n:>16s} {row['ms'][n]:.3f} ms [{min(ms[n]):.3f}-{max(ms[n]):.3f}]{rel}")
        results["timing"].append(row)
        del q, k, v, g, beta


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="", help="B,T,HK,HV separated by ';' (default: 8,4096,16,32;1,32768,16,32)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--config", default="", help="JSON: chunk config overrides for every variant (e.g. warps_prep)")
    ap.add_argument("--reps", type=int, default=3, help="rounds of the variants taking turns")
    ap.add_argument("--interpret", action="store_true", help="interpret mode (CPU plumbing test; times meaningless)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    variants = [n for n in args.variants.split(",") if n]
    if not variants or set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(set(variants) - set(VARIANTS))}; known: {', '.join(VARIANTS)}")
    try:
        config = json.loads(args.config) if args.config else {}
    except json.JSONDecodeError:
        config = None
    if not isinstance(config, dict):
        raise SystemExit(f"--config {args.config!r}: expected a JSON object of chunk config overrides")
    if args.reps < 1:
        raise SystemExit(f"--reps {args.reps}: at least 1")
    shapes = _shapes(args.shapes, SHAPES, "--shapes")

    def body(results):
        results["meta"].update(variants=variants, config=config, interpret=args.interpret)
        ablate(shapes, variants, config, args.reps, args.interpret, results)

    run_and_save(args.out, body)


if __name__ == "__main__":
    main()
