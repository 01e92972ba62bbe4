"""A state row remembers which model's numerics computed it (`ModelState.origin`, `Model.numerics_tag`).

Before, a row prefilled by one model and continued by another of the same state shapes (deterministic and default
mode, the chunked and the token-by-token GDN prefill, "tiny" and "tiny-next", two q/k/v layouts) kept provenance
PREFILL, so a deterministic cache admitted a state that neither model's prefill computes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn import sharding as S
from jaxgdn.cache import CheckpointRefused, PrefixCache, checkpoint_from_state, state_from_checkpoints
from jaxgdn.model import decode_step, prefill_chunk
from jaxgdn.state import Provenance
from tests.conftest import random_tokens

W = 64
prefill = jax.jit(prefill_chunk)
decode = jax.jit(decode_step)


@pytest.fixture(scope="module")
def others(preset_models):
    """Models whose states have the tiny model's shapes but other numerics."""
    tiny = preset_models["tiny"]
    return {"deterministic": tiny.with_deterministic(), "gdn_prefill=recurrent": tiny.with_gdn_prefill("recurrent"),
            "tiny-next": preset_models["tiny-next"]}


def _made_by(model, rng, rows=2):
    """A state whose row 0 holds one grid chunk that `model` prefilled; the other rows fresh."""
    tokens = random_tokens(rng, (rows, W))
    lengths = np.zeros((rows,), np.int32)
    lengths[0] = W
    state, _ = prefill(model, model.init_state(rows, 2 * W), tokens, lengths)
    return state


def test_numerics_tag_names_the_state_arithmetic(preset_models, others):
    tiny = preset_models["tiny"]
    tags = {name: m.numerics_tag for name, m in {"tiny": tiny, **others}.items()}
    tags["bf16"] = jaxgdn.tiny_model("tiny", dtype=jnp.bfloat16).numerics_tag
    tags["grouped"] = S.with_layout(tiny, 2).numerics_tag
    assert len(set(tags.values())) == len(tags), tags
    assert all(isinstance(t, int) and 1 <= t < 2**31 for t in tags.values())
    # decode_mode leaves a prefill's arithmetic as it is; equal models in other objects have one tag
    assert tiny.with_decode_mode("replay").numerics_tag == tiny.numerics_tag == jaxgdn.tiny_model("tiny").numerics_tag


@pytest.mark.parametrize("other", ["deterministic", "gdn_prefill=recurrent", "tiny-next"])
def test_a_row_another_model_continues_is_mixed(preset_models, others, other, rng):
    tiny, model = preset_models["tiny"], others[other]
    state = _made_by(tiny, rng, rows=3)
    assert np.asarray(state.origin).tolist() == [tiny.numerics_tag, 0, 0]
    assert np.asarray(state.provenance).tolist() == [Provenance.PREFILL, Provenance.FRESH, Provenance.FRESH]
    # row 0: tiny's chunk continued by the other model; row 1: fresh; row 2: no tokens in this call
    after, _ = prefill(model, state, random_tokens(rng, (3, W)), np.array([W, W, 0], np.int32))
    assert np.asarray(after.provenance).tolist() == [Provenance.MIXED, Provenance.PREFILL, Provenance.FRESH]
    assert np.asarray(after.origin).tolist() == [model.numerics_tag, model.numerics_tag, 0]
    # MIXED outlasts the next calls of either model (the worst provenance is kept)
    again, _ = prefill(tiny, after, random_tokens(rng, (3, W)), np.array([W, 0, 0], np.int32))
    assert np.asarray(again.provenance).tolist()[0] == Provenance.MIXED
    stepped, _ = decode(model, state, np.array([1, 2, 3], np.int32))
    assert np.asarray(stepped.provenance).tolist() == [Provenance.MIXED, Provenance.DECODE, Provenance.DECODE]


def test_the_same_model_continues_its_rows_as_prefill(tiny, rng):
    state = _made_by(tiny, rng)
    after, _ = prefill(tiny, state, random_tokens(rng, (2, W)))
    assert np.asarray(after.provenance).tolist() == [Provenance.PREFILL, Provenance.PREFILL]
    # decode_mode is not part of the tag: a replay-mode copy of the model continues it too (gdn_prefill="recurrent"
    # keeps the state layout of recurrent decode)
    rec = tiny.with_gdn_prefill("recurrent")
    state = _made_by(rec, rng)
    after, _ = decode(rec.with_decode_mode("replay"), state, np.array([5, 6], np.int32))
    assert np.asarray(after.provenance).tolist() == [Provenance.PREFILL, Provenance.PREFILL]


