"""Lower every Pallas kernel for an H200 (CUDA, sm_90) on a CPU-only jaxlib, so that GPU rules interpret mode ignores
fail CI.

How: an abstract mesh whose AbstractDevice is 'NVIDIA H200' / platform 'cuda' makes the Pallas-Triton lowering pick
compute capability 9.0 without a GPU, and `jax.jit(f).trace(...).lower(lowering_platforms=('cuda',))` runs the
whole Pallas -> Triton-IR lowering (this enforces power-of-two array shapes, 2-D dots, supported ops/dtypes).
What it cannot do without a GPU jaxlib is run Triton's own compiler (that happens inside XLA:GPU at compile time),
so Triton-compiler rules are checked here on the captured Triton IR: every `tt.dot` has M, N, K >= 16 and operands
of one element type. The decode kernel's state aliasing is checked on the emitted custom call.
"""

from __future__ import annotations

import re

import pytest

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, AxisType
from jax.experimental import pallas as pl

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.recurrent import recurrent_gated_delta_rule_pallas
from pallas_kernels.gated_delta.scan import fused_recurrent_gated_delta_rule_pallas

SDS = jax.ShapeDtypeStruct
H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(f, *args):
    """Lower `f` for CUDA/H200; returns (lowered, [Triton module per pallas_call])."""
    from jax._src.pallas.triton import lowering as tl

    modules = []
    orig = tl.lower_jaxpr_to_triton_module

    def capture(*a, **kw):
        res = orig(*a, **kw)
        modules.append(res.module)
        return res

    mesh = AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=H200)
    tl.lower_jaxpr_to_triton_module = capture
    try:
        with jax.sharding.use_abstract_mesh(mesh):  # a fresh function: `f` lowered before with the same shapes (in
            # another test of this worker) would come from jit's cache, its kernels not lowered again, not captured
            lowered = jax.jit(lambda *a: f(*a)).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        tl.lower_jaxpr_to_triton_module = orig
    return lowered, modules


def _walk(op):
    for region in op.regions:
        for block in region.blocks:
            for o in block.operations:
                yield o
                yield from _walk(o)


def dot_problems(modules):
    """Triton compiler rules for tt.dot: 2-D operands, M, N, K >= 16, same element type."""
    from jax._src.lib.mlir import ir

    bad, n = [], 0
    for m in modules:
        for op in _walk(m.operation):
            if op.name != "tt.dot":
                continue
            n += 1
            a, b = (ir.RankedTensorType(x.type) for x in list(op.operands)[:2])
            (M, Ka), (Kb, N) = a.shape, b.shape
            if min(M, N, Ka) < 16 or Ka != Kb or str(a.element_type) != str(b.element_type):
                bad.append(f"{a} x {b}")
    return n, bad


def fma_count(modules):
    """The number of PTX `fma.rn.f32` inline-assembly ops (the per-token arithmetic's FMAs) in the modules."""
    return asm_count(modules, "fma.rn.f32")


def asm_count(modules, instruction: str, kernel: str | None = None):
    """The PTX inline-assembly ops containing `instruction` in the modules (or in the one named `kernel`)."""
    return sum(op.name == "tt.elementwise_inline_asm" and instruction in str(op.attributes["asm_string"])
               for m in modules if kernel is None or m.operation.attributes["sym_name"].value == kernel
               for op in _walk(m.operation))


def chunk_args(B, T, HK, HV, K, V, dtype):
    return (SDS((B, T, HK, K), dtype), SDS((B, T, HK, K), dtype), SDS((B, T, HV, V), dtype),
            SDS((B, T, HV), jnp.float32), SDS((B, T, HV), jnp.float32), SDS((B, HV, K, V), jnp.float32),
            SDS((B,), jnp.int32))


@pytest.mark.parametrize("B,T,HK,HV,K,V,dtype,stride", [
    (1, 8192, 16, 32, 128, 128, jnp.bfloat16, 1024),  # Qwen3.5 shape, with checkpoints
    (2, 130, 1, 4, 32, 32, jnp.float32, None),        # the CPU tests' shapes
    (1, 1, 2, 4, 16, 64, jnp.bfloat16, 64),
])
def test_chunk_lowers_for_h200(B, T, HK, HV, K, V, dtype, stride):
    f = lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s0, lengths=n,
                                                                   checkpoint_stride=stride)
    lowered, modules = lower_for_h200(f, *chunk_args(B, T, HK, HV, K, V, dtype))
    assert len(modules) == 3  # default (split) design: prep (tiled inverse, w / u / kd), state recurrence, output
    n, bad = dot_problems(modules)
    assert n >= 10 and not bad, bad
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


