"""The command line's argument checks found by a new user's review (2026-12-04): seeds, conflicting flags, output
prefixes, lengths past the capacity, flags that do nothing, and the README's command lines against the parser. Every
case here fails before a model is built or compiled."""

from __future__ import annotations

import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

from jaxgdn import cli
from tests.test_cli import assert_clean_error, run

ROOT = Path(__file__).absolute().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def argparse_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main([str(a) for a in argv])
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(autouse=True)
def _no_model(monkeypatch):
    """Every case must fail before a model is built: building one fails the test."""
    def refuse(*a, **k):
        raise AssertionError("a model was built: the check came too late")

    monkeypatch.setattr(cli, "_preset", refuse)
    monkeypatch.setattr("jaxgdn.checkpoint.load_pretrained", refuse)


# ---- seeds: --model-seed was a plain int (negative accepted, 2**64 a traceback from JAX's key) -----------------

@pytest.mark.parametrize("command", ["generate", "score", "compare-states", "check-determinism", "bench"])
@pytest.mark.parametrize("value, match", [("-1", "expected a non-negative integer; got -1"),
                                          (str(2**64), "expected an integer below 2**32; got 18446744073709551616")])
def test_model_seed_range(capsys, command, value, match):
    err = argparse_error(capsys, command, "--model-seed", value)
    assert f"--model-seed: {match}" in err


@pytest.mark.parametrize("command", ["demo", "compare-states", "check-determinism"])
def test_seed_past_32_bits_is_an_argument_error(capsys, command):
    """`demo --seed 2**64` ended in an OverflowError traceback from jax.random.key."""
    assert "--seed: expected an integer below 2**32; got 4294967296" in argparse_error(capsys, command, "--seed",
                                                                                      2**32)


# ---- generate: --no-stop and --stop-token-ids ---------------------------------------------------------------------

def test_no_stop_conflicts_with_stop_token_ids(capsys):
    """--no-stop used to win silently over --stop-token-ids."""
    err = argparse_error(capsys, "generate", "--tokens", "1", "--no-stop", "--stop-token-ids", "5")
    assert "argument --stop-token-ids: not allowed with argument --no-stop" in err


# ---- compare-states: --output is a file prefix ----------------------------------------------------------------

@pytest.mark.parametrize("suffix", ["/", "/.", "/.."])
def test_compare_states_output_prefix_is_not_a_directory(capsys, tmp_path, suffix):
    """`--output DIR/` used to write the hidden files DIR/.csv, DIR/.json and DIR/.png."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    rc, _, err = run(capsys, "compare-states", "--length", 70, "--output", f"{out_dir}{suffix}")
    assert_clean_error(rc, err, "--output takes a file prefix", out_dir)
    assert "compare_states" in err and [p.name for p in tmp_path.iterdir()] == ["out"]


# ---- lengths past the capacity: demo and check-determinism had no limit (out of memory, or hours) -----------------

@pytest.mark.parametrize("argv", [["--prompt-len", 1_000_000], ["--new-tokens", 1_000_000],
                                  ["--prompt-len", 4000, "--new-tokens", 97]])
def test_demo_lengths_past_the_capacity(capsys, argv):
    rc, out, err = run(capsys, "demo", *argv)
    assert_clean_error(rc, err, "exceed the preset's capacity of 4096 tokens")
    assert out == ""


@pytest.mark.parametrize("argv, match", [
    (["--prompt-len", 1_000_000], "make requests of 1000074 tokens"),
    (["--prompt-len", 65, "--new-tokens", 100_000], "make requests of 200075 tokens"),
    (["--prompt-len", 4000, "--new-tokens", 44], "make requests of 4098 tokens"),
])
def test_check_determinism_lengths_past_the_capacity(capsys, tmp_path, argv, match):
    rc, out, err = run(capsys, "check-determinism", *argv, "--output", tmp_path / "d.json")
    assert_clean_error(rc, err, match, tmp_path)
    assert "past the model's capacity of 4096 tokens" in err and out == ""


def test_check_determinism_capacity_of_a_checkpoint(capsys, tmp_path):
    """A checkpoint's limit is its max_position_embeddings (512 for the tiny fixture)."""
    d = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "qwen3_5_tiny", d, ignore=shutil.ignore_patterns("expected.npz"))
    rc, _, err = run(capsys, "check-determinism", "--model", d, "--prompt-len", 500)
    assert_clean_error(rc, err, "make requests of 574 tokens (prompt + 2 x new tokens + 10), past the model's "
                                "capacity of 512 tokens")


# ---- score: --decode-mode changed nothing (a score is a prefill) ------------------------------------------------

def test_score_has_no_decode_mode(capsys):
    with pytest.raises(SystemExit):
        cli.main(["score", "--help"])
    assert "--decode-mode" not in capsys.readouterr().out
    assert "unrecognized arguments: --decode-mode" in argparse_error(capsys, "score", "--tokens", "1,2",
                                                                      "--decode-mode", "replay")


# ---- the README's command lines parse as written --------------------------------------------------------------

