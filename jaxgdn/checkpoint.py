"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a `Model`.

Supported: Qwen3.5 (`qwen3_5`: `model.language_model.*`, ignoring `model.visual.*` and `mtp.*`), Qwen3.5 text
(`qwen3_5_text`) and Qwen3-Next (`qwen3_next`: packed `in_proj_qkvz` / `in_proj_ba` unpacked per key-head
group; per-expert MoE weights). Nothing is downloaded. Tensors are read through a memory map, one at a time.

Before any weights are read, config.json is checked field by field (`ModelConfig.from_hf_config`) and every tensor's
presence, shape and float dtype — and that no unexpected or duplicated tensor is there, and that the shard index
agrees with the shards — from the safetensors headers alone (`check_tensors`): a bad checkpoint is refused at once
with one `CheckpointError` naming the file and the field or tensors, not after minutes of loading.

With `mesh=` (`jaxgdn.sharding.make_mesh`), parameters are placed for tensor parallelism and each device's slice is
read from the memory map on its own (`jax.make_array_from_callback`): no tensor that is split is ever materialised
whole, on a device or in host memory (except Qwen3-Next's packed in_proj_qkvz / in_proj_ba, unpacked on the host
one tensor at a time).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import LINEAR, ModelConfig
from .errors import CheckpointError, InputError
from .model import Model, check_model_options, jit
from .params import AttentionParams, GDNParams, LayerParams, MLPParams, ModelParams, MoEParams

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # what a parameter may be stored as
_IGNORED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_LFS_POINTER = b"version https://git-lfs"


class _SafetensorsFile:
    """Memory-mapped safetensors reader (handles bf16 through ml_dtypes)."""

    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(len(_LFS_POINTER))
                if head == _LFS_POINTER:
                    raise CheckpointError(f"{path} is a Git LFS pointer, not the weights: fetch them (git lfs pull) "
                                          f"or download the file itself")
                (n,) = struct.unpack("<Q", head[:8])
                f.seek(8)
                if n > size - 8:  # not a safetensors file at all (an HTML error page, a pickle): n is garbage
                    raise CheckpointError(f"{path} is not a safetensors file: its first 8 bytes give a header of {n} "
                                          f"bytes, but the file has {size}")
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path} is not a safetensors file: its header is a JSON {type(header).__name__}, "
                                  f"not an object")
        header.pop("__metadata__", None)
        self.header, self.offset = header, 8 + n
        self._mm = None
        self._check_extents(size)

    def _check_extents(self, size: int) -> None:
        """Every tensor's bytes inside the file and of its shape's size: a truncated file (an interrupted download)
        or a corrupt header is named here, before any tensor is read."""
        for name, info in self.header.items():
            try:
                start, end = (int(x) for x in info["data_offsets"])
                shape = [int(d) for d in info["shape"]]
                dtype = info["dtype"]
                if not isinstance(dtype, str):
                    raise TypeError(dtype)
            except (KeyError, TypeError, ValueError, AttributeError):
                raise CheckpointError(f"{self.path}: malformed header entry for tensor {name}: {info!r}") from None
            if self.offset + end > size or not 0 <= start <= end:
                raise CheckpointError(
                    f"{self.path}: tensor {name} needs bytes {self.offset + start}..{self.offset + end}, but the file "
                    f"has {size} bytes (truncated: an interrupted download or copy?)")
            need = int(np.prod(shape, dtype=np.int64)) * np.dtype(_DTYPES[dtype]).itemsize if dtype in _DTYPES else None
            if need is not None and end - start != need:
                raise CheckpointError(f"{self.path}: tensor {name} has {end - start} bytes, but its shape {shape} and "
                                      f"dtype {dtype} need {need}")

    def keys(self):
        return self.header.keys()

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name} in {self.path} is stored as {info['dtype']}; jaxgdn reads float "
                                  f"weights only ({', '.join(_FLOAT_DTYPES)})")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = info["data_offsets"]
        raw = self._mm[self.offset + start: self.offset + end]
        return raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])


