"""Accuracy of the chunked prefill's dot precisions (`chunk.DEFAULT_CONFIG`'s p_* keys), screened on a CPU.

  PYTHONPATH=. .venv/bin/python scripts/precision_screen.py [--config '{"p_ws": "bf16"}' ...]

Interpret mode computes every dot in fp32 whatever p_* says, so on its own it cannot tell TF32 from bf16. Here each
dot's operands are first rounded as the H200's tensor cores take them — "bf16" and "fp16": round to nearest even;
"tf32": a 10-bit mantissa, round half away from zero (`cvt.rna.tf32.f32`) — then multiplied and summed in fp32
("tf32x3" and "ieee" stay fp32; "bf16x3": the three products of the bf16 halves), and the outputs and final states
are compared with the float64 oracle (relative Frobenius error, the bar of issue 3: 2e-3). The accumulation order is
XLA:CPU's, not the tensor cores', so the figures are an estimate: on 2026-11-30 the default read 1.71e-3 / 2.96e-4
here (T256, beta = 1) against 1.71e-3 / 2.97e-4 measured on the H200 for the same kind of case (BENCHMARKS.md, run
32), and 1.78e-3 / 8.61e-4 on identical keys against 1.76e-3 / 7.97e-4 there (other random data). w and kd are stored
in fp16 as on the GPU; every case starts from a non-zero initial state, as the GPU script's do.
"""

from __future__ import annotations

import argparse
import json

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.gated_delta import wy
from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from tests.gdn_oracle import gated_delta_rule_oracle, random_gdn_inputs, rel_err

CONFIGS = {
    "default (TF32 dots, the gram tiles and q k^T in fp16)": {},
    "q k^T in TF32 (the default before run 122)": dict(p_qk="tf32"),
    "bf16 recurrence and output dots": dict(p_ws="bf16", p_kv="bf16", p_qs="bf16", p_av="bf16"),
    "bf16 output dots": dict(p_qs="bf16", p_av="bf16"),
    "bf16 recurrence dots": dict(p_ws="bf16", p_kv="bf16"),
    "bf16 everywhere but the inverse": dict(p_ws="bf16", p_kv="bf16", p_qs="bf16", p_av="bf16", p_kk="bf16",
                                            p_wu="bf16", p_qk="bf16"),
    # the gram tiles as one bf16 dot (the default before 2026-12-02's run 114), as three bf16 dots of the keys' halves
    # (exact products; the default in runs 114-116); the default since run 117 is one fp16 dot on the normalised keys
    "gram as one bf16 dot": dict(p_kk="bf16"),
    "gram as three bf16 dots (runs 114-116's default)": dict(p_kk="bf16x3"),
}
CASES = [("T256, beta = 1", dict(B=1, T=256, HK=2, HV=4), dict(beta_kind="one")),
         ("T130, realistic", dict(B=2, T=130, HK=2, HV=4), dict()),
         ("T1024, realistic", dict(B=1, T=1024, HK=1, HV=2), dict()),
         ("T128, identical keys", dict(B=1, T=128, HK=1, HV=2), dict(g_kind="near_zero", beta_kind="one")),
         # random keys, g ~ 0, beta = 1: where the default's bf16 gram tiles put the output at the 2e-3 bar on the
         # H200 (runs 109-110)
         ("T128, random keys", dict(B=1, T=128, HK=1, HV=2), dict(g_kind="near_zero", beta_kind="one"))]


def tf32(x):
    """fp32 rounded to TF32 (10 explicit mantissa bits), half away from zero, as `cvt.rna.tf32.f32`."""
    b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    b = (b + jnp.uint32(0x1000)) & jnp.uint32(0xFFFFE000)
    return lax.bitcast_convert_type(b, jnp.float32)


_FP32_DOT = wy.dot  # in interpret mode: an fp32 dot (HIGHEST precision) whatever the precision named


def emulated_dot(a, b, prec, interpret, *, trans_a=False, trans_b=False):
    """`wy.dot` with the operands rounded as the tensor cores take them for `prec`, fp32 products and sums
    ("bf16x3": the three products of the operands' bf16 halves, summed as `wy.dot` sums them)."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if prec == "bf16x3":  # `wy.dot`'s halves, held in fp32
        (a_hi, a_lo), (b_hi, b_lo) = ([h.astype(jnp.float32) for h in wy.bf16_halves(x)] for x in (a, b))
        kw = dict(trans_a=trans_a, trans_b=trans_b)
        return ((_FP32_DOT(a_hi, b_lo, "ieee", True, **kw) + _FP32_DOT(a_lo, b_hi, "ieee", True, **kw))
                + _FP32_DOT(a_hi, b_hi, "ieee", True, **kw))
    if prec in ("bf16", "fp16"):
        dt = jnp.bfloat16 if prec == "bf16" else jnp.float16
        a, b = (x.astype(dt).astype(jnp.float32) for x in (a, b))
    elif prec == "tf32":
        a, b = tf32(a), tf32(b)
    return _FP32_DOT(a, b, prec, True, trans_a=trans_a, trans_b=trans_b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", action="append", default=[], help="JSON of p_* keys to screen as well (repeatable)")
    args = ap.parse_args()
    configs = dict(CONFIGS, **{c: json.loads(c) for c in args.config})
    wy.dot = emulated_dot  # this process only: every kernel dot below goes through the emulation
    rng = np.random.default_rng(0)
    for name, shp, kinds in CASES:
        d = random_gdn_inputs(rng, shp["B"], shp["T"], shp["HK"], shp["HV"], 128, 128, np.float32, **kinds)
        if "identical" in name:
            d["k"][:] = d["k"][:, :1]
        x = {n: jnp.asarray(d[n], jnp.bfloat16) for n in "qkv"}  # bf16 inputs, as on the GPU
        x.update(g=jnp.asarray(d["g"], jnp.float32), beta=jnp.asarray(d["beta"], jnp.float32),
                 s0=jnp.asarray(d["initial_state"], jnp.float32))  # a non-zero initial state, as the GPU script's
        ro, rs = gated_delta_rule_oracle(*(np.asarray(x[n], np.float64) for n in ("q", "k", "v", "g", "beta")),
                                         initial_state=np.asarray(x["s0"], np.float64))
        for cname, cfg in configs.items():
            o, s = chunk_gated_delta_rule_pallas(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["s0"],
                                                 interpret=True, config=dict(cfg, wk_dtype="float16"))
            eo, es = rel_err(np.asarray(o, np.float32), ro), rel_err(np.asarray(s), rs)
            flag = "" if max(eo, es) <= 2e-3 else "  > 2e-3"
            print(f"{name:22s} {cname:34s} outputs {eo:.2e}  states {es:.2e}{flag}", flush=True)


if __name__ == "__main__":
    main()
