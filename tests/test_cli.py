"""The `jaxgdn` command line, run in-process (`jaxgdn.cli.main([...])`): every command runs on the tiny models,
writes its files, agrees with the API, and fails on bad input with one `jaxgdn: error:` line, exit code 2 and
no output file (nor temporary file) left behind."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import jaxgdn
from jaxgdn import cli
from jaxgdn.compare import diff_arrays
from jaxgdn.model import gdn_states
from jaxgdn.score import score
from jaxgdn.tokenizer import load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
COMMANDS = ("demo", "generate", "score", "compare-states", "check-determinism", "bench")


def run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_clean_error(rc, err, match, directory=None):
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxgdn: error: "), err
    assert match in lines[0], lines[0]
    if directory is not None:
        assert list(Path(directory).iterdir()) == [], "output or temporary files left behind"


@pytest.fixture(scope="module")
def preset(tiny):
    return tiny  # conftest's session model: tiny_model("tiny"), seed 0, fp32 -- what `--model tiny` builds


@pytest.fixture(autouse=True)
def _share_the_session_model(monkeypatch, tiny):
    """Hand the CLI the session's identical tiny model instead of rebuilding it (a few seconds per build)."""
    real = cli._preset
    monkeypatch.setattr(cli, "_preset", lambda name, seed, dtype: tiny if (name, seed, dtype) == ("tiny", 0, "float32")
                        else real(name, seed, dtype))


@pytest.fixture
def ckpt_dir(tmp_path):
    """The tiny Qwen3.5 fixture checkpoint plus the tiny tokenizer, eos id 1."""
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "qwen3_5_tiny", d, ignore=shutil.ignore_patterns("expected.npz"))
    shutil.copy(FIXTURES / "tokenizer_tiny" / "tokenizer.json", d / "tokenizer.json")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    return d


@pytest.mark.parametrize("command", COMMANDS)
def test_help(capsys, command):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: jaxgdn {command}" in capsys.readouterr().out


def test_demo(capsys):
    rc, out, _ = run(capsys, "demo", "--prompt-len", 10, "--new-tokens", 8)
    assert rc == 0
    assert "generated 8 tokens" in out and "prefill split at" in out


# ---- generate ----------------------------------------------------------------------------------------------------

def test_generate_text(capsys, tmp_path, preset):
    rc, out, err = run(capsys, "generate", "--prompt", "Hello", "--max-new-tokens", 8, "--output", tmp_path / "g.json")
    assert rc == 0
    rec = json.loads((tmp_path / "g.json").read_text())
    assert rec["prompt_tokens"] == list(b"Hello")  # presets read text as UTF-8 bytes
    [api] = jaxgdn.generate(preset, [list(b"Hello")], max_new_tokens=8)
    assert rec["tokens"] == api.tokens and np.array_equal(rec["logprobs"], api.logprobs)
    assert rec["text"] == bytes(api.tokens).decode("utf-8", errors="replace")
    assert out.splitlines()[0] == rec["text"].splitlines()[0]
    assert "8 generated" in err


def test_generate_tokens_sampled(capsys, preset):
    argv = ["--tokens", "1,2,3", "--max-new-tokens", 8, "--temperature", 0.8, "--top-p", 0.9, "--seed", 3,
            "--logprobs"]
    rc, out, _ = run(capsys, "generate", *argv)
    assert rc == 0
    [api] = jaxgdn.generate(preset, [[1, 2, 3]], max_new_tokens=8, temperature=0.8, top_p=0.9, seed=3)
    lines = out.splitlines()
    assert lines[0] == ",".join(map(str, api.tokens))
    assert len(lines) == 2 + 8  # ids, table header, one row per token
    assert [float(x.split()[2]) for x in lines[2:]] == pytest.approx(api.logprobs, abs=1e-4)  # printed to 4 places


def test_generate_checkpoint_with_tokenizer(capsys, ckpt_dir, tmp_path):
    out_file = tmp_path / "g.json"
    rc, out, _ = run(capsys, "generate", "--model", ckpt_dir, "--prompt", "Hello world", "--max-new-tokens", 8,
                     "--output", out_file)
    assert rc == 0
    rec = json.loads(out_file.read_text())
    tok = load_tokenizer(ckpt_dir)
    assert rec["prompt_tokens"] == tok.encode("Hello world")
    assert rec["sampling"]["stop_token_ids"] == [1]  # eos from generation_config.json
    assert rec["text"] == tok.decode(rec["tokens"]) and out.startswith(rec["text"])
    model = jaxgdn.load_pretrained(ckpt_dir)
    [api] = jaxgdn.generate(model, [rec["prompt_tokens"]], max_new_tokens=8, stop_token_ids=[1])
    assert rec["tokens"] == api.tokens and rec["finish_reason"] == api.finish_reason


