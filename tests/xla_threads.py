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

MIN_XLA_CPU_THREADS = 5  # the least the deadlock above needs, plus one: 3 for two warpgroups, 4 for three
# (`recurrence_mgpu`'s three-warpgroup `intra_warpgroup` form: two warpgroups can be blocked while the third runs)


def ensure_xla_cpu_threads() -> None:
    """Give XLA:CPU's pool at least MIN_XLA_CPU_THREADS threads (or the CPUs this process may use, if more), unless
    PJRT_NPROC is set already. Only effective before JAX creates its CPU backend (the first array or compile)."""
    if "PJRT_NPROC" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["PJRT_NPROC"] = str(max(MIN_XLA_CPU_THREADS, cpus))


def single_threaded_blas() -> None:
    """One OpenBLAS thread (OPENBLAS_NUM_THREADS=1) in the test processes and the scripts they start, unless set
    already. Only effective before the library loads: scipy's OpenBLAS, which JAX's CPU linear algebra calls (the
    reference GDN prefill's `solve_triangular`), loads with JAX; numpy's own is loaded before `conftest.py` runs.

    Why: after each call OpenBLAS's worker threads spin, waiting for the next one. With two xdist workers on CI's
    two cores that spinning took the cores the other worker's XLA compiles needed: 12% of a `generate` call's CPU
    time was `blas_thread_server` (perf, 2026-12-05), and two test modules on two workers took 75 s with one thread
    against 86 s without (one run each; 79 s in a later run with it). On the whole suite no gain stands out of the
    runs' spread: three fresh-clone CI runs with it took 20 min 51 s, 20 min 22 s and 22 min 10 s (user 37:55,
    37:56, 41:17) against 21 min 5 s (user 39:22) for the commit before, the same afternoon. The claims do not
    depend on it: every bitwise test compares two programs run in one process, and `solve_triangular` on the
    reference's shapes ([64, 4, 64, 64] unit lower triangular systems, and a [8, 64, 300] right-hand side) gave the
    same bits with 1, 2 and 4 OpenBLAS threads (2026-12-05)."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def xla_cpu_pool_threads() -> int | None:
    """The threads of XLA:CPU's intra-op pool in this process (Linux: threads named tf_XLAEigen), or None where that
    cannot be read."""
    try:
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    except OSError:
        return None
    return sum(name == "tf_XLAEigen" for name in names)