@pytest.mark.parametrize("config", [{"bv": 64, "p_ws": "bf16", "p_kv": "ieee"}, {"bv": 16}, {"inv": "doubling"},
                                    {"inv": "fwd64", "bv": 32},
                                    {"design": "fused", "prep_kernels": 1, "inv": "block16"},
                                    {"design": "fused", "bv": 32, "stages_state": 2, "prep_kernels": 1,
                                     "inv": "block16"},
                                    {"bv": 32, "bv_out": 64, "stages_state": 2, "warps_out": 8},
                                    {"prep_kernels": 2}, {"prep_kernels": 2, "inv": "block16"},
                                    {"prep_kernels": 2, "warps_apply": 8}, {"warps_prep": 8},
                                    {"wk_dtype": "float32"}, {"states_t": False, "bv_out": 64},
                                    {"states_t": False, "bv": 64}, {"states_t": "h"}, {"states_t": "v_new", "bv": 32},
                                    {"p_kk": "bf16"}, {"p_kk": "bf16x3", "prep_kernels": 2}, {"p_qk": "tf32"}])
def test_chunk_configs_lower(config):
    f = lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s0, lengths=n,
                                                                   config=config)
    _, modules = lower_for_h200(f, *chunk_args(2, 256, 2, 4, 128, 128, jnp.bfloat16))
    assert not dot_problems(modules)[1]


@pytest.mark.parametrize("K,V,stride", [(128, 128, 64), (64, 128, None)])
def test_chunk_with_the_mosaic_recurrence_lowers_for_h200(K, V, stride):
    """The prefill with its recurrence as the Mosaic GPU kernel (config recurrence="mosaic", the default on a Hopper
    GPU): prep and output on Triton, the recurrence a Mosaic GPU custom call."""
    f = lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s0, lengths=n,
                                                                   checkpoint_stride=stride,
                                                                   config={"recurrence": "mosaic"})
    lowered, modules = lower_for_h200(f, *chunk_args(2, 200, 2, 4, K, V, jnp.bfloat16))
    assert len(modules) == 2  # prep and output (Triton); the recurrence is not a Triton kernel
    assert not dot_problems(modules)[1]
    text = lowered.as_text()
    assert "mosaic_gpu" in text and "__gpu$xla.gpu.triton" in text


def _mosaic_prefill_lowered_twice():
    """The prefill with the Mosaic GPU recurrence lowered twice in this process: ((lowered, Triton modules) x 2)."""
    f = lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s0, lengths=n,
                                                                   config={"recurrence": "mosaic"})
    args = chunk_args(1, 128, 2, 4, 64, 64, jnp.bfloat16)
    return lower_for_h200(f, *args), lower_for_h200(f, *args)


def _mosaic_kernel_ids(lowered):
    """The Mosaic GPU kernels' hashes, and their numbered names (`\\00name_count\\00` before the dialect's name in
    the module's bytes)."""
    text = lowered.as_text()
    return (re.findall(r'kernel_hash = "(.*?)", module', text),
            re.findall(r"\\00([A-Za-z_]+_\d+)\\00stable_mosaic_gpu", text))


def test_mosaic_gpu_kernels_are_numbered_by_the_process():
    """A canary for what `jaxgdn.program_cache.stable_kernel_names` works around: jax 0.11.2 names every Mosaic GPU
    kernel it lowers with a per-process count (the module's `mosaic_gpu.dump_basename`), and the kernel's hash and
    module are part of the program, so the same prefill lowered twice in one process is two programs to XLA and to
    JAX's persistent compilation cache, and a new process finds a cached program only if it lowered as many Mosaic
    GPU kernels before it. The Triton kernels' lowering is the same both times. When this fails, jax lowers a kernel
    alike each time: drop the work-around."""
    (one, triton_one), (two, triton_two) = _mosaic_prefill_lowered_twice()
    assert [str(m) for m in triton_one] == [str(m) for m in triton_two]
    (hashes_one, names_one), (hashes_two, names_two) = _mosaic_kernel_ids(one), _mosaic_kernel_ids(two)
    assert len(hashes_one) == len(hashes_two) == 1 and hashes_one != hashes_two
    assert len(names_one) == len(names_two) == 1 and names_one != names_two, (names_one, names_two)


