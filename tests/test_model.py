"""The model and its state functions: transformers equivalence, split invariance on the 64-token grid, prefill vs
decode, padding, provenance, jit / donation / retracing, fresh state, bad input.

Every batch-2 state has capacity CAP, and token shapes are limited to [2, 16|64|80|144] and a few [1, T]
(shorter prompts are padded to 80 with `lengths`), so each is compiled once for the whole session (presets and
fixture checkpoints share configs).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn.model import _decode_jit, _prefill_jit
from jaxgdn.state import AttentionLayerState, GDNLayerState, Provenance, select_rows
from tests.conftest import CAP, FIXTURE_NAMES, PRESET_NAMES, max_abs_diff, random_tokens, tree_max_abs_diff

LOGIT_ATOL = 1e-4  # fp32 vs transformers (fp32), as issue 2 states


def rows(state, *idx):
    return select_rows(state, np.array(idx))


# ---- equivalence with transformers -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_full_forward_matches_transformers(fixture_models, expected, name):
    model, e = fixture_models[name], expected[name]
    _, logits = model.prefill_chunk(model.init_state(2, CAP), e["full_tokens"])
    assert logits.dtype == jnp.float32 and logits.shape == e["full_logits"].shape
    d = max_abs_diff(logits, e["full_logits"])
    assert d <= LOGIT_ATOL, f"{name} full forward: max abs diff {d:.3g} > {LOGIT_ATOL}"


def padded_to(tokens: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """[B, t] tokens zero-padded to [B, T] with lengths t: reuses the compiled [B, T] program."""
    B, t = tokens.shape
    return np.pad(tokens, ((0, 0), (0, T - t))), np.full((B,), t, np.int32)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_prefill_then_decode_matches_transformers(fixture_models, expected, name):
    """Prefill the 70 prompt tokens (as a [2, 80] call with lengths 70), then 6 decode steps."""
    model, e = fixture_models[name], expected[name]
    tokens, lengths = padded_to(e["prefill_tokens"], 80)
    state, logits = model.prefill_chunk(model.init_state(2, CAP), tokens, lengths)
    d = max_abs_diff(logits[:, :70], e["prefill_logits"])
    assert d <= LOGIT_ATOL, f"{name} prefill of 70: max abs diff {d:.3g} > {LOGIT_ATOL}"
    np.testing.assert_array_equal(state.position, [70, 70])
    for i in range(e["decode_tokens"].shape[1]):
        state, step_logits = model.decode_step(state, e["decode_tokens"][:, i])
        assert step_logits.dtype == jnp.float32 and step_logits.shape == (2, model.config.vocab_size)
        d = max_abs_diff(step_logits, e["decode_logits"][:, i])
        assert d <= LOGIT_ATOL, f"{name} decode step {i} (position {70 + i}): max abs diff {d:.3g} > {LOGIT_ATOL}"
    np.testing.assert_array_equal(state.position, [76, 76])


# ---- prefill + decode vs one prefill ---------------------------------------------------------------------------

@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_prefill_plus_decode_approximates_full_prefill(preset_models, rng, preset):
    """Prefill 70, decode 10 vs one prefill of 80: decode logits within max abs diff 1e-5 of the prefill logits
    (logit scale ~1.8; measured ~4e-7), every layer's state (conv, recurrent, KV) within 1e-5 (measured <= 1e-6).
    Mathematically equal, numerically not bitwise."""
    model = preset_models[preset]
    tokens = random_tokens(rng, (2, 80))
    full_state, full_logits = model.prefill_chunk(model.init_state(2, CAP), tokens)
    state, logits = model.prefill_chunk(model.init_state(2, CAP), *padded_to(tokens[:, :70], 80))
    assert max_abs_diff(logits[:, :70], full_logits[:, :70]) <= 1e-5
    for t in range(70, 80):
        state, step_logits = model.decode_step(state, tokens[:, t])
        d = max_abs_diff(step_logits, full_logits[:, t])
        assert d <= 1e-5, f"decode at position {t}: max abs diff {d:.3g} > 1e-5 vs one prefill"
    np.testing.assert_array_equal(state.position, full_state.position)
    for i, (a, b) in enumerate(zip(state.layers, full_state.layers)):
        d = tree_max_abs_diff(a, b)
        assert d <= 1e-5, f"layer {i} state: max abs diff {d:.3g} > 1e-5 (prefill+decode vs one prefill)"
    np.testing.assert_array_equal(state.provenance, [Provenance.DECODE] * 2)
    np.testing.assert_array_equal(full_state.provenance, [Provenance.PREFILL] * 2)


# ---- split invariance on the 64-token grid -----------------------------------------------------------------------
#
# One prefill of T tokens vs the same tokens in on-grid calls: 80 = 64 + 16 (split at 64) and 144 = 64 + 64 + 16
# (splits at 64 and 128; the dense preset only, for compile time). The bitwise promise is made by
# `deterministic=True` models, whose projections, MLP/MoE, norms and attention run in fixed tiles. In the default
# mode XLA:CPU picks reductions and GEMM blockings by shape (a jitted row sum over 64 floats changes in the last bit
# between 4 and 260 rows), so a split changes low bits (measured up to ~4e-7 in logits, and states differ too when
# the later call is short): there we assert a tolerance, max abs diff <= 1e-5.

SPLITS = {80: (64, 16), 144: (64, 64, 16)}


@pytest.fixture(scope="module")
def det_models(preset_models):
    return {name: m.with_deterministic(True) for name, m in preset_models.items()}


def _split_run(model, tokens, parts):
    one = model.prefill_chunk(model.init_state(2, CAP), tokens)
    state, pieces, start = model.init_state(2, CAP), [], 0
    for n in parts:
        state, logits = model.prefill_chunk(state, tokens[:, start:start + n])
        pieces.append((start, logits))
        start += n
    return dict(one=one, split_state=state, pieces=pieces)


SPLIT_CASES = [("tiny", 80), ("tiny-next", 80), ("tiny", 144)]  # (preset, total)


@pytest.fixture(scope="module")
def split_runs(det_models):
    """Deterministic models: for each case, the one-call and the split prefill."""
    rng = np.random.default_rng(20260)
    return {(preset, total): _split_run(det_models[preset], random_tokens(rng, (2, total)), SPLITS[total])
            for preset, total in SPLIT_CASES}


@pytest.mark.parametrize("preset, total", SPLIT_CASES)
def test_split_on_grid_state_bitwise(split_runs, preset, total):
    r = split_runs[preset, total]
    chex.assert_trees_all_equal(r["split_state"], r["one"][0])  # every layer, position, provenance


@pytest.mark.parametrize("preset, total", SPLIT_CASES)
def test_split_on_grid_later_logits_bitwise(split_runs, preset, total):
    r = split_runs[preset, total]
    one = np.asarray(r["one"][1])
    for start, logits in r["pieces"][1:]:
        part, ref = np.asarray(logits), one[:, start:start + logits.shape[1]]
        assert np.array_equal(part, ref), (
            f"{SPLITS[total]}: logits of tokens {start}..{start + logits.shape[1] - 1} differ from one prefill of "
            f"{total}: max abs diff {max_abs_diff(part, ref):.3g}, {np.mean(part != ref):.1%} of elements differ")


@pytest.mark.parametrize("preset, total", SPLIT_CASES)
def test_split_on_grid_first_part_logits_bitwise(split_runs, preset, total):
    r = split_runs[preset, total]
    start, logits = r["pieces"][0]
    part, ref = np.asarray(logits), np.asarray(r["one"][1])[:, :logits.shape[1]]
    assert np.array_equal(part, ref), (
        f"logits of a {logits.shape[1]}-token prefill differ from the same tokens of a {total}-token prefill: "
        f"max abs diff {max_abs_diff(part, ref):.3g}")


def test_split_on_grid_default_mode_within_tolerance(tiny, rng):
    """Default (non-deterministic) mode: split on the grid within max abs diff 1e-5 (states and logits)."""
    r = _split_run(tiny, random_tokens(rng, (2, 80)), SPLITS[80])
    d = tree_max_abs_diff(r["split_state"], r["one"][0])
    assert d <= 1e-5, f"split state: max abs diff {d:.3g} > 1e-5"
    np.testing.assert_array_equal(r["split_state"].position, r["one"][0].position)
    np.testing.assert_array_equal(r["split_state"].provenance, r["one"][0].provenance)
    for start, logits in r["pieces"]:
        d = max_abs_diff(logits, np.asarray(r["one"][1])[:, start:start + logits.shape[1]])
        assert d <= 1e-5, f"logits from {start}: max abs diff {d:.3g} > 1e-5"


# ---- padding ---------------------------------------------------------------------------------------------------

MODES = ("default", "deterministic")


@pytest.fixture(scope="module")
def padded_runs(preset_models, det_models):
    """From a non-fresh state (64 tokens absorbed, as an [2, 80] call with lengths 64: a shared compiled shape),
    rows of lengths 80 and 37 in one [2, 80] call."""
    rng = np.random.default_rng(777)
    out = {}
    for mode, models in zip(MODES, (preset_models, det_models)):
        for preset, model in models.items():
            s0, _ = model.prefill_chunk(model.init_state(2, CAP), random_tokens(rng, (2, 80)), np.array([64, 64]))
            tokens = random_tokens(rng, (2, 80))
            lengths = np.array([80, 37], np.int32)
            state, logits = model.prefill_chunk(s0, tokens, lengths)
            out[mode, preset] = dict(model=model, s0=s0, tokens=tokens, lengths=lengths, state=state,
                                     logits=logits, rng=rng)
    return out


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_padding_content_does_not_leak(padded_runs, mode, preset):
    """Same shapes, different garbage in row 1's padded tail: every state leaf and every valid logit bitwise equal."""
    r = padded_runs[mode, preset]
    tokens = r["tokens"].copy()
    tokens[1, 37:] = random_tokens(r["rng"], 43)
    state, logits = r["model"].prefill_chunk(r["s0"], tokens, r["lengths"])
    chex.assert_trees_all_equal(state, r["state"])
    assert np.array_equal(logits[0], r["logits"][0]) and np.array_equal(logits[1, :37], r["logits"][1, :37])


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_other_rows_do_not_change_a_row(padded_runs, mode, preset):
    """Same shapes: changing row 0 entirely leaves row 1's state and valid logits bitwise equal."""
    r = padded_runs[mode, preset]
    tokens = r["tokens"].copy()
    tokens[0] = random_tokens(r["rng"], 80)
    state, logits = r["model"].prefill_chunk(r["s0"], tokens, r["lengths"])
    chex.assert_trees_all_equal(rows(state, 1), rows(r["state"], 1))
    assert np.array_equal(logits[1, :37], r["logits"][1, :37])


