"""Which deterministic-mode component loses batch invariance on a tensor-parallel GPU mesh.

  PYTHONPATH=. python3 scripts/gpu_mesh_invariance.py [--tp 2] [--cpu] [--model [--jit jaxgdn,plain]]

With --model, also the deterministic model (the first 4 layers of the 9B shape on a GPU): its first GDN layer step
by step (embedding, norm, each projection, gates, conv, the GDN kernel), then every layer's state, row alone vs in
a batch — the first step that differs names the cause. Each is compiled once per `--jit` variant: "jaxgdn"
(`jaxgdn.model.jit`: `COMPILER_OPTIONS`, no excess precision — what the library's own entry points use) and "plain"
(`jax.jit` with XLA's defaults, which let a fusion keep bf16 intermediates in fp32).

Each component of deterministic mode that runs per shard (`pallas_kernels.api`: the fixed-tile matmul split by
columns and by rows, the attention kernel split by heads) — and the row-split product's all-reduce alone — is
called under the mesh on random bf16 inputs of the Qwen3.5-9B shapes: rows computed alone (M = 1 and 7) must
equal the same rows inside a larger call (2048 rows for the matmuls), bitwise. Prints PASS / FAIL per component.
On CPU (`--cpu`, with XLA_FLAGS=--xla_force_host_platform_device_count=2) with interpret-mode kernels.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxgdn import sharding as S
from pallas_kernels import api


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--model", action="store_true", help="also bisect the deterministic model by layer states")
    ap.add_argument("--jit", default="jaxgdn,plain", help="--model: compile with jaxgdn.model.jit and/or jax.jit")
    args = ap.parse_args()
    backend = "interpret" if args.cpu else "pallas"
    mesh = S.make_mesh(args.tp)
    ks = jax.random.split(jax.random.PRNGKey(0), 8)
    fails = []

    def check(name, full, part_fn):
        ok = all(np.array_equal(np.asarray(part_fn(m)), np.asarray(full)[-m:]) for m in (1, 7))
        print(f"[{'PASS' if ok else 'FAIL'}] {name}", flush=True)
        if not ok:
            fails.append(name)

    with jax.set_mesh(mesh):
        # the last: the GDN a/b gate projections (per shard N = 16, K split in 16 slices); calls of 2048 rows take
        # the matmul's many-row tiling, rows alone the few-row one
        for (K, N, how, groups) in [(4096, 12288, "col", 12288), (12288, 4096, "row", 12288),
                                    (4096, 4096, "row", 32), (4096, 8192, "col", 16), (4096, 32, "col", 16)]:
            w = (jax.random.normal(ks[0], (K, N), jnp.float32) * 0.02).astype(jnp.bfloat16)
            w = jax.device_put(w, NamedSharding(mesh, P(None, "tp") if how == "col" else P("tp", None)))
            x = jax.random.normal(ks[1], (2048, K), jnp.bfloat16)
            kw = dict(col_groups=groups) if how == "col" else dict(row_groups=groups)
            f = jax.jit(lambda x, w, kw=kw: api.matmul_invariant(x, w, backend=backend, **kw))
            full = f(x, w)
            check(f"matmul {how}-split K={K} N={N}", full, lambda m: f(x[-m:], w))

        # the all-reduce alone: fp32 partials [M, N] summed over the mesh
        def red(p):
            return jax.shard_map(lambda a: jax.lax.psum(a, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P(),
                                 check_vma=False)(p)
        p = jax.random.normal(ks[2], (args.tp, 512, 4096), jnp.float32)
        fr = jax.jit(lambda p: red(p.reshape(-1, 4096)))
        full = fr(p)
        check("psum of fp32 partials [M, 4096]", full, lambda m: fr(p[:, -m:]))

        H, HKV, Dh = 16, 4, 256
        for decode, T, Ncap in [(False, 512, 512), (True, 1, 1088)]:
            B = 1 if not decode else 64
            q = jax.random.normal(ks[3], (B, T, H, Dh), jnp.bfloat16)
            kc = jax.random.normal(ks[4], (B, Ncap, HKV, Dh), jnp.bfloat16)
            vc = jax.random.normal(ks[5], (B, Ncap, HKV, Dh), jnp.bfloat16)
            pos = (jnp.full((B, T), 1000, jnp.int32) if decode
                   else jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
            fa = jax.jit(lambda q, kc, vc, pos, d=decode: api.attention_invariant(q, kc, vc, pos, decode=d,
                                                                                  backend=backend))
            full = np.asarray(fa(q, kc, vc, pos))
            if decode:  # rows of the batch alone
                ok = all(np.array_equal(np.asarray(fa(q[b:b + 1], kc[b:b + 1], vc[b:b + 1], pos[b:b + 1]))[0],
                                        full[b]) for b in (0, 5, 63))
            else:  # the last queries alone (a continuation over the same cache)
                ok = all(np.array_equal(np.asarray(fa(q[:, -m:], kc, vc, pos[:, -m:])), full[:, -m:])
                         for m in (1, 65))
            name = f"attention {'decode' if decode else 'prefill'} per shard"
            print(f"[{'PASS' if ok else 'FAIL'}] {name}", flush=True)
            if not ok:
                fails.append(name)
        # the GDN chunk kernel per shard (heads split): row 0 alone == row 0 of a batch with a padded second row
        from tests.gdn_oracle import random_gdn_inputs
        d = random_gdn_inputs(np.random.default_rng(1), 2, 256, 16, 32, 128, 128, np.float32)
        a = [jnp.asarray(d[n], jnp.bfloat16 if n in "qkv" else jnp.float32) for n in ("q", "k", "v", "g", "beta")]
        fc = jax.jit(lambda *x, n: api.chunk_gated_delta_rule(*x, lengths=n, backend=backend))
        o2, s2 = fc(*a, n=jnp.asarray([256, 100], jnp.int32))
        o1, s1 = fc(*(x[:1] for x in a), n=jnp.asarray([256], jnp.int32))
        ok = np.array_equal(np.asarray(o1)[0], np.asarray(o2)[0]) and np.array_equal(np.asarray(s1)[0],
                                                                                   np.asarray(s2)[0])
        print(f"[{'PASS' if ok else 'FAIL'}] GDN chunk kernel per shard", flush=True)
        if not ok:
            fails.append("chunk")
    if args.model:
        import jaxgdn.model

        jits = {"jaxgdn": jaxgdn.model.jit, "plain": jax.jit}
        for name in args.jit.split(","):
            print(f"== model, compiled with {name} jit", flush=True)
            fails += [f"{name} jit: {f}" for f in model_bisect(mesh, args.cpu, jits[name])]
    print(f"FAILS: {fails}")


def layer0_bisect(sm, mesh, target, rng, jit):
    """The first GDN layer's intermediate values, step by step as `jaxgdn.layers.gdn.gdn_prefill` computes them,
    for the target row alone vs as row 0 of a batch of 2: the embedding, the input norm, the q/k/v, a, b, z
    projections, the gates, the conv, the GDN kernel's output and state (the model's own backend throughout)."""
    import pallas_kernels
    from jaxgdn.config import LINEAR
    from jaxgdn.layers import gdn as G
    from jaxgdn.layers.conv import causal_conv1d
    from jaxgdn.layers.norm import rms_norm
    from jaxgdn.model import _det

    cfg, p = sm.config, sm.params
    i = cfg.layer_types.index(LINEAR)
    lp = p.layers[i]
    det = _det(sm)  # the backend deterministic mode's products run on, as in the model
    T = len(target)

    def steps(tokens):
        B = tokens.shape[0]
        lengths = jnp.full((B,), T, jnp.int32)
        out = {}
        x = p.embed[tokens].astype(sm.dtype)
        out["embedding"] = x
        h = rms_norm(x, lp.input_norm, cfg.rms_norm_eps)
        out["input norm"] = h
        proj = G._input_projection(cfg, h, det)
        out["qkv projection"] = pre = proj(lp.mixer.in_proj_qkv)
        out["a projection"] = a = proj(lp.mixer.in_proj_a)
        out["b projection"] = b = proj(lp.mixer.in_proj_b)
        out["z projection"] = proj(lp.mixer.in_proj_z)
        g, beta = pallas_kernels.gdn_gates(lp.mixer.A_log, a, lp.mixer.dt_bias, b)
        out["g"], out["beta"] = g, beta
        state0 = jnp.zeros((B, cfg.linear_conv_kernel_dim - 1, pre.shape[-1]), pre.dtype)
        conv = causal_conv1d(pre, state0, lp.mixer.conv_weight, lengths)
        out["conv output"] = conv[0]
        q, k, v = G._split_qkv(cfg, conv[0])
        o, st = pallas_kernels.chunk_gated_delta_rule(q, k, v, g, beta, lengths=lengths, backend=sm.backend)
        out["GDN kernel output"], out["GDN kernel state"] = o, st
        return out

    f = jit(steps)
    other = rng.integers(0, cfg.vocab_size, T).astype(np.int32)
    with jax.set_mesh(mesh):
        alone = f(jnp.asarray(target[None]))
        batch = f(jnp.asarray(np.stack([target, other])))
    fails = []
    order = ["embedding", "input norm", "qkv projection", "a projection", "b projection", "z projection", "g", "beta",
             "conv output", "GDN kernel output", "GDN kernel state"]
    for name in order:
        x, y = np.asarray(alone[name])[0], np.asarray(batch[name])[0]
        ok = np.array_equal(x, y)
        where = ""
        if not ok:
            where = f" (max {float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()):.1e}"
            if x.shape[0] == T:  # per-token values: the first token that differs
                where += f"; first differing token {int(np.argwhere((x != y).reshape(T, -1).any(1))[0, 0])}"
            where += ")"
        print(f"[{'PASS' if ok else 'FAIL'}] layer {i} step '{name}': row alone == row 0 of a batch of 2{where}",
              flush=True)
        if not ok:
            fails.append(f"layer0 {name}")
    return fails


def model_bisect(mesh, cpu, jit):
    """Deterministic model (first 4 layers of the 9B shape on GPU — 3 GDN + 1 attention — the tiny one on CPU) on
    the mesh: a row alone vs the same row inside batches of 2 and 8 (other rows shorter): the first layer whose
    state differs, and which leaf."""
    import dataclasses

    from jaxgdn import Model
    from jaxgdn.config import PRESETS
    from jaxgdn.init import random_params
    from jaxgdn.model import prefill_chunk

    cfg = PRESETS["tiny" if cpu else "qwen3.5-9b"]()
    cfg = dataclasses.replace(cfg, layer_types=cfg.layer_types[:4])
    dt = jnp.float32 if cpu else jnp.bfloat16
    m = Model(params=jax.jit(lambda k: random_params(cfg, k, dt))(jax.random.key(0)), config=cfg, dtype=dt,
              backend="interpret" if cpu else None, deterministic=True)
    sm = S.shard_model(m, mesh)
    rng = np.random.default_rng(0)
    W = 256
    target = rng.integers(0, cfg.vocab_size, W).astype(np.int32)
    f = jit(prefill_chunk)

    def run(rows):
        toks = np.zeros((len(rows), W), np.int32)
        for i, r in enumerate(rows):
            toks[i, :len(r)] = r
        with jax.set_mesh(mesh):
            st, lg = f(sm, S.init_state(sm, len(rows), W + 64), jnp.asarray(toks),
                       jnp.asarray([len(r) for r in rows], jnp.int32))
        return st, np.asarray(lg)

    fails = layer0_bisect(sm, mesh, target, rng, jit)
    s1, l1 = run([target])
    for B, full in ((2, True), (2, False), (8, False)):
        rows = [target] + [rng.integers(0, cfg.vocab_size, W if full else int(rng.integers(1, W))).astype(np.int32)
                           for _ in range(B - 1)]
        s2, l2 = run(rows)
        diffs = []
        for i, (a, b) in enumerate(zip(s1.layers, s2.layers)):
            for name, x, y in zip(a._fields, a, b):
                if x is None:
                    continue
                x, y = np.asarray(x, np.float64)[0], np.asarray(y, np.float64)[0]
                if not np.array_equal(x, y):
                    diffs.append(f"layer {i} {type(a).__name__}.{name} (max {float(np.abs(x - y).max()):.1e})")
        ok = np.array_equal(l1[0], l2[0]) and not diffs
        print(f"[{'PASS' if ok else 'FAIL'}] model B={B} ({'full' if full else 'shorter'} other rows): logits "
              f"{'equal' if np.array_equal(l1[0], l2[0]) else 'differ'}; differing states: {diffs[:6]}", flush=True)
        if not ok:
            fails.append(f"model B={B}")
    return fails


if __name__ == "__main__":
    main()
