"""What a prefix cache holds after `generate` on a long prompt: its entries, the bytes it counts (`PrefixCache.nbytes`:
GDN states, and the key/value blocks its checkpoints share, once), what the same checkpoints would hold each with its
own copy of its prefix's keys and values (the sum of `Checkpoint.nbytes`: what the cache held before 2026-12-05),
and the device's memory in use (`memory_stats`), for a cold request and for a longer one restored from its cache.

Run on the GPU machine from the repo root:
  PYTHONPATH=. python3 scripts/gpu_cache_memory.py --out $OUT [--preset qwen3.5-9b --layers 8 --prompt 16384]
On CPU (`--preset tiny --prompt 2048 --interval 64`) it checks the same things at a small size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import jaxgdn  # noqa: E402
from jaxgdn.shapes import next_pow2  # noqa: E402
from gpu_model_bench import build  # noqa: E402

GiB = 2.0**30


def in_use() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use", float("nan")) / GiB


def peak() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / GiB


def report(tag: str, cache: jaxgdn.PrefixCache, cached_tokens: int) -> dict:
    cks = cache.checkpoints()
    own = sum(c.nbytes for c in cks)
    gdn = sum(x.nbytes for c in cks for x in jax.tree.leaves(c.gdn))
    row = dict(tag=tag, entries=len(cks), positions=[min(c.position for c in cks), max(c.position for c in cks)],
               cached_tokens=cached_tokens, cache_nbytes=cache.nbytes, gdn_bytes=gdn, own_copies_bytes=own,
               device_in_use_gib=in_use(), device_peak_gib=peak())
    print(f"{tag}: {len(cks)} entries (positions {row['positions'][0]}..{row['positions'][1]}), restored "
          f"{cached_tokens} tokens; cache.nbytes {cache.nbytes / GiB:.4f} GiB (GDN states {gdn / GiB:.4f}, keys/values "
          f"{(cache.nbytes - gdn) / GiB:.4f}); each with its own copy {own / GiB:.4f} GiB; device in use "
          f"{row['device_in_use_gib']:.3f} GiB, peak {row['device_peak_gib']:.3f} GiB", flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3.5-9b")
    ap.add_argument("--layers", type=int, default=8, help="the first N layers (8: 6 GDN and 2 attention layers)")
    ap.add_argument("--prompt", type=int, default=16384)
    ap.add_argument("--extra", type=int, default=1024, help="tokens the second request adds to the first's")
    ap.add_argument("--interval", type=int, default=256)
    ap.add_argument("--restore-rows", type=int, default=16, help="the batch whose restore from the cache is timed")
    ap.add_argument("--profile", action="store_true", help="print where one restore spends its host time")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__, datetime.datetime.now(datetime.timezone.utc).isoformat())
    if args.preset in ("tiny", "tiny-next"):
        model = jaxgdn.tiny_model(args.preset, seed=0, deterministic=True)
    else:
        model = build(args.preset, args.layers).with_deterministic(True)
    cfg = model.config
    print(f"{args.preset}, {len(cfg.layer_types)} layers ({len(cfg.gdn_layers)} GDN, {len(cfg.attention_layers)} "
          f"attention), prompt {args.prompt} tokens, interval {args.interval}; device in use {in_use():.3f} GiB")
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, cfg.vocab_size, args.prompt).tolist()
    empty = jaxgdn.PrefixCache(interval=args.interval)
    first = jaxgdn.generate(model, [prompt], max_new_tokens=1, cache=empty)
    rows = [report("cold", first.cache, first[0].cached_tokens)]
    longer = prompt + first[0].tokens + rng.integers(0, cfg.vocab_size, args.extra).tolist()
    second = jaxgdn.generate(model, [longer], max_new_tokens=1, cache=first.cache)
    rows.append(report("warm, longer", second.cache, second[0].cached_tokens))
    cold = jaxgdn.generate(model, [longer], max_new_tokens=1, cache=empty)
    same = second[0].tokens == cold[0].tokens and np.array_equal(second[0].logprobs, cold[0].logprobs)
    print(f"[{'PASS' if same else 'FAIL'}] the warm longer request == the same request cold (tokens, logprobs bitwise)")
    restore = time_restore(model, second.cache, longer, args.restore_rows, profile=args.profile)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cache_memory.json"), "w") as f:
        json.dump(dict(args=vars(args), rows=rows, warm_equals_cold=bool(same), restore=restore), f, indent=1)
    return 0 if same and restore["equal"] else 1


def _rowwise(template, hits):
    """`state_from_checkpoints`'s writes as they were before 2026-12-05 (for the timing only): `.at[b].set` per
    restored row and leaf, each attention row from the checkpoint's concatenated key/value blocks."""
    layers = list(template.layers)
    gdn_ids = [i for i, s in enumerate(layers) if isinstance(s, jaxgdn.GDNLayerState)]
    attn_ids = [i for i, s in enumerate(layers) if isinstance(s, jaxgdn.AttentionLayerState)]
    for b, ck in enumerate(hits):
        if ck is None:
            continue
        for i, g in zip(gdn_ids, ck.gdn):
            layers[i] = layers[i]._replace(**{n: getattr(layers[i], n).at[b].set(r) for n, r in g._asdict().items()
                                              if r is not None})
        for i, kv in zip(attn_ids, ck.kv):
            layers[i] = jaxgdn.AttentionLayerState(keys=layers[i].keys.at[b, :ck.position].set(kv.keys),
                                                   values=layers[i].values.at[b, :ck.position].set(kv.values))
    return layers


