"""Tensor parallelism over heads, with JAX's own sharding: where each parameter and state leaf lives on a mesh.

    mesh = jaxgdn.sharding.make_mesh(2)                  # 1-D mesh, axis "tp", AxisType.Auto
    model = jaxgdn.load_pretrained(path, mesh=mesh)      # or jaxgdn.sharding.shard_model(model, mesh)
    state = model.init_state(B, N)                       # created already split (jaxgdn.sharding.init_state)
    state, logits = model.prefill_chunk(state, tokens)   # unchanged; so are decode_step and generate
    with jax.set_mesh(mesh):                             # for your own jit of the pure functions:
        state, logits = jaxgdn.model.jit(jaxgdn.prefill_chunk)(model, state, tokens, lengths)

The state functions are unchanged: under `jax.jit` the inputs' `NamedSharding`s are annotations, XLA's SPMD
partitioner splits the computation and inserts the collectives (two all-reduces per layer — after the mixer's
output projection and after the MLP's down projection — plus one for the embedding gather). XLA cannot split a
Pallas call: with the mesh set as JAX's context mesh (`jax.set_mesh`; the Model methods and `generate` set it
for a model on a mesh), `pallas_kernels.api` runs the GDN and attention kernels (and deterministic mode's
fixed-tile matmuls) per shard inside `shard_map`; without it XLA gathers their inputs onto every device (correct,
slow). The pure-JAX reference needs nothing of the kind.

Placement (Megatron-style, split over heads; matrices are [in, out]):
  GDN        in_proj_qkv / conv_weight columns and the conv state's channels: by key-head group (see layout);
             in_proj_z / in_proj_a / in_proj_b columns, A_log, dt_bias, the recurrent state [B, HV, K, V] and the
             replay buffers: by value head; out_proj by rows (its input). norm_weight replicated.
  attention  q_proj columns (per head: query then gate) and o_proj rows by query head; k_proj / v_proj columns and
             the KV cache [B, N, HKV, Dh] by KV head. q_norm / k_norm replicated.
  MLP / MoE  gate / up columns and down rows by intermediate index (every expert split the same way; the router
             and the shared-expert gate replicated).
  vocabulary embed rows and lm_head columns (logits come out split over the vocabulary).
  norms, positions, provenance, origin: replicated.
An axis the mesh size does not divide is replicated instead (`plan` says what is split): a GDN layer is split
only when tp | HK (each shard keeps whole key groups; HV = r HK then divides too), else the whole GDN mixer and its
states are replicated; attention KV heads (and the KV cache) are replicated when tp does not divide HKV while the
query heads may still be split; MLP, expert and vocabulary axes each on their own.

Layout: `in_proj_qkv`'s channels are [q (HK K) | k (HK K) | v (HV V)] in Hugging Face order; a contiguous split
of that axis would hand one shard all of q and k and the other v. A model split over GDN heads therefore uses
the grouped order (`ModelConfig.gdn_qkv_groups = HK`): per key head h, [q_h | k_h | v of its r value heads]
(the order Qwen3-Next's packed in_proj_qkvz already uses), so every split by whole groups is local and needs no
communication. The conv state and replay buffers follow the parameters' order, so a state belongs to a layout:
`convert_layout` moves states and cache checkpoints between layouts (`with_layout` moves a model). The grouped
layout does not depend on the mesh size, so states move between any meshes that split the GDN heads. Without
that config field (an older jaxgdn) the Hugging Face order is kept and XLA moves the q/k/v pieces between the
shards itself (correct; three collective-permutes per GDN layer).

Determinism: for a fixed mesh every per-row reduction is local or a sum over the mesh that is elementwise and
independent of the batch; on CPU (tests/test_sharding.py) deterministic mode stays bitwise across runs, batch
compositions, grid splits and warm/cold cache on a mesh. A sharded model is not bitwise equal to the unsharded
one (the out/o/down projections sum their inputs in tp pieces), only within rounding. On GPUs an all-reduce is
NCCL's: with 2 devices each element is a + b whatever the algorithm (the same in either order), so an all-reduce
is kept; with more, NCCL's summation order of an element can depend on the message size, i.e. on the batch, so
deterministic mode on meshes of more than 2 devices all-gathers the row-split output projections' (GDN out_proj,
attention o_proj, MLP down_proj) fp32 partial products and adds them in device order, and so do the mixture of
experts' routed and shared down projections (`pallas_kernels.expert_down(fixed_order=True)`). Deterministic mode's
fixed-tile matmuls and the attention kernel run per shard in `shard_map` (`pallas_kernels.matmul_invariant`'s
`row_groups` / `col_groups`, `attention_invariant`), as the GDN kernels do; so does the default mode's attention
kernel. On two H200s every deterministic check passes with the per-shard kernels (BENCHMARKS.md, run S6: a row
alone == inside batches of 2/8/64 at prefill and decode, a grid split == one call, the first GDN layer step by step)
when the functions are compiled with `jaxgdn.model.COMPILER_OPTIONS`, as the library's entry points (`Model`
methods, `generate`, `score`, the engine) compile them. Compiled with plain `jax.jit`, XLA's default excess
precision lets a fusion keep bf16 intermediates in fp32 and the partitioned program fuses differently per batch
size: the same checks fail there (runs S3-S5, and S6 with `--plain-jit`). So jit the pure functions yourself as
`jaxgdn.model.jit(fn)` or with `compiler_options=jaxgdn.model.COMPILER_OPTIONS`.
Meshes of more than 2 GPUs have not been run (none lent so far). Run S6 predates the concurrent command-buffer
schedule in COMPILER_OPTIONS (2026-12-04; checked on one H200 only): the mesh's checks have not been run under it.
Caveat, CPU only: with backend="interpret" on a mesh, a row alone and the same row in a batch can differ in the
last bits (seen: 1.9e-9 in a GDN state, tiny model, 2 devices) although the kernel's inputs are bitwise equal —
XLA compiles the interpreted kernel body inside the partitioned program differently per batch size. The compiled
Pallas kernels (GPU) and the reference backend (the CPU default) are not affected.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .config import LINEAR, ModelConfig
from .errors import InputError, index_value
from .model import Model, _check_state_layout
from .params import AttentionParams, GDNParams, LayerParams, MLPParams, ModelParams, MoEParams
from .state import AttentionLayerState, GDNLayerState, ModelState, checked_sizes
from .state import init_state as _init_state

TP = "tp"  # the mesh axis heads are split over (pallas_kernels.api.TP_AXIS names the same axis)
_GROUPED_LAYOUT = "gdn_qkv_groups" in ModelConfig.__dataclass_fields__  # the config field of the grouped layout


# ---- the mesh ----------------------------------------------------------------------------------------------------

def make_mesh(tp: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D tensor-parallel mesh: axis "tp" over `tp` devices (default: all of `devices` / `jax.devices()`).

    The axis is `AxisType.Auto` (jax 0.11's `make_mesh` defaults to Explicit, under which slicing a split axis is
    an error instead of a resharding the partitioner works out).

    Raises InputError for a size that is not an integer >= 1 (bools refused), a size above the devices available,
    an explicit `devices` list that is empty, holds a non-device or the same device twice, or whose length differs
    from `tp`."""
    if tp is not None:
        try:
            tp = index_value(tp)
        except TypeError:
            raise InputError(f"make_mesh: the mesh size tp must be an integer >= 1; got {tp!r}") from None
    if tp is not None and tp < 1:
        raise InputError(f"make_mesh: the mesh size tp must be an integer >= 1; got {tp}")
    if devices is None:
        devices = list(jax.devices())
        if tp is not None and tp > len(devices):
            raise InputError(f"make_mesh: a mesh of {tp} devices needs at least that many; "
                             f"{len(devices)} available")
    else:
        if isinstance(devices, (str, bytes, jax.Device)):
            raise InputError(f"make_mesh: devices must be a sequence of jax devices; got {devices!r}")
        try:
            devices = list(devices)
        except TypeError:
            raise InputError(f"make_mesh: devices must be a sequence of jax devices; got {devices!r}") from None
        if not devices:
            raise InputError("make_mesh: devices is empty; a mesh needs at least one device")
        bad = [d for d in devices if not isinstance(d, jax.Device)]
        if bad:
            raise InputError(f"make_mesh: devices must be jax devices (jax.devices()); got {bad[0]!r}")
        if len(set(devices)) != len(devices):
            dup = next(d for i, d in enumerate(devices) if d in devices[:i])
            raise InputError(f"make_mesh: devices lists {dup} more than once; each device may appear only once")
        if tp is not None and tp != len(devices):
            raise InputError(f"make_mesh: a mesh of {tp} devices was asked for but {len(devices)} devices were "
                             f"given; pass exactly tp devices (or leave tp out)")
    tp = len(devices) if tp is None else tp
    return jax.make_mesh((tp,), (TP,), axis_types=(AxisType.Auto,), devices=devices[:tp])


