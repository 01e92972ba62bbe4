"""The prefix cache's inputs: what `PrefixCache`, `lookup`, `insert`, `accepts`, `checkpoint_from_state`,
`state_from_checkpoints` and `check_cache` do with malformed arguments and tampered entries. One prefill (a module
fixture) builds every checkpoint; nothing else compiles."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
import jaxgdn.init
from jaxgdn.cache import (
    Checkpoint,
    PrefixCache,
    _Entry,
    _prefix_keys,
    checkpoint_from_state,
    checkpoints_from_prefill,
    numerics_key,
    state_from_checkpoints,
)
from jaxgdn.params import weights_digest
from jaxgdn.state import Provenance

INTERVAL = 64


@pytest.fixture(scope="module")
def setup():
    """(model, tokens, prefill state, checkpoints at 64 / 128 / 192) of one 192-token prompt."""
    model = jaxgdn.tiny_model("tiny", seed=3, deterministic=True)
    toks = np.random.default_rng(0).integers(0, model.config.vocab_size, 192).tolist()
    state, _, found = jax.jit(jaxgdn.prefill_chunk, static_argnames="checkpoint_stride")(
        model, model.init_state(1, 256), jnp.asarray([toks], jnp.int32), jnp.asarray([192], jnp.int32),
        checkpoint_stride=INTERVAL)
    cks = checkpoints_from_prefill(found, state.provenance, [toks], state, INTERVAL, numerics_key(model))
    assert [c.position for c in cks] == [64, 128, 192]
    return model, toks, state, cks


@pytest.fixture(scope="module")
def full(setup):
    return PrefixCache(interval=INTERVAL).insert(setup[3])


def _positions(hits):
    return [h.position if h is not None else None for h in hits]


# ---- lookup ------------------------------------------------------------------------------------------------

def test_lookup_takes_any_flat_integer_sequence(setup, full):
    _, toks, _, _ = setup
    forms = [toks, tuple(toks), np.array(toks), np.array(toks, np.int32), jnp.asarray(toks),
             [np.int64(t) for t in toks]]
    hits, after = full.lookup(forms)
    assert _positions(hits) == [128] * len(forms)  # strictly shorter than the prompt: 128, not 192
    assert _positions(full.lookup(np.array([toks, toks[::-1]]))[0]) == [128, None]  # a 2-D array: one prompt a row
    assert after.stats().hits == len(forms) and full.stats().hits == 0


@pytest.mark.parametrize("prompt, match", [
    ("floats", "must hold integer token ids; got float64"),  # used to be truncated and hit toks' prefix
    ("float_array", "must hold integer token ids; got float64"),  # ... also as an array of integral floats
    ("bools", "must hold integer token ids; got bool"),  # used to count as token 1 / 0
    ("negative", r"outside \[0, 2\*\*63\): min -1"),  # used to be looked up
    ("huge", "must hold integer token ids; got object"),  # used to raise OverflowError
    ("empty", "prompt 0 is empty"),  # used to count a miss
    ("string", "must be a flat sequence of integer token ids; got a string"),  # used to raise a bare ValueError
    ("bool_among_ints", "must hold integer token ids; got a bool"),  # [1, True] is int64: it was looked up
    ("nested", r"got shape \(1, 192\)"),  # used to miss silently (one "token" of 192 ids)
    ("ragged", "must be a flat sequence of integer token ids"),
])
def test_lookup_refuses_malformed_prompts(setup, full, prompt, match):
    _, toks, _, _ = setup
    bad = {"floats": [t + 0.25 for t in toks], "float_array": np.array(toks, np.float64), "bools": [True] * 100,
           "negative": [-1] * 100, "huge": [2 ** 70] * 100, "bool_among_ints": [*toks[:99], True], "empty": [],
           "string": "abc", "nested": np.array([toks]), "ragged": [toks[:3], [1, 2]]}[prompt]
    with pytest.raises(jaxgdn.InputError, match=match):
        full.lookup([bad])
    with pytest.raises(jaxgdn.InputError, match="prompt 1"):  # refused before any counting: nothing half-recorded
        full.lookup([toks, bad])


@pytest.mark.parametrize("prompts, match", [
    (None, "prompts must be a sequence of prompts .* got NoneType"),
    (5, "got int"),
    ("abc", "got str"),
    ("flat", r"got one flat sequence of ids: wrap it in a list"),  # one prompt, not a list of prompts (as generate
    # and score say it; it had read "prompt 0 must be a flat sequence ...; got shape ()")
])
def test_lookup_refuses_what_is_not_a_list_of_prompts(setup, full, prompts, match):
    prompts = setup[1] if prompts == "flat" else prompts
    with pytest.raises(jaxgdn.InputError, match=match):
        full.lookup(prompts)


def test_lookup_of_a_cached_prefix_itself_returns_a_shorter_one(setup, full):
    _, toks, _, _ = setup
    hits, after = full.lookup([toks[:64], toks[:65], toks[:128], toks[:192], toks[:193]])
    assert _positions(hits) == [None, 64, 64, 128, 128]
    s = after.stats()
    assert (s.hits, s.misses, s.hit_tokens) == (4, 1, 64 + 64 + 128 + 128)


# ---- the constructor ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(interval=64.0), "interval must be a positive multiple of 64; got 64.0"),  # accepted, then lookup crashed
    (dict(interval="64"), "got '64'"),  # used to raise TypeError
    (dict(interval=True), "got True"),
    (dict(interval=96), "got 96"),
    (dict(max_bytes=float("nan")), "max_bytes must be an integer .* got nan"),  # accepted: evicted every entry
    (dict(max_bytes=1.5), "got 1.5"),
    (dict(max_bytes=True), "got True"),
    (dict(max_bytes="1"), "got '1'"),  # used to raise TypeError
    (dict(max_bytes=-1), "max_bytes must be >= 0; got -1"),
    (dict(deterministic=None), "deterministic must be True or False; got None"),  # was a non-deterministic cache
    (dict(deterministic="no"), "got 'no'"),  # was a deterministic one
    (dict(numerics=5), "numerics must be a `numerics_key` string or None; got 5"),
])
def test_constructor_refuses_bad_arguments(kw, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        PrefixCache(**kw)


def test_constructor_normalises_numpy_integers(setup):
    cache = PrefixCache(interval=np.int64(64), max_bytes=np.int64(10 ** 6), deterministic=np.bool_(True))
    assert (type(cache.interval), type(cache.max_bytes), type(cache.deterministic)) == (int, int, bool)
    assert PrefixCache(interval=INTERVAL, max_bytes=8e9).max_bytes == 8 * 10 ** 9  # a whole number as a float
    assert _positions(cache.insert(setup[3]).lookup([setup[1]])[0]) == [128]
    zero = PrefixCache(interval=INTERVAL, max_bytes=0)  # a budget of nothing: every write refused, counted
    assert zero.insert(setup[3], skip_refused=True).stats().refused_writes == 3


# ---- insert / accepts --------------------------------------------------------------------------------------

def test_hand_made_checkpoint_tokens_are_stored_as_a_tuple(setup):
    _, toks, _, cks = setup
    for tokens in (list(cks[0].tokens), np.array(cks[0].tokens), jnp.asarray(cks[0].tokens)):
        cache = PrefixCache(interval=INTERVAL).insert(dataclasses.replace(cks[0], tokens=tokens))
        # a list used to be stored as is and never equal a prompt's tuple (a silent miss); an array made lookup raise
        assert _positions(cache.lookup([toks])[0]) == [64]
        assert type(cache.checkpoints()[0].tokens) is tuple
        assert len(cache.insert(cks[0])) == 1  # the same prefix again: no false "sha256 prefix collision"


@pytest.mark.parametrize("skip_refused", [False, True])
def test_insert_refuses_malformed_checkpoints(setup, skip_refused):
    _, _, state, cks = setup
    ck = cks[0]
    cases = [
        (None, "checkpoints must be a Checkpoint or a sequence of them; got NoneType"),
        ([None], r"checkpoints\[0\] must be a jaxgdn.cache.Checkpoint; got NoneType"),
        ([ck, state], r"checkpoints\[1\] must be a jaxgdn.cache.Checkpoint; got ModelState"),
        (dataclasses.replace(ck, tokens=tuple(float(t) for t in ck.tokens)), "must hold integer token ids"),
        (dataclasses.replace(ck, tokens=(-1,) * 64), r"outside \[0, 2\*\*63\)"),
        # the tokens of one prefix with the keys / values of another: used to be admitted (then fail to restore)
        (dataclasses.replace(ck, tokens=cks[1].tokens), "attention keys of shape .*64.* for 128 tokens"),
        (dataclasses.replace(ck, provenance=7), "provenance 7"),  # used to raise a bare ValueError
        (dataclasses.replace(ck, provenance=int(Provenance.FRESH)), "provenance 0"),
        (dataclasses.replace(ck, numerics=1), "numerics must be a `numerics_key` string or None"),
        # key/value blocks (shared between the checkpoints of a sequence): their rows must add up to the tokens
        (dataclasses.replace(cks[2], kv_blocks=cks[2].kv_blocks[:2]), r"in blocks of \[64, 64\] rows for 192"),
        (dataclasses.replace(ck, kv_blocks=()), "kv_blocks: a non-empty tuple"),
        (dataclasses.replace(cks[1], kv_blocks=(ck.kv_blocks[0], ck.kv_blocks[0] * 2)), r"hold \[1, 2\] attention"),
        (dataclasses.replace(cks[1], kv_blocks=(ck.kv_blocks[0], (ck.kv[0]._replace(values=ck.kv[0].values[:3]),))),
         "of shapes .* in one block"),
    ]
    for cache in (PrefixCache(interval=INTERVAL), PrefixCache(interval=INTERVAL, deterministic=False)):
        for bad, match in cases:
            with pytest.raises(jaxgdn.InputError, match=match):
                cache.insert(bad, skip_refused=skip_refused)


def test_accepts_agrees_with_insert(setup):
    """`accepts` asks what `insert` would do (README: "cache.accepts(ck) asks first"): it used to say True for a
    checkpoint of other numerics and for one over the byte budget, both of which insert refuses."""
    model, _, _, cks = setup
    other = PrefixCache(interval=INTERVAL, numerics=numerics_key(model.with_gdn_prefill("recurrent")))
    small = PrefixCache(interval=INTERVAL, max_bytes=cks[0].nbytes - 1)
    coarse = PrefixCache(interval=128)
    for cache in (other, small, coarse, PrefixCache(interval=INTERVAL)):
        for ck in cks:
            try:
                cache.insert(ck)
                inserted = True
            except jaxgdn.CheckpointRefused:
                inserted = False
            assert cache.accepts(ck) == inserted, (cache, ck.position)
    assert not other.accepts(cks[0]) and not small.accepts(cks[0])
    with pytest.raises(jaxgdn.InputError, match="must be a jaxgdn.cache.Checkpoint"):
        coarse.accepts("x")


def test_duplicates_eviction_and_immutability(setup):
    _, toks, _, cks = setup
    size = [c.nbytes for c in cks]
    # another 64-token prefix, with arrays of its own (cks[1] and cks[2] share cks[0]'s first key/value block)
    other64 = dataclasses.replace(cks[0], tokens=tuple(toks[64:128]), kv=jax.tree.map(jnp.copy, cks[0].kv),
                                  gdn=jax.tree.map(jnp.copy, cks[0].gdn))
    shared = sum(x.nbytes for x in jax.tree.leaves(cks[0].kv_blocks))
    assert cks[1].kv_blocks[0] is cks[0].kv_blocks[0] and shared
    empty = PrefixCache(interval=INTERVAL, max_bytes=size[0] + size[1])
    one = empty.insert(cks[0])
    twice = one.insert([cks[0], dataclasses.replace(cks[0])])  # the same prefix again: one entry, counted once
    assert (len(twice), twice.stats().bytes) == (1, size[0])
    two = twice.insert(other64)
    _, touched = two.lookup([toks[:65]])  # entry toks[:64] is now the more recent: other64 goes first
    evicted = touched.insert(cks[1])
    assert [c.tokens for c in evicted.checkpoints()] == [cks[0].tokens, cks[1].tokens]
    assert evicted.stats().evictions == 1
    assert evicted.stats().bytes == size[0] + size[1] - shared == evicted.max_bytes - shared
    # a checkpoint larger than the whole budget is refused and evicts nothing
    small = PrefixCache(interval=INTERVAL, max_bytes=size[2] - 1).insert(cks[0])
    assert small.insert(cks[2], skip_refused=True).stats() == dataclasses.replace(small.stats(), refused_writes=1)
    # every older cache is unchanged, stats included
    assert [(len(c), c.stats().bytes, c.stats().hits, c.stats().evictions) for c in (empty, one, two, touched)] == [
        (0, 0, 0, 0), (1, size[0], 0, 0), (2, 2 * size[0], 0, 0), (2, 2 * size[0], 1, 0)]
    for clone in (pickle.loads(pickle.dumps(evicted)), copy.deepcopy(evicted)):
        assert clone.stats() == evicted.stats() and _positions(clone.lookup([toks])[0]) == [128]


def test_checkpoint_pickled_before_kv_blocks_loads_and_repr_is_short(setup):
    """A checkpoint pickled before `kv_blocks` (its state held `kv` whole) unpickles into one block, usable; a
    checkpoint's repr names its shape, not its arrays."""
    _, _, _, cks = setup
    ck = cks[1]
    state = {name: getattr(ck, name) for name in ("tokens", "provenance", "gdn", "numerics", "origin")}
    old = Checkpoint.__new__(Checkpoint)
    old.__setstate__(dict(state, kv=ck.kv))
    assert len(old.kv_blocks) == 1 and old.nbytes == ck.nbytes
    chex.assert_trees_all_equal(old.kv, ck.kv)
    assert PrefixCache(interval=INTERVAL).insert(old).lookup([ck.tokens + (1,)])[0][0] is old
    assert repr(ck) == (f"Checkpoint(position=128, provenance=PREFILL, gdn_layers={len(ck.gdn)}, kv_blocks=2, "
                        f"numerics={ck.numerics!r}, origin={ck.origin})")


