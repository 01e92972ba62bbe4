"""Shared fixtures for the CPU test suite.

Loaded models are session-scoped and every model test uses the same few shapes (batch 2, KV capacity `CAP`),
so each state function is compiled once per shape for the whole session: the tiny presets and the fixture
checkpoints have equal (hashable) configs and therefore share compiled programs.

Crashed workers: `pyproject.toml` runs a test again when its xdist worker process dies (pytest-rerunfailures' crash
recovery, `--reruns 2`: up to twice more, since 2026-12-01; once before) and never reruns an ordinary failure
(`--only-rerun` with a pattern that matches no error).

The cause, found on 2026-12-01 (the history below led there): **each worker ran into the kernel's limit on memory
mappings** (vm.max_map_count, 65530 by default). Every program XLA:CPU compiles keeps a few mappings of JIT code and
data for as long as JAX caches it (~3 for a small program); a worker that compiles for a whole run held 20-30k
mappings after 6 minutes and 58-65k after 15 (sampled from /proc/PID/maps during a full run). At the limit XLA:CPU's
JIT cannot map a new program: a process pushed there on purpose (pages of one anonymous mapping given alternating
protections, then compiles) logged "LLVM compilation error: Cannot allocate memory" and died of SIGSEGV — the
"Failed to materialize symbols" and unwinder crash of the core dump below. `_bounded_memory_maps` clears JAX's caches
whenever a worker holds more than half the limit. `--xla_cpu_parallel_codegen_split_count=1` (the idea below) did
not help: a full run with it crashed twice, and a second one once in its first 16 minutes.

Seen on 2026-11-30 in three of five full runs from fresh clones (6c47954: SIGABRT; 83d781a and 8396626: SIGSEGV, the
rerun passing): the worker died inside XLA:CPU's compile of `score` in
`test_score_agrees_with_generation`, right after its `generate`, with no message and no persistent cache. The test
passes alone and passed in the other two full runs (one of them verbose, to see the order the worker ran: nothing
stood out). Again in c6926f4's run (SIGSEGV, rerun passing), in another test and another program: XLA:CPU's compile
of `prefill_chunk` in test_replay.py's `test_recurrent_gdn_prefill_splits_anywhere_bitwise` — so not one test's
program. And in 765ea00's (SIGSEGV, rerun passing): test_replay.py's `test_multi_turn_reuses_answer_prefixes_bitwise`;
and in 71569a4's (SIGABRT, "Fatal Python error: Aborted" inside XLA:CPU's compile, rerun passing): again
`test_recurrent_gdn_prefill_splits_anywhere_bitwise`. On 2026-12-01, twice with the README's command in the working
tree (76b0d23: SIGSEGV, `test_multi_turn_reuses_answer_prefixes_bitwise`; 1b27e6e: SIGSEGV inside XLA:CPU's compile
of `generate` in `test_generation_logprobs_equal_teacher_forced_scoring`), the reruns passing.

What happens, from a core dump of the crashed worker (2026-12-01, the README's command at 334a842; gdb on the core):
XLA:CPU's compile of `generate`'s program in test_replay.py's `test_multi_turn_reuses_answer_prefixes_bitwise`
returned "INTERNAL: Failed to materialize symbols: { (<xla_jit_dylib_16>, { slice_bitcast_fusion }) }" (its JIT
failed to link one kernel); jaxlib turned that into a C++ exception (`xla::ValueOrThrow` -> `XlaRuntimeError`), and
throwing it crashed libgcc's unwinder on the main thread: it read an FDE of a registered EH frame at a page-aligned
address no longer mapped (JIT code memory freed while its unwind info stayed registered). Both are XLA:CPU's; the
first is the cause, and without the second the test would fail with that error instead. Stack exhaustion, a guess
before, is ruled out: that run had the soft stack limit raised to 64 MiB for the workers and their threads. An
untested idea: `--xla_cpu_parallel_codegen_split_count=1` (one JIT dylib per program; test_replay.py and
test_generate.py took 3 min 8 s with it against 2 min 53 s without, and passed) — seeing whether it stops the
crashes needs several full runs. The fresh-clone run of d75f0a1 had two crashes (SIGSEGV in test_replay.py's
`test_one_token_calls_leave_rows_without_a_token_untouched`, SIGABRT in
`test_recurrent_gdn_prefill_splits_anywhere_bitwise`), each rerun passing; so a crashed test now runs up to twice
more (a test that crashes three times fails).

Where the suite's time goes (measured 2026-12-03 on 0d76635's tests, a full run with every compile logged through
`jax_log_compiles`: 42 min on two cores, 4,728 CPU-seconds): **XLA:CPU compiling, 3,333 s of it (70%)**, in 2,869
compiles (the sharding test's 8-device worker not counted). By program: the chunked kernel's own jit (`_chunk_impl`,
the kernel tests) 753 s, `prefill_chunk` 615 s, `_prefill_core` 427 s, `_generate_core` 382 s, the replay step
168 s. By module: test_replay 611 s, test_chunk_kernel 585 s, test_replay_kernel 517 s, test_deterministic_kernels
402 s, test_cache 208 s. The Pallas kernels in interpret mode are what is large: one chunked-prefill call at the
tests' tiny shapes (B = 2, T = 128, K = V = 32) compiles to 390 fusions in 4.7 s (its 16-row tiles are unrolled in
the kernel body, so the program's size comes from the kernel, not from the shapes); a model prefill over them takes
4-8 s to compile, and the bitwise tests need each at several shapes, modes and configurations. Not a way out:
`--xla_backend_optimization_level=0` took one replay test from 103 to 77 s, but the replay-decoded state then
differed from the prefill's in its last bits (at another optimisation level XLA:CPU rounds some operation of one of
the two programs differently; which one was not looked for), so the CPU bitwise tests hold for XLA:CPU's default
code generation — which is what a user's CPU runs.

Measured again on 2026-12-05 (e87f399's 1237 tests, the README's command with `--durations=0` and every compile
logged, 22 min 28 s on two cores, 2,576 s of test time): XLA compiles 1,573 s, tracing 115 s and lowering 227 s (74%
between them); test_replay 341 s, test_chunk_kernel 273, test_replay_kernel 262, test_sharding's 8-device worker
227, test_cache 202, test_deterministic_kernels 197, test_gpu_scripts' script runs 157. What did not help:
- a persistent cache per worker: in the six heaviest modules (657 s of compiles) only 24 s were programs a worker
  had compiled before (the same MLIR module hashed), so nearly every compile is a program the suite needs once;
- XLA:CPU flags (each timed once; whether they keep the default code generation's arithmetic was not checked):
  eight of test_replay_kernel's replay-step tests on two workers took 86 s with `--xla_llvm_disable_expensive_passes`
  as without it and 78 s with `--xla_cpu_parallel_codegen_split_count=1` (a full run with it on 2026-12-01 was
  slower); one chunked-kernel call's first call (2.36 s) took 2.29 s with `--xla_cpu_use_thunk_runtime=false`
  (within the noise); `--xla_cpu_use_fusion_emitters` is not a flag of this XLA;
- `PJRT_NPROC` 3 or 8 instead of 4 (the default then; 5 since 2026-12-06), glibc malloc tunables, and Python's
  cycle collector run less often (~3%, within the noise) — none kept.
Kept, though its gain on the whole suite is within the runs' spread: one OpenBLAS thread (`tests/xla_threads.py`:
`single_threaded_blas`).
So the suite's time is its compiles; fewer layers would not shorten it (the tiny preset's kernel-backed prefill
compiled in 4.44 s with one GDN layer against 4.81 s with three), fewer programs would (fewer model variants,
configurations or shapes per bitwise check). Later fresh-clone runs came in at 15 min 0 s and 14 min 55 s (1b90280,
697be00) against 19 min 16 s (61e7d49) with about the same CPU time (user 28:44, 28:30 against 30:02): how long a run
takes is also the machine's. Retiring the chunk kernel's legacy designs (`fused`, `split2`, `block16`) would save
~40 s of test_chunk_kernel's 125 s of test time (2026-12-05): not worth the coverage.
"""

