"""Bad and unusual input to the pure state functions, the state helpers and the comparison tools: each is refused
with a named jaxgdn.InputError (or handled as documented) instead of a traceback from inside JAX or NumPy, or a
silently misused value. No test compiles the model: every refusal comes before its jitted program runs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn
from jaxgdn.compare import compare_gdn_states, diff_arrays, format_table, ulp_distance
from jaxgdn.model import _check_state_layout, gdn_states
from jaxgdn.state import at_boundary, init_state, select_rows

F32 = np.float32


@pytest.fixture(scope="module")
def model():
    return jaxgdn.tiny_model("tiny", seed=0)


@pytest.fixture(scope="module")
def state(model):
    return model.init_state(2, 64)


def _positions(s) -> np.ndarray:
    return np.asarray(s.position)


# ---- select_rows ------------------------------------------------------------------------------------------------

def test_select_rows_with_one_int_keeps_the_batch_axis(model, state):
    """The docstring allows one int: it used to drop the leading axis of every leaf, a state no function took."""
    one = select_rows(state._replace(position=jnp.array([3, 7], jnp.int32)), 1)
    assert one.batch_size == 1 and _positions(one).tolist() == [7]
    assert all(x.shape[0] == 1 for x in jax.tree.leaves(one))
    _check_state_layout(model.config, one, model.keeps_open_chunk, model.dtype)  # a state the model takes


def test_select_rows_takes_a_list_and_may_repeat_a_row(state):
    """A Python list was a TypeError from JAX's indexing; a row may be named twice (a copy of its state)."""
    s = state._replace(position=jnp.array([3, 7], jnp.int32))
    assert _positions(select_rows(s, [1, 0])).tolist() == [7, 3]
    assert _positions(select_rows(s, [1, 1])).tolist() == [7, 7]


