"""Checkpoint loading: Qwen3.5 multimodal wrapper layout, sharded checkpoints, bf16 loading, config parsing, and
clear errors. Test checkpoints are written into tmp_path from the tiny fixtures with safetensors.numpy."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxgdn
from jaxgdn.config import FULL, LINEAR, ModelConfig
from jaxgdn.model import _logits
from jaxgdn.params import GDNParams
from tests.conftest import CAP, FIXTURES, max_abs_diff

SRC = FIXTURES / "qwen3_5_tiny"


def write_checkpoint(path: Path, tensors: dict[str, np.ndarray], config: dict | str | None) -> Path:
    """A checkpoint folder: model.safetensors and config.json (a dict, raw text, or None for no config file)."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return path


@pytest.fixture(scope="module")
def reference(fixture_models, expected):
    """The plain qwen3_5_tiny fixture model and its logits on the fixture's 80 tokens (state capacity CAP)."""
    model = fixture_models["qwen3_5_tiny"]
    tokens = expected["qwen3_5_tiny"]["full_tokens"]
    _, logits = model.prefill_chunk(model.init_state(2, CAP), tokens)
    return model, tokens, np.asarray(logits)


def logits_of(model, tokens):
    return np.asarray(model.prefill_chunk(model.init_state(2, CAP), tokens)[1])


# ---- layouts ---------------------------------------------------------------------------------------------------

def test_qwen3_5_multimodal_wrapper(tmp_path, tensors, hf_config, reference):
    """model_type qwen3_5: text fields under text_config, body under model.language_model.*, vision tower and MTP
    head present but ignored. Same parameters and logits, bitwise."""
    model, tokens, logits = reference
    renamed = {}
    for k, v in tensors.items():
        renamed[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    assert "model.language_model.layers.0.linear_attn.A_log" in renamed and "lm_head.weight" in renamed
    renamed["model.visual.blocks.0.x"] = np.ones((3, 5), np.float32)
    renamed["mtp.fc.weight"] = np.ones((64, 128), np.float32)
    text = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": dict(text, model_type="qwen3_5_text"),
              "vision_config": {"depth": 1, "hidden_size": 5}, "tie_word_embeddings": False}
    loaded = jaxgdn.load_pretrained(write_checkpoint(tmp_path / "qwen3_5", renamed, config))
    assert loaded.config == model.config
    chex.assert_trees_all_equal(loaded.params, model.params)
    assert np.array_equal(logits_of(loaded, tokens), logits)


def test_sharded_checkpoint(tmp_path, tensors, hf_config, reference):
    model, tokens, logits = reference
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    path = tmp_path / "sharded"
    path.mkdir()
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / fname))
        weight_map.update({k: fname for k in keys})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                   "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(hf_config))
    loaded = jaxgdn.load_pretrained(path)
    chex.assert_trees_all_equal(loaded.params, model.params)
    assert np.array_equal(logits_of(loaded, tokens), logits)
    # A shard named by the index but missing on disk: a clear error naming the file.
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(jaxgdn.CheckpointError, match="model-00002-of-00002.safetensors"):
        jaxgdn.load_pretrained(path)


