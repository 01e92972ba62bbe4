"""Chunked (WY/UT, chunk 64) gated delta rule prefill: Pallas-Triton kernels for the H200 (interpretable on CPU).

Two designs (dimension legend in `reference.py`; C = 64, NT = ceil(T / C)); `config["design"]` picks one.

"split" (default: the recurrence kept to two dots per chunk):
1. `_prep_split_kernel`, grid (NT, HV, B), fully parallel: per chunk and value head, fp32 L2-norm of k, masking of
   padded tokens, the in-chunk cumulative log-decay gc, the strictly-lower A[i, j] = beta_i (k_i . k_j)
   exp(gc_i - gc_j) (j < i), its unit-lower inverse X = (I + A)^-1 and w = X (beta exp(gc) k), u = X (beta v),
   kd = k exp(gc_last - gc). By default (inv="tiled", `wy.tiled_inverse`) all of it on 16-row slices and [16, 16]
   tiles: the diagonal tiles inverted by exact fp32 forward substitution, the rest merged block row by block row,
   w / u / kd 16 rows at a time. u is written in fp32, w and kd in fp16 on the GPU when q/k are L2-normalised
   (`_wk_dtype`: bounded by construction), else in fp32. prep_kernels=2 writes X to memory (`_inverse_kernel`)
   and applies it in `_apply_kernel`; inv="block16" is the earlier [64, 64] form (diagonal blocks on a
   [4, 16, 16] stack, block-Neumann merge).
2. `_state_split_kernel`, grid (V // BV, HV, B) (BV = 64; 32 with two load stages on grids of at most 132 programs,
   16 with three where that gives at most 264: `_recurrence_blocks`), sequential over chunks with the fp32 state
   block S [K, BV] on chip:
   writes S at the start of every chunk (h) and v_new = u - w S, then S = exp(gc_last) S + kd^T v_new.
   On a Hopper GPU the same recurrence runs by default as a Pallas Mosaic GPU kernel (`recurrence_mgpu.py`, config
   `recurrence`: the same bits, in less time).
3. `_out_kernel`, grid (NT, HV, B, V // BVO), fully parallel: o = qg h + Aqk v_new with qg = scale q exp(gc) and the
   masked intra-chunk attention Aqk[i, j] = scale q_i . k_j exp(gc_i - gc_j) (j <= i) recomputed from q and k.
   Config `output="mosaic"` runs it as a Pallas Mosaic GPU kernel instead (`output_mgpu.py`: the same bits on the
   H200, slower). In-call checkpoints are exact copies of h at the requested chunk starts (or of the final state).
   On a Hopper GPU, on grids of at least `fused_min_programs` recurrence programs at K = V = 128 (config
   `output="auto"`, the default), 2. and 3. are one Mosaic GPU kernel instead
   (`recurrence_mgpu.state_recurrence_output_intra_mgpu`): the output, its qg and Aqk and the checkpoints computed
   inside the recurrence, h and v_new never in memory; the same bits.
   Chunks of padding only (rows shorter than the batch's longest; config `skip_padding`, the default) are neither
   loaded nor computed by 1. (it writes the zeros it would compute, or, before that kernel, which reads none of them
   but a row's first, nothing) nor run by that kernel (a row's loop ends at its last token; zeros for the later
   outputs, the final state for their checkpoints): the same values.

"fused" (two kernels: the output computed inside the recurrence, four dots per chunk on the sequential path):
1. `_prep_kernel`: as above plus Aqk and qg, written in fp32.
2. `_state_kernel`: per chunk v_new = u - w S; o = qg S + Aqk v_new; S = exp(gc_last) S + kd^T v_new; stores o, the
   final state and (optionally) the state after every `checkpoint_stride` tokens.

"tiles16" (the diagonal blocks on four 2-D [16, 16] tiles, placed into [64, 64] for the block-Neumann merge; run 4,
slower) was removed when inv="tiled" kept the tiles through the merge. A row-exact configuration (FMA-chain dots)
for an incremental replay kernel was removed: its prefill measured 54-58x the default and its replay step 88x the
recurrent kernel (BENCHMARKS.md).

Determinism properties (tested on CPU in interpret mode and on the GPU):
- every chunk's arithmetic depends only on that chunk's (masked) inputs and the incoming fp32 state, with fixed
  tile shapes, so a call split on the 64 grid, the same call twice, and a row alone vs inside a batch agree bit
  for bit, and in-call checkpoints equal separate calls' final states;
- row-causal inside a chunk: masked terms are exact zeros (`where` before `exp`, lower-triangular factors), no
  reduction's order depends on how many rows are real, so a call of j < 64 tokens starting on the grid gives the
  same output rows as the full-chunk call;
- padded tokens (t >= lengths[b], or the tail of the last chunk) get k = q = v = 0, g = 0, beta = 0: they leave the
  state bit-identical (decay exp(0) = 1, zero update).
Every dot states its precision (an fp32 dot in Triton otherwise runs as TF32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ..config import merged_config, static_config
from . import wy
from .arith import fma, mul_rn
from . import output_mgpu
from .output_mgpu import ORDERS as OUTPUT_ORDERS
from .output_mgpu import chunk_output_mgpu, key_norms
from .recurrence_mgpu import (DEFAULT_REGISTER_SPLIT, REGISTER_SPLIT_RULE, state_recurrence_mgpu,
                              state_recurrence_output_intra_mgpu, valid_register_split)
from .wy import CHUNK


# Default configuration (tuned on the H200: see BENCHMARKS.md). Keys:
#   bv: V block of the state kernel; inv: "tiled" (everything on [16, 16] tiles: `wy.tiled_inverse`; runs 24-25),
#   "block16" (16x16 diagonal blocks by forward substitution on a [4, 16, 16] stack + block-Neumann merge on
#   [64, 64]; the default up to run 23), "doubling" (loop-free: diagonal blocks by repeated squaring; measured
#   slower) or "fwd64" (plain 64-row forward substitution, a slow fallback); warps_* / stages_*: Triton launch
#   parameters; design: "split" or "fused" (module docstring); bv_out: V block of the split design's output kernel;
#   skip_padding: True (default) or False, for batches of mixed lengths padded to the longest: the prep's programs on
#   chunks of padding only (past their row's length) write the zeros the prep computes there without loading or
#   computing anything (`_prep_split_kernel`), and the fused recurrence (output "fused_intra") runs a row's chunks
#   up to its last token only (at least one), storing zeros as the later chunks' outputs and taking the final state
#   as their checkpoints (what the full loop's identity updates give: the same values, tested bitwise on CPU); before
#   it the prep writes nothing for a row's chunks of padding but its first, which that kernel never reads; the other
#   kernels (prep_kernels=2, inv other than "tiled", the fused design, the unfused recurrences) run every chunk.
#   Run 185 (an H100): every element of the outputs, final states and checkpoints equal to False's at three shapes
#   of mixed lengths; rows of about (b + 1) / B of T (`gpu_prefill_configs.py --ragged`): 0.70x the prefill's time at
#   (8, 4096), 0.81x at (4, 4096); full rows 1.006x / 1.008x at (8, 4096) / (1, 8192). The default since. With the
#   prep leaving unwritten the chunks the fused recurrence does not read, the prefill takes 0.95x / 0.95x / 0.98x its
#   time with them written at (8, 4096) / (4, 4096) / (2, 8192) with mixed lengths, 0.68x / 0.80x / 0.88x
#   skip_padding=False's (run 186);
#   prep_kernels: 1, or 2 (split design: the inverse in its own small kernel, then w / u / kd); wk_dtype: storage
#   of w and kd between prep and recurrence ("auto", "float16", "float32": `_wk_dtype`); states_t: the recurrence
#   writes the per-chunk states h and v_new transposed ([V, K] and [V, Tp]), so the output kernel's dots read their
#   second operands in the K-major order TF32 wgmma needs instead of transposing them through shared memory (run 30:
#   that kernel was bound by shared memory, 204 M bank conflicts at (8, 4096)); the same arithmetic, the same bits
#   (interpret mode and the H200, run 32); default since run 32: the output kernel 1.60 -> 0.79 ms at (8, 4096),
#   while the recurrence's transposed stores cost it 3% there and 14-15% on small grids (B=1: bv 32, 2 stages);
#   "h" or "v_new" transposes only that one (same bits; run 34: both slower than the default, 5.03 and 5.42 against
#   4.79 ms over the sweep's two shapes);
#   with design="fused" it does not apply (the default is ignored there; any other explicit value is refused);
#   p_kk, p_inv, p_wu: prep-kernel dots (gram matrix, inverse merge, w/u; p_kk may be "auto": `_gram_precision`;
#   p_qk too: `_qk_precision`),
#   each one of `wy.PRECISIONS` ("ieee", "tf32", "tf32x3", "bf16", "bf16x3": three bf16 dots of the operands' hi / lo
#   halves, "fp16": operands rounded to fp16); p_ws, p_kv: recurrence dots (w S,
#   k^T v_new); p_qk, p_qs, p_av: output-side dots (q k^T, q S, A v_new) — in the output kernel (split) or in the
#   prep and recurrence kernels (fused).
# Measured on the H200 (BENCHMARKS.md, run 3): split with 4 prep warps was the fastest over (1, 8192, 16, 32) +
# (8, 4096, 16, 32); all configurations kept outputs within 1.8e-3 and states within 8e-4 of the float64 oracle.
# Run 4: prep_kernels=2 (the inverse in its own kernel) took 2.23 + 6.08 ms against 2.42 + 7.19 ms, as accurate.
# Runs 24-25: the tiled inverse in one prep kernel, then fp16 w / kd: 1.31 + 4.41 ms against 1.80 + 6.01 (run 22's
# default), as accurate (states <= 8e-4 of the oracle).
# Benchmark-only keys: warps_replay=n or (prep, intra, out) launches the replay step's three kernels with other warps
# than the prefill's (whether the bits survive is for the GPU checks to say: `gpu_kernels.py --only replay_step`);
# only_prep=True (or stop_after="prep") returns the prep kernel's outputs and stops;
# stop_after="inverse" (prep_kernels=2) returns after the inverse kernel; stop_after="state" (split design) returns
# after the recurrence kernel (h, v_new, final state; with states_t, h and / or v_new in their transposed layouts);
# for the replay step (`replay.py`), stop_after="out" returns after kernel 3: the output row and the v_new cache with
# the new row, the boundary state not folded and the cache not cleared where the chunk completes
# (`scripts/replay_diff.py` reads the completing row there).
# Small grids (split design): when the recurrence's grid (V // bv, HV, B) has at most `small_grid` programs (132:
# one per SM of the H200), it runs with V blocks of `bv_small` and `stages_small` load stages instead — twice the
# programs, loads pipelined — unless the caller's config sets bv or stages_state. Runs 21-22: (1, 8192, 16, 32)
# 1.80 against 2.19 ms, (1, 32768, 16, 32) 6.92-6.99 against 8.30-8.34 (runs 14-15); at (8, 4096) the same setting
# was 2% slower, hence the rule. On tinier grids still — when V blocks of `bv_tiny` give at most `tiny_grid` programs
# (264: two per SM; B=1 at HV=32) — V blocks of `bv_tiny` with `stages_tiny` stages: runs 80 and 82 (2026-12-01),
# the recurrence 3-11% faster at (1, 8192) and (1, 32768) with 16 and 3, and 34-53% slower at (2, 8192), where
# V blocks of 16 would give 512 programs (hence the bound).
# The bits do not depend on either (`_recurrence_blocks`).
# bv_replay: the V block of the replay step's last two kernels (`replay.py`: the v_new, output and state dots); the
# prefill does not read it; on the GPU the bits do not depend on it (an MMA element does not depend on the
# instruction's N: runs 40 and 45); in interpret mode XLA:CPU's dots can round differently for another N.
# replay_s0_dots: how the replay step's kernel 3 multiplies by S0: 1 (default since run 62), one [16, K] x [K, bv]
# dot on w's row r and qg's row placed at another row of the tile (a row of an MMA's result depends only on that row
# of its first operand); 2, w S0 and qg S0 as two dots (the prefill's v_new and output forms). The same bits on the
# H200 (run 62) and in interpret mode; one dot took kernel 3 from 69.5 to 60.4 us per step at B=64 and from 254.6
# to 218.6 at B=256 (offline ptxas: 146 -> 80 registers per thread; ncu on the H200: 122, run 63). Needs
# p_ws == p_qs.
# replay_state_rows: the batch rows each program of the replay step's kernel 4 (the boundary states of the rows whose
# chunk completes) looks after (the largest power of two <= it that divides B); 1 is one program per row, as before
# 2026-12-01. Its work and bits do not depend on it: only how many programs find nothing to do, and how long the one
# that folds a row takes (in a loop over its rows: longer). "auto" (default): 1 while the grid has at most 4096
# programs with it (B * HV * V / bv_replay), else 16. Run 69 (H200, one row in 64 completing per step, kernel 4 us
# per step): B=64 13.9 with 1, 22.0 with 4, 16.9 with 16; B=256 42.0, 27.6 and 24.1.
# replay_qk_cols: the replay step's kernel 2 takes row t of q k^T as column 0 of k q16^T ([C, K] x [K, 16], q16 holding
# q's row t and zeros; the same 64-row wgmma, the operands' roles swapped) instead of row t of the 64-row q k^T: a
# [16, K] operand in shared memory instead of [64, K]. The same bits on the H200 (run 74: the 560 rows and 8
# boundary states; run 122 again with q k^T in fp16, `_qk_precision`), not on XLA:CPU (1.5e-8 off), so "auto"
# (default) takes it on the GPU and the 64-row form in interpret mode; True / False force either. Run 74, kernel 2
# us per step at B=64 / 256: 32.2 / 121.3 before, 27.3 / 104.6 with it (8 warps), 18.2 / 64.4 with it on 4 warps
# (the default since).
# replay_kd: where the replay step's kernel 4 takes a completing chunk's kd from: "prep" (default since run 103),
# computed by kernel 1 when the token completes the chunk and stored as the prefill's prep stores it, then loaded by
# kernel 4 as the prefill's recurrence loads its kd; "fold" (the default before), computed in kernel 4 from k and g
# (fp32, rounded to `_wk_dtype`, its layout changed for the dot). The same values either way, but on the GPU the dot
# kd^T v_new can group them otherwise: at K = V = 16 "fold" left the recurrence's bits (runs 92-101: every boundary
# state an ulp off in ~40% of its elements; run 102's SASS: HMMA k-steps grouping the k axis otherwise than the
# recurrence's), and "prep" gives them (run 103: the 560 rows and 8 boundary states at K = V = 16, 64 and 128). Run
# 103, kernel 4 us per step at B=64 / 256: 13.9 / 24.4 with "fold", 11.8 / 21.2 with "prep" (kernel 1 62.6 / 211.7
# against 63.1 / 212.1: its completing rows write kd; offline ptxas: kernel 1 209 -> 222 registers per thread).
# "prep" costs a transient kd buffer per call, [B, HV, 64, K] in `_wk_dtype` (half the v_new cache's bytes at K = V),
# written only for the completing rows.
# warps_replay_intra: the warps of the replay step's kernel 2 (q k^T of the new row, the output kernel's 64-row dot;
# the prefill runs it with warps_out): 4 with replay_qk_cols (run 74); before it, 8 (37.6 against 45.0 us per
# step at B=64 with 4), the same bits (the H200,
# 2026-11-30: the 560 rows and 8 boundary states of `gpu_kernels.py --only replay_step`; run 42 found none of its
# warps variants changing the bits either).
# state_update: how the state after a chunk, exp(gc_last) S + kd^T v_new (`_next_state`: the recurrence's, the
# replay step's kernel 4 and the fused design's sequential kernel), rounds on the GPU: "mul_add" (default), the
# decayed state rounded (`arith.mul_rn`: no compiler may contract it into an FMA), then kd^T v_new added — which the
# H200's code does inside the dot: Triton makes the decayed state the MMA chain's initial accumulator (run 102's
# SASS, in the recurrence and in kernel 4 alike, at K = V = 16 and 64); "fma", one
# fma.rn.f32 per element; "auto", as the compiler chooses (the code before 2026-12-02). Offline, Triton 3.6
# contracted the recurrence's into an FMA and not the replay step's (a layout conversion between them); on the H200
# "mul_add" computes what "auto" did in the prefill at K = V = 128 and "fma" does not (runs 93-94), so the default
# keeps the earlier bits there (at other head sizes "auto" against "mul_add" was not compared on the H200; the fused
# design was not run). Interpret mode: a multiply and an add, whatever this says.
# recurrence: which kernel runs the split design's state recurrence: "triton" (`_state_split_kernel`), "mosaic" (the
# same arithmetic as a Pallas Mosaic GPU kernel, `recurrence_mgpu.py`: the state held transposed, TF32 wgmma on
# operands rounded to nearest as Triton rounds them; the same bits as "triton" on the H200, runs 126-130, in 0.69-0.83x
# its time (run 130, recurrence_ws="u"); in interpret mode Mosaic GPU's interpreter, whose dots are fp32) or "auto"
# (default): "mosaic" on a Hopper GPU (compute capability 9.0, the wgmma it needs) where it applies — states_t=True,
# w and kd stored in fp16 (`_wk_dtype`: the GPU default), V a multiple of 64, K of 32 and at most 128 (shared
# memory) — else "triton".
# `_recurrence_kernel` decides. recurrence_ws: the Mosaic GPU kernel's form (`state_recurrence_mgpu`'s
# warp_specialised): False (one warpgroup), True (a second warpgroup converts w and kd) or "u" (default: and
# transposes u). The same bits (run 130: all three equal the Triton recurrence's on three shapes); the recurrence
# alone at (1, 8192) / (8, 4096) / (1, 32768) / (2, 8192): 0.385 / 0.965 / 1.477 / 0.462 ms with False, 0.370 /
# 0.899 / 1.402 / 0.421 with True, 0.337 / 0.905 / 1.260 / 0.406 with "u" (Triton: 0.438 / 1.095 / 1.727 / 0.592).
# (Runs 158-159, 2026-12-05: the Mosaic GPU recurrence storing h and v_new TF32-rounded, config recurrence_stores="tf32"
# then: the same bits downstream, the prefill 0.99-1.03x the default's time; removed. Runs 179-182, 2026-12-06: config
# recurrence_form="s", the state held untransposed as S [K, 32] so that B = 1 at HV = 32 gets 128 programs, and
# prep_chunks, a prep program looping over 2-8 chunks so that Triton pipelines their loads: the same bits, the
# prefill 1.02-1.03x and 1.07-1.22x the default's time; removed, kept on branch experiment/s50-s-form-prep-chunks.
# Run 184, 2026-12-06, an H100: diag_block 8 / 4 / 1, the diagonal tiles' forward substitution on [b, b] blocks merged
# by exact-fp32 dots: as accurate (every case to three digits), but the prefill 0.99-1.05x the default's time and the
# replay step's kernel 1 1.29x at b = 4; removed, kept on branch experiment/s51-diag-block.)
# output: where the split design's output is computed (`_output_in_recurrence`, `_output_kernel`): "auto" (default:
# "fused_intra" where the Mosaic GPU recurrence runs on a grid (V / 64, HV, B) of at least `fused_min_programs` (128)
# programs at K = V = 128, else "triton"), "triton" (`_out_kernel`), "mosaic" (the same arithmetic as a Pallas Mosaic
# GPU kernel, `output_mgpu.py`, fed the L2 norms of q and k by a small Triton kernel, `key_norms`, so that their row
# sums add in Triton's order) or "fused_intra" (where the Mosaic GPU recurrence runs: the output and qg and Aqk
# computed inside it, and the in-call checkpoints stored by it, h and v_new never in memory,
# `recurrence_mgpu.state_recurrence_output_intra_mgpu`; elsewhere as "triton"). "mosaic": the same bits as "triton"
# on the H200 (run 132: every element on three shapes), in 1.11-1.16x its time (the output alone, `key_norms`
# included). ("fused", the output inside the recurrence from qg and Aqk that a kernel of their own stored, gave the
# same bits in 1.066x / 1.009x / 0.967x / 0.999x the default's time at the four bar shapes, run 163 on an H100: qg
# and Aqk read from memory cost what h and v_new's stores did; removed on 2026-12-06, commit 45423e3 has it.)
# "fused_intra": the same bits as "triton" (outputs, final states and in-call checkpoints in every element on three
# shapes on an H100 and an H200, runs 168-169 and 171-174; across the threshold, a row alone on the Triton output
# against the same row in a batch on the fused kernel: the model's check, B = 1 against B = 2 and 8, run 174, PASS;
# `chunk_bitwise`'s sixth check, run 175, two of its four rows reached, both equal).
# fused_min_programs: run 172 (an H100) timed the prefill with the fused kernel in 0.75x / 0.76x / 0.80x the Triton
# output's time on 512 / 256 / 128 programs ((8, 4096), (4, 4096), (2, 8192) at HV = 32) but 1.035x on 64 ((1, 8192):
# there the chain is latency-bound and the output kernel's own grid fills the GPU), hence 128 (512 from run 169 to
# 2026-12-06, before grids between 64 and 512 were measured). fused_warpgroups: 3 (default: qg and Aqk on a warpgroup
# of their own, w and kd converted on another) or 2 (one producer warpgroup does both; the same bits);
# fused_registers: "auto" (default: `recurrence_mgpu.DEFAULT_REGISTER_SPLIT`, 232 / 200 / 72, with three warpgroups,
# none with two), None, or the three warpgroups' registers per thread (consumer, qg / Aqk, w / kd; `setmaxnreg`).
# Run 170 found the two-warpgroup kernel waiting on its producer (skipping qg and Aqk's computation: 2.55 -> 2.01 ms
# at (8, 4096) on the H200); on an H100 (runs 171-172) three warpgroups took (8, 4096) from 2.56-2.58 to 2.61 ms
# without a register split and to 2.41-2.45 with one (216 / 216 / 72, 240 / 192 / 72, 224 / 208 / 72, 232 / 216 / 56,
# 232 / 200 / 72 the fastest), and run 173 found them still waiting on the qg / Aqk warpgroup (2.19 ms with its
# computation skipped). output_order: how the Mosaic GPU kernels add the
# output's two dots (`output_mgpu._out_dots`): "h_acc" (default: qg S_c the initial accumulator of Aqk v_new, as
# the H200's Triton code does), "add" or "vn_acc" (each differs from Triton's bits in a few elements: run 132).
# Run 34 (2026-11-30): the prep's gram tiles in bf16 (p_kk) and its inverse merge in TF32 (p_inv; both "tf32" and
# "tf32x3" before) — 4.27 against 4.79 ms over (1, 8192) + (8, 4096), the prep 1.68 -> 1.28 ms at (8, 4096), as
# accurate (outputs <= 1.76e-3, states <= 8.2e-4 of the float64 oracle; `scripts/precision_screen.py` predicted it);
# other bits than before, so every bitwise check was re-run on it (BENCHMARKS.md). Runs 111-113 (2026-12-02) measured
# the gram tiles exact in their products, for random keys with g ~ 0 and beta = 1, where the bf16 tiles (the
# normalised keys rounded to bf16) put the output at issue 3's 2e-3 bar: p_kk="bf16x3" takes the output there to
# 1.73e-3 and the state from 1.4e-3 to 4.8e-4 (`precision_screen.py`; run 112 measured 1.73e-3 / 4.77e-4 on the
# H200 for the same tiles on the raw keys) at 8-9% of the prefill's time (run 113: 1.078 / 3.424 against 1.001 / 3.142
# ms at (1, 8192) / (8, 4096)); "tf32" cost the replay step's kernel 1 30% (run 111); the raw keys' form 15-23%
# (branch experiment/gram-raw). Runs 114-116 (2026-12-02) made p_kk="bf16x3" the default (every check PASS on the
# H200; +8.7% / +10.6% of the prefill at (1, 8192) / (8, 4096), +8% of the replay step at B = 64). Since run 117
# the default is p_kk="auto" (`_gram_precision`): one fp16 dot on the L2-normalised keys, whose 10 mantissa bits
# are TF32's — as accurate as TF32 tiles (random keys: 1.73e-3 / 5.03e-4; every accuracy case within 1.76e-3 /
# 8.7e-4), the six chunk bitwise checks and the replay step's five PASS, and as fast as one bf16 dot: 4.087 against
# 4.088 ms over the sweep's two shapes (bf16x3: 4.454), the replay step 165.6 against 164.4 us at B = 64 (run 118).
# Without the L2 norm "auto" takes "bf16x3" (fp16 overflows past 65504). The one bf16 dot ("bf16", the default from
# run 34 to run 113) put random keys with g ~ 0, beta = 1 at 2.000e-3 and 2.026e-3 on two draws, at and over the bar.
DEFAULT_CONFIG = dict(
    design="split", bv_out=128, warps_out=4, stages_out=1, prep_kernels=1, warps_apply=4,
    bv=64, inv="tiled", warps_prep=4, stages_prep=1, warps_state=4, stages_state=1,
    small_grid=132, bv_small=32, stages_small=2, tiny_grid=264, bv_tiny=16, stages_tiny=3,
    wk_dtype="auto", states_t=True, bv_replay=64, warps_replay_intra=4, skip_padding=True,
    replay_s0_dots=1, replay_state_rows="auto", replay_qk_cols="auto", replay_kd="prep", state_update="mul_add",
    recurrence="auto", recurrence_ws="u", output="auto", fused_min_programs=128,
    fused_warpgroups=3, fused_registers="auto", output_order="h_acc",
    p_kk="auto", p_inv="tf32", p_wu="tf32", p_qk="auto", p_ws="tf32", p_qs="tf32", p_av="tf32", p_kv="tf32",
)


def _chunk_slices(k_ref, g_ref, beta_ref, length, use_l2, start=None):
    """inv="tiled": the chunk as four 16-row slices, loaded straight from the refs: keys [16, K] (fp32, L2-normalised,
    padded rows exact zeros), beta [16] and the cumulative log-decay gc [16] — each slice's own cumsum plus the last
    value of the slice before (this design's gc: the kernel writes it out and every later kernel reads it).
    `start`: the chunk's first token (default: this program's chunk, grid axis 0); rows from `length` on are padding."""
    s = wy.SUB
    iota = lax.broadcasted_iota(jnp.int32, (s,), 0)
    ks, gcs, betas, valids = [], [], [], []
    for b in range(CHUNK // s):
        sl = pl.ds(b * s, s)
        first = pl.program_id(0) * CHUNK if start is None else start  # per slice: the prefill's IR as before run 36
        valid = (first + b * s + iota) < length
        valids.append(valid)
        ks.append(_load_key(k_ref.at[sl], valid, use_l2))
        gcs.append(_gc_slice(g_ref.at[sl], valid, gcs[-1] if gcs else None))
        betas.append(jnp.where(valid, beta_ref[sl].astype(jnp.float32), 0.0))
    return ks, gcs, betas, valids


def _gc_slice(g_ref, valid, before):
    """One 16-row slice of the chunk's cumulative log-decay gc: the slice's own cumsum of g (padded rows 0) plus the
    last value of the slice `before` (None for the first). The replay step's kernel 2 calls it for gc alone."""
    gc = jnp.cumsum(jnp.where(valid, g_ref[...].astype(jnp.float32), 0.0))
    return gc if before is None else gc + wy.last(before)