@pytest.mark.parametrize("preset", PRESET_NAMES)
@pytest.mark.parametrize("mode", MODES)
def test_length_zero_row_keeps_its_state(padded_runs, mode, preset):
    r = padded_runs[mode, preset]
    state, logits = r["model"].prefill_chunk(r["s0"], r["tokens"], np.array([80, 0], np.int32))
    chex.assert_trees_all_equal(rows(state, 1), rows(r["s0"], 1))  # KV, conv, recurrent, position, provenance
    chex.assert_trees_all_equal(rows(state, 0), rows(r["state"], 0))
    assert np.array_equal(logits[0], r["logits"][0])


@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_deterministic_padded_row_equals_the_row_alone(padded_runs, preset):
    """Deterministic mode: the padded row (length 37 of 80) run alone — a batch of 1, T = 37, no padding — gives
    bitwise the state and valid logits it has in the padded batch of 2."""
    r = padded_runs["deterministic", preset]
    b, L = 1, int(r["lengths"][1])
    state, logits = r["model"].prefill_chunk(rows(r["s0"], b), r["tokens"][b:b + 1, :L])
    chex.assert_trees_all_equal(state, rows(r["state"], b))
    assert np.array_equal(logits[0], r["logits"][b, :L]), f"row {b} (length {L}): logits differ alone"


