"""The functional prefix cache: admission rule, reproducer, fidelity, functional behaviour, invariant checks."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxgdn
from jaxgdn.cache import _Entry, _prefix_keys, checkpoint_from_state, state_from_checkpoints
from jaxgdn.state import Provenance

INTERVAL = 64


@pytest.fixture(scope="module")
def tiny():
    return jaxgdn.tiny_model("tiny", seed=3, deterministic=True)


@pytest.fixture(scope="module")
def tiny_next():
    return jaxgdn.tiny_model("tiny-next", seed=4, deterministic=True)


def _reproducer(model, deterministic: bool, seed: int = 0):
    """Request A = 100-token prompt P + 64 greedy tokens; B = P + A's first 40 tokens + 10 new tokens.

    Returns (A's generations, B cold, B warm) — warm uses the cache A left behind."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.config.vocab_size, 100).tolist()
    cache = jaxgdn.PrefixCache(interval=INTERVAL, deterministic=deterministic)
    a = jaxgdn.generate(model, [prompt], max_new_tokens=64, cache=cache)
    b_prompt = prompt + a[0].tokens[:40] + rng.integers(0, model.config.vocab_size, 10).tolist()
    cold = jaxgdn.generate(model, [b_prompt], max_new_tokens=24, cache=cache)
    warm = jaxgdn.generate(model, [b_prompt], max_new_tokens=24, cache=a.cache)
    return a, cold, warm


@pytest.mark.parametrize("name", ["tiny", "tiny_next"])
def test_reproducer_deterministic_warm_equals_cold(name, request):
    model = request.getfixturevalue(name)
    a, cold, warm = _reproducer(model, deterministic=True)
    assert warm[0].cached_tokens == 64 and cold[0].cached_tokens == 0  # the warm run really used the cache
    assert warm[0].tokens == cold[0].tokens
    assert np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs))  # bitwise
    jaxgdn.check_cache(warm.cache, model, recompute=True)


# The decode/prefill state gap is ~1e-8 here, so in a given request it may round away in every logprob; the
# negative controls below try a few requests (seeds) and need the difference to show in at least one.
CONTROL_SEEDS = range(4)


def test_reproducer_nondeterministic_shows_the_difference(tiny):
    differs = []
    for seed in CONTROL_SEEDS:
        a, cold, warm = _reproducer(tiny, deterministic=False, seed=seed)
        # The decode checkpoint at 128 (inside A's generated text) is reused ...
        assert warm[0].cached_tokens == 128
        assert any(ck.provenance == Provenance.DECODE for ck in a.cache.checkpoints())
        # ... and B's logprobs now depend on what ran before it: not bitwise equal to the cold run.
        differs.append(not np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs)))
    assert any(differs), differs


def test_letting_decode_writes_through_breaks_determinism(tiny):
    """A 'deterministic' cache that holds decode-produced entries fails the reproducer and check_cache."""
    differs = []
    for seed in CONTROL_SEEDS:
        a, cold, _ = _reproducer(tiny, deterministic=False, seed=seed)
        leaky = dataclasses.replace(a.cache, deterministic=True)  # decode entries planted past the admission rule
        rng = np.random.default_rng(seed)
        prompt = rng.integers(0, tiny.config.vocab_size, 100).tolist()
        b_prompt = prompt + a[0].tokens[:40] + rng.integers(0, tiny.config.vocab_size, 10).tolist()
        warm = jaxgdn.generate(tiny, [b_prompt], max_new_tokens=24, cache=leaky)
        assert warm[0].cached_tokens == 128
        differs.append(not np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs)))
        with pytest.raises(AssertionError, match="not prefill-produced"):
            jaxgdn.check_cache(leaky, tiny)
    assert any(differs), differs


def _prefill(model, tokens, capacity=256, state=None, stride=None):
    tokens = jnp.asarray([tokens], jnp.int32)
    state = model.init_state(1, capacity) if state is None else state
    return jax.jit(jaxgdn.prefill_chunk, static_argnames="checkpoint_stride")(
        model, state, tokens, jnp.asarray([tokens.shape[1]], jnp.int32), checkpoint_stride=stride)


