"""Replay decode: decoded tokens' logprobs and states are bitwise what a prefill (teacher forcing) computes — over
the chunked GDN prefill (each step computes its token's part of the open chunk; here on the reference backend,
which recomputes the chunk: the Pallas step is tested in test_deterministic_kernels.py) and over the token-by-token
one (gdn_prefill="recurrent": one recurrent step per token, and any split of a prompt exact)."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn.state import Provenance

NEW = 200  # generated tokens: crosses at least three 64-token grid boundaries


FORMS = ["chunked", "recurrent"]


def _model(name, form="chunked", **kw):
    return jaxgdn.tiny_model(name, seed=11, deterministic=True, **kw).with_decode_mode("replay").with_gdn_prefill(form)


def _teacher_forced(model, sequences, starts):
    """jaxgdn.score: the logprob of each token from starts[i] on, by prefill (teacher forcing)."""
    return [np.array(s, np.float32) for s in jaxgdn.score(model, sequences, start=list(starts))]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["tiny", "tiny-next"])
def test_generation_logprobs_equal_teacher_forced_scoring(name, form):
    model = _model(name, form)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in (37, 64, 5, 100)]
    batch = jaxgdn.generate(model, prompts, max_new_tokens=NEW, temperature=0.8, seed=[1, 2, 3, 4])
    alone = jaxgdn.generate(model, prompts[:1], max_new_tokens=NEW, temperature=0.8, seed=1)
    assert all(len(r.tokens) == NEW for r in batch)
    # batch of 1 == row 0 of the batch of 4, bitwise (tokens and logprobs)
    assert alone[0].tokens == batch[0].tokens
    assert np.array_equal(np.array(alone[0].logprobs, np.float32), np.array(batch[0].logprobs, np.float32))
    scored = _teacher_forced(model, [p + r.tokens for p, r in zip(prompts, batch)], [len(p) for p in prompts])
    for r, s in zip(batch, scored):
        assert np.array_equal(np.array(r.logprobs, np.float32), s)  # bitwise: score == generation


def test_greedy_generation_equals_scoring_batch_of_one():
    model = _model("tiny")
    prompt = np.random.default_rng(1).integers(0, 256, 70).tolist()
    [r] = jaxgdn.generate(model, [prompt], max_new_tokens=NEW)
    [s] = _teacher_forced(model, [prompt + r.tokens], [len(prompt)])
    assert np.array_equal(np.array(r.logprobs, np.float32), s)


@pytest.mark.parametrize("form", FORMS)
def test_replay_state_at_grid_boundary_equals_prefill(form):
    model = _model("tiny", form)
    toks = np.random.default_rng(2).integers(0, 256, 140).tolist()
    step = jax.jit(jaxgdn.decode_step)
    state, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray([toks[:50]], jnp.int32))
    for t in toks[50:128]:
        state, _ = step(model, state, jnp.asarray([t], jnp.int32))
    ref, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray([toks[:128]], jnp.int32))
    chex.assert_trees_all_equal(state, ref)  # every leaf, bitwise: GDN boundary states, open chunks, KV, position
    assert int(state.provenance[0]) == Provenance.PREFILL
    # off the grid too: replay prefill continuing from position 128 + decode matches a prefill to 140
    for t in toks[128:140]:
        state, _ = step(model, state, jnp.asarray([t], jnp.int32))
    ref, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray([toks], jnp.int32))
    chex.assert_trees_all_equal(state, ref)


def test_replay_step_is_taken_only_where_verified():
    """`replay_step_matches_prefill`: the replay step kernels on the reference and interpret backends, and with the
    Pallas kernels (the GPU) only at the head sizes the H200 checks cover: 16 x 16 (the tiny presets', since run 103),
    64 x 64 and 128 x 128."""
    from pallas_kernels import replay_step_matches_prefill

    cfg = jaxgdn.tiny_qwen3_5()
    tiny = (cfg.linear_key_head_dim, cfg.linear_value_head_dim)  # 16 x 16
    assert replay_step_matches_prefill(*tiny, "reference") and replay_step_matches_prefill(*tiny, "interpret")
    assert replay_step_matches_prefill(128, 128, "pallas") and replay_step_matches_prefill(*tiny, "pallas")
    assert replay_step_matches_prefill(64, 64, "pallas")
    assert not replay_step_matches_prefill(128, 64, "pallas") and not replay_step_matches_prefill(32, 32, "pallas")


def test_one_token_replay_without_the_step_kernels_is_the_prefill(monkeypatch):
    """Where the replay step is not verified, a one-token call runs the chunked kernel over the open chunk and the
    token (as longer calls do), never the step kernels: the same state and logits, bitwise (here, on the CPU, as
    the replay step's)."""
    from jaxgdn.layers import gdn

    model = _model("tiny", "chunked", backend="interpret")
    toks = np.random.default_rng(9).integers(0, 256, 70).tolist()
    state, _ = model.prefill_chunk(model.init_state(2, 128), jnp.asarray([toks[:50], toks[10:60]], jnp.int32))

    def decode(st):
        jax.clear_caches()  # trace again: the choice is made at trace time
        step, logits = jaxgdn.model.jit(jaxgdn.decode_step), []
        for i in range(50, 70):
            st, lg = step(model, st, jnp.asarray([toks[i], toks[i - 40]], jnp.int32))
            logits.append(np.asarray(lg))
        return st, np.stack(logits)

    with_step = decode(state)

    def refused(*a, **k):
        raise AssertionError("the replay step kernels ran")

    monkeypatch.setattr(gdn.pallas_kernels, "replay_step_matches_prefill", lambda K, V, backend: False)
    monkeypatch.setattr(gdn.pallas_kernels, "chunk_replay_step_packed", refused)
    without = decode(state)
    chex.assert_trees_all_equal(without, with_step)
    assert int(without[0].provenance[0]) == Provenance.PREFILL


def test_one_token_calls_leave_rows_without_a_token_untouched():
    """A one-token call (the replay step's path in `layers/gdn.py`) with lengths 0 for a row leaves that row's
    state as it was, every leaf bitwise, while the other row — whose token completes its open chunk, emptying it —
    equals a prefill of its tokens (the glue is the backend's caller; the kernel's own lengths-0 rows:
    test_replay_kernel.py)."""
    model = _model("tiny")
    toks = np.random.default_rng(5).integers(0, 256, 64).tolist()
    state, _ = model.prefill_chunk(model.init_state(2, 192), jnp.asarray([toks[:63], toks[:63]], jnp.int32))
    new, _ = model.prefill_chunk(state, jnp.asarray([[toks[63]], [toks[63]]], jnp.int32), jnp.asarray([0, 1]))
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[:1], new), jax.tree.map(lambda a: a[:1], state))
    ref, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray([toks], jnp.int32))
    chex.assert_trees_all_equal(jax.tree.map(lambda a: a[1:], new), ref)
    gdn = [ls for ls in new.layers if getattr(ls, "open_qkv", None) is not None]
    assert gdn and all(not np.asarray(ls.open_qkv[1]).any() for ls in gdn)  # the completed chunk emptied
    assert all(np.asarray(ls.open_qkv[0]).any() for ls in gdn)  # the untouched row's 63 tokens are still there


