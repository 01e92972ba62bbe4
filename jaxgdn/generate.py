"""Batched generation with the whole decode loop compiled (`lax.scan`), optionally through a prefix cache.

Prompts of different lengths are padded into one prefill (per-row `lengths`; a prompt several requests share is
prefilled once and its row copied), then every row decodes in lock-step. Shapes are bucketed (prompt length and
capacity to multiples of 64) so calls of similar sizes reuse one compiled program. Sampling draws each request's
randomness from its own seed and the token position (`fold_in(key(seed), position)`), never from its batch slot.

With `cache=`, each prompt is looked up first and only the uncached suffix is prefilled; the prefill's grid
checkpoints (taken inside the one call) are inserted, and — when the cache is not deterministic, or the model
decodes in replay mode (its decoded states are prefill-produced) — so are decode checkpoints at the grid boundaries
the decode crossed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import CHUNK
from pallas_kernels.invariant import log_softmax, prefix_sum, softmax

from .cache import (Checkpoint, PrefixCache, checkpoints_from_prefill, numerics_key, prefix_blocks,
                    state_from_checkpoints)
from .errors import (CapacityError, InputError, is_flat_ids, is_int, plain_int, refuse_unordered, safe_ndim,
                     token_array, token_id)
from .model import Model, check_model, decode_step, gdn_states, jit, mesh_context, placed_like, prefill_chunk
from .shapes import next_pow2
from .state import MAX_CAPACITY, at_boundary

MAX_ROW_TOKENS = MAX_CAPACITY  # prompt + max_new_tokens per row: positions are int32 (CapacityError beyond)
# The largest temperature. Sampling divides fp32 logits by it; past ~1 / float32's smallest normal (8.5e37) XLA's
# reciprocal of it flushes to zero, and well before that logits / temperature leave the normal range, so that
# top_k / top_p would see ties where the logits differ (top_k=1 would sample uniformly). At 1e30 logits of
# magnitude ~1.2e-8 and up stay normal, and 1e30 is far above any temperature that means something.
MAX_TEMPERATURE = 1e30


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    tokens: list[int]  # generated ids (a stop token, when hit, is included)
    logprobs: list[float]  # log p(token) under the model's own distribution (temperature 1, no top-k/top-p)
    finish_reason: str  # "stop" or "length"
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (not recomputed)
    # with return_top_logprobs=k: per generated token, the k most likely (token id, logprob), most likely first
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclasses.dataclass(frozen=True)
class GenerationTimings:
    """Where a generate call's time went (seconds, device work awaited; compilation included when it compiled)."""

    prefill_s: float  # the prompt prefill
    decode_s: float  # the compiled decode loop


class Generations(list):
    """The results, in prompt order (a list), plus `.cache`: the new prefix cache (None without one), and
    `.timings`: the call's prefill and decode time."""

    cache: PrefixCache | None = None
    timings: GenerationTimings | None = None


def greedy_decode(model: Model, state, token: jax.Array, steps: int):
    """`steps` greedy decode steps in one `lax.scan` (pure; jit it with `steps` static — benchmarks use it to time
    decode inside a compiled loop). token int32 [B]. Returns (state, the last chosen tokens [B])."""
    def body(carry, _):
        s, t = carry
        s, logits = decode_step(model, s, t)
        return (s, jnp.argmax(logits, -1).astype(jnp.int32)), None

    return jax.lax.scan(body, (state, token), None, length=steps)[0]


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


@functools.partial(jit, static_argnames=("stride",))
def _prefill_core(model: Model, state, tokens, lengths, *, stride: int | None):
    """The prompt prefill: (state, last-token logits [B, Vocab], in-call checkpoints or None)."""
    out = prefill_chunk(model, state, tokens, lengths, checkpoint_stride=stride, last_only=True)
    return out[0], out[1], (out[2] if stride else None)


