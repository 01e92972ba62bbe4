"""An offline engine: many generation requests (and multi-turn conversations) through batched `generate` calls
that share one prefix cache.

    engine = jaxgdn.Engine(model, max_batch=8, cache=jaxgdn.PrefixCache(interval=64))
    out = engine.run([
        jaxgdn.Request([1, 2, 3], jaxgdn.SamplingParams(max_new_tokens=16)),
        jaxgdn.Conversation([system_and_question, follow_up], jaxgdn.SamplingParams(max_new_tokens=32, seed=7)),
    ])
    out.results[0]           # GenerationResult of the request
    out.results[1].turns     # one GenerationResult per turn of the conversation
    print(out.stats.summary())

Requests are token ids; a `Conversation` is a list of messages (token ids, chat-template tokens included) where
turn i's prompt is turn i-1's prompt + turn i-1's answer + message i, so each turn extends the previous one and
finds its prompt's prefix in the cache.

Scheduling. The engine runs in waves: wave 0 holds every plain request and the first turn of every conversation;
wave t the t-th turns (they need the previous answers). Inside a wave, requests with equal sampling settings
(temperature, top_k, top_p, stop ids) are batched up to `max_batch` rows; a request whose first cache block
(the first `cache.interval` tokens) was already seen in the wave is scheduled after the batches holding the
first such request, so it finds that prefix cached. With `order="length"` (default) each of those two parts is
sorted by prompt length (rounded up to the 64-token chunk grid, as `generate` pads a batch's prefill to its longest
prompt) and then by `max_new_tokens` (a batch decodes as many steps as its longest request asks) before it is cut
into batches, so that a batch's rows need similar work and few padded tokens are computed; `order="arrival"` keeps
request order. Both sorts are stable, so equal requests keep their order. Which batch a request lands in changes
no result of a deterministic model (its rows are batch-invariant); a default-mode model makes no such promise.
Each batch is one `generate(..., cache=cache)` call and the returned `.cache` is carried to the next, so the cache
spans all batches, waves and `run` calls.

Compilation. A batch's `max_new_tokens` is the largest of its rows rounded up to a multiple of `decode_bucket` (but no
further than `max_length`), and its row count is padded to a power of two (repeating its first request; the copies'
results are dropped), so a stream of similar batches reuses a few compiled programs. Rows get exactly what they asked
for: sampling draws from the request's seed and the token position, never the batch slot, so a row that generates
beyond its own `max_new_tokens` is simply cut back (and its finish reason recomputed).

Stats: prompt tokens = cache hit tokens (restored from the cache) + prefill tokens (recomputed by prefill);
generated tokens; wall time, time inside `generate`, and — when `generate` reports it (`Generations.timings`)
— prefill versus decode time. Padding rows are not counted.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable, Sequence, Union

import numpy as np

from .cache import PrefixCache
from .errors import CapacityError, InputError, is_flat_ids, is_int, plain_int, safe_ndim, token_array, token_id
from .generate import GenerationResult, _bucket, _check_request, check_model, generate
from .model import Model
from .shapes import next_pow2

SEED_MODULUS = 2**32  # seeds lie in [0, 2**32); a conversation's turn seeds wrap around modulo this
DEFAULT_MAX_LENGTH = 1 << 22  # prompt + generated tokens per row when `Engine(max_length=None)` (4,194,304)
MAX_LENGTH_LIMIT = 1 << 30  # the largest `max_length` (positions are int32; bucket rounding stays far below 2**31)
MAX_DECODE_BUCKET = 1 << 20
ORDERS = ("length", "arrival")  # how a wave's requests are ordered before they are cut into batches (`Engine`)


def _stop_ids(value) -> tuple[int, ...]:
    """SamplingParams.stop_token_ids as a tuple of ints: a sequence of integer ids, a set of them (sorted: the
    order of stop ids means nothing, and `generate` takes a set too), or one integer id (Python, NumPy or a 0-d
    NumPy / JAX integer array)."""
    if token_id(value) is not None:
        return (token_id(value),)
    bad = InputError(f"stop_token_ids must be a sequence of integer token ids (or one integer id); got {value!r}")
    if value is None or isinstance(value, (str, bytes, dict)):
        raise bad
    try:
        ids = list(value)
    except TypeError:
        raise bad from None
    if any(token_id(t) is None for t in ids):
        raise bad
    ids = [token_id(t) for t in ids]
    return tuple(sorted(ids) if isinstance(value, (set, frozenset)) else ids)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (see `jaxgdn.generate`).

    stop_token_ids: a sequence of integer token ids (a list, tuple, set or 1-D NumPy / JAX integer array), or a
    single integer id; stored as a tuple of ints (a set's sorted). Anything else (a string, None, floats, bools,
    nested lists) raises InputError here; the ids' range and the other fields (temperature, top_p: one number each;
    max_new_tokens, seed and top_k unless None: one integer each) are checked against the model by `Engine.run`.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", _stop_ids(self.stop_token_ids))
        for name in ("max_new_tokens", "top_k"):  # 0-d NumPy / JAX integers as Python ints (`errors.plain_int`)
            object.__setattr__(self, name, plain_int(getattr(self, name)))

    @property
    def batch_key(self):
        """Requests with equal keys can share a `generate` call."""
        return (float(self.temperature), self.top_k, float(self.top_p), self.stop_token_ids)


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt to complete: a non-empty sequence of integer token ids (no bools, no floats)."""

    prompt: Sequence[int]
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class Conversation:
    """A multi-turn conversation: turn i's prompt = prompt(i-1) + answer(i-1) + messages[i] (token ids).

    Every message must hold at least one token (integer token ids, no bools, no floats). Every turn uses `params`;
    the seed of turn i is `(params.seed + i) % 2**32` (so sampled turns do not repeat each other, and any valid seed,
    2**32 - 1 included, stays valid on every turn).
    """

    messages: Sequence[Sequence[int]]
    params: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class ConversationResult:
    prompts: list[list[int]]  # the prompt of each turn
    turns: list[GenerationResult]  # the answer of each turn

    @property
    def history(self) -> list[int]:
        """The whole conversation: last prompt + last answer."""
        return self.prompts[-1] + self.turns[-1].tokens