# ---- checkpoint_from_state / state_from_checkpoints ---------------------------------------------------------

def test_checkpoint_from_state_and_restore_check_their_arguments(setup):
    model, toks, state, cks = setup
    with pytest.raises(jaxgdn.InputError, match="must hold integer token ids"):  # floats used to be truncated
        checkpoint_from_state(state, 0, [float(t) for t in toks])
    with pytest.raises(jaxgdn.InputError, match="at position 192 but 191 tokens"):
        checkpoint_from_state(state, 0, toks[:191])
    assert checkpoint_from_state(state, 0, np.array(toks)).tokens == tuple(toks)
    with pytest.raises(jaxgdn.InputError, match=r"checkpoints\[0\] must be a jaxgdn.cache.Checkpoint or None"):
        state_from_checkpoints(model.init_state(1, 256), ["not a checkpoint"])
    assert isinstance(cks[0], Checkpoint)


def test_restore_checks_the_template_and_each_checkpoints_shapes(setup):
    """state_from_checkpoints: a template that is not a state, and a checkpoint of other head counts or another dtype
    than the template's, are InputErrors naming them (were: an AttributeError; JAX's "Incompatible types for
    broadcasting"; a silent cast of the fp32 KV rows to bf16); a generator of checkpoints reads as its list (was: a
    TypeError)."""
    model, _, _, cks = setup
    with pytest.raises(jaxgdn.InputError, match="template must be a ModelState"):
        state_from_checkpoints(None, [cks[0]])
    with pytest.raises(jaxgdn.InputError, match="checkpoints must be a sequence"):
        state_from_checkpoints(model.init_state(1, 256), 3)
    restored = state_from_checkpoints(model.init_state(1, 256), (c for c in [cks[1]]))
    chex.assert_trees_all_equal(restored, state_from_checkpoints(model.init_state(1, 256), [cks[1]]))
    wider = dataclasses.replace(model.config, num_key_value_heads=4)
    other = jaxgdn.Model(jaxgdn.init.random_params(wider, jax.random.key(0)), wider)
    with pytest.raises(jaxgdn.InputError, match=r"checkpoint 0's attention layer \d+'s keys is float32\[64, 2, 16\]; "
                                                r"the state holds float32\[64, 4, 16\]"):
        state_from_checkpoints(other.init_state(1, 256), [cks[0]])
    bf16 = jaxgdn.tiny_model("tiny", seed=3, deterministic=True, dtype=jnp.bfloat16)
    with pytest.raises(jaxgdn.InputError, match="holds bfloat16"):
        state_from_checkpoints(bf16.init_state(1, 256), [cks[0]])