def mesh_of(tree) -> Mesh | None:
    """The mesh the first leaf of `tree` (a Model, params, a state, ...) is placed on; None if not on a mesh."""
    if isinstance(tree, Model):
        tree = tree.params
    if isinstance(tree, ModelParams):
        tree = tree.embed  # every leaf of a placed model is on the one mesh
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def check_mesh(mesh, what: str = "check_mesh") -> Mesh:
    """`mesh` itself when it is a `jax.sharding.Mesh` with a "tp" axis of type `AxisType.Auto`; InputError (naming
    `what`, the caller) otherwise. (Under an Explicit "tp" axis a model's first call fails inside JAX: slicing a
    split axis is an error there instead of a resharding; the mesh's other axes may be of any type.)"""
    if not isinstance(mesh, Mesh):
        raise InputError(f"{what}: mesh must be a jax.sharding.Mesh with a {TP!r} axis (e.g. from "
                         f"jaxgdn.sharding.make_mesh); got {type(mesh).__name__} {mesh!r}"[:300])
    _check_tp_axis(mesh, what)
    kind = mesh.axis_types[mesh.axis_names.index(TP)]
    if kind != AxisType.Auto:
        raise InputError(f"{what}: the mesh's {TP!r} axis is of type {kind}; tensor parallelism needs "
                         f"AxisType.Auto (build the mesh with jaxgdn.sharding.make_mesh)")
    return mesh


def _check_tp_axis(mesh, what: str) -> None:
    if TP not in mesh.axis_names:
        raise InputError(f"{what}: the mesh has no {TP!r} axis (its axes: {tuple(mesh.axis_names)}); tensor "
                         f"parallelism needs a {TP!r} axis: build the mesh with jaxgdn.sharding.make_mesh")


def _tp_size(mesh, what: str) -> int:
    """The "tp" size of a Mesh / AbstractMesh, or `mesh` itself as an int when it is an integer >= 1 (Python,
    NumPy or concrete JAX; not a bool); InputError naming `what` otherwise."""
    if isinstance(mesh, (Mesh, jax.sharding.AbstractMesh)):
        _check_tp_axis(mesh, what)
        return mesh.shape[TP]
    try:
        tp = index_value(mesh)
    except TypeError:
        raise InputError(f"{what}: mesh must be a jax.sharding.Mesh with a {TP!r} axis (e.g. from "
                         f"jaxgdn.sharding.make_mesh) or a tensor-parallel size (an integer >= 1); got "
                         f"{type(mesh).__name__} {mesh!r}"[:300]) from None
    if tp < 1:
        raise InputError(f"{what}: the tensor-parallel size must be an integer >= 1; got {tp}")
    return tp


