"""Numerical comparison of recurrent states reached two ways (e.g. prefill vs prefill-then-decode)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from pallas_kernels import CHUNK

from .errors import InputError, index_value
from .model import gdn_states
from .state import GDNLayerState, ModelState

# ulp_distance between a NaN and a number: beyond any distance between two numbers (at most 0xFF000000, -inf to inf)
ULP_NAN = 2**32


@dataclasses.dataclass(frozen=True)
class StateDiff:
    layer: int  # index among the model's layers
    max_abs: float  # NaN when either array holds a NaN (as are mean_abs and rel)
    mean_abs: float
    rel: float  # ||a - b|| / ||b||
    max_ulp: int  # largest distance in units of fp32 last place (`ulp_distance`)
    frac_equal: float  # fraction of elements bitwise equal (+0 and -0 are not; two NaNs of the same bits are)


def as_fp32(x, what: str) -> np.ndarray:
    """`x` (a NumPy or JAX array, or numbers) as fp32 values: floating-point values that fp32 holds exactly (fp32,
    bf16, fp16; float64 values only where rounding leaves them unchanged). InputError otherwise: integers, bools
    and complex numbers are not states, and rounding float64 values would make different values look equal."""
    a = np.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise InputError(f"{what} must be a floating-point array; got {a.dtype}")
    out = a.astype(np.float32)
    if a.dtype.itemsize > 4:
        kept = (out.astype(a.dtype) == a) | (np.isnan(a) & np.isnan(out))
        if not np.all(kept):
            raise InputError(f"{what} holds {a.dtype} values fp32 cannot hold exactly (comparisons are in fp32 "
                             "units: round it to fp32 first if that is meant)")
    return out


def same_shape(a: np.ndarray, b: np.ndarray, what: str = "the arrays") -> None:
    """InputError unless `a` and `b` have one shape (NumPy would broadcast, e.g. one row against a whole batch)."""
    if a.shape != b.shape:
        raise InputError(f"{what} differ in shape: {a.shape} against {b.shape} (nothing is broadcast)")


def ulp_distance(a, b) -> np.ndarray:
    """Elementwise distance in fp32 ULPs, int64, of two arrays of one shape (as fp32: `as_fp32`): the number of fp32
    values from one to the other, counted on the ordered-integer line of their bits. +0 and -0 are 0 apart, the
    smallest subnormals of either sign 2; inf is one ULP beyond the largest finite value. Two NaNs (any sign or
    payload) are 0 apart, a NaN and a number ULP_NAN (2**32), more than any two numbers are (-inf to inf:
    0xFF000000). InputError for arrays of other shapes or non-floating dtypes."""
    fa, fb = as_fp32(a, "a"), as_fp32(b, "b")
    same_shape(fa, fb)
    ia, ib = _ordered(fa), _ordered(fb)
    d = np.abs(ia - ib)
    na, nb = np.isnan(fa), np.isnan(fb)
    return np.where(na & nb, 0, np.where(na | nb, ULP_NAN, d))


def _ordered(x: np.ndarray) -> np.ndarray:
    """fp32 bits as int64 integers in the order of the values (-0 and +0 both 0)."""
    i = x.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def diff_arrays(a, b, layer: int = -1) -> StateDiff:
    """How `a` differs from `b` (the reference): arrays of one shape, compared as fp32 (`as_fp32`), differences in
    float64. `layer` labels the result. InputError for other shapes, empty or non-floating arrays."""
    a, b = as_fp32(a, "a"), as_fp32(b, "b")
    same_shape(a, b)
    if a.size == 0:
        raise InputError("nothing to compare: the arrays are empty")
    bitwise = a.view(np.int32) == b.view(np.int32)
    with np.errstate(invalid="ignore", over="ignore"):  # infinities and NaNs: NaN or inf fields, no warnings
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        rel = float(np.linalg.norm(d) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))
    return StateDiff(layer=layer, max_abs=float(d.max()), mean_abs=float(d.mean()), rel=rel,
                     max_ulp=int(ulp_distance(a, b).max()), frac_equal=float(np.mean(bitwise)))


def gdn_layer_ids(state: ModelState) -> tuple[int, ...]:
    """The indices, among the state's layers, of its GDN layers (`ModelConfig.gdn_layers` of its model)."""
    return tuple(i for i, s in enumerate(state.layers) if isinstance(s, GDNLayerState))


