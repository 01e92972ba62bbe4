"""Where the replay step's values first leave the chunked prefill's (`pallas_kernels/gated_delta/replay.py`).

Rows are prefilled to different lengths (the chunked kernels to the last grid boundary, `prime` on the rest), then
decoded step by step with the replay step; one chunked prefill of every row's whole sequence is the reference. At
each step, before the step runs, the boundary state it reads is compared with the prefill's state at that chunk's
start (and after the last step, the state it leaves); after it, the v_new row it wrote (kernel 3's, read from its
cache; for a row whose chunk completes, from a run of the same step stopped after kernel 3: `stop_after="out"`,
since kernel 4 clears the cache) with the prefill recurrence's v_new of that position. The inputs are those of
`gpu_kernels.py --only replay_step` (bf16 q / k / v, realistic gates). Prints the counts, the first few
differences and their sizes; exits 1 if any value differs.

  PYTHONPATH=. python3 scripts/replay_diff.py --dims 16,16            # on the GPU
  PYTHONPATH=. python3 scripts/replay_diff.py --interpret --heads 1,2 --steps 70   # on CPU: the kernels interpreted
  ... --config '{"bv_replay": 16}'   # the replay step (and its priming) with other chunk.DEFAULT_CONFIG keys

On the H200 at K = V = 16 (BENCHMARKS.md, run 97, 2026-12-02) every v_new row of each row's first open chunk, the
completing row's included, equalled the prefill's, and every boundary state kernel 4 folded differed (~40% of the
elements, by an ulp): from there on the decoded rows differ. Runs 100-101 (a scratch probe) narrowed it to the
fold's kd^T v_new dot itself: kernel 4's kd and the v_new rows it reads equal the prefill's, its dot's result does
not, with 1, 2 or 4 warps for kernel 4. Run 102's SASS showed the two dots grouping the k axis into different HMMA
k-steps; since run 103 kernel 4 loads kernel 1's kd as the recurrence loads its own (`replay_kd="prep"`) and nothing
differs at K = V = 16 (`--config '{"replay_kd": "fold"}'` runs the form before).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import numpy as np

import jax
import jax.numpy as jnp


def open_window(x, start, n):
    """Rows start[b] .. start[b] + 63 of x [B, T, ...] per row, zero from n[b] on (the step's open chunk), by the
    model's own row gather."""
    from jaxgdn.layers.gdn import _gather_rows

    rows = jnp.arange(64)[None, :]
    return _gather_rows(x, start[:, None] + rows, rows < n[:, None])


def main(argv=None) -> int:
    from pallas_kernels.gated_delta import replay as rp
    from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
    from tests.gdn_oracle import random_gdn_inputs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="16,16", help="K,V: the key and value head sizes")
    ap.add_argument("--heads", default="16,32", help="HK,HV")
    ap.add_argument("--prompts", default="70,37,128,5", help="each row's prompt length")
    ap.add_argument("--steps", type=int, default=140, help="replay steps per row")
    ap.add_argument("--interpret", action="store_true", help="the Pallas kernels in interpret mode (CPU)")
    ap.add_argument("--show", type=int, default=8, help="how many differences to print per kind")
    ap.add_argument("--config", default="", help="JSON: the replay step's config (chunk.DEFAULT_CONFIG keys; the "
                    "prefill keeps its default)")
    args = ap.parse_args(argv)
    step_cfg = json.loads(args.config) if args.config else {}
    K, V = (int(x) for x in args.dims.split(","))
    HK, HV = (int(x) for x in args.heads.split(","))
    prompt = np.array([int(x) for x in args.prompts.split(",")])
    if args.steps < 1 or prompt.min() < 1:
        raise SystemExit("--steps and every prompt length must be >= 1")
    interp = args.interpret
    B, T = len(prompt), int(prompt.max()) + args.steps
    x = random_gdn_inputs(np.random.default_rng(11), B, T, HK, HV, K, V, with_state=False)
    q, k, v = (jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v"))
    g, beta = (jnp.asarray(x[n], jnp.float32) for n in ("g", "beta"))

    prefill = functools.partial(chunk_gated_delta_rule_pallas, interpret=interp)
    h, vn, final = prefill(q, k, v, g, beta, lengths=jnp.asarray(prompt + args.steps, jnp.int32),
                           config=dict(stop_after="state", states_t=True))
    h = np.swapaxes(np.asarray(h), -1, -2)  # [B, HV, nt, K, V]: the state at every chunk's start
    vn = np.swapaxes(np.asarray(vn), -1, -2)  # [B, HV, Tp, V]
    pj = jnp.asarray(prompt, jnp.int32)
    bnd = (pj // 64) * 64
    _, s = prefill(q, k, v, g, beta, lengths=bnd)
    win = jax.jit(lambda start, n: tuple(open_window(a, start, n) for a in (q, k, v, g, beta)))
    xc, vc = rp.chunk_replay_prime_pallas(*win(bnd, pj - bnd), s, pj - bnd, interpret=interp,
                                          config=step_cfg or None)
    step = jax.jit(functools.partial(rp.chunk_replay_step_pallas, interpret=interp, config=step_cfg or None))
    upto_out = jax.jit(functools.partial(rp.chunk_replay_step_pallas, interpret=interp,
                                         config=dict(step_cfg, stop_after="out")))

    def diff(got, want):
        return float(np.abs(got - want).max()), int((got != want).sum())

    primed = [(b, int(bnd[b]) + r) + diff(np.asarray(vc[b, :, r]), vn[b, :, int(bnd[b]) + r])
              for b in range(B) for r in range(int(prompt[b] - bnd[b]))
              if not np.array_equal(np.asarray(vc[b, :, r]), vn[b, :, int(bnd[b]) + r])]
    s0_bad, vn_bad, pos = [], [], prompt.copy()
    for _ in range(args.steps):
        start = (pos // 64) * 64
        n = pos - start + 1
        window = win(jnp.asarray(start), jnp.asarray(n))
        s_now = np.asarray(s)
        for b in range(B):
            want = h[b, :, start[b] // 64]
            if not np.array_equal(s_now[b], want):
                s0_bad.append((b, int(start[b])) + diff(s_now[b], want))
        ln = jnp.asarray(n, jnp.int32)
        vc_out = np.asarray(upto_out(*window, s, xc, vc, ln)[3]) if (n == 64).any() else None
        _, s, xc, vc = step(*window, s, xc, vc, ln)
        vc_now = np.asarray(vc)
        for b in range(B):
            r = int(n[b]) - 1
            got = (vc_out if n[b] == 64 else vc_now)[b, :, r]
            want = vn[b, :, int(pos[b])]
            if not np.array_equal(got, want):
                vn_bad.append((b, int(pos[b])) + diff(got, want))
        pos = pos + 1
    s_now, final = np.asarray(s), np.asarray(final)
    for b in range(B):  # the boundary state the last step leaves (one it folded itself included)
        want = final[b] if pos[b] % 64 == 0 else h[b, :, pos[b] // 64]
        if not np.array_equal(s_now[b], want):
            s0_bad.append((b, int(pos[b] // 64 * 64)) + diff(s_now[b], want))
    s0_bad = sorted(set(s0_bad))  # a chunk's state is read by every step in it: each boundary once
    print(f"K, V = {K}, {V}; HK, HV = {HK}, {HV}; prompts {prompt.tolist()}, {args.steps} steps"
          f"{' (interpreted)' if interp else ''}{f'; step config {step_cfg}' if step_cfg else ''}")
    for name, bad in (("primed v_new rows", primed), ("boundary states", s0_bad),
                      ("decoded v_new rows", vn_bad)):
        print(f"  {name} != prefill: {len(bad)}" + (" (row, position, max |diff|, elements): " if bad else "")
              + ", ".join(f"({b}, {p}, {d:.3g}, {c})" for b, p, d, c in bad[:args.show]))
    return 1 if (primed or s0_bad or vn_bad) else 0


if __name__ == "__main__":
    sys.exit(main())
