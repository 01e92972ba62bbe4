"""The test suite's opt-in persistent compilation cache (JAXGDN_TEST_XLA_CACHE=DIR), for the pytest processes
(`conftest.py`) and the sharding test's 8-device worker (`test_sharding.py`).

Most of the suite's time is XLA compilation, and many programs recur across modules and xdist workers (same tiny
configs, same shapes). JAX's persistent cache can share them, but it is off by default because reading an executable
back crashed an xdist worker in 2 of 4 full runs from fresh clones sharing one warm cache on 2026-11-30 (SIGSEGV, and
SIGABRT with other test processes beside it, inside `get_executable_and_time` while deserialising an XLA:CPU
executable of test_replay's interpret-mode programs; both tests passed on rerun). Without it the suite took ~10.5
min on 2 cores then (fewer tests) against ~3 with a warm cache. Keys hash the program, so a changed model never
reuses a stale executable. A cold cache (an empty directory, as a fresh CI machine would have) gave no gain on
2026-12-03: after 28 min such a run had reached about 73% of the tests, where e356f02 without the cache (5 tests
fewer) had finished all 612 in 32 min that morning (stopped there, so no full time; which programs recur across
workers was not counted).
"""

from __future__ import annotations

import os

import jax


def use_persistent_cache_if_asked() -> None:
    """Turn JAX's persistent compilation cache on in JAXGDN_TEST_XLA_CACHE, when that is set."""
    path = os.environ.get("JAXGDN_TEST_XLA_CACHE", "")
    if not path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)
    # A size limit turns on the cache's file lock (JAX locks only when it may evict), so an xdist worker never reads
    # an entry another worker is still writing.
    jax.config.update("jax_compilation_cache_max_size", 4 << 30)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