def test_stable_kernel_names_lower_a_mosaic_gpu_kernel_alike_every_time(tmp_path):
    """Inside `stable_kernel_names` (and so inside `jaxgdn.compile_cache`) the same prefill lowers to the same program
    every time in one process — its Mosaic GPU kernel's hash the same, no numbered name in it — so a process finds
    it in the persistent cache whatever it lowered before; outside, jax's count is back (the context restores the
    lowering)."""
    from jaxgdn import compile_cache
    from jaxgdn.program_cache import stable_kernel_names

    with stable_kernel_names():
        (one, _), (two, _) = _mosaic_prefill_lowered_twice()
    with compile_cache(tmp_path / "cache"):  # the public form: the cache settings and the names together
        (three, _), _ = _mosaic_prefill_lowered_twice()
    assert one.as_text() == two.as_text() == three.as_text()
    hashes, numbered = _mosaic_kernel_ids(one)
    assert len(hashes) == 1 and numbered == []
    (after, _), _ = _mosaic_prefill_lowered_twice()  # the context gone: the per-process count again
    hashes_after, numbered_after = _mosaic_kernel_ids(after)
    assert len(numbered_after) == 1 and hashes_after != hashes


@pytest.mark.parametrize("B,T,stride,config", [(1, 8192, 1000, None), (64, 1, None, None),
                                               (2, 130, 64, {"bv": 64, "num_warps": 4}), (3, 7, None, {"bv": 16}),
                                               (1, 300, 64, {"bv": 8, "ahead": 4})])
def test_scan_lowers_for_h200_in_place(B, T, stride, config):
    f = lambda q, k, v, g, b, s0, n: fused_recurrent_gated_delta_rule_pallas(
        q, k, v, g, b, initial_state=s0, lengths=n, checkpoint_stride=stride, config=config)
    lowered, modules = lower_for_h200(f, *chunk_args(B, T, 16, 32, 128, 128, jnp.bfloat16))
    assert len(modules) == 1 and not dot_problems(modules)[1]
    assert "output_operand_aliases" in lowered.as_text()
    assert fma_count(modules) > 0  # the per-token arithmetic's FMAs reach the GPU code (not in interpret mode)


@pytest.mark.parametrize("B,HK,HV,K,V,fused", [(64, 16, 32, 128, 128, True), (3, 1, 2, 16, 32, False)])
def test_decode_lowers_for_h200_in_place(B, HK, HV, K, V, fused):
    def f(q, k, v, g, b, s, A_log, dt_bias):
        kw = dict(A_log=A_log, dt_bias=dt_bias) if fused else {}
        return recurrent_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s, **kw)

    args = (SDS((B, HK, K), jnp.bfloat16), SDS((B, HK, K), jnp.bfloat16), SDS((B, HV, V), jnp.bfloat16),
            SDS((B, HV), jnp.float32), SDS((B, HV), jnp.float32), SDS((B, HV, K, V), jnp.float32),
            SDS((HV,), jnp.float32), SDS((HV,), jnp.float32))
    lowered, modules = lower_for_h200(f, *args)
    assert len(modules) == 1 and not dot_problems(modules)[1]
    assert fma_count(modules) > 0
    text = lowered.as_text()
    assert "__gpu$xla.gpu.triton" in text and "output_operand_aliases" in text


def _tiny_call(block, dot_n):
    """A deliberately bad kernel: block rows `block`, a dot of inner size `dot_n`."""
    def kern(x_ref, o_ref):
        x = x_ref[...]
        o_ref[...] = jnp.dot(x[:, :dot_n] if dot_n < x.shape[1] else x, jnp.ones((dot_n, 16), x.dtype),
                             precision=jax.lax.Precision.HIGHEST)

    def f(x):
        return pl.pallas_call(kern, grid=(1,), in_specs=[pl.BlockSpec((block, 16), lambda i: (0, 0))],
                              out_specs=pl.BlockSpec((block, 16), lambda i: (0, 0)),
                              out_shape=SDS((block, 16), jnp.float32))(x)
    return f