@functools.partial(jit, static_argnames=("max_new_tokens", "top_k", "snap_interval", "n_top"))
def _generate_core(model: Model, state, last, seeds, temperature, top_p, stop_ids, *, max_new_tokens: int,
                   top_k: int | None, snap_interval: int | None, n_top: int = 0):
    """The whole decode loop, compiled (`lax.scan`), from the prefilled state and its last logits [B, Vocab]."""
    B = last.shape[0]
    base_keys = jax.vmap(jax.random.key)(seeds)
    n_slots = max_new_tokens // snap_interval + 1 if snap_interval else 0
    snaps = tuple(jax.tree.map(lambda x: jnp.zeros((n_slots,) + x.shape, x.dtype), at_boundary(s))
                  for s in gdn_states(state))

    def step(carry, _):
        state, logits, done, snaps, n_snap = carry
        keys = jax.vmap(jax.random.fold_in)(base_keys, state.position)
        tok = _sample(logits, keys, temperature, top_k, top_p)
        lsm = log_softmax(logits)
        logprob = jnp.take_along_axis(lsm, tok[:, None], axis=-1)[:, 0]
        top = jax.lax.top_k(lsm, n_top) if n_top else (jnp.zeros((B, 0)), jnp.zeros((B, 0), jnp.int32))
        stopped = jnp.any(tok[:, None] == stop_ids, axis=-1)  # stop_ids: [B, S], -1 padded
        emitted = ~done
        state, logits = decode_step(model, state, tok)
        if n_slots:  # keep the GDN states at each grid boundary the decode reaches (slot n_snap[b] of row b)
            at = state.position % snap_interval == 0  # [B]
            write = (jnp.arange(n_slots)[:, None] == n_snap[None, :]) & at[None, :]  # [S, B]
            snaps = jax.tree.map(
                lambda buf, new: jnp.where(write.reshape(write.shape + (1,) * (new.ndim - 1)), new[None], buf),
                snaps, tuple(at_boundary(s) for s in gdn_states(state)))
            n_snap = n_snap + at
        return (state, logits, done | stopped, snaps, n_snap), (tok, logprob, emitted, stopped & emitted, top)

    init = (state, last, jnp.zeros((B,), bool), snaps, jnp.zeros((B,), jnp.int32))
    (state, _, _, snaps, n_snap), (toks, lps, emitted, stop_hit, top) = jax.lax.scan(
        step, init, None, length=max_new_tokens)
    return dict(tokens=toks.T, logprobs=lps.T, emitted=emitted.T, stop_hit=stop_hit.T, state=state, snaps=snaps,
                n_snap=n_snap, top_values=jnp.swapaxes(top[0], 0, 1), top_ids=jnp.swapaxes(top[1], 0, 1))


def _prompt_list(prompts):
    """Prompts as something with a length: a generator (any iterable without one) is read once into a list; a string,
    None and arrays are left to `_check_request`; anything that is not iterable is refused, and so are sets and
    dicts (no order to return the results in)."""
    refuse_unordered(prompts, "prompts")
    if prompts is None or isinstance(prompts, (str, bytes)) or hasattr(prompts, "__len__"):
        return prompts
    try:
        return list(prompts)
    except TypeError:
        raise InputError(f"prompts must be a list of token-id sequences; got {type(prompts).__name__}") from None


def _per_request(value, n: int, name: str) -> list:
    """A scalar for every request, or a sequence of one value per request (a ragged nesting: InputError)."""
    ndim = safe_ndim(value)
    if ndim == 0:
        return [value.item() if isinstance(value, np.generic) else value] * n
    if ndim < 0:
        raise InputError(f"{name} must be one number, or one number per prompt; got {value!r:.60}")
    if ndim > 1:  # (a [1, n] array had read as "1 values for n prompts")
        raise InputError(f"{name} must be one number, or a flat sequence of one per prompt; got {ndim} dimensions "
                         f"(shape {np.shape(value)})")
    value = list(value)
    if len(value) != n:
        raise InputError(f"{name}: {len(value)} values for {n} prompts")
    return value


def _stop_lists(stop_token_ids, n: int) -> list[list[int]]:
    """Shared stop ids (a flat sequence) or one sequence per request; InputError for anything but integer ids."""
    def ids(row) -> list[int]:
        if isinstance(row, (str, bytes)) or safe_ndim(row) != 1 or any(token_id(s) is None for s in row):
            raise InputError(f"stop_token_ids must be integer token ids (a flat sequence, or one per prompt); got "
                             f"{row!r:.60}")
        return [token_id(s) for s in row]

    if (isinstance(stop_token_ids, (str, bytes)) or not hasattr(stop_token_ids, "__iter__")
            or getattr(stop_token_ids, "ndim", None) == 0):  # (a 0-d array has __iter__, yet cannot be iterated)
        raise InputError(f"stop_token_ids must be a sequence of integer token ids; got {stop_token_ids!r:.60}")
    stops = list(stop_token_ids)
    if stops and safe_ndim(stops[0]) != 0:
        if len(stops) != n:
            raise InputError(f"{len(stops)} stop lists for {n} prompts")
        return [ids(row) for row in stops]
    return [ids(stops)] * n if stops else [[]] * n