def _config_of(x, what: str) -> ModelConfig:
    """The ModelConfig of `x`, a Model or a ModelConfig; InputError naming `what` (the argument) otherwise."""
    if isinstance(x, Model):
        return x.config
    if isinstance(x, ModelConfig):
        return x
    raise InputError(f"{what} must be a jaxgdn Model or ModelConfig; got {type(x).__name__}")


def _check_flag(x, what: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise InputError(f"{what} must be True or False; got {x!r}")
    return bool(x)


# ---- what is split -----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TPPlan:
    """Which axes a `tp`-way mesh splits for one config (an axis tp does not divide is replicated)."""

    tp: int
    gdn_heads: bool  # tp | HK: every GDN head (whole key groups per shard), the q/k/v projection and conv with them
    grouped_qkv: bool  # gdn_heads in the grouped q/k/v layout (False: Hugging Face order, XLA moves the pieces)
    attn_heads: bool  # tp | H: q_proj columns, o_proj rows
    attn_kv: bool  # tp | HKV: k_proj / v_proj columns, the KV cache
    mlp: bool | None  # tp | intermediate_size (dense MLP layers; None: the model has none)
    experts: bool | None  # tp | moe_intermediate_size (every routed expert; None: no MoE layer)
    shared_expert: bool | None  # tp | shared_expert_intermediate_size
    vocab: bool  # tp | vocab_size: embed rows, lm_head columns

    def describe(self) -> str:
        parts = {"GDN heads": self.gdn_heads, "attention heads": self.attn_heads,
                 "KV heads": self.attn_kv, "MLP": self.mlp, "experts": self.experts,
                 "shared expert": self.shared_expert, "vocabulary": self.vocab}
        split = [k for k, v in parts.items() if v]
        rep = [k for k, v in parts.items() if v is False]
        return f"tp={self.tp}: split {', '.join(split) or 'nothing'}; replicated {', '.join(rep) or 'nothing'}"


def plan(config: ModelConfig | Model, mesh: Mesh | int) -> TPPlan:
    """What a mesh of `mesh`'s "tp" size (a Mesh, an AbstractMesh or the size itself, an integer >= 1) splits for
    `config` (a ModelConfig, or a Model: its config). InputError for any other argument."""
    return _plan(_config_of(config, "plan: config"), _tp_size(mesh, "plan"))


def _plan(c: ModelConfig, tp: int) -> TPPlan:
    div = lambda n: n > 0 and n % tp == 0  # noqa: E731
    heads = div(c.linear_num_key_heads)
    moe = any(map(c.is_moe_layer, range(c.num_layers)))
    return TPPlan(tp=tp, gdn_heads=heads, grouped_qkv=heads and tp > 1 and _GROUPED_LAYOUT,
                  attn_heads=div(c.num_attention_heads),
                  attn_kv=div(c.num_key_value_heads),
                  mlp=div(c.intermediate_size) if not all(map(c.is_moe_layer, range(c.num_layers))) else None,
                  experts=div(c.moe_intermediate_size) if moe else None,
                  shared_expert=div(c.shared_expert_intermediate_size) if moe else None, vocab=div(c.vocab_size))


def _s(flag: bool, *spec) -> P:
    """PartitionSpec `spec` when `flag`, else replicated."""
    return P(*spec) if flag else P()


def param_specs(config: ModelConfig | Model, mesh: Mesh | int) -> ModelParams:
    """A ModelParams-shaped tree of PartitionSpecs (None where the params hold None: a tied lm_head); arguments as
    `plan`'s."""
    c = _config_of(config, "param_specs: config")
    pl = _plan(c, _tp_size(mesh, "param_specs"))
    col, row = (None, TP), (TP, None)
    layers = []
    for i, kind in enumerate(c.layer_types):
        if kind == LINEAR:
            h = pl.gdn_heads  # q/k/v and conv columns by key-head group; the rest by value head
            mixer = GDNParams(in_proj_qkv=_s(h, *col), in_proj_z=_s(h, *col), in_proj_b=_s(h, *col),
                              in_proj_a=_s(h, *col), conv_weight=_s(h, *col), A_log=_s(h, TP), dt_bias=_s(h, TP),
                              norm_weight=P(), out_proj=_s(h, *row))
        else:
            mixer = AttentionParams(q_proj=_s(pl.attn_heads, *col), k_proj=_s(pl.attn_kv, *col),
                                    v_proj=_s(pl.attn_kv, *col), o_proj=_s(pl.attn_heads, *row), q_norm=P(), k_norm=P())
        if c.is_moe_layer(i):
            e = pl.experts
            sh = pl.shared_expert
            mlp = MoEParams(router=P(), gate_proj=_s(e, None, None, TP), up_proj=_s(e, None, None, TP),
                            down_proj=_s(e, None, TP, None),
                            shared=MLPParams(_s(sh, *col), _s(sh, *col), _s(sh, *row)), shared_gate=P())
        else:
            mlp = MLPParams(_s(pl.mlp, *col), _s(pl.mlp, *col), _s(pl.mlp, *row))
        layers.append(LayerParams(input_norm=P(), mixer=mixer, post_attention_norm=P(), mlp=mlp))
    return ModelParams(embed=_s(pl.vocab, TP, None), layers=tuple(layers), final_norm=P(),
                       lm_head=None if c.tie_word_embeddings else _s(pl.vocab, None, TP))


def _gdn_state_specs(pl: TPPlan, replay: bool, lead: tuple = (None,)) -> GDNLayerState:
    """Specs of one GDN layer's state; `lead`: the axes before the per-sequence ones (batch; batch and M)."""
    ch = _s(pl.gdn_heads, *lead, None, TP)  # [.., KC-1, C] / [.., 64, C]
    return GDNLayerState(conv=ch, recurrent=_s(pl.gdn_heads, *lead, TP),
                         open_qkv=ch if replay else None,
                         open_gates=_s(pl.gdn_heads, *lead, None, None, TP) if replay else None,
                         open_x=_s(pl.gdn_heads, *lead, TP) if replay else None,
                         open_vnew=_s(pl.gdn_heads, *lead, TP) if replay else None)


def state_specs(config: ModelConfig | Model, mesh: Mesh | int, replay: bool = False) -> ModelState:
    """A ModelState-shaped tree of PartitionSpecs (`replay`, True or False: with the replay-mode open-chunk
    buffers, `Model.keeps_open_chunk`); config and mesh as `plan`'s."""
    config = _config_of(config, "state_specs: config")
    replay = _check_flag(replay, "state_specs: replay")
    pl = _plan(config, _tp_size(mesh, "state_specs"))
    layers = tuple(_gdn_state_specs(pl, replay) if t == LINEAR
                   else AttentionLayerState(keys=_s(pl.attn_kv, None, None, TP), values=_s(pl.attn_kv, None, None, TP))
                   for t in config.layer_types)
    return ModelState(layers=layers, position=P(), provenance=P(), origin=P())


def _is_replay(state: ModelState) -> bool:
    return any(isinstance(s, GDNLayerState) and s.open_qkv is not None for s in state.layers)


# ---- the q/k/v channel layout ------------------------------------------------------------------------------------

def layout_groups(config: ModelConfig | Model) -> int:
    """The q/k/v channel layout of a config (or a Model's): 1 (Hugging Face order) or G key-head groups of
    [q_g | k_g | v_g]. InputError for any other argument."""
    return getattr(_config_of(config, "layout_groups: config"), "gdn_qkv_groups", 1)


def _checked_groups(config: ModelConfig, groups, what: str) -> int:
    """`groups` as a Python int when it is a layout of `config`: an integer (not a bool) dividing its
    linear_num_key_heads HK; InputError naming `what` otherwise."""
    HK = config.linear_num_key_heads
    valid = [g for g in range(1, HK + 1) if HK % g == 0]
    try:
        g = index_value(groups)
    except TypeError:
        g = None
    if g not in valid:
        raise InputError(f"{what}: groups must be an integer dividing the {HK} key heads (one of {valid}); "
                         f"got {groups!r}")
    return g


def qkv_permutation(config: ModelConfig | Model, groups: int) -> np.ndarray:
    """perm [C]: channel j of the `groups`-grouped layout is channel perm[j] of the Hugging Face layout (groups: an
    integer dividing linear_num_key_heads, else InputError)."""
    config = _config_of(config, "qkv_permutation: config")
    groups = _checked_groups(config, groups, "qkv_permutation")
    HK, HV, K, V = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                    config.linear_value_head_dim)
    kd, kg, vg = HK * K, HK // groups * K, HV // groups * V
    parts = []
    for g in range(groups):
        parts += [np.arange(g * kg, (g + 1) * kg), kd + np.arange(g * kg, (g + 1) * kg),
                  2 * kd + np.arange(g * vg, (g + 1) * vg)]
    return np.concatenate(parts)