def test_checks_catch_gpu_rule_violations():
    """Controls: the same machinery rejects a non-power-of-two block and flags a dot smaller than 16."""
    with pytest.raises(Exception, match="power of 2"):
        lower_for_h200(_tiny_call(24, 16), SDS((24, 16), jnp.float32))
    _, modules = lower_for_h200(_tiny_call(8, 16), SDS((8, 16), jnp.float32))
    assert dot_problems(modules)[1]
    _, modules = lower_for_h200(_tiny_call(16, 16), SDS((16, 16), jnp.float32))
    assert not dot_problems(modules)[1]


@pytest.mark.parametrize("B,C,dtype", [(64, 8192, jnp.bfloat16), (2, 64, jnp.float32)])
def test_conv1d_update_lowers_for_h200_in_place(B, C, dtype):
    from pallas_kernels.conv1d import causal_conv1d_update_pallas

    lowered, modules = lower_for_h200(lambda x, s, w: causal_conv1d_update_pallas(x, s, w),
                                      SDS((B, C), dtype), SDS((B, 3, C), dtype), SDS((4, C), jnp.float32))
    assert len(modules) == 1
    assert "output_operand_aliases" in lowered.as_text()


@pytest.mark.parametrize("M,K,N", [(1, 4096, 12288), (8192, 12288, 4096), (5, 96, 80), (64, 4096, 32)])
def test_invariant_matmul_lowers_for_h200(M, K, N):
    """One kernel; one dot per in-kernel K slice (the many-row tiling reduces a split weight's slices in-kernel:
    (8192, 12288, 4096) has two)."""
    from pallas_kernels.matmul import DEFAULT_CONFIG, _plan, matmul_invariant_pallas

    _, modules = lower_for_h200(lambda x, w: matmul_invariant_pallas(x, w), SDS((M, K), jnp.bfloat16),
                                SDS((K, N), jnp.bfloat16))
    n, bad = dot_problems(modules)
    inner = _plan(M, K, N, DEFAULT_CONFIG)[4]
    assert (M, K, N) != (8192, 12288, 4096) or inner == 2
    assert len(modules) == 1 and n == inner and not bad, bad


@pytest.mark.parametrize("B,T,H,HKV,Dh,N,rows", [(64, 1, 16, 4, 256, 1088, 16), (1, 8192, 16, 4, 256, 8192, 64),
                                                 (2, 7, 4, 2, 32, 100, 64)])
def test_invariant_attention_lowers_for_h200(B, T, H, HKV, Dh, N, rows):
    from pallas_kernels.attention import attention_invariant_pallas

    f = lambda q, k, v, p: attention_invariant_pallas(q, k, v, p, rows=rows)
    _, modules = lower_for_h200(f, SDS((B, T, H, Dh), jnp.bfloat16), SDS((B, N, HKV, Dh), jnp.bfloat16),
                                SDS((B, N, HKV, Dh), jnp.bfloat16), SDS((B, T), jnp.int32))
    n, bad = dot_problems(modules)
    assert len(modules) == 1 and n == 2 and not bad, bad


def test_invariant_matmul_with_transposed_weight_lowers_for_h200():
    from pallas_kernels.matmul import matmul_invariant_pallas

    f = lambda x, w: matmul_invariant_pallas(x, w, w_transposed=True)  # noqa: E731
    _, modules = lower_for_h200(f, SDS((64, 1024), jnp.bfloat16), SDS((151936, 1024), jnp.bfloat16))
    n, bad = dot_problems(modules)
    assert len(modules) == 1 and n == 1 and not bad, bad


