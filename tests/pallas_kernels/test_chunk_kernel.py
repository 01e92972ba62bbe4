"""Chunked prefill kernel (interpret mode on CPU) against the pure-JAX reference and the float64 oracle, plus the
bitwise properties the prefix cache and the determinism contract rely on.

Shapes are tiny (K = V = 32, one or two key heads) so the file runs in well under a minute on two CPU cores.
Tolerances (interpret mode computes every dot in exact fp32):
  fp32 inputs: relative (Frobenius) error <= 2e-5 against the float64 oracle; <= 1e-4 against the fp32 reference
  (the reference has its own fp32 rounding: with g very negative the state is tiny and it sits ~3e-5 from the oracle);
  bf16 inputs: states <= 2e-5 (the oracle gets the same bf16-rounded inputs), outputs <= 8e-3 (bf16 output rounding).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.reference import chunk_gated_delta_rule_reference
from tests.gdn_oracle import gated_delta_rule_oracle, random_gdn_inputs, rel_err

K = V = 32


def run(d, *, lengths=None, initial_state="from_inputs", checkpoint_stride=None, sl=slice(None), design=None):
    """Call the kernel (interpret mode) on tokens `sl` of the inputs dict `d`; `design` "split" or "fused"
    (None: the default configuration)."""
    s0 = d["initial_state"] if isinstance(initial_state, str) else initial_state
    out = chunk_gated_delta_rule_pallas(
        jnp.asarray(d["q"][:, sl]), jnp.asarray(d["k"][:, sl]), jnp.asarray(d["v"][:, sl]),
        jnp.asarray(d["g"][:, sl]), jnp.asarray(d["beta"][:, sl]),
        initial_state=None if s0 is None else jnp.asarray(s0),
        lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32),
        checkpoint_stride=checkpoint_stride, interpret=True, config=_design_config(design))
    return tuple(np.asarray(x) for x in out)


def _design_config(design):
    if design is None or isinstance(design, dict):
        return design
    if design == "split2":  # the tiled inverse in its own kernel, X through memory, then w / u / kd
        return {"design": "split", "prep_kernels": 2}
    if design == "fused":  # the fused design with the block-Neumann inverse on [64, 64] tiles
        return {"design": "fused", "prep_kernels": 1, "inv": "block16"}
    if design == "split_block16":  # the default up to run 23: the [64, 64] block-Neumann inverse, X through memory
        return {"design": "split", "prep_kernels": 2, "inv": "block16"}
    if design == "split_wk16":  # the GPU default's fp16 storage of w and kd, forced in interpret mode
        return {"design": "split", "prep_kernels": 1, "wk_dtype": "float16"}
    return {"design": design, "prep_kernels": 1}


def valid_rows(o, lengths):
    return [o[b, : int(n)] for b, n in enumerate(lengths)]


@pytest.mark.parametrize(
    "B,T,HK,HV,g_kind,beta_kind,lengths,design",
    [
        (1, 1, 1, 2, "realistic", "realistic", None, "split"),
        (2, 63, 1, 4, "near_zero", "mixed", None, "split"),
        (2, 65, 2, 4, "very_negative", "realistic", [65, 30], "split"),
        (3, 130, 1, 2, "realistic", "one", [130, 64, 1], "split"),
        (1, 130, 1, 4, "realistic", "zero", None, "split"),
        (2, 65, 2, 4, "very_negative", "realistic", [65, 30], "fused"),
        (3, 130, 1, 2, "realistic", "mixed", [130, 64, 1], "fused"),
        (2, 65, 2, 4, "very_negative", "mixed", [65, 30], "split2"),
    ],
)
def test_matches_oracle_and_reference(B, T, HK, HV, g_kind, beta_kind, lengths, design):
    rng = np.random.default_rng(1000 + T + 7 * HV)
    d = random_gdn_inputs(rng, B, T, HK, HV, K, V, np.float32, g_kind=g_kind, beta_kind=beta_kind)
    o, s = run(d, lengths=lengths, design=design)
    assert np.isfinite(o).all() and np.isfinite(s).all()
    ro, rs = gated_delta_rule_oracle(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                     lengths=lengths)
    jo, js = chunk_gated_delta_rule_reference(
        jnp.asarray(d["q"]), jnp.asarray(d["k"]), jnp.asarray(d["v"]), jnp.asarray(d["g"]), jnp.asarray(d["beta"]),
        initial_state=jnp.asarray(d["initial_state"]),
        lengths=None if lengths is None else jnp.asarray(lengths, jnp.int32))
    lens = [T] * B if lengths is None else lengths
    for b, n in enumerate(lens):
        if n:
            assert rel_err(o[b, :n], ro[b, :n]) <= 2e-5, ("output vs oracle", b)
            assert rel_err(o[b, :n], np.asarray(jo)[b, :n]) <= 1e-4, ("output vs reference", b)
    assert rel_err(s, rs) <= 2e-5, "state vs oracle"
    assert rel_err(s, np.asarray(js)) <= 1e-4, "state vs reference"


@pytest.mark.parametrize("prep_kernels", [1, 2])
def test_fp16_w_and_kd_storage(prep_kernels):
    """wk_dtype="float16" (the GPU default with L2-normalised keys; `chunk._wk_dtype`), forced in interpret mode,
    where every dot is otherwise exact fp32: the fp16 rounding of w and kd (2^-11 relative, the TF32 rounding the GPU's
    dots apply to them anyway) is the only added error. Seen: states 1.7e-4 - 1e-3 of the oracle (the most on identical
    keys with beta = 1, g ~ 0); bar 2e-3 for states, 1e-3 for outputs; all finite, including g very negative (kd
    down in fp16's subnormals)."""
    rng = np.random.default_rng(5 + prep_kernels)
    cfg = {"wk_dtype": "float16", "prep_kernels": prep_kernels}
    for g_kind, beta_kind, same_keys in [("realistic", "mixed", False), ("near_zero", "one", True),
                                         ("very_negative", "realistic", False)]:
        d = random_gdn_inputs(rng, 2, 150, 1, 2, K, V, np.float32, g_kind=g_kind, beta_kind=beta_kind)
        if same_keys:
            d["k"][:] = d["k"][:, :1]
        lengths = [150, 70]
        o, s = (np.asarray(x) for x in chunk_gated_delta_rule_pallas(
            *(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=jnp.asarray(d["initial_state"]),
            lengths=jnp.asarray(lengths), interpret=True, config=cfg))
        ro, rs = gated_delta_rule_oracle(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"],
                                         lengths=lengths)
        assert np.isfinite(o).all() and np.isfinite(s).all()
        assert rel_err(s, rs) <= 2e-3, g_kind
        assert max(rel_err(o[b, :n], ro[b, :n]) for b, n in enumerate(lengths)) <= 1e-3, g_kind
    args = [jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")]  # the option takes effect:
    w, _, kd, _ = chunk_gated_delta_rule_pallas(*args, interpret=True, config=dict(cfg, stop_after="prep"))
    assert w.dtype == kd.dtype == jnp.float16
    s32 = chunk_gated_delta_rule_pallas(*args, interpret=True, config=dict(cfg, wk_dtype="float32"))[1]
    assert not np.array_equal(np.asarray(s32), np.asarray(chunk_gated_delta_rule_pallas(*args, interpret=True,
                                                                                         config=cfg)[1]))


def test_bf16x3_dot_is_near_fp32():
    """`wy.dot`'s "bf16x3" as the GPU runs it (not interpret mode, whose dots are all fp32; XLA:CPU multiplies the
    bf16 halves exactly): within 2^-14 of the float64 product, where one bf16 dot is ~2^-8 off, transposes honoured."""
    from pallas_kernels.gated_delta import wy

    rng = np.random.default_rng(3)
    a = rng.standard_normal((16, 128)).astype(np.float32)
    b = rng.standard_normal((16, 128)).astype(np.float32)
    exact = a.astype(np.float64) @ b.astype(np.float64).T
    got3 = np.asarray(wy.dot(jnp.asarray(a), jnp.asarray(b), "bf16x3", False, trans_b=True), np.float64)
    got1 = np.asarray(wy.dot(jnp.asarray(a), jnp.asarray(b), "bf16", False, trans_b=True), np.float64)
    scale = np.abs(exact).max()
    assert np.abs(got3 - exact).max() < 2.0 ** -14 * scale < np.abs(got1 - exact).max() / 32


def test_fp16_dot_keeps_ten_mantissa_bits():
    """`wy.dot`'s "fp16" off interpret mode (the default's gram tiles on L2-normalised keys): operands rounded to fp16
    (2^-11 relative), so within 2^-10 of the float64 product where one bf16 dot (2^-8 per operand) is several times
    further off; and products of values near 1 stay finite."""
    from pallas_kernels.gated_delta import wy

    rng = np.random.default_rng(4)
    a = rng.standard_normal((16, 128)).astype(np.float32)
    a /= np.linalg.norm(a, axis=1, keepdims=True)  # unit rows, as the normalised keys
    exact = a.astype(np.float64) @ a.astype(np.float64).T
    got16 = np.asarray(wy.dot(jnp.asarray(a), jnp.asarray(a), "fp16", False, trans_b=True), np.float64)
    got1 = np.asarray(wy.dot(jnp.asarray(a), jnp.asarray(a), "bf16", False, trans_b=True), np.float64)
    err16, err1 = np.abs(got16 - exact).max(), np.abs(got1 - exact).max()
    assert err16 < 2.0 ** -10 and err1 > 4 * err16


def test_gram_precision_auto_takes_fp16_only_for_normalised_keys():
    """p_kk="auto" (the default): fp16 gram tiles where the keys are L2-normalised (bounded by 1), three bf16 dots
    where they are not (fp16 would overflow past 65504); an explicit choice is kept; an unknown one is refused."""
    from pallas_kernels.gated_delta import chunk

    assert chunk.DEFAULT_CONFIG["p_kk"] == "auto"
    assert chunk._checked_config(None, 128, use_l2=True)["p_kk"] == "fp16"
    assert chunk._checked_config(None, 128, use_l2=False)["p_kk"] == "bf16x3"
    assert chunk._checked_config({"p_kk": "bf16"}, 128, use_l2=True)["p_kk"] == "bf16"
    with pytest.raises(ValueError, match="or 'auto'"):
        chunk._checked_config({"p_kk": "fp8"}, 128)
    with pytest.raises(ValueError, match="p_ws='auto'"):
        chunk._checked_config({"p_ws": "auto"}, 128)


def test_qk_precision_auto_takes_fp16_only_for_bounded_operands():
    """p_qk="auto" (the default): the output's q k^T in fp16 where q and k are L2-normalised and q's scale keeps it
    inside fp16's normal range ([2^-10, 2^10]; K^-0.5 by default), TF32 otherwise; the prefill and the replay step
    resolve it alike (both pass their scale); an explicit choice is kept; an unknown one is refused."""
    from pallas_kernels.gated_delta import chunk

    assert chunk.DEFAULT_CONFIG["p_qk"] == "auto"
    assert chunk._checked_config(None, 128, use_l2=True)["p_qk"] == "fp16"
    assert chunk._checked_config(None, 128, use_l2=True, scale=128 ** -0.5)["p_qk"] == "fp16"
    assert chunk._checked_config(None, 128, use_l2=False, scale=128 ** -0.5)["p_qk"] == "tf32"
    for scale in (2.0 ** -11, 2.0 ** 11, -(2.0 ** 11)):
        assert chunk._checked_config(None, 128, use_l2=True, scale=scale)["p_qk"] == "tf32", scale
    assert chunk._checked_config({"p_qk": "bf16"}, 128, use_l2=True)["p_qk"] == "bf16"
    with pytest.raises(ValueError, match="p_qk='fp8'.*or 'auto'"):
        chunk._checked_config({"p_qk": "fp8"}, 128)


@pytest.mark.parametrize("keys", ["random", "identical", "nearly_parallel", "alternating_sign"])
def test_w_and_kd_rows_have_norm_at_most_one(keys):
    """The bound fp16 storage of w and kd relies on (`chunk._wk_dtype`): with L2-normalised keys, beta in [0, 1] and
    g <= 0, every row of w = X (beta exp(gc) k) and of kd = k exp(gc_last - gc) has Euclidean norm <= 1 (so every
    entry is in [-1, 1]), even where the WY inverse is worst conditioned (beta = 1, g = 0, parallel keys)."""
    rng = np.random.default_rng(17)
    adversarial = keys != "random"
    d = random_gdn_inputs(rng, 2, 192, 1, 2, K, V, np.float32, g_kind="near_zero" if adversarial else "realistic",
                          beta_kind="one" if adversarial else "mixed")
    if adversarial:
        d["g"][:] = 0.0
    if keys == "identical":
        d["k"][:] = d["k"][:, :1]
    elif keys == "nearly_parallel":
        d["k"][:] = d["k"][:, :1] + 1e-3 * rng.standard_normal(d["k"].shape)
    elif keys == "alternating_sign":
        d["k"][:, 1::2] = -d["k"][:, 0::2]
    w, _, kd, _ = chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")),
                                                interpret=True, config={"stop_after": "prep"})
    for x in (np.asarray(w), np.asarray(kd)):
        assert np.linalg.norm(x, axis=-1).max() <= 1 + 1e-5
        assert np.linalg.norm(x, axis=-1).max() >= 0.3  # not vacuous: rows of real size


def test_bf16_inputs_and_zero_initial_state():
    rng = np.random.default_rng(7)
    d = random_gdn_inputs(rng, 2, 70, 1, 2, K, V, np.float32, with_state=False)
    for n in ("q", "k", "v"):
        d[n] = np.asarray(jnp.asarray(d[n], jnp.bfloat16))
    o, s = run(d, initial_state=None)
    assert o.dtype == jnp.bfloat16 and s.dtype == np.float32
    ro, rs = gated_delta_rule_oracle(*(np.asarray(d[n], np.float64) for n in ("q", "k", "v", "g", "beta")))
    assert rel_err(o, ro) <= 8e-3  # bf16 output rounding
    assert rel_err(s, rs) <= 2e-5


@pytest.fixture(params=["split", "fused", "split2", "split_wk16", "split_block16"])
def design(request):
    """Both kernel designs (three calls: prep, state-only recurrence, output; or two: prep, recurrence + output),
    the split design with its prep in two kernels ("split2": inverse, then w / u / kd), with w and kd stored in
    fp16 between prep and recurrence as on the GPU ("split_wk16"), and the [64, 64] block-Neumann inverse
    ("split_block16")."""
    return request.param


@pytest.fixture(scope="module")
def seq():
    """Three rows of 192 tokens, HK=1, HV=2, non-zero initial state; row lengths 192, 100, 37."""
    rng = np.random.default_rng(42)
    d = random_gdn_inputs(rng, 3, 192, 1, 2, K, V, np.float32, beta_kind="mixed")
    return d


def test_split_on_grid_is_bitwise(design, seq):
    o, s = run(seq, design=design)
    for cut in (64, 128):
        o1, s1 = run(seq, design=design, sl=slice(0, cut))
        o2, s2 = run(seq, design=design, sl=slice(cut, None), initial_state=s1)
        assert np.array_equal(o1, o[:, :cut])
        assert np.array_equal(o2, o[:, cut:])
        assert np.array_equal(s2, s)


def test_same_call_twice_is_bitwise(design, seq):
    a = run(seq, design=design, lengths=[192, 100, 37])
    b = run(seq, design=design, lengths=[192, 100, 37])
    for x, y in zip(a, b):
        assert np.array_equal(x, y)


def test_row_alone_equals_row_in_batch(design, seq):
    lengths = [192, 100, 37]
    d = {n: np.array(x) for n, x in seq.items()}
    # Garbage (large values) in the padding must not matter.
    for b, n in enumerate(lengths):
        for name in ("q", "k", "v"):
            d[name][b, n:] = 1e3
        d["g"][b, n:] = -1e3
        d["beta"][b, n:] = 0.5
    o, s = run(d, design=design, lengths=lengths)
    for b, n in enumerate(lengths):
        alone = {name: x[b: b + 1] for name, x in d.items()}
        oa, sa = run(alone, design=design, sl=slice(0, n))
        assert np.array_equal(oa[0], o[b, :n]), b
        assert np.array_equal(sa[0], s[b]), b
        assert np.isfinite(o[b]).all()


def test_nan_padding_does_not_leak(design, seq):
    lengths = [192, 100, 37]
    d = {n: np.array(x) for n, x in seq.items()}
    for b, n in enumerate(lengths):
        for name in ("q", "k", "v", "g", "beta"):
            d[name][b, n:] = np.nan
    o, s = run(d, design=design, lengths=lengths)
    o_ref, s_ref = run(seq, design=design, lengths=lengths)
    assert np.array_equal(s, s_ref)
    for b, n in enumerate(lengths):
        assert np.array_equal(o[b, :n], o_ref[b, :n])


def test_checkpoints_equal_separate_calls(design, seq):
    lengths = [192, 100, 37]
    o, s, ck = run(seq, design=design, lengths=lengths, checkpoint_stride=64)
    assert ck.shape == (3, 3, 2, K, V) and ck.dtype == np.float32
    assert np.array_equal(ck[:, -1], s)
    for i in range(3):
        end = 64 * (i + 1)
        _, si = run(seq, design=design, sl=slice(0, end), lengths=[min(n, end) for n in lengths])
        assert np.array_equal(ck[:, i], si), i
    # A row past its length: checkpoint == its final state.
    assert np.array_equal(ck[2, 1], s[2]) and np.array_equal(ck[1, 2], s[1])
    # stride 128 on 192 tokens: one checkpoint; T not a multiple of 64.
    _, _, ck2 = run(seq, design=design, checkpoint_stride=128, sl=slice(0, 150))
    _, s128 = run(seq, design=design, sl=slice(0, 128))
    assert ck2.shape[1] == 1 and np.array_equal(ck2[:, 0], s128)


@pytest.mark.parametrize("start", [0, 64])
def test_partial_chunk_rows_equal_full_chunk_rows(design, seq, start):
    """A call of j < 64 tokens starting on the grid gives the same output rows as the full-chunk call."""
    if start:
        _, s_start = run(seq, design=design, sl=slice(0, start))
    else:
        s_start = seq["initial_state"]
    o_full, _ = run(seq, design=design, sl=slice(start, start + 64), initial_state=s_start)
    for j in (1, 2, 7, 33, 63):
        o_j, _ = run(seq, design=design, sl=slice(start, start + j), initial_state=s_start)
        assert np.array_equal(o_j, o_full[:, :j]), j


@pytest.mark.parametrize("inv,design", [("doubling", "split"), ("fwd64", "split"), ("tiled", "split")])
def test_alternative_inverses(inv, design):
    """The loop-free ("doubling"), plain forward-substitution ("fwd64") and tiled inverses, on an adversarial input
    (identical keys in every chunk, beta = 1, g ~ 0). Tolerance vs the oracle: 1e-4 for 'doubling' (its repeated
    squaring amplifies fp32 rounding on nearly parallel keys: ~3e-5 seen), 2e-5 for the others. Row-causality:
    bitwise."""
    rng = np.random.default_rng(11)
    d = random_gdn_inputs(rng, 1, 100, 1, 2, K, V, np.float32, g_kind="near_zero", beta_kind="one")
    d["k"][:] = d["k"][:, :1]
    cfg = {"inv": inv, "design": design, "prep_kernels": 1}
    out = chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")),
                                        initial_state=jnp.asarray(d["initial_state"]), interpret=True, config=cfg)
    o, s = (np.asarray(x) for x in out)
    ro, rs = gated_delta_rule_oracle(d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"])
    tol = 1e-4 if inv == "doubling" else 2e-5
    assert rel_err(o, ro) <= tol and rel_err(s, rs) <= tol
    o7 = chunk_gated_delta_rule_pallas(*(jnp.asarray(d[n][:, :7]) for n in ("q", "k", "v", "g", "beta")),
                                       initial_state=jnp.asarray(d["initial_state"]), interpret=True, config=cfg)[0]
    assert np.array_equal(np.asarray(o7), o[:, :7])


@pytest.mark.parametrize("config,match", [({"bv_out": 24}, "power of two"), ({"bv": 24}, "power of two"),
                                          ({"inv": "tile16"}, "unknown inv"), ({"design": "fast"}, "unknown design"),
                                          ({"p_ws": "fp64"}, "p_ws"), ({"bvv": 32}, "unknown config keys"),
                                          ({"wk_dtype": "bf16"}, "wk_dtype"), ({"diag": "merge"}, "unknown config"),
                                          ({"states_t": 1}, "states_t"), ({"states_t": "k"}, "states_t"),
                                          ({"states_t": "h", "design": "fused", "inv": "block16"}, "states_t"),
                                          ({"states_t": True, "design": "fused", "inv": "block16"}, "states_t"),
                                          ({"prep_kernels": 2, "design": "fused", "inv": "block16"}, "prep_kernels"),
                                          ({"skip_padding": 1}, "skip_padding"),
                                          ({"design": "fused"}, "fused design takes inv='block16'")])
def test_bad_config_is_refused(config, match):
    z = jnp.zeros((1, 64, 1, K))
    with pytest.raises(ValueError, match=match):
        chunk_gated_delta_rule_pallas(z, z, jnp.zeros((1, 64, 2, V)), jnp.zeros((1, 64, 2)), jnp.zeros((1, 64, 2)),
                                      interpret=True, config=config)


def test_a_bad_value_equal_to_a_good_one_is_refused_after_it_compiled():
    """jit's cache compares static arguments with ==, where True == 1 and 4.0 == 4: a config compiled with the good
    value must not let the equal bad one through unchecked (`config.StaticConfig` compares the values' types too)."""
    from pallas_kernels.config import StaticConfig

    z = jnp.zeros((1, 64, 1, K))
    args = (z, z, jnp.zeros((1, 64, 2, V)), jnp.zeros((1, 64, 2)), jnp.zeros((1, 64, 2)))
    for good, bad, match in (({"states_t": True}, {"states_t": 1}, "states_t"),
                             ({"warps_prep": 4}, {"warps_prep": 4.0}, "warps_prep")):
        chunk_gated_delta_rule_pallas(*args, interpret=True, config=good)
        with pytest.raises(ValueError, match=match):
            chunk_gated_delta_rule_pallas(*args, interpret=True, config=bad)
    a, b = StaticConfig({"x": 1, "y": [2, 3]}), StaticConfig({"y": (2, 3), "x": 1})
    assert a == b and hash(a) == hash(b) and dict(a) == {"x": 1, "y": (2, 3)}
    assert StaticConfig({"x": True}) != StaticConfig({"x": 1}) and StaticConfig({"y": (2, 3)}) != StaticConfig(
        {"y": (2.0, 3)})


@pytest.mark.parametrize("states_t", [None, "h", "v_new"])
def test_transposed_states_compute_the_same_bits(seq, states_t):
    """states_t=True (the default: h and v_new written transposed between the recurrence and the output kernel), or
    only h / only v_new transposed, computes the outputs, final states and checkpoints of states_t=False (both stored
    [K, V] / [T, V]) bit for bit: the same dots on the same values; the checkpoints are transposed back to
    [HV, K, V]."""
    base = run(seq, lengths=[192, 100, 37], checkpoint_stride=64, design={"states_t": False})
    got = run(seq, lengths=[192, 100, 37], checkpoint_stride=64,
              design=None if states_t is None else {"states_t": states_t})
    for a, b in zip(got, base):
        assert a.shape == b.shape and np.array_equal(a, b)


def test_lengths_are_clipped(seq):
    """A negative length is an empty row (state bit-identical, outputs zero) and a length past T is T — as the
    token-by-token kernel clips them — bitwise equal to passing 0 and T."""
    T = seq["q"].shape[1]
    o, s = run(seq, lengths=[-5, T + 40, 37])
    o0, s0 = run(seq, lengths=[0, T, 37])
    assert np.array_equal(o, o0) and np.array_equal(s, s0)
    assert np.array_equal(s[0], seq["initial_state"][0]) and not o[0].any()


def test_small_grid_launch_rule():
    """The recurrence takes V blocks of `bv_small` (and `stages_small`) on a grid of at most `small_grid` programs,
    and of `bv_tiny` (`stages_tiny`) where those give at most `tiny_grid` (DEFAULT_CONFIG) — the GPU script checks
    that the bits equal the default's on the H200 — unless the caller sets bv or stages_state, with the fused design,
    or in interpret mode (XLA:CPU's dots round differently per block width, so a row alone and the same row in a
    batch would differ: the row-alone tests here cover that)."""
    from pallas_kernels.gated_delta.chunk import DEFAULT_CONFIG, _recurrence_blocks

    HV, V128 = 32, 128

    def launch(B, config=(), interpret=False, **kw):
        c = _recurrence_blocks(dict(DEFAULT_CONFIG, **dict(config), **kw), config, B, HV, V128, interpret)
        return min(c["bv"], V128), c["stages_state"]

    assert launch(1) == (16, 3)  # 256 programs of bv 16: at most 264
    assert launch(2) == (32, 2)  # 128 programs of bv 64 (at most 132), 512 of bv 16 (more than 264)
    assert launch(3) == (64, 1) and launch(8) == (64, 1)
    assert launch(1, {"bv": 64}) == (64, 1) and launch(1, {"stages_state": 1}) == (64, 1)
    assert launch(1, interpret=True) == (64, 1) and launch(1, design="fused") == (64, 1)
    assert launch(4, {"small_grid": 1000}) == (32, 2) and launch(1, {"tiny_grid": 0}) == (32, 2)
    assert launch(2, {"tiny_grid": 512}) == (16, 3)


def test_skip_padding_changes_no_bit():
    """Config skip_padding (the default): the prep's programs on chunks of padding only (past their row's length)
    write zeros without loading or computing. Everything the prefill returns (outputs, final states, checkpoints every
    64) and the prep's own outputs (w, u, kd, gc: compared as bytes, so a zero's sign counts) equal those computed
    with skip_padding=False, on rows of mixed lengths (0, inside a chunk, on the grid, full), NaN in the padding, a
    random initial state."""
    rng = np.random.default_rng(31)
    d = random_gdn_inputs(rng, 4, 330, 1, 2, K, V, np.float32, beta_kind="mixed")
    x = {n: jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")}
    lengths = jnp.asarray([100, 0, 330, 192], jnp.int32)
    for n in ("k", "v", "g"):
        x[n] = x[n].at[0, 100:].set(jnp.nan).at[1].set(jnp.nan)
    outs = {}
    for skip in (False, True):
        call = functools.partial(chunk_gated_delta_rule_pallas, *x.values(), initial_state=jnp.asarray(
            d["initial_state"]), lengths=lengths, interpret=True)
        outs[skip] = (call(checkpoint_stride=64, config={"skip_padding": skip}),
                      call(config={"skip_padding": skip, "only_prep": True}))
    for name, a, b in zip(("o", "final", "checkpoints", "w", "u", "kd", "gc"), (*outs[False][0], *outs[False][1]),
                          (*outs[True][0], *outs[True][1])):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(b).all() if name != "o" else np.isfinite(b[0, :100]).all(), name
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), name
    gc = np.asarray(outs[True][1][3])
    assert not gc[1].any() and not gc[0, :, 128:].any() and gc[0, :, :100].any()  # padding chunks hold zeros