def _relayout_index(config: ModelConfig, src: int, dst: int) -> np.ndarray | None:
    """idx with x_dst = x_src[..., idx] (None when the layouts are the same)."""
    if src == dst:
        return None
    inv_src = np.argsort(qkv_permutation(config, src))
    return inv_src[qkv_permutation(config, dst)]


def _take_last(x, idx):
    if idx is None or x is None:
        return x
    if isinstance(x, HostArray):
        return x.take(idx, axis=x.ndim - 1)
    return jnp.take(x, jnp.asarray(idx), axis=-1)


def _relayout_gdn_state(s: GDNLayerState, idx) -> GDNLayerState:
    return s._replace(conv=_take_last(s.conv, idx), open_qkv=_take_last(s.open_qkv, idx))


def with_layout(model: Model, groups: int) -> Model:
    """The same model with its q/k/v channels in the `groups` layout (params permuted, config updated); `groups`:
    an integer dividing linear_num_key_heads (1: Hugging Face order), else InputError. Returns `model` itself when
    it is in that layout already. (On a model placed on a mesh the permuted leaves are placed where XLA puts them:
    `shard_model` places them again.)"""
    if not isinstance(model, Model):
        raise InputError(f"with_layout: model must be a jaxgdn Model; got {type(model).__name__}")
    groups = _checked_groups(model.config, groups, "with_layout")
    src = layout_groups(model.config)
    if src == groups:
        return model
    if not _GROUPED_LAYOUT:
        raise InputError("with_layout: this jaxgdn's ModelConfig has no gdn_qkv_groups field: only the Hugging Face "
                         "layout")
    idx = _relayout_index(model.config, src, groups)
    layers = tuple(lp._replace(mixer=lp.mixer._replace(in_proj_qkv=_take_last(lp.mixer.in_proj_qkv, idx),
                                                       conv_weight=_take_last(lp.mixer.conv_weight, idx)))
                   if isinstance(lp.mixer, GDNParams) else lp for lp in model.params.layers)
    return dataclasses.replace(model, params=model.params._replace(layers=layers),
                               config=dataclasses.replace(model.config, gdn_qkv_groups=groups))


_GDN_SHAPE = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")