@pytest.mark.parametrize("B,bv", [(1, 16), (2, 32), (8, 64)])
def test_chunk_recurrence_block_follows_the_grid(B, bv):
    """On the GPU the recurrence takes V blocks of 16 on a tiny grid (B=1, HV=32: 256 programs of bv 16), 32 on a
    small one (B=2: 128 programs of bv 64) and keeps 64 on a large one (`chunk._recurrence_blocks`): the state
    kernel's dots are [64, bv] and [128, bv]."""
    from jax._src.lib.mlir import ir

    f = lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s0, lengths=n)
    _, modules = lower_for_h200(f, *chunk_args(B, 128, 16, 32, 128, 128, jnp.bfloat16))
    state = [m for m in modules if any("gdn_chunk_state" in str(op.attributes["sym_name"])
                                       for op in m.body.operations if "sym_name" in op.attributes)]
    assert len(state) == 1
    dots = sorted(tuple(ir.RankedTensorType(op.result.type).shape) for op in _walk(state[0].operation)
                  if op.name == "tt.dot")
    assert dots == [(64, bv), (128, bv)], dots


def replay_step_args(B, HK, HV, K, V):
    """Abstract arguments of `chunk_replay_step_pallas`: the open chunk (bf16 q, k, v; fp32 g, beta) and the
    boundary state, then the two caches (lengths are the caller's)."""
    from pallas_kernels.gated_delta.replay import replay_caches

    f32, bf = jnp.float32, jnp.bfloat16
    chunk = (SDS((B, 64, HK, K), bf), SDS((B, 64, HK, K), bf), SDS((B, 64, HV, V), bf), SDS((B, 64, HV), f32),
             SDS((B, 64, HV), f32), SDS((B, HV, K, V), f32))
    xc, vc = (SDS(c.shape, f32) for c in replay_caches(B, HV, V))
    return chunk, xc, vc


@pytest.mark.parametrize("B,HK,HV,K,V", [(64, 16, 32, 128, 128), (3, 1, 2, 32, 32)])
def test_replay_step_lowers_for_h200_in_place(B, HK, HV, K, V):
    """The replay step (`gated_delta/replay.py`): four kernels (the new row's prep; its Aqk and qg; v_new and the
    output; the boundary state) whose dots all satisfy Triton's rules, with the x cache updated in place by the
    first, the v_new cache by the third, the state and the v_new cache by the fourth (four aliased outputs), and
    `prime` the first and third (a loop over the step in its priming form: an open chunk never completes, and its
    outputs are not wanted: no Aqk / qg kernel)."""
    from pallas_kernels.gated_delta.replay import chunk_replay_prime_pallas, chunk_replay_step_pallas

    chunk, xc, vc = replay_step_args(B, HK, HV, K, V)
    lowered, modules = lower_for_h200(chunk_replay_step_pallas, *chunk, xc, vc, SDS((B,), jnp.int32))
    n, bad = dot_problems(modules)
    assert len(modules) == 4 and n > 20 and not bad, bad
    assert lowered.as_text().count("output_operand_aliases") == 3  # one attribute per custom call
    assert re.findall(r"output_tuple_indices = \[(\d)\]", lowered.as_text()) == ["2", "1", "0", "1"]
    lowered, modules = lower_for_h200(chunk_replay_prime_pallas, *chunk, SDS((B,), jnp.int32))
    assert re.findall(r'name = "(gdn_replay_\w+)"', lowered.as_text()) == ["gdn_replay_prep", "gdn_replay_out"]
    assert lowered.as_text().count("output_operand_aliases") == 2  # the x cache, the v_new cache