@pytest.mark.parametrize("other", ["deterministic", "tiny-next"])
def test_the_methods_refuse_to_continue_another_models_row(preset_models, others, other, rng):
    tiny, model = preset_models["tiny"], others[other]
    state = _made_by(tiny, rng)
    with pytest.raises(jaxgdn.InputError, match="row 0 of the state was computed by a model of other numerics"):
        model.prefill_chunk(state, random_tokens(rng, (2, W)))
    with pytest.raises(jaxgdn.InputError, match="row 0 of the state was computed by a model of other numerics"):
        model.decode_step(state, np.array([1, 2], np.int32))
    # a call that leaves that row alone (length 0) is fine, and so is the model that made it
    after, _ = model.prefill_chunk(state, random_tokens(rng, (2, W)), lengths=np.array([0, W], np.int32))
    assert np.asarray(after.provenance).tolist() == [Provenance.PREFILL, Provenance.PREFILL]
    tiny.decode_step(state, np.array([1, 2], np.int32))


def test_no_cache_admits_a_mixed_state(preset_models, others, rng):
    tiny, model = preset_models["tiny"], others["deterministic"]
    state = _made_by(tiny, rng)
    tokens = random_tokens(rng, (2, W))
    after, _ = prefill(model, state, tokens)
    history = [int(t) for t in np.concatenate([np.zeros(W, np.int32), tokens[0]])]  # what row 0 absorbed (any ids)
    ck = checkpoint_from_state(after, 0, history)
    assert ck.provenance == Provenance.MIXED
    for deterministic in (True, False):
        cache = PrefixCache(interval=W, deterministic=deterministic)
        assert not cache.accepts(ck)
        with pytest.raises(CheckpointRefused, match="this state is MIXED"):
            cache.insert([ck])


def test_a_restored_row_keeps_its_checkpoints_origin(preset_models, others, rng):
    """A row restored from a cache checkpoint carries the checkpoint's origin (`Checkpoint.origin`): the model that
    computed it continues it as PREFILL, another model marks it MIXED; a checkpoint of unknown origin (0) restores
    an unclaimed row."""
    tiny, det = preset_models["tiny"], others["deterministic"]
    tokens = np.asarray(random_tokens(rng, (W,)))
    state, _ = prefill(tiny, tiny.init_state(1, 2 * W), tokens[None], np.array([W], np.int32))
    ck = checkpoint_from_state(state, 0, tokens.tolist())
    assert ck.origin == tiny.numerics_tag
    restored = state_from_checkpoints(tiny.init_state(2, 2 * W), [ck, None])
    assert np.asarray(restored.origin).tolist() == [tiny.numerics_tag, 0]
    after, _ = tiny.prefill_chunk(restored, random_tokens(rng, (2, W)))
    assert np.asarray(after.provenance).tolist() == [Provenance.PREFILL, Provenance.PREFILL]
    assert np.asarray(after.origin).tolist() == [tiny.numerics_tag] * 2
    elsewhere, _ = prefill(det, state_from_checkpoints(det.init_state(1, 2 * W), [ck]), random_tokens(rng, (1, W)))
    assert np.asarray(elsewhere.provenance).tolist() == [Provenance.MIXED]
    unknown = dataclasses.replace(ck, origin=0)
    elsewhere, _ = prefill(det, state_from_checkpoints(det.init_state(1, 2 * W), [unknown]), random_tokens(rng, (1, W)))
    assert np.asarray(elsewhere.provenance).tolist() == [Provenance.PREFILL]


