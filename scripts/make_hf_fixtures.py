#!/usr/bin/env python
"""Build tiny random Hugging Face checkpoints + reference logits for jaxgdn's CI.

Run from the repo root with the (git-ignored) torch/transformers venv:

    python3 -m venv .hfvenv
    .hfvenv/bin/pip install torch==2.13.0 'transformers>=5.2' safetensors numpy
    .hfvenv/bin/python scripts/make_hf_fixtures.py

It writes two fixture folders, each a loadable Hugging Face checkpoint directory
(``config.json`` + ``model.safetensors`` [+ ``generation_config.json``]) plus

* ``expected.npz`` with
    - ``full_tokens``    int32   [2, 80]          random token ids
    - ``full_logits``    float32 [2, 80, vocab]   one uncached forward over ``full_tokens``
    - ``prefill_tokens`` int32   [2, 70]
    - ``prefill_logits`` float32 [2, 70, vocab]   forward over ``prefill_tokens`` with use_cache=True
    - ``decode_tokens``  int32   [2, 6]
    - ``decode_logits``  float32 [2, 6, vocab]    row i = logits after feeding decode token i
                                                  (one token per call, through the prefill's cache)
* ``fixture_info.json`` with the torch / transformers versions and a few facts.

Fixtures:

* ``tests/fixtures/qwen3_5_tiny``    ``qwen3_5_text`` / ``Qwen3_5ForCausalLM`` (dense MLP)
* ``tests/fixtures/qwen3_next_tiny`` ``qwen3_next``   / ``Qwen3NextForCausalLM`` (MoE on every layer)

Both: vocab 256, hidden 64, 4 layers [linear, linear, linear, full]; GDN 2 key heads /
4 value heads of 16, conv kernel 4; attention 4 heads / 2 KV heads of 16 with
partial_rotary_factor 0.25 (rotary dim 4); rms_norm_eps 1e-6; untied lm_head.

Everything runs in float32 on CPU with eager attention and transformers' pure-torch
gated-delta-rule / causal-conv1d fallbacks (fla / causal-conv1d are not installed; the
script refuses to run if they are).  After construction EVERY parameter is overwritten
with seeded random values (see ``randomize_``) so no formula bug can hide behind
zero/one initialisation.  The prefill (70 tokens) spans two 64-token chunks of the
chunked GDN kernel; decode uses the recurrent kernel and the conv-state update path.

The script checks self-consistency: full-forward logits over prefill++decode must match
prefill_logits ++ decode_logits (printed max abs diff, asserted < 1e-4).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import torch

import transformers
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"

SEED = 1234
BATCH = 2
FULL_LEN = 80
PREFILL_LEN = 70
DECODE_LEN = 6

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    # Gated DeltaNet
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    # gated full attention
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    attention_bias=False,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    max_position_embeddings=512,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def qwen3_5_config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        **COMMON,
        intermediate_size=96,
        # Real Qwen3.5 configs carry mrope_section/mrope_interleaved; with text-only
        # positions all three mrope rows are equal, so it is plain 1-D RoPE.  The section
        # here matches the tiny rotary dim (4 -> 2 frequencies).
        rope_parameters=dict(
            rope_type="default",
            rope_theta=10000.0,
            partial_rotary_factor=0.25,
            mrope_section=[1, 1, 0],
            mrope_interleaved=True,
        ),
    )


def qwen3_next_config() -> Qwen3NextConfig:
    return Qwen3NextConfig(
        **COMMON,
        intermediate_size=96,  # unused: every layer is MoE
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


@torch.no_grad()
def randomize_(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Overwrite every parameter with seeded random values of a sensible scale.

    * zero-centred RMSNorms (weight used as ``1 + w``): w ~ N(0, 0.1)
    * GDN gated norm ``linear_attn.norm.weight`` (used as plain ``w``): w ~ 1 + N(0, 0.1)
    * ``A_log`` = log(U(1, 16))
    * ``dt_bias`` ~ N(-3, 0.5): softplus(a + dt_bias) is then ~0.05, so the per-step decay
      exp(g) = exp(-A * softplus(.)) is mostly 0.4..0.95 and the recurrent state matters
      across many tokens (with dt_bias ~ N(0,1) and A up to 16 the state would be wiped
      every step and a wrong recurrence could go unnoticed).
    * ``conv1d.weight`` ~ N(0, 0.3) so the SiLU after the conv is properly non-linear
    * MoE router ``mlp.gate.weight`` ~ N(0, 0.2) (clear top-k choices, no near ties)
    * every other matrix (embeddings, projections, experts, lm_head) ~ N(0, 0.05)
    """
    for name, p in model.named_parameters():
        def normal(mean=0.0, std=1.0):
            return torch.randn(p.shape, generator=gen, dtype=torch.float32) * std + mean

        if name.endswith("linear_attn.norm.weight"):
            v = normal(1.0, 0.1)
        elif name.endswith("norm.weight"):  # input/post_attention_layernorm, q_norm, k_norm, final norm
            v = normal(0.0, 0.1)
        elif name.endswith("A_log"):
            v = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            v = normal(-3.0, 0.5)
        elif name.endswith("conv1d.weight"):
            v = normal(0.0, 0.3)
        elif name.endswith("mlp.gate.weight"):
            v = normal(0.0, 0.2)
        else:
            v = normal(0.0, 0.05)
        p.copy_(v.to(p.dtype))