@pytest.mark.parametrize("update,mul,fma", [("mul_add", 1, 0), ("fma", 0, 1), ("auto", 0, 0)])
@pytest.mark.parametrize("K", [16, 128])
def test_state_update_rounding_is_written_out_in_every_kernel(update, mul, fma, K):
    """The state after a chunk, exp(gc_last) S + kd^T v_new, rounds as config `state_update` says in the prefill's
    recurrence, in the replay step's kernel 4 and in the fused design's sequential kernel alike: "mul_add" (default)
    one `mul.rn.f32` (which no compiler contracts with the add), "fma" one `fma.rn.f32`, "auto" neither (the
    compiler's choice: offline Triton fused the recurrence's and not kernel 4's; BENCHMARKS.md, runs 93-94)."""
    from pallas_kernels.gated_delta.replay import chunk_replay_step_pallas

    config = {"state_update": update}
    f = lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s0, lengths=n,
                                                                   config=config)
    _, prefill = lower_for_h200(f, *chunk_args(2, 130, 1, 2, K, K, jnp.bfloat16))
    chunk, xc, vc = replay_step_args(2, 1, 2, K, K)
    _, step = lower_for_h200(lambda *a: chunk_replay_step_pallas(*a, config=config), *chunk, xc, vc,
                             SDS((2,), jnp.int32))
    for modules, kernel in ((prefill, "gdn_chunk_state"), (step, "gdn_replay_state")):
        assert (asm_count(modules, "mul.rn.f32", kernel), asm_count(modules, "fma.rn.f32", kernel)) == (mul, fma)
    assert asm_count(prefill, ".rn.f32") == mul + fma  # nowhere else in the prefill
    fused = {"design": "fused", "prep_kernels": 1, "inv": "block16", "state_update": update}  # its sequential kernel
    _, modules = lower_for_h200(lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(
        q, k, v, g, b, initial_state=s0, lengths=n, config=fused), *chunk_args(2, 130, 1, 2, K, K, jnp.bfloat16))
    assert (asm_count(modules, "mul.rn.f32", "gdn_chunk_state"), asm_count(modules, "fma.rn.f32")) == (mul, fma)


def test_state_update_option_is_checked_and_interpret_mode_ignores_it():
    """A `state_update` other than the three is refused; in interpret mode (no PTX) every option computes the same
    multiply and add, bitwise."""
    import numpy as np

    rng = np.random.default_rng(5)
    B, T, HK, HV, K, V = 2, 70, 1, 2, 16, 16
    q, k = (jnp.asarray(rng.standard_normal((B, T, HK, K)), jnp.bfloat16) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, T, HV, V)), jnp.bfloat16)
    g = jnp.asarray(-rng.uniform(0.01, 1.0, (B, T, HV)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (B, T, HV)), jnp.float32)
    run = lambda update: chunk_gated_delta_rule_pallas(q, k, v, g, beta, interpret=True,  # noqa: E731
                                                       config={"state_update": update})
    outs = [run(u) for u in ("mul_add", "fma", "auto")]
    for o in outs[1:]:
        assert np.array_equal(np.asarray(o[0]), np.asarray(outs[0][0]))
        assert np.array_equal(np.asarray(o[1]), np.asarray(outs[0][1]))
    with pytest.raises(ValueError, match="state_update"):
        run("fused")


@pytest.mark.parametrize("groups", [16, 1])
def test_packed_replay_step_lowers_for_h200_in_place(groups):
    """The replay step on the model's packed buffers (`open_chunk.py`, Qwen3.5-9B's GDN shape; the grouped layout
    and Hugging Face's): the four kernels read q, k and v out of the one qkv buffer, and a fifth empties the rows
    whose chunk completed, in place (its two aliased outputs: the qkv and gates buffers)."""
    from functools import partial

    from pallas_kernels.gated_delta.replay import chunk_replay_step_packed_pallas

    B, HK, HV, K, V = 64, 16, 32, 128, 128
    _, xc, vc = replay_step_args(B, HK, HV, K, V)
    qkv = SDS((B, 64, 2 * HK * K + HV * V), jnp.bfloat16)
    gates = SDS((B, 64, 2, HV), jnp.float32)
    step = partial(chunk_replay_step_packed_pallas, heads=(HK, K, HV, V), groups=groups)
    lowered, modules = lower_for_h200(step, qkv, gates, SDS((B, HV, K, V), jnp.float32), xc, vc,
                                      SDS((B,), jnp.int32))
    n, bad = dot_problems(modules)
    assert len(modules) == 5 and n > 20 and not bad, bad
    names = re.findall(r'name = "(gdn_\w+)"', lowered.as_text())
    assert sorted(names) == ["gdn_open_chunk_clear", "gdn_replay_intra", "gdn_replay_out", "gdn_replay_prep",
                             "gdn_replay_state"], names
    assert lowered.as_text().count("output_operand_aliases") == 4  # prep, out, state, the clearing
    assert sorted(re.findall(r"output_tuple_indices = \[(\d)\]", lowered.as_text())) == ["0", "0", "1", "1", "1", "2"]


