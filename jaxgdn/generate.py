"""Batched generation with the whole decode loop compiled (`lax.scan`).

Prompts of different lengths are padded into one prefill (per-row `lengths`), then every row decodes in
lock-step. Shapes are bucketed (prompt length and capacity to multiples of 64) so calls of similar sizes reuse
one compiled program. Sampling draws each request's randomness from its own seed and the token position
(`fold_in(key(seed), position)`), never from its batch slot.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import CHUNK
from pallas_kernels.invariant import log_softmax, prefix_sum, softmax

from .errors import InputError
from .model import Model, decode_step, prefill_chunk


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # generated ids (a stop token, when hit, is included)
    logprobs: list[float]  # log p(token) under the model's own distribution (temperature 1, no top-k/top-p)
    finish_reason: str  # "stop" or "length"


def _bucket(n: int, step: int = CHUNK) -> int:
    return max(step, -(-n // step) * step)


def _sample(logits, keys, temperature, top_k: int | None, top_p):
    """logits fp32 [B, Vocab]; keys [B]; temperature, top_p [B]. Greedy where temperature == 0."""
    greedy = jnp.argmax(logits, axis=-1)
    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    if top_k is not None:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    # top-p: keep the smallest set of tokens whose probability mass reaches top_p (the top token always kept).
    srt = jnp.sort(scaled, axis=-1)[:, ::-1]
    cum = prefix_sum(softmax(srt))
    cutoff_idx = jnp.sum(cum < top_p[:, None], axis=-1, keepdims=True)
    cutoff = jnp.take_along_axis(srt, jnp.minimum(cutoff_idx, srt.shape[-1] - 1), axis=-1)
    scaled = jnp.where(scaled < cutoff, -jnp.inf, scaled)
    sampled = jax.vmap(jax.random.categorical)(keys, scaled)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("capacity", "max_new_tokens", "top_k"))
def _generate_core(model: Model, tokens, lengths, seeds, temperature, top_p, stop_ids, *, capacity: int,
                   max_new_tokens: int, top_k: int | None):
    B = tokens.shape[0]
    state = model.init_state(B, capacity)
    state, logits = prefill_chunk(model, state, tokens, lengths)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, Vocab]
    base_keys = jax.vmap(jax.random.key)(seeds)

    def step(carry, _):
        state, logits, done = carry
        keys = jax.vmap(jax.random.fold_in)(base_keys, state.position)
        tok = _sample(logits, keys, temperature, top_k, top_p)
        logprob = jnp.take_along_axis(log_softmax(logits), tok[:, None], axis=-1)[:, 0]
        stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        emitted = ~done
        state, logits = decode_step(model, state, tok)
        return (state, logits, done | stopped), (tok, logprob, emitted, stopped & emitted)

    (_, _, _), (toks, lps, emitted, stop_hit) = jax.lax.scan(
        step, (state, last, jnp.zeros((B,), bool)), None, length=max_new_tokens)
    return toks.T, lps.T, emitted.T, stop_hit.T


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float = 1.0, seed: int | Sequence[int] = 0,
             stop_token_ids: Sequence[int] = ()) -> list[GenerationResult]:
    """Generate from a batch of prompts (lists of token ids, any lengths). Greedy when temperature == 0.

    seed: one int for all requests or one per request. Returns one `GenerationResult` per prompt, in order.
    """
    V = model.config.vocab_size
    if not prompts:
        raise InputError("no prompts given")
    if max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or (top_k is not None and not 1 <= top_k <= V):
        raise InputError(f"invalid sampling parameters: temperature={temperature}, top_k={top_k}, top_p={top_p}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise InputError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= V:
            raise InputError(f"prompt {i} holds token ids outside [0, {V})")
    if any(not 0 <= s < V for s in stop_token_ids):
        raise InputError(f"stop_token_ids must lie in [0, {V})")
    B = len(prompts)
    seeds = [seed] * B if isinstance(seed, int) else list(seed)
    if len(seeds) != B:
        raise InputError(f"{len(seeds)} seeds for {B} prompts")
    lens = np.array([len(p) for p in prompts], np.int32)
    T = _bucket(int(lens.max()))
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    capacity = _bucket(T + max_new_tokens)
    stops = np.array(list(stop_token_ids) or [-1], np.int32)
    toks, lps, emitted, stop_hit = jax.device_get(_generate_core(
        model, jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(seeds, jnp.uint32),
        jnp.full((B,), temperature, jnp.float32), jnp.full((B,), top_p, jnp.float32), jnp.asarray(stops),
        capacity=capacity, max_new_tokens=max_new_tokens, top_k=top_k))
    results = []
    for b in range(B):
        n = int(emitted[b].sum())
        results.append(GenerationResult(tokens=toks[b, :n].tolist(), logprobs=lps[b, :n].tolist(),
                                        finish_reason="stop" if stop_hit[b].any() else "length"))
    return results
