"""load_pretrained on broken or unusual checkpoint directories: each is refused with a CheckpointError (InputError
for a bad argument) naming the file and the field or tensor, before any weights are read — never a KeyError,
ZeroDivisionError, MemoryError or JSON traceback, and never silently wrong weights. Every checkpoint here is a
damaged copy of a tiny fixture written into tmp_path; nothing is compiled but the loader's finiteness check (one
small reduction)."""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from pathlib import Path

import chex
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxgdn
from jaxgdn import checkpoint as ckpt
from jaxgdn.config import ModelConfig, tiny_qwen3_5
from tests.conftest import FIXTURES
from tests.test_checkpoint import edit_first_header_entry

SRC = FIXTURES / "qwen3_5_tiny"
NEXT = FIXTURES / "qwen3_next_tiny"


@pytest.fixture(scope="module")
def reference():
    return jaxgdn.load_pretrained(SRC)


def write(path: Path, tensors: dict | None = None, config=None, files: dict[str, bytes] | None = None) -> Path:
    """A checkpoint folder: model.safetensors from `tensors` (or raw `files`), config.json from `config` (a dict or
    other JSON value, or bytes written as they are)."""
    path.mkdir(parents=True)
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"))
    for name, data in (files or {}).items():
        (path / name).write_bytes(data)
    (path / "config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    return path


def esc(s: str) -> str:
    return re.escape(s)


# ---- config.json -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [b"[1, 2]", b"null", b'"qwen3_5_text"'])
def test_config_that_is_not_an_object(tmp_path, tensors, raw):
    path = write(tmp_path / "c", tensors, raw)  # was AttributeError: 'list' object has no attribute 'get'
    with pytest.raises(jaxgdn.CheckpointError, match=esc(str(path / "config.json")) + " must hold a JSON object"):
        jaxgdn.load_pretrained(path)


def test_config_that_is_not_utf8(tmp_path, tensors):
    path = write(tmp_path / "c", tensors, b"\xff\xfe\x00\x80garbage")  # was UnicodeDecodeError
    with pytest.raises(jaxgdn.CheckpointError, match="config.json is not valid JSON"):
        jaxgdn.load_pretrained(path)


@pytest.mark.parametrize("text", [None, [1], "x"])
def test_qwen3_5_text_config_that_is_not_an_object(tmp_path, tensors, text):
    path = write(tmp_path / "c", tensors, {"model_type": "qwen3_5", "text_config": text})  # was AttributeError
    with pytest.raises(jaxgdn.CheckpointError, match="config.json: text_config must be a JSON object"):
        jaxgdn.load_pretrained(path)


@pytest.mark.parametrize("field, value, match", [
    # each was accepted, or failed far from the cause with a message that did not name the field
    ("num_hidden_layers", "4", 'num_hidden_layers must be an integer; got "4"'),  # was "layer_types has 4 entries
    # for 4 layers"
    ("hidden_size", "64", 'hidden_size must be an integer; got "64"'),  # was a tensor "shape (128, 64), expected
    # (128, '64')"
    ("hidden_size", 64.0, "hidden_size must be an integer; got 64.0"),  # was loaded
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a number"),  # was loaded: the string reached the model
    ("rms_norm_eps", 0, "rms_norm_eps must be > 0"),
    ("tie_word_embeddings", "false", 'tie_word_embeddings must be true or false; got "false"'),  # was True
    ("layer_types", "linear_attention", "layer_types must be a list of strings"),  # was "16 entries for 4 layers"
    ("mlp_only_layers", 3, "mlp_only_layers must be a list of layer indices"),
    ("rope_parameters", [1], "rope_parameters must be a JSON object"),  # was AttributeError
    ("rope_parameters", {"rope_theta": "abc"}, 'rope_parameters.rope_theta must be a number; got "abc"'),
    ("vocab_size", -1, "vocab_size must be >= 1; got -1"),  # was a shape mismatch on embed_tokens
    ("hidden_size", 0, "hidden_size must be >= 1; got 0"),
    ("linear_num_key_heads", 0, "linear_num_key_heads must be >= 1"),  # was ZeroDivisionError
    ("num_key_value_heads", 0, "num_key_value_heads must be >= 1"),  # was ZeroDivisionError
    ("num_attention_heads", True, "num_attention_heads must be an integer; got true"),
])
def test_config_field_of_the_wrong_type_or_range_is_named(tmp_path, tensors, hf_config, field, value, match):
    path = write(tmp_path / "c", tensors, dict(hf_config, **{field: value}))
    with pytest.raises(jaxgdn.CheckpointError, match=esc(str(path / "config.json")) + ": " + esc(match)):
        jaxgdn.load_pretrained(path)


def test_full_attention_interval_zero(tmp_path, tensors, hf_config):
    cfg = {k: v for k, v in hf_config.items() if k != "layer_types"}
    path = write(tmp_path / "c", tensors, dict(cfg, full_attention_interval=0))  # was ZeroDivisionError
    with pytest.raises(jaxgdn.CheckpointError, match="full_attention_interval must be >= 1; got 0"):
        jaxgdn.load_pretrained(path)


def test_layer_types_length_names_num_hidden_layers(tmp_path, tensors, hf_config):
    path = write(tmp_path / "c", tensors, dict(hf_config, num_hidden_layers=5))
    with pytest.raises(jaxgdn.CheckpointError, match=r"config\.json: layer_types has 4 entries for 5 layers "
                                                     r"\(num_hidden_layers\)"):
        jaxgdn.load_pretrained(path)


def test_non_finite_weights_are_refused_by_name(tmp_path, tensors, hf_config):
    """A NaN or an infinity in the weights (a corrupt download) is a CheckpointError naming the parameters; it had
    loaded, and `generate` returned token 0 with NaN logprobs and finish_reason "length"."""
    bad = dict(tensors)
    bad["model.layers.1.input_layernorm.weight"] = tensors["model.layers.1.input_layernorm.weight"].copy()
    bad["model.layers.1.input_layernorm.weight"][3] = np.nan
    bad["model.layers.1.linear_attn.A_log"] = tensors["model.layers.1.linear_attn.A_log"].copy()
    bad["model.layers.1.linear_attn.A_log"][0] = -np.inf
    path = write(tmp_path / "c", bad, hf_config)
    with pytest.raises(jaxgdn.CheckpointError, match=esc(str(path)) + r" holds non-finite weights \(NaN or inf\) in "
                                                     r"\.layers\[1\]\.input_norm, \.layers\[1\]\.mixer\.A_log$"):
        jaxgdn.load_pretrained(path)
    jaxgdn.load_pretrained(write(tmp_path / "d", tensors, hf_config))  # the same tensors, finite: loads


def test_qwen3_5_text_config_field_is_named_with_its_prefix(tmp_path, tensors, hf_config):
    cfg = {"model_type": "qwen3_5", "text_config": dict(hf_config, linear_key_head_dim="16")}
    with pytest.raises(jaxgdn.CheckpointError, match='text_config.linear_key_head_dim must be an integer; got "16"'):
        jaxgdn.load_pretrained(write(tmp_path / "c", tensors, cfg))
    cfg = {"model_type": "qwen3_5", "text_config": {k: v for k, v in hf_config.items() if k != "vocab_size"}}
    with pytest.raises(jaxgdn.CheckpointError, match="lacks the field 'text_config.vocab_size'"):
        jaxgdn.load_pretrained(write(tmp_path / "d", tensors, cfg))


def test_qwen3_5_tie_word_embeddings_from_the_top_level(tmp_path, tensors, hf_config, reference):
    """Qwen3.5 may keep tie_word_embeddings at the top level only (the text_config lacking it): it is read there."""
    renamed = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in tensors.items() if k != "lm_head.weight"}
    text = {k: v for k, v in hf_config.items() if k != "tie_word_embeddings"}
    cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
           "tie_word_embeddings": True}
    loaded = jaxgdn.load_pretrained(write(tmp_path / "c", renamed, cfg))
    assert loaded.config.tie_word_embeddings and loaded.params.lm_head is None
    chex.assert_trees_all_equal(loaded.params.embed, reference.params.embed)


