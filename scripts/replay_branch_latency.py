"""The replay step's kernels, one block row at a time: each kernel's device time per step when every row of the batch
has its new token in the same block row i of the open chunk (row 16 i + 8: kernel 1's branch i), at a batch small
enough that each program has an SM to itself (B = 4: 128 programs of kernel 1 on 132 SMs), so that a kernel's time
is one program's latency; and at B = 64, where the programs queue (two per SM for kernel 1).

Why: issue 7's step time is mostly kernel 1's (`docs/speed_gaps.md`), a chain at two programs per SM, and with the
batch's rows at mixed positions (as `gpu_kernels.py`'s replay timing puts them) its time is that of the mix of
branches. Run 198's small batches (`gpu_kernels.py --replay-batches 2,4,8,16`) had kernel 1 at 7.1 µs per step for
a batch whose rows reach block row 2 and 21.0 for one that reaches block row 3; this says which branch costs what.

  PYTHONPATH=.:scripts python3 scripts/replay_branch_latency.py [--batches 4,64] [--config '{"replay_kd": "fold"}']

(--config: a chunk-config variant timed after the default, in the same process.) Run 198 (an H100, BENCHMARKS.md)
timed the default and a variant storing kd before the chain (branch `experiment/s57-kd-first`): the same times.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

BRANCH_ROW = 8  # the new token's row in its block row


def branch_times(B: int, cfg, nstep: int = 8) -> dict[int, dict[str, float]]:
    """{block row i: {kernel name: device µs per step}} with every row's new token at row 16 i + BRANCH_ROW."""
    from pallas_kernels.gated_delta import replay as rp
    from scripts.gpu_kernels import open_chunk_inputs, replay_step_loop
    from scripts.gpu_model_bench import profiled_kernels

    q, k, v, g, beta, s0, _ = open_chunk_inputs(B, seed=B + 11)
    q_src, k_src = q[:, ::-1] + 0, k[:, ::-1] + 0
    out = {}
    for i in range(4):
        lengths = jnp.full((B,), 16 * i + BRANCH_ROW + 1, jnp.int32)
        xc, vc = rp.chunk_replay_prime_pallas(q, k, v, g, beta, s0, lengths - 1, config=cfg)
        loop = replay_step_loop(cfg, lengths, nstep)
        per = profiled_kernels(lambda: loop(v, g, beta, q_src, k_src, (s0 + 0, xc + 0, vc + 0, q + 0, k + 0)), 12)
        out[i] = {n: t / nstep for n, t, _ in per if n.startswith("gdn_replay")}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="4,64", help="comma list of batch sizes")
    ap.add_argument("--config", default="", help="a chunk-config variant (JSON object) timed after the default")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where branch_latency.json goes")
    args = ap.parse_args(argv)
    configs = {"default": None}
    if args.config:
        try:
            variant = json.loads(args.config)
        except json.JSONDecodeError:
            variant = None
        if not isinstance(variant, dict):
            raise SystemExit(f"--config {args.config!r}: expected a JSON object")
        configs[args.config] = variant
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches {args.batches!r}: expected a comma list of integers") from None
    device = jax.devices()[0].device_kind
    print(f"backend {jax.default_backend()} ({device})")
    rows = []
    for B in batches:
        for name, cfg in configs.items():
            for i, kernels in branch_times(B, cfg).items():
                rows.append(dict(B=B, config=name, block_row=i, row=16 * i + BRANCH_ROW, kernels_us=kernels))
                print(f"B={B} [{name}] block row {i} (new token at row {16 * i + BRANCH_ROW}): "
                      + ", ".join(f"{n} {t:.1f} us" for n, t in sorted(kernels.items())), flush=True)
    with open(os.path.join(args.out, "branch_latency.json"), "w") as f:
        json.dump(dict(device=device, argv=sys.argv, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