def convert_layout(x, src: Model | ModelConfig, dst: Model | ModelConfig):
    """Move a ModelState, a cache `Checkpoint`, a PrefillCheckpoints or a tuple of GDNLayerState (or one) from
    `src`'s q/k/v channel layout to `dst`'s (e.g. a state of an unsharded model to continue on a sharded one).
    Returns x itself when the layouts agree.

    InputError when src or dst is neither a Model nor a ModelConfig, when their GDN head shapes differ (two
    different models), or when x is none of those or does not fit src (a state of another model), and, with `src`
    a Model, for a state whose rows another model advanced (`ModelState.origin`). The claim moves with the rows:
    with `src` a Model, a converted row's origin is `src`'s numerics in dst's layout (`Model.numerics_tag_for`),
    so a dst that differs from src in more than the layout marks it MIXED (its methods refuse it); with `src` a
    config, claimed rows become unclaimed (0). The same for a cache `Checkpoint` (`Checkpoint.origin`; its
    `numerics`, which named src's layout and weights, becomes None); a PrefillCheckpoints or bare GDN states carry
    no origin: which layout they are in no check can see — pass the model that made them as `src`."""
    from .cache import Checkpoint  # local: the cache module imports nothing from here
    from .state import PrefillCheckpoints

    src_c, dst_c = _config_of(src, "convert_layout: src"), _config_of(dst, "convert_layout: dst")
    differ = [f for f in _GDN_SHAPE if getattr(src_c, f) != getattr(dst_c, f)]
    if differ:
        raise InputError(f"convert_layout: src and dst are different models (their {', '.join(differ)} differ); "
                         f"a layout conversion moves a state between two layouts of one model")
    if isinstance(x, ModelState):
        _check_state(src_c, x, "convert_layout")
        _check_made_by(x, src, "convert_layout", "src")
    elif isinstance(x, (Checkpoint, PrefillCheckpoints)):
        _check_gdn_states(src_c, x.gdn, "convert_layout")
        if isinstance(x, Checkpoint):
            _check_made_by(x, src, "convert_layout", "src")
    elif isinstance(x, GDNLayerState):
        _check_gdn_states(src_c, (x,), "convert_layout")
    elif isinstance(x, (tuple, list)):
        _check_gdn_states(src_c, x, "convert_layout")
    else:
        raise InputError(f"convert_layout: x must be a ModelState, a cache Checkpoint, a PrefillCheckpoints or a "
                         f"tuple of GDNLayerState; got {type(x).__name__}")
    idx = _relayout_index(src_c, layout_groups(src_c), layout_groups(dst_c))
    if idx is None:
        return x
    # The claim moves with the state: src's numerics in dst's layout (from a config alone, unclaimed: 0)
    moved = src.numerics_tag_for(dst_c) if isinstance(src, Model) else 0
    if isinstance(x, ModelState):
        return x._replace(layers=tuple(_relayout_gdn_state(s, idx) if isinstance(s, GDNLayerState) else s
                                       for s in x.layers),
                          origin=jnp.where(x.origin != 0, jnp.int32(moved), x.origin))
    if isinstance(x, Checkpoint):  # (its numerics_key named src's layout and weights: now unknown)
        return dataclasses.replace(x, gdn=tuple(_relayout_gdn_state(s, idx) for s in x.gdn),
                                   origin=moved if x.origin else 0, numerics=None)
    if isinstance(x, PrefillCheckpoints):
        return x._replace(gdn=tuple(_relayout_gdn_state(s, idx) for s in x.gdn))
    if isinstance(x, GDNLayerState):
        return _relayout_gdn_state(x, idx)
    return tuple(_relayout_gdn_state(s, idx) for s in x)


def _check_made_by(x, model, what: str, name: str) -> None:
    """`model`, where a Model, is the one whose numerics computed `x`, a ModelState (its claimed rows,
    `ModelState.origin`; concrete values only) or a cache Checkpoint (`Checkpoint.origin`, where set); InputError
    otherwise, prefixed with `what`, naming the argument `name`."""
    if not isinstance(model, Model) or isinstance(x.origin, jax.core.Tracer):
        return
    origin = np.atleast_1d(np.asarray(x.origin))
    other = (origin != 0) & (origin != model.numerics_tag)
    if np.any(other):
        row = int(np.argmax(other))
        subject, arg = (f"row {row} of the state", "state") if isinstance(x, ModelState) else ("the checkpoint", "ck")
        raise InputError(f"{what}: {subject} was computed by another model than {name} (numerics_tag "
                         f"{int(origin[row])}, {name}'s {model.numerics_tag}); "
                         + _other_layout_hint(model, int(origin[row]), arg))


def _other_layout_hint(model: Model, origin: int, x: str) -> str:
    """What to do about `x` (a state or checkpoint) of numerics_tag `origin` given for `model`: where `origin` is
    `model`'s numerics in another q/k/v layout (the unsharded model's, most often), convert it first."""
    hk = model.config.linear_num_key_heads
    for groups in (g for g in range(1, hk + 1) if hk % g == 0):
        if groups != model.config.gdn_qkv_groups and origin == model.numerics_tag_for(
                dataclasses.replace(model.config, gdn_qkv_groups=groups)):
            return (f"it is this model's in the q/k/v layout gdn_qkv_groups={groups}: move it with "
                    f"convert_layout({x}, <the model in that layout>, model) first")
    return "pass the model that made it"


def _check_state(config: ModelConfig, state, what: str, dtype=None) -> None:
    """`state` a ModelState laid out for `config` (`model._check_state_layout`: layer kinds, head shapes, one batch;
    with the model's `dtype`, the arrays' dtypes too); InputError prefixed with `what` otherwise."""
    try:
        _check_state_layout(config, state, None, dtype)
    except InputError as e:
        raise InputError(f"{what}: {e}") from None


def _check_gdn_states(config: ModelConfig, states, what: str) -> None:
    """`states` GDNLayerStates of `config`'s GDN shapes: conv (and open_qkv) over its C channels, the recurrent
    state [.., HV, K, V]; InputError naming `what` otherwise."""
    C = config.gdn_conv_dim
    rec = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    for i, s in enumerate(states):
        if not isinstance(s, GDNLayerState):
            raise InputError(f"{what}: GDN layer state {i} must be a GDNLayerState; got {type(s).__name__}")
        chans = [np.shape(x)[-1:] for x in (s.conv, s.open_qkv) if x is not None]
        if any(c != (C,) for c in chans) or tuple(np.shape(s.recurrent)[-3:]) != rec:
            raise InputError(f"{what}: GDN layer state {i} has conv {np.shape(s.conv)} and recurrent "
                             f"{np.shape(s.recurrent)}; the model's config needs {C} channels and [.., {rec[0]}, "
                             f"{rec[1]}, {rec[2]}] (a state of another model)")