def _store_gc(gc_ref, gcs):
    """Write the four 16-row slices of gc (`_chunk_slices`) into gc_ref [C]."""
    for i, gc in enumerate(gcs):
        gc_ref[pl.ds(i * wy.SUB, wy.SUB)] = gc


def _store_tiled_inverse(x_ref, gc_ref, x, gcs):
    """Write the tiled inverse as the [C, C] X (zeros above the diagonal tiles) and gc [C]."""
    s, nb = wy.SUB, CHUNK // wy.SUB
    zero = jnp.zeros((s, s), jnp.float32)
    _store_gc(gc_ref, gcs)
    for i in range(nb):
        for m in range(nb):
            x_ref[pl.ds(i * s, s), pl.ds(m * s, s)] = x[i, m] if m <= i else zero


def _store_tiled_wy(x, ks, gcs, betas, valids, v_ref, w_ref, u_ref, kd_ref, cfg, interpret):
    """w = X (beta exp(gc) k), u = X (beta v) and kd = k exp(gc_last - gc) (as `wy.apply_wy`), 16 rows at a time from
    the tiled inverse: w_i = sum_{m <= i} X_im (beta exp(gc) k)_m (the tiles above the diagonal are never used)."""
    s, nb = wy.SUB, CHUNK // wy.SUB
    g_last = wy.last(gcs[-1])
    bks, bvs = _wy_rhs_slices(ks, gcs, betas, valids, v_ref)
    for i in range(nb):
        sl = pl.ds(i * s, s)
        w, u = _wy_block_row(i, x, bks, bvs, cfg, interpret)
        w_ref[sl, :] = w.astype(w_ref.dtype)
        u_ref[sl, :] = u
        kd_ref[sl, :] = _kd_slice(ks[i], gcs[i], g_last).astype(kd_ref.dtype)