def test_quantized_checkpoint_is_refused_by_its_config(tmp_path, tensors, hf_config):
    """An FP8 / AWQ / GPTQ export: refused from config.json, not with a dtype or missing-weight error later."""
    cfg = dict(hf_config, quantization_config={"quant_method": "fp8", "fmt": "e4m3"})
    with pytest.raises(jaxgdn.UnsupportedModelError, match=r"quantization_config \('fp8'\)"):
        jaxgdn.load_pretrained(write(tmp_path / "c", tensors, cfg))


def test_classification_architecture_is_refused(tmp_path, tensors, hf_config):
    cfg = dict(hf_config, architectures=["Qwen3_5ForSequenceClassification"])
    with pytest.raises(jaxgdn.UnsupportedModelError, match="Qwen3_5ForSequenceClassification"):
        jaxgdn.load_pretrained(write(tmp_path / "c", tensors, cfg))


def test_qwen3_next_top_k_beyond_the_experts(tmp_path):
    cfg = json.loads((NEXT / "config.json").read_text())
    path = write(tmp_path / "c", load_file(str(NEXT / "model.safetensors")), dict(cfg, num_experts_per_tok=9))
    with pytest.raises(jaxgdn.CheckpointError, match=r"num_experts_per_tok \(9\) must be in \[1, num_experts = 4\]"):
        jaxgdn.load_pretrained(path)