def test_in_call_checkpoints_equal_separate_prefills(tiny):
    rng = np.random.default_rng(5)
    toks = rng.integers(0, tiny.config.vocab_size, 200).tolist()
    state0 = tiny.init_state(1, 256)
    state, _, ckpts = _prefill(tiny, toks, stride=INTERVAL)
    found = jaxgdn.cache.checkpoints_from_prefill(ckpts, state.provenance, [toks], state, INTERVAL)
    assert [c.position for c in found] == [64, 128, 192]
    for ck in found:
        sep, _ = _prefill(tiny, toks[:ck.position], state=state0)
        ref = checkpoint_from_state(sep, 0, toks[:ck.position])
        chex.assert_trees_all_equal((ck.gdn, ck.kv), (ref.gdn, ref.kv))  # bitwise


def test_fresh_state_is_exactly_zero(tiny):
    state = tiny.init_state(2, 64)
    for leaf in jax.tree.leaves(state):
        assert not np.any(np.asarray(leaf))


def test_admission_rule_and_predicate(tiny):
    toks = list(range(1, 65))
    state, _ = _prefill(tiny, toks, capacity=128)
    good = checkpoint_from_state(state, 0, toks)
    decoded, _ = tiny.decode_step(state, jnp.array([7], jnp.int32))
    # make a decode-touched state sit on the grid: prefill 63, decode 1
    s63, _ = _prefill(tiny, toks[:63], capacity=128)
    s64, _ = tiny.decode_step(s63, jnp.array([toks[63]], jnp.int32))
    bad = checkpoint_from_state(s64, 0, toks)
    det = jaxgdn.PrefixCache(interval=INTERVAL, deterministic=True)
    assert det.accepts(good) and not det.accepts(bad)
    with pytest.raises(jaxgdn.CheckpointRefused, match="only prefill-produced"):
        det.insert(bad)
    skipped = det.insert(bad, skip_refused=True)
    assert len(skipped) == 0 and skipped.stats().refused_writes == 1
    nondet = jaxgdn.PrefixCache(interval=INTERVAL, deterministic=False)
    assert nondet.accepts(bad) and len(nondet.insert(bad)) == 1
    off_grid = checkpoint_from_state(decoded, 0, toks + [7])
    with pytest.raises(jaxgdn.CheckpointRefused, match="not on the cache grid"):
        nondet.insert(off_grid)
    with pytest.raises(jaxgdn.InputError, match="multiple of 64"):  # a ValueError too
        jaxgdn.PrefixCache(interval=100)
    with pytest.raises(jaxgdn.InputError, match="max_bytes"):
        jaxgdn.PrefixCache(interval=INTERVAL, max_bytes=-1)
    with pytest.raises(jaxgdn.InputError, match="batch_size and capacity must be >= 1"):
        tiny.init_state(2, 0)
    for bad in [(2.5, 64), (True, 64), (2, "64")]:
        with pytest.raises(jaxgdn.InputError, match="batch_size and capacity must be integers"):
            tiny.init_state(*bad)


def test_insert_is_functional_and_lookup_longest_prefix(tiny):
    rng = np.random.default_rng(6)
    toks = rng.integers(0, tiny.config.vocab_size, 192).tolist()
    state, _, ckpts = _prefill(tiny, toks, stride=INTERVAL)
    found = jaxgdn.cache.checkpoints_from_prefill(ckpts, state.provenance, [toks], state, INTERVAL)
    empty = jaxgdn.PrefixCache(interval=INTERVAL)
    one = empty.insert(found[0])
    full = one.insert(found[1:])
    assert (len(empty), len(one), len(full)) == (0, 1, 3)  # the old caches are unchanged
    assert empty.stats().bytes == 0 and one.stats().bytes == found[0].nbytes
    # longest cached prefix of at most len - 1 tokens: a 192-token prompt hits 128, a 193-token one hits 192
    hits, after = full.lookup([toks, toks + [1], toks[:64], toks[:10] + [999 % 256] * 60, [5] * 70])
    assert [h.position if h else None for h in hits] == [128, 192, None, None, None]
    assert after.stats().hits == 2 and after.stats().misses == 3 and after.stats().hit_tokens == 320
    assert full.stats().hits == 0  # lookup returned a new cache
    # a restored state continues exactly like the original prefill
    restored = state_from_checkpoints(tiny.init_state(2, 256), [hits[0], None])
    assert np.asarray(restored.position).tolist() == [128, 0]
    s_full, logits_full = _prefill(tiny, toks)
    s_cont, logits_cont = jax.jit(jaxgdn.prefill_chunk)(
        tiny, restored, jnp.asarray([toks[128:], toks[128:]], jnp.int32), jnp.asarray([64, 64], jnp.int32))
    assert np.array_equal(np.asarray(logits_cont[0]), np.asarray(logits_full[0, 128:]))
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x[0], jaxgdn.model.gdn_states(s_cont)),
                                jax.tree.map(lambda x: x[0], jaxgdn.model.gdn_states(s_full)))


