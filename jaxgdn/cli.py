"""Command line `jaxgdn`: demo, generate, score, compare-states, check-determinism, bench.

Every command but `demo` (which takes `--preset`) takes `--model DIR|tiny|tiny-next` (a Hugging Face checkpoint
directory, or an embedded random preset) and `--compile-cache DIR` (JAX's persistent compilation cache, for the
command's duration: a later command with the same DIR skips most compiles), and every command `--help`. Text goes in and
out through the checkpoint's tokenizer.json (UTF-8 bytes for the presets, whose vocabulary is 256); `--tokens 1,2,3`
passes token ids directly. Bad input exits 2: jaxgdn's own checks print one line on stderr (`jaxgdn: error: ...`),
argparse's its usage and an error line. `check-determinism` exits 1 when a check fails and still writes its report.
Output files are written to temporary files and renamed into place only when the command returns (a report of a failed
check included), so an error leaves none behind. A stdout closed early (`jaxgdn score ... | head`) ends the command
quietly with status 141, a shell's status for SIGPIPE, and no output file.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import sys
import time
from pathlib import Path

from .errors import CapacityError, CheckpointError, InputError, JaxGDNError
from .program_cache import compile_cache

PRESETS = ("tiny", "tiny-next")
PRESET_MAX_LENGTH = 4096  # the CLI's capacity limit for the embedded presets (they have no max_position_embeddings)


# ---- output files: temp file beside the target, renamed on success ---------------------------------------------

class _Outputs:
    """Collects output files as temporary files; `commit` renames them into place, `discard` removes them."""

    def __init__(self):
        self.pending: list[tuple[Path, Path]] = []

    def target(self, path) -> Path:
        """Check early that `path` can be written (its directory exists); returns it as a Path."""
        path = Path(path)
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise InputError(f"output directory {parent} does not exist (for {path})")
        if path.is_dir():
            raise InputError(f"output path {path} is a directory")
        return path

    def _tmp(self, path) -> Path:
        path = self.target(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{len(self.pending)}")
        self.pending.append((tmp, path))
        return tmp

    def write_text(self, path, text: str) -> None:
        self._tmp(path).write_text(text)

    def savefig(self, fig, path) -> None:
        fig.savefig(self._tmp(path), format="png", dpi=110, bbox_inches="tight")

    def commit(self) -> list[Path]:
        for tmp, final in self.pending:
            os.replace(tmp, final)
        done = [final for _, final in self.pending]
        self.pending = []
        return done

    def discard(self) -> None:
        for tmp, _ in self.pending:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self.pending = []


# ---- models, tokenizers, prompts --------------------------------------------------------------------------------

def _output_path(text: str) -> str:
    """argparse type of every --output: a path, not empty (an unset shell variable, `--output "$OUT"`, had turned
    the output off without a word)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty: it names the file to write (leave the option out to "
                                         "write none)")
    return text