def test_recurrent_mode_still_shows_the_difference():
    model = jaxgdn.tiny_model("tiny", seed=11, deterministic=True)  # recurrent decode
    toks = np.random.default_rng(2).integers(0, 256, 128).tolist()
    state, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray([toks[:50]], jnp.int32))
    for t in toks[50:]:
        state, _ = model.decode_step(state, jnp.asarray([t], jnp.int32))
    ref, _ = model.prefill_chunk(model.init_state(1, 192), jnp.asarray([toks], jnp.int32))
    gdn, gdn_ref = jaxgdn.model.gdn_states(state), jaxgdn.model.gdn_states(ref)
    assert any(not np.array_equal(a.recurrent, b.recurrent) for a, b in zip(gdn, gdn_ref))
    assert int(state.provenance[0]) == Provenance.DECODE


@pytest.mark.parametrize("form", FORMS)
def test_multi_turn_reuses_answer_prefixes_bitwise(form):
    model = _model("tiny", form)
    rng = np.random.default_rng(3)
    cache = jaxgdn.PrefixCache(interval=64, deterministic=True)
    turn1 = rng.integers(0, 256, 90).tolist()
    first = jaxgdn.generate(model, [turn1], max_new_tokens=120, cache=cache)
    # replay-decoded checkpoints inside the answer were admitted by the deterministic cache
    positions = sorted(c.position for c in first.cache.checkpoints())
    assert positions == [64, 128, 192]
    assert all(c.provenance == Provenance.PREFILL for c in first.cache.checkpoints())
    # on the grid the open chunk is empty: entries keep conv and recurrent only, no replay buffers
    assert all(g.open_qkv is None and g.open_x is None for c in first.cache.checkpoints() for g in c.gdn)
    message = rng.integers(0, 256, 20).tolist()
    turn2 = turn1 + first[0].tokens + message  # 230 tokens
    warm = jaxgdn.generate(model, [turn2], max_new_tokens=30, cache=first.cache)
    cold = jaxgdn.generate(model, [turn2], max_new_tokens=30, cache=cache)
    assert warm[0].cached_tokens == 192 and cold[0].cached_tokens == 0
    recomputed = len(turn2) - warm[0].cached_tokens
    assert recomputed <= 64 + len(message)  # at most one interval plus the new message
    assert warm[0].tokens == cold[0].tokens
    assert np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs))
    jaxgdn.check_cache(warm.cache, model, recompute=True)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["tiny", "tiny-next"])
