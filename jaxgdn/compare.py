"""Numerical comparison of recurrent states reached two ways (e.g. prefill vs prefill-then-decode)."""

from __future__ import annotations

import dataclasses

import numpy as np

from .model import gdn_states
from .state import ModelState


@dataclasses.dataclass(frozen=True)
class StateDiff:
    layer: int  # index among the model's layers
    max_abs: float
    mean_abs: float
    rel: float  # ||a - b|| / ||b||
    max_ulp: int  # largest distance in units of fp32 last place
    frac_equal: float  # fraction of elements bitwise equal


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise distance in fp32 ULPs (ordered-integer trick; +0 and -0 are 0 apart)."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return np.abs(ia - ib)


def diff_arrays(a, b, layer: int = -1) -> StateDiff:
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return StateDiff(layer=layer, max_abs=float(d.max()), mean_abs=float(d.mean()),
                     rel=float(np.linalg.norm(d) / max(np.linalg.norm(b.astype(np.float64)), 1e-30)),
                     max_ulp=int(ulp_distance(a, b).max()), frac_equal=float(np.mean(a == b)))


def compare_gdn_states(a: ModelState, b: ModelState, layer_ids) -> list[StateDiff]:
    """Per GDN layer: how the fp32 recurrent state of `a` differs from `b` (the reference)."""
    return [diff_arrays(x.recurrent, y.recurrent, i) for i, x, y in zip(layer_ids, gdn_states(a), gdn_states(b))]


def format_table(diffs: list[StateDiff], title: str) -> str:
    lines = [title, f"{'layer':>5} {'max abs':>10} {'mean abs':>10} {'rel diff':>10} {'max ULP':>9} {'bitwise eq':>10}"]
    for d in diffs:
        lines.append(f"{d.layer:>5} {d.max_abs:>10.3e} {d.mean_abs:>10.3e} {d.rel:>10.3e} {d.max_ulp:>9d} "
                     f"{d.frac_equal:>10.1%}")
    return "\n".join(lines)