def test_model_config_zero_heads_is_a_value_error():
    with pytest.raises(ValueError, match="linear_num_key_heads must be positive"):  # was ZeroDivisionError
        tiny_qwen3_5().__class__(**{**tiny_qwen3_5().__dict__, "linear_num_key_heads": 0})


def test_fixture_configs_parse_as_before():
    for fx in (SRC, NEXT):
        c = ModelConfig.from_json_file(fx / "config.json")
        assert c == jaxgdn.load_pretrained(fx).config
    assert ModelConfig.from_json_file(SRC / "config.json") == tiny_qwen3_5()


# ---- safetensors files -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("data, match", [
    (b"version https://git-lfs.github.com/spec/v1\noid sha256:0123abcd\nsize 708920\n", "is a Git LFS pointer"),
    (b"<!DOCTYPE html><html><body>rate limited</body></html>", "is not a safetensors file: its first 8 bytes"),
    (b"", "is not a readable safetensors file"),
    (b"\x07\x00\x00\x00\x00\x00\x00\x00[1,2,3]", "is not a safetensors file: its header is a JSON list"),
])
def test_file_that_is_not_safetensors(tmp_path, hf_config, data, match):
    """A git clone without LFS, an HTML error page saved under the name, a zero-byte file, a header that is not an
    object (the first two were a MemoryError: 8 bytes of text read as a header length of ~10**18)."""
    path = write(tmp_path / "c", None, hf_config, files={"model.safetensors": data})
    with pytest.raises(jaxgdn.CheckpointError, match=esc(str(path / "model.safetensors")) + " " + esc(match)):
        jaxgdn.load_pretrained(path)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8])
def test_integer_weights_are_refused(tmp_path, tensors, hf_config, dtype):
    """A weight stored as integers (a quantized or corrupt export) was cast to float and loaded."""
    name = "model.layers.0.linear_attn.A_log"
    bad = dict(tensors, **{name: tensors[name].astype(dtype)})
    with pytest.raises(jaxgdn.CheckpointError, match=esc(name) + " is stored as [IU]"):
        jaxgdn.load_pretrained(write(tmp_path / "c", bad, hf_config))


def test_a_tensor_in_two_files_is_refused(tmp_path, tensors, hf_config):
    """Without an index every *.safetensors file is read: a stale extra file holding a tensor again silently
    shadowed (or was shadowed by) the real one, depending on the file names' order."""
    name = "model.layers.0.linear_attn.A_log"
    path = write(tmp_path / "c", tensors, hf_config)
    save_file({name: np.zeros(tensors[name].shape, np.float32)}, str(path / "zz-stale.safetensors"))
    with pytest.raises(jaxgdn.CheckpointError, match=f"tensor {esc(name)} is stored twice: .*model.safetensors "
                                                     f".*zz-stale.safetensors"):
        jaxgdn.load_pretrained(path)


