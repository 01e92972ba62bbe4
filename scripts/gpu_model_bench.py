"""Model-level GPU benchmark and checks on a Qwen3.5-9B-shaped model with random bf16 weights.

Measures, in one process: copy bandwidth and bf16 matmul rate (the ceilings); prefill of 8k tokens (tokens/s
against its compute roofline); decode at batch 64 (step time against its memory roofline: weights + GDN
states + KV bytes over copy bandwidth); the cost of deterministic mode (deterministic / normal throughput);
bitwise batch-invariance and split checks in deterministic mode; replay vs recurrent decode step time, over the
chunked GDN prefill (stage `replay`) and the token-by-token one (`scan`, `scan_bitwise`).

  PYTHONPATH=. python3 scripts/gpu_model_bench.py [--preset qwen3.5-9b] [--layers N] [--out DIR] [--stages ...]

On a CPU it runs end to end with `--preset tiny` (small shapes), which is how it is tested before a GPU run.
Prints a table per stage and writes model_bench.json into --out. The ceilings are measured in every run
(`ceilings` in --stages is accepted and changes nothing); an unknown stage name is an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform
import statistics
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxgdn  # noqa: E402
from jaxgdn.config import LINEAR, PRESETS  # noqa: E402
from jaxgdn.generate import greedy_decode  # noqa: E402
from jaxgdn.init import random_params  # noqa: E402

RESULTS: dict = {"errors": []}


def log(*a):
    print(*a, flush=True)


def timed(fn, *args, reps=5, warm=1):
    """Median wall time (s) of fn(*args) with a device sync, after `warm` untimed calls."""
    for _ in range(warm):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def ceilings(small: bool):
    n = (1 << 20) if small else (1 << 30)  # floats: 4 MiB / 4 GiB
    x = jnp.ones((n,), jnp.float32) * 1.5
    copy = jax.jit(lambda a: a * 1.0000001)
    t = timed(copy, x, reps=10)
    bw = 2 * x.nbytes / t
    m = 512 if small else 8192
    a = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    tm = timed(mm, a, b, reps=10)
    rate = 2 * m**3 / tm
    RESULTS["ceilings"] = {"copy_bytes_per_s": bw, "bf16_flops_per_s": rate}
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {rate / 1e12:.0f} TFLOP/s ({m}^3)")
    return bw, rate


def param_bytes(params) -> int:
    """Bytes the model reads (a buffer shared by several layers counts once per layer)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))


def build(preset: str, layers: int | None, dtype=jnp.bfloat16, distinct: bool = False):
    """The model with random weights. Unless `distinct`, one random layer of each kind is drawn and shared by every
    layer of that kind (the same buffers: same bytes read per layer, far less memory and build time; drawing all
    32 layers of the 9B shape took 142-184 s on the H200)."""
    cfg = PRESETS[preset]()
    if layers:
        cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[:layers])
    key = jax.random.key(0, impl="rbg")
    kinds = list(dict.fromkeys(cfg.layer_types))
    if distinct or len(kinds) == len(cfg.layer_types) or cfg.num_experts:
        params = jax.jit(lambda k: random_params(cfg, k, dtype))(key)
    else:
        small = dataclasses.replace(cfg, layer_types=tuple(kinds))
        drawn = jax.jit(lambda k: random_params(small, k, dtype))(key)
        by_kind = dict(zip(kinds, drawn.layers))
        params = drawn._replace(layers=tuple(by_kind[t] for t in cfg.layer_types))
    return jaxgdn.Model(params=params, config=cfg, dtype=dtype)


def stage_digest(model, bw: float):
    """`jaxgdn.params.weights_digest` of the model's weights (what the prefix cache's numerics key adds per `Model`
    object): the first call, its compile included, and the median of five more, against the copy bandwidth."""
    from jaxgdn.params import weights_digest

    t0 = time.perf_counter()
    digest = weights_digest(model.params)
    first = time.perf_counter() - t0
    median = timed(lambda: weights_digest(model.params), reps=5, warm=0)
    nbytes = param_bytes(model.params)
    RESULTS["digest"] = dict(first_s=first, median_s=median, bytes=nbytes, tb_per_s=nbytes / median / 1e12,
                             copy_tb_per_s=bw / 1e12, digest=digest, stable=weights_digest(model.params) == digest)
    log(f"weights digest {digest}: first call {first:.2f} s (compile included), then {median * 1e3:.2f} ms for "
        f"{nbytes / 1e9:.2f} GB ({nbytes / median / 1e12:.2f} TB/s; copy {bw / 1e12:.2f})")