def test_bf16_generation_equals_scoring(name, form):
    """bf16 too: jaxgdn's compiled entry points round every bf16 op (no XLA excess precision), so the replayed
    decode and the teacher-forced prefill round alike whatever their shapes. The MoE (tiny-next) included: its
    deterministic expert products failed to run on XLA:CPU in bf16 until 2026-12-01 (`pallas_kernels.api`'s
    `_expert_product`)."""
    model = _model(name, form, dtype=jnp.bfloat16)
    prompts = [np.random.default_rng(4).integers(0, 256, n).tolist() for n in (60, 33)]
    out = jaxgdn.generate(model, prompts, max_new_tokens=80, temperature=0.8, seed=[5, 6])
    scored = _teacher_forced(model, [p + r.tokens for p, r in zip(prompts, out)], [len(p) for p in prompts])
    for r, s in zip(out, scored):
        assert np.array_equal(np.array(r.logprobs, np.float32), s)


def test_recurrent_gdn_prefill_splits_anywhere_bitwise():
    """gdn_prefill="recurrent" in deterministic mode: a prompt split off the 64 grid (no grid error) gives the
    unsplit call's state and logits bitwise, and its states are admissible PREFILL checkpoints; the chunked prefill
    with recurrent decode refuses the same split."""
    model = _model("tiny", "recurrent")
    toks = jnp.asarray([np.random.default_rng(7).integers(0, 256, 150).tolist()], jnp.int32)
    whole, lg = model.prefill_chunk(model.init_state(1, 192), toks)
    s, lg1 = model.prefill_chunk(model.init_state(1, 192), toks[:, :37])
    s, lg2 = model.prefill_chunk(s, toks[:, 37:101])
    s, lg3 = model.prefill_chunk(s, toks[:, 101:])
    chex.assert_trees_all_equal(s, whole)
    np.testing.assert_array_equal(np.concatenate([lg1, lg2, lg3], axis=1), np.asarray(lg))
    assert int(s.provenance[0]) == Provenance.PREFILL
    assert s.layers[0].open_qkv is None  # no open-chunk buffers: nothing to replay
    chunked = jaxgdn.tiny_model("tiny", seed=11, deterministic=True)
    st, _ = chunked.prefill_chunk(chunked.init_state(1, 192), toks[:, :37])
    with pytest.raises(jaxgdn.InputError, match="grid"):
        chunked.prefill_chunk(st, toks[:, 37:101])


def test_recurrent_gdn_prefill_with_recurrent_decode():
    """gdn_prefill="recurrent" with recurrent decode, deterministic: prefills may start off the grid (exact), and a
    decode step through the decode kernels still marks the state DECODE (its other paths are not the prefill's)."""
    model = jaxgdn.tiny_model("tiny", seed=11, deterministic=True).with_gdn_prefill("recurrent")
    toks = jnp.asarray([np.random.default_rng(8).integers(0, 256, 100).tolist()], jnp.int32)
    s, _ = model.prefill_chunk(model.init_state(1, 128), toks[:, :37])
    s, _ = model.prefill_chunk(s, toks[:, 37:])  # off the grid: no error
    assert int(s.provenance[0]) == Provenance.PREFILL
    s, _ = model.decode_step(s, jnp.asarray([3], jnp.int32))
    assert int(s.provenance[0]) == Provenance.DECODE


def test_state_layout_must_match_the_model():
    """A state made for replay over the chunked prefill (open-chunk buffers) is refused by a model without them, and
    the other way round; unknown gdn_prefill values are refused."""
    chunked, scan = _model("tiny", "chunked"), _model("tiny", "recurrent")
    toks, tok = jnp.zeros((1, 5), jnp.int32), jnp.zeros((1,), jnp.int32)
    for model, state in ((scan, chunked.init_state(1, 128)), (chunked, scan.init_state(1, 128))):
        with pytest.raises(jaxgdn.InputError, match="open-chunk buffers"):
            model.prefill_chunk(state, toks)
        with pytest.raises(jaxgdn.InputError, match="open-chunk buffers"):
            model.decode_step(state, tok)
    with pytest.raises(ValueError, match="gdn_prefill"):
        jaxgdn.tiny_model("tiny").with_gdn_prefill("token-by-token")