# ---- host tensors (the sharded checkpoint loader) ----------------------------------------------------------------

class HostArray:
    """A tensor still on the host — a view of a memory-mapped file, or a lazy stack / permutation of such views —
    that is read one shard's slice at a time (`read(index)`), converted to `dtype` on the way.

    `jaxgdn.checkpoint.read_params(..., lazy=True)` builds parameters of these; `place` turns each into a sharded
    `jax.Array` through `jax.make_array_from_callback`, so no device (and no host buffer) ever holds a whole
    tensor that is split."""

    def __init__(self, source, dtype, shape=None):
        self.source, self.dtype = source, jnp.dtype(dtype)
        self.shape = tuple(source.shape if shape is None else shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _raw(self, index: tuple) -> np.ndarray:
        return np.asarray(self.source[index])

    def read(self, index=None) -> np.ndarray:
        """The slice `index` (a tuple of slices, as `make_array_from_callback` passes) in the target dtype."""
        index = tuple(index) if index is not None else ()
        index = index + (slice(None),) * (self.ndim - len(index))
        x = self._raw(index)
        if x.dtype != self.dtype:  # via fp32, as the eager loader converts (bf16 -> fp32 is exact)
            x = (x if x.dtype == np.float32 else x.astype(np.float32)).astype(self.dtype)
        return np.ascontiguousarray(x)

    def take(self, idx: np.ndarray, axis: int) -> "HostArray":
        """A lazy x.take(idx, axis)."""
        return _HostTake(self, np.asarray(idx), axis)

    def __array__(self, dtype=None, copy=None):
        x = self.read()
        return x if dtype is None else x.astype(dtype)


class _HostTake(HostArray):
    def __init__(self, base: HostArray, idx: np.ndarray, axis: int):
        shape = base.shape[:axis] + (len(idx),) + base.shape[axis + 1:]
        super().__init__(base, base.dtype, shape)
        self.idx, self.axis = idx, axis

    def _raw(self, index):
        sel = self.idx[index[self.axis]]
        # read the selected channels as a few contiguous runs (a split of a grouped layout is 3 runs per group)
        runs = np.split(sel, np.nonzero(np.diff(sel) != 1)[0] + 1) if len(sel) else []
        pieces = []
        for r in runs:
            sub = list(index)
            sub[self.axis] = slice(int(r[0]), int(r[-1]) + 1)
            pieces.append(self.source._raw(tuple(sub)))
        if not pieces:
            return np.zeros(tuple(len(range(*s.indices(n))) for s, n in zip(index, self.shape)), self.source.dtype)
        return np.concatenate(pieces, axis=self.axis)


class HostStack(HostArray):
    """A lazy np.stack(parts) along a new leading axis (MoE experts, one memory-mapped tensor each)."""

    def __init__(self, parts: Sequence[HostArray], dtype=None):
        first = parts[0]
        super().__init__(self, first.dtype if dtype is None else dtype, (len(parts),) + tuple(first.shape))
        self.parts = list(parts)

    def _raw(self, index):
        rows = range(len(self.parts))[index[0]]
        return np.stack([self.parts[e]._raw(index[1:]) for e in rows])


def host_array(x: np.ndarray, dtype) -> HostArray:
    """Wrap a host (memory-mapped) array for lazy, sliced reading in `dtype`."""
    return HostArray(x, dtype)


# ---- placement ---------------------------------------------------------------------------------------------------

def _place(x, sharding: NamedSharding):
    if x is None:
        return None
    if isinstance(x, HostArray):
        return jax.make_array_from_callback(x.shape, sharding, x.read, dtype=x.dtype)
    return jax.device_put(x, sharding)


def place(tree, specs, mesh: Mesh):
    """device_put every leaf of `tree` with NamedSharding(mesh, spec) (HostArray leaves read shard by shard)."""
    return jax.tree.map(lambda spec, x: _place(x, NamedSharding(mesh, spec)), specs, tree,
                        is_leaf=lambda s: isinstance(s, P))


def shard_model(model: Model, mesh: Mesh) -> Model:
    """The model with its parameters placed for tensor parallelism on `mesh` (see the module docstring).

    A model split over GDN heads is moved to the grouped q/k/v layout first (`with_layout`: its config's
    gdn_qkv_groups becomes HK). Parameters may be jax arrays (device_put: each device receives its slice; a model
    already on a mesh is moved to this one) or HostArrays from the lazy loader (each device's slice read from the
    memory map). Dtype, backend, determinism, decode mode and the rest of the config are kept."""
    check_mesh(mesh, "shard_model")
    if not isinstance(model, Model):
        raise InputError(f"shard_model: model must be a jaxgdn Model; got {type(model).__name__}")
    groups = _sharded_layout(model.config, mesh)
    model = with_layout(model, groups)
    params = place(model.params, param_specs(model.config, mesh), mesh)
    return dataclasses.replace(model, params=params)


def _sharded_layout(config: ModelConfig, mesh: Mesh) -> int:
    """The q/k/v layout `shard_model` gives a model of `config` on `mesh`: HK groups when the mesh splits the GDN
    heads (and this ModelConfig knows the grouped layout), else the config's own."""
    return config.linear_num_key_heads if plan(config, mesh).grouped_qkv else layout_groups(config)


def _check_model_mesh(model, mesh: Mesh, what: str) -> None:
    """A state for a `model` (a Model; anything else is not checked) placed on a mesh must be on that mesh: its
    jitted functions refuse arguments on other devices. InputError naming `what` otherwise."""
    have = mesh_of(model.params) if isinstance(model, Model) else None
    if have is not None and have != mesh:
        raise InputError(f"{what}: the model is placed on another mesh ({_describe(have)}) than the one given "
                         f"({_describe(mesh)}); its states must be on its own mesh: leave the mesh out or pass the "
                         f"model's (jaxgdn.sharding.mesh_of(model)), or shard_model(model, mesh) first")


def _describe(mesh: Mesh) -> str:
    return f"{dict(mesh.shape)} on devices {[d.id for d in mesh.devices.flat]}"


def _check_sharded_layout(config: ModelConfig, mesh: Mesh, what: str, thing: str) -> None:
    """A state or checkpoint placed on `mesh` is used by the model sharded there: refuse a `config` in another
    q/k/v layout than that model's (e.g. the unsharded model's, whose states must be converted first)."""
    have, want = layout_groups(config), _sharded_layout(config, mesh)
    if have != want:
        raise InputError(f"{what}: config is in the q/k/v layout gdn_qkv_groups={have}, but the model sharded on this "
                         f"mesh uses gdn_qkv_groups={want} (shard_model regroups it): pass the sharded model (or its "
                         f"config), after moving a {thing} of the unsharded model with convert_layout({thing}, "
                         f"unsharded_model, sharded_model)")


def shard_state(state: ModelState, mesh: Mesh, config: Model | ModelConfig) -> ModelState:
    """The state placed on `mesh` by `state_specs` (heads / channels split; a state already on a mesh is moved).

    `config`: the model sharded on `mesh` (`shard_model`), or its config. The state must already be in that model's
    q/k/v layout (a state made by the sharded model, or `convert_layout` of an unsharded one's). InputError for a
    bad mesh, a model placed on another mesh, a config that is neither, a config in another layout than a model
    sharded on `mesh` has (e.g. the unsharded model's, when the mesh splits the GDN heads), a state that is not a
    ModelState of that config, or, given a Model, one with rows another model advanced (`ModelState.origin`)."""
    check_mesh(mesh, "shard_state")
    _check_model_mesh(config, mesh, "shard_state")
    model = config
    dtype = config.dtype if isinstance(config, Model) else None  # (a config alone does not say the dtype)
    config = _config_of(config, "shard_state: config")
    _check_state(config, state, "shard_state", dtype)
    _check_made_by(state, model, "shard_state", "config")
    _check_sharded_layout(config, mesh, "shard_state", "state")
    return place(state, state_specs(config, mesh, _is_replay(state)), mesh)


def init_state(model: Model, batch_size: int, capacity: int, mesh: Mesh | None = None) -> ModelState:
    """A fresh state, created directly in its sharded placement (no device ever holds it whole).

    mesh: default the mesh the model's parameters are on (an unsharded model gets `model.init_state`); a model on
    a mesh takes only that one (InputError for another: the model could not use the state).
    batch_size and capacity: integers >= 1 (Python, NumPy or concrete JAX integer scalars; not bools), else
    InputError, as `jaxgdn.state.init_state`."""
    if not isinstance(model, Model):
        raise InputError(f"init_state: model must be a jaxgdn Model; got {type(model).__name__}")
    batch_size, capacity = checked_sizes(batch_size, capacity)
    if mesh is not None:
        check_mesh(mesh, "init_state")
        _check_model_mesh(model, mesh, "init_state")
    mesh = mesh_of(model.params) if mesh is None else mesh
    replay = model.keeps_open_chunk
    if mesh is None:
        return _init_state(model.config, batch_size, capacity, model.dtype, replay)
    return _sharded_zeros(model.config, batch_size, capacity, jnp.dtype(model.dtype), replay, mesh)()


@functools.lru_cache(maxsize=64)
def _sharded_zeros(config, batch_size, capacity, dtype, replay, mesh):
    """A compiled function creating the fresh state directly in its placement (cached per shape and mesh)."""
    specs = state_specs(config, mesh, replay)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))
    return jax.jit(functools.partial(_init_state, config, batch_size, capacity, dtype, replay),
                   out_shardings=shardings)


