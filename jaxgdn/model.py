"""The hybrid model and its pure state functions.

    state = model.init_state(batch_size=B, capacity=N)
    state, logits = model.prefill_chunk(state, tokens, lengths=None)  # tokens int32 [B, T] -> logits fp32 [B, T, Vocab]
    state, logits = model.decode_step(state, token)                   # token int32 [B]    -> logits fp32 [B, Vocab]

`Model` is a pytree (parameters are leaves; config, dtype, kernel backend and modes are static), so the functions
`prefill_chunk(model, state, tokens, lengths)` and `decode_step(model, state, token)` below can be jitted with
the state donated. The methods check their inputs on concrete values (JAX silently clamps out-of-range
gathers) and call a jitted copy.

A token's path: `Model.prefill_chunk` -> `prefill_chunk` -> per layer `layers.gdn.gdn_prefill` (conv, gates,
`pallas_kernels.chunk_gated_delta_rule` — or `fused_recurrent_gated_delta_rule` with gdn_prefill="recurrent" ->
backend dispatch -> reference or Pallas kernel) or `layers.attention.attention`, then `layers.mlp.feed_forward`.
Decode: `decode_step` -> `layers.gdn.gdn_decode` (`pallas_kernels.recurrent_gated_delta_rule`), or in replay mode
the prefill path for one token (over the chunked GDN prefill: `pallas_kernels.chunk_replay_step_packed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import CHUNK, resolve_backend

from .config import LINEAR, ModelConfig
from .errors import CapacityError, InputError, bool_among_ints, index_value
from .init import random_params
from .layers.attention import attention
from .layers.gdn import gdn_decode, gdn_prefill
from .layers.linear import linear
from .layers.mlp import feed_forward
from .layers.norm import rms_norm
from .params import ModelParams, weights_digest
from .state import (STATE_DTYPES, AttentionLayerState, GDNLayerState, ModelState, PrefillCheckpoints, Provenance,
                    check_state_dtype, init_state)


MODEL_DTYPES = STATE_DTYPES


def check_model_options(dtype, backend) -> None:
    """A model's activation dtype is float32 or bfloat16 (the two the tests and the GPU checks cover) and its kernel
    backend one `pallas_kernels.backend` knows ("pallas" only where JAX has a GPU: a model built on a CPU host to
    export for a GPU is not supported), or None; raised at construction (before any weights are read by
    `load_pretrained`), not at the first call."""
    check_state_dtype(dtype)
    if backend is not None:
        try:
            resolve_backend(backend)  # the one place that knows the backends
        except ValueError as e:
            raise InputError(str(e)) from None
        if backend == "pallas" and jax.default_backend() != "gpu":
            raise InputError(f"backend 'pallas' compiles the kernels for a GPU, and JAX has none here (default "
                             f"backend: {jax.default_backend()}); use 'interpret' (the same kernels, interpreted), "
                             f"'reference' (pure JAX) or None (the device's default)")


@functools.lru_cache(maxsize=16)
def _param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Path -> shape of every parameter `config` needs (`init.random_params`'s, shapes only: nothing is allocated)."""
    spec = jax.eval_shape(lambda: random_params(config, jax.random.key(0)))
    return {jax.tree_util.keystr(path): tuple(x.shape) for path, x in jax.tree_util.tree_flatten_with_path(spec)[0]}


def _check_params(params, config) -> None:
    """InputError unless `config` is a ModelConfig and `params` a ModelParams of the structure and shapes it needs:
    the layers compute with the parameters' shapes and kinds (a dense or MoE MLP, a tied head) while the checks and
    the numerics tag follow the config, so a mismatch would run and compute something else under the config's name.
    The leaves must have the full shapes, neither split nor stacked (to vmap over models, stack their ModelParams and
    build the Model inside). Trees that are not parameters — leaves that are not arrays (a sharding spec), None where
    the config needs an array (a tree_map's placeholders), tracers (a Model inside jit, vmap or shard_map, whose
    leaves may be per-shard or stacked: it was checked where it was built) — are not checked."""
    if not isinstance(config, ModelConfig):
        raise InputError(f"config must be a jaxgdn.ModelConfig; got {type(config).__name__}")
    if not isinstance(params, ModelParams):
        raise InputError(f"params must be a jaxgdn ModelParams (jaxgdn.init.random_params, load_pretrained); got "
                         f"{type(params).__name__}")
    keystr = jax.tree_util.keystr
    items = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: x is None)[0]
    shapes = _param_shapes(config)
    need = set(shapes)
    nones = {keystr(path) for path, x in items if x is None}
    arrays = all(x is None or (hasattr(x, "shape") and hasattr(x, "dtype")) for _, x in items)
    if not arrays or nones & need - {".lm_head"} or any(isinstance(x, jax.core.Tracer) for _, x in items):
        return
    leaves = [(keystr(path), x) for path, x in items if x is not None]
    got = {path for path, _ in leaves}
    if got != need:
        diff = [("missing params" if d in need else "unexpected params") + d for d in sorted(got ^ need)]
        raise InputError(f"params do not hold the parameters the config needs (a dense or MoE MLP, a tied or stored "
                         f"head, the layer kinds): {', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''}")
    for path, x in leaves:
        if tuple(x.shape) != shapes[path]:
            raise InputError(f"params{path} has shape {tuple(x.shape)}; the config needs {shapes[path]}")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"],
                   meta_fields=["config", "dtype", "backend", "deterministic", "decode_mode", "gdn_prefill"])
