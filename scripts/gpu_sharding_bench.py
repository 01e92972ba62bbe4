"""Tensor parallelism across GPUs (`jaxgdn.sharding`): the CPU tests' checks on real GPUs, and prefill / decode
throughput on 1 GPU vs a mesh of N (default 2) for a Qwen3.5-9B-shaped model with random bf16 weights.

  PYTHONPATH=. python3 scripts/gpu_sharding_bench.py --out DIR [--stages ...] [--layers 8] [--tp 2]

Stages (comma-separated `--stages`; each writes into DIR/sharding_bench.json as soon as it ends):
  env        devices, NCCL variables, copy bandwidth per GPU, all-reduce time on the mesh for the sizes the model uses
  checks     tiny models (fp32, HIGHEST matmul precision) on the mesh vs one GPU: logits / states within tolerance,
             parameters and states placed as planned, the Pallas kernels inside shard_map (jaxpr), the prefix
             cache restored onto the mesh (deterministic: warm == cold, bitwise)
  hlo        the 9B-shaped decode step on the mesh, compiled: the collectives XLA inserted, with their shapes (no
             all-gather of a GDN state or KV cache), with and without the mesh context
  prefill    B=1, T=--prefill-tokens (8192), last-token logits: 1 GPU vs the mesh (tokens/s, speedup, efficiency)
  decode     B=--decode-batch (256; also --decode-batch2, 64), KV capacity for --context (1024): step time inside a
             compiled loop of 16 steps, 1 GPU vs the mesh; the bar: mesh throughput >= 1.6x one GPU at B=256
  det        deterministic mode: prefill and decode as above, 1 GPU vs the mesh (the cost of batch invariance there)
  profile    decode at B=--decode-batch, 1 GPU and the mesh: device time per step by kernel (collectives included)
  bitwise    deterministic mode on the mesh, 9B-shaped: the same call twice, a row alone == inside batches of
             2/8/64 (first, middle, last), a prompt split on the 64 grid == one call, a decode step alone == in a
             batch; plus one GPU vs the mesh (expected: close, not bitwise)

Decode states are fresh states with `position` set to --context: the step's cost does not depend on the values
(attention reads the whole KV capacity, masked), and it saves a B x context prefill per configuration.

Scope: `--layers N` keeps the first N of the 32 layers (BENCHMARKS.md's model figures use 8: compiling all 32 for
every stage did not fit one session's device time). The embedding and lm_head (248320 x 4096) are always there and
weigh more in a slice than in the whole model; the report gives the per-layer part too.

NCCL: NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others are forced below, as the machines require).

On a CPU it runs end to end with small shapes (how it is tested before a GPU run):
  XLA_FLAGS=--xla_force_host_platform_device_count=2 PYTHONPATH=. python3 scripts/gpu_sharding_bench.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import statistics
import time
import traceback

# Required on the lent multi-GPU machines: never use NVLink multicast (it can take the shared host's GPUs down).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# (scripts/ is on sys.path when run as a script)
from gpu_model_bench import apply_matmul_config, build as build_shared, profiled_kernels, timed  # noqa: E402
import jaxgdn  # noqa: E402
from jaxgdn import sharding as S  # noqa: E402
from jaxgdn.generate import greedy_decode  # noqa: E402
from jaxgdn.model import decode_step, prefill_chunk  # noqa: E402
from jaxgdn.state import AttentionLayerState, GDNLayerState  # noqa: E402

RESULTS: dict = {"errors": []}
OUT = "."
# How the model's functions are compiled: `jaxgdn.model.jit` (jaxgdn's COMPILER_OPTIONS, as `Model.prefill_chunk`,
# `generate` and the other entry points compile them), or plain `jax.jit` with `--plain-jit` (XLA's default excess
# precision: a fusion may keep bf16 intermediates in fp32, so rounding can move with the fusion).
MODEL_JIT = jaxgdn.model.jit


def log(*a):
    print(*a, flush=True)


def save():
    with open(os.path.join(OUT, "sharding_bench.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1, default=lambda x: x.item() if hasattr(x, "item") else str(x))


def nbytes(tree) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def on_mesh(mesh):
    """The mesh as JAX's context mesh (the Pallas kernels then run per shard), or nothing for one device."""
    return jax.set_mesh(mesh) if mesh is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---- models ------------------------------------------------------------------------------------------------------