def checkpoint_specs(config: ModelConfig | Model, mesh: Mesh | int, replay: bool = False):
    """Specs of a cache `Checkpoint`'s leaves (no batch axis): (gdn, kv) trees (`replay`, True or False: with the
    open-chunk buffers a replay-mode checkpoint off the grid keeps; on the grid it has none, `state.at_boundary`);
    config and mesh as `plan`'s."""
    config = _config_of(config, "checkpoint_specs: config")
    replay = _check_flag(replay, "checkpoint_specs: replay")
    pl = _plan(config, _tp_size(mesh, "checkpoint_specs"))
    gdn = tuple(_gdn_state_specs(pl, replay, lead=()) for _ in config.gdn_layers)
    kv = tuple(AttentionLayerState(keys=_s(pl.attn_kv, None, TP), values=_s(pl.attn_kv, None, TP))
               for _ in config.attention_layers)
    return gdn, kv


def shard_checkpoint(ck, mesh: Mesh, config: Model | ModelConfig):
    """A cache `Checkpoint` with its leaves placed on `mesh` (e.g. one restored from host memory or disk); given a
    list or tuple of checkpoints, a list of them placed together: the key/value blocks the checkpoints of a sequence
    share (`Checkpoint.kv_blocks`) are placed once and stay shared (placed one call each, every checkpoint gets a
    copy of its own).

    `config`, and the checkpoint's q/k/v layout, as `shard_state`'s. InputError for a bad mesh or config, a
    checkpoint that is not a well-formed Checkpoint of that config (one GDN / attention layer state per such layer
    of the model, of its head shapes), or, given a Model, one another model computed (`Checkpoint.origin`)."""
    from .cache import _checked  # local: the cache module imports nothing from here

    check_mesh(mesh, "shard_checkpoint")
    _check_model_mesh(config, mesh, "shard_checkpoint")
    model = config
    config = _config_of(config, "shard_checkpoint: config")
    many = type(ck) in (list, tuple)  # (not a NamedTuple: a ModelState is one, and refused below)
    cks = [_checked(c, f"shard_checkpoint: ck[{i}]" if many else "shard_checkpoint: ck")
           for i, c in enumerate(ck if many else [ck])]
    for c in cks:
        _check_checkpoint_shapes(config, c)
        _check_made_by(c, model, "shard_checkpoint", "config")
    _check_sharded_layout(config, mesh, "shard_checkpoint", "checkpoint")
    placed = {}  # the leaves' ids of a block -> the block placed

    def place_block(block, kv_s):
        key = tuple(map(id, jax.tree.leaves(block)))
        if key not in placed:
            placed[key] = place(block, kv_s, mesh)
        return placed[key]

    out = []
    for c in cks:
        gdn_s, kv_s = checkpoint_specs(config, mesh, any(s.open_qkv is not None for s in c.gdn))
        out.append(dataclasses.replace(c, gdn=place(c.gdn, gdn_s, mesh),
                                       kv_blocks=tuple(place_block(block, kv_s) for block in c.kv_blocks)))
    return out if many else out[0]