def prefill_flops(cfg, T: int) -> float:
    """Matmul FLOPs of one prefill of T tokens (projections, MLP, lm_head, attention, GDN chunk algebra)."""
    D, f = cfg.hidden_size, 0.0
    for kind in cfg.layer_types:
        if kind == LINEAR:
            HV, K, V = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
            f += 2 * T * D * (cfg.gdn_conv_dim + cfg.gdn_value_dim + 2 * HV) + 2 * T * cfg.gdn_value_dim * D
            # per chunk of 64 and value head: kk^T, T@v, T@k, w@S, q@S, qk^T, qk@v, k^T v  (~8 matmuls)
            f += T * HV * 2 * (64 * K * 3 + 64 * V * 2 + K * V * 3)
        else:
            H, HKV, Dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
            f += 2 * T * D * (2 * H * Dh + 2 * HKV * Dh) + 2 * T * H * Dh * D
            f += 2 * 2 * T * T * H * Dh / 2  # causal QK^T and PV
        f += 2 * T * D * cfg.intermediate_size * 3
    return f + 2 * D * cfg.vocab_size  # lm_head for the last token only


def prefill_setup(model, T: int):
    """(compiled B=1 prefill of T random tokens returning the last token's logits, as a server does; its arguments)."""
    state = model.init_state(1, T)
    toks = jax.random.randint(jax.random.key(1), (1, T), 0, model.config.vocab_size, jnp.int32)
    f = jaxgdn.model.jit(functools.partial(jaxgdn.prefill_chunk, last_only=True))
    return f, (model, state, toks, jnp.array([T], jnp.int32))


def stage_prefill(model, T: int, rate: float, tag: str):
    f, call_args = prefill_setup(model, T)
    t = timed(f, *call_args, reps=3)
    flops = prefill_flops(model.config, T)
    out = {"T": T, "seconds": t, "tokens_per_s": T / t, "flops": flops, "compute_roofline_s": flops / rate}
    RESULTS[f"prefill_{tag}"] = out
    log(f"prefill[{tag}] T={T}: {t * 1e3:.1f} ms, {T / t:,.0f} tok/s; compute roofline {flops / rate * 1e3:.1f} ms "
        f"({flops / rate / t:.0%} of it)")
    return t


def stage_prefill_ragged(model, B: int, T: int, tag: str, reps: int = 3):
    """B rows of mixed lengths (row b about (b + 1) / B of T, the last full: `gpu_prefill_configs.ragged_lengths`)
    prefilled in one call padded to T, with the chunked GDN kernels skipping the chunks of padding only (chunk config
    `skip_padding`, the default) and computing them (False): whether the last tokens' logits of the two are equal in
    every element, and the time of each (compiled ahead of time, each under its config; `reps` rounds taking turns,
    medians of 3 calls each)."""
    from pallas_kernels.gated_delta import chunk
    from scripts.gpu_prefill_configs import ragged_lengths

    lengths = ragged_lengths(B, T)
    toks = jax.random.randint(jax.random.key(2), (B, T), 0, model.config.vocab_size, jnp.int32)
    state = model.init_state(B, T)
    fn = functools.partial(jaxgdn.prefill_chunk, last_only=True)
    progs, saved = {}, chunk.DEFAULT_CONFIG["skip_padding"]
    try:
        for skip in (True, False):  # the kernels read DEFAULT_CONFIG when traced: one compiled program each
            chunk.DEFAULT_CONFIG["skip_padding"] = skip
            jax.clear_caches()
            progs[skip] = jaxgdn.model.jit(fn).lower(model, state, toks, lengths).compile()
    finally:
        chunk.DEFAULT_CONFIG["skip_padding"] = saved
        jax.clear_caches()
    logits = {skip: np.asarray(p(model, state, toks, lengths)[1]) for skip, p in progs.items()}
    times: dict = {True: [], False: []}
    for r in range(reps):
        for skip in ((True, False) if r % 2 == 0 else (False, True)):
            times[skip].append(timed(progs[skip], model, state, toks, lengths, reps=3))
    t_skip, t_full = statistics.median(times[True]), statistics.median(times[False])
    tokens = int(np.sum(np.asarray(lengths)))
    out = {"B": B, "T": T, "lengths": [int(n) for n in lengths], "seconds_skip_padding": t_skip,
           "seconds_every_chunk": t_full, "ratio": t_skip / t_full, "tokens_per_s": tokens / t_skip,
           "logits_equal": bool(np.array_equal(logits[True], logits[False])), "times": {
               "skip_padding": times[True], "every_chunk": times[False]}}
    RESULTS[f"prefill_ragged_{tag}"] = out
    log(f"prefill_ragged[{tag}] B={B} T={T} ({tokens} tokens): {t_skip * 1e3:.1f} ms skipping padding chunks, "
        f"{t_full * 1e3:.1f} ms computing them ({out['ratio']:.3f}x); last logits equal: {out['logits_equal']}")
    return out