def test_default_mode_padded_rows_vs_each_row_alone(padded_runs):
    """Default mode: each row alone (batch of 1, same T [1, 80], its own length) vs the padded batch of 2.

    The strongest claim that holds is a tolerance, not bitwise: XLA:CPU's reductions and dots are not
    shape-invariant, so a [1, T] and a [2, T] call may round differently, depending on the data (we saw both
    outcomes; differences were below 1e-6). Asserted: max abs diff <= 1e-5 for states and valid logits. The
    bitwise guarantees at a fixed shape (padding content, other rows, length-0 rows) are tested above, and
    deterministic mode makes this one bitwise too.
    """
    r = padded_runs["default", "tiny"]
    for b, L in enumerate(r["lengths"]):
        state, logits = r["model"].prefill_chunk(rows(r["s0"], b), r["tokens"][b:b + 1], r["lengths"][b:b + 1])
        ref_state = rows(r["state"], b)
        np.testing.assert_array_equal(state.position, ref_state.position)
        np.testing.assert_array_equal(state.provenance, ref_state.provenance)
        d = tree_max_abs_diff(state, ref_state)
        assert d <= 1e-5, f"row {b} (length {L}) alone: state max abs diff {d:.3g} > 1e-5"
        d = max_abs_diff(logits[0, :L], r["logits"][b, :L])
        assert d <= 1e-5, f"row {b} (length {L}) alone: logits max abs diff {d:.3g} > 1e-5"