def build(preset: str, layers: int | None, dtype, backend=None) -> jaxgdn.Model:
    """Random parameters on device 0 (one GPU); one layer of each kind shared by all (`gpu_model_bench.build`)."""
    with jax.default_device(jax.devices()[0]):
        return dataclasses.replace(build_shared(preset, layers, dtype), backend=backend)


def fresh_state(model, B: int, capacity: int, position: int):
    """A fresh state (sharded when the model is) whose rows claim `position` tokens absorbed."""
    st = S.init_state(model, B, capacity)
    pos = jnp.full((B,), position, jnp.int32)
    mesh = S.mesh_of(model)
    if mesh is not None:
        pos = jax.device_put(pos, NamedSharding(mesh, P()))
    return st._replace(position=pos)


# ---- stage: environment ------------------------------------------------------------------------------------------

def stage_env(mesh, small: bool):
    devs = jax.devices()
    RESULTS["env"] = {"devices": [str(d) for d in devs], "n_devices": len(devs), "jax": jax.__version__,
                      "nccl_env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO")},
                      "xla_flags": os.environ.get("XLA_FLAGS", "")}
    n = (1 << 20) if small else (1 << 30)
    x = jnp.ones((n,), jnp.float32) * 1.5
    t = timed(jax.jit(lambda a: a * 1.0000001), x, reps=10)
    RESULTS["env"]["copy_bytes_per_s"] = 2 * x.nbytes / t
    log(f"devices: {len(devs)} x {devs[0].device_kind}; copy {2 * x.nbytes / t / 1e12:.2f} TB/s (one device)")
    if mesh is None:
        return
    # all-reduce of the activations a row-split projection produces: decode [B, D] and prefill [T, D], bf16
    D = 64 if small else 4096
    ar = {}
    for rows in ((4, 64) if small else (1, 64, 256, 8192)):
        a = jax.device_put(jnp.ones((mesh.shape[S.TP], rows, D), jnp.bfloat16), NamedSharding(mesh, P(S.TP)))
        f = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, S.TP), mesh=mesh, in_specs=P(S.TP), out_specs=P(S.TP)))
        reps = 20
        g = jax.jit(lambda v: jax.lax.fori_loop(0, reps, lambda i, u: f(u) * 0.5, v))
        t = timed(g, a, reps=5) / reps
        ar[f"[{rows},{D}] bf16"] = t
        log(f"  all-reduce over {mesh.shape[S.TP]} devices of [{rows}, {D}] bf16: {t * 1e6:.1f} us")
    RESULTS["env"]["all_reduce_s"] = ar


# ---- stage: checks (tiny models, the CPU tests' checks on the GPUs) ----------------------------------------------

