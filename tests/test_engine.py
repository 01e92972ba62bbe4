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


def test_plain_token_lists_use_default_params(det, requests):
    out = Engine(det, use_cache=False, progress=False,
                 default_params=SamplingParams(max_new_tokens=8)).run([requests[2].prompt])
    assert out.cache is None and _same(out.results[0], _alone(det, requests[2]))


@pytest.mark.parametrize("items, kwargs, error, match", [
    ([], {}, jaxgdn.InputError, "no requests"),
    ([Request([])], {}, jaxgdn.InputError, "request 0: prompt 0 is empty"),
    ([[1, 2], [3, 300]], {}, jaxgdn.InputError, "request 1: .*outside"),
    ([Request([1], SamplingParams(top_p=0.0))], {}, jaxgdn.InputError, "sampling parameters"),
    ([Request([1], SamplingParams(max_new_tokens=0))], {}, jaxgdn.InputError, "max_new_tokens"),
    ([[1], Request([1], SamplingParams(seed=-1))], {}, jaxgdn.InputError, r"request 1: seed must be an integer"),
    ([Request([1], SamplingParams(stop_token_ids=(999,)))], {}, jaxgdn.InputError, "stop_token_ids"),
    ([Conversation([])], {}, jaxgdn.InputError, "conversation 0 has no messages"),
    (["abc"], {}, jaxgdn.InputError, "request 0: a prompt must be a sequence of integer token ids"),
    ([[1.5, 2]], {}, jaxgdn.InputError, "integer token ids"),
    ([Conversation([[1], []])], {}, jaxgdn.InputError, "conversation 0, message 1"),
    ([Request(list(range(10)), SamplingParams(max_new_tokens=8))], dict(max_length=16), jaxgdn.CapacityError,
     "needs up to 18 tokens"),
    ([Conversation([[1] * 5, [2] * 5], SamplingParams(max_new_tokens=4))], dict(max_length=17),
     jaxgdn.CapacityError, "conversation 0 needs up to 18"),
])
def test_bad_requests(det, items, kwargs, error, match):
    with pytest.raises(error, match=match):
        Engine(det, progress=False, **kwargs).run(items)


def test_bad_engine_options(det):
    with pytest.raises(jaxgdn.InputError, match="max_batch"):
        Engine(det, max_batch=0)
