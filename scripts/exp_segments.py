"""Experiment (run 142): the chunked prefill as S chained calls on the 64 grid, under jaxgdn's COMPILER_OPTIONS
(XLA's concurrent command-buffer schedule) and plain jax.jit. In the data, segment s + 1's prep and segment s's
output do not depend on segment s's recurrence, so the concurrent schedule could run them beside it (the
recurrence at B = 1 fills 64 of the H200's 132 SMs). Prints each variant's median and whether its bits equal the
one call's.

  PYTHONPATH=. python3 scripts/exp_segments.py
"""
import sys, time
import jax, jax.numpy as jnp, numpy as np
from jaxgdn.model import COMPILER_OPTIONS
from pallas_kernels import api

def inputs(B, T, HK, HV, K=128, V=128, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, HK, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HK, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HV, V), jnp.bfloat16)
    g = jax.nn.log_sigmoid(jax.random.normal(ks[3], (B, T, HV), jnp.float32) + 3.0) * 0.5
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV), jnp.float32)).astype(jnp.bfloat16)
    return q, k, v, g, beta

def segmented(S):
    def f(q, k, v, g, beta):
        T = q.shape[1]; L = T // S
        st = None; outs = []
        for s in range(S):
            sl = slice(s * L, (s + 1) * L)
            o, st = api.chunk_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=st)
            outs.append(o)
        return jnp.concatenate(outs, axis=1), st
    return f

def timeit(f, args, n=30):
    r = f(*args); jax.block_until_ready(r)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); jax.block_until_ready(f(*args)); ts.append(time.perf_counter() - t0)
    # back-to-back: 10 calls, one sync
    t0 = time.perf_counter()
    for _ in range(10): r = f(*args)
    jax.block_until_ready(r); b2b = (time.perf_counter() - t0) / 10
    return np.median(ts) * 1e3, b2b * 1e3, r

for (B, T, HK, HV) in [(1, 32768, 16, 32), (8, 4096, 16, 32), (1, 8192, 16, 32)]:
    args = inputs(B, T, HK, HV)
    base = None
    for opts_name, opts in [("concurrent", COMPILER_OPTIONS), ("plain", None)]:
        for S in ([1, 2, 4, 8] if T >= 8192 else [1, 2, 4]):
            f = jax.jit(segmented(S), compiler_options=opts) if opts else jax.jit(segmented(S))
            med, b2b, r = timeit(f, args)
            if base is None: base = r
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(r, base))
            print(f"B={B} T={T} {opts_name:10s} S={S}: median {med:.3f} ms, back-to-back {b2b:.3f} ms, "
                  f"bits == one call: {same}", flush=True)