def test_qwen3_next_packed_projections_unpacked(fixture_models):
    """The loader's unpacking of in_proj_qkvz / in_proj_ba, checked against an independent NumPy unpacking."""
    model = fixture_models["qwen3_next_tiny"]
    c = model.config
    t = load_file(str(FIXTURES / "qwen3_next_tiny" / "model.safetensors"))
    HK, HV, K, V, D = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                       c.linear_value_head_dim, c.hidden_size)
    r = HV // HK
    for i in c.gdn_layers:
        qkvz = t[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"]  # [HK * (2K + 2rV), D]
        ba = t[f"model.layers.{i}.linear_attn.in_proj_ba.weight"]  # [HK * 2r, D]
        q_rows, k_rows, v_rows, z_rows, b_rows, a_rows = [], [], [], [], [], []
        group = 2 * K + 2 * r * V
        for g in range(HK):
            blk = qkvz[g * group:(g + 1) * group]
            q_rows.append(blk[:K])
            k_rows.append(blk[K:2 * K])
            v_rows.append(blk[2 * K:2 * K + r * V])
            z_rows.append(blk[2 * K + r * V:])
            b_rows.append(ba[g * 2 * r:g * 2 * r + r])
            a_rows.append(ba[g * 2 * r + r:(g + 1) * 2 * r])
        qkv = np.concatenate(q_rows + k_rows + v_rows)
        p = model.params.layers[i].mixer
        assert isinstance(p, GDNParams)
        assert np.array_equal(p.in_proj_qkv, qkv.T)
        assert np.array_equal(p.in_proj_z, np.concatenate(z_rows).T)
        assert np.array_equal(p.in_proj_b, np.concatenate(b_rows).T)
        assert np.array_equal(p.in_proj_a, np.concatenate(a_rows).T)
        assert p.in_proj_qkv.shape == (D, c.gdn_conv_dim)


def test_bf16_load(expected):
    """dtype=bfloat16: matrices bf16, A_log / dt_bias fp32, logits fp32 and close to transformers' fp32 logits:
    max abs diff <= 0.3 and norm-wise rel err <= 5e-2 (bf16 weights and activations; logit scale ~1.7)."""
    for name in ("qwen3_5_tiny", "qwen3_next_tiny"):
        model = jaxgdn.load_pretrained(FIXTURES / name, dtype=jnp.bfloat16)
        assert model.dtype == jnp.bfloat16
        for i in model.config.gdn_layers:
            p = model.params.layers[i].mixer
            assert p.A_log.dtype == jnp.float32 and p.dt_bias.dtype == jnp.float32, "A_log/dt_bias must stay fp32"
            assert p.in_proj_qkv.dtype == jnp.bfloat16 and p.conv_weight.dtype == jnp.bfloat16
            assert p.norm_weight.dtype == jnp.bfloat16
        assert model.params.embed.dtype == jnp.bfloat16 and model.params.lm_head.dtype == jnp.bfloat16
        fp32 = jaxgdn.load_pretrained(FIXTURES / name)
        for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(fp32.params)):
            assert np.array_equal(np.asarray(a, np.float32), np.asarray(b.astype(a.dtype), np.float32)), \
                "bf16 parameters must be the fp32 ones rounded to bf16 (A_log/dt_bias: unchanged)"
    # Logits (one model; compile time): Qwen3.5 in bf16 against transformers' fp32 logits.
    e = expected["qwen3_5_tiny"]
    model = jaxgdn.load_pretrained(FIXTURES / "qwen3_5_tiny", dtype=jnp.bfloat16)
    state, logits = model.prefill_chunk(model.init_state(2, CAP), e["full_tokens"])
    assert logits.dtype == jnp.float32
    assert all(s.recurrent.dtype == jnp.float32 for s in state.layers if hasattr(s, "recurrent"))
    assert all(s.keys.dtype == jnp.bfloat16 for s in state.layers if hasattr(s, "keys"))
    d = max_abs_diff(logits, e["full_logits"])
    rel = float(np.linalg.norm(np.asarray(logits) - e["full_logits"]) / np.linalg.norm(e["full_logits"]))
    assert d <= 0.3, f"bf16 logits: max abs diff {d:.3g} > 0.3"
    assert rel <= 5e-2, f"bf16 logits: rel err {rel:.3g} > 5e-2"


def test_tied_embeddings(tmp_path, tensors, hf_config, reference, rng):
    """tie_word_embeddings: no lm_head.weight needed; the output head is the embedding matrix."""
    model, _, _ = reference
    tied = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    loaded = jaxgdn.load_pretrained(write_checkpoint(tmp_path / "tied", tied, dict(hf_config,
                                                                                     tie_word_embeddings=True)))
    assert loaded.config.tie_word_embeddings and loaded.params.lm_head is None
    chex.assert_trees_all_equal(loaded.params._replace(lm_head=None), model.params._replace(lm_head=None))
    untied = jaxgdn.Model(params=loaded.params._replace(lm_head=loaded.params.embed.T), config=model.config)
    x = jnp.asarray(rng.standard_normal((2, 3, model.config.hidden_size)), jnp.float32)
    got, want = jax.jit(_logits)(loaded, x), jax.jit(_logits)(untied, x)
    assert got.shape == (2, 3, model.config.vocab_size)
    assert max_abs_diff(got, want) <= 1e-5, "tied head != lm_head = embed.T (max abs diff > 1e-5)"


# ---- config parsing --------------------------------------------------------------------------------------------

def test_config_full_attention_interval_without_layer_types(hf_config):
    cfg = {k: v for k, v in hf_config.items() if k != "layer_types"}
    cfg.update(num_hidden_layers=8, full_attention_interval=4)
    c = ModelConfig.from_hf_config(cfg)
    assert c.layer_types == (LINEAR, LINEAR, LINEAR, FULL) * 2
    assert c.attention_layers == (3, 7)


