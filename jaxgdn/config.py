"""Model configuration: a frozen, hashable description of a Qwen3.5 / Qwen3-Next hybrid model.

Built from a Hugging Face `config.json` (`from_hf_config`) or from a preset (`tiny_qwen3_5`, `tiny_qwen3_next`,
`qwen3_5_9b`). Hashable so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from .errors import CheckpointError, InputError, UnsupportedModelError, is_int

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
        for name in ("layer_types", "mlp_only_layers"):  # hashable (a config is static under jit): lists as tuples
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        sizes = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
        counts = sizes + ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size", "decoder_sparse_step", "gdn_qkv_groups")
        for name in counts:
            if not is_int(getattr(self, name)):
                raise InputError(f"{name} must be an integer; got {getattr(self, name)!r}")
        for name in sizes:  # before any division by them
            if not getattr(self, name) > 0:
                raise InputError(f"{name} must be positive; got {getattr(self, name)!r}")
        if self.num_experts and self.decoder_sparse_step < 1:
            raise InputError(f"decoder_sparse_step must be >= 1 with experts; got {self.decoder_sparse_step}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise InputError(f"num_experts_per_tok ({self.num_experts_per_tok}) must lie in [1, num_experts = "
                             f"{self.num_experts}]")
        if any(t not in (LINEAR, FULL) for t in self.layer_types):
            raise InputError(f"layer_types must be {LINEAR!r} or {FULL!r}; got {self.layer_types}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise InputError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.gdn_qkv_groups < 1 or self.linear_num_key_heads % self.gdn_qkv_groups:
            raise InputError(f"gdn_qkv_groups ({self.gdn_qkv_groups}) must divide linear_num_key_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise InputError(f"rotary dim {self.rotary_dim} must be even and in (0, head_dim]")

    # ---- derived sizes -------------------------------------------------------------------------------------
    def digest(self) -> str:
        """sha256 (hex) of a canonical text of the fields: every number written as a float (10000 and 10000.0, True
        and 1, np.int64(256) and 256 are equal fields of equal configs, and give one digest), the rest as their
        JSON. The same in every process (the prefix cache's `numerics_key`, `Model.numerics_tag`)."""
        def canonical(x):
            if isinstance(x, (tuple, list)):
                return [canonical(y) for y in x]
            if isinstance(x, str):
                return x
            try:
                return repr(float(x) + 0.0)  # (+ 0.0: -0.0 == 0.0)
            except (TypeError, ValueError):
                return repr(x)

        fields = {f.name: canonical(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

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
    def from_hf_config(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from a parsed `config.json` (model_type qwen3_5 — via its text_config —, qwen3_5_text, qwen3_next).

        Every field jaxgdn reads is checked for its JSON type (an integer size is an integer, not a string, float or
        bool; a flag is true or false) and range before anything is built: `CheckpointError` naming `source` (the
        file, in messages) and the field otherwise; `UnsupportedModelError` for a model type, architecture (a
        classification head), quantized checkpoint, rope type or activation jaxgdn does not implement."""
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source} must hold a JSON object; got {type(cfg).__name__} {json.dumps(cfg):.60}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{source}: unsupported model_type {model_type!r}; jaxgdn supports {', '.join(SUPPORTED_MODEL_TYPES)}")
        _check_supported(cfg, source, "")
        where = ""  # prefix of field names in messages
        if model_type == "qwen3_5":
            if "text_config" not in cfg:
                raise CheckpointError(f"{source}: qwen3_5 config.json has no text_config")
            text = cfg["text_config"]
            if not isinstance(text, dict):
                raise CheckpointError(f"{source}: text_config must be a JSON object; got {json.dumps(text):.60}")
            _check_supported(text, source, "text_config.")
            tie = text.get("tie_word_embeddings")
            if tie is None:
                tie = _get(cfg, "tie_word_embeddings", bool, source, "", default=False)
            cfg = dict(text, model_type="qwen3_5_text", tie_word_embeddings=tie)
            model_type, where = "qwen3_5_text", "text_config."

        def get(key, kind, default=_REQUIRED, minimum=None):
            return _get(cfg, key, kind, source, where, default, minimum)

        n = get("num_hidden_layers", int, minimum=1)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = get("full_attention_interval", int, 4, minimum=1)
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise CheckpointError(f"{source}: {where}layer_types must be a list of strings; got "
                                  f"{json.dumps(layer_types):.80}")
        if len(layer_types) != n:
            raise CheckpointError(f"{source}: {where}layer_types has {len(layer_types)} entries for {n} layers "
                                  f"({where}num_hidden_layers)")
        bad = sorted({t for t in layer_types if t not in (LINEAR, FULL)})
        if bad:
            raise CheckpointError(f"{source}: {where}layer_types must be {LINEAR!r} or {FULL!r}; got {bad}")
        for key in ("rope_parameters", "rope_scaling"):
            if cfg.get(key) is not None and not isinstance(cfg[key], dict):
                raise CheckpointError(f"{source}: {where}{key} must be a JSON object; got {json.dumps(cfg[key]):.80}")
        # transformers' rule (`modeling_rope_utils`): a non-empty rope_scaling takes precedence over rope_parameters
        # (the Qwen3-Next model card has users add one for long context), its type is "rope_type", else the legacy
        # "type", else "default"; rope_theta and partial_rotary_factor come from that dict first, the top level next
        rope_key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
        rope = cfg.get(rope_key) or {}
        rope_type = rope["rope_type"] if "rope_type" in rope else rope.get("type", "default")
        if rope_type != "default":
            raise UnsupportedModelError(f"{source}: {where}{rope_key} has rope_type {rope_type!r}: jaxgdn implements "
                                        f"the default RoPE only (no YaRN, linear, dynamic or llama3 scaling)")
        rope_theta = _get(rope, "rope_theta", float, source, where + rope_key + ".", None, minimum=0)
        if rope_theta is None:
            rope_theta = get("rope_theta", float, 10000.0, minimum=0)
        partial = _get(rope, "partial_rotary_factor", float, source, where + rope_key + ".", None, minimum=0)
        if partial is None:
            partial = get("partial_rotary_factor", float, 0.25, minimum=0)
        if get("attention_bias", bool, False):
            raise UnsupportedModelError(f"{source}: {where}attention_bias is true: jaxgdn's attention projections have "
                                        f"no biases (Qwen3.5 / Qwen3-Next checkpoints have none)")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the MLPs and experts are SwiGLU
            raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (jaxgdn's MLPs use silu)")
        moe = model_type == "qwen3_next" and get("num_experts", int, 0, minimum=0) > 0
        heads = get("num_attention_heads", int, minimum=1)
        hidden = get("hidden_size", int, minimum=1)
        head_dim = get("head_dim", int, None, minimum=1)
        if head_dim is None:
            head_dim = hidden // heads
        mlp_only = cfg.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(is_int(i) for i in mlp_only):
            raise CheckpointError(f"{source}: {where}mlp_only_layers must be a list of layer indices; got "
                                  f"{json.dumps(mlp_only):.80}")
        fields = dict(
            model_type=model_type,
            vocab_size=get("vocab_size", int, minimum=1),
            hidden_size=hidden,
            layer_types=tuple(layer_types),
            rms_norm_eps=get("rms_norm_eps", float, 1e-6, minimum=0),
            tie_word_embeddings=get("tie_word_embeddings", bool, False),
            num_attention_heads=heads,
            num_key_value_heads=get("num_key_value_heads", int, minimum=1),
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            linear_num_key_heads=get("linear_num_key_heads", int, minimum=1),
            linear_num_value_heads=get("linear_num_value_heads", int, minimum=1),
            linear_key_head_dim=get("linear_key_head_dim", int, minimum=1),
            linear_value_head_dim=get("linear_value_head_dim", int, minimum=1),
            linear_conv_kernel_dim=get("linear_conv_kernel_dim", int, 4, minimum=1),
            intermediate_size=get("intermediate_size", int, 0, minimum=0),
            norm_topk_prob=get("norm_topk_prob", bool, True),
            # (0 divides by zero in transformers' MoE layers; a dense model never reads it)
            decoder_sparse_step=get("decoder_sparse_step", int, 1, minimum=1 if moe else 0) or 1,
            mlp_only_layers=tuple(mlp_only),
        )
        if moe:
            fields.update(num_experts=get("num_experts", int), num_experts_per_tok=get("num_experts_per_tok", int, 0),
                          moe_intermediate_size=get("moe_intermediate_size", int, 0, minimum=1),
                          shared_expert_intermediate_size=get("shared_expert_intermediate_size", int, 0, minimum=0))
            if not 1 <= fields["num_experts_per_tok"] <= fields["num_experts"]:
                raise CheckpointError(f"{source}: {where}num_experts_per_tok ({fields['num_experts_per_tok']}) must "
                                      f"be in [1, num_experts = {fields['num_experts']}]")
        try:
            return cls(**fields)
        except ValueError as e:  # sizes that do not fit together
            raise CheckpointError(f"{source}: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"no config.json at {path}")
        try:
            cfg = json.loads(path.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        return cls.from_hf_config(cfg, source=str(path))


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false"}
# Heads a checkpoint may carry that jaxgdn's causal LM cannot stand in for.
_UNSUPPORTED_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def _get(cfg: dict, key: str, kind, source: str, where: str, default=_REQUIRED, minimum=None):
    """cfg[key] checked to be of JSON type `kind` (int, float: any number, bool) and >= minimum (> 0 for floats
    with minimum 0); `default` when absent or null (CheckpointError naming the field when required)."""
    x = cfg.get(key)
    if x is None:
        if default is _REQUIRED:
            raise CheckpointError(f"{source} lacks the field {where + key!r}")
        return default
    ok = (isinstance(x, bool) if kind is bool else is_int(x) if kind is int
          else isinstance(x, (int, float)) and not isinstance(x, bool) and x == x)
    if not ok:
        raise CheckpointError(f"{source}: {where}{key} must be {_KINDS[kind]}; got {json.dumps(x):.60}")
    if minimum is not None and (x < minimum if kind is int else not x > minimum):
        raise CheckpointError(f"{source}: {where}{key} must be {'>=' if kind is int else '>'} {minimum}; got {x}")
    return x


def _check_supported(cfg: dict, source: str, where: str) -> None:
    """Refuse what loads only to compute something else: a quantized checkpoint, a classification head."""
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise UnsupportedModelError(f"{source}: {where}quantization_config ({method!r}): jaxgdn loads unquantized "
                                    f"float weights only (fp32 / bf16 / fp16)")
    archs = cfg.get("architectures")
    if isinstance(archs, list):
        heads = [a for a in archs if isinstance(a, str) and a.endswith(_UNSUPPORTED_HEADS)]
        if heads and len(heads) == len(archs):
            raise UnsupportedModelError(f"{source}: {where}architectures {heads}: jaxgdn implements the causal "
                                        f"language model only")


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