def compare_gdn_states(a: ModelState, b: ModelState, layer_ids=None) -> list[StateDiff]:
    """Per GDN layer: how the fp32 recurrent state of `a` differs from `b` (the reference), labelled by the layer's
    index among the model's layers. `layer_ids`: those indices (`config.gdn_layers`), or None to read them from
    the states. InputError when the states differ in their GDN layers or shapes (states of other models or batch
    sizes; nothing is broadcast), when only one keeps replay decode's open chunk and rows lie off the 64-token grid
    (its `recurrent` is then the state at the last grid boundary), or when `layer_ids` are not the states' GDN
    layers."""
    _check_comparable(a, b)
    ids = _checked_layer_ids(gdn_layer_ids(a), layer_ids)
    out = []
    for i, x, y in zip(ids, gdn_states(a), gdn_states(b)):
        try:
            out.append(diff_arrays(x.recurrent, y.recurrent, i))
        except InputError as e:
            raise InputError(f"layer {i}: {e}") from None
    return out


def _check_comparable(a: ModelState, b: ModelState) -> None:
    """Two ModelStates with GDN layers at the same places whose recurrent states mean the same positions."""
    for name, s in (("a", a), ("b", b)):
        if not isinstance(s, ModelState):
            raise InputError(f"{name} must be a jaxgdn ModelState; got {type(s).__name__}")
    if gdn_layer_ids(a) != gdn_layer_ids(b):
        raise InputError(f"the states' GDN layers differ: layers {list(gdn_layer_ids(a))} of a against "
                         f"{list(gdn_layer_ids(b))} of b (states of other models)")
    _check_same_meaning(a, b)


def _checked_layer_ids(ids: tuple[int, ...], layer_ids) -> tuple[int, ...]:
    """`ids` (the states' GDN layers), after checking `layer_ids` (None, or those same indices)."""
    if layer_ids is None:
        return ids
    try:
        given = tuple(index_value(i) for i in layer_ids)
    except TypeError:
        raise InputError(f"layer_ids must be a sequence of integer layer indices; got {layer_ids!r}") from None
    if given != ids:
        raise InputError(f"layer_ids {list(given)} are not the states' GDN layers {list(ids)} "
                         "(pass the model's config.gdn_layers, or None)")
    return ids


def _check_same_meaning(a: ModelState, b: ModelState) -> None:
    """A state with replay decode's open-chunk buffers keeps in `recurrent` the state at the last 64-token grid
    boundary, not at its position: against a state without them, only rows on the grid compare like with like."""
    ga, gb = gdn_states(a), gdn_states(b)
    if not ga or (ga[0].open_qkv is None) == (gb[0].open_qkv is None):
        return
    positions = [np.asarray(s.position) for s in (a, b)]
    if any(np.any(p % CHUNK != 0) for p in positions):
        raise InputError(f"one state keeps replay decode's open chunk (its recurrent state is the one at the last "
                         f"{CHUNK}-token boundary) and the other does not, and rows lie off the grid (positions "
                         f"{positions[0].tolist()} and {positions[1].tolist()}): their recurrent states are of "
                         "different positions")


def _percent(frac: float) -> str:
    """`frac` as a percentage with one decimal, where a fraction below 1 never reads 100.0% (99.96% would round up
    to it, with elements unequal)."""
    text = f"{frac:.1%}"
    return "99.9%" if text == "100.0%" and frac < 1 else text


def format_table(diffs: list[StateDiff], title: str) -> str:
    """`diffs` as a text table under `title`, one row per StateDiff, columns aligned for every value: "max ULP"
    holds up to ULP_NAN (10 digits), and "bitwise eq" reads 100.0% only when every element is."""
    lines = [title, f"{'layer':>5} {'max abs':>10} {'mean abs':>10} {'rel diff':>10} {'max ULP':>10} "
                    f"{'bitwise eq':>10}"]
    for d in diffs:
        lines.append(f"{d.layer:>5} {d.max_abs:>10.3e} {d.mean_abs:>10.3e} {d.rel:>10.3e} {d.max_ulp:>10d} "
                     f"{_percent(d.frac_equal):>10}")
    return "\n".join(lines)