@dataclasses.dataclass(frozen=True)
class EngineStats:
    requests: int  # generation rows run (a conversation counts one per turn); padding rows excluded
    batches: int  # generate calls
    prompt_tokens: int  # = cache_hit_tokens + prefill_tokens
    cache_hit_tokens: int  # prompt tokens restored from the prefix cache
    prefill_tokens: int  # prompt tokens recomputed by prefill
    generated_tokens: int  # tokens returned (after cutting rows back to their max_new_tokens)
    wall_s: float  # the whole run, host work included
    generate_s: float  # inside generate calls (compilation included)
    prefill_s: float | None  # of generate_s, in prefill (None when generate does not report it)
    decode_s: float | None  # of generate_s, in the decode loop
    cache_entries: int = 0
    cache_bytes: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Prefilled + generated tokens per second of wall time."""
        return (self.prefill_tokens + self.generated_tokens) / max(self.wall_s, 1e-9)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return None if not self.prefill_s else self.prefill_tokens / self.prefill_s

    @property
    def decode_tokens_per_s(self) -> float | None:
        return None if not self.decode_s else self.generated_tokens / self.decode_s

    def summary(self) -> str:
        def rate(x):
            return "n/a" if x is None else f"{x:,.1f}"

        split = ("prefill/decode split n/a (generate does not report it)" if self.prefill_s is None else
                 f"prefill {self.prefill_s:.2f} s ({rate(self.prefill_tokens_per_s)} tok/s), "
                 f"decode {self.decode_s:.2f} s ({rate(self.decode_tokens_per_s)} tok/s)")
        return (f"{self.requests} requests in {self.batches} batches, {self.wall_s:.2f} s wall "
                f"({self.tokens_per_s:,.1f} tok/s); prompt tokens {self.prompt_tokens} = {self.cache_hit_tokens} "
                f"cache hits + {self.prefill_tokens} prefilled; {self.generated_tokens} generated; generate "
                f"{self.generate_s:.2f} s: {split}; cache {self.cache_entries} entries, {self.cache_bytes:,} bytes")


@dataclasses.dataclass(frozen=True)
class EngineOutput:
    results: list[Union[GenerationResult, ConversationResult]]  # in request order
    stats: EngineStats
    cache: PrefixCache | None


Item = Union[Request, Conversation, Sequence[int]]


@dataclasses.dataclass
class _Job:
    item: int  # index of the request / conversation
    turn: int
    prompt: list[int]
    params: SamplingParams


def _check_tokens(msg, what: str, vocab_size: int) -> list[int]:
    """A prompt / message as a list of ints, checked as `generate` checks a prompt (`errors.token_array`)."""
    return [int(t) for t in token_array(msg, what, vocab_size)]


def _check_options(model, max_batch, cache, use_cache, max_length, progress, pad_batches, decode_bucket,
                   default_params, order) -> None:
    """`Engine`'s arguments, each as its docstring says; InputError naming the first that is not."""
    check_model(model)
    for name, flag in (("use_cache", use_cache), ("pad_batches", pad_batches)):
        if not isinstance(flag, (bool, np.bool_)):
            raise InputError(f"{name} must be a bool; got {type(flag).__name__} {flag!r:.40}")
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise InputError(f"progress must be True, False or None; got {type(progress).__name__} {progress!r:.40}")
    if not is_int(max_batch) or max_batch < 1:
        raise InputError(f"max_batch must be an integer >= 1; got {max_batch!r}")
    if not is_int(decode_bucket) or not 1 <= decode_bucket <= MAX_DECODE_BUCKET:
        raise InputError(f"decode_bucket must be an integer in [1, {MAX_DECODE_BUCKET}]; got {decode_bucket!r}")
    if max_length is not None and not (is_int(max_length) and 2 <= max_length <= MAX_LENGTH_LIMIT):
        raise InputError(f"max_length must be None or an integer in [2, {MAX_LENGTH_LIMIT}]; got {max_length!r}")
    if cache is not None and not isinstance(cache, PrefixCache):
        raise InputError(f"cache must be a jaxgdn.PrefixCache or None; got {type(cache).__name__}")
    if cache is not None and not use_cache:
        raise InputError("cache= was given with use_cache=False: pass one or the other (use_cache=False runs "
                         "without a cache)")
    if not isinstance(default_params, SamplingParams):
        raise InputError(f"default_params must be a SamplingParams; got {type(default_params).__name__}")
    if not isinstance(order, str) or order not in ORDERS:
        raise InputError(f"order must be one of {ORDERS}; got {order!r:.40}")


