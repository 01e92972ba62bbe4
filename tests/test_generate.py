"""jaxgdn.generate: greedy decoding equals a manual prefill + argmax + decode_step loop, batching does not change
results, stop tokens, seeded sampling, no recompilation within a size bucket, invalid parameters.

All batched calls use 2 prompts of at most 64 tokens and max_new_tokens=NEW, so `_generate_core` is compiled once
for batch 2 and once for batch 1."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxgdn
from jaxgdn.generate import _generate_core
from tests.conftest import CAP, random_tokens

NEW = 8


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4242)
    return [random_tokens(rng, 5).tolist(), random_tokens(rng, 40).tolist()]


@pytest.fixture(scope="module")
def greedy(tiny, prompts):
    return jaxgdn.generate(tiny, prompts, max_new_tokens=NEW)


def test_greedy_equals_manual_loop(tiny, prompts, greedy):
    """Tokens equal; logprobs equal to log_softmax of the manually computed logits within 1e-5."""
    B = len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.zeros((B, 80), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    state, logits = tiny.prefill_chunk(tiny.init_state(B, CAP), tokens, lengths)
    last = np.asarray(logits)[np.arange(B), lengths - 1]
    manual_tokens, manual_lp = [], []
    for _ in range(NEW):
        tok = last.argmax(-1).astype(np.int32)
        lp = np.asarray(jax.nn.log_softmax(last, axis=-1))[np.arange(B), tok]
        manual_tokens.append(tok)
        manual_lp.append(lp)
        state, last = tiny.decode_step(state, tok)
        last = np.asarray(last)
    manual_tokens, manual_lp = np.stack(manual_tokens, 1), np.stack(manual_lp, 1)
    for b, r in enumerate(greedy):
        assert r.finish_reason == "length" and len(r.tokens) == NEW == len(r.logprobs)
        assert r.tokens == manual_tokens[b].tolist(), f"row {b}: greedy tokens differ from the manual loop"
        d = float(np.max(np.abs(np.array(r.logprobs) - manual_lp[b])))
        assert d <= 1e-5, f"row {b}: logprobs max abs diff {d:.3g} > 1e-5 vs log_softmax of manual logits"


def test_batched_prompts_equal_each_alone(tiny, prompts, greedy):
    for b, p in enumerate(prompts):
        alone = jaxgdn.generate(tiny, [p], max_new_tokens=NEW)[0]
        assert alone.tokens == greedy[b].tokens, f"prompt {b}: tokens differ when generated alone"
        d = float(np.max(np.abs(np.array(alone.logprobs) - greedy[b].logprobs)))
        assert d <= 1e-5, f"prompt {b}: logprobs alone vs batched max abs diff {d:.3g} > 1e-5"


def test_stop_tokens(tiny, prompts, greedy):
    stop = greedy[0].tokens[3]
    out = jaxgdn.generate(tiny, prompts, max_new_tokens=NEW, stop_token_ids=[stop])
    for b, (r, g) in enumerate(zip(out, greedy)):
        if stop in g.tokens:
            n = g.tokens.index(stop) + 1
            assert r.finish_reason == "stop", f"row {b}"
            assert r.tokens == g.tokens[:n] and r.tokens[-1] == stop, f"row {b}: must end at the first stop token"
            assert np.array_equal(r.logprobs, g.logprobs[:n])
        else:
            assert r.finish_reason == "length" and r.tokens == g.tokens


def test_seeded_sampling(tiny, prompts, greedy):
    a = jaxgdn.generate(tiny, prompts, max_new_tokens=NEW, temperature=1.0, seed=11)
    b = jaxgdn.generate(tiny, prompts, max_new_tokens=NEW, temperature=1.0, seed=11)
    c = jaxgdn.generate(tiny, prompts, max_new_tokens=NEW, temperature=1.0, seed=12)
    assert [r.tokens for r in a] == [r.tokens for r in b], "same seed must reproduce the same tokens"
    assert all(np.array_equal(x.logprobs, y.logprobs) for x, y in zip(a, b))
    assert [r.tokens for r in a] != [r.tokens for r in c], "another seed should give other tokens"
    assert [r.tokens for r in a] != [r.tokens for r in greedy]
    for r in a + c:
        assert all(np.isfinite(r.logprobs)) and max(r.logprobs) <= 0.0
        assert all(0 <= t < tiny.config.vocab_size for t in r.tokens)


def test_sampling_randomness_follows_the_request_not_the_batch_slot(tiny, prompts):
    """Row 0 with its own seed gives the same samples whatever the other row holds (prompt and seed)."""
    other = random_tokens(np.random.default_rng(9), 23).tolist()
    a = jaxgdn.generate(tiny, prompts, max_new_tokens=NEW, temperature=1.0, seed=[5, 6])
    b = jaxgdn.generate(tiny, [prompts[0], other], max_new_tokens=NEW, temperature=1.0, seed=[5, 99])
    assert a[0].tokens == b[0].tokens
    assert np.max(np.abs(np.array(a[0].logprobs) - b[0].logprobs)) <= 1e-5
    same = jaxgdn.generate(tiny, [prompts[0], prompts[0]], max_new_tokens=NEW, temperature=1.0, seed=[5, 5])
    assert same[0].tokens == same[1].tokens == a[0].tokens


def test_tiny_top_p_is_greedy(tiny, prompts, greedy):
    """top_p so small that only the most likely token survives: sampling must return the greedy tokens."""
    out = jaxgdn.generate(tiny, prompts, max_new_tokens=NEW, temperature=1.0, top_p=1e-6, seed=3)
    assert [r.tokens for r in out] == [r.tokens for r in greedy]


def test_no_recompilation_within_a_bucket(tiny, prompts):
    """Prompts of other lengths with the same 64-token buckets (prompt: 64, capacity: 64 for up to 56 prompt
    tokens + NEW), other values, seeds, sampling parameters and stop tokens: no new compilation."""
    # the bucket's program (`greedy`'s call), compiled here if conftest's `_bounded_memory_maps` cleared JAX's caches
    # since the fixture ran (as test_score's twin failed once)
    jaxgdn.generate(tiny, prompts, max_new_tokens=NEW)
    n = _generate_core._cache_size()
    assert n >= 1
    rng = np.random.default_rng(1)
    jaxgdn.generate(tiny, [random_tokens(rng, 17).tolist(), random_tokens(rng, 50).tolist()], max_new_tokens=NEW)
    jaxgdn.generate(tiny, [random_tokens(rng, 1).tolist(), random_tokens(rng, 56).tolist()], max_new_tokens=NEW,
                    temperature=0.7, top_p=0.9, seed=[1, 2], stop_token_ids=[3])
    assert _generate_core._cache_size() == n, "generate recompiled for prompts of the same bucket"


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=4, top_p=0.0), "top_p"),
    (dict(max_new_tokens=4, top_p=1.5), "top_p"),
    (dict(max_new_tokens=4, top_k=0), "top_k"),
    (dict(max_new_tokens=4, top_k=257), "top_k"),
    (dict(max_new_tokens=4, top_k=2.5), r"top_k=2.5 \(an integer"),
    (dict(max_new_tokens=4, return_top_logprobs=1.5), "return_top_logprobs"),
    (dict(max_new_tokens=4, stop_token_ids=[256]), "stop_token_ids"),
    (dict(max_new_tokens=4, seed=[1, 2, 3]), "seed: 3 values for 2 prompts"),
    (dict(max_new_tokens=4, seed=np.array([[1, 2]])), r"seed must be one number, or a flat sequence of one per "
                                                       r"prompt; got 2 dimensions \(shape \(1, 2\)\)"),
    (dict(max_new_tokens=4, temperature=-1.0), r"temperature=-1.0 \(must be >= 0"),
    (dict(max_new_tokens=4, top_p=1.5), r"top_p=1.5 \(must lie in \(0, 1\]\)"),
    (dict(max_new_tokens=4, temperature="hot"), "numbers"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be >= 1, an integer; got 2.5"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=4, seed=-1), r"seed must be an integer in \[0, 2\*\*32\); got -1"),
    (dict(max_new_tokens=4, seed=2**32), "seed must be an integer"),
    (dict(max_new_tokens=4, seed=[1, 1.5]), "got 1.5"),
    (dict(max_new_tokens=4, temperature="0.5"), "numbers"),  # a string is not a number, even one float() reads
    (dict(max_new_tokens=4, temperature=True), "numbers"),
    (dict(max_new_tokens=4, stop_token_ids="50"), "stop_token_ids must be a sequence of integer token ids"),
    (dict(max_new_tokens=4, stop_token_ids=5), "stop_token_ids must be a sequence of integer token ids"),
    (dict(max_new_tokens=4, stop_token_ids=[1.7]), "stop_token_ids must be integer token ids"),
    (dict(max_new_tokens=4, stop_token_ids=[[1], [2.5]]), "stop_token_ids must be integer token ids"),
])
def test_invalid_parameters(tiny, prompts, kwargs, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.generate(tiny, prompts, **kwargs)


@pytest.mark.parametrize("bad_prompts, match", [
    ([], "no prompts"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, 256]], "prompt 0"),
    ([[-1, 2]], "prompt 0"),
    ([1, 2, 3], "one flat sequence of ids: wrap it in a list"),
    ("hello", "got a string"),
    (["hello"], "prompt 0 must be a flat sequence of integer token ids; got a string"),
    ([[1.7, 2.2, 3.9]], "prompt 0 must hold integer token ids; got float64"),
    ([[1, 2], [True, False]], "prompt 1 must hold integer token ids; got bool"),
    ([[1, True, 3]], "prompt 0 must hold integer token ids; got a bool"),  # NumPy makes [1, True] int64
    (np.zeros((1, 2, 3), np.int32), r"prompt 0 must be a flat sequence of integer token ids; got shape \(2, 3\)"),
    ([[1, 2], 5], r"prompt 1 must be a flat sequence .*got shape \(\)"),
])
def test_invalid_prompts(tiny, bad_prompts, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.generate(tiny, bad_prompts, max_new_tokens=4)


def test_per_request_sampling_stops_and_top_logprobs(tiny, prompts):
    """Per-request temperature / seed / stop lists, and top-k logprobs consistent with the chosen tokens."""
    greedy_first = jaxgdn.generate(tiny, prompts[:2], max_new_tokens=6)
    stop = greedy_first[1].tokens[2]
    out = jaxgdn.generate(tiny, prompts[:2], max_new_tokens=6, temperature=[0.0, 0.0], seed=np.array([1, 2]),
                          stop_token_ids=[[], [stop]], return_top_logprobs=3)
    assert out[0].tokens == greedy_first[0].tokens and out[0].finish_reason == "length"
    assert out[1].finish_reason == "stop" and out[1].tokens[-1] == stop
    for r in out:
        assert len(r.top_logprobs) == len(r.tokens)
        for tok, lp, top in zip(r.tokens, r.logprobs, r.top_logprobs):
            assert len(top) == 3 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
            assert top[0][0] == tok and top[0][1] == lp  # greedy: the chosen token is the most likely one
    with pytest.raises(jaxgdn.InputError, match="temperature: 1 values for 2 prompts"):
        jaxgdn.generate(tiny, prompts[:2], max_new_tokens=2, temperature=[0.5])
    with pytest.raises(jaxgdn.InputError, match="no prompts"):
        jaxgdn.generate(tiny, np.zeros((0, 3), np.int32), max_new_tokens=2)
