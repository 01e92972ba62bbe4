"""One token-by-token prefill call (`pallas_kernels.gated_delta.scan`), for Nsight Compute on the GPU machine.

  PYTHONPATH=. ncu --kernel-name regex:scan --launch-skip 1 --launch-count 1 --set full \
      python3 scripts/gpu_profile_scan.py [--shape 1,2048,16,32] [--config '{"bv":16,"num_warps":1}']

Runs the kernel twice on random Qwen3.5-shaped inputs (the first launch compiles and warms up; profile the second)
and prints the wall time of a third call, so the profile can be matched to a timing.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.scan import fused_recurrent_gated_delta_rule_pallas


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,2048,16,32", help="B,T,HK,HV (K = V = 128)")
    ap.add_argument("--config", default="", help="JSON launch configuration (scan.DEFAULT_CONFIG keys)")
    args = ap.parse_args()
    B, T, HK, HV = (int(x) for x in args.shape.split(","))
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(ks[0], (B, T, HK, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HK, 128), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HV, 128), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    config = json.loads(args.config) if args.config else None
    f = jax.jit(lambda *x: fused_recurrent_gated_delta_rule_pallas(*x, config=config))
    for _ in range(2):
        jax.block_until_ready(f(q, k, v, g, beta))
    t = time.perf_counter()
    jax.block_until_ready(f(q, k, v, g, beta))
    print(f"scan {args.shape} config {config}: {(time.perf_counter() - t) * 1e3:.2f} ms (one call, host-timed)")


if __name__ == "__main__":
    main()