def test_config_fields_from_fixtures():
    nxt = json.loads((FIXTURES / "qwen3_next_tiny" / "config.json").read_text())
    c = ModelConfig.from_json_file(FIXTURES / "qwen3_next_tiny" / "config.json")
    assert c.model_type == "qwen3_next"
    assert c.num_experts == nxt["num_experts"] and c.num_experts_per_tok == nxt["num_experts_per_tok"]
    assert c.moe_intermediate_size == nxt["moe_intermediate_size"]
    assert c.shared_expert_intermediate_size == nxt["shared_expert_intermediate_size"]
    assert c.norm_topk_prob == nxt["norm_topk_prob"]
    assert all(c.is_moe_layer(i) for i in range(c.num_layers))
    assert c.rotary_dim == int(nxt["head_dim"] * 0.25)
    hash(c)  # hashable: usable as a static jit argument
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 3  # type: ignore[misc]


def test_config_mlp_only_layers_and_sparse_step():
    nxt = json.loads((FIXTURES / "qwen3_next_tiny" / "config.json").read_text())
    c = ModelConfig.from_hf_config(dict(nxt, mlp_only_layers=[0], decoder_sparse_step=2))
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


# ---- errors ----------------------------------------------------------------------------------------------------

def test_missing_directory(tmp_path):
    with pytest.raises(jaxgdn.CheckpointError, match="does not exist"):
        jaxgdn.load_pretrained(tmp_path / "nope")


def test_path_is_a_file(tmp_path):
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    with pytest.raises(jaxgdn.CheckpointError, match="not a directory"):
        jaxgdn.load_pretrained(f)


def test_missing_config(tmp_path, tensors):
    path = write_checkpoint(tmp_path / "noconfig", tensors, None)
    with pytest.raises(jaxgdn.CheckpointError, match="config.json"):
        jaxgdn.load_pretrained(path)


def test_malformed_config(tmp_path, tensors):
    path = write_checkpoint(tmp_path / "badjson", tensors, '{"model_type": "qwen3_5_text", ')
    with pytest.raises(jaxgdn.CheckpointError, match="not valid JSON"):
        jaxgdn.load_pretrained(path)


def test_unsupported_model_type(tmp_path, tensors, hf_config):
    path = write_checkpoint(tmp_path / "llama", tensors, dict(hf_config, model_type="llama"))
    with pytest.raises(jaxgdn.UnsupportedModelError, match="llama"):
        jaxgdn.load_pretrained(path)


def test_config_missing_field(tmp_path, tensors, hf_config):
    cfg = {k: v for k, v in hf_config.items() if k != "linear_num_value_heads"}
    with pytest.raises(jaxgdn.CheckpointError, match="linear_num_value_heads"):
        jaxgdn.load_pretrained(write_checkpoint(tmp_path / "nofield", tensors, cfg))


def test_qwen3_5_without_text_config(tmp_path, tensors):
    with pytest.raises(jaxgdn.CheckpointError, match="text_config"):
        jaxgdn.load_pretrained(write_checkpoint(tmp_path / "notext", tensors, {"model_type": "qwen3_5"}))


def test_no_safetensors(tmp_path, hf_config):
    path = tmp_path / "empty"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(jaxgdn.CheckpointError, match="safetensors"):
        jaxgdn.load_pretrained(path)


def test_missing_tensor(tmp_path, tensors, hf_config):
    name = "model.layers.1.linear_attn.A_log"
    path = write_checkpoint(tmp_path / "missing", {k: v for k, v in tensors.items() if k != name}, hf_config)
    with pytest.raises(jaxgdn.CheckpointError, match=name.replace(".", r"\.")):
        jaxgdn.load_pretrained(path)


def test_unexpected_tensor(tmp_path, tensors, hf_config):
    name = "model.layers.0.linear_attn.surprise.weight"
    path = write_checkpoint(tmp_path / "extra", dict(tensors, **{name: np.zeros((2, 2), np.float32)}), hf_config)
    with pytest.raises(jaxgdn.CheckpointError, match=name.replace(".", r"\.")):
        jaxgdn.load_pretrained(path)


@pytest.mark.parametrize("name", ["model.layers.2.linear_attn.dt_bias", "model.layers.3.self_attn.q_proj.weight",
                                  "model.embed_tokens.weight"])
def test_shape_mismatch_names_the_tensor(tmp_path, tensors, hf_config, name):
    bad = dict(tensors)
    shape = list(bad[name].shape)
    shape[0] += 1
    bad[name] = np.zeros(shape, np.float32)
    path = write_checkpoint(tmp_path / "shape", bad, hf_config)
    with pytest.raises(jaxgdn.CheckpointError, match=name.replace(".", r"\.") + r" has shape"):
        jaxgdn.load_pretrained(path)