def _check_request(model: Model, prompts, max_new_tokens, temperature, top_k, top_p, stop_token_ids,
                   return_top_logprobs: int = 0, seed=0):
    """Validate a generation request (scalars or per-request sequences; `prompts` has a length: see
    `_prompt_list`); raises InputError naming the problem."""
    V = model.config.vocab_size
    if isinstance(prompts, (str, bytes)):
        raise InputError("prompts must be a list of token-id sequences (got a string: encode it with a tokenizer)")
    if prompts is None or len(prompts) == 0:
        raise InputError("no prompts given")
    if is_flat_ids(prompts):
        raise InputError("prompts must be a list of token-id sequences (got one flat sequence of ids: wrap it in a "
                         "list)")
    n = len(prompts)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be >= 1, an integer; got {max_new_tokens!r}")
    for t, p in zip(_per_request(temperature, n, "temperature"), _per_request(top_p, n, "top_p")):
        if any(isinstance(x, (str, bytes, bool, np.bool_)) or getattr(x, "dtype", None) == np.bool_ for x in (t, p)):
            raise InputError(f"invalid sampling parameters: temperature={t!r}, top_p={p!r} (numbers)")
        try:
            t, p = float(t), float(p)
        except (TypeError, ValueError):
            raise InputError(f"invalid sampling parameters: temperature={t!r}, top_p={p!r} (numbers)") from None
        if not 0 <= t <= MAX_TEMPERATURE:  # also rejects NaN and inf (logits / inf are all 0)
            raise InputError(f"invalid sampling parameters: temperature={t} (must be >= 0 and at most "
                             f"{MAX_TEMPERATURE:g}; 0 is greedy)")
        if not 0 < p <= 1:
            raise InputError(f"invalid sampling parameters: top_p={p} (must lie in (0, 1])")
    if top_k is not None and not (is_int(top_k) and 1 <= top_k <= V):
        raise InputError(f"invalid sampling parameters: top_k={top_k!r} (an integer in [1, {V}], or None)")
    if not (is_int(return_top_logprobs) and 0 <= return_top_logprobs <= V):
        raise InputError(f"return_top_logprobs must lie in [0, {V}]; got {return_top_logprobs}")
    _seeds(seed, n)
    for i, p in enumerate(prompts):
        token_array(p, f"prompt {i}", V)
    bad = [s for row in _stop_lists(stop_token_ids, n) for s in row if not 0 <= s < V]
    if bad:
        raise InputError(f"stop_token_ids must lie in [0, {V}); got {bad[0]}")


def _check_capacity(prompts: list[list[int]], max_new_tokens: int) -> None:
    """CapacityError when the longest prompt + max_new_tokens passes `MAX_ROW_TOKENS` (the engine bounds its rows
    tighter, by `max_length`, and checks that itself)."""
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > MAX_ROW_TOKENS:
        raise CapacityError(f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} is beyond "
                            f"{MAX_ROW_TOKENS} tokens per row (positions are int32)")


def _seeds(seed, n: int) -> list[int]:
    """One seed for every request, or one per request, as Python ints in [0, 2**32) (NumPy and 0-d JAX integers
    too); InputError otherwise."""
    out = []
    for s in _per_request(seed, n, "seed"):
        value = token_id(s)
        if value is None or not 0 <= value < 2**32:
            raise InputError(f"seed must be an integer in [0, 2**32); got {s!r}")
        out.append(value)
    return out


