"""jaxgdn: Gated DeltaNet hybrid language models (Qwen3.5 / Qwen3-Next) in JAX.

    model = jaxgdn.load_pretrained(path)            # or jaxgdn.tiny_model()
    state = model.init_state(batch_size=B, capacity=N)
    state, logits = model.prefill_chunk(state, tokens, lengths=None)
    state, logits = model.decode_step(state, token)
"""

from .checkpoint import load_pretrained
from .config import ModelConfig, qwen3_5_9b, tiny_qwen3_5, tiny_qwen3_next
from .errors import CapacityError, CheckpointError, InputError, JaxGDNError, UnsupportedModelError
from .cache import Checkpoint, CheckpointRefused, PrefixCache, check_cache
from .engine import Conversation, ConversationResult, Engine, EngineOutput, EngineStats, Request, SamplingParams
from .generate import GenerationResult, Generations, generate
from .model import Model, decode_step, prefill_chunk
from .presets import tiny_model
from .program_cache import compile_cache
from .score import score
from .tokenizer import load_tokenizer
from .state import AttentionLayerState, GDNLayerState, ModelState, Provenance
from . import sharding  # tensor parallelism: jaxgdn.sharding.make_mesh, shard_model, init_state, ...

__all__ = [
    "load_pretrained", "ModelConfig", "qwen3_5_9b", "tiny_qwen3_5", "tiny_qwen3_next", "CapacityError",
    "CheckpointError", "InputError", "JaxGDNError", "UnsupportedModelError", "GenerationResult", "generate", "Model",
    "decode_step", "prefill_chunk", "tiny_model", "Checkpoint", "CheckpointRefused", "PrefixCache", "check_cache",
    "Generations", "score", "Engine", "Request", "Conversation", "SamplingParams", "EngineOutput", "EngineStats",
    "ConversationResult", "load_tokenizer", "AttentionLayerState", "GDNLayerState", "ModelState", "Provenance",
    "sharding", "compile_cache",
]