def _wy_rhs_slices(ks, gcs, betas, valids, v_ref):
    """The right-hand sides of w and u per 16-row slice: beta exp(gc) k [16, K] and beta v [16, V] (padded rows 0)."""
    s = wy.SUB
    bks = [kb * (beta * jnp.exp(gc))[:, None] for kb, beta, gc in zip(ks, betas, gcs)]
    bvs = [_masked(v_ref.at[pl.ds(m * s, s)], valid) * beta[:, None] for m, (valid, beta) in
           enumerate(zip(valids, betas))]
    return bks, bvs


def _wy_block_row(i, x, bks, bvs, cfg, interpret):
    """Rows 16 i .. 16 i + 15 of w and u: sum_{m <= i} X_im (beta exp(gc) k)_m and X_im (beta v)_m (shared with the
    replay step, `replay.py`)."""
    w = wy.dot(x[i, 0], bks[0], cfg["p_wu"], interpret)
    u = wy.dot(x[i, 0], bvs[0], cfg["p_wu"], interpret)
    for m in range(1, i + 1):
        w = w + wy.dot(x[i, m], bks[m], cfg["p_wu"], interpret)
        u = u + wy.dot(x[i, m], bvs[m], cfg["p_wu"], interpret)
    return w, u


def _kd_slice(kb, gc, g_last):
    """kd = k exp(gc_last - gc) of one 16-row slice (fp32; stored in `_wk_dtype`)."""
    return kb * jnp.exp(g_last - gc)[:, None]