def stage_checks(mesh, tol: float):
    checks, detail = {}, {}
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, (2, 64)).astype(np.int32)
    lens = np.array([64, 41], np.int32)
    nxt = np.array([7, 9], np.int32)
    valid = np.arange(64)[None, :] < lens[:, None]
    pf, dc = MODEL_JIT(prefill_chunk), MODEL_JIT(decode_step)
    with jax.default_matmul_precision("highest"):
        for name in ("tiny", "tiny-next"):
            model = jaxgdn.tiny_model(name)
            s0, l0 = pf(model, model.init_state(2, 128), toks, lens)
            s0d, l0d = dc(model, s0, nxt)
            sm = S.shard_model(model, mesh)
            st = S.init_state(sm, 2, 128)
            with on_mesh(mesh):
                jx = str(jax.make_jaxpr(prefill_chunk)(sm, st, toks, lens))
                s1, l1 = pf(sm, st, toks, lens)
                s1d, l1d = dc(sm, s1, nxt)
            specs = S.state_specs(sm.config, mesh)
            d = {"plan": S.plan(model.config, mesh).describe(),
                 "prefill_logits": float(np.max(np.abs(np.asarray(l1)[valid] - np.asarray(l0)[valid]))),
                 "decode_logits": float(np.max(np.abs(np.asarray(l1d) - np.asarray(l0d)))),
                 "state": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
                              zip(jax.tree.leaves(S.convert_layout(s1d, sm, model).layers),
                                  jax.tree.leaves(s0d.layers))),
                 "shard_maps_in_prefill": jx.count("shard_map["),
                 "misplaced": S.check_placement(sm.params, S.param_specs(sm.config, mesh))
                 + S.check_placement(s1d, specs)}
            detail[name] = d
            checks[f"{name}: logits within {tol}"] = max(d["prefill_logits"], d["decode_logits"]) <= tol
            checks[f"{name}: placed as planned"] = d["misplaced"] == []
            if S.plan(model.config, mesh).gdn_heads and jax.default_backend() == "gpu":  # Pallas only on a GPU
                checks[f"{name}: Pallas kernels in shard_map"] = (
                    d["shard_maps_in_prefill"] == len(model.config.gdn_layers))
        # deterministic prefix cache on the mesh: warm == cold bitwise, checkpoints split, check_cache
        model = jaxgdn.tiny_model("tiny", seed=3, deterministic=True)
        sm = S.shard_model(model, mesh)
        prompt = rng.integers(0, 256, 100).tolist()
        with on_mesh(mesh):
            cold = jaxgdn.generate(sm, [prompt], max_new_tokens=16, cache=jaxgdn.PrefixCache(64, deterministic=True))
            warm = jaxgdn.generate(sm, [prompt], max_new_tokens=16, cache=cold.cache)
            jaxgdn.check_cache(warm.cache, sm, recompute=True)
        [ck] = cold.cache.checkpoints()
        checks["cache: warm uses the checkpoint"] = warm[0].cached_tokens == 64
        checks["cache: warm == cold (bitwise)"] = (warm[0].tokens == cold[0].tokens
                                                   and np.array_equal(warm[0].logprobs, cold[0].logprobs))
        checks["cache: checkpoint split over the mesh"] = S.check_placement(
            (ck.gdn, ck.kv), S.checkpoint_specs(sm.config, mesh)) == []
    RESULTS["checks"] = {"passed": checks, "detail": detail}
    for k, v in checks.items():
        log(f"  [{'PASS' if v else 'FAIL'}] {k}")
    for k, v in detail.items():
        log(f"  {k}: {v['plan']}; prefill {v['prefill_logits']:.2e}, decode {v['decode_logits']:.2e}, "
            f"state {v['state']:.2e}")


# ---- stage: collectives in the compiled decode step ---------------------------------------------------------------

_COLL = re.compile(r"= (\S+) (all-reduce|all-gather|collective-permute|all-to-all|reduce-scatter)(-start)?\(")


def collectives(compiled_text: str) -> dict:
    found: dict = {}
    for m in _COLL.finditer(compiled_text):
        key = f"{m.group(2)} {m.group(1)}"
        found[key] = found.get(key, 0) + 1
    return found


def stage_hlo(model, mesh, B: int, context: int):
    sm = S.shard_model(model, mesh)
    st = fresh_state(sm, B, context + 64, context)
    tok = jnp.zeros((B,), jnp.int32)
    out = {}
    for ctx_name, ctx in (("with mesh context", on_mesh(mesh)), ("without", _Null())):
        with ctx:
            txt = MODEL_JIT(decode_step).lower(sm, st, tok).compile().as_text()
        c = collectives(txt)
        out[ctx_name] = c
        log(f"  decode step collectives ({ctx_name}): {sum(c.values())}")
        for k, v in sorted(c.items(), key=lambda kv: -kv[1]):
            log(f"    {v:4d} x {k}")
    cfg = model.config
    hv_local = cfg.linear_num_value_heads // mesh.shape[S.TP]
    state_shape = f"f32[{B},{cfg.linear_num_value_heads}"  # a gathered recurrent state would show the full HV
    out["state_gathered_with_context"] = any(state_shape in k for k in out["with mesh context"]
                                             if k.startswith("all-gather"))
    out["hv_per_device"] = hv_local
    RESULTS["hlo_decode"] = out
    del sm, st


# ---- stage: prefill / decode throughput, 1 GPU vs the mesh -------------------------------------------------------

def prefill_time(model, mesh, T: int, reps: int = 3):
    f = MODEL_JIT(functools.partial(prefill_chunk, last_only=True))
    st = S.init_state(model, 1, T)
    toks = jax.random.randint(jax.random.key(1), (1, T), 0, model.config.vocab_size, jnp.int32)
    lens = jnp.array([T], jnp.int32)
    with on_mesh(mesh):
        return timed(f, model, st, toks, lens, reps=reps)


