"""How the prefill/decode state gap grows with sequence length.

For each length L: the fp32 GDN recurrent state after a prefill of `--prefix` tokens followed by L - prefix
recurrent decode steps, against the state after one prefill of L tokens (same tokens), per GDN layer; and the
gap in the logits at position L - 1. Writes PREFIX.csv and PREFIX.png.

    .venv/bin/python scripts/state_gap_study.py                         # tiny model, L = 64 .. 1024
    .venv/bin/python scripts/state_gap_study.py --model path/to/Qwen3.5-9B --lengths 256,1024,4096 --dtype bfloat16

It uses the public API (model.prefill_chunk, model.decode_step, jaxgdn.compare.diff_arrays) and
jaxgdn.model.gdn_states (the GDN layers' states of a model state): a template for other numerical studies.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without `pip install -e .`
import jaxgdn  # noqa: E402
from jaxgdn.compare import diff_arrays  # noqa: E402
from jaxgdn.model import gdn_states  # noqa: E402


def load(model: str, seed: int, dtype, deterministic: bool) -> jaxgdn.Model:
    if model in ("tiny", "tiny-next") and not os.path.isdir(model):
        return jaxgdn.tiny_model(model, seed=seed, dtype=dtype, deterministic=deterministic)
    return jaxgdn.load_pretrained(model, dtype=dtype, deterministic=deterministic)


def study(model: jaxgdn.Model, lengths: list[int], prefix: int, seed: int = 0) -> list[dict]:
    """Rows: length, layer, rel, max_abs, mean_abs, max_ulp, frac_equal, logit_max_abs (one per length and layer)."""
    lengths = sorted(lengths)
    top = lengths[-1]
    width = -(-top // 64) * 64
    tokens = np.random.default_rng(seed).integers(0, model.config.vocab_size, top).astype(np.int32)
    padded = np.zeros((len(lengths), width), np.int32)
    padded[:, :top] = tokens

    # Reference: one prefill of L tokens for every L, as rows of one batch (per-row lengths).
    ref, ref_logits = model.prefill_chunk(model.init_state(len(lengths), width), padded,
                                          np.array(lengths, np.int32))
    ref_rec = [np.asarray(s.recurrent) for s in gdn_states(ref)]
    ref_logits = np.asarray(ref_logits)

    # Prefill `prefix` tokens, then decode one token at a time, stopping at each L.
    state = model.init_state(1, width)
    if prefix:
        state, _ = model.prefill_chunk(state, padded[:1], np.array([prefix], np.int32))
    rows, pos, logits = [], prefix, None
    for i, L in enumerate(lengths):
        while pos < L:
            state, logits = model.decode_step(state, jnp.asarray(tokens[pos:pos + 1]))
            pos += 1
        logit_gap = float(np.max(np.abs(np.asarray(logits)[0] - ref_logits[i, L - 1])))
        for layer, s, r in zip(model.config.gdn_layers, gdn_states(state), ref_rec):
            d = diff_arrays(np.asarray(s.recurrent)[0], r[i], layer)
            rows.append(dict(length=L, layer=layer, rel=d.rel, max_abs=d.max_abs, mean_abs=d.mean_abs,
                             max_ulp=d.max_ulp, frac_equal=d.frac_equal, logit_max_abs=logit_gap))
    return rows


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    for layer in sorted({r["layer"] for r in rows}):
        rs = [r for r in rows if r["layer"] == layer]
        ax1.plot([r["length"] for r in rs], [r["rel"] or np.nan for r in rs], marker="o", label=f"GDN layer {layer}")
    rs = [r for r in rows if r["layer"] == rows[0]["layer"]]
    ax2.plot([r["length"] for r in rs], [r["logit_max_abs"] or np.nan for r in rs], marker="o", color="k")
    ax1.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="state rel. diff ||a-b|| / ||b||",
            title="recurrent state: prefill+decode vs prefill")
    ax2.set(xscale="log", yscale="log", xlabel="sequence length L", ylabel="max |logit diff| at position L-1",
            title="logits")
    ax1.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=10)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    os.replace(tmp, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="checkpoint directory, or preset tiny / tiny-next (default tiny)")
    ap.add_argument("--model-seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--lengths", default="64,128,256,512,1024", help="sequence lengths (default 64,...,1024)")
    ap.add_argument("--prefix", type=int, default=1, help="tokens prefilled before decoding starts (default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random tokens")
    ap.add_argument("--output", default="state_gap", help="output prefix: PREFIX.csv, PREFIX.png")
    args = ap.parse_args(argv)
    try:
        lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--lengths must be integers separated by commas; got {args.lengths!r}")
    if not lengths or args.prefix < 0 or lengths[0] <= args.prefix:
        ap.error(f"every length must exceed --prefix ({args.prefix}); got {lengths}")
    out = Path(args.output)
    if not out.parent.is_dir():
        ap.error(f"output directory {out.parent} does not exist")
    try:
        model = load(args.model, args.model_seed, getattr(jnp, args.dtype), args.deterministic)
        t0 = time.perf_counter()
        rows = study(model, lengths, args.prefix, args.seed)
    except jaxgdn.JaxGDNError as e:
        print(f"state_gap_study: error: {e}", file=sys.stderr)
        return 2
    print(f"{'L':>6} {'layer':>5} {'rel diff':>10} {'max abs':>10} {'max ULP':>9} {'bitwise eq':>10} {'logit gap':>10}")
    for r in rows:
        print(f"{r['length']:>6} {r['layer']:>5} {r['rel']:>10.3e} {r['max_abs']:>10.3e} {r['max_ulp']:>9} "
              f"{r['frac_equal']:>10.1%} {r['logit_max_abs']:>10.3e}")
    csv_path, png_path = out.with_name(out.name + ".csv"), out.with_name(out.name + ".png")
    tmp = csv_path.with_name(f".{csv_path.name}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, csv_path)
    plot(rows, f"{args.model}: prefill {args.prefix} token(s), then recurrent decode to L, vs one prefill of L",
         png_path)
    print(f"wrote {csv_path} and {png_path} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