from __future__ import annotations

import gc
from pathlib import Path

from tests.xla_threads import ensure_xla_cpu_threads, single_threaded_blas

# before JAX starts: Mosaic GPU's interpret mode needs >= 3 pool threads (tests/xla_threads.py)
ensure_xla_cpu_threads()
single_threaded_blas()  # before JAX loads scipy's OpenBLAS: its idle threads spin on the cores compiles need

import jax  # noqa: E402
import numpy as np
import pytest

import jaxgdn
from tests.xla_cache import use_persistent_cache_if_asked

use_persistent_cache_if_asked()  # opt-in: JAXGDN_TEST_XLA_CACHE=DIR (tests/xla_cache.py says why)

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_NAMES = ("qwen3_5_tiny", "qwen3_next_tiny")
PRESET_NAMES = ("tiny", "tiny-next")
CAP = 256  # KV capacity of every batch-2 state in the model tests (one compiled program per token shape)


# ---- helpers (imported by the test modules) ---------------------------------------------------------------------

def tree_equal_leaves(a, b) -> list[bool]:
    """Per-leaf bitwise equality of two pytrees of the same structure."""
    return [bool(np.array_equal(np.asarray(x), np.asarray(y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]


def tree_max_abs_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def max_abs_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def random_tokens(rng: np.random.Generator, shape, vocab: int = 256) -> np.ndarray:
    return rng.integers(0, vocab, shape).astype(np.int32)


# ---- fixtures ---------------------------------------------------------------------------------------------------

# This suite's modules run under JAX's strict dtype promotion (as equinox's tests do): an implicit bf16 <-> fp32
# or int <-> float promotion anywhere in the code they exercise raises instead of silently changing precision.
STRICT_MODULES = ("test_reference_gdn", "test_layers", "test_model", "test_checkpoint", "test_generate",
                  "test_full_size_shapes")


@pytest.fixture(autouse=True, scope="module")
def _strict_dtype_promotion(request):
    if request.module.__name__.rsplit(".", 1)[-1] in STRICT_MODULES:
        with jax.numpy_dtype_promotion("strict"):
            yield
    else:
        yield


def _memory_maps_in_use() -> int | None:
    """Memory mappings this process holds (Linux: lines of /proc/self/maps), or None where that cannot be read."""
    try:
        with open("/proc/self/maps", "rb") as fh:
            return sum(1 for _ in fh)
    except OSError:
        return None


def _memory_map_limit() -> int | None:
    """The kernel's per-process limit on memory mappings (vm.max_map_count), or None where it cannot be read."""
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return None


MAP_LIMIT = _memory_map_limit()
MAPS_HIGH = 0.5  # clear JAX's compiled programs when a worker holds more than this share of MAP_LIMIT


@pytest.fixture(autouse=True)
def _bounded_memory_maps():
    """Keeps each test process well under the kernel's limit on memory mappings, the cause of the worker crashes in
    the module docstring: every program XLA:CPU compiles keeps a few mappings of JIT code and data while JAX caches
    it, and a worker that compiles for a whole run reaches vm.max_map_count (65530 by default), where XLA:CPU's JIT
    can no longer map a new program ("Failed to materialize symbols"). When a worker holds more than half the limit,
    JAX's caches are cleared before its next test (the programs still in use compile again when next called; XLA
    compiles the same program to the same code, so results are unchanged)."""
    if MAP_LIMIT is not None:
        used = _memory_maps_in_use()
        if used is not None and used > MAPS_HIGH * MAP_LIMIT:
            jax.clear_caches()
            gc.collect()
    yield


@pytest.fixture(scope="session")
def fixture_models():
    """The two tiny Hugging Face checkpoints, loaded in fp32: name -> Model."""
    return {name: jaxgdn.load_pretrained(FIXTURES / name) for name in FIXTURE_NAMES}


@pytest.fixture(scope="module")
def tensors() -> dict:
    """The qwen3_5_tiny fixture's tensors (name -> NumPy array), for tests that write damaged or altered copies."""
    from safetensors.numpy import load_file

    return load_file(str(FIXTURES / "qwen3_5_tiny" / "model.safetensors"))


@pytest.fixture(scope="module")
def hf_config() -> dict:
    """The qwen3_5_tiny fixture's config.json, parsed."""
    import json

    return json.loads((FIXTURES / "qwen3_5_tiny" / "config.json").read_text())


@pytest.fixture(scope="session")
def expected():
    """transformers' recorded logits: name -> dict of arrays (full_tokens, full_logits, prefill_*, decode_*)."""
    out = {}
    for name in FIXTURE_NAMES:
        with np.load(FIXTURES / name / "expected.npz") as z:
            out[name] = {k: z[k] for k in z.files}
    return out


@pytest.fixture(scope="session")
def tiny():
    """The embedded random tiny dense Qwen3.5 model, fp32 (default, non-deterministic mode)."""
    return jaxgdn.tiny_model("tiny")


@pytest.fixture(scope="session")
def preset_models(tiny):
    """The embedded random tiny models ("tiny": dense Qwen3.5, "tiny-next": MoE Qwen3-Next), fp32."""
    return {"tiny": tiny, "tiny-next": jaxgdn.tiny_model("tiny-next")}


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's name (reproducible, different for every test)."""
    seed = int.from_bytes(request.node.nodeid.encode(), "little") % (2**63)
    return np.random.default_rng(seed)
