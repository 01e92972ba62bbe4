"""One call of a gated delta rule kernel, for Nsight Compute on the GPU machine.

  # the token-by-token prefill kernel (`pallas_kernels.gated_delta.scan`)
  PYTHONPATH=. ncu --kernel-name regex:scan --launch-skip 1 --launch-count 1 --set full \
      python3 scripts/gpu_profile.py [--shape 1,2048,16,32] [--dims 128,128] [--config '{"bv":16,"num_warps":1}']
  # the chunked prefill's three kernels (`pallas_kernels.gated_delta.chunk`: prep, recurrence, output)
  PYTHONPATH=. ncu --kernel-name regex:gdn_chunk --launch-skip 3 --launch-count 3 --section SpeedOfLight \
      --section LaunchStats --section Occupancy --section WarpStateStats \
      python3 scripts/gpu_profile.py --kernel chunk --shape 8,4096,16,32

  # the replay step's four kernels (`pallas_kernels.gated_delta.replay`: prep, intra, out, state), B rows at mixed
  # phases (run 63: --clock-control none, as the machine's notes ask)
  PYTHONPATH=. ncu --clock-control none --kernel-name regex:gdn_replay --launch-skip 4 --launch-count 4 \
      --section SpeedOfLight --section LaunchStats --section Occupancy \
      python3 scripts/gpu_profile.py --kernel replay --shape 64,64,16,32

(--launch-skip / --launch-count 3: the chunked prefill's three kernels; prep_kernels=2 launches four, the fused
design two. The replay step: T is the open chunk (64); lengths 1..64 at random, or every row --replay-length tokens,
e.g. 57 for kernel 1's last block row alone, and B = 4 so that each of its programs has an SM: one program's latency.)
Runs the kernel(s) twice on random Qwen3.5-shaped inputs (the first call compiles and warms up; profile the second)
and prints the wall time of a third call, so the profile can be matched to a timing.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.replay import chunk_replay_step_pallas, replay_caches
from pallas_kernels.gated_delta.scan import fused_recurrent_gated_delta_rule_pallas


def replay_step(q, k, v, g, beta, *, config, length=0):
    """One replay step over open chunks of random lengths 1..64 (every row `length` tokens, if given) from a random
    boundary state, empty caches (the timing of a step does not depend on the caches' values)."""
    B, _, HV, V = v.shape
    s0 = jax.random.normal(jax.random.PRNGKey(1), (B, HV, k.shape[-1], V), jnp.float32) * 0.1
    lengths = (jnp.full((B,), length, jnp.int32) if length else jax.random.randint(jax.random.PRNGKey(2), (B,), 1, 65))
    return chunk_replay_step_pallas(q, k, v, g, beta, s0, *replay_caches(B, HV, V), lengths, config=config)


KERNELS = {"scan": fused_recurrent_gated_delta_rule_pallas, "chunk": chunk_gated_delta_rule_pallas,
           "replay": replay_step}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=sorted(KERNELS), default="scan")
    ap.add_argument("--shape", default="1,2048,16,32", help="B,T,HK,HV")
    ap.add_argument("--dims", default="128,128", help="K,V: the heads' key and value sizes")
    ap.add_argument("--config", default="", help="JSON launch configuration (the kernel module's DEFAULT_CONFIG keys)")
    ap.add_argument("--replay-length", type=int, default=0,
                    help="--kernel replay: every row's open chunk this many tokens long (1..64; default random)")
    args = ap.parse_args()
    if not 0 <= args.replay_length <= 64 or (args.replay_length and args.kernel != "replay"):
        ap.error(f"--replay-length {args.replay_length}: 1..64 tokens, with --kernel replay only")
    B, T, HK, HV = (int(x) for x in args.shape.split(","))
    K, V = (int(x) for x in args.dims.split(","))
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(ks[0], (B, T, HK, K), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, HK, K), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, HV, V), jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (B, T, HV)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (B, T, HV)))
    config = json.loads(args.config) if args.config else None
    kernel = KERNELS[args.kernel]
    if args.kernel == "replay" and args.replay_length:
        kernel = functools.partial(replay_step, length=args.replay_length)
    f = jax.jit(lambda *x: kernel(*x, config=config))
    for _ in range(2):
        jax.block_until_ready(f(q, k, v, g, beta))
    t = time.perf_counter()
    jax.block_until_ready(f(q, k, v, g, beta))
    ms = (time.perf_counter() - t) * 1e3
    print(f"{args.kernel} {args.shape} K,V {K},{V} config {config}: {ms:.2f} ms (one call, host-timed)")


if __name__ == "__main__":
    main()