def test_lru_eviction_whole_entries(tiny):
    rng = np.random.default_rng(7)
    seqs = [rng.integers(0, tiny.config.vocab_size, 64).tolist() for _ in range(3)]
    cks = [checkpoint_from_state(_prefill(tiny, s, capacity=64)[0], 0, s) for s in seqs]
    size = cks[0].nbytes
    cache = jaxgdn.PrefixCache(interval=INTERVAL, max_bytes=2 * size)
    cache = cache.insert(cks[0]).insert(cks[1])
    _, cache = cache.lookup([seqs[0] + [1]])  # touch entry 0: entry 1 is now least recent
    cache = cache.insert(cks[2])
    assert cache.stats().evictions == 1 and cache.stats().entries == 2 and cache.stats().bytes == 2 * size
    hits, _ = cache.lookup([s + [1] for s in seqs])
    assert [h is not None for h in hits] == [True, False, True]
    too_small = jaxgdn.PrefixCache(interval=INTERVAL, max_bytes=size - 1)
    assert len(too_small.insert(cks[0], skip_refused=True)) == 0


def _plant(cache, ck):
    key = _prefix_keys(ck.tokens, cache.interval, ck.position)[-1][1] if ck.position >= cache.interval else b"x"
    return dataclasses.replace(cache, _entries={**cache._entries, key: _Entry(ck, 0)})


def test_check_cache_catches_planted_entries(tiny):
    toks = list(range(3, 67))
    state, _ = _prefill(tiny, toks, capacity=128)
    good = checkpoint_from_state(state, 0, toks)
    cache = jaxgdn.PrefixCache(interval=INTERVAL).insert(good)
    jaxgdn.check_cache(cache, tiny, recompute=True)
    decode_made = dataclasses.replace(good, provenance=int(Provenance.DECODE))
    with pytest.raises(AssertionError, match="not prefill-produced"):
        jaxgdn.check_cache(_plant(jaxgdn.PrefixCache(interval=INTERVAL), decode_made), tiny)
    s65, _ = tiny.decode_step(state, jnp.array([1], jnp.int32))
    off = checkpoint_from_state(s65, 0, toks + [1])
    with pytest.raises(AssertionError, match="off the grid"):
        jaxgdn.check_cache(_plant(jaxgdn.PrefixCache(interval=INTERVAL, deterministic=False), off), tiny)
    gdn = list(good.gdn)
    gdn[1] = gdn[1]._replace(recurrent=gdn[1].recurrent.at[0, 0, 0].set(jnp.nan))
    with pytest.raises(AssertionError, match="not finite"):
        jaxgdn.check_cache(_plant(jaxgdn.PrefixCache(interval=INTERVAL), dataclasses.replace(good, gdn=tuple(gdn))),
                           tiny)
    tampered = list(good.gdn)
    tampered[0] = tampered[0]._replace(recurrent=tampered[0].recurrent * (1 + 1e-6))
    planted = _plant(jaxgdn.PrefixCache(interval=INTERVAL), dataclasses.replace(good, gdn=tuple(tampered)))
    jaxgdn.check_cache(planted, tiny)  # structurally fine ...
    with pytest.raises(AssertionError, match="differs from a fresh prefill"):
        jaxgdn.check_cache(planted, tiny, recompute=True)  # ... but not what a prefill computes


def test_batched_lookup_and_generation(tiny):
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, tiny.config.vocab_size, n).tolist() for n in (70, 130, 5)]
    cache = jaxgdn.PrefixCache(interval=INTERVAL)
    first = jaxgdn.generate(tiny, prompts, max_new_tokens=8, cache=cache)
    assert sorted(c.position for c in first.cache.checkpoints()) == [64, 64, 128]
    again = jaxgdn.generate(tiny, prompts, max_new_tokens=8, cache=first.cache)
    assert [r.cached_tokens for r in again] == [64, 128, 0]
    for r1, r2 in zip(first, again):
        assert r1.tokens == r2.tokens and np.array_equal(np.array(r1.logprobs), np.array(r2.logprobs))


