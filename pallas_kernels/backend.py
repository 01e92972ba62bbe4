"""The one place that chooses a kernel backend.

  "reference"  pure JAX (`pallas_kernels.gated_delta.reference`): any device, the oracle and the fallback
  "pallas"     Pallas kernels compiled for the GPU (Triton backend)
  "interpret"  the same Pallas kernels run by the Pallas interpreter (CPU tests)

`None` means the default for the current device: "pallas" on a GPU, "reference" elsewhere.
"""

from __future__ import annotations

import jax

BACKENDS = ("reference", "pallas", "interpret")


def resolve_backend(backend: str | None) -> str:
    if backend is None:
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS} or None")
    return backend