class Engine:
    """Offline batched generation over one prefix cache (see the module docstring).

    cache: the prefix cache to start from; None with `use_cache=True` makes an empty one (deterministic when the
    model is). The engine keeps the newest cache in `.cache` across `run` calls.
    max_length: limit on prompt + generated tokens per row, counted over a conversation's turns (`CapacityError`
    beyond it, raised before anything runs); None means `DEFAULT_MAX_LENGTH` (2**22); at most 2**30.
    max_batch, decode_bucket: positive integers (Python, NumPy or 0-d JAX; decode_bucket at most 2**20). max_batch
    bounds the requests in one batch; with `pad_batches` (default) a batch's rows are padded to a power of two, so a
    max_batch that is not one (3, say) can run up to the next power of two rows (4), the copies' results dropped:
    size memory for that, or pass pad_batches=False (one compiled program per distinct batch size then).
    use_cache, pad_batches: bools. `cache=` with `use_cache=False` is a contradiction (InputError).
    progress: a bar over the requests on stderr: True, False, or None (the default) for one only when stderr is a
    terminal (as `load_pretrained`'s), so that batch jobs' logs get no carriage-return lines.
    order: "length" (default) or "arrival": how requests are grouped into batches (the module docstring's
    Scheduling); results come back in request order either way.
    """

    def __init__(self, model: Model, *, max_batch: int = 8, cache: PrefixCache | None = None,
                 use_cache: bool = True, max_length: int | None = None, progress: bool | None = None,
                 pad_batches: bool = True, decode_bucket: int = 16,
                 default_params: SamplingParams = SamplingParams(), order: str = "length"):
        max_batch, max_length, decode_bucket = map(plain_int, (max_batch, max_length, decode_bucket))
        _check_options(model, max_batch, cache, use_cache, max_length, progress, pad_batches, decode_bucket,
                       default_params, order)
        self.model = model
        self.max_batch = int(max_batch)  # NumPy integers as Python ints (np.int64 has no bit_length)
        self.cache = cache if cache is not None else (PrefixCache(deterministic=model.deterministic)
                                                      if use_cache else None)
        self.max_length = int(max_length) if max_length is not None else None
        self.progress = None if progress is None else bool(progress)
        self.pad_batches = bool(pad_batches)
        self.decode_bucket = int(decode_bucket)
        self.default_params = default_params
        self.order = order

    @property
    def row_limit(self) -> int:
        """Prompt + generated tokens per row: `max_length`, or `DEFAULT_MAX_LENGTH` when it is None."""
        return self.max_length if self.max_length is not None else DEFAULT_MAX_LENGTH

    # ---- validation ----------------------------------------------------------------------------------------
    def _normalise(self, items: Iterable[Item]) -> list[Request | Conversation]:
        if isinstance(items, (Request, Conversation)):
            raise InputError("run takes a list of requests / conversations (got one: wrap it in a list)")
        if isinstance(items, (str, bytes)):
            raise InputError("run takes a list of requests (got a string: encode it with a tokenizer)")
        try:
            items = list(items)  # any iterable (a generator too), materialised once
        except TypeError:
            raise InputError(f"run takes a list of requests / conversations / token-id lists; got "
                             f"{type(items).__name__}") from None
        if len(items) == 0:
            raise InputError("no requests given")
        if is_flat_ids(items):
            raise InputError("run takes a list of requests (got one flat sequence of ids: wrap it in a list)")
        V = self.model.config.vocab_size
        limit = self.row_limit
        out = []
        for i, it in enumerate(items):
            if not isinstance(it, (Request, Conversation)):
                it = Request(prompt=it, params=self.default_params)
            what = f"request {i}" if isinstance(it, Request) else f"conversation {i}"
            if not isinstance(it.params, SamplingParams):
                raise InputError(f"{what}: params must be a SamplingParams; got {type(it.params).__name__}")
            if isinstance(it, Request):
                prompts = [_check_tokens(it.prompt, f"{what}: the prompt", V)]
            else:
                if isinstance(it.messages, (str, bytes)):
                    raise InputError(f"{what}: messages must be a list of token-id sequences; got a string")
                try:
                    messages = list(it.messages)
                except TypeError:
                    raise InputError(f"{what}: messages must be a list of token-id sequences") from None
                if not messages:
                    raise InputError(f"{what} has no messages")
                if is_flat_ids(messages):
                    raise InputError(f"{what}: messages must be a list of token-id sequences (got one flat sequence "
                                     f"of ids: wrap it in a list)")
                prompts = [_check_tokens(m, f"{what}, message {j}", V) for j, m in enumerate(messages)]
            p = it.params
            for name in ("temperature", "top_p", "seed"):  # one number per request (generate takes lists too)
                if safe_ndim(getattr(p, name)) != 0:
                    raise InputError(f"{what}: invalid sampling parameters: {name}={getattr(p, name)!r} (a number)")
            try:
                _check_request(self.model, prompts[:1], p.max_new_tokens, p.temperature, p.top_k, p.top_p,
                               p.stop_token_ids, seed=p.seed)
            except InputError as e:
                raise type(e)(f"{what}: {e}") from None
            need = sum(len(m) for m in prompts) + len(prompts) * p.max_new_tokens
            if need > limit:
                bound = (f"max_length {self.max_length}" if self.max_length is not None else
                         f"the default bound of {DEFAULT_MAX_LENGTH} tokens per row (pass max_length, up to "
                         f"{MAX_LENGTH_LIMIT}, to raise it)")
                raise CapacityError(f"{what} needs up to {need} tokens (prompts + max_new_tokens per turn), beyond "
                                    f"{bound}")
            # keep the validated ids (a generator of messages is read once)
            out.append(dataclasses.replace(it, prompt=prompts[0]) if isinstance(it, Request) else
                       dataclasses.replace(it, messages=prompts))
        return out

    # ---- scheduling ----------------------------------------------------------------------------------------
    def _batches(self, jobs: list[_Job]) -> list[list[_Job]]:
        block = self.cache.interval if self.cache is not None else None
        groups: dict = {}
        for job in jobs:
            groups.setdefault(job.params.batch_key, []).append(job)
        batches = []
        for group in groups.values():
            first, later, seen = [], [], set()
            for job in group:  # a request whose first cache block an earlier one shares goes after it
                key = tuple(job.prompt[:block]) if block and len(job.prompt) > block else None
                (later if key is not None and key in seen else first).append(job)
                if key is not None:
                    seen.add(key)
            for part in (first, later):
                if self.order == "length":  # similar prefill and decode work per batch (stable: ties keep order)
                    part = sorted(part, key=lambda j: (_bucket(len(j.prompt)), j.params.max_new_tokens))
                batches += [part[k:k + self.max_batch] for k in range(0, len(part), self.max_batch)]
        return batches

    def _run_batch(self, batch: list[_Job]):
        rows = list(batch)
        if self.pad_batches:
            rows += [batch[0]] * (min(next_pow2(len(batch)), next_pow2(self.max_batch)) - len(batch))
        new = max(j.params.max_new_tokens for j in batch)
        rounded = -(-new // self.decode_bucket) * self.decode_bucket
        # the rounding never runs more steps than max_length (nor fewer than a row asks for); capped at max_length
        # itself rather than at what the longest prompt leaves, so that the steps stay a few values (each compiles)
        limit = self.row_limit
        new = max(new, min(rounded, limit))
        p = batch[0].params
        t0 = time.perf_counter()
        out = generate(self.model, [j.prompt for j in rows], max_new_tokens=new, temperature=p.temperature,
                       top_k=p.top_k, top_p=p.top_p, seed=[j.params.seed for j in rows],
                       stop_token_ids=p.stop_token_ids, cache=self.cache)
        elapsed = time.perf_counter() - t0
        if self.cache is not None:
            self.cache = out.cache
        results = [_cut(r, j.params.max_new_tokens) for r, j in zip(out, batch)]
        return results, elapsed, getattr(out, "timings", None)

    # ---- the run -------------------------------------------------------------------------------------------
    def run(self, items: Iterable[Item]) -> EngineOutput:
        """Generate for every request / conversation; results in request order, with stats and the new cache.

        items: any iterable (a list, a generator: it is read once) of `Request`, `Conversation` or plain token-id
        lists (run with `default_params`). Everything is validated before anything compiles or runs.
        """
        from tqdm.auto import tqdm

        t_start = time.perf_counter()
        items = self._normalise(items)
        total = sum(1 if isinstance(it, Request) else len(it.messages) for it in items)
        results: list = [None] * len(items)
        conv_prompts = {i: [] for i, it in enumerate(items) if isinstance(it, Conversation)}
        conv_turns = {i: [] for i in conv_prompts}
        counts = dict(requests=0, batches=0, prompt=0, hit=0, generated=0)
        gen_s, prefill_s, decode_s, split = 0.0, 0.0, 0.0, True

        with tqdm(total=total, unit="req", desc="jaxgdn engine", leave=False,
                  disable=None if self.progress is None else not self.progress) as bar:
            turn = 0
            while True:
                jobs = []
                for i, it in enumerate(items):
                    if isinstance(it, Request) and turn == 0:
                        jobs.append(_Job(i, 0, [int(t) for t in it.prompt], it.params))
                    elif isinstance(it, Conversation) and turn < len(it.messages):
                        prev = conv_prompts[i][-1] + conv_turns[i][-1].tokens if turn else []
                        params = dataclasses.replace(it.params, seed=(int(it.params.seed) + turn) % SEED_MODULUS)
                        jobs.append(_Job(i, turn, prev + [int(t) for t in it.messages[turn]], params))
                if not jobs:
                    break
                for batch in self._batches(jobs):
                    res, elapsed, timings = self._run_batch(batch)
                    gen_s += elapsed
                    if timings is None:
                        split = False
                    else:
                        prefill_s += timings.prefill_s
                        decode_s += timings.decode_s
                    counts["batches"] += 1
                    for job, r in zip(batch, res):
                        counts["requests"] += 1
                        counts["prompt"] += len(job.prompt)
                        counts["hit"] += r.cached_tokens
                        counts["generated"] += len(r.tokens)
                        if isinstance(items[job.item], Conversation):
                            conv_prompts[job.item].append(job.prompt)
                            conv_turns[job.item].append(r)
                        else:
                            results[job.item] = r
                    bar.update(len(batch))
                    done = counts["prompt"] - counts["hit"] + counts["generated"]
                    bar.set_postfix(tok_s=f"{done / max(time.perf_counter() - t_start, 1e-9):.0f}")
                turn += 1

        for i in conv_prompts:
            results[i] = ConversationResult(prompts=conv_prompts[i], turns=conv_turns[i])
        cstats = self.cache.stats() if self.cache is not None else None
        stats = EngineStats(
            requests=counts["requests"], batches=counts["batches"], prompt_tokens=counts["prompt"],
            cache_hit_tokens=counts["hit"], prefill_tokens=counts["prompt"] - counts["hit"],
            generated_tokens=counts["generated"], wall_s=time.perf_counter() - t_start, generate_s=gen_s,
            prefill_s=prefill_s if split else None, decode_s=decode_s if split else None,
            cache_entries=cstats.entries if cstats else 0, cache_bytes=cstats.bytes if cstats else 0)
        return EngineOutput(results=results, stats=stats, cache=self.cache)


def _cut(r: GenerationResult, n: int) -> GenerationResult:
    """A result cut back to n tokens (as if generated with max_new_tokens=n; top_logprobs too when present)."""
    if len(r.tokens) <= n:
        return r
    top = r.top_logprobs[:n] if r.top_logprobs is not None else None
    return dataclasses.replace(r, tokens=r.tokens[:n], logprobs=r.logprobs[:n], finish_reason="length",
                               top_logprobs=top)


def run_requests(model: Model, items: Sequence[Item], **engine_kwargs) -> EngineOutput:
    """One-shot: `Engine(model, **engine_kwargs).run(items)`."""
    return Engine(model, **engine_kwargs).run(items)