def _normalised(name: str) -> str:
    """A tensor's name with Qwen3.5's `model.language_model.` prefix read as `model.`."""
    return name.replace("model.language_model.", "model.", 1) if name.startswith("model.language_model.") else name


def _open_tensors(path: Path) -> dict[str, tuple[_SafetensorsFile, str]]:
    """Map normalised tensor names to (file, original name). Only headers are read. With an index, its shards are
    the files, and every tensor it maps must be in the shard it names; without one, every *.safetensors file is. A
    tensor found twice (in two files, or as both `model.language_model.X` and `model.X`) is refused, naming both
    places: one would silently shadow the other."""
    index = path / "model.safetensors.index.json"
    weight_map = None
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, OSError) as e:
            raise CheckpointError(f"{index} is malformed: {type(e).__name__}: {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index} is malformed: weight_map must map tensor names to shard file names")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors file (or model.safetensors.index.json) in {path}")
    out: dict[str, tuple[_SafetensorsFile, str]] = {}
    for fname in files:
        fpath = path / fname
        if not fpath.is_file():
            raise CheckpointError(f"missing checkpoint shard {fpath}" + (f" (named in {index.name})" if weight_map
                                                                          is not None else ""))
        st = _SafetensorsFile(fpath)
        for name in st.keys():
            if name.startswith(_IGNORED_PREFIXES):
                continue
            norm = _normalised(name)
            if norm in out:
                other, oname = out[norm]
                hint = "remove the stale file" if other.path != fpath else "the file holds both prefixes"
                raise CheckpointError(f"tensor {norm} is stored twice: as {oname} in {other.path} and as {name} in "
                                      f"{fpath} (one would shadow the other: {hint})")
            out[norm] = (st, name)
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name.startswith(_IGNORED_PREFIXES):
                continue
            norm = _normalised(name)
            st, orig = out.get(norm, (None, None))
            if st is None or st.path != path / fname or orig != name:
                where = f"it is in {st.path.name}" if st is not None else "no shard holds it"
                raise CheckpointError(f"{index} maps tensor {name} to {fname}, which does not hold it ({where})")
    return out