def test_corrupt_safetensors_file(tmp_path, hf_config):
    path = tmp_path / "corrupt"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    (path / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(jaxgdn.CheckpointError, match="model.safetensors"):
        jaxgdn.load_pretrained(path)


def test_truncated_safetensors_file_names_the_file_and_a_tensor(tmp_path, tensors, hf_config):
    """An interrupted download: the file ends inside its tensors' bytes. Refused when the file is opened, naming it
    and the first tensor it cannot hold (not a NumPy reshape error from deep inside the load)."""
    path = write_checkpoint(tmp_path / "trunc", tensors, hf_config)
    whole = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(jaxgdn.CheckpointError, match=r"model\.safetensors: tensor \S+ needs bytes .*truncated"):
        jaxgdn.load_pretrained(path)


def edit_first_header_entry(file: Path, edit) -> str:
    """Rewrite the header entry of the first tensor of a .safetensors file with `edit(entry)` (in place), keeping
    the header's length so that every offset still points where it did; returns the tensor's name."""
    raw = file.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    edit(header[name])
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= n
    file.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n:])
    return name


def test_tensor_bytes_that_do_not_fit_its_shape_are_refused(tmp_path, tensors, hf_config):
    """A header whose byte range for a tensor disagrees with its shape and dtype (a corrupt header)."""
    path = write_checkpoint(tmp_path / "hdr", tensors, hf_config)
    name = edit_first_header_entry(path / "model.safetensors",
                                   lambda e: e.update(shape=[e["shape"][0] + 1] + e["shape"][1:]))
    with pytest.raises(jaxgdn.CheckpointError, match=name.replace(".", r"\.") + r" has \d+ bytes, but its shape"):
        jaxgdn.load_pretrained(path)


@pytest.mark.parametrize("field,value,match", [
    ("layer_types", ["sliding_attention", "linear_attention", "linear_attention", "full_attention"], "layer_types"),
    ("linear_num_value_heads", 3, "linear_num_value_heads"),
    ("num_attention_heads", "four", "config.json"),
])
def test_bad_config_values_are_checkpoint_errors(tmp_path, tensors, hf_config, field, value, match):
    cfg = dict(hf_config, **{field: value})
    with pytest.raises(jaxgdn.CheckpointError, match=match):
        jaxgdn.load_pretrained(write_checkpoint(tmp_path / "badval", tensors, cfg))


def test_unsupported_activation_is_refused(tmp_path, tensors, hf_config):
    with pytest.raises(jaxgdn.UnsupportedModelError, match="hidden_act 'gelu'"):
        jaxgdn.load_pretrained(write_checkpoint(tmp_path / "gelu", tensors, dict(hf_config, hidden_act="gelu")))


def test_errors_are_jaxgdn_errors():
    assert issubclass(jaxgdn.UnsupportedModelError, jaxgdn.CheckpointError)
    assert issubclass(jaxgdn.CheckpointError, jaxgdn.JaxGDNError)
    assert issubclass(jaxgdn.InputError, ValueError)


@pytest.mark.parametrize("kw, match", [
    (dict(dtype=jnp.int32), "dtype must be float32 or bfloat16"),
    (dict(dtype=jnp.float16), "dtype must be float32 or bfloat16"),
    (dict(dtype="not a dtype"), "dtype must be float32 or bfloat16"),
    (dict(backend="cuda"), "unknown kernel backend 'cuda'"),
    # (CPU only, as this suite is: was accepted, then a plain ValueError from inside Pallas at the first call)
    (dict(backend="pallas"), "backend 'pallas' compiles the kernels for a GPU, and JAX has none here"),
])
def test_bad_model_options_are_rejected_before_loading(kw, match):
    """dtype and backend are checked before any file is read (the directory here does not even exist) and on every
    way to make a model."""
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.load_pretrained("/nonexistent/model/dir", **kw)
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.tiny_model("tiny", **kw)
    model = jaxgdn.tiny_model("tiny")
    with pytest.raises(jaxgdn.InputError, match=match):
        dataclasses.replace(model, **kw)  # as with_backend and every other copy does


def test_loading_shows_progress_when_asked(capsys):
    """`progress=True` draws a bar over the layers on stderr; the default draws one on a terminal only (pytest's
    captured stderr is not one), and `progress=False` never: the weights are the same."""
    shown = jaxgdn.load_pretrained(SRC, progress=True)
    err = capsys.readouterr().err
    n = len(shown.config.layer_types)
    assert f"loading {SRC.name}" in err and f"/{n} [" in err and "layer" in err, err  # (tqdm redraws at most every
    # 0.1 s and clears the bar at the end: a fast load may never show n/n)
    quiet = [jaxgdn.load_pretrained(SRC), jaxgdn.load_pretrained(SRC, progress=False)]
    assert capsys.readouterr().err == ""
    for model in quiet:
        chex.assert_trees_all_equal(model.params, shown.params)