def test_checkpoints_of_a_sequence_share_their_key_value_blocks(tiny):
    """The checkpoints of one prompt hold its keys and values once (blocks between consecutive checkpoints, the same
    arrays in every checkpoint that reaches them), and so do those of a later request restored from one of them, and
    the decode checkpoints after a prompt's; the cache counts every block once and evicting an entry frees only what
    no other entry holds; each checkpoint's keys and values are still a prefill's, and a request restored from a
    checkpoint of several blocks computes what it computes cold."""
    rng = np.random.default_rng(21)
    prompt = rng.integers(0, tiny.config.vocab_size, 318).tolist()
    first = jaxgdn.generate(tiny, [prompt], max_new_tokens=4, cache=jaxgdn.PrefixCache(interval=INTERVAL))
    cks = sorted(first.cache.checkpoints(), key=lambda c: c.position)
    assert [c.position for c in cks] == [64, 128, 192, 256]
    for k, ck in enumerate(cks):
        assert len(ck.kv_blocks) == k + 1 and all(b is cks[-1].kv_blocks[j] for j, b in enumerate(ck.kv_blocks))
    gdn_bytes = [sum(x.nbytes for x in jax.tree.leaves(c.gdn)) for c in cks]
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves(cks[-1].kv))  # 256 rows of every attention layer
    assert first.cache.nbytes == sum(gdn_bytes) + kv_bytes < sum(c.nbytes for c in cks)
    jaxgdn.check_cache(first.cache, tiny)
    state, _ = _prefill(tiny, prompt, capacity=320)  # each one's keys and values, concatenated: a prefill's
    attn = [s for s in state.layers if isinstance(s, jaxgdn.state.AttentionLayerState)]
    for ck in cks:
        chex.assert_trees_all_equal(ck.kv, tuple(jax.tree.map(lambda x: x[0, :ck.position], s) for s in attn))

    # evicting the oldest entry (64) frees its GDN states only: its block is the others' first
    full = first.cache.nbytes
    squeezed = jaxgdn.PrefixCache(interval=INTERVAL, max_bytes=full - 1).insert(cks)
    assert [c.position for c in squeezed.checkpoints()] == [128, 192, 256]
    assert squeezed.nbytes == full - gdn_bytes[0] and squeezed.stats().evictions == 1

    # a longer request restored at 256 shares the restored checkpoint's blocks, and computes what a cold one does
    longer = prompt + first[0].tokens + rng.integers(0, tiny.config.vocab_size, 70).tolist()
    warm = jaxgdn.generate(tiny, [longer], max_new_tokens=4, cache=first.cache)
    cold = jaxgdn.generate(tiny, [longer], max_new_tokens=4)
    assert warm[0].cached_tokens == 256 and warm[0].tokens == cold[0].tokens
    assert np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs))
    new = sorted((c for c in warm.cache.checkpoints() if c.position > 256), key=lambda c: c.position)
    assert [(c.position, len(c.kv_blocks)) for c in new] == [(320, 5), (384, 6)]
    assert all(a is b for c in new for a, b in zip(c.kv_blocks, cks[-1].kv_blocks + new[0].kv_blocks[4:]))
    jaxgdn.check_cache(warm.cache, tiny)
    state, _ = _prefill(tiny, longer[:384], capacity=384)  # the blocks after the restored one: the right rows
    attn = [s for s in state.layers if isinstance(s, jaxgdn.state.AttentionLayerState)]
    for ck in new:
        chex.assert_trees_all_equal(ck.kv, tuple(jax.tree.map(lambda x: x[0, :ck.position], s) for s in attn))
    _, _, found = _prefill(tiny, longer[:128], stride=INTERVAL)
    with pytest.raises(jaxgdn.InputError, match="bases\\[0\\] is a checkpoint of another sequence"):
        jaxgdn.cache.checkpoints_from_prefill(found, state.provenance, [longer[1:]], state, INTERVAL, bases=[cks[0]])

    # decode checkpoints (in a cache that admits them) share the blocks of the row's last prefill checkpoint
    loose = jaxgdn.generate(tiny, [prompt], max_new_tokens=4,
                            cache=jaxgdn.PrefixCache(interval=INTERVAL, deterministic=False)).cache
    [decoded] = [c for c in loose.checkpoints() if c.provenance == Provenance.DECODE]
    [base] = [c for c in loose.checkpoints() if c.position == 256]
    assert decoded.position == 320 and len(decoded.kv_blocks) == 5
    assert all(a is b for a, b in zip(decoded.kv_blocks, base.kv_blocks))
    # its last block holds rows 256..320 (318 prompt tokens, then 2 decoded): a prefill's within decode's own gap
    state, _ = _prefill(tiny, list(decoded.tokens), capacity=320)
    attn = [s for s in state.layers if isinstance(s, jaxgdn.state.AttentionLayerState)]
    for mine, s in zip(decoded.kv_blocks[-1], attn):
        np.testing.assert_allclose(np.asarray(mine.keys), np.asarray(s.keys[0, 256:320]), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(mine.values), np.asarray(s.values[0, 256:320]), rtol=1e-4, atol=1e-5)