def _seed(text: str) -> int:
    """argparse type of the seed options (--seed of demo / compare-states / check-determinism, --model-seed): an
    integer in [0, 2**32) (NumPy's generators take no negative seed; JAX's keys no seed past 64 bits; generate's
    sampling seed is checked by the library against the same range)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer; got {value}")
    if value >= 1 << 32:
        raise argparse.ArgumentTypeError(f"expected an integer below 2**32; got {value}")
    return value


@functools.lru_cache(maxsize=4)
def _preset(name: str, seed: int, dtype_name: str):
    import jax.numpy as jnp

    from .presets import tiny_model

    return tiny_model(name, seed=seed, dtype=getattr(jnp, dtype_name))


def _add_model_args(p: argparse.ArgumentParser, deterministic: bool = True, decode_mode: bool = True,
                    gdn_prefill: bool = True) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny", metavar="DIR|tiny|tiny-next",
                   help="Hugging Face checkpoint directory (config.json + safetensors), or an embedded random "
                        "preset: tiny (Qwen3.5 layout) or tiny-next (Qwen3-Next, MoE). Default: tiny")
    g.add_argument("--model-seed", type=_seed, metavar="N", default=0,
                   help="seed of a preset's random weights (default 0)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter/activation dtype (GDN states stay fp32; default float32)")
    if deterministic:
        g.add_argument("--deterministic", action="store_true",
                       help="batch-invariant numerics (a row's result does not depend on the batch or prompt split)")
    if decode_mode:
        g.add_argument("--decode-mode", choices=("recurrent", "replay"), default="recurrent",
                       help="recurrent: one-token recurrent update (fast); replay: decode runs the prefill path, "
                            "bitwise what a prefill computes (slower over the chunked GDN prefill: each step "
                            "computes its token's part of the open 64-token chunk with the prefill's arithmetic; "
                            "about as fast as recurrent with --gdn-prefill recurrent)")
    g.add_argument("--compile-cache", metavar="DIR",
                   help="keep the compiled programs in DIR (JAX's persistent compilation cache, made if missing) so "
                        "that the next command with the same DIR skips most compiles: on an H100 at the 9B shape, "
                        "`generate`'s first call took 33 s in a new process and 5.5 s with the cache warm "
                        "(BENCHMARKS.md). JAX_COMPILATION_CACHE_DIR does the same with JAX's defaults (programs that "
                        "compile in under 1 s not kept)")
    if gdn_prefill:
        g.add_argument("--gdn-prefill", choices=("chunked", "recurrent"), default="chunked",
                       help="GDN prefill arithmetic: chunked (fast prefill) or recurrent (token by token with the "
                            "decode kernel's arithmetic: slower prefill, one-step replay decode; with "
                            "--deterministic any prompt split is exact)")


def _load_model(args, deterministic: bool | None = None):
    """(model, source description) from --model / --model-seed / --dtype / --deterministic / --decode-mode /
    --gdn-prefill."""
    import dataclasses

    import jax.numpy as jnp

    from .checkpoint import load_pretrained

    det = getattr(args, "deterministic", False) if deterministic is None else deterministic
    mode = getattr(args, "decode_mode", "recurrent")
    form = getattr(args, "gdn_prefill", "chunked")
    if args.model in PRESETS and not os.path.isdir(args.model):
        model = _preset(args.model, args.model_seed, args.dtype)
        source = f"preset {args.model!r} (seed {args.model_seed})"
    else:
        if not os.path.exists(args.model):
            raise CheckpointError(f"model directory {args.model} does not exist (nor is it a preset: "
                                  f"{', '.join(PRESETS)})")
        model = load_pretrained(args.model, dtype=getattr(jnp, args.dtype))
        source = f"checkpoint {args.model}"
    return dataclasses.replace(model, deterministic=det, decode_mode=mode, gdn_prefill=form), source


def _max_length(args) -> int:
    if getattr(args, "max_length", None) is not None:
        if args.max_length < 2:
            raise InputError(f"--max-length must be >= 2; got {args.max_length}")
        return args.max_length
    if args.model in PRESETS and not os.path.isdir(args.model):
        return PRESET_MAX_LENGTH
    try:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
    except (OSError, ValueError):
        return 1 << 30
    n = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(n) if n else 1 << 30


def _add_tokenizer_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", metavar="PATH|bytes",
                   help="tokenizer.json (or a directory holding one), or 'bytes' for UTF-8 bytes as ids. Default: the "
                        "model directory's tokenizer.json; UTF-8 bytes for the presets")


def _load_tokenizer(args, model):
    """The tokenizer for text I/O, or None when there is none (then only --tokens works)."""
    from .tokenizer import ByteTokenizer, load_tokenizer

    spec = getattr(args, "tokenizer", None)
    if spec == "bytes":
        tok = ByteTokenizer()
    elif spec is not None:
        tok = load_tokenizer(spec)
        if tok is None:
            raise InputError(f"no tokenizer.json in {spec}")
    elif args.model in PRESETS and not os.path.isdir(args.model):
        tok = ByteTokenizer()
    else:
        tok = load_tokenizer(args.model)
    if tok is not None and tok.vocab_size > model.config.vocab_size:
        raise InputError(f"tokenizer {tok.name} has {tok.vocab_size} ids but the model's vocabulary is "
                         f"{model.config.vocab_size}")
    return tok


def _add_prompt_args(p: argparse.ArgumentParser, required: bool = True, what: str = "prompt") -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--prompt", metavar="TEXT", help=f"the {what} as text (needs a tokenizer)")
    g.add_argument("--prompt-file", metavar="FILE", help=f"read the {what} text from FILE (UTF-8)")
    g.add_argument("--tokens", metavar="IDS", help=f"the {what} as token ids, e.g. '1,2,3'")


def _parse_ids(text: str, flag: str) -> list[int]:
    """Integers separated by commas (spaces allowed around them, or instead of them); an empty field ("1,,2", "",
    a trailing comma) is an InputError rather than silently dropped. An empty text is no ids (the caller's check names
    it: "empty prompt"), except for --stop-token-ids, where it silently meant no stop tokens."""
    if not text.strip() and flag != "--stop-token-ids":
        return []
    fields = [f.split() for f in text.split(",")]
    if any(not f for f in fields):
        hint = " (--no-stop turns the stop tokens off)" if flag == "--stop-token-ids" else ""
        raise InputError(f"{flag} must be integers separated by commas, without empty fields; got {text!r}{hint}")
    try:
        return [int(x) for f in fields for x in f]
    except ValueError:
        raise InputError(f"{flag} must be integers separated by commas; got {text!r}") from None


def _check_ids(ids: list[int], model, what: str) -> list[int]:
    if not ids:
        raise InputError(f"empty {what}")
    V = model.config.vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise InputError(f"{what} holds token ids outside [0, {V}): {bad[:5]}")
    return ids


def _check_text_args(args) -> None:
    """--prompt / --completion must be text a tokenizer can encode: bytes that are not UTF-8 in the command line
    reach Python as lone surrogates, which made every tokenizer raise a UnicodeEncodeError (a traceback)."""
    for flag in ("prompt", "completion"):
        text = getattr(args, flag, None)
        if text is None:
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            byte = e.object[e.start].encode("utf-8", "surrogateescape")[0]
            raise InputError(f"--{flag} is not valid UTF-8 text (byte 0x{byte:02x} at character {e.start}): pass "
                             f"token ids with --tokens, or the text in a UTF-8 file") from None


def _read_prompt(args, tok, model, what: str = "prompt") -> tuple[list[int], bool]:
    """(token ids, given as text?) from --prompt / --prompt-file / --tokens."""
    if args.tokens is not None:
        return _check_ids(_parse_ids(args.tokens, "--tokens"), model, what), False
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read prompt file {args.prompt_file}: {e}") from None
    else:
        text = args.prompt
    if text == "":
        raise InputError(f"empty {what}")
    if tok is None:
        raise InputError(f"{args.model} has no tokenizer.json: pass token ids with --tokens, or --tokenizer PATH")
    return _check_ids(tok.encode(text), model, what), True


def _show(tok, token: int) -> str:
    return repr(tok.token_text(token)) if tok is not None else ""


# ---- demo ------------------------------------------------------------------------------------------------------

def _demo(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from .compare import compare_gdn_states, format_table
    from .generate import generate

    model = _preset(args.preset, args.seed, "float32")
    cfg = model.config
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt_len).tolist()
    print(f"jaxgdn demo: embedded {args.preset!r} model (seed {args.seed}), {cfg.num_layers} layers "
          f"({len(cfg.gdn_layers)} GDN, {len(cfg.attention_layers)} attention), vocab {cfg.vocab_size}")
    print(f"prompt: {len(prompt)} token ids, first ten {prompt[:10]}")
    [res] = generate(model, [prompt], max_new_tokens=args.new_tokens)
    print(f"\ngenerated {len(res.tokens)} tokens (greedy, finish: {res.finish_reason}):")
    for i, (t, lp) in enumerate(zip(res.tokens, res.logprobs)):
        print(f"  {i:>3}  token {t:>5}  logprob {lp:9.4f}")

    full = np.array([prompt + res.tokens], np.int32)
    n, total = len(prompt), full.shape[1]
    capacity = -(-total // 64) * 64

    def prefill(state, toks):  # every call padded to one width: a single compiled program
        padded = np.zeros((1, capacity), np.int32)
        padded[:, :toks.shape[1]] = toks
        return model.prefill_chunk(state, padded, np.array([toks.shape[1]], np.int32))[0]

    one = prefill(model.init_state(1, capacity), full)
    dec = prefill(model.init_state(1, capacity), full[:, :n])
    for t in res.tokens:
        dec, _ = model.decode_step(dec, jnp.array([t], jnp.int32))
    print()
    print(format_table(compare_gdn_states(dec, one, cfg.gdn_layers),
                       f"GDN recurrent state at position {total}: prefill {n} + decode {total - n} "
                       f"vs one prefill of {total}"))
    cut = 64 if total > 64 else total // 2
    for split in sorted({cut, cut - 1} - {0}):
        s = prefill(prefill(model.init_state(1, capacity), full[:, :split]), full[:, split:])
        grid = "on" if split % 64 == 0 else "off"
        print()
        print(format_table(compare_gdn_states(s, one, cfg.gdn_layers),
                           f"prefill split at {split} ({grid} the 64 grid) vs one prefill of {total}"))
    return 0


# ---- generate --------------------------------------------------------------------------------------------------

def _generate(args, out: _Outputs) -> int:
    from .generate import generate

    _check_text_args(args)
    if args.output:
        out.target(args.output)
    model, source = _load_model(args)
    tok = _load_tokenizer(args, model)
    prompt, as_text = _read_prompt(args, tok, model)
    cap = _max_length(args)
    if len(prompt) + args.max_new_tokens > cap:
        raise CapacityError(f"prompt of {len(prompt)} tokens + {args.max_new_tokens} new tokens exceeds the "
                            f"capacity of {cap} tokens (--max-length)")
    if args.no_stop:
        stops = ()
    elif args.stop_token_ids is not None:
        stops = tuple(_parse_ids(args.stop_token_ids, "--stop-token-ids"))
    else:
        stops = tok.eos_token_ids if tok is not None else ()
    t0 = time.perf_counter()
    [res] = generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                     top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=stops)
    elapsed = time.perf_counter() - t0
    text = tok.decode(res.tokens) if (as_text and tok is not None) else None
    print(text if text is not None else ",".join(map(str, res.tokens)))
    if args.logprobs:
        print(f"{'#':>4} {'token':>7} {'logprob':>10}  text")
        for i, (t, lp) in enumerate(zip(res.tokens, res.logprobs)):
            print(f"{i:>4} {t:>7} {lp:>10.4f}  {_show(tok, t)}")
    mean = sum(res.logprobs) / max(len(res.logprobs), 1)
    print(f"[{source}: {len(prompt)} prompt tokens, {len(res.tokens)} generated, finish {res.finish_reason}, "
          f"mean logprob {mean:.4f}, {elapsed:.2f} s]", file=sys.stderr)
    if args.output:
        record = dict(model=args.model, prompt_tokens=prompt, tokens=res.tokens, logprobs=res.logprobs,
                      finish_reason=res.finish_reason, text=text,
                      sampling=dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_token_ids=list(stops),
                                    deterministic=model.deterministic, decode_mode=model.decode_mode,
                                    gdn_prefill=model.gdn_prefill))
        out.write_text(args.output, json.dumps(record, indent=1) + "\n")
    return 0


# ---- score -----------------------------------------------------------------------------------------------------

def _perplexity(mean_logprob: float) -> float:
    """exp(-mean logprob), inf where that overflows a float (a mean below about -709)."""
    import math

    return math.exp(-mean_logprob) if -mean_logprob < 709.78 else math.inf


def _score(args, out: _Outputs) -> int:
    from .score import score

    _check_text_args(args)
    if args.output:
        if Path(args.output).suffix.lower() not in (".json", ".csv"):
            raise InputError(f"--output must end in .json or .csv; got {args.output}")
        out.target(args.output)
    model, source = _load_model(args)
    tok = _load_tokenizer(args, model)
    seq, _ = _read_prompt(args, tok, model, "sequence")
    if args.completion is not None or args.completion_tokens is not None:
        if args.start is not None:
            raise InputError("--start cannot be combined with --completion / --completion-tokens")
        if args.completion_tokens is not None:
            comp = _parse_ids(args.completion_tokens, "--completion-tokens")
        else:
            if tok is None:
                raise InputError(f"{args.model} has no tokenizer.json: pass --completion-tokens")
            comp = tok.encode(args.completion)
        comp = _check_ids(comp, model, "completion")
        start, seq = len(seq), seq + comp
    else:
        start = 1 if args.start is None else args.start
    cap = _max_length(args)
    if len(seq) > cap:
        raise CapacityError(f"sequence of {len(seq)} tokens exceeds the capacity of {cap} tokens (--max-length)")
    t0 = time.perf_counter()
    [lps] = score(model, [seq], start=start)
    elapsed = time.perf_counter() - t0
    rows = [dict(position=start + i, token=seq[start + i], logprob=lp,
                 text=tok.token_text(seq[start + i]) if tok is not None else None) for i, lp in enumerate(lps)]
    if not args.quiet:
        print(f"{'pos':>5} {'token':>7} {'logprob':>10}  text")
        for r in rows:
            print(f"{r['position']:>5} {r['token']:>7} {r['logprob']:>10.4f}  {_show(tok, r['token'])}")
    total = float(sum(lps))
    mean = total / len(lps)
    print(f"scored {len(lps)} tokens (positions {start}..{len(seq) - 1}): total logprob {total:.4f}, mean "
          f"{mean:.4f}, perplexity {_perplexity(mean):.3f}")
    print(f"[{source}, {elapsed:.2f} s]", file=sys.stderr)
    if args.output:
        if args.output.lower().endswith(".csv"):
            import csv
            import io

            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=["position", "token", "logprob", "text"])
            w.writeheader()
            w.writerows(rows)
            out.write_text(args.output, buf.getvalue())
        else:
            out.write_text(args.output, json.dumps(dict(model=args.model, tokens=seq, start=start, logprobs=lps,
                                                        total=total, mean=mean), indent=1) + "\n")
    return 0


# ---- compare-states --------------------------------------------------------------------------------------------

def state_gap_records(model, tokens: list[int], decode_from: int, splits: list[int], stride: int = 1,
                      rows: int = 16, progress: bool | None = None) -> list[dict]:
    """For every GDN layer and every `stride`-th position p of `tokens`: how the fp32 recurrent state reached
    (a) by prefill of `decode_from` tokens then recurrent decode, (b) by a prefill split at s then a prefill of the
    rest, for each s in `splits`, differs from the state of one prefill of p tokens.

    Uses the pure state functions without the deterministic grid check (off-grid splits are the point). All
    prefill calls share one padded width (per-row lengths), so there are three compiled programs in all.
    Returns dict rows: comparison, layer, position, max_abs, mean_abs, rel, max_ulp, mean_ulp, frac_equal.
    progress: a bar over the positions on stderr (None: on a terminal only).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .compare import diff_arrays, ulp_distance
    from .model import _decode_jit as decode, _prefill_jit as prefill, gdn_states  # unchecked: off-grid on purpose

    model = model.with_decode_mode("recurrent")
    T = len(tokens)
    W = max(64, -(-T // 64) * 64)
    toks = np.zeros((W,), np.int32)
    toks[:T] = tokens
    layer_ids = model.config.gdn_layers
    positions = list(range(stride, T + 1, stride))
    splits = sorted(set(splits))  # each split point once

    def run_prefill(state, start, lengths):
        """Rows of `state` (all at position `start`) absorb tokens[start: start + lengths[r]]."""
        block = np.zeros((len(lengths), W), np.int32)
        block[:, :W - start] = toks[start:]
        return prefill(model, state, jnp.asarray(block), jnp.asarray(lengths, jnp.int32))[0]

    def tile(state, n):
        return jax.tree.map(lambda x: jnp.repeat(x, n, axis=0), state)

    def rec(state):  # [R, HV, K, V] per GDN layer, on the host
        return [np.asarray(s.recurrent) for s in gdn_states(state)]

    fresh1 = model.init_state(1, W)
    starts = {s: (run_prefill(fresh1, 0, [s]) if s else fresh1) for s in sorted(set(splits) | {decode_from})}
    records = []

    def add(name, p, got, ref):
        for lid, a, b in zip(layer_ids, got, ref):
            d = diff_arrays(a, b, lid)
            records.append(dict(comparison=name, layer=lid, position=p, max_abs=d.max_abs, mean_abs=d.mean_abs,
                                rel=d.rel, max_ulp=d.max_ulp, mean_ulp=float(ulp_distance(a, b).mean()),
                                frac_equal=d.frac_equal))

    from tqdm.auto import tqdm

    dec_state, dec_pos = starts[decode_from], decode_from
    bar = tqdm(total=len(positions), desc="compare-states", unit="pos", leave=False,
               disable=None if progress is None else not progress)
    for k in range(0, len(positions), rows):
        batch = positions[k:k + rows]
        lens = batch + [0] * (rows - len(batch))
        ref = rec(run_prefill(model.init_state(rows, W), 0, lens))
        for i, p in enumerate(batch):  # (a) prefill decode_from, then decode up to p
            if p <= decode_from:
                continue
            while dec_pos < p:
                dec_state, _ = decode(model, dec_state, jnp.asarray([toks[dec_pos]], jnp.int32))
                dec_pos += 1
            add(f"prefill {decode_from} + decode", p, [r[0] for r in rec(dec_state)], [r[i] for r in ref])
        for s in splits:  # (b) prefill split at s
            rest = [max(p - s, 0) for p in lens]
            if not any(r > 0 for r in rest):
                continue
            got = rec(run_prefill(tile(starts[s], rows), s, rest))
            grid = "on" if s % 64 == 0 else "off"
            for i, p in enumerate(batch):
                if p > s:
                    add(f"split at {s} ({grid} grid)", p, [g[i] for g in got], [r[i] for r in ref])
        bar.update(len(batch))
    bar.close()
    return records


def summarize_gaps(records: list[dict]) -> list[dict]:
    """Per comparison and layer: positions compared, max/median rel diff, max ULP, mean fraction of elements
    bitwise equal, share of positions whose whole state is bitwise equal."""
    import numpy as np

    def order(key):  # the decode comparison first, then the splits by their point, each by layer
        name, layer = key
        split = re.match(r"split at (\d+)", name)
        return (1, int(split.group(1)), layer) if split else (0, 0, layer)

    out = []
    for name, layer in sorted({(r["comparison"], r["layer"]) for r in records}, key=order):
        rs = [r for r in records if r["comparison"] == name and r["layer"] == layer]
        rel = np.array([r["rel"] for r in rs])
        out.append(dict(comparison=name, layer=layer, positions=len(rs), max_rel=float(rel.max()),
                        median_rel=float(np.median(rel)), max_ulp=int(max(r["max_ulp"] for r in rs)),
                        mean_frac_equal=float(np.mean([r["frac_equal"] for r in rs])),
                        positions_bitwise_equal=float(np.mean([r["frac_equal"] == 1.0 for r in rs]))))
    return out


def plot_gaps(records: list[dict], title: str):
    """A matplotlib figure: rel diff (log) and fraction bitwise equal versus position, per comparison and layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, layout="constrained")
    names = list(dict.fromkeys(r["comparison"] for r in records))
    layers = list(dict.fromkeys(r["layer"] for r in records))
    styles = ("-", "--", ":", "-.")
    for name, layer in dict.fromkeys((r["comparison"], r["layer"]) for r in records):
        rs = [r for r in records if r["comparison"] == name and r["layer"] == layer]
        pos = [r["position"] for r in rs]
        rel = [r["rel"] if r["rel"] > 0 else float("nan") for r in rs]  # 0 (bitwise equal) cannot sit on a log axis
        kw = dict(color=f"C{names.index(name) % 10}", linestyle=styles[layers.index(layer) % len(styles)],
                  marker=".", markersize=3, linewidth=1, label=f"{name}, layer {layer}")
        ax1.plot(pos, rel, **kw)
        ax2.plot(pos, [r["frac_equal"] for r in rs], **kw)
    ax1.set_yscale("log")
    ax1.set_ylabel("relative diff ||a-b|| / ||b||\n(gaps: bitwise equal)")
    ax2.set_ylabel("fraction of elements bitwise equal")
    ax2.set_xlabel("position (tokens absorbed)")
    ax2.set_ylim(-0.05, 1.05)
    ax1.set_title(title)
    ax1.legend(fontsize=7, ncol=2)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    return fig


def _records_csv(records: list[dict]) -> str:
    import csv
    import io

    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(records[0]))
    w.writeheader()
    w.writerows(records)
    return buf.getvalue()


def _compare_states(args, out: _Outputs) -> int:
    import numpy as np

    _check_text_args(args)
    prefix = args.output
    given = [f"--{n}" for n in ("length", "seed") if getattr(args, n) is not None]
    if given and (args.prompt is not None or args.prompt_file is not None or args.tokens is not None):
        raise InputError(f"{' and '.join(given)} shape the random prompt, which a given prompt replaces: drop "
                         f"{'them' if len(given) > 1 else 'it'} or the prompt")
    if os.path.basename(prefix) in ("", ".", ".."):  # 'out/' used to write the hidden files out/.csv, .json, .png
        raise InputError(f"--output takes a file prefix (it writes PREFIX.csv, PREFIX.json, PREFIX.png), not a "
                         f"directory; got {prefix!r}: try {os.path.join(prefix, 'compare_states')!r}")
    for ext in (".csv", ".json", ".png"):
        out.target(prefix + ext)
    model, source = _load_model(args)
    if args.prompt is not None or args.prompt_file is not None or args.tokens is not None:
        tokens, _ = _read_prompt(args, _load_tokenizer(args, model), model)
    else:
        length = 128 if args.length is None else args.length
        if length < 2:
            raise InputError(f"--length must be >= 2; got {length}")
        seed = 0 if args.seed is None else args.seed
        tokens = np.random.default_rng(seed).integers(0, model.config.vocab_size, length).tolist()
    T = len(tokens)
    if T < 2:
        raise InputError(f"the prompt must hold at least 2 tokens; got {T}")
    if T > _max_length(args):
        raise CapacityError(f"prompt of {T} tokens exceeds the capacity of {_max_length(args)} tokens (--max-length)")
    if not 0 <= args.decode_from < T:
        raise InputError(f"--decode-from must lie in [0, {T - 1}] for a {T}-token prompt; got {args.decode_from}")
    splits = _parse_ids(args.splits, "--splits") if args.splits.strip() else []
    if any(not 0 < s < T for s in splits):
        raise InputError(f"--splits must lie in [1, {T - 1}] for a {T}-token prompt; got {splits}")
    if args.stride < 1:
        raise InputError(f"--stride must be >= 1; got {args.stride}")
    splits = sorted(set(splits))  # a split point given twice is compared once
    if not any(p > min([args.decode_from] + splits) for p in range(args.stride, T + 1, args.stride)):
        raise InputError(f"nothing to compare: no position {args.stride}, {2 * args.stride}, ... up to {T} (--stride) "
                         f"lies past --decode-from ({args.decode_from}) or a split point ({splits or 'none'})")
    left_out = [name for name, start in [(f"prefill {args.decode_from} + decode", args.decode_from)]
                + [(f"split at {s}", s) for s in splits] if not any(p > start for p in range(args.stride, T + 1,
                                                                                            args.stride))]
    if left_out:  # the others run; say which of the asked-for comparisons have nothing to compare
        print(f"compare-states: left out (no position {args.stride}, {2 * args.stride}, ... up to {T} lies past "
              f"their start; a smaller --stride compares them): {', '.join(left_out)}", file=sys.stderr)
    t0 = time.perf_counter()
    records = state_gap_records(model, tokens, args.decode_from, splits, args.stride)
    summary = summarize_gaps(records)
    print(f"compare-states: {source}, {T} tokens, {len(records)} rows in {time.perf_counter() - t0:.1f} s; "
          f"reference: one prefill of p tokens, for every position p")
    print(f"{'comparison':<26} {'layer':>5} {'positions':>9} {'max rel':>10} {'median rel':>10} {'max ULP':>10} "
          f"{'elems eq':>9} {'states eq':>9}")
    for s in summary:
        print(f"{s['comparison']:<26} {s['layer']:>5} {s['positions']:>9} {s['max_rel']:>10.3e} "
              f"{s['median_rel']:>10.3e} {s['max_ulp']:>10} {s['mean_frac_equal']:>9.1%} "
              f"{s['positions_bitwise_equal']:>9.1%}")
    print("(elems eq: mean fraction of state elements bitwise equal; states eq: positions whose whole state is)")
    meta = dict(model=args.model, tokens=T, decode_from=args.decode_from, splits=splits, stride=args.stride,
                metrics=dict(max_abs="max |a-b|", mean_abs="mean |a-b|", rel="||a-b||_2 / ||b||_2",
                             max_ulp="largest fp32 ULP distance", mean_ulp="mean fp32 ULP distance",
                             frac_equal="fraction of elements bitwise equal"))
    out.write_text(prefix + ".csv", _records_csv(records))
    out.write_text(prefix + ".json", json.dumps(dict(meta, summary=summary, rows=records), indent=1) + "\n")
    import matplotlib.pyplot as plt

    fig = plot_gaps(records, f"GDN state vs one prefill, {source}, {T} tokens")
    out.savefig(fig, prefix + ".png")
    plt.close(fig)
    print(f"wrote {prefix}.csv, {prefix}.json, {prefix}.png")
    return 0


# ---- check-determinism -----------------------------------------------------------------------------------------

CHECKS = ("run-to-run", "warm-cold", "batch", "split", "score", "cache")


def determinism_checks(model, prompt_len: int = 100, new_tokens: int = 32, interval: int = 64, seed: int = 0,
                       unsafe_cache: bool = False, checks=CHECKS) -> list[tuple[str, bool | None, str]]:
    """Run the determinism checks on `model` (made deterministic). Returns (check, passed, detail) rows.

    Request A (a random prompt) warms a prefix cache; request B continues A's conversation (A's prompt + A's
    answer + 10 new tokens). Checks: B twice; B cold versus warm from A's cache; B alone versus row 1 of a batch
    of 4; B's prompt prefilled in one call versus split at 64; every cache entry (structure, provenance, and
    bitwise equality with a fresh prefill of its prefix); in replay decode mode also B's generated logprobs
    versus a teacher-forced score. `checks`: which of CHECKS to run. `unsafe_cache` admits decode-produced
    states into the cache (the bug the deterministic cache refuses): the cache check then fails, and the
    warm-vs-cold check fails wherever the decode states' ~1e-8 gap reaches a logprob (it does for some prompts
    and not others: try a few --seed values).
    """
    import dataclasses

    import jax
    import numpy as np

    from .cache import PrefixCache, check_cache, checkpoint_from_state
    from .generate import generate
    from .score import score

    model = model.with_deterministic(True)
    V = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, V, prompt_len).tolist()
    rows = []

    def same(a, b) -> tuple[bool, str]:
        ta, tb = [r.tokens for r in a], [r.tokens for r in b]
        la = [np.array(r.logprobs, np.float32) for r in a]
        lb = [np.array(r.logprobs, np.float32) for r in b]
        if ta == tb and all(np.array_equal(x, y) for x, y in zip(la, lb)):
            return True, "tokens and logprobs bitwise equal"
        diffs = [float(np.max(np.abs(x - y))) if x.shape == y.shape else float("inf") for x, y in zip(la, lb)]
        return False, f"tokens equal: {ta == tb}; max logprob diff {max(diffs):.3g}"

    empty = PrefixCache(interval=interval, deterministic=not unsafe_cache)
    gen = functools.partial(generate, model, max_new_tokens=new_tokens)

    a = gen([prompt], cache=empty)
    b_prompt = prompt + a[0].tokens + rng.integers(0, V, 10).tolist()
    cold = gen([b_prompt], cache=empty)
    if "run-to-run" in checks:
        ok, detail = same(cold, gen([b_prompt], cache=empty))
        rows.append(("run to run (same request twice)", ok, detail))

    warm = gen([b_prompt], cache=a.cache)
    if "warm-cold" in checks:
        ok, detail = same(cold, warm)
        hit = warm[0].cached_tokens
        rows.append(("warm vs cold prefix cache", ok and hit > 0,
                     f"{detail}; warm run restored {hit} of {len(b_prompt)} prompt tokens from the cache"
                     + ("" if hit else " (no hit: the check is vacuous)")))

    if "batch" in checks:
        others = [rng.integers(0, V, n).tolist() for n in (7, 64, 130)]
        ok, detail = same(cold, gen([others[0], b_prompt] + others[1:], cache=empty)[1:2])
        rows.append(("batch size (alone vs row 1 of 4)", ok, detail))

    # One compiled prefill program ([1, W], per-row lengths) serves the split check and the cache recompute.
    cache = warm.cache
    n = len(b_prompt)
    W = -(-max([n] + [ck.position for ck in cache.checkpoints()]) // 64) * 64

    def prefill(state, tokens):
        toks = np.zeros((1, W), np.int32)
        toks[0, :len(tokens)] = tokens
        return model.prefill_chunk(state, toks, np.array([len(tokens)], np.int32))

    if "split" in checks:
        one, logits_one = prefill(model.init_state(1, W), b_prompt)
        # on the grid; and off it where the model continues exactly (replay decode, gdn_prefill="recurrent")
        for at, name in [(64, "prefill split on the 64 grid")] + (
                [(37, "prefill split off the grid")] if model.continues_exactly else []):
            two, logits_two = prefill(prefill(model.init_state(1, W), b_prompt[:at])[0], b_prompt[at:])
            leaves_eq = all(np.array_equal(np.asarray(x), np.asarray(y))
                            for x, y in zip(jax.tree.leaves(one.layers), jax.tree.leaves(two.layers)))
            logit_eq = np.array_equal(np.asarray(logits_one)[0, n - 1], np.asarray(logits_two)[0, n - at - 1])
            rows.append((name, leaves_eq and logit_eq, f"{n} tokens in one call vs {at} + {n - at}: states equal "
                         f"{leaves_eq}, last logits equal {logit_eq}"))

    if "score" in checks and model.decode_mode == "replay":
        sc = np.array(score(model, [b_prompt + cold[0].tokens], start=n)[0], np.float32)
        gl = np.array(cold[0].logprobs, np.float32)
        rows.append(("generation == teacher-forced score", np.array_equal(sc, gl),
                     f"replay decode, {len(gl)} tokens; max diff {float(np.max(np.abs(sc - gl))):.3g}"))
    elif "score" in checks:  # recurrent decode computes other arithmetic than a prefill: equality is not promised
        rows.append(("generation == teacher-forced score", None,
                     f"not checked: {model.decode_mode} decode does not promise it (--decode-mode replay does)"))

    if "cache" not in checks:
        return rows
    try:
        check_cache(dataclasses.replace(cache, deterministic=True), model)  # structure, finite, provenance
        bad = []
        for ck in cache.checkpoints():  # bitwise equal to a fresh prefill of the prefix
            state = prefill(model.init_state(1, W), list(ck.tokens))[0]
            fresh = checkpoint_from_state(state, 0, ck.tokens)
            if not all(np.array_equal(np.asarray(x), np.asarray(y))
                       for x, y in zip(jax.tree.leaves((ck.gdn, ck.kv)), jax.tree.leaves((fresh.gdn, fresh.kv)))):
                bad.append(ck.position)
        ok = not bad
        detail = (f"{len(cache)} entries, all prefill-produced and bitwise equal to a fresh prefill" if ok else
                  f"entries at positions {bad} differ from a fresh prefill of their prefix")
    except AssertionError as e:
        ok, detail = False, str(e).strip().splitlines()[0][:160]
    rows.append(("cache entries == fresh prefill", ok, detail))
    return rows


def _check_determinism(args, out: _Outputs) -> int:
    if args.output:
        out.target(args.output)
    if args.prompt_len < 65:
        raise InputError(f"--prompt-len must be >= 65 (the checks split the prompt at 64); got {args.prompt_len}")
    if args.new_tokens < 2:
        raise InputError(f"--new-tokens must be >= 2; got {args.new_tokens}")
    if args.interval <= 0 or args.interval % 64:
        raise InputError(f"--interval must be a positive multiple of 64; got {args.interval}")
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown or not checks:
        raise InputError(f"--checks must name some of {', '.join(CHECKS)}; got {args.checks!r}")
    # the longest request: B, A's prompt + A's answer + 10 tokens, then its own answer (or a batch row of 130)
    longest = max(args.prompt_len + 2 * args.new_tokens + 10, 130 + args.new_tokens)
    if longest > _max_length(args):
        raise CapacityError(f"--prompt-len {args.prompt_len} and --new-tokens {args.new_tokens} make requests of "
                            f"{longest} tokens (prompt + 2 x new tokens + 10), past the model's capacity of "
                            f"{_max_length(args)} tokens")
    model, source = _load_model(args, deterministic=True)
    t0 = time.perf_counter()
    rows = determinism_checks(model, args.prompt_len, args.new_tokens, args.interval, args.seed, args.unsafe_cache,
                              checks)
    print(f"check-determinism: {source}, deterministic=True, decode {model.decode_mode}, "
          f"GDN prefill {model.gdn_prefill}"
          + (", UNSAFE cache (decode states admitted)" if args.unsafe_cache else "")
          + f" ({time.perf_counter() - t0:.1f} s)")
    width = max(len(r[0]) for r in rows)
    print(f"{'check':<{width}}  result  detail")
    for name, ok, detail in rows:
        print(f"{name:<{width}}  {'PASS' if ok else 'info' if ok is None else 'FAIL':<6}  {detail}")
    failed = [r[0] for r in rows if r[1] is False]
    print(f"{len(failed)} failed" + (f": {', '.join(failed)}" if failed else ""))
    if args.output:
        out.write_text(args.output, json.dumps(dict(model=args.model, decode_mode=model.decode_mode,
                                                    gdn_prefill=model.gdn_prefill, unsafe_cache=args.unsafe_cache,
                                                    checks=[dict(check=n, passed=ok, detail=d) for n, ok, d in rows]),
                                               indent=1) + "\n")
    return 1 if failed else 0


# ---- bench -----------------------------------------------------------------------------------------------------

def _bench(args, out: _Outputs) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from .generate import greedy_decode
    from .model import _prefill_jit as prefill
    from .model import jit as model_jit

    if args.output:
        out.target(args.output)
    for flag in ("batch_size", "prompt_len", "decode_steps", "repeats"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be >= 1; got {getattr(args, flag)}")
    model, source = _load_model(args)
    B, T, N = args.batch_size, args.prompt_len, args.decode_steps
    cap = -(-(T + N) // 64) * 64
    if T + N > _max_length(args):
        raise CapacityError(f"{T} prompt + {N} decode tokens exceed the capacity of {_max_length(args)} tokens "
                            f"(--max-length)")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.config.vocab_size, (B, T)), jnp.int32)
    lengths = jnp.full((B,), T, jnp.int32)
    decode_loop = model_jit(functools.partial(greedy_decode, steps=N))  # the library's compiler options

    def timed(fn):
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    t = time.perf_counter()
    state, logits = jax.block_until_ready(prefill(model, model.init_state(B, cap), tokens, lengths))
    prefill_compile = time.perf_counter() - t
    fresh = model.init_state(B, cap)
    prefill_s = timed(lambda: prefill(model, fresh, tokens, lengths))
    first = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    t = time.perf_counter()
    jax.block_until_ready(decode_loop(model, state, first))
    decode_compile = time.perf_counter() - t
    decode_s = timed(lambda: decode_loop(model, state, first))
    dev = jax.devices()[0]
    res = dict(model=args.model, device=f"{dev.platform}:{dev.device_kind}", dtype=args.dtype,
               deterministic=model.deterministic, decode_mode=model.decode_mode, gdn_prefill=model.gdn_prefill,
               batch_size=B, prompt_len=T,
               decode_steps=N, repeats=args.repeats, prefill_s=prefill_s, prefill_tokens_per_s=B * T / prefill_s,
               decode_step_ms=1e3 * decode_s / N, decode_tokens_per_s=B * N / decode_s,
               prefill_compile_s=prefill_compile, decode_compile_s=decode_compile)
    print(f"bench: {source} on {res['device']} ({args.dtype}, decode {model.decode_mode}, GDN prefill "
          f"{model.gdn_prefill}), batch {B}")
    print(f"  prefill {T} tokens/row: {1e3 * prefill_s:9.2f} ms  {res['prefill_tokens_per_s']:>12,.0f} tokens/s")
    print(f"  decode {N} steps:       {res['decode_step_ms']:9.3f} ms/step "
          f"{res['decode_tokens_per_s']:>9,.0f} tokens/s")
    print(f"  (median of {args.repeats}; compile {prefill_compile:.1f} s prefill, {decode_compile:.1f} s decode loop)")
    if args.output:
        out.write_text(args.output, json.dumps(res, indent=1) + "\n")
    return 0


# ---- the parser ------------------------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxgdn", description="Gated DeltaNet hybrid models in JAX")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="generate with the embedded tiny model and compare prefill vs decode states",
                          description="Builds the embedded tiny model from a fixed seed, generates greedily from a "
                                      "random prompt, prints tokens and logprobs, and a per-GDN-layer table comparing "
                                      "the state after one prefill with the state after prefill + decode.")
    demo.add_argument("--preset", default="tiny", choices=["tiny", "tiny-next"],
                      help="tiny: dense Qwen3.5; tiny-next: Qwen3-Next MoE (default tiny)")
    demo.add_argument("--seed", type=_seed, metavar="N", default=0, help="seed of the model and the prompt (default 0)")
    demo.add_argument("--prompt-len", type=int, metavar="N", default=100, help="random prompt length (default 100)")
    demo.add_argument("--new-tokens", type=int, metavar="N", default=40, help="tokens generated (default 40)")

    gen = sub.add_parser("generate", help="generate a completion of a prompt",
                         description="Generate a completion (text in, text out through the tokenizer; or token ids "
                                     "with --tokens). The completion goes to stdout, a summary to stderr.")
    _add_model_args(gen)
    _add_tokenizer_arg(gen)
    _add_prompt_args(gen)
    gen.add_argument("--max-new-tokens", type=int, metavar="N", default=32, help="default 32")
    gen.add_argument("--temperature", type=float, metavar="T", default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-k", type=int, metavar="K", default=None,
                     help="sample among the K most likely tokens (default: all)")
    gen.add_argument("--top-p", type=float, metavar="P", default=1.0,
                     help="nucleus sampling: the smallest set of tokens with probability >= P (default 1.0: all)")
    gen.add_argument("--seed", type=int, metavar="N", default=0, help="sampling seed (default 0)")
    stop = gen.add_mutually_exclusive_group()  # --no-stop used to win silently over --stop-token-ids
    stop.add_argument("--stop-token-ids", metavar="IDS", help="stop tokens, e.g. '1,2' (default: the tokenizer's eos)")
    stop.add_argument("--no-stop", action="store_true", help="no stop tokens")
    gen.add_argument("--max-length", type=int, metavar="N", help="capacity: prompt + new tokens (default: the model's "
                                                    f"max_position_embeddings; {PRESET_MAX_LENGTH} for presets)")
    gen.add_argument("--logprobs", action="store_true", help="also print each generated token's logprob")
    gen.add_argument("--output", type=_output_path, metavar="FILE.json",
                     help="also write tokens, logprobs and text as JSON")

    sc = sub.add_parser("score", help="per-token logprobs of a sequence (teacher forcing)",
                        description="Logprob of each token given the tokens before it, by prefill. Scores the "
                                    "sequence from --start (default 1), or only --completion given the prompt.")
    _add_model_args(sc, decode_mode=False)  # scoring is a prefill: no decode step for --decode-mode to change
    _add_tokenizer_arg(sc)
    _add_prompt_args(sc, what="sequence (or the context, with --completion)")
    comp = sc.add_mutually_exclusive_group()
    comp.add_argument("--completion", metavar="TEXT", help="score only this text, appended to the prompt")
    comp.add_argument("--completion-tokens", metavar="IDS", help="score only these token ids, appended to the prompt")
    sc.add_argument("--start", type=int, metavar="N", help="first position scored (default 1)")
    sc.add_argument("--max-length", type=int, metavar="N", help="capacity limit on the sequence length")
    sc.add_argument("--quiet", action="store_true", help="print the summary only, not the per-token table")
    sc.add_argument("--output", type=_output_path, metavar="FILE.json|FILE.csv",
                    help="also write the per-token logprobs")

    cs = sub.add_parser("compare-states", help="prefill vs decode vs split-prefill GDN states, per layer and position",
                        description="For every GDN layer and every position p of a prompt, compares the fp32 "
                                    "recurrent state reached by (a) a prefill of --decode-from tokens then recurrent "
                                    "decode and (b) a prefill split at each of --splits (on and off the 64-token "
                                    "grid) with the state of one prefill of p tokens: max and mean abs diff, "
                                    "relative diff, ULP distance, fraction bitwise equal. Writes PREFIX.csv, "
                                    "PREFIX.json and a PNG plot PREFIX.png.")
    _add_model_args(cs, deterministic=True, decode_mode=False)
    _add_tokenizer_arg(cs)
    _add_prompt_args(cs, required=False, what="prompt (default: --length random tokens)")
    cs.add_argument("--length", type=int, metavar="N",
                    help="random prompt length when no prompt is given (default 128)")
    cs.add_argument("--seed", type=_seed, metavar="N", help="seed of the random prompt (default 0)")
    cs.add_argument("--decode-from", type=int, metavar="N", default=64,
                    help="prefill this many tokens, then decode (default 64)")
    cs.add_argument("--splits", default="64,63", metavar="S,S", help="prefill split points (default 64,63)")
    cs.add_argument("--stride", type=int, metavar="N", default=1, help="compare every stride-th position (default 1)")
    cs.add_argument("--max-length", type=int, metavar="N", help="capacity limit on the prompt length")
    cs.add_argument("--output", type=_output_path, default="compare_states", metavar="PREFIX",
                    help="output files PREFIX.csv, PREFIX.json, PREFIX.png (default compare_states)")

    cd = sub.add_parser("check-determinism", help="warm-vs-cold cache, batch-size and split checks (pass/fail table)",
                        description="With deterministic=True: the same request twice; a request cold versus warm "
                                    "from a prefix cache another request filled; alone versus inside a batch of 4; "
                                    "a prompt prefilled in one call versus split on the 64 grid; every cache entry "
                                    "versus a fresh prefill. Prints a table; exits 1 if a check fails.")
    _add_model_args(cd, deterministic=False)
    cd.add_argument("--prompt-len", type=int, metavar="N", default=100,
                    help="random prompt length (>= 65; default 100)")
    cd.add_argument("--new-tokens", type=int, metavar="N", default=32, help="tokens generated per request (default 32)")
    cd.add_argument("--interval", type=int, metavar="N", default=64, help="prefix cache grid (default 64)")
    cd.add_argument("--seed", type=_seed, metavar="N", default=0, help="seed of the random prompts (default 0)")
    cd.add_argument("--unsafe-cache", action="store_true",
                    help="admit decode-produced states into the cache (what the deterministic cache refuses): "
                         "the cache check fails, and the warm-vs-cold check on prompts where the decoded states' "
                         "small gap reaches a logprob (some prompts: try a few --seed values)")
    cd.add_argument("--checks", default=",".join(CHECKS), metavar="NAMES",
                    help=f"which checks to run (default all: {','.join(CHECKS)}; score runs in replay mode only)")
    cd.add_argument("--output", type=_output_path, metavar="FILE.json", help="also write the table as JSON")

    be = sub.add_parser("bench", help="prefill and decode tokens/s on the current device",
                        description="Times one prefill of --prompt-len tokens per row and a compiled loop of "
                                    "--decode-steps decode steps (median of --repeats runs, after a compiling run).")
    _add_model_args(be)
    be.add_argument("--batch-size", type=int, metavar="N", default=1, help="rows per call (default 1)")
    be.add_argument("--prompt-len", type=int, metavar="N", default=128, help="prompt tokens per row (default 128)")
    be.add_argument("--decode-steps", type=int, metavar="N", default=32,
                    help="decode steps in the compiled loop (default 32)")
    be.add_argument("--repeats", type=int, metavar="N", default=3,
                    help="timed runs; the median is reported (default 3)")
    be.add_argument("--max-length", type=int, metavar="N", help="capacity limit on prompt + decode tokens")
    be.add_argument("--output", type=_output_path, metavar="FILE.json", help="also write the results as JSON")
    return parser


_COMMANDS = {"generate": _generate, "score": _score, "compare-states": _compare_states,
             "check-determinism": _check_determinism, "bench": _bench}


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    out = _Outputs()
    try:
        if args.command == "demo":
            if args.prompt_len < 1 or args.new_tokens < 1:
                raise JaxGDNError("--prompt-len and --new-tokens must be >= 1")
            if args.prompt_len + args.new_tokens > PRESET_MAX_LENGTH:  # (it ran out of memory, or ran for hours)
                raise CapacityError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} exceed the "
                                    f"preset's capacity of {PRESET_MAX_LENGTH} tokens")
            rc = _demo(args)
        else:
            with compile_cache(getattr(args, "compile_cache", None), label="--compile-cache"):
                rc = _COMMANDS[args.command](args, out)
        sys.stdout.flush()  # a closed stdout shows here, not in the interpreter's exit flush (a message, status 120)
        out.commit()
        return rc
    except JaxGDNError as e:
        print(f"jaxgdn: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed early (`jaxgdn score ... | head`): stop quietly, as a Unix filter does
        with contextlib.suppress(OSError):  # (and keep the interpreter's exit flush from failing on it again)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # what a shell reports for a process SIGPIPE ended
    except OSError as e:
        print(f"jaxgdn: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxgdn: interrupted", file=sys.stderr)
        return 130
    finally:
        out.discard()


if __name__ == "__main__":
    sys.exit(main())
