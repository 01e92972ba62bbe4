"""How long a user waits for the first call: compile + first run of the model's entry points, by depth.

For each layer count in --layers (the first N layers of the preset, random bf16 weights: `gpu_model_bench.build`), in
one process: `jaxgdn.prefill_chunk` (B = 1, --prefill-tokens tokens), `jaxgdn.decode_step` (B = --decode-batch) and
`jaxgdn.generate` (one prompt of --prompt-tokens, --new-tokens new tokens), each called through `jaxgdn.model.jit`
(prefill, decode) or as the user calls it (generate). It prints, per entry point, the first call (trace, compile and
run) and the median of three later calls, so the difference is the compile's share; then how the first call grows
with depth, and prefill's and decode's trace, lower and compile (a second compile, `phases`). The model's layers are
a Python loop, so the traced program holds every layer; how much of that the compile pays for is what this measures
(runs 165-167, an H100, BENCHMARKS.md "How long a first call waits": 17-19 s for the prefill's first call at 4 layers,
38 s at 32, 2.8 s with the cache warm).
  PYTHONPATH=. python3 scripts/gpu_compile_times.py [--preset qwen3.5-9b] [--layers 4,8,32] [--compile-cache DIR]
      [--backend reference|pallas|interpret] [--order prefill,decode,generate] [--names-check] [--out DIR]
With --compile-cache, JAX's persistent compilation cache holds every program in DIR: a second process with the same
DIR shows what a user's restart waits for. On a CPU it runs with `--preset tiny` (the test uses `--layers 1,2`).
Writes compile_times.json into --out after every depth.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxgdn  # noqa: E402
from jaxgdn.program_cache import compile_cache, stable_kernel_names  # noqa: E402
from jaxgdn.config import PRESETS  # noqa: E402
from pallas_kernels.backend import BACKENDS  # noqa: E402
from scripts.gpu_model_bench import build, timed_calls  # noqa: E402


def log(*a):
    print(*a, flush=True)


def first_and_warm(run, reps: int = 3) -> dict:
    """{first_s, warm_s}: `run()` once (it compiles), then the median of `reps` more calls; each waited on
    (`gpu_model_bench.timed_calls`)."""
    _, t = timed_calls(lambda: jax.block_until_ready(run()), reps)
    return {"first_s": t["first_s"], "warm_s": t["median_s"]}


def phases(jitted, *args) -> dict:
    """Where a first call's wait goes, through jax's ahead-of-time stages: {trace_s, lower_s, compile_s} (each
    `jax.stages` step timed alone; the compile is XLA's, the Pallas kernels' own compiles included)."""
    t0 = time.perf_counter()
    traced = jitted.trace(*args)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2}


ENTRY_POINTS = ("prefill", "decode", "generate")


def entry_points(model, T: int, B: int, prompt: int, new: int, order=ENTRY_POINTS) -> dict:
    """First and warm call times of prefill, decode and generate on `model`, called in `order`; for prefill and
    decode also the first call's trace, lower and compile (`phases`, on a fresh jit of the same function, after the
    timed calls)."""
    V = model.config.vocab_size
    toks = jax.random.randint(jax.random.key(1), (1, T), 0, V, jnp.int32)
    prefill = jaxgdn.model.jit(functools.partial(jaxgdn.prefill_chunk, last_only=True))
    decode = jaxgdn.model.jit(jaxgdn.decode_step)
    state1 = model.init_state(1, T)
    stateB = model.init_state(B, 64)
    nxt = jnp.arange(B, dtype=jnp.int32) % V
    rng = np.random.default_rng(0)
    prompt_toks = rng.integers(0, V, prompt).tolist()
    lens = jnp.array([T], jnp.int32)
    calls = {
        "prefill": lambda: prefill(model, state1, toks, lens),
        "decode": lambda: decode(model, stateB, nxt),
        "generate": lambda: [r.logprobs for r in jaxgdn.generate(model, [prompt_toks], max_new_tokens=new)],
    }
    out = {name: first_and_warm(calls[name]) for name in order}
    out["prefill"].update(phases(jaxgdn.model.jit(functools.partial(jaxgdn.prefill_chunk, last_only=True)),
                                 model, state1, toks, lens))
    # a new function object (functools.partial), so that jax's in-memory caches from the timed calls do not answer
    # (the persistent cache, when on, may: run 165's decode)
    out["decode"].update(phases(jaxgdn.model.jit(functools.partial(jaxgdn.decode_step)), model, stateB, nxt))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--layers", default="4,8,32", help="comma list of layer counts (the preset's first N layers)")
    ap.add_argument("--prefill-tokens", type=int, default=4096)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--order", default=",".join(ENTRY_POINTS),
                    help="the order the entry points are first called in (with --compile-cache a later process finds "
                         "the programs in any order: `jaxgdn.program_cache.stable_kernel_names`, run 191)")
    ap.add_argument("--backend", choices=BACKENDS, default=None,
                    help="the GDN layers' kernel backend (default: the device's; 'reference': the kernels' share)")
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="JAX's persistent compilation cache in DIR (every program kept): run twice to see a warm one")
    ap.add_argument("--names-check", action="store_true",
                    help="first: the prefill's last logits and state with the Mosaic GPU kernels' names numbered "
                         "(jax's) and stable (`stable_kernel_names`), compared bitwise (the first --layers count; no "
                         "cache)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    try:
        layer_counts = [int(n) for n in args.layers.split(",") if n.strip()]
    except ValueError:
        ap.error(f"--layers must be a comma list of integers; got {args.layers!r}")
    order = tuple(n.strip() for n in args.order.split(","))
    if sorted(order) != sorted(ENTRY_POINTS):
        ap.error(f"--order must name {', '.join(ENTRY_POINTS)} once each; got {args.order!r}")
    if args.preset not in PRESETS:
        ap.error(f"--preset: unknown {args.preset!r}; choose from {sorted(PRESETS)}")
    depth = len(PRESETS[args.preset]().layer_types)
    if not layer_counts or min(layer_counts) < 1 or max(layer_counts) > depth:
        ap.error(f"--layers must name layer counts from 1 to the preset's {depth}; got {args.layers!r}")
    cached = cache_entries(args.compile_cache) if args.compile_cache else None
    meta = {"compile_cache": args.compile_cache, "cache_entries_before": cached,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "jax": jax.__version__,
            "device": jax.devices()[0].device_kind, "host": platform.node(), "argv": vars(args)}
    log(json.dumps(meta))
    results = {"meta": meta, "by_layers": {}}
    if args.names_check:
        results["names_check"] = names_check(args.preset, layer_counts[0], args.prefill_tokens, args.backend)
        write(args.out, results)
    with compile_cache(args.compile_cache):  # the CLI's --compile-cache: every program kept in DIR
        measure(args, layer_counts, order, results)


def names_check(preset: str, layers: int, T: int, backend) -> dict:
    """The model's prefill (B = 1, T tokens; the last logits and the new state) lowered and compiled twice, with jax's
    numbered Mosaic GPU kernel names and inside `stable_kernel_names`: the kernels' code must be the same (only their
    name attribute differs), so every array must be equal in every element. Logged; returns {equal, arrays}."""
    model = build(preset, layers).with_backend(backend)
    toks = jax.random.randint(jax.random.key(2), (1, T), 0, model.config.vocab_size, jnp.int32)
    state = model.init_state(1, T)

    def logits():  # a new function object each time: lowered and compiled again, not taken from jit's cache
        fn = jaxgdn.model.jit(functools.partial(jaxgdn.prefill_chunk, last_only=True))
        return [np.asarray(x) for x in jax.tree.leaves(fn(model, state, toks))]

    numbered = logits()
    with stable_kernel_names():
        stable = logits()
    equal = len(numbered) == len(stable) and all(np.array_equal(a, b) for a, b in zip(numbered, stable))
    out = {"equal": equal, "arrays": len(numbered)}
    log(f"names check ({layers} layers, {T} tokens): the last logits and the state with stable kernel names "
        f"{'EQUAL' if equal else 'DIFFER'} to the numbered names' in every element ({len(numbered)} arrays, "
        f"{sum(a.size for a in numbered)} values)")
    return out


def measure(args, layer_counts, order, results: dict):
    """The entry points at each depth, logged and written (into `results`) after every depth; then the growth."""
    for n in layer_counts:
        model = build(args.preset, n).with_backend(args.backend)
        r = entry_points(model, args.prefill_tokens, args.decode_batch, args.prompt_tokens, args.new_tokens, order)
        results["by_layers"][str(n)] = r
        for name, t in r.items():
            split = (f" (trace {t['trace_s']:.2f}, lower {t['lower_s']:.2f}, compile {t['compile_s']:.2f} s)"
                     if "trace_s" in t else "")
            log(f"layers {n:3d} {name:9s} first call {t['first_s']:8.2f} s, warm {t['warm_s'] * 1e3:9.1f} ms{split}")
        del model
        write(args.out, results)  # after every depth: a run cut short keeps what it measured
    lo, hi = str(layer_counts[0]), str(layer_counts[-1])
    if lo != hi:
        for name in ENTRY_POINTS:
            a, b = results["by_layers"][lo][name]["first_s"], results["by_layers"][hi][name]["first_s"]
            log(f"{name}: first call {b / a:.2f}x from {lo} to {hi} layers ({a:.2f} -> {b:.2f} s)")
    write(args.out, results)


def cache_entries(path: str) -> int:
    """Entries already in the compile cache `path` (0: a cold cache, or no directory yet), logged."""
    entries = len(os.listdir(path)) if os.path.isdir(path) else 0
    log(f"compile cache {path}: {entries} entries before this run")
    return entries


def write(out: str, results: dict):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compile_times.json"), "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