def _valid_rows(length):
    """[C] bool: which rows of this program's chunk (grid axis 0) are real tokens."""
    iota = lax.broadcasted_iota(jnp.int32, (CHUNK,), 0)
    return (pl.program_id(0) * CHUNK + iota) < length


def _load_key(ref, valid, use_l2):
    """q or k rows [R, K] in fp32: L2-normalised (optional), padded rows exact zeros (`where`: NaN cannot leak)."""
    x = ref[...].astype(jnp.float32)
    if use_l2:
        x = wy.l2norm(x)
    return jnp.where(valid[:, None], x, 0.0)


def _masked(ref, valid):
    x = ref[...].astype(jnp.float32)
    return jnp.where(valid[:, None] if x.ndim == 2 else valid, x, 0.0)


def _prep_kernel(len_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, qg_ref, kd_ref, aqk_ref, gc_ref, *,
                 scale, use_l2, cfg, interpret):
    """Fused design, parallel part: w, u, kd, gc and the output-side qg, Aqk of one chunk (written in fp32)."""
    valid = _valid_rows(len_ref[0])
    q = _load_key(q_ref, valid, use_l2) * scale  # scale folded into q (padded rows stay exact zeros)
    k = _load_key(k_ref, valid, use_l2)
    gc = jnp.cumsum(_masked(g_ref, valid))  # [C]; padded tokens add exact zeros
    gc_ref[...] = gc
    aqk_ref[...], qg_ref[...] = wy.intra(q, k, gc, cfg, interpret)
    w_ref[...], u_ref[...], kd_ref[...] = wy.wy_form(k, _masked(v_ref, valid), _masked(beta_ref, valid), gc, cfg,
                                                   interpret)


def _state_kernel(w_ref, u_ref, qg_ref, kd_ref, aqk_ref, gc_ref, s0_ref, o_ref, st_ref, *ck_refs, nt, per, nck, cfg,
                  interpret):
    """Fused design, sequential part: per chunk v_new = u - w S; o = qg S + Aqk v_new;
    S = exp(gc_last) S + kd^T v_new."""

    def body(c, s):
        sl = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        g_last = wy.last(gc_ref[sl])
        v_new = u_ref[sl, :] - wy.dot(w_ref[sl, :], s, cfg["p_ws"], interpret)  # [C, BV]
        o = wy.dot(qg_ref[sl, :], s, cfg["p_qs"], interpret) + wy.dot(aqk_ref[sl, :], v_new, cfg["p_av"], interpret)
        o_ref[sl, :] = o.astype(o_ref.dtype)
        s = _next_state(s, g_last, kd_ref[sl, :], v_new, cfg, interpret)
        if per:
            m = lax.div(c + 1, per)

            @pl.when((lax.rem(c + 1, per) == 0) & (m <= nck))
            def _():
                ck_refs[0][m - 1] = s

        return s

    s = lax.fori_loop(0, nt, body, s0_ref[...].astype(jnp.float32))
    st_ref[...] = s


def _prep_split_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, w_ref, u_ref, kd_ref, gc_ref, *, use_l2, cfg,
                       interpret, padding_read=True):
    """Split design, parallel part 1: w, u, kd, gc of one chunk (u and gc in fp32; w and kd in their refs' dtype,
    `_wk_dtype`). Needs no q. With `skip_padding`, a chunk wholly past its row's length (padding only) is neither
    loaded nor computed: its w, u, kd and gc are written as the exact zeros the computation gives there — or, where
    the kernel that follows reads no such chunk but a row's first (`padding_read=False`: the fused recurrence under
    `skip_padding`, `recurrence_mgpu._chunks_run`), written for the first chunk only and left unwritten after it."""
    if cfg["inv"] == "tiled":
        def live(start=None):
            ks, gcs, betas, valids = _chunk_slices(k_ref, g_ref, beta_ref, len_ref[0], use_l2, start)
            _store_gc(gc_ref, gcs)
            _store_tiled_wy(wy.tiled_inverse(ks, gcs, betas, cfg, interpret), ks, gcs, betas, valids, v_ref, w_ref,
                            u_ref, kd_ref, cfg, interpret)

        if not cfg["skip_padding"]:
            live()
            return
        first = pl.program_id(0) * CHUNK  # (outside the branches: interpret mode reads grid indices at the top only)
        padding = first >= len_ref[0]
        read = padding if padding_read else jnp.logical_and(padding, first == 0)  # the chunks of padding read later
        pl.when(read)(lambda: _store_padding_chunk(w_ref, u_ref, kd_ref, gc_ref))  # what `live` computes there
        pl.when(jnp.logical_not(padding))(lambda: live(first))
        return
    valid = _valid_rows(len_ref[0])
    k = _load_key(k_ref, valid, use_l2)
    gc = jnp.cumsum(_masked(g_ref, valid))
    gc_ref[...] = gc
    _store_wy(w_ref, u_ref, kd_ref, wy.wy_form(k, _masked(v_ref, valid), _masked(beta_ref, valid), gc, cfg, interpret))


def _store_padding_chunk(w_ref, u_ref, kd_ref, gc_ref):
    """A chunk of padding only: w = u = kd = 0 and gc = 0, what the prep computes there (k, beta and g masked to exact
    zeros make the chunk's inverse I and every product +0), so the recurrence leaves the state as it is."""
    for ref in (w_ref, u_ref, kd_ref, gc_ref):
        ref[...] = jnp.zeros(ref.shape, ref.dtype)


def _store_wy(w_ref, u_ref, kd_ref, wuk):
    """Write wuk = (w, u, kd), w and kd in their refs' dtype (fp16 storage: `_wk_dtype`)."""
    w, u, kd = wuk
    w_ref[...] = w.astype(w_ref.dtype)
    u_ref[...] = u
    kd_ref[...] = kd.astype(kd_ref.dtype)


def _inverse_kernel(len_ref, k_ref, g_ref, beta_ref, x_ref, gc_ref, *, use_l2, cfg, interpret):
    """Split design with prep_kernels=2, part 1: X = (I + A)^-1 [C, C] and gc of one chunk (a small footprint:
    [C, C] tiles and one [C, K] block live, so more programs fit on an SM to hide the inverse's latency)."""
    if cfg["inv"] == "tiled":
        ks, gcs, betas, _ = _chunk_slices(k_ref, g_ref, beta_ref, len_ref[0], use_l2)
        _store_tiled_inverse(x_ref, gc_ref, wy.tiled_inverse(ks, gcs, betas, cfg, interpret), gcs)
        return
    valid = _valid_rows(len_ref[0])
    gc = jnp.cumsum(_masked(g_ref, valid))
    gc_ref[...] = gc
    x_ref[...] = wy.wy_inverse(_load_key(k_ref, valid, use_l2), _masked(beta_ref, valid), gc, cfg, interpret)


def _apply_kernel(len_ref, k_ref, v_ref, beta_ref, gc_ref, x_ref, w_ref, u_ref, kd_ref, *, use_l2, cfg, interpret):
    """Split design with prep_kernels=2, part 2: w, u and kd of one chunk from X (two dots, throughput-bound)."""
    valid = _valid_rows(len_ref[0])
    _store_wy(w_ref, u_ref, kd_ref, wy.apply_wy(x_ref[...], _load_key(k_ref, valid, use_l2), _masked(v_ref, valid),
                                              _masked(beta_ref, valid), gc_ref[...], cfg, interpret))