def _check_checkpoint_shapes(config: ModelConfig, ck) -> None:
    """One layer state per GDN / attention layer of `config`, of its head shapes; InputError otherwise."""
    what = "shard_checkpoint: ck"
    ngdn, nattn = len(config.gdn_layers), len(config.attention_layers)
    if len(ck.gdn) != ngdn or len(ck.kv_blocks[0]) != nattn:
        raise InputError(f"{what} holds {len(ck.gdn)} GDN and {len(ck.kv_blocks[0])} attention layer states; the "
                         f"model has {ngdn} and {nattn} (a checkpoint of another model)")
    _check_gdn_states(config, ck.gdn, what)
    heads = (config.num_key_value_heads, config.head_dim)
    for i, a in (ia for block in ck.kv_blocks for ia in enumerate(block)):
        if tuple(np.shape(a.keys)[1:]) != heads or tuple(np.shape(a.values)[1:]) != heads:
            raise InputError(f"{what}: attention layer state {i} has keys {np.shape(a.keys)} and values "
                             f"{np.shape(a.values)}; the model's config needs [P, {heads[0]}, {heads[1]}] (a "
                             f"checkpoint of another model)")


def unshard_model(model: Model, device: jax.Device | None = None) -> Model:
    """The model gathered onto one device (`device`, default `jax.devices()[0]`), in the Hugging Face q/k/v layout
    (for export and comparison). A model not on a mesh is moved there too (and to that layout). InputError for a
    `model` that is not a Model or a `device` that is not a jax.Device."""
    if not isinstance(model, Model):
        raise InputError(f"unshard_model: model must be a jaxgdn Model; got {type(model).__name__}")
    if device is not None and not isinstance(device, jax.Device):
        raise InputError(f"unshard_model: device must be a jax.Device (e.g. jax.devices()[0]) or None; got "
                         f"{type(device).__name__} {device!r}"[:300])
    device = jax.devices()[0] if device is None else device
    model = with_layout(model, 1)
    return dataclasses.replace(model, params=jax.device_put(model.params, device))


def spec_of(x) -> P | None:
    """The PartitionSpec of a jax.Array on a mesh (None for a single-device array)."""
    s = getattr(x, "sharding", None)
    return s.spec if isinstance(s, NamedSharding) else None


def normalize_spec(spec: P | None, ndim: int) -> tuple:
    """A spec as a tuple of ndim entries (trailing Nones filled in), for comparing placements."""
    t = tuple(spec) if spec is not None else ()
    return t + (None,) * (ndim - len(t))


def check_placement(tree, specs) -> list[str]:
    """The leaves of `tree` whose sharding differs from `specs` (a tree of PartitionSpecs: `param_specs`,
    `state_specs`, ...), one line each; a leaf not on a mesh always differs. Empty when every leaf is placed as
    planned; one line when the tree and the specs differ in their number of leaves or their structure. InputError
    when `specs` holds anything but PartitionSpecs (and None)."""
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    other = next((s for s in flat_specs if not isinstance(s, P)), None)
    if other is not None:
        raise InputError(f"check_placement: specs must be a tree of PartitionSpecs (e.g. param_specs(config, mesh)); "
                         f"it holds a leaf of type {type(other).__name__}")
    flat, tree_def = jax.tree_util.tree_flatten_with_path(tree)
    if len(flat) != len(flat_specs):
        return [f"{len(flat)} leaves but {len(flat_specs)} specs"]
    spec_def = jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P))
    if tree_def != spec_def:  # as many leaves, in another structure: a pairing by order would mean nothing
        return [f"the tree's structure {tree_def} differs from the specs' {spec_def}"[:500]]
    bad = []
    for (path, x), want in zip(flat, flat_specs):
        got = spec_of(x)
        if got is None or normalize_spec(got, np.ndim(x)) != normalize_spec(want, np.ndim(x)):
            bad.append(f"{jax.tree_util.keystr(path)}: {got} != {want}")
    return bad


__all__ = [
    "TP", "TPPlan", "HostArray", "HostStack", "make_mesh", "check_mesh", "mesh_of", "plan", "param_specs",
    "state_specs", "checkpoint_specs", "layout_groups", "qkv_permutation", "with_layout", "convert_layout",
    "host_array", "place", "shard_model", "shard_state", "init_state", "shard_checkpoint", "unshard_model", "spec_of",
    "check_placement",
]
