"""Compiled programs kept across processes: JAX's persistent compilation cache, with the Mosaic GPU kernels lowered
so that a process finds them whatever it compiled before.

    with jaxgdn.compile_cache("/path/to/xla-cache"):   # the CLI's --compile-cache DIR
        state, logits = model.prefill_chunk(state, tokens)   # compiled once, read back by the next process

Why the second part: jax 0.11.2 names every Mosaic GPU kernel it lowers with a count kept per process (the module's
`mosaic_gpu.dump_basename` attribute, "<name>_<count>", set on first use by `mosaic_gpu.get_or_set_dump_options`),
and the name is part of the kernel's bytes, of its hash and so of the program. On a Hopper GPU the prefill's
recurrence is such a kernel, so a process found a cached prefill only if it had lowered as many Mosaic GPU kernels
before it: the same calls in the same order (run 190, an H100: `generate` then `prefill_chunk` after a process that
ran them the other way round waited 9.2 s for each, against 2.0-2.5 s when the order matched, run 165).
`stable_kernel_names` names each kernel after its module alone while it is active — the attribute set before jax
asks for it, which `get_or_set_dump_options` then keeps — so the same kernel lowers to the same bytes every time.
jax's Python side reads the name only to name the files its Mosaic GPU dump options write (kernels of one name then
share a file name). On an H100 (run 191) the prefill's arrays were equal in every element with and without it
(`scripts/gpu_compile_times.py --names-check`), and a process calling in the other order found the cached programs
(1.25 s for the prefill, 2.4 s for `generate`).
"""

from __future__ import annotations

import contextlib
import os

from .errors import InputError

_CACHE_SETTINGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes")
_DUMP_NAME = "mosaic_gpu.dump_basename"


@contextlib.contextmanager
def stable_kernel_names():
    """Mosaic GPU kernels lowered inside this context carry their module's name alone, without jax's per-process
    count (module docstring), so a kernel lowers to the same program in any process, after anything. Process-wide
    while active (it swaps one jax function, in every thread); on exit jax's lowering is as it was. Nothing changes
    where jax has no Mosaic GPU lowering of that form (other versions)."""
    try:
        from jax._src.lib.mlir import ir
        from jax.experimental.mosaic.gpu import core as mgpu_core
    except ImportError:  # no Mosaic GPU in this jax
        yield
        return
    lower_as_gpu_kernel = getattr(mgpu_core, "_lower_as_gpu_kernel", None)
    if lower_as_gpu_kernel is None:
        yield
        return

    def named_by_module(*args, **kwargs):
        module, *rest = lower_as_gpu_kernel(*args, **kwargs)  # (module, out shapes, unwrap, launch context)
        attrs = module.operation.attributes
        if _DUMP_NAME not in attrs and "sym_name" in attrs:
            attrs[_DUMP_NAME] = ir.StringAttr.get(ir.StringAttr(attrs["sym_name"]).value, context=module.context)
        return (module, *rest)

    mgpu_core._lower_as_gpu_kernel = named_by_module
    try:
        yield
    finally:
        mgpu_core._lower_as_gpu_kernel = lower_as_gpu_kernel


@contextlib.contextmanager
def compile_cache(path: str | os.PathLike | None, *, label: str = "compile cache"):
    """JAX's persistent compilation cache in `path` (every program kept, however quick its compile) for the
    context's duration, with `stable_kernel_names`; then JAX's settings as they were and its cache handle dropped,
    so a caller in the same process is left as it was. None: nothing changes (a cache JAX_COMPILATION_CACHE_DIR
    names stays in use). The directory is made if missing; InputError (`label` first: the CLI passes its flag's
    name) where it cannot be made or written. The CLI's `--compile-cache` of every command;
    `scripts/gpu_compile_times.py` uses it too."""
    if path is None:
        yield
        return
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = os.fspath(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise InputError(f"{label} {path}: cannot make the directory ({e.strerror or e})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{label} {path}: the directory is not writable")
    before = {name: getattr(jax.config, name) for name in _CACHE_SETTINGS}
    compilation_cache.reset_cache()  # JAX opens its cache once per process: make it open this one
    try:
        for name, value in zip(_CACHE_SETTINGS, (os.path.abspath(path), 0.0, -1)):  # -1: no size floor
            jax.config.update(name, value)
        with stable_kernel_names():
            yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