@pytest.mark.parametrize("rows, match", [
    ([], "rows is empty"),  # was "got float64"
    (np.array([], np.int32), "rows is empty"),  # was a state of zero rows
    ([[0, 1]], "flat sequence"),  # was a state with two batch axes
    ([0, True], "not bools"),  # was rows [0, 1]
    (np.array([True, False]), "not bools"),
    ([0, 2], r"rows must lie in \[0, 2\)"),
])
def test_select_rows_refuses_bad_rows(state, rows, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        select_rows(state, rows)


def test_select_rows_checks_the_state_and_traced_rows(state):
    with pytest.raises(jaxgdn.InputError, match="state must be a jaxgdn ModelState"):
        select_rows(None, [0])  # was AttributeError
    with pytest.raises(jaxgdn.InputError, match="integer array"):
        jax.jit(select_rows)(state, jnp.array([0.0, 1.0]))  # was JAX's TypeError on a float index
    assert jax.jit(select_rows)(state, jnp.array(1)).batch_size == 1


# ---- state layout: dtypes and rows ------------------------------------------------------------------------------

def test_a_state_of_a_model_of_the_other_dtype_is_refused(model, state):
    """A bf16 model's state given to an fp32 model (or the reverse) ran with promoted arithmetic and came back in
    other dtypes (conv bf16 -> fp32); now a named InputError, from the methods and under jit."""
    bf16_state = jaxgdn.tiny_model("tiny", seed=0, dtype=jnp.bfloat16).init_state(2, 64)
    tokens = np.ones((2, 4), np.int32)
    with pytest.raises(jaxgdn.InputError, match="layer 0's conv is bfloat16; a model of dtype float32"):
        model.prefill_chunk(bf16_state, tokens)
    with pytest.raises(jaxgdn.InputError, match="layer 0's conv is bfloat16"):
        jax.jit(jaxgdn.decode_step)(model, bf16_state, jnp.ones((2,), jnp.int32))
    g0 = state.layers[0]
    low = state._replace(layers=(g0._replace(recurrent=g0.recurrent.astype(jnp.bfloat16)),) + state.layers[1:])
    with pytest.raises(jaxgdn.InputError, match="layer 0's recurrent is bfloat16; .* keeps it in float32"):
        model.decode_step(low, np.ones((2,), np.int32))


def test_a_state_whose_arrays_disagree_on_the_batch_is_refused(model, state):
    """position [1] over layers of 2 rows passed the batch check (B is position's length) and failed inside JAX."""
    half = state._replace(position=state.position[:1], provenance=state.provenance[:1], origin=state.origin[:1])
    with pytest.raises(jaxgdn.InputError, match=r"layer 0's conv has shape \(2, 3, 128\), not the state's 1 rows"):
        model.prefill_chunk(half, np.ones((1, 4), np.int32))
    with pytest.raises(jaxgdn.InputError, match="position must be an integer array"):
        model.decode_step(state._replace(position=state.position[0]), np.ones((2,), np.int32))


def test_init_state_refuses_a_dtype_no_model_has(model):
    with pytest.raises(jaxgdn.InputError, match="dtype must be float32 or bfloat16"):
        init_state(model.config, 2, 64, jnp.int32)  # was an int32 conv and KV cache


def test_state_helpers_name_a_wrong_argument(state):
    with pytest.raises(jaxgdn.InputError, match="state must be a jaxgdn ModelState"):
        gdn_states(None)  # was AttributeError
    with pytest.raises(jaxgdn.InputError, match="at_boundary takes a GDNLayerState"):
        at_boundary(state.layers[3])  # the attention layer: was AttributeError


# ---- tokens and lengths -----------------------------------------------------------------------------------------

def test_bools_and_strings_are_not_token_ids(model, state):
    """NumPy reads [1, True] as [1, 1]: a bool passed as token 1 (generate and score already refuse it)."""
    with pytest.raises(jaxgdn.InputError, match="tokens must hold integer token ids; got a bool"):
        model.prefill_chunk(state, [[1, True], [2, 3]])
    with pytest.raises(jaxgdn.InputError, match="lengths .* a bool"):
        model.prefill_chunk(state, [[1, 2], [2, 3]], [2, True])
    with pytest.raises(jaxgdn.InputError, match="got a string"):
        model.decode_step(state, "ab")


# ---- the pure prefill's static options --------------------------------------------------------------------------

def test_pure_prefill_names_options_that_must_be_static(model, state):
    """Under a plain jax.jit, checkpoint_stride and last_only are traced: that was a TracerBoolConversionError."""
    tokens = jnp.ones((2, 4), jnp.int32)
    for kwargs, name in (({"checkpoint_stride": 64}, "checkpoint_stride"), ({"last_only": True}, "last_only")):
        with pytest.raises(jaxgdn.InputError, match=f"{name} decides the program's shapes.*static_argnames"):
            jax.jit(jaxgdn.prefill_chunk)(model, state, tokens, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"checkpoint_stride": 64.0}, "positive multiple of 64; got 64.0"),  # was a shape TypeError inside the model
    ({"last_only": "yes"}, "last_only must be True or False"),  # was taken as True
])
def test_pure_prefill_refuses_options_of_the_wrong_type(model, state, kwargs, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.prefill_chunk(model, state, jnp.ones((2, 4), jnp.int32), **kwargs)


def test_jit_adds_compiler_options_given_to_it():
    """jaxgdn.model.jit(fn, compiler_options=...) was a TypeError (the keyword given twice)."""
    fn = jaxgdn.model.jit(lambda x: x + 1, compiler_options={"xla_allow_excess_precision": False})
    assert float(fn(F32(1))) == 2.0


# ---- compare ----------------------------------------------------------------------------------------------------

def test_ulp_distance_of_special_values():
    nan, inf, big = F32(np.nan), F32(np.inf), np.finfo(F32).max
    got = ulp_distance(np.array([0.0, nan, nan, inf, -inf, nan], F32), np.array([-0.0, -nan, 1.0, big, inf, inf], F32))
    # two NaNs of other signs were 4286578688 apart, and a NaN 1077936128 from 1.0: less than 1.0 from -1.0
    assert got.tolist() == [0, 0, 2**32, 1, 0xFF000000, 2**32]
    assert jaxgdn.compare.ULP_NAN == 2**32 > int(ulp_distance(F32(-inf), F32(inf)))


@pytest.mark.parametrize("a, b, match", [
    (np.zeros((2, 3), F32), np.zeros((3,), F32), r"differ in shape: \(2, 3\) against \(3,\)"),  # was broadcast
    (np.array([2**24 + 1]), np.array([2**24]), "a must be a floating-point array; got int64"),  # was 0 apart
    (np.array([1.0], F32), np.array([1.0 + 1e-12]), "b holds float64 values fp32 cannot hold exactly"),
])
def test_ulp_distance_refuses_what_it_would_misread(a, b, match):
    for fn in (ulp_distance, diff_arrays):
        with pytest.raises(jaxgdn.InputError, match=match):
            fn(a, b)


def test_ulp_distance_takes_bf16_and_exact_float64():
    assert ulp_distance(jnp.array([1.0, 2.0], jnp.bfloat16), np.array([1.0, 2.0])).tolist() == [0, 0]


def test_diff_arrays_counts_bitwise_equal_elements():
    """frac_equal says "bitwise equal": it counted +0 == -0 as equal and NaN against the same NaN as unequal."""
    assert diff_arrays(np.array([0.0, 1.0], F32), np.array([-0.0, 1.0], F32)).frac_equal == 0.5
    d = diff_arrays(np.array([np.nan, 1.0], F32), np.array([np.nan, 1.0], F32))
    assert d.frac_equal == 1.0 and d.max_ulp == 0 and np.isnan(d.max_abs)
    with pytest.raises(jaxgdn.InputError, match="empty"):
        diff_arrays(np.zeros(0, F32), np.zeros(0, F32))  # was NumPy's ValueError from max()


def test_compare_gdn_states_refuses_mismatched_states_and_layer_ids(model, state):
    ids = model.config.gdn_layers
    one = model.init_state(1, 64)
    with pytest.raises(jaxgdn.InputError, match=r"layer 0: the arrays differ in shape: \(1, "):
        compare_gdn_states(one, state, ids)  # one row against two: was broadcast
    with pytest.raises(jaxgdn.InputError, match=r"layer_ids \[0\] are not the states' GDN layers \[0, 1, 2\]"):
        compare_gdn_states(state, state, ids[:1])  # was one layer compared, silently
    with pytest.raises(jaxgdn.InputError, match="GDN layers differ"):
        compare_gdn_states(state, state._replace(layers=state.layers[:2]), None)
    assert [d.layer for d in compare_gdn_states(state, state)] == list(ids)  # layer_ids read from the states


def test_format_table_aligns_and_never_rounds_up_to_all_equal():
    a = np.arange(2000, dtype=F32)
    b = a.copy()
    b[-1] = np.nextafter(b[-1], F32(np.inf))
    near = diff_arrays(a, b, 0)  # 1999 of 2000 equal: read "100.0%"
    far = diff_arrays(np.array([-np.inf], F32), np.array([np.inf], F32), 12)  # a 10-digit ULP count
    lines = format_table([near, far], "title").splitlines()
    assert lines[2].endswith("99.9%") and near.frac_equal < 1
    assert len({len(line) for line in lines[1:]}) == 1, lines  # the 10-digit count pushed its row out


def test_compare_gdn_states_refuses_a_replay_state_off_the_grid_against_another(model, state):
    """A replay-mode state's `recurrent` is the state at the last grid boundary: against a recurrent-mode state at
    an off-grid position it was compared silently, a state of another position; on the grid it is the same."""
    replay = model.with_decode_mode("replay").init_state(2, 64)
    assert len(compare_gdn_states(replay, state)) == 3  # both at position 0: on the grid
    off = jnp.array([64, 70], jnp.int32)
    with pytest.raises(jaxgdn.InputError, match="open chunk .* off the grid"):
        compare_gdn_states(replay._replace(position=off), state._replace(position=off))


def test_a_donated_state_is_named(model):
    """Reusing a state donated to a jitted call was JAX's "Array has been deleted with shape=int32[2]"."""
    donated = model.init_state(2, 64)
    for x in jax.tree.leaves(donated):
        x.delete()  # what a call with donate_argnums does to the buffers it consumes
    with pytest.raises(jaxgdn.InputError, match="donated to a jitted call"):
        model.decode_step(donated, np.ones((2,), np.int32))


def test_equal_models_share_their_pytree_metadata(model):
    """dtype spelled jnp.float32, np.dtype("float32") or "float32" (and deterministic as a NumPy bool) used to give
    equal models other pytree metadata (they hash differently), so jit compiled every program again for each."""
    spellings = [jaxgdn.Model(model.params, model.config, dtype=d, deterministic=det)
                 for d, det in ((jnp.float32, False), (np.dtype("float32"), np.bool_(False)), ("float32", False))]
    assert len({jax.tree_util.tree_structure(m) for m in spellings}) == 1
    assert all(m.dtype == jnp.dtype(jnp.float32) and type(m.deterministic) is bool for m in spellings)


def test_init_state_refuses_capacities_past_int32_positions(model):
    """A capacity past the int32 positions is a CapacityError naming it (was: accepted, and a bare out-of-memory
    error from XLA for large ones); the largest allowed one is accepted (shapes only: nothing is allocated)."""
    from jaxgdn.errors import CapacityError
    from jaxgdn.state import MAX_CAPACITY

    for capacity in (2**31, MAX_CAPACITY + 1, 2**40):
        with pytest.raises(CapacityError, match=f"capacity {capacity} is past"):
            model.init_state(1, capacity)
    state = jax.eval_shape(lambda: model.init_state(1, MAX_CAPACITY))
    assert state.capacity == MAX_CAPACITY


@pytest.mark.parametrize("change,match", [
    (dict(num_experts_per_tok=8), r"num_experts_per_tok \(8\) must lie in \[1, num_experts = 4\]"),
    (dict(num_experts_per_tok=0), r"num_experts_per_tok \(0\) must lie in"),
    (dict(vocab_size=256.0), "vocab_size must be an integer; got 256.0"),
    (dict(linear_num_key_heads=True), "linear_num_key_heads must be an integer"),
])
def test_model_config_refuses_what_fails_at_the_first_call(change, match):
    """ModelConfig (exported) checks what only the Hugging Face loader checked: more experts per token than experts
    (was: JAX's top_k error at the first call) and sizes that are not integers (a float vocab_size was accepted)."""
    with pytest.raises(jaxgdn.InputError, match=match):
        dataclasses.replace(jaxgdn.tiny_qwen3_next(), **change)


def test_a_model_refuses_parameters_its_config_does_not_describe():
    """Model(params, config) checks the parameters against the config (shapes and kinds, from
    `init.random_params`'s shapes; nothing is allocated). Were accepted: a config of a larger vocabulary (ids past
    the embedding then read as its last row), tiny's dense weights under tiny-next's MoE config (which ran the dense
    MLP under tiny-next's numerics tag, and so continued tiny-next's states), None for either argument."""
    tiny, nxt = jaxgdn.tiny_model("tiny"), jaxgdn.tiny_model("tiny-next")
    cases = [
        (tiny.params, dataclasses.replace(tiny.config, vocab_size=512), r"params.embed has shape \(256, 64\); the "
                                                                        r"config needs \(512, 64\)"),
        (tiny.params, nxt.config, "missing params.layers.0..mlp.router"),
        (nxt.params, tiny.config, "unexpected params.layers.0..mlp.router"),
        (tiny.params, dataclasses.replace(tiny.config, tie_word_embeddings=True), "unexpected params.lm_head"),
        (None, tiny.config, "params must be a jaxgdn ModelParams"),
        (tiny.params, None, "config must be a jaxgdn.ModelConfig"),
    ]
    for params, config, match in cases:
        with pytest.raises(jaxgdn.InputError, match=match):
            jaxgdn.Model(params, config)
    # trees that are not parameters (a tree_map's placeholders, sharding specs, stacked tracers) still make a Model
    assert jax.tree.map(lambda x: None, tiny).config == tiny.config
    assert jax.tree.map(lambda x: jax.sharding.PartitionSpec(), tiny).config == tiny.config
    stacked = jax.tree.map(lambda *x: jnp.stack(x), tiny.params, tiny.params)  # (a Model of them is refused)
    embed_sums = jax.vmap(lambda p: jaxgdn.Model(p, tiny.config).params.embed.sum())(stacked)
    assert embed_sums.shape == (2,)


def test_a_qwen3_next_of_many_layers_builds():
    """A Qwen3-Next layout of 48 layers (36 GDN, 12 attention, every MLP a mixture of experts, as the 80B model has)
    at tiny sizes: its parameters' shapes (`init.random_params`) and the Model. Was: StopIteration from
    random_params, which drew 16 keys per layer where a GDN layer with experts takes 17 — and, through the
    parameter check that uses it, from `Model` and `load_pretrained` for any such checkpoint."""
    from jaxgdn.config import FULL, LINEAR
    from jaxgdn.init import random_params

    config = dataclasses.replace(jaxgdn.tiny_qwen3_next(),
                                 layer_types=tuple(FULL if i % 4 == 3 else LINEAR for i in range(48)))
    params = jax.eval_shape(lambda: random_params(config, jax.random.key(0)))
    model = jaxgdn.Model(params, config)
    assert len(model.params.layers) == 48 and model.config.num_layers == 48