# ---- provenance and position -----------------------------------------------------------------------------------

def test_provenance_and_position(tiny, rng):
    P = Provenance
    model = tiny
    s = model.init_state(2, CAP)
    np.testing.assert_array_equal(s.provenance, [P.FRESH, P.FRESH])
    np.testing.assert_array_equal(s.position, [0, 0])
    steps = [  # (call, tokens T or None for decode, lengths, expected position, expected provenance)
        ("prefill", 64, [64, 0], [64, 0], [P.PREFILL, P.FRESH]),  # length 0 keeps FRESH
        ("prefill", 16, [16, 2], [80, 2], [P.PREFILL, P.PREFILL]),  # both start on the grid (64 and 0)
        ("prefill", 64, [0, 61], [80, 63], [P.PREFILL, P.PREFILL_OFF_GRID]),  # row 1 starts at 2: off grid
        ("decode", None, None, [81, 64], [P.DECODE, P.DECODE]),
        ("prefill", 64, [0, 64], [81, 128], [P.DECODE, P.DECODE]),  # row 1 starts on the grid: taint survives
        ("prefill", 16, [16, 16], [97, 144], [P.DECODE, P.DECODE]),
    ]
    for call, T, lengths, pos, prov in steps:
        if call == "prefill":
            s, _ = model.prefill_chunk(s, random_tokens(rng, (2, T)), np.array(lengths, np.int32))
        else:
            s, _ = model.decode_step(s, random_tokens(rng, (2,)))
        np.testing.assert_array_equal(s.position, pos, err_msg=f"position after {call} {lengths}")
        np.testing.assert_array_equal(s.provenance, prov, err_msg=f"provenance after {call} {lengths}")
        assert s.position.dtype == jnp.int32 and s.provenance.dtype == jnp.int32


def test_off_grid_taint_survives_on_grid_prefill(tiny, rng):
    P = Provenance
    s = tiny.init_state(2, CAP)
    s, _ = tiny.prefill_chunk(s, random_tokens(rng, (2, 16)))  # both rows at 16: off the grid from now on
    np.testing.assert_array_equal(s.provenance, [P.PREFILL] * 2)
    s, _ = tiny.prefill_chunk(s, random_tokens(rng, (2, 64)), np.array([48, 64], np.int32))  # row 0 -> 64
    np.testing.assert_array_equal(s.position, [64, 80])
    np.testing.assert_array_equal(s.provenance, [P.PREFILL_OFF_GRID] * 2)
    s, _ = tiny.prefill_chunk(s, random_tokens(rng, (2, 16)), np.array([16, 0], np.int32))  # row 0 starts at 64
    np.testing.assert_array_equal(s.provenance, [P.PREFILL_OFF_GRID] * 2)


# ---- fresh state -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fresh_state_is_exactly_zero(tiny, dtype):
    cfg = tiny.config
    state = jaxgdn.Model(params=tiny.params, config=cfg, dtype=dtype).init_state(batch_size=3, capacity=40)
    assert state.batch_size == 3 and state.capacity == 64  # rounded up to the attention kernel's key block
    for leaf in jax.tree.leaves(state):
        assert isinstance(leaf, jax.Array) and not np.any(np.asarray(leaf, np.float32)), "fresh state not all zero"
    assert len(state.layers) == cfg.num_layers
    for kind, layer in zip(cfg.layer_types, state.layers):
        if kind == "linear_attention":
            assert isinstance(layer, GDNLayerState)
            assert layer.recurrent.shape == (3, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                             cfg.linear_value_head_dim)
            assert layer.recurrent.dtype == jnp.float32, "GDN recurrent state must be fp32"
            assert layer.conv.shape == (3, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim)
            assert layer.conv.dtype == dtype
        else:
            assert isinstance(layer, AttentionLayerState)
            assert layer.keys.shape == layer.values.shape == (3, 64, cfg.num_key_value_heads, cfg.head_dim)
            assert layer.keys.dtype == dtype
    assert state.position.dtype == state.provenance.dtype == jnp.int32