def _bad_dirs(tmp_path):
    bad_json = tmp_path / "bad_json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{oops")
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(FIXTURES / "qwen3_5_tiny" / "config.json", no_weights / "config.json")
    no_tok = tmp_path / "no_tok"
    shutil.copytree(FIXTURES / "qwen3_5_tiny", no_tok, ignore=shutil.ignore_patterns("expected.npz"))
    return dict(bad_json=bad_json, llama=llama, no_weights=no_weights, no_tok=no_tok)


@pytest.mark.parametrize("argv, match", [
    (["--model", "{missing}", "--tokens", "1"], "does not exist (nor is it a preset: tiny, tiny-next)"),
    (["--model", "{bad_json}", "--tokens", "1"], "is not valid JSON"),
    (["--model", "{llama}", "--tokens", "1"], "unsupported model_type 'llama'"),
    (["--model", "{no_weights}", "--tokens", "1"], "no *.safetensors"),
    (["--model", "{no_tok}", "--prompt", "hi"], "has no tokenizer.json"),
    (["--prompt", ""], "empty prompt"),
    (["--prompt-file", "{missing}"], "cannot read prompt file"),
    (["--tokens", "1,x"], "must be integers"),
    (["--tokens", ""], "empty prompt"),
    (["--tokens", "1,999"], "outside [0, 256)"),
    (["--tokens", "1,2", "--max-new-tokens", "8", "--max-length", "5"], "exceeds the capacity of 5"),
    (["--tokens", "1", "--top-p", "0"], "invalid sampling parameters"),
    (["--tokens", "1", "--temperature", "-1"], "invalid sampling parameters"),
    (["--tokens", "1", "--top-k", "0"], "invalid sampling parameters"),
    (["--tokens", "1", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--tokens", "1", "--stop-token-ids", "300"], "stop_token_ids"),
    (["--tokens", "1", "--top-p", "1.5"], "top_p=1.5 (must lie in (0, 1])"),
    (["--tokens", "1", "--temperature", "1", "--seed", "-1"], "seed must be an integer in [0, 2**32); got -1"),
    (["--tokens", "1", "--seed", str(2**32)], "seed must be an integer in [0, 2**32)"),
])
def test_generate_bad_input(capsys, tmp_path, argv, match):
    paths = dict(_bad_dirs(tmp_path), missing=tmp_path / "missing")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    argv = [a.format(**paths) for a in argv]
    rc, out, err = run(capsys, "generate", *argv, "--output", out_dir / "g.json")
    assert_clean_error(rc, err, match, out_dir)
    assert out == ""


def test_output_directory_must_exist(capsys, tmp_path):
    rc, _, err = run(capsys, "generate", "--tokens", "1", "--output", tmp_path / "nowhere" / "g.json")
    assert_clean_error(rc, err, "output directory")


# ---- score -------------------------------------------------------------------------------------------------------

def test_score_completion_csv(capsys, tmp_path, preset):
    rc, out, _ = run(capsys, "score", "--prompt", "Hello", "--completion", " world", "--output", tmp_path / "s.csv")
    assert rc == 0
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    seq = list(b"Hello world")
    [api] = score(preset, [seq], start=5)
    assert [int(r["position"]) for r in rows] == list(range(5, 11))
    assert [int(r["token"]) for r in rows] == seq[5:]
    assert np.array_equal(np.array([float(r["logprob"]) for r in rows]), np.array(api))  # exact float round trip
    assert "scored 6 tokens" in out and "'w'" in out


def test_score_tokens_json(capsys, tmp_path, preset):
    rc, out, _ = run(capsys, "score", "--tokens", "5,6,7,8,9", "--start", 2, "--quiet", "--output", tmp_path / "s.json")
    assert rc == 0
    rec = json.loads((tmp_path / "s.json").read_text())
    [api] = score(preset, [[5, 6, 7, 8, 9]], start=2)
    assert rec["start"] == 2 and np.array_equal(rec["logprobs"], api)
    assert rec["total"] == pytest.approx(sum(api))
    assert out.startswith("scored 3 tokens")  # --quiet: the summary only, no per-token table


@pytest.mark.parametrize("argv, match", [
    (["--tokens", "5,6,7", "--start", "3"], "start 3 is out of range"),
    (["--tokens", "5"], "sequence 0 has one token: scoring needs at least 2"),
    (["--tokens", "5,6", "--completion-tokens", "7,256"], "completion holds token ids outside"),
    (["--tokens", "5,6", "--start", "1", "--completion", "x"], "cannot be combined"),
    (["--tokens", "5,6", "--output", "{out}/s.txt"], "must end in .json or .csv"),
    (["--tokens", "5,6,7", "--max-length", "2"], "exceeds the capacity of 2"),
])
def test_score_bad_input(capsys, tmp_path, argv, match):
    argv = [a.format(out=tmp_path) for a in argv]
    rc, _, err = run(capsys, "score", *argv)
    assert_clean_error(rc, err, match, tmp_path)


# ---- compare-states ----------------------------------------------------------------------------------------------

CS_ARGS = ["--length", 70, "--decode-from", 60, "--splits", "64,63,64", "--stride", 5, "--seed", 4]  # (64 twice:
# compared once)


def test_compare_states(capsys, tmp_path, preset):
    prefix = tmp_path / "cs"
    rc, out, _ = run(capsys, "compare-states", *CS_ARGS, "--output", prefix)
    assert rc == 0
    rows = list(csv.DictReader(open(f"{prefix}.csv")))
    by = {}
    for r in rows:
        by.setdefault(r["comparison"], []).append(r)
    layers = len(preset.config.gdn_layers)
    # positions 5, 10, ..., 70; the decode path and both splits are compared beyond 60 / 64 / 63: at 65 and 70
    assert {k: len(v) for k, v in by.items()} == {
        "prefill 60 + decode": 2 * layers, "split at 64 (on grid)": 2 * layers, "split at 63 (off grid)": 2 * layers}
    on = by["split at 64 (on grid)"]
    assert all(float(r["rel"]) == 0 and float(r["frac_equal"]) == 1 and int(r["max_ulp"]) == 0 for r in on)
    for name in ("prefill 60 + decode", "split at 63 (off grid)"):
        rel = [float(r["rel"]) for r in by[name]]
        assert 0 < max(rel) < 1e-3, f"{name}: max rel diff {max(rel):.3g} (expected a small nonzero gap)"

    # One row recomputed through the API: the decode path at position 70, every GDN layer.
    tokens = np.random.default_rng(4).integers(0, 256, 70).astype(np.int32)
    padded = np.zeros((1, 128), np.int32)
    padded[0, :70] = tokens
    ref, _ = preset.prefill_chunk(preset.init_state(1, 128), padded, np.array([70], np.int32))
    dec, _ = preset.prefill_chunk(preset.init_state(1, 128), padded, np.array([60], np.int32))
    for t in tokens[60:]:
        dec, _ = preset.decode_step(dec, np.array([t], np.int32))
    for layer, a, b in zip(preset.config.gdn_layers, gdn_states(dec), gdn_states(ref)):
        d = diff_arrays(a.recurrent, b.recurrent, layer)
        [row] = [r for r in by["prefill 60 + decode"] if int(r["position"]) == 70 and int(r["layer"]) == layer]
        assert float(row["rel"]) == d.rel and float(row["max_abs"]) == d.max_abs and int(row["max_ulp"]) == d.max_ulp

    rec = json.loads(open(f"{prefix}.json").read())
    assert rec["tokens"] == 70 and len(rec["rows"]) == len(rows) and len(rec["summary"]) == 3 * layers
    # the summary in a fixed order: the decode path, then the splits by their point, each by layer
    assert [(r["comparison"], r["layer"]) for r in rec["summary"]] == [
        (name, layer) for name in ("prefill 60 + decode", "split at 63 (off grid)", "split at 64 (on grid)")
        for layer in sorted(preset.config.gdn_layers)]
    assert open(f"{prefix}.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "split at 64 (on grid)" in out


def test_compare_states_progress_bar(capsys, preset, monkeypatch):
    """A bar over the positions on stderr when asked (on a terminal by default; off here, where stderr is not one),
    and nothing on stderr when not asked. The bar redraws at every step here: tqdm's default redraws at most every
    0.1 s, so with the programs already compiled (another test ran them first) the loop could end before it drew
    "14/14" (seen with two xdist workers, 2026-12-05)."""
    import functools

    import tqdm.auto

    from jaxgdn.cli import state_gap_records

    monkeypatch.setattr(tqdm.auto, "tqdm", functools.partial(tqdm.auto.tqdm, mininterval=0, miniters=1))

    tokens = np.random.default_rng(4).integers(0, 256, 70).tolist()
    capsys.readouterr()
    with_bar = state_gap_records(preset, tokens, 60, [64], 5, progress=True)
    err = capsys.readouterr().err
    assert "compare-states" in err and "14/14" in err, err
    assert state_gap_records(preset, tokens, 60, [64], 5) == with_bar
    assert capsys.readouterr().err == ""


def test_compare_states_names_the_comparisons_its_stride_leaves_out(capsys, tmp_path):
    """Positions 8, 16, ..., 64 of 70 tokens: the decode path from 60 and the split at 63 are compared at 64, the
    split at 64 at none: it is named on stderr (before, it left the table without a word), the others run."""
    rc, out, err = run(capsys, "compare-states", "--length", 70, "--decode-from", 60, "--splits", "64,63",
                       "--stride", 8, "--seed", 4, "--output", tmp_path / "cs")
    assert rc == 0
    assert "left out (no position 8, 16, ... up to 70 lies past their start; a smaller --stride compares them): " \
           "split at 64" in err, err
    assert "split at 63 (off grid)" in out and "prefill 60 + decode" in out and "split at 64" not in out


def test_compare_states_leaves_no_partial_files(capsys, tmp_path, monkeypatch):
    """The CSV and JSON are staged before the plot; a failure in the plot leaves no file at all."""
    def broken(*a, **k):
        raise jaxgdn.InputError("plot failed")

    monkeypatch.setattr(cli, "plot_gaps", broken)
    rc, _, err = run(capsys, "compare-states", *CS_ARGS, "--output", tmp_path / "cs")
    assert_clean_error(rc, err, "plot failed", tmp_path)


@pytest.mark.parametrize("argv, match", [
    (["--length", "1"], "--length must be >= 2"),
    (["--length", "20", "--decode-from", "20"], "--decode-from must lie in [0, 19]"),
    (["--length", "20", "--decode-from", "5", "--splits", "0,5"], "--splits must lie in [1, 19]"),
    (["--tokens", "1,2,300"], "outside [0, 256)"),
    (["--length", "100", "--stride", "1000"], "nothing to compare: no position 1000, 2000, ... up to 100"),
    (["--length", "100", "--splits", "", "--decode-from", "99", "--stride", "3"],
     "lies past --decode-from (99) or a split point (none)"),
])
def test_compare_states_bad_input(capsys, tmp_path, argv, match):
    rc, _, err = run(capsys, "compare-states", *argv, "--output", tmp_path / "cs")
    assert_clean_error(rc, err, match, tmp_path)


# ---- check-determinism -------------------------------------------------------------------------------------------

def test_check_determinism_passes(capsys, tmp_path):
    rc, out, _ = run(capsys, "check-determinism", "--output", tmp_path / "d.json")
    assert rc == 0, out
    rec = json.loads((tmp_path / "d.json").read_text())
    passed = {c["check"]: c["passed"] for c in rec["checks"]}
    for name in ("run to run (same request twice)", "warm vs cold prefix cache", "batch size (alone vs row 1 of 4)",
                 "prefill split on the 64 grid", "cache entries == fresh prefill"):
        assert passed[name] is True, name
    assert "0 failed" in out


def test_check_determinism_replay_over_the_recurrent_gdn_prefill(capsys, tmp_path):
    """--decode-mode replay --gdn-prefill recurrent: every check passes, generated logprobs == scoring included."""
    rc, out, _ = run(capsys, "check-determinism", "--decode-mode", "replay", "--gdn-prefill", "recurrent",
                     "--output", tmp_path / "d.json")
    assert rc == 0, out
    rec = json.loads((tmp_path / "d.json").read_text())
    assert rec["gdn_prefill"] == "recurrent" and rec["decode_mode"] == "replay"
    assert any("score" in c["check"] and c["passed"] is True for c in rec["checks"])
    assert any(c["check"] == "prefill split off the grid" and c["passed"] is True for c in rec["checks"])
    assert "0 failed" in out and "GDN prefill recurrent" in out


def test_check_determinism_catches_an_unsafe_cache(capsys):
    """Admitting decode-produced states into the cache is the bug the checks exist for: they must fail. The
    provenance check fails for every prompt; a decode-produced state changes a logprob only where its ~1e-8 gap
    reaches one, so the warm/cold comparison tries up to four prompts and must fail on one."""
    warm_failed = False
    for seed in range(4):
        rc, out, _ = run(capsys, "check-determinism", "--unsafe-cache", "--checks", "warm-cold,cache",
                         "--seed", str(seed))
        assert rc == 1
        cache = [line for line in out.splitlines() if line.startswith("cache entries == fresh prefill")]
        assert cache and "FAIL" in cache[0] and "not prefill-produced" in cache[0]
        warm = [line for line in out.splitlines() if line.startswith("warm vs cold prefix cache")]
        assert warm and "restored 128" in warm[0]
        assert "batch size" not in out  # --checks ran only the two named checks
        if "FAIL" in warm[0]:
            assert "2 failed: " in out
            warm_failed = True
            break
    assert warm_failed


def test_check_determinism_score_alone_in_recurrent_mode_reports_why_not(capsys, tmp_path):
    """`--checks score` in the default (recurrent) decode mode, which does not promise generation == score: an info
    row saying so, and the report written (it used to end in a ValueError with no rows to print)."""
    rc, out, _ = run(capsys, "check-determinism", "--checks", "score", "--prompt-len", 65, "--new-tokens", 2,
                     "--output", tmp_path / "d.json")
    assert rc == 0, out
    row = [line for line in out.splitlines() if line.startswith("generation == teacher-forced score")]
    assert row and "info" in row[0] and "--decode-mode replay" in row[0] and "0 failed" in out
    assert (tmp_path / "d.json").is_file()


@pytest.mark.parametrize("command", ["demo", "compare-states", "check-determinism"])  # (generate: the library's
def test_negative_seed_is_an_argument_error(capsys, command):  # check, a one-line error: test_generate_bad_input)
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--seed", "-1"])
    assert e.value.code == 2 and "--seed: expected a non-negative integer; got -1" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "score", "compare-states", "check-determinism", "bench"])
def test_an_empty_output_is_an_argument_error(capsys, command):
    """`--output ""` (an unset shell variable) is refused before anything runs; it had turned the output off."""
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--output", ""])
    assert e.value.code == 2 and "--output: must not be empty" in capsys.readouterr().err


def test_check_determinism_bad_checks(capsys):
    rc, _, err = run(capsys, "check-determinism", "--checks", "warm-cold,nope")
    assert_clean_error(rc, err, "--checks must name some of")


# ---- bench -------------------------------------------------------------------------------------------------------

def test_bench(capsys, tmp_path):
    rc, out, _ = run(capsys, "bench", "--prompt-len", 64, "--decode-steps", 4, "--repeats", 1,
                     "--output", tmp_path / "b.json")
    assert rc == 0
    rec = json.loads((tmp_path / "b.json").read_text())
    assert rec["prefill_tokens_per_s"] > 0 and rec["decode_tokens_per_s"] > 0 and rec["decode_steps"] == 4
    assert rec["device"].startswith("cpu") and "tokens/s" in out


def test_bench_bad_input(capsys, tmp_path):
    rc, _, err = run(capsys, "bench", "--batch-size", 0, "--output", tmp_path / "b.json")
    assert_clean_error(rc, err, "--batch-size must be >= 1", tmp_path)


def test_compile_cache_keeps_programs_and_restores_jax_settings(capsys, tmp_path):
    """--compile-cache DIR: the command's compiled programs land in DIR (bf16: programs no other test here compiled,
    so they compile now), its output is the output without the flag, and JAX's cache settings are as before after."""
    import jax

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    before = [getattr(jax.config, n) for n in names]
    cache = tmp_path / "xla" / "new"  # made by the command, parents included
    argv = ("score", "--tokens", "5,6,7,8,9", "--start", 2, "--quiet", "--dtype", "bfloat16")
    rc, cached, _ = run(capsys, *argv, "--compile-cache", cache)
    assert rc == 0 and len(list(cache.iterdir())) >= 1
    assert [getattr(jax.config, n) for n in names] == before
    rc, plain, _ = run(capsys, *argv)
    assert rc == 0 and plain == cached and len(list(cache.iterdir())) >= 1


def test_compile_cache_bad_directory(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    rc, _, err = run(capsys, "score", "--tokens", "5,6,7", "--compile-cache", tmp_path / "file" / "xla")
    assert_clean_error(rc, err, f"--compile-cache {tmp_path / 'file' / 'xla'}: cannot make the directory")