@pytest.mark.parametrize("args,match", [
    (lambda m, c: (m, c), "cache must be a jaxgdn.PrefixCache"),  # arguments swapped
    (lambda m, c: (c, None), "model must be a jaxgdn.Model"),
])
def test_check_cache_names_a_wrong_argument(setup, full, args, match):
    """check_cache's arguments are checked before any assertion (was: an AttributeError from inside it)."""
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.check_cache(*args(setup[0], full))


# ---- check_cache -------------------------------------------------------------------------------------------

def _plant(cache, ck, key=None):
    key = _prefix_keys(ck.tokens, cache.interval, ck.position)[-1][1] if key is None else key
    return dataclasses.replace(cache, _entries={**cache._entries, key: _Entry(ck, 0)})


def test_check_cache_catches_tampered_entries(setup, full):
    model, toks, _, cks = setup
    jaxgdn.check_cache(full, model)
    wrong_key = _plant(PrefixCache(interval=INTERVAL), cks[1], key=_prefix_keys(toks, INTERVAL, 64)[-1][1])
    assert _positions(wrong_key.lookup([toks])[0]) == [None]  # never found ...
    with pytest.raises(RuntimeError, match="collision"):
        wrong_key.insert(cks[0])  # ... and it blocks the prefix whose key it holds
    with pytest.raises(AssertionError, match="stored under another prefix's key"):
        jaxgdn.check_cache(wrong_key, model)
    regridded = dataclasses.replace(full, interval=128)  # entries at 128 keyed on the 64 grid: never found
    with pytest.raises(AssertionError, match="off the grid|another prefix's key"):
        jaxgdn.check_cache(regridded, model)
    as_list = _plant(PrefixCache(interval=INTERVAL), dataclasses.replace(cks[0], tokens=list(cks[0].tokens)))
    with pytest.raises(AssertionError, match="tokens are not a tuple of token ids"):
        jaxgdn.check_cache(as_list, model)
    beyond_vocab = dataclasses.replace(cks[0], tokens=(model.config.vocab_size,) * 64)
    with pytest.raises(AssertionError, match=r"tokens are not a tuple of token ids in \[0, 256\)"):
        jaxgdn.check_cache(_plant(PrefixCache(interval=INTERVAL), beyond_vocab), model)
    fresh = dataclasses.replace(cks[0], provenance=int(Provenance.FRESH))
    with pytest.raises(AssertionError, match="provenance 0"):
        jaxgdn.check_cache(_plant(PrefixCache(interval=INTERVAL, deterministic=False), fresh), model)
    over = dataclasses.replace(full, max_bytes=cks[0].nbytes)  # a budget lowered by hand: nothing evicted
    with pytest.raises(AssertionError, match="over its budget"):
        jaxgdn.check_cache(over, model)