def test_a_deterministic_cache_holds_a_prefix_computed_twice_once(tiny):
    """Two requests of one batch that share a prefix compute its keys and values apart; a deterministic cache (every
    entry a fresh prefill's bits) keeps the first's blocks and gives them to the second's later checkpoints (here
    replay-decode checkpoints past a held one), which still equal a prefill of their tokens bit for bit."""
    replay = tiny.with_decode_mode("replay")
    shared = np.random.default_rng(23).integers(0, tiny.config.vocab_size, 189).tolist()
    out = jaxgdn.generate(replay, [shared + [1], shared + [2]], max_new_tokens=4,
                          cache=jaxgdn.PrefixCache(interval=INTERVAL))
    cks = sorted(out.cache.checkpoints(), key=lambda c: c.position)
    assert [c.position for c in cks] == [64, 128, 192, 192]  # (each row's 64 and 128 are one entry)
    held, decoded = cks[1], cks[2:]
    assert decoded[0].tokens[189] != decoded[1].tokens[189]
    for ck in decoded:
        assert len(ck.kv_blocks) == 3 and all(a is b for a, b in zip(ck.kv_blocks, held.kv_blocks))
        state, _ = _prefill(replay, list(ck.tokens), capacity=192)
        attn = [s for s in state.layers if isinstance(s, jaxgdn.state.AttentionLayerState)]
        chex.assert_trees_all_equal(ck.kv, tuple(jax.tree.map(lambda x: x[0, :192], s) for s in attn))
    assert decoded[0].kv_blocks[2] is not decoded[1].kv_blocks[2]
    assert out.cache.nbytes == _distinct_bytes(cks)


# ---- property-based: random insert / lookup / evict sequences -----------------------------------------------

@pytest.fixture(scope="module")
def pool(tiny):
    """Checkpoints of a few random sequences at 64 and 128 (two share their first 64 tokens)."""
    rng = np.random.default_rng(9)
    base = rng.integers(0, tiny.config.vocab_size, 128).tolist()
    other = base[:64] + rng.integers(0, tiny.config.vocab_size, 64).tolist()
    third = rng.integers(0, tiny.config.vocab_size, 128).tolist()
    out = []
    for s in (base, other, third):
        state, _, ck = _prefill(tiny, s, stride=INTERVAL)
        out += jaxgdn.cache.checkpoints_from_prefill(ck, state.provenance, [s], state, INTERVAL)
    return out, [base, other, third]


def _distinct_bytes(checkpoints) -> int:
    """The bytes of the distinct arrays the checkpoints hold (an array shared by several counted once)."""
    return sum({id(x): x.nbytes for c in checkpoints for x in jax.tree.leaves((c.gdn, c.kv_blocks))}.values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "lookup"]), st.integers(0, 5), st.integers(0, 2),
                              st.integers(0, 70)), max_size=25),
       budget_entries=st.one_of(st.none(), st.integers(1, 4)))
def test_cache_properties(pool, ops, budget_entries):
    checkpoints, seqs = pool
    size = checkpoints[0].nbytes
    cache = jaxgdn.PrefixCache(interval=INTERVAL, max_bytes=None if budget_entries is None else budget_entries * size)
    inserted = set()
    for op, ci, si, extra in ops:
        if op == "insert":
            ck = checkpoints[ci]
            before = (len(cache), cache.nbytes)
            cache = cache.insert(ck, skip_refused=True)  # a checkpoint larger than the budget is refused
            inserted.add(ck.tokens)
            fits = cache.max_bytes is None or ck.nbytes <= cache.max_bytes
            assert (len(cache) >= 1) if fits else (len(cache), cache.nbytes) == before
        else:
            query = seqs[si][: max(1, 64 + extra)] + [1]
            [hit], cache = cache.lookup([query])
            if hit is not None:
                assert hit.tokens in inserted  # never a state for a prefix that was not inserted
                assert tuple(query[:hit.position]) == hit.tokens and hit.position <= len(query) - 1
        stats = cache.stats()
        assert stats.bytes == _distinct_bytes(cache.checkpoints())  # byte accounting matches the entries
        assert stats.entries == len(cache.checkpoints())
        if cache.max_bytes is not None:
            assert stats.bytes <= cache.max_bytes