class _Reader:
    """Hands out tensors by name with shape checks, and remembers what was used. `lazy`: tensors stay on the host as
    `jaxgdn.sharding.HostArray`s (memory-map views, read slice by slice when placed)."""

    def __init__(self, tensors, dtype, lazy: bool = False, dry: bool = False):
        self.tensors, self.dtype, self.used, self.lazy = tensors, dtype, set(), lazy
        # dry: check names, shapes and dtypes against the headers only (nothing read, nothing built), collecting
        # every problem for one message (`problems`); raw() hands out zero-stride placeholders of the right shape.
        self.dry, self.missing, self.problems = dry, [], []

    def raw(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        shape = tuple(shape)
        if name not in self.tensors:
            if not self.dry:
                raise CheckpointError(f"missing tensor {name}")
            self.missing.append(name)
            return np.broadcast_to(np.float32(0), shape)
        st, orig = self.tensors[name]
        self.used.add(name)
        if self.dry:
            info = st.header[orig]
            got = tuple(info["shape"])
            if got != shape:
                self.problems.append(f"tensor {name} has shape {got}, expected {shape} ({st.path.name})")
            elif info["dtype"] not in _FLOAT_DTYPES:
                self.problems.append(f"tensor {name} is stored as {info['dtype']} ({st.path.name}); jaxgdn reads "
                                     f"float weights only ({', '.join(_FLOAT_DTYPES)})")
            return np.broadcast_to(np.float32(0), shape)
        x = st.get(orig)
        if tuple(x.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(x.shape)}, expected {shape} ({st.path})")
        return x

    def concat(self, xs):
        return None if self.dry else np.concatenate(xs, axis=0)

    def cast(self, x: np.ndarray, dtype=None):
        if self.dry:
            return None
        if self.lazy:
            from .sharding import host_array

            return host_array(x, dtype or self.dtype)
        return jnp.asarray(np.asarray(x, dtype=np.float32) if x.dtype != np.float32 else x, dtype or self.dtype)

    def stack(self, xs):
        if self.dry:
            return None
        if self.lazy:
            from .sharding import HostStack

            return HostStack(xs)
        return jnp.stack(xs)

    def linear(self, name: str, out_dim: int, in_dim: int):
        """A torch Linear weight [out, in] as our [in, out]."""
        return self.cast(self.raw(name + ".weight", (out_dim, in_dim)).T)

    def vector(self, name: str, n: int, dtype=None):
        return self.cast(self.raw(name, (n,)), dtype)


def _gdn(r: _Reader, c: ModelConfig, pre: str) -> GDNParams:
    D, HK, HV, K, V = (c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                       c.linear_value_head_dim)
    if c.model_type == "qwen3_next":
        # Packed per key-head group g: qkvz rows [q_g (K) | k_g (K) | v_g (r*V) | z_g (r*V)],
        # ba rows [b_g (r) | a_g (r)].
        rr = HV // HK
        w = r.raw(pre + "in_proj_qkvz.weight", (HK * (2 * K + 2 * rr * V), D)).reshape(HK, 2 * K + 2 * rr * V, D)
        wq, wk = w[:, :K], w[:, K:2 * K]
        wv, wz = w[:, 2 * K:2 * K + rr * V], w[:, 2 * K + rr * V:]
        qkv = r.concat([wq.reshape(-1, D), wk.reshape(-1, D), wv.reshape(-1, D)])
        ba = r.raw(pre + "in_proj_ba.weight", (HK * 2 * rr, D)).reshape(HK, 2 * rr, D)
        in_qkv, in_z = r.cast(None if qkv is None else qkv.T), r.cast(wz.reshape(-1, D).T)
        in_b, in_a = r.cast(ba[:, :rr].reshape(-1, D).T), r.cast(ba[:, rr:].reshape(-1, D).T)
    else:
        in_qkv = r.linear(pre + "in_proj_qkv", c.gdn_conv_dim, D)
        in_z = r.linear(pre + "in_proj_z", c.gdn_value_dim, D)
        in_b = r.linear(pre + "in_proj_b", HV, D)
        in_a = r.linear(pre + "in_proj_a", HV, D)
    conv = r.raw(pre + "conv1d.weight", (c.gdn_conv_dim, 1, c.linear_conv_kernel_dim))[:, 0, :].T  # [KC, C]
    return GDNParams(in_proj_qkv=in_qkv, in_proj_z=in_z, in_proj_b=in_b, in_proj_a=in_a, conv_weight=r.cast(conv),
                     A_log=r.vector(pre + "A_log", HV, jnp.float32), dt_bias=r.vector(pre + "dt_bias", HV, jnp.float32),
                     norm_weight=r.vector(pre + "norm.weight", V),
                     out_proj=r.linear(pre + "out_proj", D, c.gdn_value_dim))


def _attention(r: _Reader, c: ModelConfig, pre: str) -> AttentionParams:
    D, H, HKV, Dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    return AttentionParams(q_proj=r.linear(pre + "q_proj", H * 2 * Dh, D), k_proj=r.linear(pre + "k_proj", HKV * Dh, D),
                           v_proj=r.linear(pre + "v_proj", HKV * Dh, D), o_proj=r.linear(pre + "o_proj", D, H * Dh),
                           q_norm=r.vector(pre + "q_norm.weight", Dh), k_norm=r.vector(pre + "k_norm.weight", Dh))


def _mlp(r: _Reader, pre: str, D: int, I: int) -> MLPParams:
    return MLPParams(gate_proj=r.linear(pre + "gate_proj", I, D), up_proj=r.linear(pre + "up_proj", I, D),
                     down_proj=r.linear(pre + "down_proj", D, I))


def _moe(r: _Reader, c: ModelConfig, pre: str) -> MoEParams:
    D, E, I = c.hidden_size, c.num_experts, c.moe_intermediate_size
    experts = [_mlp(r, f"{pre}experts.{e}.", D, I) for e in range(E)]
    return MoEParams(router=r.linear(pre + "gate", E, D),
                     gate_proj=r.stack([x.gate_proj for x in experts]),
                     up_proj=r.stack([x.up_proj for x in experts]),
                     down_proj=r.stack([x.down_proj for x in experts]),
                     shared=_mlp(r, pre + "shared_expert.", D, c.shared_expert_intermediate_size),
                     shared_gate=r.linear(pre + "shared_expert_gate", 1, D))


def _build(r: _Reader, c: ModelConfig, layers) -> ModelParams:
    """The parameters through reader `r`; `layers`: the layer indices and kinds (perhaps behind a progress bar)."""
    D = c.hidden_size
    out = []
    for i, kind in layers:
        pre = f"model.layers.{i}."
        mixer = _gdn(r, c, pre + "linear_attn.") if kind == LINEAR else _attention(r, c, pre + "self_attn.")
        ff = _moe(r, c, pre + "mlp.") if c.is_moe_layer(i) else _mlp(r, pre + "mlp.", D, c.intermediate_size)
        out.append(LayerParams(input_norm=r.vector(pre + "input_layernorm.weight", D), mixer=mixer,
                               post_attention_norm=r.vector(pre + "post_attention_layernorm.weight", D), mlp=ff))
    embed = r.cast(r.raw("model.embed_tokens.weight", (c.vocab_size, D)))
    lm_head = None if c.tie_word_embeddings else r.linear("lm_head", c.vocab_size, D)
    return ModelParams(embed=embed, layers=tuple(out), final_norm=r.vector("model.norm.weight", D), lm_head=lm_head)


def _more(names: list[str], n: int = 5) -> str:
    return ", ".join(names[:n]) + (f" (and {len(names) - n} more)" if len(names) > n else "")


def check_tensors(path: Path, tensors, config: ModelConfig) -> None:
    """Every tensor the config needs is present, of its shape and a float dtype, and no other is there — from the
    safetensors headers alone, before a byte of weights is read. One CheckpointError lists what is wrong."""
    r = _Reader(tensors, None, dry=True)
    _build(r, config, enumerate(config.layer_types))
    unexpected = sorted(set(tensors) - r.used)
    if config.tie_word_embeddings and "lm_head.weight" in unexpected:
        unexpected.remove("lm_head.weight")  # some tied checkpoints still store the copy (`_untie_a_distinct_head`)
    problems = []
    if r.missing:
        problems.append(f"missing tensor{'s' if len(r.missing) > 1 else ''} {_more(r.missing)}")
    problems += r.problems[:5]
    if unexpected:
        problems.append(f"unexpected tensors in {path}: {_more(unexpected)}")
    if problems:
        raise CheckpointError(f"{path} does not match its config.json: " + "; ".join(problems))


def _untie_a_distinct_head(path: Path, config: ModelConfig) -> ModelConfig:
    """transformers' rule for tied embeddings: a checkpoint that stores an `lm_head.weight` other than its embedding
    (another shape or other values) is not tied, whatever config.json says, and its stored head computes the logits.
    `config` untied (with a warning) in that case; as it is otherwise. Tied checkpoints that store a copy equal to the
    embedding stay tied. (The two are compared in blocks of rows, read from the memory-mapped files.)"""
    if not config.tie_word_embeddings:
        return config
    tensors = _open_tensors(path)
    if "lm_head.weight" not in tensors or "model.embed_tokens.weight" not in tensors:
        return config
    (hf, hn), (ef, en) = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    head, embed = hf.get(hn), ef.get(en)
    same = head.shape == embed.shape and all(
        np.array_equal(head[i:i + 4096].astype(np.float32), embed[i:i + 4096].astype(np.float32))
        for i in range(0, embed.shape[0], 4096))
    if same:
        return config
    warnings.warn(f"{path}: config.json ties the word embeddings, but the checkpoint stores an lm_head.weight that "
                  f"differs from them; as transformers does, it is loaded untied and the stored head computes the "
                  f"logits", stacklevel=3)
    return dataclasses.replace(config, tie_word_embeddings=False)


def read_params(path: Path, config: ModelConfig, dtype, lazy: bool = False,
                progress: bool | None = None) -> ModelParams:
    """The parameters as jax arrays, or (`lazy`) as host arrays read only when placed (`jaxgdn.sharding.place`).
    Every tensor's presence, shape and dtype (and that no unexpected one is there) is checked from the file headers
    first (`check_tensors`), so a bad checkpoint is refused before any weights are read.
    progress: a bar over the layers on stderr (None: on a terminal only; never when lazy, where nothing is read
    here)."""
    from tqdm.auto import tqdm

    tensors = _open_tensors(path)
    check_tensors(path, tensors, config)
    c = config
    bar = tqdm(enumerate(c.layer_types), total=len(c.layer_types), desc=f"loading {path.name}", unit="layer",
               leave=False, disable=True if lazy else (None if progress is None else not progress))
    try:
        return _build(_Reader(tensors, dtype, lazy), c, bar)
    finally:
        bar.close()


def check_finite(path: Path, params: ModelParams) -> None:
    """CheckpointError naming the parameters that hold a NaN or an infinity (a corrupt download, a conversion that
    overflowed): they would make every logit NaN, and `generate` return token 0 with NaN logprobs as if nothing were
    wrong. One compiled reduction over every parameter, where it lies (placed or sharded): no host pass."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    finite = jax.device_get(_all_finite([x for _, x in leaves]))
    bad = [jax.tree_util.keystr(where) for (where, _), ok in zip(leaves, finite) if not ok]
    if bad:
        raise CheckpointError(f"{path} holds non-finite weights (NaN or inf) in {_more(bad)}")


@jit  # (jaxgdn's compiler options, as every compilation in the library: test_deterministic checks it)
def _all_finite(xs):
    return [jnp.all(jnp.isfinite(x)) for x in xs]


def load_pretrained(path, dtype=jnp.float32, backend: str | None = None, deterministic: bool = False,
                    mesh=None, progress: bool | None = None) -> Model:
    """Load a Hugging Face directory (config.json + model.safetensors or a sharded index) into a `Model`.

    dtype: parameter/activation dtype (float32 or bfloat16); A_log and dt_bias always load as fp32. (Not the
    config's `dtype`: fp32 unless asked.) A config.json that ties the embeddings over a checkpoint storing another
    `lm_head.weight` loads untied, with a warning, as transformers does.
    backend: kernel backend (None: Pallas on GPU, pure JAX elsewhere).
    deterministic: batch-invariant numerics (see `Model.deterministic`).
    mesh: a `jax.sharding.Mesh` with a "tp" axis (`jaxgdn.sharding.make_mesh`): parameters placed for tensor
    parallelism (`jaxgdn.sharding.shard_model`), each device's slice read from the file on its own.
    progress: a progress bar over the layers as they are read, on stderr (None, the default: only when stderr is a
    terminal; True: always; False: never). Not with `mesh`, where the reads happen as the slices are placed.
    Weights that hold a NaN or an infinity are refused once loaded (`check_finite`: CheckpointError naming them).
    """
    check_model_options(dtype, backend)
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"path must be a checkpoint directory (a str or os.PathLike); got {type(path).__name__} "
                         f"{path!r:.60}")
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise InputError(f"progress must be True, False or None; got {progress!r:.60}")
    if mesh is not None:  # before any file is opened: a bad mesh argument is named first
        from .sharding import check_mesh

        check_mesh(mesh, "load_pretrained")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    config = ModelConfig.from_json_file(path / "config.json")
    check_tensors(path, _open_tensors(path), config)  # headers only, before the head below reads two tensors
    config = _untie_a_distinct_head(path, config)
    if mesh is not None:
        from .sharding import shard_model

        model = shard_model(Model(params=read_params(path, config, dtype, lazy=True), config=config, dtype=dtype,
                                  backend=backend, deterministic=deterministic), mesh)
    else:
        model = Model(params=read_params(path, config, dtype, progress=progress), config=config, dtype=dtype,
                      backend=backend, deterministic=deterministic)
    check_finite(path, model.params)
    return model