def test_another_architecture_of_the_same_shapes_is_refused(setup):
    """The tiny-next preset's states have the tiny preset's shapes; the numerics key's config digest tells them
    apart, so a cache holding one refuses the other's checkpoints (it used to admit them: same key, same shapes)."""
    model, _, _, cks = setup
    nxt = jaxgdn.tiny_model("tiny-next", deterministic=True)
    assert numerics_key(nxt) != numerics_key(model)
    other = PrefixCache(interval=INTERVAL, numerics=numerics_key(nxt))
    assert not other.accepts(cks[0])
    with pytest.raises(jaxgdn.CheckpointRefused):
        other.insert(cks[0])


def _edit_leaf(params, i, edit):
    """params with leaf i (flattened order) replaced by edit(its NumPy copy)."""
    leaves, treedef = jax.tree.flatten(params)
    leaves[i] = jnp.asarray(edit(np.array(leaves[i])))
    return jax.tree.unflatten(treedef, leaves)


def test_the_numerics_key_covers_the_weights(setup):
    """Two models of one architecture and mode with other weights (a fine-tune, an RL policy update) have other
    numerics keys, so a cache holding one's states refuses the other's, naming the weights; equal weights in another
    model object give the same key. The digest changes when one element moves by one ulp, when two elements swap,
    and when one leaf is cast to another dtype; it reads values, so it refuses tracers."""
    model, _, _, cks = setup
    same = jaxgdn.Model(jax.tree.map(lambda x: jnp.array(np.array(x)), model.params), model.config,
                        deterministic=True)
    assert numerics_key(same) == numerics_key(model)
    digest = weights_digest(model.params)
    assert model.weights_digest == digest and len(digest) == 16
    for derived in (model.with_backend("reference"), model.with_deterministic(False),
                    model.with_decode_mode("replay"), model.with_gdn_prefill("recurrent")):
        assert derived.__dict__.get("weights_digest") == digest  # carried along, not computed again
    nudged = _edit_leaf(model.params, 3, lambda x: np.concatenate(
        [np.nextafter(x.ravel()[:1], np.float32(np.inf)), x.ravel()[1:]]).reshape(x.shape).astype(x.dtype))
    swapped = _edit_leaf(model.params, 3, lambda x: np.concatenate(
        [x.ravel()[1::-1], x.ravel()[2:]]).reshape(x.shape))
    leaf = np.array(jax.tree.leaves(model.params)[3]).ravel()
    assert leaf[0] != leaf[1]  # (else the swap would change nothing)
    cast = _edit_leaf(model.params, 3, lambda x: x.astype(jnp.bfloat16))
    digests = {digest, *(weights_digest(p) for p in (nudged, swapped, cast))}
    assert len(digests) == 4, digests
    updated = dataclasses.replace(model, params=nudged)  # an RL step: one weight moved by one ulp
    assert numerics_key(updated) != numerics_key(model)
    cache = PrefixCache(interval=INTERVAL).insert(cks[0])
    assert cache.numerics == numerics_key(model)
    with pytest.raises(jaxgdn.CheckpointRefused, match=f"differing: weights: {digest} -> {weights_digest(nudged)};"):
        cache.bound_to(numerics_key(updated))
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(weights_digest)(model.params)