def test_state_leaves_flatten_in_declaration_order(tiny):
    state = tiny.init_state(2, 8)
    expected = []
    for layer in state.layers:
        expected += [layer.conv, layer.recurrent] if isinstance(layer, GDNLayerState) else [layer.keys, layer.values]
    expected += [state.position, state.provenance, state.origin]
    leaves = jax.tree.leaves(state)
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))


# ---- jit, donation, retracing ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def donating_prefill():
    """jax.jit of the pure prefill with the state donated, wrapped so a second trace fails the test."""
    fn = jax.jit(chex.assert_max_traces(jaxgdn.prefill_chunk, n=1), donate_argnums=1)
    yield fn
    chex.clear_trace_counter()


def test_jit_prefill_agrees_with_method_and_donates(tiny, donating_prefill, rng):
    tokens = random_tokens(rng, (2, 16))
    lengths = np.array([16, 9], np.int32)
    ref_state, ref_logits = tiny.prefill_chunk(tiny.init_state(2, CAP), tokens, lengths)
    for _ in range(2):  # twice with the same shapes: one trace only (assert_max_traces n=1)
        donated = tiny.init_state(2, CAP)
        state, logits = donating_prefill(tiny, donated, jnp.asarray(tokens), jnp.asarray(lengths))
        chex.assert_trees_all_equal(state, ref_state)
        assert np.array_equal(logits, ref_logits)
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated)), "donated state buffers were not consumed"


def test_assert_max_traces_catches_a_retrace(tiny, donating_prefill, rng):
    """The trace counter really counts: a new shape is a second trace and is refused."""
    donating_prefill(tiny, tiny.init_state(2, CAP), jnp.asarray(random_tokens(rng, (2, 16))),
                     jnp.full((2,), 16, jnp.int32))
    with pytest.raises(AssertionError):  # raised at trace time, before any compilation
        donating_prefill(tiny, tiny.init_state(2, CAP), jnp.asarray(random_tokens(rng, (2, 64))),
                         jnp.full((2,), 64, jnp.int32))


def test_jit_decode_agrees_with_method_and_donates(tiny, rng):
    state, _ = tiny.prefill_chunk(tiny.init_state(2, CAP), random_tokens(rng, (2, 64)))
    token = random_tokens(rng, (2,))
    ref_state, ref_logits = tiny.decode_step(state, token)
    step = jax.jit(chex.assert_max_traces(jaxgdn.decode_step, n=1), donate_argnums=1)
    try:
        donated = jax.tree.map(jnp.copy, state)
        s1, l1 = step(tiny, donated, jnp.asarray(token))
        chex.assert_trees_all_equal(s1, ref_state)
        assert np.array_equal(l1, ref_logits)
        assert all(leaf.is_deleted() for leaf in jax.tree.leaves(donated))
        s2, _ = step(tiny, s1, jnp.asarray(token))  # same shapes: no retrace
        np.testing.assert_array_equal(s2.position, np.asarray(ref_state.position) + 1)
    finally:
        chex.clear_trace_counter()


def test_methods_do_not_recompile_for_same_shapes(tiny, rng):
    s = tiny.init_state(2, CAP)
    tiny.prefill_chunk(s, random_tokens(rng, (2, 16)), np.array([16, 10], np.int32))
    s2, _ = tiny.decode_step(s, random_tokens(rng, (2,)))
    n_prefill, n_decode = _prefill_jit._cache_size(), _decode_jit._cache_size()
    s3, _ = tiny.prefill_chunk(s, random_tokens(rng, (2, 16)), np.array([5, 16], np.int32))  # other values
    tiny.prefill_chunk(s3, random_tokens(rng, (2, 16)))  # lengths=None, non-fresh state
    tiny.decode_step(s2, random_tokens(rng, (2,)))
    assert _prefill_jit._cache_size() == n_prefill, "prefill_chunk recompiled for the same shapes"
    assert _decode_jit._cache_size() == n_decode, "decode_step recompiled for the same shapes"