def readme_command_lines() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Command line"):]
    block = re.search(r"^```bash\n(.*?)^```", section, re.S | re.M).group(1)
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def test_readme_command_lines_parse():
    """Each README command line is accepted by the parser (flags and values as written; running them is slow: the
    review of 2026-12-04 ran all nine by hand, with DIR the tiny fixture plus tokenizer)."""
    lines = readme_command_lines()
    assert len(lines) >= 9 and all(argv[0] == "jaxgdn" for argv in lines), lines
    assert {argv[1] for argv in lines} == {"demo", "generate", "score", "compare-states", "check-determinism",
                                           "bench"}
    for argv in lines:
        cli._parser().parse_args(argv[1:])  # SystemExit(2) on a flag or value the parser does not take


# ---- stdout closed early ----------------------------------------------------------------------------------------

class _ClosedStdout:
    """A stdout whose reader has gone: writes are buffered, the flush fails."""

    def write(self, text):
        return len(text)

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        return 1  # (os.dup2 is stubbed in the test)


@pytest.mark.parametrize("where", ["in the command", "in the last flush"])
def test_broken_pipe_is_quiet(capsys, monkeypatch, tmp_path, where):
    """`jaxgdn score ... | head -1` used to end with `jaxgdn: error: [Errno 32] Broken pipe` and exit 2 (bad input's
    code), or, when only the final flush met the closed pipe, with Python's "Exception ignored ... BrokenPipeError"
    and status 120. Now it stops quietly with a shell's SIGPIPE status, and no output file (nor temporary file)."""
    def command(args, out):
        out.write_text(args.output, "partial")
        print("pos token logprob")
        if where == "in the command":
            raise BrokenPipeError(32, "Broken pipe")
        return 0

    monkeypatch.setitem(cli._COMMANDS, "score", command)
    monkeypatch.setattr(os, "dup2", lambda fd, fd2: None)  # (under `pytest -s` it would silence the session's stdout)
    if where == "in the last flush":
        monkeypatch.setattr("sys.stdout", _ClosedStdout())
    rc, _, err = run(capsys, "score", "--tokens", "1,2", "--output", tmp_path / "s.json")
    assert rc == 141 and err == ""
    assert list(tmp_path.iterdir()) == []


# ---- text that is not UTF-8 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["generate", "--prompt", "ab\udcff"], "--prompt is not valid UTF-8 text (byte 0xff at character 2)"),
    (["score", "--tokens", "1,2", "--completion", "\udcfe"], "--completion is not valid UTF-8 text (byte 0xfe"),
    (["compare-states", "--prompt", "\udcc3x"], "--prompt is not valid UTF-8 text (byte 0xc3"),
])
def test_text_that_is_not_utf8(capsys, argv, match):
    """Bytes that are not UTF-8 in the command line reach Python as lone surrogates ('\\udcff' for 0xff): the
    tokenizers raised UnicodeEncodeError, a traceback."""
    rc, out, err = run(capsys, *argv)
    assert_clean_error(rc, err, match)
    assert out == ""


# ---- compare-states: --length / --seed shape the random prompt only (a given prompt silently replaced them) -----

@pytest.mark.parametrize("extra, match", [(["--length", "70"], "--length shape the random prompt"),
                                          (["--seed", "3"], "--seed shape the random prompt"),
                                          (["--length", "70", "--seed", "3"], "--length and --seed shape")])
def test_compare_states_random_prompt_flags_with_a_prompt(capsys, tmp_path, extra, match):
    rc, _, err = run(capsys, "compare-states", "--tokens", "1,2,3,4", *extra, "--output", tmp_path / "cs")
    assert_clean_error(rc, err, match, tmp_path)


# ---- score: the perplexity of a very unlikely sequence was an OverflowError traceback ----------------------------

def test_perplexity_overflows_to_inf():
    assert cli._perplexity(-1.0) == pytest.approx(2.718281828459045)
    assert cli._perplexity(0.0) == 1.0
    assert cli._perplexity(-800.0) == float("inf")


@pytest.mark.parametrize("text, flag, match", [
    ("1,,2", "--tokens", "without empty fields; got '1,,2'"),
    ("1,2,", "--tokens", "without empty fields"),
    ("", "--stop-token-ids", "without empty fields; got '' (--no-stop turns the stop tokens off)"),
    ("1,x", "--tokens", "must be integers separated by commas; got '1,x'"),
])
def test_id_lists_with_empty_fields_are_refused(text, flag, match):
    """`--tokens 1,,2` read as [1, 2] and `--stop-token-ids ""` silently meant no stop tokens; both are errors now.
    Spaces around or instead of commas still read as separators."""
    from jaxgdn.errors import InputError

    with pytest.raises(InputError, match=re.escape(match)):
        cli._parse_ids(text, flag)
    assert cli._parse_ids(" 1, 2  3 ", "--tokens") == [1, 2, 3]
    assert cli._parse_ids(" ", "--tokens") == []  # no ids: the caller names it ("empty prompt", test_cli.py)