def _state_split_kernel(w_ref, u_ref, kd_ref, gc_ref, s0_ref, h_ref, vn_ref, st_ref, *, nt, cfg, interpret):
    """Split design, sequential part: only the state recurrence (two dots per chunk). Writes the fp32 state at the
    start of every chunk (h) and v_new = u - w S; the output needs nothing else from the recurrence."""

    ht, vt = _transposed(cfg)  # h / v_new written transposed (`_recurrence_and_output`)

    def chunk_gc(c):  # gc of chunk c (static or traced)
        return gc_ref[pl.ds(c * CHUNK if isinstance(c, int) else pl.multiple_of(c * CHUNK, CHUNK), CHUNK)]

    def body(c, carry):
        s, gc_c = carry
        # the next chunk's gc, loaded a chunk ahead and carried as loaded, so that no chunk waits on its own gc load
        # (a plain load in the loop: the pipeliner stages only the dots' operands; run 82, 2026-12-01: the
        # recurrence 4-6% faster at (1, 8192), (2, 8192) and (8, 4096), the same bits)
        gc_next = chunk_gc(jnp.minimum(c + 1, nt - 1))
        sl = pl.ds(pl.multiple_of(c * CHUNK, CHUNK), CHUNK)
        h_ref[c] = s.T if ht else s
        v_new = _v_new(u_ref[sl, :], w_ref[sl, :], s, cfg, interpret)  # [C, BV]
        if vt:  # [BV, C] of [BV, Tp]
            vn_ref[:, sl] = v_new.T
        else:
            vn_ref[sl, :] = v_new
        kd = kd_ref[sl, :].astype(jnp.float32)
        return _next_state(s, wy.last(gc_c), kd, v_new, cfg, interpret), gc_next

    st_ref[...] = lax.fori_loop(0, nt, body, (s0_ref[...].astype(jnp.float32), chunk_gc(0)))[0]


def _v_new(u, w, s, cfg, interpret):
    """v_new = u - w S for one chunk [C, BV]: u fp32 [C, BV], w [C, K] as stored (`_wk_dtype`), S fp32 [K, BV]."""
    return u - wy.dot(w.astype(jnp.float32), s, cfg["p_ws"], interpret)


def _next_state(s, g_last, kd, v_new, cfg, interpret):
    """The state after a chunk: exp(gc_last) S + kd^T v_new (kd [C, K] as stored, v_new [C, BV]); the multiply and
    the add rounded as config `state_update` says, so that every kernel that calls this rounds alike (on the GPU
    the add is the dot's own accumulation: Triton feeds the decayed state to the MMA chain as its accumulator)."""
    kv = wy.dot(kd.astype(jnp.float32), v_new, cfg["p_kv"], interpret, trans_a=True)
    how = "auto" if interpret else cfg["state_update"]
    if how == "fma":
        return fma(s, jnp.exp(g_last), kv, True)
    return mul_rn(s, jnp.exp(g_last), how == "mul_add") + kv


def _out_kernel(len_ref, q_ref, k_ref, gc_ref, h_ref, vn_ref, o_ref, *, scale, use_l2, cfg, interpret):
    """Split design, parallel part 2: o = qg S_c + Aqk v_new for one chunk (q k^T recomputed from the inputs).
    Each operand is loaded where its dot needs it (the `load_*` callables): loading h and v_new before q k^T kept
    both live through it, and the kernel's shared memory went from 96 to 160 KiB (ptxas; one program per SM)."""
    aqk, qg = _intra_rows(_valid_rows(len_ref[0]), q_ref, k_ref, lambda: gc_ref[...], scale=scale, use_l2=use_l2,
                          cfg=cfg, interpret=interpret)
    o_ref[...] = _out_dots(aqk, qg, lambda: h_ref[...], lambda: vn_ref[...], cfg, interpret).astype(o_ref.dtype)


def _intra_rows(valid, q_ref, k_ref, load_gc, *, scale, use_l2, cfg, interpret):
    """The output's V-independent part of one chunk: Aqk [C, C] and qg [C, K] (`wy.intra`) from the inputs, gc
    [C] from `load_gc()` after q and k (shared with the replay step, `replay.py`, which runs it once per value
    head)."""
    q = _load_key(q_ref, valid, use_l2) * scale
    k = _load_key(k_ref, valid, use_l2)
    return wy.intra(q, k, load_gc(), cfg, interpret)


def _out_dots(aqk, qg, load_h, load_vn, cfg, interpret):
    """o = qg S_c + Aqk v_new [C, BVO], S_c and v_new from `load_h()` / `load_vn()` right before their dots, in the
    layouts `_transposed(cfg)` names (shared with the replay step)."""
    ht, vt = _transposed(cfg)  # stored transposed: the dots' second operands in the K-major order TF32 needs
    return (wy.dot(qg, load_h(), cfg["p_qs"], interpret, trans_b=ht)
            + wy.dot(aqk, load_vn(), cfg["p_av"], interpret, trans_b=vt))


def _transposed(cfg) -> tuple[bool, bool]:
    """(h transposed, v_new transposed) for cfg["states_t"]: True, False, "h" or "v_new" (only that one)."""
    t = cfg["states_t"]
    return t in (True, "h"), t in (True, "v_new")


def _checked_config(config, V: int, use_l2: bool = True, scale: float | None = None) -> dict:
    """DEFAULT_CONFIG updated with `config`, with the choices that would otherwise fail silently checked, and
    p_kk="auto" and p_qk="auto" resolved for `use_l2` and the query scale (`_gram_precision`, `_qk_precision`; scale
    None: K^-0.5's range)."""
    cfg = merged_config("chunk_gated_delta_rule", DEFAULT_CONFIG, config,
                        blocks={"bv": V, "bv_out": V, "bv_small": V, "bv_tiny": V, "bv_replay": V},
                        extra=("only_prep", "stop_after", "warps_replay"))
    if cfg.get("stop_after") not in (None, "prep", "inverse", "state", "out"):
        raise ValueError(f"stop_after={cfg['stop_after']!r}: expected 'prep', 'inverse', 'state' (the prefill) or "
                         "'out' (the replay step)")
    if cfg["design"] not in ("split", "fused"):
        raise ValueError(f"unknown design {cfg['design']!r}; expected 'split' or 'fused'")
    if cfg["inv"] not in ("tiled", "block16", "doubling", "fwd64"):
        raise ValueError(f"unknown inv {cfg['inv']!r}; expected 'tiled', 'block16', 'doubling' or 'fwd64'")
    if cfg["inv"] == "tiled" and cfg["design"] != "split":
        raise ValueError("inv='tiled' (the default) needs the split design; the fused design takes inv='block16'")
    if cfg["prep_kernels"] not in (1, 2) or (cfg["prep_kernels"] == 2 and cfg["design"] != "split"):
        raise ValueError(f"prep_kernels={cfg['prep_kernels']!r}: 1, or 2 with the split design")
    t = cfg["states_t"]
    if not (isinstance(t, bool) or t in ("h", "v_new")) or (dict(config or ()).get("states_t")
                                                             and cfg["design"] != "split"):
        raise ValueError(f"states_t={t!r}: True, False, 'h' or 'v_new'; other than False only with the split design")
    if cfg["wk_dtype"] not in ("auto", "float16", "float32"):
        raise ValueError(f"wk_dtype={cfg['wk_dtype']!r}: expected 'auto', 'float16' or 'float32'")
    if cfg["recurrence"] not in ("auto", "triton", "mosaic"):
        raise ValueError(f"recurrence={cfg['recurrence']!r}: expected 'auto', 'triton' or 'mosaic'")
    if cfg["output"] not in ("auto", "triton", "mosaic", "fused_intra"):
        gone = " ('fused' was removed: 'fused_intra' computes the same bits faster)" if cfg["output"] == "fused" else ""
        raise ValueError(f"output={cfg['output']!r}: expected 'auto', 'triton', 'mosaic' or 'fused_intra'{gone}")
    if type(cfg["fused_min_programs"]) is not int or cfg["fused_min_programs"] < 1:
        raise ValueError(f"fused_min_programs={cfg['fused_min_programs']!r}: expected a positive int")
    if cfg["fused_warpgroups"] not in (2, 3) or isinstance(cfg["fused_warpgroups"], bool):
        raise ValueError(f"fused_warpgroups={cfg['fused_warpgroups']!r}: expected 2 or 3")
    regs = cfg["fused_registers"]
    if regs not in (None, "auto") and (cfg["fused_warpgroups"] != 3 or not valid_register_split(regs)):
        raise ValueError(f"fused_registers={regs!r}: 'auto', None, or with fused_warpgroups=3 {REGISTER_SPLIT_RULE}")
    if cfg["output_order"] not in OUTPUT_ORDERS:
        raise ValueError(f"output_order={cfg['output_order']!r}: expected one of {OUTPUT_ORDERS}")
    if cfg["recurrence_ws"] not in (False, True, "u"):
        raise ValueError(f"recurrence_ws={cfg['recurrence_ws']!r}: expected False, True or 'u'")
    if not isinstance(cfg["skip_padding"], bool):
        raise ValueError(f"skip_padding={cfg['skip_padding']!r}: expected True or False")
    if cfg["state_update"] not in ("mul_add", "fma", "auto"):
        raise ValueError(f"state_update={cfg['state_update']!r}: expected 'mul_add', 'fma' or 'auto'")
    cfg["p_kk"] = _gram_precision(cfg["p_kk"], use_l2)
    cfg["p_qk"] = _qk_precision(cfg["p_qk"], use_l2, scale)
    for name, p in cfg.items():
        if name.startswith("p_") and p not in wy.PRECISIONS:
            also = " or 'auto'" if name in ("p_kk", "p_qk") else ""
            raise ValueError(f"{name}={p!r}: expected one of {wy.PRECISIONS}{also}")
    return cfg