def test_checkpoint_origins_are_checked(tiny, rng):
    tokens = np.asarray(random_tokens(rng, (W,)))
    state, _ = prefill(tiny, tiny.init_state(1, 2 * W), tokens[None], np.array([W], np.int32))
    ck = checkpoint_from_state(state, 0, tokens.tolist(), model=tiny)
    for bad in (-1, 2**31, 1.5, True, "7"):
        with pytest.raises(jaxgdn.InputError, match="origin must be a `Model.numerics_tag`"):
            PrefixCache(interval=W).insert(dataclasses.replace(ck, origin=bad))
    cache = PrefixCache(interval=W).insert(ck)
    jaxgdn.check_cache(cache, tiny, recompute=True)
    planted = dataclasses.replace(cache, _entries={k: dataclasses.replace(e, checkpoint=dataclasses.replace(
        e.checkpoint, origin=tiny.numerics_tag + 1)) for k, e in cache._entries.items()})
    with pytest.raises(AssertionError, match="computed by a model of numerics_tag"):
        jaxgdn.check_cache(planted, tiny)


def test_a_cache_of_unknown_numerics_holds_one_kind_of_state(preset_models, rng):
    """Checkpoints made without `model=` still carry their origin: the first one admitted sets the cache's tag
    (`PrefixCache.origin`), a later one of another tag is refused whatever the order, and a model of another tag
    cannot use the cache (it used to restore the other model's state and generate other tokens without a word)."""
    tiny, nxt = preset_models["tiny"], preset_models["tiny-next"]
    toks = random_tokens(rng, (W,)).tolist()
    cks = {}
    for name, m in (("tiny", tiny), ("tiny-next", nxt)):
        state, _ = prefill(m, m.init_state(1, 2 * W), np.asarray([toks], np.int32), np.array([W], np.int32))
        cks[name] = checkpoint_from_state(state, 0, toks)
        assert cks[name].numerics is None and cks[name].origin == m.numerics_tag
    held = PrefixCache(interval=W).insert(cks["tiny-next"])
    assert held.origin == nxt.numerics_tag and held.numerics is None
    with pytest.raises(CheckpointRefused, match=f"numerics_tag {tiny.numerics_tag}; this cache holds states of "
                       f"numerics_tag {nxt.numerics_tag}"):
        held.insert(cks["tiny"])
    for order in (["tiny-next", "tiny"], ["tiny", "tiny-next"]):
        one = PrefixCache(interval=W).insert([cks[n] for n in order], skip_refused=True)
        assert len(one) == 1 and one.stats().refused_writes == 1 and one.origin == preset_models[order[0]].numerics_tag
    with pytest.raises(CheckpointRefused, match=f"this cache holds states of numerics_tag {nxt.numerics_tag}"):
        jaxgdn.generate(tiny, [toks + [1, 2, 3]], max_new_tokens=2, cache=held)
    with pytest.raises(jaxgdn.InputError, match="origin .* is not the numerics_tag of `numerics`"):
        PrefixCache(numerics=jaxgdn.cache.numerics_key(tiny), origin=nxt.numerics_tag)


@pytest.mark.parametrize("decode_mode", ["recurrent", "replay"])
def test_generates_checkpoints_carry_the_models_tag(tiny, decode_mode, rng):
    model = tiny.with_decode_mode(decode_mode)
    cache = PrefixCache(interval=W, deterministic=decode_mode == "replay")
    out = jaxgdn.generate(model, [random_tokens(rng, (W + 10,)).tolist()], max_new_tokens=W, cache=cache)
    positions = sorted(ck.position for ck in out.cache.checkpoints())
    assert positions == [W, 2 * W]  # from the prefill, and inside the answer (from decode)
    assert all(ck.origin == model.numerics_tag for ck in out.cache.checkpoints())
    assert out.cache.origin == model.numerics_tag


def test_numerics_tag_is_the_same_in_every_process_and_for_equal_configs(tiny):
    """The tag hashes a canonical text of the config (`ModelConfig.digest`): equal configs whose fields differ only
    in type (10000 and 10000.0, np.int64 and int) give one tag, and another process (another hash seed) the same."""
    import dataclasses as dc
    import os
    import subprocess
    import sys

    cfg = tiny.config
    typed = dc.replace(cfg, rope_theta=int(cfg.rope_theta), vocab_size=np.int64(cfg.vocab_size))
    assert typed == cfg and typed.digest() == cfg.digest() and repr(typed) != repr(cfg)
    assert dc.replace(cfg, rope_theta=cfg.rope_theta * 2).digest() != cfg.digest()
    code = "import jaxgdn; print(jaxgdn.tiny_model('tiny').numerics_tag)"
    env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == tiny.numerics_tag
