"""scripts/precision_screen.py's emulation of the tensor cores' operand rounding (its accuracy figures in
BENCHMARKS.md rest on it)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from scripts.precision_screen import emulated_dot, tf32


def test_tf32_keeps_ten_mantissa_bits_rounding_half_away():
    one = np.float32(1.0)
    ulp = np.float32(2.0 ** -10)  # TF32's spacing at 1
    x = jnp.asarray([1.0, 1.0 + 2.0 ** -12, 1.0 + 3 * 2.0 ** -12, 1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11),
                     1.0 + 2.0 ** -10, 3.0e-20], jnp.float32)
    got = np.asarray(tf32(x))
    assert got[0] == one and got[1] == one  # exact, and below half an ulp: down
    assert got[2] == one + ulp and got[3] == one + ulp  # above half, and the tie: away from zero
    assert got[4] == -(one + ulp) and got[5] == one + ulp  # ties away on the negative side; representable: kept
    bits = np.asarray(got).view(np.uint32)
    assert not (bits & 0x1FFF).any()  # 13 low mantissa bits cleared everywhere, tiny values included


def test_emulated_dot_rounds_operands_then_sums_in_fp32():
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((32, 8)), jnp.float32)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    for prec, rnd in (("bf16", lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)), ("tf32", tf32),
                      ("fp16", lambda x: x.astype(jnp.float16).astype(jnp.float32))):
        want = np.asarray(rnd(a), np.float64) @ np.asarray(rnd(b), np.float64)
        got = np.asarray(emulated_dot(a, b, prec, True), np.float64)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()  # fp32 sums of the rounded products
        assert np.abs(got - exact).max() > 1e-4  # the rounding is there: not the fp32 dot
    np.testing.assert_allclose(np.asarray(emulated_dot(a.T, b, "ieee", True, trans_a=True)), exact, rtol=1e-5,
                               atol=1e-5)


def test_emulated_bf16x3_is_near_fp32():
    """Three bf16 products (the operands' hi and lo halves; `wy.dot`'s "bf16x3") lose only the lo x lo term:
    within ~2^-16 of the float64 product where one bf16 dot is ~2^-8 off."""
    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((128, 16)), jnp.float32)
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    scale = np.abs(exact).max()
    err3 = np.abs(np.asarray(emulated_dot(a, b, "bf16x3", True), np.float64) - exact).max() / scale
    err1 = np.abs(np.asarray(emulated_dot(a, b, "bf16", True), np.float64) - exact).max() / scale
    assert err3 < 2.0 ** -14 and err1 > 2.0 ** -9 and err1 > 100 * err3
