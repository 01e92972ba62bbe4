"""Deterministic mode on the GPU's code path, run on CPU: the tiny model with the Pallas kernels in interpret mode, so
projections go through the fixed-tile matmul and attention through the Pallas attention kernel (what a GPU runs;
on a CPU the default backend is the pure-JAX reference, tested in test_deterministic.py and test_replay.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn.model import _det

WIDTH = 128


@pytest.fixture(scope="module")
def model():
    m = jaxgdn.tiny_model("tiny", seed=5, dtype=jnp.bfloat16, deterministic=True).with_backend("interpret")
    assert _det(m) == "interpret"
    return m


def _prefill(model, rows):
    toks = np.zeros((len(rows), WIDTH), np.int32)
    for i, r in enumerate(rows):
        toks[i, :len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    _, logits = jaxgdn.model.jit(jaxgdn.prefill_chunk)(model, model.init_state(len(rows), WIDTH), jnp.asarray(toks),
                                                       lengths)
    return np.asarray(logits)


def test_kernels_are_on_the_path(model):
    """The compiled prefill contains the invariant matmul and attention kernels (not the lax.map fallback)."""
    toks = jnp.zeros((1, 64), jnp.int32)
    text = str(jax.make_jaxpr(jaxgdn.prefill_chunk)(model, model.init_state(1, 64), toks, jnp.array([64], jnp.int32)))
    assert "invariant_matmul" in text and "invariant_attention" in text
    assert "invariant_matmul" not in str(jax.make_jaxpr(jaxgdn.prefill_chunk)(
        model.with_backend("reference"), model.init_state(1, 64), toks, jnp.array([64], jnp.int32)))


def test_prefill_logits_alone_equal_inside_batches(model):
    rng = np.random.default_rng(0)
    target = rng.integers(0, 256, 90).tolist()
    alone = _prefill(model, [target])[0, :90]
    for batch, where in ((3, 1), (5, 4)):
        rows = [rng.integers(0, 256, int(rng.integers(1, WIDTH + 1))).tolist() for _ in range(batch)]
        rows[where] = target
        assert np.array_equal(_prefill(model, rows)[where, :90], alone), (batch, where)


def test_recurrent_decode_alone_equals_batched(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (64, 20, 128)]
    batched = jaxgdn.generate(model, prompts, max_new_tokens=6, temperature=0.9, seed=[1, 2, 3])
    [alone] = jaxgdn.generate(model, prompts[2:], max_new_tokens=6, temperature=0.9, seed=3)
    assert alone.tokens == batched[2].tokens
    assert np.array_equal(np.array(alone.logprobs), np.array(batched[2].logprobs))


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_replay_generation_equals_scoring(model, form):
    replay = model.with_decode_mode("replay").with_gdn_prefill(form)
    prompts = [np.random.default_rng(2).integers(0, 256, n).tolist() for n in (50, 9)]
    out = jaxgdn.generate(replay, prompts, max_new_tokens=24, temperature=0.8, seed=[4, 5])  # row 0 crosses 64
    scored = jaxgdn.score(replay, [p + r.tokens for p, r in zip(prompts, out)], start=[len(p) for p in prompts])
    for r, s in zip(out, scored):
        assert np.array_equal(np.array(r.logprobs, np.float32), np.array(s, np.float32))


def test_default_mode_attention_uses_the_kernel_and_matches_reference():
    """Default mode on the kernel backends runs attention through the Pallas kernel too (faster than XLA's on the
    H200); fp32 logits stay within 1e-4 (max abs) of the pure-JAX reference, prefill and decode."""
    ref = jaxgdn.tiny_model("tiny", seed=6)
    ker = ref.with_backend("interpret")
    toks = jnp.asarray(np.random.default_rng(3).integers(0, 256, (2, 70)), jnp.int32)
    lengths = jnp.array([70, 41], jnp.int32)
    assert "invariant_attention" in str(jax.make_jaxpr(jaxgdn.prefill_chunk)(ker, ker.init_state(2, 80), toks,
                                                                              lengths))
    outs = []
    for m in (ref, ker):
        s, lg = jaxgdn.model.jit(jaxgdn.prefill_chunk)(m, m.init_state(2, 80), toks, lengths)
        _, lg2 = jaxgdn.model.jit(jaxgdn.decode_step)(m, s, jnp.array([3, 4], jnp.int32))
        outs.append((np.asarray(lg)[0], np.asarray(lg)[1, :41], np.asarray(lg2)))
    for a, b in zip(*outs):
        assert np.abs(a - b).max() <= 1e-4


def test_replay_state_equals_prefill_state_with_the_kernels(model):
    """Replay decode over the chunked prefill with the Pallas kernels (the replay step and its caches): the state
    after decoding equals a prefill's, every leaf bitwise (boundary state, open chunk, the step's caches, KV) — at
    a grid boundary, where the step cleared its caches, and off the grid, where `prime` built the prefill's."""
    import chex

    replay = model.with_decode_mode("replay")
    toks = np.random.default_rng(8).integers(0, 256, 100).tolist()
    step = jaxgdn.model.jit(jaxgdn.decode_step)
    state, _ = replay.prefill_chunk(replay.init_state(1, WIDTH), jnp.asarray([toks[:30]], jnp.int32))
    for n, t in enumerate(toks[30:], start=31):
        state, _ = step(replay, state, jnp.asarray([t], jnp.int32))
        if n in (64, 100):
            ref, _ = replay.prefill_chunk(replay.init_state(1, WIDTH), jnp.asarray([toks[:n]], jnp.int32))
            chex.assert_trees_all_equal(state, ref)
    assert np.asarray(state.layers[0].open_x).any()  # 36 open tokens: two block rows cached


def test_replay_second_turn_warm_equals_cold_with_the_kernels(model):
    """The prefix cache with replay decode on the Pallas path: a checkpoint taken inside turn 1's answer (at 64,
    where the replay step has just cleared its caches) restores into a fresh state and turn 2 continues from it —
    bitwise what turn 2 computes without the cache."""
    replay = model.with_decode_mode("replay")
    rng = np.random.default_rng(9)
    cache = jaxgdn.PrefixCache(interval=64, deterministic=True)
    turn1 = rng.integers(0, 256, 50).tolist()
    first = jaxgdn.generate(replay, [turn1], max_new_tokens=20, cache=cache)
    assert [c.position for c in first.cache.checkpoints()] == [64]  # inside the answer
    turn2 = turn1 + first[0].tokens + rng.integers(0, 256, 5).tolist()
    warm = jaxgdn.generate(replay, [turn2], max_new_tokens=8, cache=first.cache)
    cold = jaxgdn.generate(replay, [turn2], max_new_tokens=8, cache=cache)
    assert warm[0].cached_tokens == 64 and cold[0].cached_tokens == 0
    assert warm[0].tokens == cold[0].tokens
    assert np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs))