def test_a_prefill_checkpoint_replaces_a_decode_produced_one_of_the_same_prefix(setup):
    """In a cache that admits decode-produced states (deterministic=False), a prefill checkpoint of a prefix already
    held as a decode-produced one takes its place (it was dropped: the less exact state stayed); the other way round,
    the prefill one stays."""
    _, _, _, cks = setup
    decoded = dataclasses.replace(cks[0], provenance=int(Provenance.DECODE),
                                  gdn=jax.tree.map(lambda x: x + 1.0, cks[0].gdn))  # other values, to tell them apart
    first_decoded = PrefixCache(interval=INTERVAL, deterministic=False).insert(decoded).insert(cks[0])
    first_prefill = PrefixCache(interval=INTERVAL, deterministic=False).insert(cks[0]).insert(decoded)
    for cache in (first_decoded, first_prefill):
        [entry] = cache._entries.values()
        assert entry.checkpoint.provenance == int(Provenance.PREFILL) and len(cache) == 1
        chex.assert_trees_all_equal(entry.checkpoint.gdn, cks[0].gdn)


def test_bool_among_ints_finds_a_bool_anywhere_in_ids():
    """`errors.bool_among_ints` (the check every token list goes through; its flat-sequence path gathers element
    types): a Python or NumPy bool, or a subclass of np.bool_, anywhere in a flat list or tuple, or in a nested one;
    not an int, a NumPy integer or an array (whose dtype speaks for it)."""
    from jaxgdn.errors import bool_among_ints

    class Flag(np.bool_):
        pass

    ids = list(range(1000))
    for bad in (True, np.bool_(False), Flag(True)):
        for at in (0, 500, 999):
            assert bool_among_ints(ids[:at] + [bad] + ids[at + 1:])
            assert bool_among_ints(tuple(ids[:at] + [bad] + ids[at + 1:]))
    assert bool_among_ints([[1, 2], [3, True]]) and bool_among_ints(True)
    assert not bool_among_ints(ids) and not bool_among_ints(tuple(ids)) and not bool_among_ints([])
    assert not bool_among_ints([np.int64(3), np.int32(4), 5]) and not bool_among_ints([[1, 2], [3, 4]])
    assert not bool_among_ints(np.array([True, False]))  # an array's dtype is checked elsewhere