def check_no_kernels() -> None:
    for mod in ("fla", "causal_conv1d", "kernels"):
        if importlib.util.find_spec(mod) is not None:
            sys.exit(f"'{mod}' is importable; uninstall it so the pure-torch reference path is used")


@torch.no_grad()
def record(model, vocab: int, gen: torch.Generator) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    def rand_tokens(n):
        return torch.randint(0, vocab, (BATCH, n), generator=gen, dtype=torch.long)

    full_tokens = rand_tokens(FULL_LEN)
    prefill_tokens = rand_tokens(PREFILL_LEN)
    decode_tokens = rand_tokens(DECODE_LEN)

    full_logits = model(input_ids=full_tokens, use_cache=False).logits

    out = model(input_ids=prefill_tokens, use_cache=True)
    prefill_logits = out.logits
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    step_logits = []
    for i in range(DECODE_LEN):
        out = model(input_ids=decode_tokens[:, i : i + 1], cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        step_logits.append(out.logits[:, -1])
    decode_logits = torch.stack(step_logits, dim=1)

    # Self-consistency: uncached forward over prefill ++ decode.
    joined = torch.cat([prefill_tokens, decode_tokens], dim=1)
    ref = model(input_ids=joined, use_cache=False).logits
    d_pre = (ref[:, :PREFILL_LEN] - prefill_logits).abs().max().item()
    d_dec = (ref[:, PREFILL_LEN:] - decode_logits).abs().max().item()
    scale = ref.abs().max().item()
    print(f"  max|logit| {scale:.4f}  logit std {ref.std().item():.4f}")
    print(f"  max diff full-vs-prefill {d_pre:.3e}   full-vs-decode {d_dec:.3e}")
    assert d_pre < 1e-4 and d_dec < 1e-4, (d_pre, d_dec)

    return dict(
        full_tokens=full_tokens.numpy().astype(np.int32),
        full_logits=full_logits.numpy().astype(np.float32),
        prefill_tokens=prefill_tokens.numpy().astype(np.int32),
        prefill_logits=prefill_logits.numpy().astype(np.float32),
        decode_tokens=decode_tokens.numpy().astype(np.int32),
        decode_logits=decode_logits.numpy().astype(np.float32),
    ), dict(max_diff_full_vs_prefill=d_pre, max_diff_full_vs_decode=d_dec)


def build(name: str, cls, config, seed: int) -> None:
    print(f"== {name}: {cls.__name__} ({config.model_type})")
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    config._attn_implementation = "eager"
    model = cls(config).to(torch.float32).eval()
    randomize_(model, gen)

    out_dir = FIXTURES / name
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.iterdir():  # start clean (only files this script writes live here)
        if f.is_file():
            f.unlink()
    model.save_pretrained(out_dir, safe_serialization=True)

    # Reload from disk so the logits are those of exactly what was saved, and make sure
    # nothing was dropped / renamed / re-initialised on the round trip.
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    model = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    loaded = model.state_dict()
    assert saved.keys() == loaded.keys(), set(saved) ^ set(loaded)
    for k, v in saved.items():
        assert torch.equal(v, loaded[k]), f"{k} changed on save/load round trip"
    arrays, diffs = record(model, config.vocab_size, gen)
    np.savez(out_dir / "expected.npz", **arrays)

    info = dict(
        model_type=config.model_type,
        architecture=cls.__name__,
        transformers_version=transformers.__version__,
        torch_version=torch.__version__,
        seed=seed,
        dtype="float32",
        attn_implementation="eager",
        gdn_kernels="transformers pure-torch fallback (chunk_size 64 prefill, recurrent decode)",
        **diffs,
    )
    (out_dir / "fixture_info.json").write_text(json.dumps(info, indent=2) + "\n")
    for f in sorted(out_dir.iterdir()):
        print(f"  {f.name:28s} {f.stat().st_size:9d} B")


def main() -> None:
    check_no_kernels()
    torch.set_default_dtype(torch.float32)
    torch.use_deterministic_algorithms(True)
    print(f"torch {torch.__version__}  transformers {transformers.__version__}")
    build("qwen3_5_tiny", Qwen3_5ForCausalLM, qwen3_5_config(), SEED)
    build("qwen3_next_tiny", Qwen3NextForCausalLM, qwen3_next_config(), SEED + 1)


if __name__ == "__main__":
    main()
