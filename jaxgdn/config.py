"""Model configuration: a frozen, hashable description of a Qwen3.5 / Qwen3-Next hybrid model.

Built from a Hugging Face `config.json` (`from_hf_config`) or from a preset (`tiny_qwen3_5`, `tiny_qwen3_next`,
`qwen3_5_9b`). Hashable so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError, UnsupportedModelError

LINEAR = "linear_attention"
FULL = "full_attention"
SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "qwen3_5_text" or "qwen3_next" (a "qwen3_5" checkpoint is read through its text_config)
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]  # LINEAR (GDN) or FULL (gated attention), one per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # dense MLP
    intermediate_size: int
    # mixture of experts (Qwen3-Next); num_experts == 0 means every layer is dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Channel order of the GDN q/k/v projection (`in_proj_qkv`, `conv_weight`, the conv state): 1 is Hugging Face's
    # [q (HK*K) | k (HK*K) | v (HV*V)]; G > 1 is G groups of [q_g | k_g | v_g], each holding HK/G key heads and their
    # value heads. `jaxgdn.sharding` uses G = HK for a model split over heads, so every shard's q, k and v are local.
    gdn_qkv_groups: int = 1

    def __post_init__(self):
        if any(t not in (LINEAR, FULL) for t in self.layer_types):
            raise ValueError(f"layer_types must be {LINEAR!r} or {FULL!r}; got {self.layer_types}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.gdn_qkv_groups < 1 or self.linear_num_key_heads % self.gdn_qkv_groups:
            raise ValueError(f"gdn_qkv_groups ({self.gdn_qkv_groups}) must divide linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary dim {self.rotary_dim} must be even and in (0, head_dim]")

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_key_dim(self) -> int:  # HK * K
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:  # HV * V
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:  # C = 2*HK*K + HV*V
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    def is_moe_layer(self, i: int) -> bool:
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    # ---- Hugging Face ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed `config.json` (model_type qwen3_5 — via its text_config —, qwen3_5_text, qwen3_next)."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; jaxgdn supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        if model_type == "qwen3_5":
            if "text_config" not in cfg:
                raise CheckpointError("qwen3_5 config.json has no text_config")
            cfg = dict(cfg["text_config"], model_type="qwen3_5_text",
                       tie_word_embeddings=cfg["text_config"].get("tie_word_embeddings",
                                                                  cfg.get("tie_word_embeddings", False)))
            model_type = "qwen3_5_text"
        try:
            n = cfg["num_hidden_layers"]
            layer_types = cfg.get("layer_types")
            if layer_types is None:
                interval = cfg.get("full_attention_interval", 4)
                layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
            if len(layer_types) != n:
                raise CheckpointError(f"layer_types has {len(layer_types)} entries for {n} layers")
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
            partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
            if rope.get("rope_type", "default") not in ("default", None):
                raise UnsupportedModelError(f"rope_type {rope.get('rope_type')!r} is not supported")
            act = cfg.get("hidden_act", "silu")
            if act not in ("silu", "swish"):  # the MLPs and experts are SwiGLU
                raise UnsupportedModelError(f"hidden_act {act!r} is not supported (jaxgdn's MLPs use silu)")
            moe = model_type == "qwen3_next" and cfg.get("num_experts", 0) > 0
            return cls(
                model_type=model_type,
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                layer_types=tuple(layer_types),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                num_attention_heads=cfg["num_attention_heads"],
                num_key_value_heads=cfg["num_key_value_heads"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                rope_theta=float(rope_theta),
                partial_rotary_factor=float(partial),
                linear_num_key_heads=cfg["linear_num_key_heads"],
                linear_num_value_heads=cfg["linear_num_value_heads"],
                linear_key_head_dim=cfg["linear_key_head_dim"],
                linear_value_head_dim=cfg["linear_value_head_dim"],
                linear_conv_kernel_dim=cfg.get("linear_conv_kernel_dim", 4),
                intermediate_size=cfg.get("intermediate_size", 0),
                num_experts=cfg["num_experts"] if moe else 0,
                num_experts_per_tok=cfg.get("num_experts_per_tok", 0) if moe else 0,
                moe_intermediate_size=cfg.get("moe_intermediate_size", 0) if moe else 0,
                shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0) if moe else 0,
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(cfg.get("mlp_only_layers", ()) or ()),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the field {e.args[0]!r}") from None
        except (ValueError, TypeError) as e:  # a field of the wrong type, or sizes that do not fit together
            raise CheckpointError(f"config.json: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"no config.json at {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_config(cfg)


def _tiny(**overrides) -> ModelConfig:
    base = dict(
        model_type="qwen3_5_text", vocab_size=256, hidden_size=64,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL), rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, partial_rotary_factor=0.25,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, intermediate_size=96)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_qwen3_5() -> ModelConfig:
    """The embedded tiny Qwen3.5-architecture model (tests, demo): 4 layers, hidden 64, vocab 256."""
    return _tiny()


def tiny_qwen3_next() -> ModelConfig:
    """A tiny Qwen3-Next (MoE on every layer: 4 experts, top-2, shared expert)."""
    return _tiny(model_type="qwen3_next", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48)


def qwen3_5_9b() -> ModelConfig:
    """Qwen3.5-9B's text shape (hidden 4096, 32 layers, every 4th full attention)."""
    return _tiny(vocab_size=248320, hidden_size=4096, layer_types=tuple(
        FULL if (i + 1) % 4 == 0 else LINEAR for i in range(32)), num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, rope_theta=10_000_000.0, linear_num_key_heads=16, linear_num_value_heads=32,
        linear_key_head_dim=128, linear_value_head_dim=128, intermediate_size=12288)


PRESETS = {"tiny": tiny_qwen3_5, "tiny-next": tiny_qwen3_next, "qwen3.5-9b": qwen3_5_9b}