def decode_time(model, mesh, B: int, context: int, steps: int = 16):
    """Seconds per decode step inside one compiled loop of `steps` (state donated), and per separate call."""
    cap = context + steps + 64

    f = MODEL_JIT(functools.partial(greedy_decode, steps=steps), donate_argnums=1)
    tok = jnp.zeros((B,), jnp.int32)
    with on_mesh(mesh):
        state = fresh_state(model, B, cap, context)
        state, _ = f(model, state, tok)  # compile + warm
        jax.block_until_ready(state)
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            state, t_out = f(model, state, tok)
            jax.block_until_ready(t_out)
            ts.append((time.perf_counter() - t0) / steps)
        state = fresh_state(model, B, cap, context)
        t_call = timed(MODEL_JIT(decode_step), model, state, tok, reps=5)
    return statistics.median(ts), t_call, state


def decode_bytes(model, state, context, cap) -> int:
    """Bytes a decode step must move at least: weights (no embedding gather), the GDN states read and written,
    the KV cache up to the position (summed over the devices)."""
    p = model.params
    weights = nbytes(p) - p.embed.nbytes
    gdn = sum(nbytes(s) for s in state.layers if isinstance(s, GDNLayerState))
    kv = sum(nbytes(s) for s in state.layers if isinstance(s, AttentionLayerState)) * context / cap
    return int(weights + 2 * gdn + kv)


def stage_throughput(model, mesh, args, tag: str, kinds=("prefill", "decode")):
    n = mesh.shape[S.TP]
    sm = S.shard_model(model, mesh)
    res = RESULTS.setdefault(f"throughput_{tag}", {})
    if "prefill" in kinds:
        T = args.prefill_tokens
        t1 = prefill_time(model, None, T)
        tn = prefill_time(sm, mesh, T)
        res["prefill"] = {"T": T, "s_1": t1, f"s_{n}": tn, "tok_s_1": T / t1, f"tok_s_{n}": T / tn,
                          "speedup": t1 / tn, "efficiency": t1 / tn / n}
        log(f"prefill[{tag}] T={T}: 1 device {t1 * 1e3:.1f} ms ({T / t1:,.0f} tok/s), {n} devices {tn * 1e3:.1f} ms "
            f"({T / tn:,.0f} tok/s): speedup {t1 / tn:.2f}x, efficiency {t1 / tn / n:.0%}")
        save()
    if "decode" in kinds:
        for B in sorted({args.decode_batch, args.decode_batch2}, reverse=True):
            cap = args.context + 16 + 64
            t1, c1, st1 = decode_time(model, None, B, args.context)
            by = decode_bytes(model, st1, args.context, cap)
            del st1
            tn, cn, stn = decode_time(sm, mesh, B, args.context)
            del stn
            bw = RESULTS.get("env", {}).get("copy_bytes_per_s")
            r = {"B": B, "context": args.context, "step_s_1": t1, f"step_s_{n}": tn, "call_s_1": c1,
                 f"call_s_{n}": cn, "tok_s_1": B / t1, f"tok_s_{n}": B / tn, "speedup": t1 / tn,
                 "efficiency": t1 / tn / n, "bytes_total": by}
            if bw:
                r.update(roofline_s_1=by / bw, **{f"roofline_s_{n}": by / n / bw})
            res[f"decode_B{B}"] = r
            bar = "" if B != 256 or tag != "normal" else f"  [{'PASS' if t1 / tn >= 1.6 else 'FAIL'}] bar >= 1.6x"
            log(f"decode[{tag}] B={B} ctx={args.context}: 1 device {t1 * 1e3:.2f} ms/step ({B / t1:,.0f} tok/s), "
                f"{n} devices {tn * 1e3:.2f} ms/step ({B / tn:,.0f} tok/s): speedup {t1 / tn:.2f}x, efficiency "
                f"{t1 / tn / n:.0%}{bar}" + (f"; roofline 1 device {by / bw * 1e3:.2f} ms, {n} devices "
                                            f"{by / n / bw * 1e3:.2f} ms" if bw else ""))
            save()
    del sm


