"""Embedded models built from a fixed seed: no files needed (tests, demo)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .config import PRESETS
from .errors import InputError, index_value
from .init import random_params
from .model import Model, check_model_options


def tiny_model(name: str = "tiny", seed: int = 0, dtype=jnp.float32, backend: str | None = None,
               deterministic: bool = False) -> Model:
    """A random model of a preset config: "tiny", "tiny-next" (small, for tests and demos) or "qwen3.5-9b" (the full
    9B shape: ~18 GB of random weights in bf16, ~36 GB in fp32 — on a small machine build it under `jax.eval_shape`
    for its shapes only)."""
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    check_model_options(dtype, backend)
    try:
        key = jax.random.key(index_value(seed))
    except (TypeError, OverflowError, ValueError):
        raise InputError(f"seed must be an integer a JAX key takes (64 bits); got {seed!r}") from None
    config = PRESETS[name]()
    return Model(params=random_params(config, key, dtype), config=config, dtype=dtype,
                 backend=backend, deterministic=deterministic)