# ---- bad input -------------------------------------------------------------------------------------------------

@pytest.fixture
def state2(tiny):
    return tiny.init_state(2, CAP)


@pytest.mark.parametrize("bad, match", [
    (np.array([[1, 2, 256]] * 2, np.int32), "outside"),  # id == vocab
    (np.array([[1, -1, 3]] * 2, np.int32), "outside"),  # negative id
    (np.array([[1.0, 2.0, 3.0]] * 2, np.float32), "integer"),
    (jnp.array([[1.0, 2.0, 3.0]] * 2, jnp.bfloat16), "integer"),
    (np.array([1, 2, 3], np.int32), "rank 2"),
    (np.zeros((2, 3, 1), np.int32), "rank 2"),
    (np.zeros((3, 4), np.int32), "rows"),  # batch mismatch
    (np.zeros((2, 0), np.int32), "T == 0"),
])
def test_prefill_rejects_bad_tokens(tiny, state2, bad, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        tiny.prefill_chunk(state2, bad)


@pytest.mark.parametrize("tokens, lengths, match", [
    (np.array([[2**32 + 5, 2, 3, 4], [5, 6, 0, 0]], np.int64), None, "tokens holds values outside the int32 range"),
    (np.full((2, 4), 2**32 - 1, np.uint32), None, "outside the int32 range: min 4294967295"),  # not "-1"
    (np.ones((2, 4), np.int32), np.array([2**32 + 4, 1], np.int64), "lengths holds values outside the int32 range"),
    ([[1, 2], [3]], None, "rectangular integer array"),  # ragged rows
])
def test_prefill_refuses_values_a_cast_to_int32_would_change(tiny, state2, tokens, lengths, match):
    """Token ids and lengths are cast to int32 for the kernels: wider values that would wrap (2**32 + 5 becoming
    5) are refused, not silently changed."""
    with pytest.raises(jaxgdn.InputError, match=match):
        tiny.prefill_chunk(state2, tokens, lengths)


def test_a_state_of_another_model_is_refused(tiny, state2):
    """The state must hold one layer state per layer, each of the layer's kind and head shapes: a truncated or
    reordered state, one of another config, or no state at all is a named InputError (before, a 2-layer state ran
    the first two layers and returned logits)."""
    toks = np.ones((2, 4), np.int32)
    g0 = state2.layers[0]
    other = state2._replace(layers=(g0._replace(recurrent=jnp.zeros((2, 2) + g0.recurrent.shape[2:])),)
                            + state2.layers[1:])  # a GDN layer of 2 value heads, as another config makes
    for bad, match in ((state2._replace(layers=state2.layers[:2]), "holds 2 layer states; the model has 4"),
                       (state2._replace(layers=state2.layers[::-1]), "layer 0 of the state is of type "
                                                                      "AttentionLayerState"),
                       (None, "state must be a jaxgdn ModelState")):
        with pytest.raises(jaxgdn.InputError, match=match):
            tiny.prefill_chunk(bad, toks)
    with pytest.raises(jaxgdn.InputError, match="a state of another model"):
        tiny.decode_step(other, np.ones((2,), np.int32))
    with pytest.raises(jaxgdn.InputError, match="holds 2 layer states"):
        jax.jit(jaxgdn.decode_step)(tiny, state2._replace(layers=state2.layers[:2]), jnp.ones((2,), jnp.int32))


def test_the_pure_functions_refuse_a_first_argument_that_is_not_a_model(tiny, state2):
    """`jaxgdn.prefill_chunk` / `decode_step` name a bad first argument (before, an AttributeError from inside),
    with a hint where model and state are swapped; under jit too."""
    toks, tok = np.ones((2, 4), np.int32), np.ones((2,), np.int32)
    for bad, match in ((None, "got NoneType"), (tiny.config, "got ModelConfig"),
                       (state2, r"\(model and state swapped\?\); got ModelState")):
        with pytest.raises(jaxgdn.InputError, match="^model must be a jaxgdn.Model .*" + match):
            jaxgdn.prefill_chunk(bad, state2, toks)
        with pytest.raises(jaxgdn.InputError, match="^model must be a jaxgdn.Model .*" + match):
            jaxgdn.decode_step(bad, state2, tok)
    with pytest.raises(jaxgdn.InputError, match="swapped"):
        jax.jit(jaxgdn.decode_step)(state2, tiny, jnp.ones((2,), jnp.int32))


def test_row_selection_is_checked(tiny, state2):
    with pytest.raises(jaxgdn.InputError, match=r"rows must lie in \[0, 2\)"):
        jaxgdn.state.select_rows(state2, np.array([5]))
    with pytest.raises(jaxgdn.InputError, match=r"row must be an integer in \[0, 2\)"):
        jaxgdn.cache.checkpoint_from_state(state2, 5, [])
    assert jaxgdn.state.select_rows(state2, np.array([-1])).batch_size == 1


def test_deterministic_must_be_a_bool(tiny):
    for make in (lambda: tiny.with_deterministic("no"), lambda: jaxgdn.tiny_model("tiny", deterministic="no")):
        with pytest.raises(jaxgdn.InputError, match="deterministic must be True or False; got 'no'"):
            make()


def test_prefill_rejects_out_of_range_jax_tokens(tiny, state2):
    with pytest.raises(jaxgdn.InputError, match="256"):
        tiny.prefill_chunk(state2, jnp.full((2, 4), 300, jnp.int32))


def test_padding_past_lengths_may_hold_any_id(tiny, state2):
    """Only valid positions' ids are checked: padding (here -1 and 10**6) reaches neither the state nor a valid
    logit, so the call gives bitwise what zero padding gives; an id out of range inside `lengths` is named."""
    valid = np.array([[7, 8, 9, 10], [11, 12, 0, 0]], np.int32)
    lengths = np.array([4, 2], np.int32)
    odd = valid.copy()
    odd[1, 2:] = [-1, 10**6]
    s0, l0 = tiny.prefill_chunk(state2, valid, lengths)
    s1, l1 = tiny.prefill_chunk(state2, odd, lengths)
    chex.assert_trees_all_equal(s0, s1)
    assert np.array_equal(np.asarray(l0)[0], np.asarray(l1)[0])
    assert np.array_equal(np.asarray(l0)[1, :2], np.asarray(l1)[1, :2])
    odd[1, 1] = 256
    with pytest.raises(jaxgdn.InputError, match=r"256 at index \[1, 1\], 1 such id"):
        tiny.prefill_chunk(state2, odd, lengths)


@pytest.mark.parametrize("lengths, match", [
    ([5, 4], r"\[0, T=4\]"),  # > T
    ([-1, 4], r"\[0, T=4\]"),  # negative
    ([4, 4, 4], r"shape \(2,\)"),  # batch mismatch
    (np.array([[4, 4]], np.int32), r"shape \(2,\)"),  # wrong rank
    (np.array([4.0, 4.0], np.float32), "int"),
])
def test_prefill_rejects_bad_lengths(tiny, state2, lengths, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        tiny.prefill_chunk(state2, np.zeros((2, 4), np.int32), lengths)


@pytest.mark.parametrize("bad, match", [
    (np.array([256, 0], np.int32), "outside"),
    (np.array([0, -3], np.int32), "outside"),
    (np.array([0.0, 1.0], np.float32), "integer"),
    (np.array([[0, 1]], np.int32), "rank 1"),
    (np.array(5, np.int32), "rank 1"),
    (np.array([0, 1, 2], np.int32), "rows"),
])
def test_decode_rejects_bad_token(tiny, state2, bad, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        tiny.decode_step(state2, bad)


@pytest.mark.parametrize("replay, tokens, lengths, match", [
    (False, np.zeros((3, 4), np.int32), np.full((3,), 4, np.int32), "3 rows but the state holds 2"),
    (False, np.zeros((2, 4), np.float32), np.full((2,), 4, np.int32), "integer"),
    (False, np.zeros((2, 4), np.int32), np.full((3,), 4, np.int32), r"shape \(2,\)"),
    (True, np.zeros((2, 4), np.int32), np.full((2,), 4, np.int32), "open-chunk buffers"),
    (False, np.zeros((3,), np.int32), None, "3 rows but the state holds 2"),  # a decode
    (False, np.zeros((2, 1), np.int32), None, "rank 1"),  # a decode
])
def test_pure_functions_check_shapes_under_jit(tiny, state2, replay, tokens, lengths, match):
    """The pure functions check what needs no values — ranks, dtypes, the batch, the state's layout — at trace
    time, so a jitted call fails with a named InputError instead of a shape error from deep inside the model."""
    model = tiny.with_decode_mode("replay") if replay else tiny
    with pytest.raises(jaxgdn.InputError, match=match):
        if lengths is None:
            jax.jit(jaxgdn.decode_step)(model, state2, jnp.asarray(tokens))
        else:
            jax.jit(jaxgdn.prefill_chunk)(model, state2, jnp.asarray(tokens), jnp.asarray(lengths))


@pytest.mark.parametrize("stride", [0, 32, 100])
def test_pure_prefill_rejects_a_stride_off_the_grid(tiny, state2, stride):
    with pytest.raises(jaxgdn.InputError, match="positive multiple of 64"):
        jaxgdn.prefill_chunk(tiny, state2, jnp.zeros((2, 4), jnp.int32), checkpoint_stride=stride)


def test_pure_prefill_lengths_default_to_every_token(tiny, state2):
    tokens = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4))
    got = _prefill_jit(tiny, state2, tokens)
    want = _prefill_jit(tiny, state2, tokens, jnp.full((2,), 4, jnp.int32))
    chex.assert_trees_all_equal(got, want)


def test_prefill_capacity_exceeded(tiny):
    state = tiny.init_state(2, 64)
    with pytest.raises(jaxgdn.CapacityError, match="capacity 64"):
        tiny.prefill_chunk(state, np.zeros((2, 65), np.int32))
    # Lengths count, not T: row 1 alone overflows from a non-zero position.
    state = state._replace(position=jnp.array([0, 60], jnp.int32))
    with pytest.raises(jaxgdn.CapacityError, match="row 1"):
        tiny.prefill_chunk(state, np.zeros((2, 8), np.int32), np.array([8, 5], np.int32))
    assert issubclass(jaxgdn.CapacityError, jaxgdn.InputError)


def test_decode_capacity_exceeded(tiny):
    state = tiny.init_state(2, 64)._replace(position=jnp.array([10, 64], jnp.int32))
    with pytest.raises(jaxgdn.CapacityError, match="row 1"):
        tiny.decode_step(state, np.array([1, 2], np.int32))


def test_state_at_exact_capacity_is_accepted(tiny, rng):
    """Filling the cache exactly is fine; one more token is refused."""
    state = tiny.init_state(2, CAP)._replace(position=jnp.array([CAP - 1, CAP - 1], jnp.int32))
    state, logits = tiny.decode_step(state, random_tokens(rng, (2,)))
    assert np.all(np.isfinite(logits))
    with pytest.raises(jaxgdn.CapacityError):
        tiny.decode_step(state, random_tokens(rng, (2,)))


def test_deterministic_mode_refuses_an_off_grid_prefill(det_models):
    """Deterministic mode keeps its split promise by refusing prefills that start off the 64-token grid."""
    model = det_models["tiny"]
    state = model.init_state(2, CAP)._replace(position=jnp.array([64, 16], jnp.int32))
    with pytest.raises(jaxgdn.InputError, match="row 1 .*position 16.*grid"):
        model.prefill_chunk(state, np.zeros((2, 4), np.int32))


@pytest.mark.parametrize("name, seed, match", [("tiny", 2**64, r"seed must be an integer in \[0, 2\*\*32\)"),
                                               ("tiny", 2**32, r"seed must be an integer in \[0, 2\*\*32\)"),
                                               ("tiny", -1, "seed must be an integer"),
                                               ("tiny", 2.5, "seed must be an integer"),
                                               ("tiny", True, "seed must be an integer"),
                                               ("small", 0, "unknown preset 'small'")])
def test_tiny_model_refuses_bad_arguments(name, seed, match):
    """An unknown preset or a seed outside [0, 2**32) is an InputError (a seed of 2**64 was an OverflowError from
    JAX, a float a TypeError; 2**32 and -1 built the weights of seeds 0 and 2**32 - 1, a JAX key keeping a seed's
    low 32 bits)."""
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.tiny_model(name, seed=seed)