def test_a_tensor_under_both_prefixes_is_refused(tmp_path, tensors):
    """A Qwen3.5 file with both model.language_model.X and model.X: one silently won."""
    cfg = {"model_type": "qwen3_5", "text_config": json.loads((SRC / "config.json").read_text())}
    both = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
            for k, v in tensors.items()}
    both["model.norm.weight"] = np.zeros_like(tensors["model.norm.weight"])
    with pytest.raises(jaxgdn.CheckpointError, match=r"model\.norm\.weight is stored twice"):
        jaxgdn.load_pretrained(write(tmp_path / "c", both, cfg))


def sharded(path: Path, tensors: dict, hf_config: dict) -> tuple[Path, dict]:
    names = sorted(tensors)
    path.mkdir()
    weight_map = {}
    for fname, keys in (("model-00001-of-00002.safetensors", names[::2]),
                        ("model-00002-of-00002.safetensors", names[1::2])):
        save_file({k: tensors[k] for k in keys}, str(path / fname))
        weight_map.update({k: fname for k in keys})
    (path / "config.json").write_text(json.dumps(hf_config))
    return path, weight_map


def test_index_that_maps_a_tensor_to_the_wrong_shard(tmp_path, tensors, hf_config, reference):
    path, weight_map = sharded(tmp_path / "c", tensors, hf_config)
    index = path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    chex.assert_trees_all_equal(jaxgdn.load_pretrained(path).params, reference.params)
    name = sorted(tensors)[0]  # in the first shard
    assert weight_map[name] == "model-00001-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": dict(weight_map, **{name: "model-00002-of-00002.safetensors"})}))
    with pytest.raises(jaxgdn.CheckpointError, match=f"index.json maps tensor {esc(name)} to "
                       r"model-00002-of-00002\.safetensors, which does not hold it \(it is in model-00001"):
        jaxgdn.load_pretrained(path)
    index.write_text(json.dumps({"weight_map": dict(weight_map, **{"model.layers.9.mlp.x": weight_map[name]})}))
    with pytest.raises(jaxgdn.CheckpointError, match=r"maps tensor model\.layers\.9\.mlp\.x to .*no shard holds it"):
        jaxgdn.load_pretrained(path)


@pytest.mark.parametrize("content, match", [
    # was AttributeError, TypeError (Path / int), TypeError, UnicodeDecodeError; KeyError was already handled
    (b'{"weight_map": ["a", "b"]}', "malformed: weight_map must map tensor names to shard file names"),
    (b'{"weight_map": {"lm_head.weight": 5}}', "malformed: weight_map must map tensor names"),
    (b"[1]", "malformed: TypeError"),
    (b"\xff\xfe\x00\x80", "malformed"),
    (b'{"metadata": {}}', "malformed: KeyError"),
])
def test_malformed_index(tmp_path, tensors, hf_config, content, match):
    path, _ = sharded(tmp_path / "c", tensors, hf_config)
    (path / "model.safetensors.index.json").write_bytes(content)
    with pytest.raises(jaxgdn.CheckpointError, match=r"model\.safetensors\.index\.json is " + esc(match)):
        jaxgdn.load_pretrained(path)


# ---- missing / misshapen / unexpected tensors: refused from the headers, before any weights are read --------------

@pytest.fixture
def reads(monkeypatch):
    """Counts tensors read from the files."""
    n = []
    orig = ckpt._SafetensorsFile.get

    def spy(self, name):
        n.append(name)
        return orig(self, name)

    monkeypatch.setattr(ckpt._SafetensorsFile, "get", spy)
    return n


def test_missing_tensors_are_all_named_before_any_read(tmp_path, tensors, hf_config, reads):
    """lm_head.weight is read last: its absence was found only after every layer had been loaded (minutes on a real
    model), and only the first missing tensor was named."""
    gone = ["model.layers.2.mlp.up_proj.weight", "lm_head.weight"]
    path = write(tmp_path / "c", {k: v for k, v in tensors.items() if k not in gone}, hf_config)
    with pytest.raises(jaxgdn.CheckpointError, match=esc(f"{path} does not match its config.json: missing tensors "
                                                         f"{gone[0]}, {gone[1]}")):
        jaxgdn.load_pretrained(path, progress=False)
    assert reads == []


def test_unexpected_tensor_is_refused_before_any_read(tmp_path, tensors, hf_config, reads):
    name = "model.layers.0.linear_attn.surprise.weight"
    path = write(tmp_path / "c", dict(tensors, **{name: np.zeros((2, 2), np.float32)}), hf_config)
    with pytest.raises(jaxgdn.CheckpointError, match=f"unexpected tensors in {esc(str(path))}: {esc(name)}"):
        jaxgdn.load_pretrained(path)
    assert reads == []