@dataclasses.dataclass(frozen=True)
class Model:
    params: ModelParams
    config: ModelConfig
    dtype: jnp.dtype = jnp.float32  # activations and matmul inputs; GDN states stay fp32
    backend: str | None = None  # kernel backend (see pallas_kernels.backend); None: the device default
    # Batch-invariant numerics: a row's logits depend neither on the other rows of the call nor on how its
    # prompt was split on the 64-token grid (with the chunked GDN prefill and recurrent decode every prefill call
    # must then start on the grid; replay decode and gdn_prefill="recurrent" continue exactly from anywhere).
    deterministic: bool = False
    # "recurrent": decode with the one-token recurrent update (fast; the state differs from prefill's, and is
    # tainted DECODE). "replay": decode runs the prefill path for its token — over the chunked GDN prefill the
    # replay step computes the token's part of the open 64-token chunk from the last grid boundary with the
    # prefill's arithmetic (`pallas_kernels.chunk_replay_step`, caches in the state), over gdn_prefill="recurrent"
    # one recurrent step — so decoded states and logits are bitwise what a prefill computes (provenance stays
    # PREFILL); in deterministic mode this makes generated text cacheable.
    decode_mode: str = "recurrent"
    # The GDN layers' prefill arithmetic. "chunked": the chunked (WY, chunk 64) kernels — fast prefill; a replay
    # decode step then costs several recurrent steps (BENCHMARKS.md). "recurrent": the recurrence token by token
    # with the decode kernel's arithmetic (`pallas_kernels.fused_recurrent_gated_delta_rule`) — a slower prefill
    # (sequential in T; BENCHMARKS.md), but a replay decode is then one recurrent step, and any split of a prompt,
    # on the grid or not, gives the unsplit call's bits.
    gdn_prefill: str = "chunked"

    def __post_init__(self):
        check_model_options(self.dtype, self.backend)
        _check_params(self.params, self.config)
        if not isinstance(self.deterministic, (bool, np.bool_)):
            raise InputError(f"deterministic must be True or False; got {self.deterministic!r}")
        if self.decode_mode not in ("recurrent", "replay"):
            raise InputError(f"decode_mode must be 'recurrent' or 'replay'; got {self.decode_mode!r}")
        if self.gdn_prefill not in ("chunked", "recurrent"):
            raise InputError(f"gdn_prefill must be 'chunked' or 'recurrent'; got {self.gdn_prefill!r}")
        # One spelling of each static option (jnp.float32, np.dtype("float32") and "float32" hash differently: equal
        # models used to differ in their pytree metadata and so compiled every program again)
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        object.__setattr__(self, "deterministic", bool(self.deterministic))

    @property
    def keeps_open_chunk(self) -> bool:
        """Whether states carry the open 64-token chunk's inputs (replay decode over the chunked prefill)."""
        return self.decode_mode == "replay" and self.gdn_prefill == "chunked"

    @property
    def continues_exactly(self) -> bool:
        """Whether a prefill may start anywhere and still give the unsplit call's bits: replay decode over the
        chunked prefill (it replays the open chunk) and the token-by-token prefill. Otherwise only on the grid."""
        return self.keeps_open_chunk or self.gdn_prefill == "recurrent"

    @property
    def numerics_tag(self) -> int:
        """A 31-bit tag (>= 1) of what decides this model's state arithmetic apart from its weights and mesh: the
        config (the architecture and its q/k/v channel layout), deterministic mode, the GDN prefill arithmetic, the
        dtype and the resolved kernel backend. Every row a model advances records it (`ModelState.origin`), so a
        row continued by a model of other numerics is seen (`Provenance.MIXED`). The weights and the mesh are the
        prefix cache's to check (`jaxgdn.cache.numerics_key`): a tag is static, known while tracing."""
        return self.numerics_tag_for(self.config)

    def numerics_tag_for(self, config: ModelConfig) -> int:
        """The `numerics_tag` this model's numerics have with `config` instead of its own (e.g. the same model in
        another q/k/v layout: `jaxgdn.sharding.convert_layout` moves a state's claim with it)."""
        return _numerics_tag(config.digest(), self.deterministic, self.gdn_prefill, self.dtype.name,
                             resolve_backend(self.backend))

    @functools.cached_property
    def weights_digest(self) -> str:
        """`jaxgdn.params.weights_digest` of the parameters, computed once per model object (on its first use: the
        prefix cache's `numerics_key`)."""
        return weights_digest(self.params)

    def init_state(self, batch_size: int, capacity: int) -> ModelState:
        """A fresh state (`jaxgdn.state.init_state`): batch_size and capacity integers >= 1 (InputError otherwise),
        the KV capacity rounded up to a multiple of 64; for a model placed on a mesh (`jaxgdn.sharding`), created
        already split over it."""
        from . import sharding  # local: the sharding module imports this one

        if sharding.mesh_of(self.params) is not None:
            return sharding.init_state(self, batch_size, capacity)
        return init_state(self.config, batch_size, capacity, self.dtype, replay=self.keeps_open_chunk)

    def _with(self, **options) -> "Model":
        """This model with other static options, the same parameters: their digest, once computed, goes along."""
        model = dataclasses.replace(self, **options)
        if "weights_digest" in self.__dict__:
            model.__dict__["weights_digest"] = self.__dict__["weights_digest"]
        return model

    def with_backend(self, backend: str | None) -> "Model":
        return self._with(backend=backend)

    def with_deterministic(self, deterministic: bool = True) -> "Model":
        return self._with(deterministic=deterministic)

    def with_decode_mode(self, decode_mode: str) -> "Model":
        return self._with(decode_mode=decode_mode)

    def with_gdn_prefill(self, gdn_prefill: str) -> "Model":
        return self._with(gdn_prefill=gdn_prefill)

    def prefill_chunk(self, state: ModelState, tokens, lengths=None):
        """Absorb a batch of token runs. tokens: int32 [B, T]; lengths: int32 [B] valid tokens per row (None: T).

        Continues from whatever `state` holds. Returns (new_state, logits fp32 [B, T, Vocab]); logits at
        padded positions are meaningless. Padded tokens leave the state bit-identical.
        """
        tokens, lengths = _check_prefill(self.config, state, tokens, lengths,
                                         self.deterministic and not self.continues_exactly, self.keeps_open_chunk,
                                         self.dtype)
        _check_origin(state, self.numerics_tag, lengths)
        with mesh_context(self):
            return _prefill_jit(self, state, tokens, lengths)

    def decode_step(self, state: ModelState, token):
        """Absorb one token per row (`decode_mode`: the recurrent update, or replay). token: int32 [B].
        Returns (state, logits fp32 [B, Vocab])."""
        token = _check_decode(self.config, state, token, self.keeps_open_chunk, self.dtype)
        _check_origin(state, self.numerics_tag)
        with mesh_context(self):
            return _decode_jit(self, state, token)


