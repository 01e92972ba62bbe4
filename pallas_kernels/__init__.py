"""Kernels for the gated delta rule: a pure-JAX reference and Pallas GPU kernels behind one dispatcher."""

from .api import (attention_invariant, cache_attention, chunk_gated_delta_rule, chunk_replay_prime, chunk_replay_step,
                  chunk_replay_step_packed, expert_down, fused_recurrent_gated_delta_rule, matmul_invariant,
                  recurrent_gated_delta_rule, replay_caches, replay_step_matches_prefill,
                  REPLAY_STEP_VERIFIED_HEADS)
from .backend import BACKENDS, resolve_backend
from .gated_delta.reference import CHUNK, gdn_gates, l2_normalize

__all__ = ["chunk_gated_delta_rule", "chunk_replay_step", "chunk_replay_step_packed", "chunk_replay_prime",
           "replay_caches", "replay_step_matches_prefill", "REPLAY_STEP_VERIFIED_HEADS",
           "fused_recurrent_gated_delta_rule", "recurrent_gated_delta_rule", "expert_down", "matmul_invariant",
           "cache_attention", "attention_invariant", "BACKENDS", "resolve_backend", "CHUNK", "gdn_gates",
           "l2_normalize"]
