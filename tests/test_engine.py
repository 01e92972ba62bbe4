"""The offline engine: results in request order and equal to generating each request alone (bitwise, with a
deterministic model and cache), multi-turn conversations reuse the prefix cache across turns, stats add up, the
progress bar, and input validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxgdn
from jaxgdn.engine import Conversation, ConversationResult, Engine, Request, SamplingParams

INTERVAL = 64


@pytest.fixture(scope="module")
def det(tiny):
    return tiny.with_deterministic(True)


def _same(a: jaxgdn.GenerationResult, b: jaxgdn.GenerationResult) -> bool:
    return (a.tokens == b.tokens and a.finish_reason == b.finish_reason
            and np.array_equal(np.array(a.logprobs, np.float32), np.array(b.logprobs, np.float32)))


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(5)
    return [
        Request(rng.integers(0, 256, 40).tolist(), SamplingParams(max_new_tokens=16)),
        Request(rng.integers(0, 256, 3).tolist(), SamplingParams(max_new_tokens=16, temperature=0.8, seed=1)),
        Request(rng.integers(0, 256, 25).tolist(), SamplingParams(max_new_tokens=8)),
        Request(rng.integers(0, 256, 47).tolist(), SamplingParams(max_new_tokens=16, temperature=0.8, seed=2)),
    ]


def _alone(model, req: Request) -> jaxgdn.GenerationResult:
    """The request generated alone, without a cache, cut to its max_new_tokens (generated with 16: with seeds
    drawn per position, a longer run's first n tokens are the n-token run)."""
    p = req.params
    [r] = jaxgdn.generate(model, [req.prompt], max_new_tokens=16, temperature=p.temperature, seed=p.seed)
    n = p.max_new_tokens
    return r if n == 16 else dataclasses.replace(r, tokens=r.tokens[:n], logprobs=r.logprobs[:n])


def test_results_in_order_and_equal_to_generate_alone(det, requests):
    """Two sampling groups, mixed max_new_tokens: every result is bitwise what generating the request alone (no
    cache) returns, in request order."""
    out = Engine(det, max_batch=4, cache=jaxgdn.PrefixCache(interval=INTERVAL), progress=False).run(requests)
    assert len(out.results) == len(requests)
    for i, (req, got) in enumerate(zip(requests, out.results)):
        assert len(got.tokens) == req.params.max_new_tokens, f"request {i}"
        assert _same(got, _alone(det, req)), f"request {i}: engine result differs from generate alone"
    s = out.stats
    assert s.requests == len(requests) and s.batches == 2  # two sampling groups, each within max_batch
    assert s.prompt_tokens == sum(len(r.prompt) for r in requests) == s.cache_hit_tokens + s.prefill_tokens
    assert s.generated_tokens == sum(r.params.max_new_tokens for r in requests)
    assert s.cache_hit_tokens == 0  # no prompt reaches a 64-token checkpoint
    assert 0 < s.generate_s <= s.wall_s and s.tokens_per_s > 0


def test_length_order_batches_similar_requests_and_changes_no_result(det, requests):
    """order="length" (default) cuts batches from the requests sorted by prompt length on the 64-token grid, then
    max_new_tokens (stable); "arrival" keeps request order. With a deterministic model the results are the same
    bits either way (the rows are batch-invariant)."""
    from jaxgdn.engine import _Job

    p8, p16 = SamplingParams(max_new_tokens=8), SamplingParams(max_new_tokens=16)
    lengths = [200, 10, 190, 12, 70, 65]
    jobs = [_Job(i, 0, [1] * n, p8 if i != 4 else p16) for i, n in enumerate(lengths)]
    for p in (p8, p16):  # one sampling group: max_new_tokens is not part of the batch key
        assert p.batch_key == p8.batch_key

    def items(order):
        engine = Engine(det, max_batch=2, use_cache=False, progress=False, order=order)
        return [[j.item for j in batch] for batch in engine._batches(jobs)]

    # 64-token buckets: 10, 12 -> 1; 65, 70 -> 2 (65 asks 8 new tokens, 70 asks 16); 190, 200 -> 4
    assert items("length") == [[1, 3], [5, 4], [2, 0]]
    assert items("arrival") == [[0, 1], [2, 3], [4, 5]]
    out = {o: Engine(det, max_batch=2, cache=jaxgdn.PrefixCache(interval=INTERVAL), progress=False,
                     order=o).run(requests) for o in ("length", "arrival")}
    for i, (a, b) in enumerate(zip(out["length"].results, out["arrival"].results)):
        assert _same(a, b), f"request {i}: the batch order changed its result"
    assert out["length"].stats.batches == out["arrival"].stats.batches == 2


def test_multi_turn_conversations_reuse_the_cache(det):
    rng = np.random.default_rng(6)
    system = rng.integers(0, 256, 70).tolist()  # a shared 70-token system prompt: one 64-token checkpoint
    convs = [Conversation([system + rng.integers(0, 256, 4 + k).tolist(), rng.integers(0, 256, 5).tolist()],
                          SamplingParams(max_new_tokens=16, seed=k)) for k in range(2)]
    engine = Engine(det, max_batch=2, cache=jaxgdn.PrefixCache(interval=INTERVAL), progress=False)
    out = engine.run(convs)
    assert all(isinstance(r, ConversationResult) and len(r.turns) == 2 for r in out.results)
    for c, r in zip(convs, out.results):
        assert r.prompts[0] == c.messages[0]
        assert r.prompts[1] == r.prompts[0] + r.turns[0].tokens + c.messages[1]  # turn 2 extends turn 1
        assert r.history == r.prompts[1] + r.turns[1].tokens
        assert r.turns[1].cached_tokens >= INTERVAL, "the second turn must find its prefix in the cache"
    # The first conversation is scheduled first; the second shares its first cache block and hits it.
    assert out.results[0].turns[0].cached_tokens == 0
    assert out.results[1].turns[0].cached_tokens == INTERVAL
    s = out.stats
    assert s.requests == 4 and s.batches == 4
    assert s.cache_hit_tokens == sum(t.cached_tokens for r in out.results for t in r.turns) > 0
    assert s.prompt_tokens == sum(len(p) for r in out.results for p in r.prompts)
    assert s.prompt_tokens == s.cache_hit_tokens + s.prefill_tokens
    assert s.generated_tokens == 4 * 16
    assert s.cache_entries == len(out.cache) > 0 and engine.cache is out.cache
    if s.prefill_s is not None:  # generate reports its prefill/decode split
        assert 0 <= s.prefill_s and 0 <= s.decode_s and s.prefill_s + s.decode_s <= s.generate_s + 1e-3
    jaxgdn.check_cache(out.cache, det)


def test_progress_bar(det, requests, capsys):
    Engine(det, use_cache=False, progress=True).run(requests[:1])
    assert "jaxgdn engine" in capsys.readouterr().err
    Engine(det, use_cache=False, progress=False).run(requests[:1])
    assert capsys.readouterr().err == ""
    Engine(det, use_cache=False).run(requests[:1])  # the default: a bar only when stderr is a terminal (not here)
    assert capsys.readouterr().err == ""


def test_plain_token_lists_use_default_params(det, requests):
    out = Engine(det, use_cache=False, progress=False,
                 default_params=SamplingParams(max_new_tokens=8)).run([requests[2].prompt])
    assert out.cache is None and _same(out.results[0], _alone(det, requests[2]))


@pytest.mark.parametrize("items, kwargs, error, match", [
    ([], {}, jaxgdn.InputError, "no requests"),
    ([Request([])], {}, jaxgdn.InputError, "^request 0: the prompt is empty$"),
    ([[1, 2], [3, 300]], {}, jaxgdn.InputError, "request 1: .*outside"),
    ([Request([1], SamplingParams(top_p=0.0))], {}, jaxgdn.InputError, "sampling parameters"),
    ([Request([1], SamplingParams(max_new_tokens=0))], {}, jaxgdn.InputError, "max_new_tokens"),
    ([[1], Request([1], SamplingParams(seed=-1))], {}, jaxgdn.InputError, r"request 1: seed must be an integer"),
    ([Request([1], SamplingParams(stop_token_ids=(999,)))], {}, jaxgdn.InputError, "stop_token_ids"),
    ([Conversation([])], {}, jaxgdn.InputError, "conversation 0 has no messages"),
    (["abc"], {}, jaxgdn.InputError,
     "request 0: the prompt must be a flat sequence of integer token ids; got a string"),
    ([[1.5, 2]], {}, jaxgdn.InputError, "integer token ids"),
    ([Conversation([[1], []])], {}, jaxgdn.InputError, "^conversation 0, message 1 is empty$"),
    ([Conversation([[1], [999]])], {}, jaxgdn.InputError, r"^conversation 0, message 1 holds token ids outside"),
    ([[1], Request([True, False, True])], {}, jaxgdn.InputError, "^request 1: the prompt must hold integer token ids"),
    ([Request([1.0, 2.0, 3.0])], {}, jaxgdn.InputError, "^request 0: the prompt must hold integer token ids"),
    ([Request([1, True])], {}, jaxgdn.InputError, "request 0: the prompt must hold integer token ids; got a bool"),
    ([Request([[1], [2, 3]])], {}, jaxgdn.InputError, "request 0: the prompt must be a flat sequence"),
    ([[1], Conversation([[1, 2], [3.0]])], {}, jaxgdn.InputError,
     "^conversation 1, message 1 must hold integer token ids"),
    ([Conversation([[1], [True]])], {}, jaxgdn.InputError, "^conversation 0, message 1 must hold integer token ids"),
    ([Conversation([[1], [2]], SamplingParams(seed=2**32))], {}, jaxgdn.InputError,
     r"^conversation 0: seed must be an integer"),
    ([Request([1], SamplingParams(max_new_tokens=10**15))], {}, jaxgdn.CapacityError,
     "request 0 needs up to 1000000000000001 tokens .*default bound"),
    ([Request([1], SamplingParams(max_new_tokens=10**15))], dict(max_length=2**30), jaxgdn.CapacityError,
     "beyond max_length 1073741824"),
    ([Request([1], SamplingParams(temperature="0.5"))], {}, jaxgdn.InputError, "request 0: .*temperature='0.5'"),
    ([Request([1], None)], {}, jaxgdn.InputError, "request 0: params must be a SamplingParams"),
    ([1, 2, 3], {}, jaxgdn.InputError, "flat sequence of ids: wrap it in a list"),
    (Request([1, 2]), {}, jaxgdn.InputError, "got one: wrap it in a list"),
    (5, {}, jaxgdn.InputError, "run takes a list of requests"),
    (iter([]), {}, jaxgdn.InputError, "no requests"),
    ([Request(list(range(10)), SamplingParams(max_new_tokens=8))], dict(max_length=16), jaxgdn.CapacityError,
     "needs up to 18 tokens"),
    ([Conversation([[1] * 5, [2] * 5], SamplingParams(max_new_tokens=4))], dict(max_length=17),
     jaxgdn.CapacityError, "conversation 0 needs up to 18"),
])
def test_bad_requests(det, items, kwargs, error, match):
    with pytest.raises(error, match=match):
        Engine(det, progress=False, **kwargs).run(items)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_batch=0), "max_batch"),
    (dict(max_batch=2.5), r"max_batch must be an integer >= 1; got 2.5"),
    (dict(max_batch="8"), r"max_batch must be an integer >= 1; got '8'"),
    (dict(max_batch=True), "max_batch must be an integer"),
    (dict(decode_bucket=2.5), r"decode_bucket must be an integer in \[1, \d+\]; got 2.5"),
    (dict(decode_bucket=0), "decode_bucket must be an integer"),
    (dict(decode_bucket=2**40), "decode_bucket must be an integer"),
    (dict(max_length=1), "max_length must be None or an integer"),
    (dict(max_length=2**40), "max_length must be None or an integer"),
    (dict(max_length=16.0), "max_length must be None or an integer"),
    (dict(cache=True), "cache must be a jaxgdn.PrefixCache or None; got bool"),
    (dict(default_params={"max_new_tokens": 4}), "default_params must be a SamplingParams"),
    (dict(order="random"), r"order must be one of \('length', 'arrival'\); got 'random'"),
    (dict(order=None), "order must be one of"),
    (dict(progress="yes"), "progress must be True, False or None; got str 'yes'"),
    (dict(pad_batches=None), "pad_batches must be a bool"),
])
def test_bad_engine_options(det, kwargs, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        Engine(det, **kwargs)


@pytest.mark.parametrize("stop", ["50", [1.7], None, [True], [[1, 2]], 2.0, {1: 2}, {1.5}])
def test_bad_stop_token_ids(stop):
    with pytest.raises(jaxgdn.InputError, match="stop_token_ids must be a sequence of integer token ids"):
        SamplingParams(stop_token_ids=stop)


def test_stop_token_ids_forms():
    """A sequence of integer ids (list, tuple, 1-D array, generator) or one integer id, stored as a tuple of ints."""
    assert SamplingParams(stop_token_ids=[5, np.int64(7)]).stop_token_ids == (5, 7)
    assert SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids == (3, 4)
    assert SamplingParams(stop_token_ids=(t for t in (1, 2))).stop_token_ids == (1, 2)
    assert SamplingParams(stop_token_ids=5).stop_token_ids == (5,)
    assert SamplingParams(stop_token_ids={9, 2, np.int32(5)}).stop_token_ids == (2, 5, 9)  # as generate takes a set
    assert SamplingParams(stop_token_ids=frozenset()).stop_token_ids == ()
    assert SamplingParams(stop_token_ids=np.int32(9)).stop_token_ids == (9,)
    assert all(type(t) is int for t in SamplingParams(stop_token_ids=np.array([3, 4])).stop_token_ids)


def test_conversation_seed_wraps_modulo_2_32(det):
    """A seed that passes validation stays valid on every turn: turn t uses (seed + t) % 2**32, so with seed
    2**32 - 1 both (sampled) turns run and turn 1 draws from seed 0."""
    params = SamplingParams(max_new_tokens=2, temperature=1.0, seed=2**32 - 1)
    out = Engine(det, use_cache=False, progress=False).run([Conversation([[1, 2, 3], [4, 5]], params)])
    [r] = out.results
    assert len(r.turns) == 2 and all(len(t.tokens) == 2 for t in r.turns)
    alone = _alone(det, Request(r.prompts[1], dataclasses.replace(params, seed=0)))
    assert _same(r.turns[1], alone), "turn 1 must use seed (2**32 - 1 + 1) % 2**32 = 0"


def test_run_accepts_any_iterable(det, requests):
    """A generator of requests is materialised once: same results as the list."""
    engine = Engine(det, use_cache=False, progress=False)
    out = engine.run(r for r in requests[2:3])
    assert len(out.results) == 1 and _same(out.results[0], _alone(det, requests[2]))
    conv = engine.run([Conversation(iter([requests[2].prompt, [4, 5]]), SamplingParams(max_new_tokens=2))])
    assert len(conv.results[0].turns) == 2 and conv.results[0].prompts[0] == requests[2].prompt