def test_a_cache_holds_one_kind_of_state(tiny):
    """A cache filled by the chunked GDN prefill refuses a model whose prefill is token by token (its states would
    restore silently, with other bits); an empty cache takes either; check_cache names the mismatch."""
    prompt = np.random.default_rng(9).integers(0, tiny.config.vocab_size, 70).tolist()
    filled = jaxgdn.generate(tiny, [prompt], max_new_tokens=4, cache=jaxgdn.PrefixCache(interval=INTERVAL)).cache
    assert len(filled) and filled.numerics == jaxgdn.cache.numerics_key(tiny)
    scan = tiny.with_gdn_prefill("recurrent")
    with pytest.raises(jaxgdn.cache.CheckpointRefused, match="gdn_prefill=chunked"):
        jaxgdn.generate(scan, [prompt], max_new_tokens=4, cache=filled)
    with pytest.raises(AssertionError, match="other numerics"):
        jaxgdn.check_cache(filled, scan)
    fresh = jaxgdn.generate(scan, [prompt], max_new_tokens=4, cache=jaxgdn.PrefixCache(interval=INTERVAL))
    assert fresh.cache.numerics == jaxgdn.cache.numerics_key(scan) and len(fresh.cache)
    # the activation dtype and the kernel backend decide the bits too: a bf16 or interpret-mode model is refused
    # before anything is computed
    for other in (dataclasses.replace(tiny, dtype=jnp.bfloat16), tiny.with_backend("interpret")):
        with pytest.raises(jaxgdn.cache.CheckpointRefused, match="dtype=float32, backend=reference, qkv_groups=1, "
                           r"mesh=none, tag=\d+; the model using it has .*(dtype=bfloat16|backend=interpret)"):
            jaxgdn.generate(other, [prompt], max_new_tokens=4, cache=filled)


def test_checkpoints_carry_their_models_numerics(tiny):
    """A checkpoint records the numerics of the model that computed it (`generate`'s own, or `model=` by hand): a
    cache refuses one made with other numerics than its states' (`skip_refused` counts it), takes one of unknown
    numerics, binds itself to the first known one when unbound, and `check_cache` names an entry planted with other
    numerics."""
    prompt = np.random.default_rng(10).integers(0, tiny.config.vocab_size, 70).tolist()
    filled = jaxgdn.generate(tiny, [prompt], max_new_tokens=4, cache=jaxgdn.PrefixCache(interval=INTERVAL)).cache
    key = jaxgdn.cache.numerics_key(tiny)
    assert len(filled) and all(ck.numerics == key for ck in filled.checkpoints())
    toks = list(range(1, 65))
    state, _ = _prefill(tiny, toks, capacity=128)
    scan = tiny.with_gdn_prefill("recurrent")
    other = checkpoint_from_state(_prefill(scan, toks, capacity=128)[0], 0, toks, model=scan)  # token by token
    assert other.numerics == jaxgdn.cache.numerics_key(scan) != key and other.origin == scan.numerics_tag
    with pytest.raises(jaxgdn.InputError, match="row 0 was computed by another model than `model`"):
        checkpoint_from_state(state, 0, toks, model=scan)  # a tiny state labelled as the token-by-token model's
    # made without the model, a checkpoint still carries its state's origin, which a cache of another tag refuses
    unlabelled = checkpoint_from_state(_prefill(scan, toks, capacity=128)[0], 0, toks)
    assert unlabelled.numerics is None and unlabelled.origin == scan.numerics_tag
    with pytest.raises(jaxgdn.CheckpointRefused, match=f"numerics_tag {scan.numerics_tag}; this cache holds states "
                       f"of numerics_tag {tiny.numerics_tag}"):
        filled.insert(unlabelled)
    with pytest.raises(jaxgdn.CheckpointRefused, match="computed by a model with .*gdn_prefill=recurrent"):
        filled.insert(other)
    skipped = filled.insert(other, skip_refused=True)
    assert len(skipped) == len(filled) and skipped.stats().refused_writes == filled.stats().refused_writes + 1
    unknown = checkpoint_from_state(state, 0, toks)
    assert unknown.numerics is None and len(filled.insert(unknown)) == len(filled) + 1
    bound = jaxgdn.PrefixCache(interval=INTERVAL).insert(other)
    assert bound.numerics == other.numerics and jaxgdn.PrefixCache(interval=INTERVAL).insert(unknown).numerics is None
    with pytest.raises(jaxgdn.CheckpointRefused, match="gdn_prefill=recurrent"):
        jaxgdn.generate(tiny, [prompt], max_new_tokens=4, cache=bound)
    jaxgdn.check_cache(jaxgdn.PrefixCache(interval=INTERVAL).insert(checkpoint_from_state(state, 0, toks, model=tiny)),
                       tiny, recompute=True)
    with pytest.raises(AssertionError, match="other numerics than the cache's"):
        jaxgdn.check_cache(_plant(jaxgdn.PrefixCache(interval=INTERVAL, numerics=key), other), tiny)


