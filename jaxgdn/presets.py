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
    for its shapes only). seed: an integer in [0, 2**32), each giving its own weights."""
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    check_model_options(dtype, backend)
    try:
        value = index_value(seed)
    except TypeError:
        value = None
    if value is None or not 0 <= value < 2**32:  # a JAX key (x64 off) keeps a seed's low 32 bits: 2**32 would be 0
        raise InputError(f"seed must be an integer in [0, 2**32) (the CLI's --model-seed range); got {seed!r}")
    key = jax.random.key(value)
    config = PRESETS[name]()
    return Model(params=random_params(config, key, dtype), config=config, dtype=dtype,
                 backend=backend, deterministic=deterministic)
