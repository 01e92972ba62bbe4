"""XLA:CPU's thread pool in the test processes: at least `MIN_XLA_CPU_THREADS` threads (`PJRT_NPROC`), set by
`conftest.py` before JAX starts its CPU backend.

Why: Mosaic GPU's interpret mode runs a warp-specialised kernel's warpgroups (`recurrence_mgpu`'s
`warp_specialised=True` / "u": two) as Python threads, each executing its own XLA program, and every barrier wait,
copy and memory operation of the kernel is a host callback that XLA:CPU runs on its pool. The callback that runs
the warpgroups holds one pool thread while it waits for them, a warpgroup blocked in a barrier wait holds another,
and the warpgroup it waits for needs a third to make progress. XLA:CPU sizes the pool by the machine's cores
(`PJRT_NPROC`, else `NPROC`, else the CPUs this process may run on), so on a 2-core machine such as CI's the kernel
could deadlock: every thread idle, nothing failing. Found on 2026-12-05 on branch `experiment/segments` (whose
program puts that callback on the pool): a full run of its suite stopped in test_mgpu_recurrence.py's
`test_prefill_with_the_mosaic_recurrence`, the faulthandler dump showing exactly the three threads above; 30
prefills with the Mosaic GPU recurrence (interpret mode) in one process hung at the fifth with the default pool of
2 threads and all passed with `PJRT_NPROC` = 3 and with 4 (main's code passed 30 with 2).
The pool's size does not change the tests' claims: each bitwise test compares two programs run in one process.
"""

from __future__ import annotations

import os

MIN_XLA_CPU_THREADS = 4  # 3 is the least the deadlock above needs; one to spare


def ensure_xla_cpu_threads() -> None:
    """Give XLA:CPU's pool at least MIN_XLA_CPU_THREADS threads (or the CPUs this process may use, if more), unless
    PJRT_NPROC is set already. Only effective before JAX creates its CPU backend (the first array or compile)."""
    if "PJRT_NPROC" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["PJRT_NPROC"] = str(max(MIN_XLA_CPU_THREADS, cpus))


def xla_cpu_pool_threads() -> int | None:
    """The threads of XLA:CPU's intra-op pool in this process (Linux: threads named tf_XLAEigen), or None where that
    cannot be read."""
    try:
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    return sum(name == "tf_XLAEigen" for name in names)