def stage_profile(model, mesh, B: int, context: int, steps: int = 16, top: int = 20):
    """Where a decode step's device time goes, on 1 GPU and on the mesh: one call of the compiled `steps`-step loop
    under the profiler, kernels by device time per step (on the mesh: summed over the devices, then / devices)."""
    n = mesh.shape[S.TP]
    f = MODEL_JIT(functools.partial(greedy_decode, steps=steps), donate_argnums=1)
    tok = jnp.zeros((B,), jnp.int32)
    for tag, m, msh, ndev in (("1", model, None, 1), (str(n), S.shard_model(model, mesh), mesh, n)):
        with on_mesh(msh):
            held = [fresh_state(m, B, context + steps + 64, context)]  # donated: each call takes the last one's output

            def run():
                held[0], tokens = f(m, held[0], tok)
                return tokens

            rows = profiled_kernels(run, top=100000)
            held.clear()
        per = [(name, t / steps / ndev, c / steps / ndev) for name, t, c in rows]
        total = sum(t for _, t, _ in per)
        coll = [(name, t, c) for name, t, c in per if re.search(r"all.?reduce|all.?gather|nccl", name, re.I)]
        RESULTS.setdefault("profile", {})[f"decode_B{B}_{tag}dev"] = dict(
            total_us=total, collectives_us=sum(t for _, t, _ in coll), collective_kernels=sum(c for *_, c in coll),
            kernels=[dict(name=name[:200], us_per_step=t, count=c) for name, t, c in per[:top]])
        log(f"profile decode B={B} on {tag} device(s): device time per step and device, {total / 1e3:.2f} ms over "
            f"{len(per)} kernel names; collectives {sum(t for _, t, _ in coll):.0f} us in "
            f"{sum(c for *_, c in coll):.0f} kernels; the {top} largest:")
        for name, t, c in per[:top]:
            log(f"  {t:9.1f} us  x{c:<5.1f} {name[:110]}")


# ---- stage: bitwise on the mesh (deterministic mode) -------------------------------------------------------------

