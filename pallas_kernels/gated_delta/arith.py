"""Element-wise fp32 arithmetic whose rounding the kernels fix themselves instead of leaving it to the compiler.

A multiply followed by an add may be contracted into one FMA (one rounding instead of two) by LLVM or by ptxas
(PTX's `mul.f32` / `add.f32` without a rounding mode allow it), and whether it is depends on the code around it:
offline (PyPI's Triton 3.6, `scripts/ptxas_report.py --dump`) the chunked prefill's state update exp(gc_last) S +
kd^T v_new compiled to `fma.rn.f32` while the replay step's copy of it became a multiply, a layout conversion and
an add; on the H200 (XLA's Triton) the prefill's was not fused at K = V = 128 (BENCHMARKS.md, runs 93-94). Where
two kernels must agree bit for bit, the rounding is written out: `mul_rn` (a multiply nothing may contract) or
`fma`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fma(a, b, c, fused: bool):
    """a * b + c (broadcast). fused (on the GPU): one PTX `fma.rn.f32` per element, a single rounding whatever
    layouts the operands have (the decode kernel's, where Triton had left a multiply and an add: Nsight Compute,
    run 14); not fused (interpret mode, or a config that turns it off): a multiply and an add, two roundings
    (XLA:CPU does not contract them)."""
    return _ptx("fma.rn.f32 $0, $1, $2, $3;", a, b, c) if fused else a * b + c


def mul_rn(a, b, exact: bool):
    """a * b (broadcast), rounded on its own. exact (on the GPU): PTX `mul.rn.f32`, which neither LLVM nor ptxas
    contracts with a following add; otherwise (interpret mode: XLA:CPU does not contract) a plain multiply."""
    return _ptx("mul.rn.f32 $0, $1, $2;", a, b) if exact else a * b


def _ptx(asm: str, *args):
    """One fp32 PTX instruction per element of the broadcast operands (Triton inline assembly: the GPU only)."""
    from jax.experimental.pallas import triton as pltriton

    args = jnp.broadcast_arrays(*args)
    return pltriton.elementwise_inline_asm(asm, args=list(args), constraints="=f" + ",f" * len(args), pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, args[0].dtype)])[0]


def fma_mode(fused, interpret: bool) -> bool:
    """A config's FMA switch (a bool) as the kernels use it: never in interpret mode (no PTX there)."""
    if fused not in (True, False):
        raise ValueError(f"fma={fused!r}: expected True or False")
    return bool(fused) and not interpret