@functools.lru_cache(maxsize=256)
def _numerics_tag(config_digest: str, deterministic: bool, gdn_prefill: str, dtype: str, backend: str) -> int:
    """`Model.numerics_tag`: from `ModelConfig.digest` (canonical: the same in every process) and the options."""
    text = f"{config_digest}|deterministic={deterministic}|gdn_prefill={gdn_prefill}|dtype={dtype}|backend={backend}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") % (2**31 - 1) + 1


def mesh_context(model: Model):
    """A context setting the mesh the model's parameters are on as JAX's mesh (`jax.set_mesh`), so the Pallas
    kernels run per shard (`shard_map`); a no-op for an unsharded model or when a mesh is already set."""
    from .sharding import mesh_of

    mesh = mesh_of(model.params)
    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.set_mesh(mesh)


def placed_like(y: jax.Array, x) -> jax.Array:
    """`y` on `x`'s placement (its sharding; a NamedSharding fits any shape), where an eager op on `x` (a gather, a
    donated write) may have left it elsewhere: a state of a model on a mesh stays split as planned."""
    sharding = getattr(x, "sharding", None)
    return y if sharding is None or y.sharding == sharding else jax.device_put(y, sharding)


# ---- input checks (on concrete values only; under a trace they are skipped) -----------------------------------