def _gram_precision(p_kk: str, use_l2: bool) -> str:
    """The gram tiles' dot precision: p_kk="auto" (default) is "fp16" when the keys are L2-normalised (every element
    in [-1, 1], so beta k overflows fp16 only for beta past 65504; 10 mantissa bits, TF32's, where bf16 keeps 7), else
    "bf16x3" (three
    bf16 dots of the operands' hi / lo halves: any finite keys). Either keeps random keys with g ~ 0 and beta = 1
    inside issue 3's 2e-3 bar, which one bf16 dot ("bf16") reaches (runs 109-117). In interpret mode every dot is
    fp32 whatever this returns."""
    if p_kk != "auto":
        return p_kk
    return "fp16" if use_l2 else "bf16x3"


def _qk_precision(p_qk: str, use_l2: bool, scale: float | None) -> str:
    """The output's q k^T dot precision (the output kernel's and the replay step's row of it): p_qk="auto" (default) is
    "fp16" when both operands are bounded — q and k L2-normalised, q times a scale in [2^-10, 2^10] (K^-0.5 by
    default): fp16 neither overflows nor loses more than TF32 to subnormals there — else "tf32". fp16 keeps TF32's 10
    mantissa bits at twice its rate from half its shared memory: the prefill 1.4-2.2% faster over the sweep's shapes,
    its output kernel ~7% (runs 121 and 123; the default since run 122), as accurate (every accuracy case the
    default's to three digits). In interpret mode every dot is fp32 whatever this returns."""
    if p_qk != "auto":
        return p_qk
    bounded = use_l2 and (scale is None or 2.0 ** -10 <= abs(scale) <= 2.0 ** 10)
    return "fp16" if bounded else "tf32"