def _module(modules, name):
    mod = [m for m in modules if any(name in str(op.attributes["sym_name"])
                                     for op in m.body.operations if "sym_name" in op.attributes)]
    assert len(mod) == 1, name
    return mod[0]


@pytest.mark.parametrize("HK,HV,per_program", [(16, 32, 2), (4, 16, 4), (2, 6, 1)])
def test_replay_step_runs_q_k_once_per_key_head(HK, HV, per_program):
    """Kernel 2 of the replay step runs the prefill's 64-row q k^T once per program for the value heads of one key
    head (G = HV / HK of them when G is a power of two, else one), and writes each head's row of Aqk and qg: one
    64-row dot — [64, 16] on the GPU, k q16^T (`replay_qk_cols`), [64, 64] with the interpret form forced — and 2 G
    stores of a row. Kernel 3 loads the rows of w and u it computes with a mask (the others
    are never written) and the new row's Aqk and qg as vectors, not 16-row tiles."""
    from jax._src.lib.mlir import ir

    from pallas_kernels.gated_delta.replay import chunk_replay_step_pallas

    B, K, V = 4, 128, 128
    chunk, xc, vc = replay_step_args(B, HK, HV, K, V)
    lowered, modules = lower_for_h200(chunk_replay_step_pallas, *chunk, xc, vc, SDS((B,), jnp.int32))
    intra = list(_walk(_module(modules, "gdn_replay_intra").operation))
    dots = [tuple(ir.RankedTensorType(op.result.type).shape) for op in intra if op.name == "tt.dot"]
    assert dots == [(64, 16)], dots
    _, rows_form = lower_for_h200(lambda *a: chunk_replay_step_pallas(*a, config={"replay_qk_cols": False}), *chunk, xc,
                                  vc, SDS((B,), jnp.int32))
    assert [tuple(ir.RankedTensorType(op.result.type).shape) for op in _walk(_module(rows_form, "gdn_replay_intra")
                                                                                .operation) if op.name == "tt.dot"] \
        == [(64, 64)]
    stores = [str(op.operands[1].type) for op in intra if op.name == "tt.store"]
    assert sorted(stores) == sorted(["tensor<64xf32>", "tensor<128xf32>"] * per_program), stores
    loads = {}  # result type -> [masked?] of the loads whose values are used (a store's own load of the old value,
    for op in _walk(_module(modules, "gdn_replay_out").operation):  # unused, is Pallas's swap: Triton drops it)
        if op.name == "tt.load" and list(op.result.uses):
            loads.setdefault(str(op.result.type), []).append(len(op.operands) > 1)
    assert loads["tensor<16x128xf32>"] == [True] and loads["tensor<16x64xf32>"] == [True], loads  # w; u's V block
    assert loads["tensor<64xf32>"] == [False] and loads["tensor<128xf32>"] == [False], loads  # Aqk's, qg's row


def test_replay_step_v_new_dot_reads_w_in_fp32():
    """The replay step's w (the prefill stores it in fp16) reaches kernel 3's 16-row v_new dot as fp32 holding the
    fp16 values: the prep kernel rounds through fp16, kernel 3 has no fp16 tensor. On an fp16 w that dot differed
    from the prefill's 64-row one in one element of 560 rows x 128 on the H200 (BENCHMARKS.md, runs 48-53)."""
    B, HK, HV, K, V = 4, 16, 32, 128, 128
    from pallas_kernels.gated_delta.replay import chunk_replay_step_pallas

    chunk, xc, vc = replay_step_args(B, HK, HV, K, V)
    _, modules = lower_for_h200(chunk_replay_step_pallas, *chunk, xc, vc, SDS((B,), jnp.int32))
    text = {str(m.operation.attributes["sym_name"]).strip('"'): m.operation.get_asm(enable_debug_info=False)
            for m in modules}
    assert "xf16>" in text["gdn_replay_prep"]  # the rounding, as the prefill's prep stores w
    assert "xf16>" not in text["gdn_replay_out"]