def _concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_tokens(tokens, rank: int, what: str):
    """tokens as int32, after checking their rank and dtype (the ids: `_check_ids`), and, for concrete wider or
    unsigned integers, that the values survive the cast (2**32 + 5 would become 5). A string, or a bool inside a
    Python sequence (NumPy reads [1, True] as [1, 1]), is refused."""
    if isinstance(tokens, (str, bytes)):
        raise InputError(f"{what} must be an integer array of token ids; got a string (encode it with a tokenizer)")
    if bool_among_ints(tokens):
        raise InputError(f"{what} must hold integer token ids; got a bool")
    if not hasattr(tokens, "dtype"):
        try:
            tokens = np.asarray(tokens)
        except (TypeError, ValueError):
            raise InputError(f"{what} must be a rectangular integer array (int32)") from None
    if tokens.ndim != rank:
        raise InputError(f"{what} must have rank {rank}; got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise InputError(f"{what} must be an integer array (int32); got {tokens.dtype}")
    _check_int32_range(tokens, what)
    return jnp.asarray(tokens, jnp.int32)


def _check_int32_range(x, what: str) -> None:
    """Concrete integers of another dtype than int32 must fit int32 (a silent wrap would change their meaning)."""
    if _concrete(x) and x.dtype != jnp.int32 and x.size:
        a = np.asarray(x)
        lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
        if int(a.min()) < lo or int(a.max()) > hi:
            raise InputError(f"{what} holds values outside the int32 range: min {int(a.min())}, max {int(a.max())}")


def _check_ids(cfg: ModelConfig, tokens: jax.Array, what: str, lengths=None):
    """On concrete values, that every id lies in the vocabulary — for a prefill with `lengths`, every id of a valid
    position: padding may hold anything (-1 included), since it reaches neither a state nor a valid logit."""
    if not (_concrete(tokens) and tokens.size and (lengths is None or _concrete(lengths))):
        return
    ids = np.asarray(tokens)
    bad = (ids < 0) | (ids >= cfg.vocab_size)
    if lengths is not None:
        bad &= np.arange(ids.shape[1]) < np.asarray(lengths)[:, None]
    if np.any(bad):
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        scope = " (padding past `lengths` is not checked)" if lengths is not None else ""
        raise InputError(f"{what} holds ids outside [0, {cfg.vocab_size}): {int(ids[at])} at index {list(at)}, "
                         f"{int(np.sum(bad))} such id(s) in all{scope}")


def _check_capacity(state: ModelState, advance):
    if not (_concrete(state.position) and _concrete(advance)):
        return
    cap = state.capacity
    if cap == 0:
        return
    end = np.asarray(state.position) + np.asarray(advance)
    if np.any(end > cap):
        row = int(np.argmax(end - cap))
        raise CapacityError(f"row {row} would reach position {int(end[row])}, beyond the state's KV capacity {cap}")


def _check_state_layout(cfg: ModelConfig, state: ModelState, open_chunk: bool | None, dtype=None):
    """A ModelState with one layer state per layer of the config, of the layer's kind, its arrays of one batch
    (`_check_state_arrays`; with `dtype`, the model's, their dtypes too) and head shapes, whose GDN layers carry the
    open-chunk buffers exactly when the model keeps them (shapes and dtypes only: holds under a trace).
    (Not checkable here: the q/k/v channel order of a state made by a model of another layout — `jaxgdn.sharding.
    convert_layout` moves states between layouts.)"""
    if not isinstance(state, ModelState):
        raise InputError(f"state must be a jaxgdn ModelState (model.init_state); got {type(state).__name__}")
    if len(state.layers) != len(cfg.layer_types):
        raise InputError(f"the state holds {len(state.layers)} layer states; the model has {len(cfg.layer_types)} "
                         f"layers (make states with this model's init_state)")
    for i, (s, kind) in enumerate(zip(state.layers, cfg.layer_types)):
        want = GDNLayerState if kind == LINEAR else AttentionLayerState
        if not isinstance(s, want):
            raise InputError(f"layer {i} of the state is of type {type(s).__name__}; the model's layer {i} needs "
                             f"{want.__name__}")
    _check_state_arrays(state, dtype)
    for i, (s, kind) in enumerate(zip(state.layers, cfg.layer_types)):
        if kind == LINEAR:
            got = (tuple(s.recurrent.shape[1:]), s.conv.shape[-1])
            need = ((cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                    cfg.gdn_conv_dim)
        else:
            got, need = tuple(s.keys.shape[2:]), (cfg.num_key_value_heads, cfg.head_dim)
        if got != need:
            raise InputError(f"layer {i} of the state has shapes {got}, the model's config needs {need} (a state "
                             f"of another model)")
    gdn = [s for s in state.layers if isinstance(s, GDNLayerState)]
    if open_chunk is None or not gdn or (gdn[0].open_qkv is not None) == open_chunk:
        return
    has, uses = ("lacks", "uses") if open_chunk else ("holds", "does not use")
    raise InputError(f"the state {has} the open-chunk buffers of replay decode over the chunked prefill, and the "
                     f"model {uses} them: make states with this model's init_state (decode_mode and gdn_prefill "
                     "decide their layout)")


_IN_MODEL_DTYPE = ("conv", "open_qkv", "keys", "values")  # a layer state's arrays in the model's dtype (others fp32)


def _check_state_arrays(state: ModelState, dtype=None):
    """`position`, `provenance` and `origin` integer arrays [B], every layer array with those B rows on its leading
    axis, and, given the model's `dtype`, each array in the dtype the model makes it: conv, open-chunk q|k|v, keys
    and values in `dtype`, the rest (the GDN recurrent state, gates and replay caches) fp32. A state of a bf16 model
    given to an fp32 one, or the reverse, used to run with promoted arithmetic and come back in other dtypes.
    Also refused: a state whose arrays were deleted, donated to a jitted call (JAX's error named no argument)."""
    if any(isinstance(x, jax.Array) and _concrete(x) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise InputError("the state's arrays were deleted: it was donated to a jitted call (donate_argnums), which "
                         "consumed it; pass the state that call returned")
    for name in ("position", "provenance", "origin"):
        x = getattr(state, name)
        if getattr(x, "ndim", None) != 1 or not jnp.issubdtype(x.dtype, jnp.integer):
            raise InputError(f"the state's {name} must be an integer array [B]; got "
                             f"{getattr(x, 'dtype', type(x).__name__)}{list(getattr(x, 'shape', ()))}")
    B = state.position.shape[0]
    for name in ("provenance", "origin"):
        if getattr(state, name).shape != (B,):
            raise InputError(f"the state's {name} has shape {tuple(getattr(state, name).shape)}; its position "
                             f"({B},)")
    for i, layer in enumerate(state.layers):
        for field, x in zip(layer._fields, layer):
            if x is None:
                continue
            if x.ndim == 0 or x.shape[0] != B:
                raise InputError(f"layer {i}'s {field} has shape {tuple(x.shape)}, not the state's {B} rows on its "
                                 "leading axis (a state is indexed by row with jaxgdn.state.select_rows)")
            want = jnp.dtype(dtype if field in _IN_MODEL_DTYPE else jnp.float32)
            if dtype is not None and x.dtype != want:
                raise InputError(f"layer {i}'s {field} is {x.dtype}; a model of dtype {jnp.dtype(dtype).name} keeps "
                                 f"it in {want.name} (a state of another model: make states with this model's "
                                 "init_state)")


def _check_shapes(cfg: ModelConfig, state: ModelState, tokens, lengths, open_chunk: bool | None,
                  decode: bool = False, dtype=None):
    """The checks that need only shapes and dtypes, so they hold under a trace too (the pure functions make them):
    tokens [B, T] with `lengths` [B] or None (a prefill) or token [B] (`decode`), B the state's batch, and a state
    laid out for the model (`dtype`: the model's, which the state's dtypes must match; None: not checked).
    Returns tokens and lengths as int32 arrays (a prefill's lengths None: T for every row; a decode's lengths:
    None)."""
    what = "token" if decode else "tokens"
    _check_state_layout(cfg, state, open_chunk, dtype)
    tokens = _check_tokens(tokens, 1 if decode else 2, what)
    B = tokens.shape[0]
    if B != state.batch_size:
        raise InputError(f"{what} {'has' if decode else 'have'} {B} rows but the state holds {state.batch_size}")
    if decode:
        return tokens, None
    if tokens.shape[1] == 0:
        raise InputError("tokens has no columns (T == 0)")
    if lengths is None:
        return tokens, jnp.full((B,), tokens.shape[1], jnp.int32)
    if bool_among_ints(lengths):
        raise InputError(f"lengths must be an int array of shape ({B},); got a bool among them: {lengths!r}")
    if not hasattr(lengths, "dtype"):
        try:
            lengths = np.asarray(lengths)
        except (TypeError, ValueError):
            raise InputError(f"lengths must be an int array of shape ({B},)") from None
    if lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise InputError(f"lengths must be an int array of shape ({B},); got {lengths.dtype}{tuple(lengths.shape)}")
    _check_int32_range(lengths, "lengths")
    return tokens, jnp.asarray(lengths, jnp.int32)


def _check_static_options(checkpoint_stride, last_only) -> tuple[int | None, bool]:
    """The pure prefill's `checkpoint_stride` (None or a positive multiple of 64) and `last_only` (a bool), which
    decide the program's shapes: under `jit` they must be static (`static_argnames`), not traced."""
    for name, value in (("checkpoint_stride", checkpoint_stride), ("last_only", last_only)):
        if isinstance(value, jax.core.Tracer):
            raise InputError(f"{name} decides the program's shapes, so it must be static under jit: "
                             "jit with static_argnames=('checkpoint_stride', 'last_only')")
    if not isinstance(last_only, (bool, np.bool_)):
        raise InputError(f"last_only must be True or False; got {last_only!r}")
    if checkpoint_stride is None:
        return None, bool(last_only)
    try:
        stride = index_value(checkpoint_stride)
    except TypeError:
        stride = 0
    if stride <= 0 or stride % CHUNK:
        raise InputError(f"checkpoint_stride must be a positive multiple of {CHUNK}; got {checkpoint_stride!r}")
    return stride, bool(last_only)


def _check_prefill(cfg: ModelConfig, state: ModelState, tokens, lengths, grid_rule: bool = False,
                   open_chunk: bool | None = None, dtype=None):
    padded = lengths is not None
    tokens, lengths = _check_shapes(cfg, state, tokens, lengths, open_chunk, dtype=dtype)
    T = tokens.shape[1]
    if padded and _concrete(lengths) and (np.min(lengths) < 0 or np.max(lengths) > T):
        raise InputError(f"lengths must lie in [0, T={T}]; got {np.asarray(lengths).tolist()}")
    _check_ids(cfg, tokens, "tokens", lengths if padded else None)
    _check_capacity(state, lengths)
    if grid_rule and _concrete(state.position) and _concrete(lengths):
        pos, lens = np.asarray(state.position), np.asarray(lengths)
        off = (pos % CHUNK != 0) & (lens > 0)
        if np.any(off):
            row = int(np.argmax(off))
            raise InputError(
                f"deterministic mode: row {row} would start a prefill at position {int(pos[row])}, off the "
                f"{CHUNK}-token grid; a prefill call that does not end a sequence must end on the grid "
                f"(split prompts at multiples of {CHUNK})")
    return tokens, lengths


def _check_origin(state: ModelState, tag: int, lengths=None) -> None:
    """On concrete values: no row this call advances (a decode: every row; a prefill: those with tokens) holds
    tokens another model's numerics computed (`ModelState.origin` set and not `tag`, this model's
    `numerics_tag`). The pure functions continue such a row and mark it Provenance.MIXED."""
    if not (_concrete(state.origin) and _concrete(state.position) and (lengths is None or _concrete(lengths))):
        return
    origin, pos = np.asarray(state.origin), np.asarray(state.position)
    foreign = (pos > 0) & (origin != 0) & (origin != tag)
    if lengths is not None:
        foreign &= np.asarray(lengths) > 0
    if np.any(foreign):
        row = int(np.argmax(foreign))
        raise InputError(
            f"row {row} of the state was computed by a model of other numerics (numerics_tag {int(origin[row])}; "
            f"this model's is {tag}: another config or q/k/v layout, deterministic mode, GDN prefill, dtype or "
            "kernel backend); continuing it would give neither model's result. Continue it with the model that "
            "computed it or recompute it with this one; a state of this model in another q/k/v layout moves with "
            "jaxgdn.sharding.convert_layout (the pure functions would continue it and mark it Provenance.MIXED)")


def _check_decode(cfg: ModelConfig, state: ModelState, token, open_chunk: bool | None = None, dtype=None):
    token, _ = _check_shapes(cfg, state, token, None, open_chunk, decode=True, dtype=dtype)
    _check_ids(cfg, token, "token")
    _check_capacity(state, 1)
    return token


# ---- the pure state functions ----------------------------------------------------------------------------------

def _det(model: Model) -> str | bool:
    """False in default mode; in deterministic mode the resolved kernel backend its batch-invariant matmuls and
    attention run on ("pallas" on a GPU: fixed-tile Pallas kernels; "reference" elsewhere: XLA on fixed 64-row
    tiles through `lax.map`: `pallas_kernels.invariant.row_tiled`)."""
    return resolve_backend(model.backend) if model.deterministic else False


def _logits(model: Model, x: jax.Array) -> jax.Array:
    p, cfg = model.params, model.config
    x = rms_norm(x, p.final_norm, cfg.rms_norm_eps)
    if p.lm_head is None:  # tied: the embedding [Vocab, D] read in place (no transposed copy per call)
        return linear(x, p.embed, _det(model), col_groups=cfg.vocab_size, w_transposed=True).astype(jnp.float32)
    return linear(x, p.lm_head, _det(model), col_groups=cfg.vocab_size).astype(jnp.float32)


def _advance(state: ModelState, layers, lengths: jax.Array, taint: jax.Array, tag: int) -> ModelState:
    """The state after a call: rows with tokens move on, their provenance the worse of theirs and `taint` (MIXED
    where a model of other numerics computed the row so far: its origin set and not `tag`), their origin `tag`."""
    touched = lengths > 0
    foreign = (state.position > 0) & (state.origin != 0) & (state.origin != tag)
    taint = jnp.where(foreign, Provenance.MIXED, taint).astype(jnp.int32)
    provenance = jnp.where(touched, jnp.maximum(state.provenance, taint), state.provenance)
    origin = jnp.where(touched, jnp.int32(tag), state.origin)
    return ModelState(layers=tuple(layers), position=state.position + lengths, provenance=provenance, origin=origin)


def check_model(model) -> None:
    """InputError unless `model` is a jaxgdn Model (the first argument of the pure functions, generate, score and
    Engine; a static check, so free under jit: the model's type is part of its pytree structure)."""
    if not isinstance(model, Model):
        hint = " (model and state swapped?)" if isinstance(model, ModelState) else ""
        raise InputError(f"model must be a jaxgdn.Model (the first argument){hint}; got {type(model).__name__}")


def prefill_chunk(model: Model, state: ModelState, tokens: jax.Array, lengths: jax.Array | None = None,
                  checkpoint_stride: int | None = None, last_only: bool = False):
    """Pure prefill. tokens int32 [B, T]; lengths int32 [B] (None: T). Returns (state, logits fp32 [B, T, Vocab]).

    Shapes, dtypes and the state's layout are checked (InputError), under `jit` too; values are not (see
    `Model.prefill_chunk`, which checks them).

    `last_only`: logits only for each row's last valid token, [B, Vocab] (bitwise the same rows; saves the
    [B, T, Vocab] tensor — 8 GB for one 8k-token prompt of a 248k vocabulary — and its matmul).

    With `checkpoint_stride` (a multiple of 64) it also returns `PrefillCheckpoints`: the GDN states every
    `stride` tokens counted from the call's start (recurrent decode mode, or gdn_prefill="recurrent") or from the
    last grid boundary (replay decode over the chunked prefill), each bitwise equal to the final state of a
    separate prefill ending there.
    """
    check_model(model)
    checkpoint_stride, last_only = _check_static_options(checkpoint_stride, last_only)
    replay = model.keeps_open_chunk
    tokens, lengths = _check_shapes(model.config, state, tokens, lengths, replay, dtype=model.dtype)
    cfg, p, det = model.config, model.params, _det(model)
    x = p.embed[tokens].astype(model.dtype)  # [B, T, D]
    new_layers, ckpts = [], []
    for lp, ls, kind in zip(p.layers, state.layers, cfg.layer_types):
        h = rms_norm(x, lp.input_norm, cfg.rms_norm_eps)
        if kind == LINEAR:
            h, ls, ck = gdn_prefill(cfg, lp.mixer, h, ls, lengths, state.position, model.backend, checkpoint_stride,
                                    det, form=model.gdn_prefill)
            ckpts.append(ck)
        else:
            h, ls = attention(cfg, lp.mixer, h, ls, state.position, lengths, det, backend=model.backend)
        x = x + h
        x = x + feed_forward(cfg, lp.mlp, rms_norm(x, lp.post_attention_norm, cfg.rms_norm_eps), det)
        new_layers.append(ls)
    on_grid = model.continues_exactly | ((state.position % CHUNK) == 0)
    taint = jnp.where(on_grid, Provenance.PREFILL, Provenance.PREFILL_OFF_GRID).astype(jnp.int32)
    new_state = _advance(state, new_layers, lengths, taint, model.numerics_tag)
    if last_only:
        x = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, D]
    if checkpoint_stride is None:
        return new_state, _logits(model, x)
    if replay:  # counted from the last grid boundary (the replayed open chunk comes first)
        start = state.position - state.position % CHUNK
        span = state.position % CHUNK + lengths
    else:
        start, span = state.position, lengths
    m = ckpts[0].recurrent.shape[1] if ckpts else 0
    rel = checkpoint_stride * jnp.arange(1, m + 1)
    found = PrefillCheckpoints(position=start[:, None] + rel[None, :], valid=rel[None, :] <= span[:, None],
                               gdn=tuple(ckpts))
    return new_state, _logits(model, x), found


def decode_step(model: Model, state: ModelState, token: jax.Array):
    """Pure decode of one token per row. token int32 [B]. Returns (state, logits fp32 [B, Vocab]).

    Recurrent mode: the one-token recurrent update (taints the state DECODE). Replay mode: a one-token prefill —
    with the chunked GDN prefill the replay step over the open chunk since the last grid boundary, with
    gdn_prefill="recurrent" one step of the token-by-token kernel — bitwise what a prefill computes.

    Shapes, dtypes and the state's layout are checked (InputError), under `jit` too; values are not.
    """
    check_model(model)
    token, _ = _check_shapes(model.config, state, token, None, model.keeps_open_chunk, decode=True,
                             dtype=model.dtype)
    if model.decode_mode == "replay":
        state, logits = prefill_chunk(model, state, token[:, None], jnp.ones_like(state.position))
        return state, logits[:, 0]
    cfg, p, det = model.config, model.params, _det(model)
    x = p.embed[token].astype(model.dtype)  # [B, D]
    ones = jnp.ones_like(state.position)
    new_layers = []
    for lp, ls, kind in zip(p.layers, state.layers, cfg.layer_types):
        h = rms_norm(x, lp.input_norm, cfg.rms_norm_eps)
        if kind == LINEAR:
            h, ls = gdn_decode(cfg, lp.mixer, h, ls, model.backend, det)
        else:
            h, ls = attention(cfg, lp.mixer, h[:, None], ls, state.position, None, det, decode=True,
                              backend=model.backend)
            h = h[:, 0]
        x = x + h
        x = x + feed_forward(cfg, lp.mlp, rms_norm(x, lp.post_attention_norm, cfg.rms_norm_eps), det)
        new_layers.append(ls)
    taint = jnp.full_like(state.position, Provenance.DECODE)
    return _advance(state, new_layers, ones, taint, model.numerics_tag), _logits(model, x)


# XLA may keep bf16 intermediates in fp32 across fused ops ("excess precision"), so a bf16 result's rounding
# would depend on how its program was fused, i.e. on the call's shapes: a bf16 replay decode then differs from a
# teacher-forced prefill (measured on CPU). jaxgdn's own compiled entry points round every bf16 op; jit the pure
# functions yourself with `compiler_options=COMPILER_OPTIONS` for the same guarantee.
# On the GPU, XLA runs a compiled program's kernels as command buffers (CUDA graphs); "CONCURRENT" lets kernels with
# no data between them run side by side (XLA's default runs them one after another). Only the order of launches
# changes, not any kernel's arithmetic: on one H200 the model's replay and batch-invariance checks PASS under it, and
# a 4-layer 9B slice's decode step at B=64 takes 1.72 against 1.94 ms (deterministic recurrent) and 1.85 against
# 2.09 (replay), the prefill and the default mode's decode unchanged within the runs' spread (BENCHMARKS.md,
# runs 136-140; not yet run on a multi-GPU mesh). Since 2026-12-04. XLA:CPU ignores the option.
COMPILER_OPTIONS = {"xla_allow_excess_precision": False, "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"}


def jit(fn, **kwargs):
    """`jax.jit` with jaxgdn's compiler options (see COMPILER_OPTIONS); other `jax.jit` arguments pass through, and
    `compiler_options` given here are added to those (a key given wins)."""
    options = {**COMPILER_OPTIONS, **(kwargs.pop("compiler_options", None) or {})}
    return jax.jit(fn, compiler_options=options, **kwargs)


_prefill_jit = jit(prefill_chunk, static_argnames=("checkpoint_stride", "last_only"))
_decode_jit = jit(decode_step)


def gdn_states(state: ModelState) -> tuple[GDNLayerState, ...]:
    """The GDN layers' states, in layer order."""
    if not isinstance(state, ModelState):
        raise InputError(f"state must be a jaxgdn ModelState; got {type(state).__name__}")
    return tuple(s for s in state.layers if isinstance(s, GDNLayerState))