def stage_bitwise(model, mesh, max_len: int, batches=(2, 8, 64)):
    det = model.with_deterministic()
    sm = S.shard_model(det, mesh)
    cfg = det.config
    rng = np.random.default_rng(0)
    target = rng.integers(0, cfg.vocab_size, max_len).astype(np.int32)
    width = max_len
    f = MODEL_JIT(functools.partial(prefill_chunk, last_only=True))
    d = MODEL_JIT(decode_step)
    checks = {}

    def run(m, msh, rows):
        toks = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            toks[i, :len(r)] = r
        with on_mesh(msh):
            st, lg = f(m, S.init_state(m, len(rows), width + 64), jnp.asarray(toks),
                       jnp.asarray([len(r) for r in rows], jnp.int32))
            st, lg2 = d(m, st, jnp.full((len(rows),), 11, jnp.int32))
        return np.asarray(lg), np.asarray(lg2)

    alone, alone_dec = run(sm, mesh, [target])
    again, again_dec = run(sm, mesh, [target])
    checks["same call twice"] = bool(np.array_equal(alone, again) and np.array_equal(alone_dec, again_dec))
    for B in batches:
        for where in sorted({0, B // 2, B - 1}):
            rows = [rng.integers(0, cfg.vocab_size, rng.integers(1, max_len + 1)).astype(np.int32) for _ in range(B)]
            rows[where] = target
            lg, dec = run(sm, mesh, rows)
            checks[f"B={B} row={where} prefill"] = bool(np.array_equal(lg[where], alone[0]))
            checks[f"B={B} row={where} decode"] = bool(np.array_equal(dec[where], alone_dec[0]))
    half = (max_len // 2) // 64 * 64
    with on_mesh(mesh):
        st = S.init_state(sm, 1, width + 64)
        st, _ = f(sm, st, jnp.asarray(target[None, :half]), jnp.array([half], jnp.int32))
        _, lg2 = f(sm, st, jnp.asarray(target[None, half:]), jnp.array([max_len - half], jnp.int32))
    checks[f"split at {half} == one call"] = bool(np.array_equal(np.asarray(lg2)[0], alone[0]))
    one, _ = run(det, None, [target])
    RESULTS[f"bitwise_len{max_len}"] = {"passed": checks, "one_gpu_vs_mesh_max_abs": float(np.max(np.abs(one - alone))),
                                        "one_gpu_vs_mesh_bitwise": bool(np.array_equal(one, alone))}
    for k, v in checks.items():
        log(f"  [{'PASS' if v else 'FAIL'}] len {max_len} {k}")
    log(f"  one GPU vs the mesh (last-token logits): max |diff| {float(np.max(np.abs(one - alone))):.3e} "
        f"(bitwise: {bool(np.array_equal(one, alone))}; not expected)")


# ---- main --------------------------------------------------------------------------------------------------------

def main():
    global OUT, MODEL_JIT
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--layers", type=int, default=8, help="keep only the first N layers (0: all)")
    ap.add_argument("--tp", type=int, default=2, help="mesh size")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--decode-batch", type=int, default=256)
    ap.add_argument("--decode-batch2", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--bitwise-lengths", default="512")
    ap.add_argument("--backend", default=None, help="kernel backend (default: Pallas on GPU, reference on CPU)")
    ap.add_argument("--tol", type=float, default=1e-4, help="checks stage: max |logit diff|, fp32 HIGHEST")
    ap.add_argument("--stages", default="env,checks,hlo,prefill,decode,det,bitwise")
    ap.add_argument("--cpu-smoke", action="store_true", help="small shapes, tiny preset (CPU test of the script)")
    ap.add_argument("--matmul-config", default="", help="JSON dict overriding pallas_kernels.matmul.DEFAULT_CONFIG "
                    "for this run (deterministic mode's matmul tiling)")
    ap.add_argument("--plain-jit", action="store_true", help="compile the model's functions with jax.jit (XLA's "
                    "default excess precision) instead of jaxgdn.model.jit")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.plain_jit:
        MODEL_JIT = jax.jit
    if args.matmul_config:  # before anything is traced (the kernel reads its defaults at trace time)
        RESULTS["matmul_config"] = apply_matmul_config(args.matmul_config)
    if args.cpu_smoke:
        args.preset, args.layers, args.prefill_tokens = "tiny", 0, 128
        args.decode_batch, args.decode_batch2, args.context, args.bitwise_lengths = 8, 4, 64, "128"
    OUT = args.out
    os.makedirs(OUT, exist_ok=True)
    stages = args.stages.split(",")
    small = args.preset.startswith("tiny")
    if len(jax.devices()) < args.tp:
        raise SystemExit(f"--tp {args.tp} needs {args.tp} devices; found {jax.devices()}")
    mesh = S.make_mesh(args.tp)
    RESULTS.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                   host=platform.node(), preset=args.preset, layers=args.layers or "all", tp=args.tp,
                   args=vars(args))
    log(f"jax {jax.__version__}, {len(jax.devices())} x {jax.devices()[0].device_kind}, mesh {args.tp}, "
        f"preset {args.preset}, layers {args.layers or 'all'}, stages {stages}")
    model = None

    def big():
        nonlocal model
        if model is None:
            t0 = time.time()
            model = build(args.preset, args.layers or None, jnp.bfloat16, args.backend)
            RESULTS["model"] = {"param_bytes": nbytes(model.params), "layers": model.config.num_layers,
                                "gdn_layers": len(model.config.gdn_layers),
                                "plan": S.plan(model.config, mesh).describe()}
            log(f"built {nbytes(model.params) / 1e9:.2f} GB of bf16 parameters in {time.time() - t0:.1f}s; "
                f"{RESULTS['model']['plan']}")
        return model

    table = {
        "env": lambda: stage_env(mesh, small),
        "checks": lambda: stage_checks(mesh, args.tol),
        "hlo": lambda: stage_hlo(big(), mesh, args.decode_batch, args.context),
        "prefill": lambda: stage_throughput(big(), mesh, args, "normal", ("prefill",)),
        "decode": lambda: stage_throughput(big(), mesh, args, "normal", ("decode",)),
        "det": lambda: stage_throughput(big().with_deterministic(), mesh, args, "deterministic"),
        "bitwise": lambda: [stage_bitwise(big(), mesh, int(n)) for n in args.bitwise_lengths.split(",")],
        "profile": lambda: stage_profile(big(), mesh, args.decode_batch, args.context),
    }
    for name in stages:
        t1 = time.time()
        log(f"== {name}")
        try:
            table[name]()
        except Exception as e:  # one broken stage must not hide the others
            traceback.print_exc()
            RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}"[:2000])
        RESULTS.setdefault("stage_seconds", {})[name] = time.time() - t1
        log(f"  ({name}: {time.time() - t1:.0f}s)")
        save()
    log("errors: " + ("; ".join(RESULTS["errors"]) or "none"))


if __name__ == "__main__":
    main()