def test_chunk_output_kernel_loads_states_after_q_k():
    """The prefill's output kernel loads S_c and v_new (fp32 [BVO, K] / [BVO, C]) after the q k^T dot, each right
    before its own dot. Loaded before q k^T they stay live through it: 160 instead of 96 KiB of shared memory by
    ptxas, one program per SM, ~20% slower prefills on the H200 (BENCHMARKS.md, runs 39-45)."""
    f = lambda q, k, v, g, b, s0, n: chunk_gated_delta_rule_pallas(q, k, v, g, b, initial_state=s0, lengths=n)
    _, modules = lower_for_h200(f, *chunk_args(8, 256, 16, 32, 128, 128, jnp.bfloat16))
    out = [m for m in modules if any("gdn_chunk_out" in str(op.attributes["sym_name"])
                                     for op in m.body.operations if "sym_name" in op.attributes)]
    assert len(out) == 1
    seq = []  # ("dot", -) or ("load", fp32 matrix?) in program order
    for op in _walk(out[0].operation):
        if op.name in ("tt.load", "tt.dot"):
            t = str(op.result.type)  # e.g. tensor<128x128xf32>; a scalar load is plain i32
            seq.append((op.name, op.name == "tt.load" and re.fullmatch(r"tensor<\d+x\d+xf32>", t) is not None))
    dots = [i for i, (name, _) in enumerate(seq) if name == "tt.dot"]
    states = [i for i, (name, f32_matrix) in enumerate(seq) if f32_matrix]
    assert len(dots) == 3 and len(states) == 2, seq
    assert dots[0] < states[0] < dots[1] < states[1] < dots[2], seq


@pytest.mark.parametrize("bv,s0_dots", [(64, 1), (32, 1), (64, 2)])
def test_replay_step_out_kernel_takes_its_v_block(bv, s0_dots):
    """`bv_replay` sets the V block of the replay step's last two kernels: kernel 3's dots are [16, bv] (on the new
    token's block row: a row of an MMA does not depend on M or N on the H200) — w S0 and qg S0 as one dot and the
    output's A v_new (`replay_s0_dots` = 1, the default), or w S0, qg S0 and A v_new (2) — and kernel 4's one
    [128, bv] dot per program (the boundary state's V block, the prefill's shape with N = bv)."""
    from jax._src.lib.mlir import ir

    from pallas_kernels.gated_delta.replay import chunk_replay_step_pallas

    B, HK, HV, K, V = 4, 16, 32, 128, 128
    chunk, xc, vc = replay_step_args(B, HK, HV, K, V)
    config = {"bv_replay": bv, "replay_s0_dots": s0_dots}
    _, modules = lower_for_h200(lambda *a: chunk_replay_step_pallas(*a, config=config), *chunk, xc, vc,
                                SDS((B,), jnp.int32))

    def dots(name):
        return sorted(tuple(ir.RankedTensorType(op.result.type).shape) for op in _walk(_module(modules, name).operation)
                      if op.name == "tt.dot")

    assert dots("gdn_replay_out") == [(16, bv)] * (1 + s0_dots)
    assert dots("gdn_replay_state") == [(128, bv)]  # one program per (V block, value head, row)


@pytest.mark.parametrize("warps,want", [(None, [4, 4, 4, 4]), ((8, 4, 2), [8, 4, 2, 4]), (8, [8, 8, 8, 4])])
def test_replay_step_kernels_take_their_warps(warps, want):
    """The replay step's kernels launch with the prefill's warps by default (prep; 4 for the intra kernel,
    `warps_replay_intra`; output; recurrence) and with the benchmark-only `warps_replay` when given, in the order
    prep, intra, out; the boundary state's kernel always with the recurrence's (its dot is the recurrence's)."""
    from pallas_kernels.gated_delta.replay import chunk_replay_step_pallas

    B, HK, HV, K, V = 4, 16, 32, 128, 128
    chunk, xc, vc = replay_step_args(B, HK, HV, K, V)
    cfg = None if warps is None else {"warps_replay": warps}
    lowered, _ = lower_for_h200(lambda *a: chunk_replay_step_pallas(*a, config=cfg), *chunk, xc, vc,
                                SDS((B,), jnp.int32))
    text = lowered.as_text()
    names = re.findall(r'name = "(gdn_replay_\w+)"', text)
    assert names == ["gdn_replay_prep", "gdn_replay_intra", "gdn_replay_out", "gdn_replay_state"], names
    assert [int(w) for w in re.findall(r"num_warps = (\d+) : i32", text)] == want