def kernel_times(trace_dir: str, top: int = 15) -> list[tuple[str, float, int]]:
    """(name, total µs, count) of the device kernels in a `jax.profiler` trace (its perfetto JSON), largest first.
    Events of processes whose name mentions a GPU; on a machine without one, every complete event (for tests)."""
    import glob
    import gzip
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))[-1]
    with gzip.open(path, "rt") as fh:
        events = json.load(fh)["traceEvents"]
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    gpu = {pid for pid, n in names.items() if "gpu" in n.lower()}
    totals: dict = {}
    for e in events:
        if e.get("ph") == "X" and (not gpu or e.get("pid") in gpu):
            t, c = totals.get(e["name"], (0.0, 0))
            totals[e["name"]] = (t + float(e.get("dur", 0.0)), c + 1)
    return sorted(((n, t, c) for n, (t, c) in totals.items()), key=lambda r: -r[1])[:top]


def profiled_kernels(run, top: int) -> list[tuple[str, float, int]]:
    """`kernel_times` of one call of `run()` (compiled and warmed by a first call; what it returns is waited on)."""
    import tempfile
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run())
        return kernel_times(d, top=top)


def stage_prefill_profile(model, T: int, tag: str, top: int = 25):
    """Where a prefill's device time goes (B=1, T tokens, last-token logits): one call under the profiler, kernels by
    device time. Beside the deterministic model's, it says which kernels make the two modes differ."""
    f, call_args = prefill_setup(model, T)
    rows = profiled_kernels(lambda: f(*call_args), top)
    RESULTS[f"prefill_profile_{tag}"] = [dict(name=n[:200], us=t, count=c) for n, t, c in rows]
    log(f"prefill_profile[{tag}] T={T}: device time by kernel (top {len(rows)}), total of these "
        f"{sum(t for _, t, _ in rows) / 1e3:.1f} ms")
    for n, t, c in rows:
        log(f"  {t:9.1f} us  x{c:<4d} {n[:110]}")


def prompt_lengths(B: int, context: int, phases: str) -> np.ndarray:
    """Each row's prompt length before the decode loop: `context` for every row ("aligned", as every run before
    2026-12-04's run 144), or `context - (23 b mod 64)` for row b ("mixed": the rows at mixed positions of the
    64-token grid, as in a real batch, so that replay decode's steps fall in every block row of the open chunk and
    some rows complete a chunk inside the loop; "aligned" puts every row of a context on the grid at row 0 of a new
    chunk, the replay step's cheapest case)."""
    if phases == "aligned":
        return np.full((B,), context, np.int32)
    return (context - (23 * np.arange(B)) % 64).astype(np.int32)


def decode_setup(model, B: int, context: int, steps: int, phases: str = "mixed"):
    """(compiled loop of `steps` greedy decode steps, state after a prefill of `prompt_lengths` tokens per row, first
    tokens)."""
    cfg = model.config
    state = model.init_state(B, context + steps + 64)
    toks = jax.random.randint(jax.random.key(2), (B, context), 0, cfg.vocab_size, jnp.int32)
    state, _ = jaxgdn.model.jit(jaxgdn.prefill_chunk, static_argnames="last_only")(
        model, state, toks, jnp.asarray(prompt_lengths(B, context, phases)), last_only=True)

    loop = jaxgdn.model.jit(functools.partial(greedy_decode, steps=steps))
    return loop, state, jnp.zeros((B,), jnp.int32)