def test_the_numerics_key_names_the_layout_and_restoring_checks_the_checkpoint(tiny):
    """A model in another q/k/v channel layout (what a tensor-parallel split uses: its conv states' channels are
    ordered otherwise) is refused a cache of the Hugging Face layout's states; `state_from_checkpoints` names a
    checkpoint too long for the state (CapacityError) and one carrying replay buffers the state's model does not
    keep (InputError), instead of NumPy / attribute errors."""
    prompt = np.random.default_rng(9).integers(0, tiny.config.vocab_size, 70).tolist()
    filled = jaxgdn.generate(tiny, [prompt], max_new_tokens=4, cache=jaxgdn.PrefixCache(interval=INTERVAL)).cache
    grouped = jaxgdn.sharding.with_layout(tiny, 2)
    assert "qkv_groups=2, mesh=none" in jaxgdn.cache.numerics_key(grouped)
    with pytest.raises(jaxgdn.CheckpointRefused, match="qkv_groups=2"):
        jaxgdn.generate(grouped, [prompt], max_new_tokens=4, cache=filled)
    [ck] = filled.checkpoints()
    longer = dataclasses.replace(ck, tokens=ck.tokens * 2)  # 128 tokens (only its length is read before refusing)
    with pytest.raises(jaxgdn.CapacityError, match="checkpoint of 128 tokens exceeds the state's capacity 64"):
        state_from_checkpoints(tiny.init_state(1, 64), [longer])
    replay = tiny.with_decode_mode("replay")
    state, _ = _prefill(replay, prompt, capacity=128)
    off_grid = checkpoint_from_state(state, 0, prompt)  # position 70: the open chunk's buffers kept
    with pytest.raises(jaxgdn.InputError, match="open_qkv.*restore it into a state of a replay-mode model"):
        state_from_checkpoints(tiny.init_state(1, 128), [off_grid])
    with pytest.raises(jaxgdn.InputError, match="2 checkpoints for a state of 1 rows"):
        state_from_checkpoints(tiny.init_state(1, 128), [ck, ck])


@pytest.mark.parametrize("per_call", [None, 2])
def test_state_from_checkpoints_writes_each_row_what_its_checkpoint_holds(tiny, per_call, monkeypatch):
    """`state_from_checkpoints` on a template of random values (not zeros, so a row or a tail it must keep shows):
    rows restored from one checkpoint, from two checkpoints of one sequence sharing key/value blocks, from a
    checkpoint whose blocks are one array at two offsets, and a row left alone; bitwise what a row-by-row NumPy
    construction gives. The template is left as it was (its arrays are written in a copy). per_call: the parts one
    jitted write takes (None: all five key/value parts of a leaf in one call, padded to eight; 2: over three calls)."""
    if per_call is not None:
        monkeypatch.setattr(jaxgdn.cache, "_PARTS_PER_CALL", per_call)
    rng = np.random.default_rng(11)
    template = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x, tiny.init_state(5, 256))
    before = jax.tree.map(np.array, template)
    layers = template.layers
    gdn_ids = [i for i, s in enumerate(layers) if isinstance(s, jaxgdn.GDNLayerState)]
    attn_ids = [i for i, s in enumerate(layers) if isinstance(s, jaxgdn.AttentionLayerState)]

    def rand(shape, dtype):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    def gdn():
        return tuple(jaxgdn.GDNLayerState(conv=rand(layers[i].conv.shape[1:], layers[i].conv.dtype),
                                          recurrent=rand(layers[i].recurrent.shape[1:], jnp.float32))
                     for i in gdn_ids)

    def block(n):
        return tuple(jaxgdn.AttentionLayerState(*(rand((n,) + getattr(layers[i], f).shape[2:],
                                                       getattr(layers[i], f).dtype) for f in ("keys", "values")))
                     for i in attn_ids)

    toks = rng.integers(0, tiny.config.vocab_size, 192).tolist()
    long = jaxgdn.Checkpoint(tuple(toks), Provenance.PREFILL, gdn(), kv_blocks=(block(64), block(64), block(64)))
    short = jaxgdn.Checkpoint(tuple(toks[:128]), Provenance.PREFILL, gdn(), kv_blocks=long.kv_blocks[:2])
    same = block(64)
    twice = jaxgdn.Checkpoint(tuple(toks[:128]), Provenance.PREFILL, gdn(), kv_blocks=(same, same))
    hits = [long, None, short, long, twice]
    restored = state_from_checkpoints(template, hits)

    want = jax.tree.map(np.array, template)
    for b, ck in enumerate(hits):
        if ck is None:
            continue
        for i, g in zip(gdn_ids, ck.gdn):
            want.layers[i].conv[b] = np.asarray(g.conv)
            want.layers[i].recurrent[b] = np.asarray(g.recurrent)
        for i, kv in zip(attn_ids, ck.kv):
            want.layers[i].keys[b, :ck.position] = np.asarray(kv.keys)
            want.layers[i].values[b, :ck.position] = np.asarray(kv.values)
    chex.assert_trees_all_equal(restored.layers, want.layers)
    assert np.asarray(restored.position).tolist() == [192, 0, 128, 192, 128]
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, template), before)  # the template as it was


