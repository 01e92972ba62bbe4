"""Input handling of `generate`, `score` and the engine, as a user calls them (mistakes included): a clear
`InputError` naming the argument instead of a traceback from deep inside NumPy / JAX, and the forms the docstrings
promise (generators, NumPy and JAX integers) accepted with the results of their list twins."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn.engine import Conversation, Engine, Request, SamplingParams, _cut
from jaxgdn.generate import MAX_ROW_TOKENS, GenerationResult

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8]]
NEW = 4


@pytest.fixture(scope="module")
def model():
    return jaxgdn.tiny_model("tiny", seed=3)


@pytest.fixture(scope="module")
def greedy(model):
    return jaxgdn.generate(model, PROMPTS, max_new_tokens=NEW)


def _tokens(results) -> list[list[int]]:
    return [r.tokens for r in results]


# ---- the model argument ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("call", [
    lambda m: jaxgdn.generate(None, PROMPTS, max_new_tokens=NEW),
    lambda m: jaxgdn.generate(PROMPTS, m, max_new_tokens=NEW),  # arguments swapped
    lambda m: jaxgdn.score(None, [[1, 2, 3]]),
    lambda m: jaxgdn.score([[1, 2, 3]], m),
    lambda m: Engine(None),
    lambda m: jaxgdn.engine.run_requests(m.config, [[1, 2]]),
], ids=["generate-None", "generate-swapped", "score-None", "score-swapped", "engine-None", "run_requests-config"])
def test_a_model_that_is_not_a_model_is_named(model, call):
    """Was: AttributeError ('list' object has no attribute 'config')."""
    with pytest.raises(jaxgdn.InputError, match="model must be a jaxgdn.Model"):
        call(model)


# ---- generate ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cache", [True, "cache", {}])
def test_generate_refuses_a_cache_that_is_not_a_prefix_cache(model, cache):
    """Was: AttributeError ('bool' object has no attribute 'bound_to')."""
    with pytest.raises(jaxgdn.InputError, match="cache must be a jaxgdn.PrefixCache or None"):
        jaxgdn.generate(model, PROMPTS, max_new_tokens=NEW, cache=cache)


def test_generate_reads_a_generator_of_prompts(model, greedy):
    """Was: TypeError (object of type 'generator' has no len()); the engine and score took generators already."""
    out = jaxgdn.generate(model, (p for p in PROMPTS), max_new_tokens=NEW)
    assert _tokens(out) == _tokens(greedy)
    with pytest.raises(jaxgdn.InputError, match="prompts must be a list of token-id sequences; got int"):
        jaxgdn.generate(model, 5, max_new_tokens=NEW)


def test_generate_takes_jax_and_numpy_integers_where_ints_go(model):
    """Seeds as a JAX / NumPy array (a 0-d one too), stop ids as a JAX array: what the equal Python ints give. Was:
    InputError (seed must be an integer; got Array(1, ...)) and (stop_token_ids must be integer token ids)."""
    kw = dict(max_new_tokens=NEW, temperature=1.0)
    ref = jaxgdn.generate(model, PROMPTS, seed=[1, 2], **kw)
    assert _tokens(jaxgdn.generate(model, PROMPTS, seed=jnp.array([1, 2], jnp.uint32), **kw)) == _tokens(ref)
    ref0 = jaxgdn.generate(model, PROMPTS, seed=7, **kw)
    for seed in (np.array(7), jnp.array(7)):
        assert _tokens(jaxgdn.generate(model, PROMPTS, seed=seed, **kw)) == _tokens(ref0)
    stop = ref[0].tokens[1]
    by_list = jaxgdn.generate(model, PROMPTS, seed=[1, 2], stop_token_ids=[stop], **kw)
    by_jax = jaxgdn.generate(model, PROMPTS, seed=[1, 2], stop_token_ids=jnp.array([stop]), **kw)
    assert by_jax == by_list and by_jax[0].finish_reason == "stop"


@pytest.mark.parametrize("prompts", [jnp.array([1, 2, 3]), [np.int64(1), np.array(2)], np.array([4, 5])])
def test_generate_names_one_flat_sequence_of_any_kind(model, prompts):
    """Was, for a JAX array: 'prompt 0 must be a flat sequence ...; got shape ()' (it is flat: it wants wrapping)."""
    with pytest.raises(jaxgdn.InputError, match="one flat sequence of ids: wrap it in a list"):
        jaxgdn.generate(model, prompts, max_new_tokens=NEW)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=[0.5, [1.0, 2.0]]), "temperature must be one number, or one number per prompt"),
    (dict(top_p=[0.5, [1.0, 2.0]]), "top_p must be one number, or one number per prompt"),
    (dict(stop_token_ids=[3, [1, 2]]), "stop_token_ids must be integer token ids"),
    (dict(stop_token_ids=np.array(5)), "stop_token_ids must be a sequence of integer token ids"),
    (dict(stop_token_ids=jnp.array(5)), "stop_token_ids must be a sequence of integer token ids"),
    (dict(stop_token_ids=[5, -1]), r"stop_token_ids must lie in \[0, 256\); got -1"),
    (dict(temperature=jnp.array(True)), "numbers"),
    (dict(top_p=np.array(True)), "numbers"),
])
def test_generate_bad_sampling_values(model, kwargs, match):
    """Was: ValueError from NumPy (ragged), TypeError (iteration over a 0-d array), a stop-range error not naming the
    id, and a JAX bool temperature sampled as 1.0."""
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.generate(model, PROMPTS, max_new_tokens=NEW, **kwargs)


@pytest.mark.parametrize("max_new_tokens", [2**31, 10**12, MAX_ROW_TOKENS - 4])
def test_generate_refuses_rows_past_int32_positions(model, max_new_tokens):
    """Was: XLA's RESOURCE_EXHAUSTED after trying to allocate the KV cache (terabytes) — or int32 positions wrapping
    on a device that had the memory."""
    with pytest.raises(jaxgdn.CapacityError, match="max_new_tokens=.* is beyond .* tokens per row"):
        jaxgdn.generate(model, PROMPTS, max_new_tokens=max_new_tokens)


# ---- score ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sequences", [jnp.array([1, 2, 3]), (t for t in (1, 2, 3))])
def test_score_names_one_flat_sequence_of_any_kind(model, sequences):
    """Was: 'sequence 0 must be a flat sequence of integer token ids; got shape ()'."""
    with pytest.raises(jaxgdn.InputError, match="one flat sequence of ids: wrap it in a list"):
        jaxgdn.score(model, sequences)


def test_integer_options_take_zero_d_numpy_and_jax_integers(model):
    """max_new_tokens, top_k, return_top_logprobs (generate, SamplingParams), batch_size, window (score) and the
    Engine's max_batch, decode_bucket, max_length take 0-d NumPy / JAX integers as the Python ints they hold (were:
    InputError 'must be >= 1, an integer; got Array(4, dtype=int32)'); 0-d bools and floats are still refused."""
    ref = jaxgdn.generate(model, PROMPTS, max_new_tokens=NEW, temperature=1.0, top_k=5, return_top_logprobs=2)
    got = jaxgdn.generate(model, PROMPTS, max_new_tokens=jnp.array(NEW), temperature=1.0, top_k=np.array(5),
                          return_top_logprobs=jnp.array(2))
    assert list(got) == list(ref)
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    assert jaxgdn.score(model, seqs, batch_size=jnp.array(1), window=np.array(64)) == jaxgdn.score(model, seqs)
    params = SamplingParams(max_new_tokens=jnp.array(NEW), top_k=jnp.array(3))
    assert (type(params.max_new_tokens), type(params.top_k)) == (int, int)
    engine = Engine(model, max_batch=jnp.array(2), decode_bucket=np.array(NEW), max_length=jnp.array(64),
                    progress=False, use_cache=False)
    assert (engine.max_batch, engine.decode_bucket, engine.max_length) == (2, NEW, 64)
    assert engine.run([Request(p, params) for p in PROMPTS]).results == Engine(
        model, max_batch=2, decode_bucket=NEW, max_length=64, progress=False, use_cache=False).run(
        [Request(p, SamplingParams(max_new_tokens=NEW, top_k=3)) for p in PROMPTS]).results
    with pytest.raises(jaxgdn.InputError, match="max_new_tokens must be >= 1, an integer"):
        jaxgdn.generate(model, PROMPTS, max_new_tokens=jnp.array(True))
    with pytest.raises(jaxgdn.InputError, match="top_k="):
        jaxgdn.generate(model, PROMPTS, max_new_tokens=NEW, top_k=jnp.array(2.0))
    with pytest.raises(jaxgdn.InputError, match="batch_size must be an integer"):
        jaxgdn.score(model, seqs, batch_size=jnp.array([1]))


def test_score_takes_jax_and_zero_d_integer_starts(model):
    """Was: InputError ('start value 0 is Array(1, dtype=int32), not an integer'; 'got array(2)')."""
    seqs = [[1, 2, 3, 4], [5, 6, 7]]
    ref = jaxgdn.score(model, seqs, start=[1, 2])
    assert jaxgdn.score(model, seqs, start=jnp.array([1, 2])) == ref
    ref2 = jaxgdn.score(model, seqs, start=2)
    assert jaxgdn.score(model, seqs, start=np.array(2)) == ref2
    assert jaxgdn.score(model, seqs, start=jnp.array(2)) == ref2
    with pytest.raises(jaxgdn.InputError, match="start value 0 is Array"):
        jaxgdn.score(model, seqs, start=jnp.array([1.0, 2.0]))


# ---- the engine -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(use_cache=False, cache=jaxgdn.PrefixCache()), "cache= was given with use_cache=False"),
    (dict(pad_batches="no"), "pad_batches must be a bool; got str 'no'"),
    (dict(use_cache="False"), "use_cache must be a bool"),
    (dict(progress="False"), "progress must be True, False or None; got str 'False'"),  # (None: on a terminal)
])
def test_engine_options_that_would_be_misused(model, kwargs, match):
    """Was: accepted — the cache used although use_cache=False, and any truthy string taken as True."""
    with pytest.raises(jaxgdn.InputError, match=match):
        Engine(model, **kwargs)


def test_engine_flags_accept_numpy_bools(model):
    engine = Engine(model, progress=np.False_, pad_batches=np.True_, use_cache=np.False_)
    assert engine.progress is False and engine.pad_batches is True and engine.cache is None


@pytest.mark.parametrize("items, match", [
    ([Request([1, 2], SamplingParams(max_new_tokens=2, seed=[1]))], r"^request 0: .*seed=\[1\]"),
    ([[1, 2], Request([1, 2], SamplingParams(max_new_tokens=2, seed=np.array([3])))], r"^request 1: .*seed="),
    ([Conversation([[1, 2], [3]], SamplingParams(max_new_tokens=2, seed=[1]))], r"^conversation 0: .*seed=\[1\]"),
    ([Request([1, 2], SamplingParams(temperature=[0.5, [1.0]]))], r"^request 0: .*temperature"),
    (jnp.array([1, 2, 3]), "one flat sequence of ids: wrap it in a list"),
    ([Conversation(jnp.array([1, 2, 3]))], "^conversation 0: messages must be .*one flat sequence"),
])
def test_engine_bad_requests_are_named_before_anything_runs(model, items, match):
    """Was: a seed list of one passed validation, then generate raised without the request's name (after earlier
    batches had run) or, in a conversation, a TypeError from int([1]); a ragged temperature a NumPy ValueError; a
    flat JAX array 'request 0: the prompt must be a flat sequence ...; got shape ()'."""
    with pytest.raises(jaxgdn.InputError, match=match):
        Engine(model, progress=False).run(items)


def test_engine_takes_jax_integers_in_sampling_params(model):
    """A 0-d JAX seed and JAX stop ids run as the equal Python ints (the stop ids were refused: InputError)."""
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=jnp.array(9), stop_token_ids=jnp.array([255]))
    assert params.stop_token_ids == (255,) and all(type(t) is int for t in params.stop_token_ids)
    engine = Engine(model, progress=False, use_cache=False, decode_bucket=NEW)
    out = engine.run([Request(p, params) for p in PROMPTS])
    ref = engine.run([Request(p, SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=9, stop_token_ids=[255]))
                      for p in PROMPTS])
    assert out.results == ref.results


def test_cut_also_cuts_top_logprobs():
    """A result cut back to n tokens keeps n top-logprob lists (they were left at the uncut length)."""
    r = GenerationResult(tokens=[1, 2, 3], logprobs=[-1.0, -2.0, -3.0], finish_reason="stop",
                         top_logprobs=[[(1, -1.0)], [(2, -2.0)], [(3, -3.0)]])
    cut = _cut(r, 2)
    assert cut.tokens == [1, 2] and cut.top_logprobs == [[(1, -1.0)], [(2, -2.0)]] and cut.finish_reason == "length"
    assert _cut(dataclasses.replace(r, top_logprobs=None), 1).top_logprobs is None


def test_engine_takes_numpy_integer_options(model, greedy):
    """max_batch / decode_bucket / max_length as NumPy integers run as the Python ints do. Was: accepted by
    Engine(...), then an AttributeError inside run ('numpy.int64' object has no attribute 'bit_length')."""
    engine = Engine(model, max_batch=np.int64(2), decode_bucket=np.int64(NEW), max_length=np.int32(64),
                    use_cache=False, progress=False, default_params=SamplingParams(max_new_tokens=NEW))
    out = engine.run(PROMPTS)
    assert [r.tokens for r in out.results] == _tokens(greedy) and out.stats.batches == 1
    assert type(engine.max_batch) is int and type(engine.decode_bucket) is int and type(engine.max_length) is int


@pytest.mark.parametrize("temperature", [float("inf"), 1e300, [0.5, float("inf")], 8e37, 1.0001e30])
def test_generate_refuses_an_infinite_temperature(model, temperature):
    """Was: accepted; fp32 logits / inf are all 0, so top_k / top_p kept every token (temperature=inf with top_k=1
    sampled uniformly instead of greedily; 1e300 is inf in fp32). So did temperatures from ~8e37 up to float32's
    largest value (XLA's fp32 reciprocal of them flushes to zero); the bound is now 1e30."""
    with pytest.raises(jaxgdn.InputError, match=r"must be >= 0 and at most 1e\+30"):
        jaxgdn.generate(model, PROMPTS, max_new_tokens=NEW, temperature=temperature, top_k=1)
    with pytest.raises(jaxgdn.InputError, match=r"^request 0: .*must be >= 0 and at most 1e\+30"):
        Engine(model, progress=False).run([Request([1, 2], SamplingParams(temperature=np.inf))])


def test_the_largest_temperature_keeps_top_k_1_greedy(model, greedy):
    """At the largest temperature allowed, top_k=1 still samples the greedy tokens (at 8e37 and above it did not)."""
    out = jaxgdn.generate(model, PROMPTS, max_new_tokens=NEW, temperature=1e30, top_k=1, seed=1)
    assert _tokens(out) == _tokens(greedy)


def test_decode_bucket_rounding_stops_at_max_length(model, greedy, monkeypatch):
    """A batch's max_new_tokens rounded up to decode_bucket never runs more steps than max_length. Was:
    Engine(max_length=16, decode_bucket=512) ran 512 decode steps for requests of at most 5 + 4 tokens (and with
    decode_bucket=2**20, allowed, a million: a run that looked hung)."""
    import jaxgdn.engine as engine_module

    asked = []
    real = engine_module.generate
    monkeypatch.setattr(engine_module, "generate",
                        lambda *a, **kw: (asked.append(kw["max_new_tokens"]), real(*a, **kw))[1])
    engine = Engine(model, max_length=16, decode_bucket=512, use_cache=False, progress=False,
                    default_params=SamplingParams(max_new_tokens=NEW))
    out = engine.run(PROMPTS)
    assert asked == [16]  # max_length, not 512 (nor what the longest prompt leaves: few values, few compiles)
    assert [r.tokens for r in out.results] == _tokens(greedy)
    asked.clear()
    engine = Engine(model, max_length=16, decode_bucket=8, use_cache=False, progress=False,
                    default_params=SamplingParams(max_new_tokens=NEW))
    engine.run(PROMPTS)
    assert asked == [8]  # within the limit, the rounding is as before


@pytest.mark.parametrize("call", [
    lambda m: jaxgdn.generate(m, {(1, 2), (3, 4)}, max_new_tokens=NEW),
    lambda m: jaxgdn.generate(m, {(1, 2): 0}, max_new_tokens=NEW),
    lambda m: jaxgdn.score(m, frozenset({(1, 2, 3), (4, 5, 6)})),
])
def test_unordered_prompts_are_refused(model, call):
    """Results come back in prompt order, which a set or a dict does not have (a set of prompts ran, its results in
    an arbitrary order; a dict's keys were read as prompts)."""
    with pytest.raises(jaxgdn.InputError, match="ordered sequence of token-id sequences"):
        call(model)
