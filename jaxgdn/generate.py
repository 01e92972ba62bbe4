"""Batched generation with the whole decode loop compiled (`lax.scan`), optionally through a prefix cache.

Prompts of different lengths are padded into one prefill (per-row `lengths`), then every row decodes in
lock-step. Shapes are bucketed (prompt length and capacity to multiples of 64) so calls of similar sizes reuse
one compiled program. Sampling draws each request's randomness from its own seed and the token position
(`fold_in(key(seed), position)`), never from its batch slot.

With `cache=`, each prompt is looked up first and only the uncached suffix is prefilled; the prefill's grid
checkpoints (taken inside the one call) are inserted, and — when the cache is not deterministic — so are
decode checkpoints at the grid boundaries the decode crossed.
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

from .cache import Checkpoint, PrefixCache, checkpoints_from_prefill, state_from_checkpoints
from .errors import InputError
from .model import Model, decode_step, gdn_states, prefill_chunk
from .state import AttentionLayerState


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # generated ids (a stop token, when hit, is included)
    logprobs: list[float]  # log p(token) under the model's own distribution (temperature 1, no top-k/top-p)
    finish_reason: str  # "stop" or "length"
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (not recomputed)


class Generations(list):
    """The results, in prompt order (a list), plus `.cache`: the new prefix cache (None without one)."""

    cache: PrefixCache | None = None


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


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "top_k", "stride", "snap_interval"))
def _generate_core(model: Model, state, tokens, lengths, seeds, temperature, top_p, stop_ids, *,
                   max_new_tokens: int, top_k: int | None, stride: int | None, snap_interval: int | None):
    B = tokens.shape[0]
    out = prefill_chunk(model, state, tokens, lengths, checkpoint_stride=stride, last_only=True)
    state, last = out[0], out[1]  # last: [B, Vocab] logits of each prompt's last token
    prefill_ckpts = out[2] if stride else None
    prefill_provenance = state.provenance
    base_keys = jax.vmap(jax.random.key)(seeds)
    n_slots = max_new_tokens // snap_interval + 1 if snap_interval else 0
    snaps = tuple(jax.tree.map(lambda x: jnp.zeros((n_slots,) + x.shape, x.dtype), s) for s in gdn_states(state))

    def step(carry, _):
        state, logits, done, snaps, n_snap = carry
        keys = jax.vmap(jax.random.fold_in)(base_keys, state.position)
        tok = _sample(logits, keys, temperature, top_k, top_p)
        logprob = jnp.take_along_axis(log_softmax(logits), tok[:, None], axis=-1)[:, 0]
        stopped = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        emitted = ~done
        state, logits = decode_step(model, state, tok)
        if n_slots:  # keep the GDN states at each grid boundary the decode reaches (slot n_snap[b] of row b)
            at = state.position % snap_interval == 0  # [B]
            write = (jnp.arange(n_slots)[:, None] == n_snap[None, :]) & at[None, :]  # [S, B]
            snaps = jax.tree.map(
                lambda buf, new: jnp.where(write.reshape(write.shape + (1,) * (new.ndim - 1)), new[None], buf),
                snaps, gdn_states(state))
            n_snap = n_snap + at
        return (state, logits, done | stopped, snaps, n_snap), (tok, logprob, emitted, stopped & emitted)

    init = (state, last, jnp.zeros((B,), bool), snaps, jnp.zeros((B,), jnp.int32))
    (state, _, _, snaps, n_snap), (toks, lps, emitted, stop_hit) = jax.lax.scan(
        step, init, None, length=max_new_tokens)
    return dict(tokens=toks.T, logprobs=lps.T, emitted=emitted.T, stop_hit=stop_hit.T, state=state,
                prefill_provenance=prefill_provenance, prefill_checkpoints=prefill_ckpts, snaps=snaps, n_snap=n_snap)


def _check_request(model: Model, prompts, max_new_tokens, temperature, top_k, top_p, stop_token_ids):
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


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float = 1.0, seed: int | Sequence[int] = 0,
             stop_token_ids: Sequence[int] = (), cache: PrefixCache | None = None) -> Generations:
    """Generate from a batch of prompts (lists of token ids, any lengths). Greedy when temperature == 0.

    seed: one int for all requests or one per request. Returns a `Generations` list with one
    `GenerationResult` per prompt, in order, and `.cache`, the new prefix cache when `cache` was given.
    """
    _check_request(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_token_ids)
    B = len(prompts)
    seeds = [seed] * B if isinstance(seed, int) else list(seed)
    if len(seeds) != B:
        raise InputError(f"{len(seeds)} seeds for {B} prompts")
    prompts = [[int(t) for t in p] for p in prompts]

    hits: list[Checkpoint | None] = [None] * B
    if cache is not None:
        hits, cache = cache.lookup(prompts)
    starts = np.array([h.position if h else 0 for h in hits], np.int32)
    lens = np.array([len(p) for p in prompts], np.int32) - starts
    T = _bucket(int(lens.max()))
    tokens = np.zeros((B, T), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :lens[i]] = p[starts[i]:]
    capacity = _bucket(int((starts + lens).max()) + max_new_tokens)
    state = model.init_state(B, capacity)
    if cache is not None:
        state = state_from_checkpoints(state, hits)
    stops = np.array(list(stop_token_ids) or [-1], np.int32)
    # Decode checkpoints: always admissible in a non-deterministic cache; in a deterministic one only when replay
    # decode keeps the states prefill-produced.
    snapshots = cache is not None and (not cache.deterministic or model.decode_mode == "replay")
    snap_interval = cache.interval if snapshots else None
    out = _generate_core(
        model, state, jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(seeds, jnp.uint32),
        jnp.full((B,), temperature, jnp.float32), jnp.full((B,), top_p, jnp.float32), jnp.asarray(stops),
        max_new_tokens=max_new_tokens, top_k=top_k, stride=cache.interval if cache is not None else None,
        snap_interval=snap_interval)
    toks, lps, emitted, stop_hit = (np.asarray(out[k]) for k in ("tokens", "logprobs", "emitted", "stop_hit"))

    results = Generations()
    for b in range(B):
        n = int(emitted[b].sum())
        results.append(GenerationResult(tokens=toks[b, :n].tolist(), logprobs=lps[b, :n].tolist(),
                                        finish_reason="stop" if stop_hit[b].any() else "length",
                                        cached_tokens=int(starts[b])))
    if cache is not None:
        histories = [p + toks[b].tolist() for b, p in enumerate(prompts)]
        new = checkpoints_from_prefill(out["prefill_checkpoints"], out["prefill_provenance"], histories, out["state"],
                                       cache.interval)
        if snap_interval:
            new += _decode_checkpoints(out, prompts, histories, [len(r.tokens) for r in results], snap_interval)
        results.cache = cache.insert(new, skip_refused=True)
    return results


def _decode_checkpoints(out, prompts, histories, n_emitted, interval) -> list[Checkpoint]:
    """Checkpoints at the grid boundaries reached by decode, within emitted tokens (provenance: the final state's,
    DECODE after recurrent decode, PREFILL after replay decode)."""
    state = out["state"]
    provenance = np.asarray(state.provenance)
    attn = [s for s in state.layers if isinstance(s, AttentionLayerState)]
    n_snap = np.asarray(out["n_snap"])
    found = []
    for b, prompt in enumerate(prompts):
        first = (len(prompt) // interval + 1) * interval
        for i in range(int(n_snap[b])):
            p = first + i * interval
            if p - len(prompt) > n_emitted[b]:
                break
            gdn = tuple(jax.tree.map(lambda x: x[i, b], s) for s in out["snaps"])
            kv = tuple(AttentionLayerState(keys=s.keys[b, :p], values=s.values[b, :p]) for s in attn)
            found.append(Checkpoint(tokens=tuple(histories[b][:p]), provenance=int(provenance[b]), gdn=gdn, kv=kv))
    return found