def generate(model: Model, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float | Sequence[float] = 0.0, top_k: int | None = None,
             top_p: float | Sequence[float] = 1.0, seed: int | Sequence[int] = 0,
             stop_token_ids: Sequence[int] | Sequence[Sequence[int]] = (), return_top_logprobs: int = 0,
             cache: PrefixCache | None = None) -> Generations:
    """Generate from a batch of prompts (lists of token ids, any lengths). Greedy where temperature == 0.

    prompts: a list (any iterable: a generator is read once) of token-id sequences — lists, tuples, 1-D NumPy / JAX
    integer arrays — or a 2-D integer array, one row per prompt. temperature, top_p, seed: one value for all requests
    or one per request (top_k is shared: it is a compile-time size). A request's samples depend only on its prompt, seed
    and parameters, so equal prompts with equal seeds (the default seed is 0 for all) give equal completions: pass one
    seed per request (`seed=[0, 1, ...]`) for k different samples of one prompt; requests of one prompt (and one
    cache hit) share one prefill, their row copied (`_prefill_groups`). stop_token_ids: a sequence of ids
    shared by all requests, or one sequence per request. return_top_logprobs=k also returns, per generated token, the
    k most likely tokens and their logprobs. max_new_tokens, top_k, return_top_logprobs: Python, NumPy or 0-d JAX
    integers. cache: a `PrefixCache` or None. Bad input raises `InputError` naming it (a
    `CapacityError` when a prompt + max_new_tokens passes `MAX_ROW_TOKENS`) before anything compiles. Returns a
    `Generations` list with one `GenerationResult` per prompt, in order, `.cache` (the new prefix cache when `cache`
    was given) and `.timings`.
    """
    check_model(model)
    prompts = _prompt_list(prompts)
    max_new_tokens, top_k, return_top_logprobs = map(plain_int, (max_new_tokens, top_k, return_top_logprobs))
    _check_request(model, prompts, max_new_tokens, temperature, top_k, top_p, stop_token_ids, return_top_logprobs,
                   seed)
    if cache is not None and not isinstance(cache, PrefixCache):
        raise InputError(f"cache must be a jaxgdn.PrefixCache or None; got {type(cache).__name__}")
    B = len(prompts)
    seeds = _seeds(seed, B)
    temperatures = _per_request(temperature, B, "temperature")
    top_ps = _per_request(top_p, B, "top_p")
    stop_rows = _stop_lists(stop_token_ids, B)
    prompts = [token_array(p, f"prompt {i}", None).tolist() for i, p in enumerate(prompts)]
    _check_capacity(prompts, max_new_tokens)

    hits: list[Checkpoint | None] = [None] * B
    if cache is not None:
        hits, cache = cache.bound_to(numerics_key(model)).lookup(prompts)
    starts = np.array([h.position if h else 0 for h in hits], np.int32)
    lens = np.array([len(p) for p in prompts], np.int32) - starts
    # Rows with the same prompt and the same cache hit (k samples of one prompt) prefill the same tokens from the same
    # state: each such group is prefilled once, in the row of its first request, and copied to the others
    unique, copy_of = _prefill_groups(prompts, starts)
    prefilled = _prefill_rows(unique, B)
    T = _bucket(int(lens.max()))
    tokens = np.zeros((len(prefilled), T), np.int32)
    for i, b in enumerate(prefilled):
        tokens[i, :lens[b]] = prompts[b][starts[b]:]
    capacity = _bucket(int((starts + lens).max()) + max_new_tokens)
    state = model.init_state(len(prefilled), capacity)
    if cache is not None:
        state = state_from_checkpoints(state, [hits[b] for b in prefilled])
    stops = np.full((B, max(1, max(len(r) for r in stop_rows))), -1, np.int32)
    for b, row in enumerate(stop_rows):
        stops[b, :len(row)] = row
    # Decode checkpoints: always admissible in a non-deterministic cache; in a deterministic one only when replay
    # decode keeps the states prefill-produced.
    snapshots = cache is not None and (not cache.deterministic or model.decode_mode == "replay")
    snap_interval = cache.interval if snapshots else None
    with mesh_context(model):  # a model placed on a mesh (jaxgdn.sharding): its Pallas kernels run per shard
        t0 = time.perf_counter()
        state, last, prefill_ckpts = _prefill_core(model, state, jnp.asarray(tokens),
                                                   jnp.asarray(lens[prefilled]),
                                                   stride=cache.interval if cache is not None else None)
        prefill_provenance = state.provenance  # (of the prefilled rows, as the in-call checkpoints)
        if len(unique) < B:  # every request's row, from its group's
            state, last = _rows_taken((state, last), copy_of)
        jax.block_until_ready(last)  # only to time prefill apart from decode
        t1 = time.perf_counter()
        out = _generate_core(
            model, state, last, jnp.asarray(seeds, jnp.uint32), jnp.asarray(temperatures, jnp.float32),
            jnp.asarray(top_ps, jnp.float32), jnp.asarray(stops), max_new_tokens=max_new_tokens, top_k=top_k,
            snap_interval=snap_interval, n_top=return_top_logprobs)
        out = dict(jax.block_until_ready(out), prefill_provenance=prefill_provenance,
                   prefill_checkpoints=prefill_ckpts)
    timings = GenerationTimings(prefill_s=t1 - t0, decode_s=time.perf_counter() - t1)
    toks, lps, emitted, stop_hit = (np.asarray(out[k]) for k in ("tokens", "logprobs", "emitted", "stop_hit"))

    top_ids, top_values = np.asarray(out["top_ids"]), np.asarray(out["top_values"])  # [B, steps, k]
    results = Generations()
    results.timings = timings
    for b in range(B):
        n = int(emitted[b].sum())
        top = None
        if return_top_logprobs:
            top = [list(zip(top_ids[b, i].tolist(), top_values[b, i].tolist())) for i in range(n)]
        results.append(GenerationResult(tokens=toks[b, :n].tolist(), logprobs=lps[b, :n].tolist(),
                                        finish_reason="stop" if stop_hit[b].any() else "length",
                                        cached_tokens=int(starts[b]), top_logprobs=top))
    if cache is not None:
        histories = [p + toks[b].tolist() for b, p in enumerate(prompts)]
        numerics = numerics_key(model)
        # (once per prefill group: its requests' rows hold the same checkpoints, the same objects)
        of_unique = checkpoints_from_prefill(out["prefill_checkpoints"], out["prefill_provenance"], histories,
                                             out["state"], cache.interval, numerics, bases=hits, by_row=True,
                                             rows=unique + [None] * (len(prefilled) - len(unique)))
        new = [ck for row in of_unique for ck in row]
        by_row = [of_unique[i] for i in copy_of]
        if snap_interval:  # a row's decode checkpoints share the key/value blocks of its last one before them
            bases = [row[-1] if row else hit for row, hit in zip(by_row, hits)]
            new += _decode_checkpoints(out, prompts, histories, [len(r.tokens) for r in results], snap_interval,
                                       numerics, bases)
        results.cache = cache.insert(new, skip_refused=True)
    return results


