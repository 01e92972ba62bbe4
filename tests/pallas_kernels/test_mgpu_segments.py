"""The speculative segmented recurrence (`recurrence_mgpu.segmented_recurrence`, chunk config `recurrence_segments`):
the Mosaic GPU recurrence cut into segments run at once, all but the first from a zero state, then checked at each
boundary and recomputed where the check fails. Its claim is bitwise: whatever the gates, h (the state at every chunk
start), v_new and the final state equal the unsegmented recurrence's, bit for bit — in Mosaic GPU's interpret mode
here (CPU), on the H200 in `scripts/gpu_segments.py`. Each case also asserts which way the check went, so that both
paths (the speculative states kept; the rest of a segment recomputed) are the ones exercised.

Shapes: K = 32, V = 64 (the kernel's V block), eight chunks (T = 500: not a multiple of 64, the rows of different
lengths), a non-zero initial state. The kernel runs here in its one-warpgroup form (`warp_specialised=False`, the
same bits as the default's: `test_mgpu_recurrence.py`, and on the H200 run 130): the interpreter runs a
warp-specialised kernel's warpgroups as threads, and inside the segmented form's while loop that deadlocked on this
2-core machine (a barrier wait; seen on 2026-12-05 in a pytest run, never in the same calls from a script). The
default form with segments is checked where it runs, on the H200.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.gated_delta.chunk import chunk_gated_delta_rule_pallas
from pallas_kernels.gated_delta.recurrence_mgpu import segmented_recurrence, state_recurrence_mgpu
from tests.gdn_oracle import random_gdn_inputs

K, V, HK, HV, B, T = 32, 64, 1, 2, 2, 500
LENGTHS = [500, 311]
WK16 = dict(wk_dtype="float16")  # w and kd stored in fp16, as the prep stores them on the GPU (the kernel's input)


def gates(kind: str, rng):
    """(g, beta) [B, T, HV]: "forget" (g in [-12, -6]: a chunk's decay underflows, the initial state's part is gone
    after one chunk), "keep" (g = -1e-4, beta = 0.01: the initial state's part outlives every window here) or "mixed"
    (head 0 forgets, head 1 keeps: one head is enough to fail a check)."""
    forget = (-rng.uniform(6.0, 12.0, (B, T, HV)), 1.0 / (1.0 + np.exp(-rng.standard_normal((B, T, HV)))))
    keep = (np.full((B, T, HV), -1e-4), np.full((B, T, HV), 0.01))
    if kind == "mixed":
        return tuple(np.stack([f[..., 0], k[..., 1]], -1) for f, k in zip(forget, keep))
    return forget if kind == "forget" else keep


@functools.lru_cache(maxsize=None)
def case(kind: str):
    rng = np.random.default_rng(11)
    d = random_gdn_inputs(rng, B, T, HK, HV, K, V)
    d["g"], d["beta"] = (x.astype(np.float32) for x in gates(kind, rng))
    prep = chunk_gated_delta_rule_pallas(
        *(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=jnp.asarray(d["initial_state"]),
        lengths=jnp.asarray(LENGTHS, jnp.int32), interpret=True, config=dict(stop_after="prep", **WK16))
    return d, prep


@functools.lru_cache(maxsize=None)
def _run(segments: int, window: int):
    return jax.jit(functools.partial(segmented_recurrence, segments=segments, window=window, warp_specialised=False,
                                     interpret=True))


def run(kind, segments, window):
    d, (w, u, kd, gc) = case(kind)
    return [np.asarray(x) for x in _run(segments, window)(w, u, kd, gc, jnp.asarray(d["initial_state"]))]


@pytest.mark.parametrize("kind,segments,window,passes", [
    ("forget", 2, 1, [True]), ("forget", 2, 4, [True]),
    # the last boundary (chunk 6) lies in row 1's padding (311 tokens: chunks 5-7), where g = 0 forgets nothing
    ("forget", 4, 1, [True, True, False]),
    ("keep", 2, 1, [False]), ("keep", 4, 1, [False] * 3), ("keep", 2, 2, [False]),
    ("mixed", 2, 1, [False]),
])
def test_segmented_is_bitwise_the_unsegmented_recurrence(kind, segments, window, passes):
    """h, v_new and the final state bitwise equal to one segment's, and each boundary's check went the way the
    gates say (window = 4 with 2 segments: the window is the whole segment, recomputed in full)."""
    *got, passed = run(kind, segments, window)
    *want, none = run(kind, 1, 1)
    assert none.shape == (0,)
    for name, g, w in zip(("h", "v_new", "final"), got, want):
        assert g.shape == w.shape, name
        assert np.array_equal(g.view(np.int32), w.view(np.int32)), name
    assert passed.tolist() == passes


def test_the_speculative_states_differ_before_the_check():
    """The check is not vacuous: a segment started from zero (the speculative run, before any boundary is checked)
    gives other states than the true recurrence inside its first chunk, even where the gates forget."""
    d, (w, u, kd, gc) = case("forget")
    s0 = jnp.asarray(d["initial_state"])
    rec = functools.partial(state_recurrence_mgpu, warp_specialised=False, interpret=True)
    h, _, _ = (np.asarray(x) for x in rec(w, u, kd, gc, s0))
    h_zero, _, _ = (np.asarray(x) for x in rec(w[:, :, 256:], u[:, :, 256:], kd[:, :, 256:], gc[:, :, 256:],
                                               jnp.zeros_like(s0)))
    assert not np.array_equal(h[:, :, 4], h_zero[:, :, 0])  # the state at the boundary itself: S vs 0
    assert np.array_equal(h[:, :, 6], h_zero[:, :, 2])  # two chunks on, the forgetting gates made them one


@pytest.mark.parametrize("segments,window,match", [(3, 1, "segments"), (2, 5, "window"), (0, 1, "segments"),
                                                   (2, 0, "window")])
def test_bad_segment_arguments_are_refused(segments, window, match):
    d, (w, u, kd, gc) = case("forget")
    with pytest.raises(ValueError, match=match):
        segmented_recurrence(w, u, kd, gc, jnp.asarray(d["initial_state"]), segments=segments, window=window,
                             warp_specialised=False, interpret=True)


def test_lowers_for_an_h200_with_segments():
    """The segmented form (a launch of twice the programs, the in-place window and rest launches inside a while loop)
    lowers for CUDA at K = V = 128, and the in-place launches alias their h and v_new."""
    sds = jax.ShapeDtypeStruct
    args = (sds((1, 4, 1024, 128), jnp.float16), sds((1, 4, 1024, 128), jnp.float32),
            sds((1, 4, 1024, 128), jnp.float16), sds((1, 4, 1024), jnp.float32), sds((1, 4, 128, 128), jnp.float32))
    fn = jax.jit(functools.partial(state_recurrence_mgpu, segments=2, window=2))
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 3 and "output_operand_alias" in text


def prefill(d, **config):
    out = chunk_gated_delta_rule_pallas(
        *(jnp.asarray(d[n]) for n in ("q", "k", "v", "g", "beta")), initial_state=jnp.asarray(d["initial_state"]),
        lengths=jnp.asarray(LENGTHS, jnp.int32), interpret=True, checkpoint_stride=128,
        config={"recurrence": "mosaic", "recurrence_ws": False, **WK16, **config})
    return [np.asarray(x) for x in out]


@pytest.mark.parametrize("kind", ["forget", "keep"])
def test_prefill_with_segments_is_bitwise_the_prefill_without(kind):
    """Through the prefill (config recurrence_segments, segment_window): outputs, final states and in-call
    checkpoints equal the unsegmented prefill's, bit for bit."""
    d, _ = case(kind)
    got = prefill(d, recurrence_segments=2, segment_window=1)
    want = prefill(d, recurrence_segments=1)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("config,match", [
    (dict(recurrence_segments=3), "do not split"),  # 8 chunks
    (dict(recurrence_segments=8, segment_window=2), "do not split"),
    (dict(recurrence_segments="many"), "recurrence_segments="),
    (dict(segment_window=0), "segment_window="),
    (dict(recurrence="triton", recurrence_segments=2), "needs the Mosaic GPU recurrence"),
])
def test_bad_segment_configs_are_refused(config, match):
    d, _ = case("forget")
    with pytest.raises(ValueError, match=match):
        prefill(d, **config)


def test_auto_segments_fill_idle_sms_only():
    """recurrence_segments="auto" (`chunk._segments`, H200: 132 SMs): 2 segments for the 64 programs of B = 1, HV = 32
    (issue 3's B = 1 shapes), 4 for HV = 16, none where the grid already fills the GPU (B = 8) or the segments would
    be shorter than four windows; 1 in interpret mode; an explicit count as given."""
    from pallas_kernels.gated_delta.chunk import DEFAULT_CONFIG, _segments

    auto = dict(DEFAULT_CONFIG, recurrence_segments="auto", segment_window=4)
    assert _segments(auto, 1, 32, 128, 512, False, sms=132) == 2
    assert _segments(auto, 1, 16, 128, 512, False, sms=132) == 4
    assert _segments(auto, 8, 32, 128, 64, False, sms=132) == 1
    assert _segments(auto, 1, 32, 128, 24, False, sms=132) == 1  # 12-chunk segments: fewer than four windows
    assert _segments(auto, 1, 32, 128, 32, False, sms=132) == 2
    assert _segments(auto, 1, 16, 128, 36, False, sms=132) == 2  # 36 = 4 * 9: 9-chunk segments at 4 are too short
    assert _segments(auto, 1, 32, 128, 512, True, sms=132) == 1
    assert _segments(dict(auto, recurrence_segments=4), 8, 32, 128, 64, False, sms=132) == 4
    assert _segments(dict(auto, recurrence_segments=1), 1, 32, 128, 3, False, sms=132) == 1  # (any chunk count)