def test_wrong_shape_names_tensor_and_file_before_any_read(tmp_path, tensors, hf_config, reads):
    name = "model.norm.weight"
    path = write(tmp_path / "c", dict(tensors, **{name: np.zeros((65,), np.float32)}), hf_config)
    with pytest.raises(jaxgdn.CheckpointError, match=esc(f"tensor {name} has shape (65,), expected (64,) "
                                                         f"(model.safetensors)")):
        jaxgdn.load_pretrained(path)
    assert reads == []


def test_qwen3_next_packed_projection_shape_checked_from_the_header(tmp_path, reads):
    t = load_file(str(NEXT / "model.safetensors"))
    name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
    t[name] = np.zeros((10, 64), np.float32)
    path = write(tmp_path / "c", t, json.loads((NEXT / "config.json").read_text()))
    with pytest.raises(jaxgdn.CheckpointError, match=esc(f"tensor {name} has shape (10, 64), expected (192, 64)")):
        jaxgdn.load_pretrained(path)
    assert reads == []


def test_failed_load_leaves_no_open_files_or_threads(tmp_path, tensors, hf_config):
    path = write(tmp_path / "c", {k: v for k, v in tensors.items() if k != "lm_head.weight"}, hf_config)
    fds, threads = set(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(3):
        with pytest.raises(jaxgdn.CheckpointError, match="lm_head.weight"):
            jaxgdn.load_pretrained(path, progress=True)
    assert set(os.listdir("/proc/self/fd")) <= fds
    assert threading.active_count() <= threads


# ---- stored dtype vs. load dtype ---------------------------------------------------------------------------------

@pytest.mark.parametrize("stored", [np.float16, ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("load", [jnp.float32, jnp.bfloat16])
def test_weights_stored_in_another_float_dtype(tmp_path, tensors, hf_config, stored, load):
    """Each parameter is the stored value converted to the load dtype (A_log / dt_bias: to fp32)."""
    t = {k: v.astype(stored) for k, v in tensors.items()}
    model = jaxgdn.load_pretrained(write(tmp_path / "c", t, hf_config), dtype=load)
    embed = t["model.embed_tokens.weight"].astype(np.float32).astype(load)
    assert model.params.embed.dtype == load and np.array_equal(np.asarray(model.params.embed), embed)
    a_log = model.params.layers[0].mixer.A_log
    assert a_log.dtype == jnp.float32
    assert np.array_equal(np.asarray(a_log), t["model.layers.0.linear_attn.A_log"].astype(np.float32))


# ---- arguments ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(path=None), "path must be a checkpoint directory"),  # was TypeError from pathlib
    (dict(path=5), "path must be a checkpoint directory"),
    (dict(path=SRC, progress="no"), "progress must be True, False or None"),  # "no" drew a bar
])
def test_bad_arguments_are_input_errors(kw, match):
    with pytest.raises(jaxgdn.InputError, match=match):
        jaxgdn.load_pretrained(**kw)


def test_progress_bar_goes_to_stderr_only(capsys, tmp_path, tensors, hf_config):
    jaxgdn.load_pretrained(SRC, progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "loading qwen3_5_tiny" in err
    path = write(tmp_path / "c", {k: v for k, v in tensors.items() if k != "lm_head.weight"}, hf_config)
    with pytest.raises(jaxgdn.CheckpointError):
        jaxgdn.load_pretrained(path, progress=True)
    assert capsys.readouterr().out == ""


def test_header_entry_with_a_non_string_dtype(tmp_path, tensors, hf_config):
    """A corrupt header whose dtype is a list was a TypeError (unhashable) from the dtype lookup."""
    path = write(tmp_path / "c", tensors, hf_config)
    name = edit_first_header_entry(path / "model.safetensors", lambda e: e.update(dtype=["F32"]))
    with pytest.raises(jaxgdn.CheckpointError, match=f"model.safetensors: malformed header entry for tensor "
                                                     f"{esc(name)}"):
        jaxgdn.load_pretrained(path)


# ---- what transformers does with the same config.json (helper 55's review against transformers 5.25) ------------

def test_a_tied_config_with_a_distinct_stored_head_loads_untied(tmp_path, tensors, hf_config, reference):
    """transformers does not tie a stored lm_head.weight that differs from the embedding, and its logits come from
    it; jaxgdn used to drop it silently and use the embedding (2.66 off the recorded logits on this fixture). The
    parameters equal the untied fixture's, whose logits test_checkpoint.py compares with transformers'."""
    assert not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    path = write(tmp_path / "c", tensors, dict(hf_config, tie_word_embeddings=True))
    with pytest.warns(UserWarning, match="stores an lm_head.weight that differs from them"):
        loaded = jaxgdn.load_pretrained(path)
    assert not loaded.config.tie_word_embeddings
    chex.assert_trees_all_equal(loaded.params, reference.params)
    assert loaded.config == reference.config
    # a stored copy equal to the embedding stays tied, without a warning
    same = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tied = jaxgdn.load_pretrained(write(tmp_path / "d", same, dict(hf_config, tie_word_embeddings=True)))
    assert tied.config.tie_word_embeddings and tied.params.lm_head is None


def test_a_damaged_tied_checkpoint_is_refused_before_its_head_is_read(tmp_path, tensors, hf_config):
    """The header check comes before the tied-head comparison, which reads two whole tensors: a tied config.json with
    a distinct stored head and a missing tensor is refused without the "loaded untied" warning (was: the warning,
    after reading both tensors, then the CheckpointError)."""
    damaged = {k: v for k, v in tensors.items() if k != "model.layers.0.input_layernorm.weight"}
    path = write(tmp_path / "c", damaged, dict(hf_config, tie_word_embeddings=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(jaxgdn.CheckpointError, match="model.layers.0.input_layernorm.weight"):
            jaxgdn.load_pretrained(path)


def test_rope_values_inside_rope_parameters_win_over_top_level_ones(hf_config):
    """transformers reads rope_theta and partial_rotary_factor from rope_parameters first (jaxgdn read the top
    level first: logits 0.023 and 0.24 off on the fixture)."""
    inner = hf_config["rope_parameters"]
    c = ModelConfig.from_hf_config(dict(hf_config, rope_theta=1e6, partial_rotary_factor=0.5))
    assert (c.rope_theta, c.partial_rotary_factor) == (inner["rope_theta"], inner["partial_rotary_factor"])
    bare = {k: v for k, v in hf_config.items() if k != "rope_parameters"}
    c = ModelConfig.from_hf_config(dict(bare, rope_theta=1e6, partial_rotary_factor=0.5))
    assert (c.rope_theta, c.partial_rotary_factor) == (1e6, 0.5)  # the top level where the dict lacks them


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}},  # legacy "type"
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": {"rope_type": "default"}},
    {"rope_parameters": {"type": "dynamic", "factor": 2.0}},
    {"rope_parameters": {"rope_type": None}},
])
def test_rope_scaling_is_refused_not_ignored(hf_config, rope):
    """transformers applies rope_scaling (over rope_parameters) and reads the legacy "type" key; jaxgdn ran plain
    RoPE for each of these. It implements the default RoPE only, so it refuses them."""
    with pytest.raises(jaxgdn.UnsupportedModelError, match="rope_type .* jaxgdn implements the default RoPE only"):
        ModelConfig.from_hf_config(dict(hf_config, **rope))


def test_attention_bias_and_a_zero_sparse_step_are_refused(hf_config):
    with pytest.raises(jaxgdn.UnsupportedModelError, match="attention_bias is true"):
        ModelConfig.from_hf_config(dict(hf_config, attention_bias=True))
    assert ModelConfig.from_hf_config(dict(hf_config, attention_bias=False)) == ModelConfig.from_hf_config(hf_config)
    nxt = json.loads((NEXT / "config.json").read_text())
    with pytest.raises(jaxgdn.CheckpointError, match="decoder_sparse_step must be >= 1; got 0"):
        ModelConfig.from_hf_config(dict(nxt, decoder_sparse_step=0))
    assert ModelConfig.from_hf_config(dict(hf_config, decoder_sparse_step=0)).decoder_sparse_step == 1  # dense