def test_requests_of_one_prompt_are_prefilled_once(tiny, monkeypatch):
    """k samples of one prompt in a batch (RL rollouts): `generate` prefills the prompt once and copies the row, so
    each request's tokens and logprobs are bitwise those of the request alone (deterministic model), and the decode
    checkpoints of the prompt's requests share its key/value blocks (one prefill computed them), in a cache that
    admits decode checkpoints."""
    import sys

    module = sys.modules["jaxgdn.generate"]
    rows = []
    prefill = module._prefill_core
    monkeypatch.setattr(module, "_prefill_core", lambda m, s, tokens, *a, **k: (rows.append(tokens.shape[0]),
                                                                                   prefill(m, s, tokens, *a, **k))[1])
    rng = np.random.default_rng(21)
    p, q = (rng.integers(0, tiny.config.vocab_size, n).tolist() for n in (100, 70))
    kw = dict(max_new_tokens=40, temperature=0.9)
    cache = jaxgdn.PrefixCache(interval=INTERVAL, deterministic=False)  # (it takes decode checkpoints)
    out = jaxgdn.generate(tiny, [p, q, p, p], seed=[0, 1, 2, 3], cache=cache, **kw)
    assert rows == [2]  # p once, q once
    for b, (prompt, seed) in enumerate([(p, 0), (q, 1), (p, 2), (p, 3)]):
        alone = jaxgdn.generate(tiny, [prompt], seed=seed, **kw)[0]
        assert out[b].tokens == alone.tokens and np.array_equal(out[b].logprobs, alone.logprobs), b
    assert len({tuple(out[b].tokens) for b in (0, 2, 3)}) == 3  # three different samples of p
    decoded = [ck for ck in out.cache.checkpoints() if ck.position == 128 and ck.tokens[:100] == tuple(p)]
    assert len(decoded) == 3 and all(ck.kv_blocks[0] is decoded[0].kv_blocks[0] for ck in decoded)
    # three distinct prompts among six requests: a prefill of four rows (one an unused copy), the same results
    r = rng.integers(0, tiny.config.vocab_size, 90).tolist()
    batch = [(p, 4), (q, 5), (p, 6), (r, 7), (p, 8), (q, 9)]
    rows.clear()
    six = jaxgdn.generate(tiny, [b for b, _ in batch], seed=[s for _, s in batch], cache=cache, **kw)
    assert rows == [4]
    for b, (prompt, seed) in enumerate(batch):
        alone = jaxgdn.generate(tiny, [prompt], seed=seed, **kw)[0]
        assert six[b].tokens == alone.tokens and np.array_equal(six[b].logprobs, alone.logprobs), b
    assert any(ck.tokens == tuple(r[:64]) for ck in six.cache.checkpoints())  # r's prefill checkpoint, once
    # the prefill's rows: exactly the requests when every prompt is distinct, else the distinct ones padded to a
    # power of two (at most the batch), so that an engine's padded batches compile for a few row counts
    pad = module._prefill_rows
    assert pad([0, 1, 2, 3, 4], 5) == [0, 1, 2, 3, 4] and pad([0, 1, 2], 8) == [0, 1, 2, 0]
    assert pad([0, 2], 4) == [0, 2] and pad([3], 8) == [3] and pad([0, 1, 5], 6) == [0, 1, 5, 0]
    assert pad([0, 1, 2, 3, 4], 6) == [0, 1, 2, 3, 4, 0]  # (a power of two past the batch: the batch)