def time_restore(model, cache, prompt, rows: int, reps: int = 6, profile: bool = False) -> dict:
    """Median seconds to restore a batch of `rows` rows, every other one from the cache's longest checkpoint of
    `prompt` (`generate`'s first step on a warm batch), by `state_from_checkpoints` and by the old row-by-row writes
    (the first call apart: it compiles what the pattern needs); whether the two give the same arrays; with `profile`,
    where one call of `state_from_checkpoints` spends its host time."""
    import time

    from jaxgdn.cache import state_from_checkpoints

    hit, _ = cache.lookup([prompt])
    hits = [hit[0] if b % 2 == 0 else None for b in range(rows)]
    capacity = next_pow2(len(prompt))
    out = {}
    for name, fn in (("state_from_checkpoints", lambda t: state_from_checkpoints(t, hits).layers),
                     ("row by row (before)", lambda t: _rowwise(t, hits))):
        times = []
        for _ in range(reps):
            layers = template = None  # (the previous repetition's arrays go before the next are made)
            template = jax.block_until_ready(model.init_state(rows, capacity))
            t0 = time.perf_counter()
            layers = jax.block_until_ready(fn(template))
            times.append(time.perf_counter() - t0)
        del template
        out[name] = float(np.median(times[1:]))
        out[name + " first"] = times[0]
        out[name + " peak GiB"] = peak()
        print(f"restore {rows} rows (every other from the {hit[0].position}-token checkpoint, capacity {capacity}): "
              f"{name} {out[name] * 1e3:.2f} ms (median of {reps - 1} after a first call of {times[0] * 1e3:.1f} "
              f"ms)", flush=True)
        out.setdefault("layers", []).append(layers)
    if profile:
        import cProfile
        import io
        import pstats

        template = jax.block_until_ready(model.init_state(rows, capacity))
        prof = cProfile.Profile()
        prof.runcall(lambda: jax.block_until_ready(state_from_checkpoints(template, hits)))
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        print(text.getvalue()[-3000:], flush=True)
    a, b = out.pop("layers")
    out["equal"] = all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    print(f"[{'PASS' if out['equal'] else 'FAIL'}] the two restores give the same arrays", flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