def stage_profile(model, B: int, context: int, tag: str, steps: int = 16, phases: str = "mixed"):
    """Where a decode step's device time goes: one compiled loop of `steps` decode steps under the profiler."""
    f, state, tok0 = decode_setup(model, B, context, steps, phases)
    rows = profiled_kernels(lambda: f(model, state, tok0), top=15)
    RESULTS[f"profile_{tag}"] = [dict(name=n[:200], us_per_step=t / steps, count=c // steps) for n, t, c in rows]
    log(f"profile[{tag}] B={B} ({phases} phases): device time per decode step by kernel (top {len(rows)})")
    for n, t, c in rows:
        log(f"  {t / steps:9.1f} us  x{c // steps:<4d} {n[:110]}")


def stage_decode(model, B: int, context: int, bw: float, tag: str, steps: int = 16, phases: str = "mixed"):
    cfg = model.config
    cap = context + steps + 64
    f, state, tok0 = decode_setup(model, B, context, steps, phases)
    mean_len = float(prompt_lengths(B, context, phases).mean())
    t = timed(f, model, state, tok0, reps=3) / steps
    step1 = jaxgdn.model.jit(jaxgdn.decode_step)
    t_call = timed(step1, model, state, tok0, reps=5)
    weights = param_bytes(model.params) - model.params.embed.nbytes + B * cfg.hidden_size * 2
    gdn = sum(x.nbytes for x in jax.tree.leaves(jaxgdn.model.gdn_states(state)))
    kv_bytes = sum(s.keys.nbytes + s.values.nbytes for s in state.layers
                   if isinstance(s, jaxgdn.AttentionLayerState)) * (mean_len + steps / 2) / cap
    traffic = weights + 2 * gdn + kv_bytes
    out = {"B": B, "context": context, "phases": phases, "mean_prompt": mean_len, "step_s_in_loop": t,
           "step_s_per_call": t_call, "bytes": traffic, "memory_roofline_s": traffic / bw, "tokens_per_s": B / t}
    RESULTS[f"decode_{tag}"] = out
    log(f"decode[{tag}] B={B} ctx={context} ({phases} phases, mean {mean_len:.0f}): {t * 1e3:.2f} ms/step in a "
        f"compiled loop ({t_call * 1e3:.2f} ms per call), {B / t:,.0f} tok/s; memory roofline "
        f"{traffic / bw * 1e3:.2f} ms ({t / (traffic / bw):.2f}x)")
    return t


BITWISE_BATCHES = (1, 2, 8, 16, 32, 64)


def stage_bitwise(model, max_len: int, max_tokens: int = 65536, batch_sizes=BITWISE_BATCHES):
    """Deterministic mode: a sequence's logits alone == inside batches (as row 0, middle, last) == split.

    Batch sizes `batch_sizes` (default 1, 2, 8, 16, 32, 64), keeping 1 and those with batch * max_len <= max_tokens
    (memory). At the 9B shape (HV = 32) on a Hopper GPU, B = 1 takes the chunked prefill's output kernel and B >= 2 its
    output inside the recurrence (`chunk._output_in_recurrence`: 128 programs and up): `--bitwise-batches 1,2,8` checks
    that crossing alone."""
    cfg = model.config
    batches = [b for b in batch_sizes if b == 1 or b * max_len <= max_tokens]
    rng = np.random.default_rng(0)
    target = rng.integers(0, cfg.vocab_size, max_len).astype(np.int32)
    width = max_len
    f = jaxgdn.model.jit(functools.partial(jaxgdn.prefill_chunk, last_only=True))  # compare last-token logits

    def run(rows, lengths):
        toks = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            toks[i, :len(r)] = r
        _, lg = f(model, model.init_state(len(rows), width), jnp.asarray(toks), jnp.asarray(lengths, jnp.int32))
        return np.asarray(lg)

    alone = run([target], [max_len])[0]  # [Vocab]: depends on every token before it
    checks = {}
    for B in batches:
        for where in sorted({0, B // 2, B - 1}):
            rows = [rng.integers(0, cfg.vocab_size, rng.integers(1, max_len + 1)).astype(np.int32) for _ in range(B)]
            rows[where] = target
            lg = run(rows, [len(r) for r in rows])[where]
            checks[f"B={B} row={where}"] = bool(np.array_equal(lg, alone))
    # split on the grid: first half then second half
    half = (max_len // 2) // 64 * 64
    s, lg1 = f(model, model.init_state(1, width), jnp.asarray(target[None, :half]), jnp.array([half], jnp.int32))
    _, lg2 = f(model, s, jnp.asarray(target[None, half:]), jnp.array([max_len - half], jnp.int32))
    checks[f"split at {half}"] = bool(np.array_equal(np.asarray(lg2[0]), alone))
    RESULTS[f"bitwise_len{max_len}"] = checks
    with open(os.path.join(RESULTS["out"], "model_bench.json"), "w") as fh:
        json.dump(RESULTS, fh, indent=1, default=float)
    for k, v in checks.items():
        log(f"  [{'PASS' if v else 'FAIL'}] len {max_len} {k}")
    return all(checks.values())


def _trees_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def replay_state_checks(model, report=lambda name, ok: None) -> dict:
    """Replay decode (model in replay mode, deterministic), bitwise on the device: the state after decoding the
    tokens of a sequence one by one == the state of a prefill of the same tokens (at a grid boundary, and off the
    grid); a second turn warmed by the first turn's cache (checkpoints inside the generated answer) == the same
    turn cold, recomputing at most one interval plus the new message; and, over the chunked prefill, the recurrent
    decode mode still differs. `report(name, ok)` is called as each check is decided."""
    rng = np.random.default_rng(5)
    V = model.config.vocab_size
    toks = rng.integers(0, V, 140).astype(np.int32)
    step = jaxgdn.model.jit(jaxgdn.decode_step)
    out = {}

    def put(name, ok):  # a check decided: kept and reported at once
        out[name] = bool(ok)
        report(name, out[name])

    ref128, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray(toks[None, :128]))
    ref140, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray(toks[None, :140]))
    modes = [(model, "replay")] + ([(model.with_decode_mode("recurrent"), "recurrent")]
                                   if model.gdn_prefill == "chunked" else [])
    for mdl, name in modes:
        st, _ = mdl.prefill_chunk(mdl.init_state(1, 192), jnp.asarray(toks[None, :50]))
        for pos in range(50, 140):
            st, _ = step(mdl, st, jnp.asarray(toks[pos:pos + 1]))
            if pos + 1 == 128:
                at128 = st
        if name == "replay":
            put("state after decoding to 128 == prefill to 128", _trees_equal(at128, ref128))
            put("state after decoding to 140 == prefill to 140", _trees_equal(st, ref140))
        else:  # over the chunked prefill only (over the token-by-token prefill the two modes may agree)
            put("recurrent decode mode: GDN state at 140 differs from prefill (expected)", not _trees_equal(
                jaxgdn.model.gdn_states(st), jaxgdn.model.gdn_states(ref140)))
    cache = jaxgdn.PrefixCache(interval=64, deterministic=True)
    turn1 = rng.integers(0, V, 90).tolist()
    first = jaxgdn.generate(model, [turn1], max_new_tokens=120, cache=cache)
    message = rng.integers(0, V, 20).tolist()
    turn2 = turn1 + first[0].tokens + message
    warm = jaxgdn.generate(model, [turn2], max_new_tokens=30, cache=first.cache)
    cold = jaxgdn.generate(model, [turn2], max_new_tokens=30, cache=cache)
    put(f"turn 2 warm == cold (cached {warm[0].cached_tokens} of {len(turn2)}, bound: recompute <= 64 + 20)",
        warm[0].tokens == cold[0].tokens and np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs))
        and len(turn2) - warm[0].cached_tokens <= 64 + len(message))
    return out


def scan_model(model):
    """Deterministic, replay decode over the token-by-token GDN prefill."""
    return model.with_deterministic().with_decode_mode("replay").with_gdn_prefill("recurrent")


def stage_replay_bitwise(model, prompt_len: int = 100, new_tokens: int = 210, batch: int = 4,
                         tag: str = "replay_bitwise"):
    """Replay decode, deterministic: generated logprobs == teacher-forced `jaxgdn.score`, bitwise, for 4 rows of
    different prompt lengths (100, 87, 74, 61) and for row 0 alone (== the same row in the batch); `new_tokens` each
    (210 by default: from 100 to 310, the generation crosses the grid boundaries at 128, 192, 256; until
    2026-12-02 the stage generated 140). Then `replay_state_checks`."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, model.config.vocab_size, prompt_len - 13 * i).tolist() for i in range(batch)]
    checks = RESULTS.setdefault(tag, {})

    def report(name, ok):  # logged as decided: a run cut by its time limit keeps what it had found
        checks[name] = bool(ok)
        log(f"  [{'PASS' if ok else 'FAIL'}] {tag} {name}")

    out = jaxgdn.generate(model, prompts, max_new_tokens=new_tokens, temperature=0.8, seed=list(range(batch)))
    scores = jaxgdn.score(model, [p + r.tokens for p, r in zip(prompts, out)], start=[len(p) for p in prompts])
    for i, (r, s) in enumerate(zip(out, scores)):
        report(f"row {i}: generate == score", np.array_equal(np.array(r.logprobs, np.float32), np.array(s, np.float32)))
    [alone] = jaxgdn.generate(model, prompts[:1], max_new_tokens=new_tokens, temperature=0.8, seed=0)
    report("row 0 alone == in batch", alone.tokens == out[0].tokens and bool(
        np.array_equal(np.array(alone.logprobs), np.array(out[0].logprobs))))
    replay_state_checks(model, report)
    return all(checks.values())


def timed_calls(run, reps: int):
    """(the first call's result, {first_s, median_s, times_s}): `run()` once (it compiles), then `reps` times."""
    t0 = time.perf_counter()
    out = run()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return out, dict(first_s=first, median_s=statistics.median(times), times_s=times)


def stage_shared_prompt(model, batch: int = 8, prompt_len: int = 4096, new_tokens: int = 16, reps: int = 3,
                        tag: str = "shared_prompt"):
    """`jaxgdn.generate` on `batch` requests of one prompt (k samples of a prompt, as RL rollouts draw them: the prompt
    prefilled once since 2026-12-05, its row copied) against `batch` distinct prompts of the same length, seeded
    sampling, the model as given (no cache): seconds per call, the median of `reps` calls after a first one that
    compiles. Also whether request 0 of the shared batch equals the same request alone (tokens and logprobs,
    bitwise: the model should be deterministic). Then `jaxgdn.score` of the shared batch's sequences from the
    prompt's end, with the prompt's prefill shared (the default) and apart: the times, and whether they are equal,
    bitwise."""
    rng = np.random.default_rng(5)
    V = model.config.vocab_size
    one = rng.integers(0, V, prompt_len).tolist()
    cases = {"distinct prompts": [rng.integers(0, V, prompt_len).tolist() for _ in range(batch)],
             "one prompt": [one] * batch}
    res = RESULTS.setdefault(tag, {})
    seeds = list(range(batch))
    outs = {}
    for name, prompts in cases.items():
        outs[name], res[name] = timed_calls(
            lambda: jaxgdn.generate(model, prompts, max_new_tokens=new_tokens, temperature=0.8, seed=seeds), reps)
        log(f"  {tag}: {name}, {batch} x {prompt_len} tokens + {new_tokens} new: {res[name]['median_s'] * 1e3:.1f} "
            f"ms per call (first, compiling: {res[name]['first_s']:.1f} s)")
    res["ratio"] = res["one prompt"]["median_s"] / res["distinct prompts"]["median_s"]
    [alone] = jaxgdn.generate(model, [one], max_new_tokens=new_tokens, temperature=0.8, seed=0)
    shared = outs["one prompt"][0]
    ok = alone.tokens == shared.tokens and bool(np.array_equal(np.array(alone.logprobs), np.array(shared.logprobs)))
    res["request 0 alone == in the shared batch"] = ok
    log(f"  {tag}: one prompt / distinct {res['ratio']:.3f}x; [{'PASS' if ok else 'FAIL'}] request 0 alone == in the "
        f"shared batch")
    # score: the shared batch's sequences (prompt + completion) from the prompt's end, the prompt's prefill shared
    # (the default) or each sequence prefilled apart (share_prefixes=False); the logprobs must be equal, bitwise
    seqs = [one + r.tokens for r in outs["one prompt"]]
    scores = {}
    for name, share in (("score, shared prefix", True), ("score, apart", False)):
        scores[name], res[name] = timed_calls(
            lambda: jaxgdn.score(model, seqs, start=prompt_len, batch_size=batch, share_prefixes=share), reps)
        log(f"  {tag}: {name}, {batch} x ({prompt_len} + {new_tokens}) tokens: {res[name]['median_s'] * 1e3:.1f} ms "
            f"per call (first, compiling: {res[name]['first_s']:.1f} s)")
    same = all(np.array_equal(np.array(a, np.float32), np.array(b, np.float32))
               for a, b in zip(scores["score, shared prefix"], scores["score, apart"]))
    res["score shared == apart"] = same
    ratio = res['score, shared prefix']['median_s'] / res['score, apart']['median_s']
    log(f"  {tag}: score shared / apart {ratio:.3f}x; "
        f"[{'PASS' if same else 'FAIL'}] the same logprobs, bitwise")
    return ok and same


def apply_default_config(defaults: dict, text: str, flag: str) -> dict:
    """A JSON dict of `defaults`' keys (a kernel's DEFAULT_CONFIG, e.g. `pallas_kernels.matmul`'s for --matmul-config
    or the chunked prefill's for --chunk-config), written into the defaults for this process: call it before anything
    is traced (the kernels read their defaults at trace time). Unknown keys or text that is not a JSON dict stop the
    run. Returns the resulting defaults."""
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag}: not JSON ({e}): {text!r}")
    if not isinstance(overrides, dict):
        raise SystemExit(f"{flag}: expected a JSON dict, got {text!r}")
    unknown = set(overrides) - set(defaults)
    if unknown:
        raise SystemExit(f"{flag}: unknown keys {sorted(unknown)}; known: {sorted(defaults)}")
    defaults.update(overrides)
    return dict(defaults)


def apply_matmul_config(text: str) -> dict:
    """--matmul-config (this script's and `gpu_sharding_bench.py`'s): `apply_default_config` on
    `pallas_kernels.matmul.DEFAULT_CONFIG`."""
    from pallas_kernels import matmul as _mm
    return apply_default_config(_mm.DEFAULT_CONFIG, text, "--matmul-config")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (faster compiles)")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--phases", choices=("mixed", "aligned"), default="mixed",
                    help="decode stages: rows' prompts of context - (23 b mod 64) tokens (mixed positions on the "
                         "64-token grid, the default since 2026-12-04) or all of `context` (aligned: every row at "
                         "a chunk's first row, as before)")
    ap.add_argument("--bitwise-lengths", default="512,4096")
    ap.add_argument("--bitwise-max-tokens", type=int, default=65536, help="largest batch * length in the bitwise stage")
    ap.add_argument("--bitwise-batches", default=",".join(map(str, BITWISE_BATCHES)),
                    help="the bitwise stage's batch sizes (comma list of positive ints)")
    ap.add_argument("--stages", default="ceilings,prefill,decode,det,replay,bitwise,replay_bitwise",
                    help="comma list, run in this order; also 'shared_prompt' (generate on k copies of one "
                         "prompt against k distinct prompts), 'prefill_ragged' (a batch of mixed lengths "
                         "with and without the kernels skipping chunks of padding, normal and deterministic), "
                         "'profile' (decode kernel times, normal and "
                         "deterministic), 'replay_profile' (the same for replay decode and deterministic "
                         "recurrent decode) and 'prefill_profile' (the same for a prefill)")
    ap.add_argument("--ragged-batch", type=int, default=8, help="prefill_ragged stage: rows per call")
    ap.add_argument("--ragged-tokens", type=int, default=4096,
                    help="prefill_ragged stage: the longest row (row b holds about (b + 1) / B of it)")
    ap.add_argument("--replay-tokens", type=int, default=210,
                    help="tokens each row generates in the replay_bitwise stages (issue 7 asks for >= 200)")
    ap.add_argument("--shared-batch", type=int, default=8, help="shared_prompt stage: requests per call")
    ap.add_argument("--shared-prompt-len", type=int, default=4096, help="shared_prompt stage: prompt tokens")
    ap.add_argument("--distinct-layers", action="store_true", help="draw every layer's weights (slow to build)")
    ap.add_argument("--matmul-config", default="", help="JSON dict overriding pallas_kernels.matmul.DEFAULT_CONFIG "
                    "(the deterministic mode's matmul tiling policy) for this run")
    ap.add_argument("--chunk-config", default="", help="JSON dict overriding pallas_kernels.gated_delta.chunk."
                    "DEFAULT_CONFIG (the chunked prefill's and replay step's kernels, e.g. '{\"output\": \"mosaic\"}') "
                    "for this run")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.phases == "mixed" and args.context < 64:
        ap.error(f"--phases mixed needs --context >= 64 (row b's prompt is context - (23 b mod 64)); got "
                 f"{args.context}")
    if args.ragged_batch < 1 or args.ragged_tokens < 1:
        ap.error(f"--ragged-batch and --ragged-tokens must be positive; got {args.ragged_batch}, {args.ragged_tokens}")
    try:
        bitwise_batches = tuple(int(b) for b in args.bitwise_batches.split(","))
    except ValueError:
        bitwise_batches = ()
    if not bitwise_batches or min(bitwise_batches) < 1:
        ap.error(f"--bitwise-batches: a comma list of positive ints; got {args.bitwise_batches!r}")
    model = bw = rate = None  # set below, after the stage names are checked; the stages read them when they run
    # the decode stages' rows at the phases --phases names
    decode = functools.partial(stage_decode, phases=args.phases)
    profile = functools.partial(stage_profile, phases=args.phases)
    named = dict([
        ("digest", lambda: stage_digest(model, bw)),
        ("prefill", lambda: stage_prefill(model, args.prefill_tokens, rate, "normal")),
        ("decode", lambda: decode(model, args.decode_batch, args.context, bw, "normal")),
        ("det", lambda: (stage_prefill(model.with_deterministic(), args.prefill_tokens, rate, "deterministic"),
                         decode(model.with_deterministic(), args.decode_batch, args.context, bw,
                                "deterministic"))),
        ("replay", lambda: decode(model.with_deterministic().with_decode_mode("replay"), args.decode_batch,
                                  args.context, bw, "replay")),
        # gdn_prefill="recurrent": the GDN prefill token by token with the decode arithmetic; replay decode is then
        # one recurrent step (and any prefill split is exact)
        ("scan", lambda: (stage_prefill(scan_model(model), args.prefill_tokens, rate, "deterministic_scan"),
                          decode(scan_model(model), args.decode_batch, args.context, bw, "replay_scan"))),
        ("scan_bitwise", lambda: stage_replay_bitwise(scan_model(model), new_tokens=args.replay_tokens,
                                                      tag="replay_scan_bitwise")),
        ("bitwise", lambda: [stage_bitwise(model.with_deterministic(), int(n), args.bitwise_max_tokens,
                                           bitwise_batches) for n in args.bitwise_lengths.split(",")]),
        ("replay_bitwise", lambda: stage_replay_bitwise(model.with_deterministic().with_decode_mode("replay"),
                                                        new_tokens=args.replay_tokens)),
        ("shared_prompt", lambda: stage_shared_prompt(model.with_deterministic(), args.shared_batch,
                                                      args.shared_prompt_len)),
        ("prefill_ragged", lambda: (stage_prefill_ragged(model, args.ragged_batch, args.ragged_tokens, "normal"),
                                    stage_prefill_ragged(model.with_deterministic(), args.ragged_batch,
                                                         args.ragged_tokens, "deterministic"))),
        ("prefill_profile", lambda: (stage_prefill_profile(model, args.prefill_tokens, "normal"),
                                     stage_prefill_profile(model.with_deterministic(), args.prefill_tokens,
                                                           "deterministic"))),
        ("profile", lambda: (profile(model, args.decode_batch, args.context, "normal"),
                             profile(model.with_deterministic(), args.decode_batch, args.context,
                                     "deterministic"))),
        # replay decode's step by kernel beside deterministic recurrent decode's: the replay kernels against the
        # XLA glue around them (the open chunk's row scatters and the q / k / v slices handed to the step)
        ("replay_profile", lambda: (profile(model.with_deterministic().with_decode_mode("replay"),
                                            args.decode_batch, args.context, "replay"),
                                    profile(model.with_deterministic(), args.decode_batch, args.context,
                                            "deterministic"))),
    ])
    unknown = set(args.stages.split(",")) - set(named) - {"ceilings"}  # ceilings: always measured
    if unknown:  # before any device work: a typo must not cost a model build
        raise SystemExit(f"unknown stages {sorted(unknown)}; known: ceilings, {', '.join(named)}")
    small = args.preset.startswith("tiny")
    if args.matmul_config:  # before anything is traced (the kernel reads its defaults at trace time)
        RESULTS["matmul_config"] = apply_matmul_config(args.matmul_config)
    if args.chunk_config:
        from pallas_kernels.gated_delta import chunk as _chunk
        RESULTS["chunk_config"] = apply_default_config(_chunk.DEFAULT_CONFIG, args.chunk_config, "--chunk-config")
    RESULTS.update(device=str(jax.devices()[0]), jax=jax.__version__, date=datetime.date.today().isoformat(),
                   host=platform.node(), preset=args.preset, layers=args.layers, out=args.out)
    log(f"device {jax.devices()[0]}, jax {jax.__version__}, preset {args.preset}, layers {args.layers or 'all'}")
    os.makedirs(args.out, exist_ok=True)
    bw, rate = ceilings(small)
    t0 = time.time()
    model = build(args.preset, args.layers, distinct=args.distinct_layers)
    log(f"built {param_bytes(model.params) / 1e9:.2f} GB of bf16 parameters in {time.time() - t0:.1f}s")
    for name, fn in [(n, named[n]) for n in args.stages.split(",") if n in named]:  # in the order given
        t1 = time.time()
        try:
            fn()
        except Exception as e:  # one broken stage must not hide the others
            traceback.print_exc()
            RESULTS["errors"].append(f"{name}: {type(e).__name__}: {e}"[:2000])
        log(f"  ({name}: {time.time() - t1:.0f}s)")
        with open(os.path.join(args.out, "model_bench.json"), "w") as fh:
            json.dump(RESULTS, fh, indent=1, default=float)
    if "decode_normal" in RESULTS and "decode_deterministic" in RESULTS:
        r = RESULTS["decode_normal"]["step_s_in_loop"] / RESULTS["decode_deterministic"]["step_s_in_loop"]
        log(f"deterministic/normal decode throughput {r:.2f}")
    for tag in ("replay", "replay_scan"):
        for base in ("normal", "deterministic"):
            if f"decode_{base}" in RESULTS and f"decode_{tag}" in RESULTS:
                r = RESULTS[f"decode_{tag}"]["step_s_in_loop"] / RESULTS[f"decode_{base}"]["step_s_in_loop"]
                log(f"{tag} / {base} recurrent decode step time {r:.2f}")
    for tag in ("deterministic", "deterministic_scan"):
        if "prefill_normal" in RESULTS and f"prefill_{tag}" in RESULTS:
            r = RESULTS["prefill_normal"]["seconds"] / RESULTS[f"prefill_{tag}"]["seconds"]
            log(f"{tag}/normal prefill throughput {r:.2f}")
    log("errors: " + ("; ".join(RESULTS["errors"]) or "none"))


if __name__ == "__main__":
    main()