def _recurrence_blocks(cfg: dict, config, B: int, HV: int, V: int, interpret: bool) -> dict:
    """The split design's recurrence launch for this shape: `bv_small` / `stages_small` on a grid of at most
    `small_grid` programs, `bv_tiny` / `stages_tiny` where that gives at most `tiny_grid` (DEFAULT_CONFIG), unless
    `config` (the caller's) sets bv or stages_state.

    Bitwise safe on the GPU: every element of v_new = u - w S and of kd^T v_new is one tensor-core dot over the same
    axis (K, or the chunk's 64 rows) in the same order whatever the V block, and pipelining moves loads, not
    arithmetic — so a row alone (a small grid) and the same row in a batch (a large one) still agree bit for bit.
    Checked on the H200 (run 21: bv=32 with 2 stages == the default, outputs and states; `scripts/gpu_kernels.py`
    also checks a row alone against a batch across the switch). Not in interpret mode: there the dots are
    XLA:CPU's, whose rounding does depend on the block width (seen in the tests), and speed is not the point."""
    user = dict(config or ())
    if interpret or cfg["design"] != "split" or "bv" in user or "stages_state" in user:
        return cfg
    if (V // min(cfg["bv"], V)) * HV * B > cfg["small_grid"]:
        return cfg
    if (V // min(cfg["bv_tiny"], V)) * HV * B <= cfg["tiny_grid"]:
        return dict(cfg, bv=cfg["bv_tiny"], stages_state=cfg["stages_tiny"])
    return dict(cfg, bv=cfg["bv_small"], stages_state=cfg["stages_small"])


def _wk_dtype(cfg: dict, use_l2: bool, interpret: bool):
    """Storage dtype of the split design's w and kd between the prep and the recurrence kernels.

    "auto" (default): fp16 on the GPU when q/k are L2-normalised and the recurrence's dots that read w and kd
    (p_ws, p_kv) are TF32 or bf16, else fp32. With unit keys, beta in [0, 1] and log-decays g <= 0, every entry of
    kd = k exp(gc_last - gc) and of w = X (beta exp(gc) k) lies in [-1, 1] (a row of w is beta_i exp(gc_i) k_i
    carried through the chunk's earlier factors I - beta_j k_j k_j^T, each of norm <= 1), so fp16 cannot overflow,
    and its 10-bit mantissa is the TF32 mantissa those dots round them to anyway (below fp16's normal range, |x| <
    6e-5, it keeps fewer bits, an absolute error <= 3e-8): half the bytes of the recurrence's largest reads, the same
    accuracy class (BENCHMARKS.md, run 25). In interpret mode "auto" keeps fp32, so the CPU tests' exact-fp32
    tolerances hold; "float16" forces it (tested on CPU)."""
    choice = cfg["wk_dtype"]
    if choice == "auto":
        tf32_dots = cfg["p_ws"] in ("tf32", "bf16") and cfg["p_kv"] in ("tf32", "bf16")
        return jnp.float16 if use_l2 and tf32_dots and not interpret else jnp.float32
    return jnp.float16 if choice == "float16" else jnp.float32


def _check_pow2(name, x, lo=16):
    if x < lo or x & (x - 1):
        raise ValueError(f"{name}={x}: the Pallas-Triton kernels need a power of two >= {lo}")


@functools.partial(jax.jit, static_argnames=("scale", "use_qk_l2norm", "checkpoint_stride", "interpret", "config"))
def _chunk_impl(q, k, v, g, beta, initial_state, lengths, *, scale, use_qk_l2norm, checkpoint_stride, interpret,
                config):
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cfg = _recurrence_blocks(_checked_config(config, V, use_qk_l2norm, scale), config, B, HV, V, interpret)
    nt = -(-T // CHUNK)
    tp = nt * CHUNK
    if tp != T:
        pad = tp - T
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    if cfg["design"] == "split":
        return _split_calls(q, k, v, g, beta, initial_state, lengths, T=T, scale=scale, use_l2=use_qk_l2norm,
                            checkpoint_stride=checkpoint_stride, interpret=interpret, cfg=cfg)
    bv = min(cfg["bv"], V)
    nv = V // bv
    f32 = jnp.float32

    cg = _ChunkGrid(q, v)
    prep = pl.pallas_call(
        functools.partial(_prep_kernel, scale=scale, use_l2=use_qk_l2norm, cfg=cfg, interpret=interpret),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.key, cg.value, cg.token, cg.token],
        out_specs=[cg.rows(K), cg.rows(V), cg.rows(K), cg.rows(K), cg.rows(CHUNK), cg.gc],
        # w, u, q * scale * exp(gc), k * exp(gc_last - gc), masked intra-chunk attention, gc
        out_shape=[cg.rows_out(K), cg.rows_out(V), cg.rows_out(K), cg.rows_out(K), cg.rows_out(CHUNK), cg.gc_out],
        compiler_params=_triton_params(cfg["warps_prep"], cfg["stages_prep"]),
        interpret=interpret,
        name="gdn_chunk_prep",
    )
    w, u, qg, kd, aqk, gc = prep(lengths, q, k, v, g, beta)
    if cfg.get("only_prep") or cfg.get("stop_after") == "prep":  # benchmarking hook: the parallel kernel alone
        return w, u, qg, kd, aqk, gc

    per = 0 if checkpoint_stride is None else checkpoint_stride // CHUNK
    nck = 0 if checkpoint_stride is None else T // checkpoint_stride
    out_specs = [
        pl.BlockSpec((None, tp, None, bv), lambda j, h, b: (b, 0, h, j)),
        pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
    ]
    out_shape = [jax.ShapeDtypeStruct((B, tp, HV, V), v.dtype), jax.ShapeDtypeStruct((B, HV, K, V), f32)]
    if nck:
        out_specs.append(pl.BlockSpec((None, nck, None, K, bv), lambda j, h, b: (b, 0, h, 0, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, nck, HV, K, V), f32))
    state = pl.pallas_call(
        functools.partial(_state_kernel, nt=nt, per=per if nck else 0, nck=nck, cfg=cfg, interpret=interpret),
        grid=(nv, HV, B),
        in_specs=[
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, CHUNK), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp), lambda j, h, b: (b, h, 0)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_triton_params(cfg["warps_state"], cfg["stages_state"]),
        interpret=interpret,
        name="gdn_chunk_state",
    )
    outs = state(w, u, qg, kd, aqk, gc, initial_state)
    o = outs[0][:, :T] if tp != T else outs[0]
    if checkpoint_stride is None:
        return o, outs[1]
    ck = outs[2] if nck else jnp.zeros((B, 0, HV, K, V), f32)
    return o, outs[1], ck


class _ChunkGrid:
    """Grid (NT, HV, B) of the chunk-parallel kernels (prep, inverse, apply) and their operands' BlockSpecs, for
    inputs q/k [B, Tp, HK, K], v [B, Tp, HV, V], g/beta [B, Tp, HV] and per-chunk outputs [B, HV, Tp, n]."""

    def __init__(self, q, v):
        self.B, self.tp, hk, self.K = q.shape
        self.HV, self.V = v.shape[2], v.shape[3]
        g = self.HV // hk
        self.grid = (self.tp // CHUNK, self.HV, self.B)
        self.lengths = pl.BlockSpec((1,), lambda c, h, b: (b,))
        self.key = pl.BlockSpec((None, CHUNK, None, self.K), lambda c, h, b: (b, c, h // g, 0))
        self.value = pl.BlockSpec((None, CHUNK, None, self.V), lambda c, h, b: (b, c, h, 0))
        self.token = pl.BlockSpec((None, CHUNK, None), lambda c, h, b: (b, c, h))
        self.gc = pl.BlockSpec((None, None, CHUNK), lambda c, h, b: (b, h, c))
        self.gc_out = jax.ShapeDtypeStruct((self.B, self.HV, self.tp), jnp.float32)

    def rows(self, n):
        """BlockSpec of a per-chunk [B, HV, Tp, n] array."""
        return pl.BlockSpec((None, None, CHUNK, n), lambda c, h, b: (b, h, c, 0))

    def rows_out(self, n, dtype=jnp.float32):
        return jax.ShapeDtypeStruct((self.B, self.HV, self.tp, n), dtype)


def _split_calls(q, k, v, g, beta, initial_state, lengths, *, T, scale, use_l2, checkpoint_stride, interpret, cfg):
    """The split design's pallas_calls (inputs already padded to the grid): prep (one kernel, or two with
    prep_kernels=2) -> recurrence -> output (or the recurrence that computes the output: `fused`)."""
    K, V, HV = q.shape[3], v.shape[3], v.shape[2]
    prep_only = cfg.get("only_prep") or cfg.get("stop_after") in ("prep", "inverse")  # benchmarking hooks
    recurrence = None if prep_only else _recurrence_kernel(cfg, K, V, _wk_dtype(cfg, use_l2, interpret), interpret)
    fused = not prep_only and _output_in_recurrence(cfg, recurrence, q.shape[0], HV, K, V, use_l2,
                                                    (q.dtype, k.dtype), v.dtype, interpret)
    if cfg["prep_kernels"] == 2:
        w, u, kd, gc = _prep_two_calls(q, k, v, g, beta, lengths, use_l2=use_l2, interpret=interpret, cfg=cfg)
    else:  # under skip_padding the fused recurrence reads no chunk of padding but a row's first
        w, u, kd, gc = _prep_one_call(q, k, v, g, beta, lengths, use_l2=use_l2, interpret=interpret, cfg=cfg,
                                      padding_read=not (fused and cfg["skip_padding"]))
    if prep_only:
        return tuple(x for x in (w, u, kd, gc) if x is not None)
    return _recurrence_and_output(q, k, v, w, u, kd, gc, initial_state, lengths, T=T, scale=scale, use_l2=use_l2,
                                  checkpoint_stride=checkpoint_stride, interpret=interpret, cfg=cfg,
                                  recurrence=recurrence, fused=fused)


def _prep_one_call(q, k, v, g, beta, lengths, *, use_l2, interpret, cfg, padding_read=True):
    """The split design's prep kernel: (w, u, kd, gc); with `padding_read=False` (`_prep_split_kernel`) the chunks of
    padding after a row's first are left unwritten."""
    cg = _ChunkGrid(q, v)
    wk = _wk_dtype(cfg, use_l2, interpret)
    return pl.pallas_call(
        functools.partial(_prep_split_kernel, use_l2=use_l2, cfg=cfg, interpret=interpret, padding_read=padding_read),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.value, cg.token, cg.token],
        out_specs=[cg.rows(cg.K), cg.rows(cg.V), cg.rows(cg.K), cg.gc],
        out_shape=[cg.rows_out(cg.K, wk), cg.rows_out(cg.V), cg.rows_out(cg.K, wk), cg.gc_out],
        compiler_params=_triton_params(cfg["warps_prep"], cfg["stages_prep"]),
        interpret=interpret,
        name="gdn_chunk_prep",
    )(lengths, k, v, g, beta)


def _prep_two_calls(q, k, v, g, beta, lengths, *, use_l2, interpret, cfg):
    """prep_kernels=2: the inverse (and gc) in one kernel, w / u / kd in a second; X goes through memory (fp32)."""
    cg = _ChunkGrid(q, v)
    wk = _wk_dtype(cfg, use_l2, interpret)
    x, gc = pl.pallas_call(
        functools.partial(_inverse_kernel, use_l2=use_l2, cfg=cfg, interpret=interpret),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.token, cg.token],
        out_specs=[cg.rows(CHUNK), cg.gc],
        out_shape=[cg.rows_out(CHUNK), cg.gc_out],
        compiler_params=_triton_params(cfg["warps_prep"], cfg["stages_prep"]),
        interpret=interpret,
        name="gdn_chunk_inverse",
    )(lengths, k, g, beta)
    if cfg.get("stop_after") == "inverse":  # benchmarking hook: the inverse kernel alone (X in place of w)
        return x, None, None, gc
    w, u, kd = pl.pallas_call(
        functools.partial(_apply_kernel, use_l2=use_l2, cfg=cfg, interpret=interpret),
        grid=cg.grid,
        in_specs=[cg.lengths, cg.key, cg.value, cg.token, cg.gc, cg.rows(CHUNK)],
        out_specs=[cg.rows(cg.K), cg.rows(cg.V), cg.rows(cg.K)],
        out_shape=[cg.rows_out(cg.K, wk), cg.rows_out(cg.V), cg.rows_out(cg.K, wk)],
        compiler_params=_triton_params(cfg["warps_apply"], 1),
        interpret=interpret,
        name="gdn_chunk_apply",
    )(lengths, k, v, beta, gc, x)
    return w, u, kd, gc


def _recurrence_and_output(q, k, v, w, u, kd, gc, initial_state, lengths, *, T, scale, use_l2, checkpoint_stride,
                           interpret, cfg, recurrence, fused):
    """The split design's recurrence ("triton" or "mosaic": `_recurrence_kernel`) and output kernels, or with `fused`
    (`_output_in_recurrence`) the recurrence that computes the output; and the in-call checkpoints."""
    B, tp, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    nt = tp // CHUNK
    f32 = jnp.float32
    ht, vt = _transposed(cfg)  # h [.., nt, V, K] / v_new [.., V, Tp] transposed (else [.., nt, K, V] / [.., Tp, V])
    if fused:
        # the output, its qg and Aqk and the in-call checkpoints inside the recurrence: h and v_new never go through
        # memory (`state_recurrence_output_intra_mgpu`)
        r_q, r_k = key_norms(q, k, lengths, warps=cfg["warps_out"], interpret=interpret)
        per = None if checkpoint_stride is None else checkpoint_stride // CHUNK
        o, final, *inside = state_recurrence_output_intra_mgpu(
            w, u, kd, gc, initial_state, q, k, r_q, r_k, scale=scale, out_dtype=v.dtype, qk_dtype=_qk_dtype(cfg),
            checkpoint_chunks=per, warpgroups=cfg["fused_warpgroups"], registers=_fused_registers(cfg),
            lengths=lengths if cfg["skip_padding"] else None, interpret=interpret)
        state_at = lambda i: inside[0][:, i // per - 1]  # noqa: E731  (the kernel's m-th stored state)
    else:
        if recurrence == "mosaic":
            h, vn, final = state_recurrence_mgpu(w, u, kd, gc, initial_state, warp_specialised=cfg["recurrence_ws"],
                                                 interpret=interpret)
        else:
            h, vn, final = _state_split_call(w, u, kd, gc, initial_state, nt=nt, interpret=interpret, cfg=cfg)
        if cfg.get("stop_after") == "state":
            return h, vn, final
        o = _output_call(q, k, gc, h, vn, lengths, scale=scale, use_l2=use_l2, out_dtype=v.dtype,
                         interpret=interpret, cfg=cfg)
        state_at = lambda i: jnp.swapaxes(h[:, :, i], -1, -2) if ht else h[:, :, i]  # noqa: E731  (h[i], exact)
    o = o[:, :T] if tp != T else o
    if checkpoint_stride is None:
        return o, final
    # the state after m * per chunks is the state at the start of chunk m * per (or the final state): exact copies
    per = checkpoint_stride // CHUNK
    parts = [state_at(i) if i < nt else final for i in (m * per for m in range(1, T // checkpoint_stride + 1))]
    return o, final, (jnp.stack(parts, axis=1) if parts else jnp.zeros((B, 0, HV, K, V), f32))


def _output_call(q, k, gc, h, vn, lengths, *, scale, use_l2, out_dtype, interpret, cfg):
    """The split design's output o [B, Tp, HV, V] from the inputs q, k [B, Tp, HK, K], gc and the recurrence's h and
    v_new (in the layouts `_transposed` names): the Triton kernel (`_out_kernel`) or the Mosaic GPU one
    (`output_mgpu.py`, config `output`)."""
    B, tp, HK, K = q.shape
    HV, V = vn.shape[1], (vn.shape[2] if _transposed(cfg)[1] else vn.shape[3])
    if _output_kernel(cfg, K, V, use_l2, (q.dtype, k.dtype), out_dtype, interpret) == "mosaic":
        r_q, r_k = key_norms(q, k, lengths, warps=cfg["warps_out"], interpret=interpret)
        return chunk_output_mgpu(q, k, r_q, r_k, gc, h, vn, scale=scale, out_dtype=out_dtype, qk_dtype=_qk_dtype(cfg),
                                 order=cfg["output_order"], interpret=interpret)
    G = HV // HK
    nt = tp // CHUNK
    bvo = min(cfg["bv_out"], V)
    ht, vt = _transposed(cfg)
    return pl.pallas_call(
        functools.partial(_out_kernel, scale=scale, use_l2=use_l2, cfg=cfg, interpret=interpret),
        grid=(nt, HV, B, V // bvo),
        in_specs=[
            pl.BlockSpec((1,), lambda c, h, b, j: (b,)),
            pl.BlockSpec((None, CHUNK, None, K), lambda c, h, b, j: (b, c, h // G, 0)),
            pl.BlockSpec((None, CHUNK, None, K), lambda c, h, b, j: (b, c, h // G, 0)),
            pl.BlockSpec((None, None, CHUNK), lambda c, h, b, j: (b, h, c)),
            pl.BlockSpec((None, None, None, bvo, K), lambda c, h, b, j: (b, h, c, j, 0)) if ht else
            pl.BlockSpec((None, None, None, K, bvo), lambda c, h, b, j: (b, h, c, 0, j)),
            pl.BlockSpec((None, None, bvo, CHUNK), lambda c, h, b, j: (b, h, j, c)) if vt else
            pl.BlockSpec((None, None, CHUNK, bvo), lambda c, h, b, j: (b, h, c, j)),
        ],
        out_specs=pl.BlockSpec((None, CHUNK, None, bvo), lambda c, h, b, j: (b, c, h, j)),
        out_shape=jax.ShapeDtypeStruct((B, tp, HV, V), out_dtype),
        compiler_params=_triton_params(cfg["warps_out"], cfg["stages_out"]),
        interpret=interpret,
        name="gdn_chunk_out",
    )(lengths, q, k, gc, h, vn)


def _qk_dtype(cfg: dict):
    return jnp.float16 if cfg["p_qk"] == "fp16" else jnp.bfloat16


def _output_fits(cfg: dict, K: int, V: int, use_l2: bool, qk_dtypes, out_dtype) -> bool:
    """Whether the Mosaic GPU output arithmetic (`output_mgpu`: the output kernel, or inside the recurrence) applies."""
    return (_transposed(cfg) == (True, True) and use_l2 and K in (64, 128) and V in (64, 128)
            and all(jnp.dtype(d).itemsize == 2 for d in qk_dtypes)
            and output_mgpu.shared_memory_bytes(K, V, qk_dtypes[0], out_dtype) <= output_mgpu.SMEM_BYTES
            and cfg["bv_out"] >= V and cfg["p_qk"] in ("fp16", "bf16") and cfg["p_qs"] == cfg["p_av"] == "tf32")


def _fused_registers(cfg: dict) -> tuple[int, int, int] | None:
    """The register split (`setmaxnreg`) the fused kernel's warpgroups get (config `fused_registers`): "auto" takes
    `recurrence_mgpu.DEFAULT_REGISTER_SPLIT` with three warpgroups and none with two."""
    regs = cfg["fused_registers"]
    if regs == "auto":
        return DEFAULT_REGISTER_SPLIT if cfg["fused_warpgroups"] == 3 else None
    return None if regs is None else tuple(regs)


def _output_in_recurrence(cfg: dict, recurrence: str, B: int, HV: int, K: int, V: int, use_l2: bool, qk_dtypes,
                          out_dtype, interpret: bool) -> bool:
    """Whether the output is computed inside the Mosaic GPU recurrence ("fused_intra", config `output`) rather than
    the recurrence storing h and v_new for an output kernel. Only where the Mosaic GPU recurrence runs and the
    output's arithmetic fits (`_output_fits`); "auto" (default) takes it on the GPU where the recurrence's grid
    (V / 64, HV, B) has at least `fused_min_programs` programs and K = V = 128 (where it was measured, and faster:
    BENCHMARKS.md runs 168-169 and 172; on smaller grids the chain is latency-bound and the output kernel's own grid
    is faster; other head sizes were not run on a GPU)."""
    if (recurrence != "mosaic" or cfg.get("stop_after") is not None
            or not _output_fits(cfg, K, V, use_l2, qk_dtypes, out_dtype)):
        return False
    if cfg["output"] == "auto":
        return not interpret and K == V == 128 and B * HV * (V // 64) >= cfg["fused_min_programs"]
    return cfg["output"] == "fused_intra"


def _output_kernel(cfg: dict, K: int, V: int, use_l2: bool, qk_dtypes, out_dtype, interpret: bool) -> str:
    """"triton" or "mosaic": which kernel computes the split design's output where it is not computed inside the
    recurrence (`_output_in_recurrence`; config `output`). "mosaic" where asked (refused where it cannot apply);
    otherwise, "auto" and "fused_intra" included, the Triton kernel (the same bits)."""
    fits = _output_fits(cfg, K, V, use_l2, qk_dtypes, out_dtype)
    choice = "triton" if cfg["output"] in ("auto", "fused_intra") else cfg["output"]
    return _triton_or_mosaic("output", choice, fits, interpret, lambda: (
        f"needs states_t=True, the L2 norm of q and k, 16-bit q and k (shared memory; at K = V = 128 outputs in "
        f"q's dtype), K and V 64 or 128, bv_out >= V, p_qk 'fp16' or 'bf16' and p_qs = p_av = 'tf32'; got "
        f"states_t={cfg['states_t']!r}, use_qk_l2norm={use_l2}, q and k in {[jnp.dtype(d).name for d in qk_dtypes]}, "
        f"out_dtype={jnp.dtype(out_dtype).name}, K={K}, V={V}, bv_out={cfg['bv_out']}, p_qk={cfg['p_qk']!r}, "
        f"p_qs={cfg['p_qs']!r}, p_av={cfg['p_av']!r}"))


def _state_split_call(w, u, kd, gc, initial_state, *, nt, interpret, cfg):
    """The Triton recurrence (`_state_split_kernel`): (h, v_new, final state) in the layouts `_transposed` names."""
    B, HV, tp, K = w.shape
    V = u.shape[-1]
    bv = min(cfg["bv"], V)
    f32 = jnp.float32
    ht, vt = _transposed(cfg)
    return pl.pallas_call(
        functools.partial(_state_split_kernel, nt=nt, cfg=cfg, interpret=interpret),
        grid=(V // bv, HV, B),
        in_specs=[
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, tp, K), lambda j, h, b: (b, h, 0, 0)),
            pl.BlockSpec((None, None, tp), lambda j, h, b: (b, h, 0)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, nt, bv, K), lambda j, h, b: (b, h, 0, j, 0)) if ht else
            pl.BlockSpec((None, None, nt, K, bv), lambda j, h, b: (b, h, 0, 0, j)),
            pl.BlockSpec((None, None, bv, tp), lambda j, h, b: (b, h, j, 0)) if vt else
            pl.BlockSpec((None, None, tp, bv), lambda j, h, b: (b, h, 0, j)),
            pl.BlockSpec((None, None, K, bv), lambda j, h, b: (b, h, 0, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, HV, nt) + ((V, K) if ht else (K, V)), f32),  # state at the start of every chunk
            jax.ShapeDtypeStruct((B, HV) + ((V, tp) if vt else (tp, V)), f32),  # v_new
            jax.ShapeDtypeStruct((B, HV, K, V), f32),  # final state
        ],
        compiler_params=_triton_params(cfg["warps_state"], cfg["stages_state"]),
        interpret=interpret,
        name="gdn_chunk_state",
    )(w, u, kd, gc, initial_state)


def _recurrence_kernel(cfg: dict, K: int, V: int, wk_dtype, interpret: bool) -> str:
    """"triton" or "mosaic": which kernel runs the split design's recurrence (config `recurrence`, DEFAULT_CONFIG's
    notes). "auto" takes the Mosaic GPU kernel on a Hopper GPU where it applies; an explicit "mosaic" where it
    cannot apply is refused."""
    fits = (_transposed(cfg) == (True, True) and V % 64 == 0 and K % 32 == 0 and K <= 128
            and wk_dtype == jnp.float16)
    return _triton_or_mosaic("recurrence", cfg["recurrence"], fits, interpret, lambda: (
        f"needs states_t=True, w and kd stored in fp16 (wk_dtype), V a multiple of 64 and K a multiple of 32 up to "
        f"128; got states_t={cfg['states_t']!r}, w and kd in {jnp.dtype(wk_dtype).name}, K={K}, V={V}"))


def _triton_or_mosaic(key: str, choice: str, fits: bool, interpret: bool, why_not) -> str:
    """The one rule behind the config keys that pick a Triton or a Mosaic GPU kernel (`recurrence`, `output`):
    "mosaic" where asked and `fits` (else a ValueError whose text `why_not()` gives); "triton" where asked, in
    interpret mode or where the Mosaic GPU kernel does not fit; "auto": "mosaic" on a Hopper GPU (compute capability
    9.0), else "triton"."""
    if choice == "mosaic":
        if not fits:
            raise ValueError(f"{key}='mosaic' {why_not()}")
        return "mosaic"
    if choice == "triton" or interpret or not fits:
        return "triton"
    device = jax.devices()[0]
    return "mosaic" if device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0" else "triton"


def _triton_params(num_warps, num_stages):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def chunk_gated_delta_rule_pallas(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True,
                                  lengths=None, checkpoint_stride=None, interpret=False, config=None):
    """Chunked gated delta rule (prefill) with Pallas kernels. Shapes and semantics: `reference.py`.

    q, k: [B,T,HK,K] (bf16 or fp32); v: [B,T,HV,V]; g: fp32 log-decay [B,T,HV]; beta: [B,T,HV];
    initial_state fp32 [B,HV,K,V] or None; lengths int32 [B] or None; checkpoint_stride None or a multiple of 64.
    Returns (o [B,T,HV,V] in v.dtype, final_state fp32 [B,HV,K,V]) or (o, final_state, checkpoints
    [B, T // stride, HV, K, V]). `config` (a dict, see DEFAULT_CONFIG) overrides launch/precision choices.
    """
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"expected q, k [B,T,HK,K] and v [B,T,HV,V]; got {q.shape}, {k.shape}, {v.shape}")
    B, T, HK, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % HK:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({HK})")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B,T,HV]={(B, T, HV)}; got {g.shape}, {beta.shape}")
    if checkpoint_stride is not None and (checkpoint_stride <= 0 or checkpoint_stride % CHUNK):
        raise ValueError(f"checkpoint_stride must be a positive multiple of {CHUNK}; got {checkpoint_stride}")
    _check_pow2("K", K)
    _check_pow2("V", V)
    scale = float(K**-0.5 if scale is None else scale)
    if initial_state is None:
        initial_state = jnp.zeros((B, HV, K, V), jnp.float32)
    elif initial_state.shape != (B, HV, K, V):
        raise ValueError(f"initial_state must be [B,HV,K,V]={(B, HV, K, V)}; got {initial_state.shape}")
    lengths = (jnp.full((B,), T, jnp.int32) if lengths is None
               else jnp.clip(jnp.asarray(lengths, jnp.int32), 0, T))  # a negative length: an empty row
    config = static_config(config)
    return _chunk_impl(q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32),
                       initial_state.astype(jnp.float32), lengths, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
                       checkpoint_stride=checkpoint_stride, interpret=bool(interpret), config=config)