def _prefill_groups(prompts: list[list[int]], starts: np.ndarray) -> tuple[list[int], np.ndarray]:
    """(unique, copy_of): the first request of each group of requests with the same prompt and cache hit (they
    prefill the same tokens from the same state), in order, and for every request the index of its group in
    `unique`. A row's prefill does not depend on the other rows (`deterministic=True`: bitwise, tested; otherwise
    within rounding, as any batch composition), so prefilling a group once changes no request's result there."""
    group: dict[tuple, int] = {}  # (prompt, start) -> its index in `unique`
    unique, copy_of = [], []
    for b, (p, s) in enumerate(zip(prompts, starts)):
        key = (tuple(p), int(s))
        if key not in group:
            group[key] = len(unique)
            unique.append(b)
        copy_of.append(group[key])
    return unique, np.array(copy_of, np.int32)


def _prefill_rows(unique: list[int], batch: int) -> list[int]:
    """The requests whose rows the prefill runs: `unique` as it is when every request has its own prompt (then
    exactly as many rows as requests), else padded to a power of two (at most `batch`) by repeating its first, so
    that the prefill of a padded batch (the engine pads to powers of two) compiles for a few row counts, not for
    every count of distinct prompts. The padding rows' results are not used."""
    if len(unique) == batch:
        return unique
    n = min(next_pow2(len(unique)), batch)
    return unique + [unique[0]] * (n - len(unique))


def _rows_taken(tree, rows: np.ndarray):
    """Every array of `tree` (batch-major) at the batch rows `rows`, placed as it was (a model on a mesh keeps its
    state's sharding)."""
    return jax.tree.map(lambda x: placed_like(jnp.take(x, jnp.asarray(rows), axis=0), x), tree)


def _decode_checkpoints(out, prompts, histories, n_emitted, interval, numerics: str,
                        bases: list[Checkpoint | None]) -> list[Checkpoint]:
    """Checkpoints at the grid boundaries reached by decode, within emitted tokens (provenance: the final state's,
    DECODE after recurrent decode, PREFILL after replay decode), computed with `numerics` (`numerics_key`). bases[b]:
    row b's last checkpoint before them (restored or made by its prefill; None: none), whose key/value blocks they
    share (`cache.prefix_blocks`)."""
    state = out["state"]
    provenance, origin = np.asarray(state.provenance), np.asarray(state.origin)
    n_snap = np.asarray(out["n_snap"])
    found = []
    for b, prompt in enumerate(prompts):
        first = (len(prompt) // interval + 1) * interval
        snaps = [(i, first + i * interval) for i in range(int(n_snap[b]))]
        snaps = [(i, p) for i, p in snaps if p - len(prompt) <= n_emitted[b]]
        blocks = prefix_blocks(state, b, [p for _, p in snaps], bases[b])
        for i, p in snaps:
            gdn = tuple(jax.tree.map(lambda x: x[i, b], s) for s in out["snaps"])
            found.append(Checkpoint(tokens=tuple(histories[b][:p]), provenance=int(provenance[b]), gdn=gdn,
                                    kv_blocks=blocks[p], numerics=numerics, origin=int(origin[b])))
    return found
