"""Command line: `jaxgdn demo` (more commands arrive with the generation-engine issue)."""

from __future__ import annotations

import argparse
import sys

from .errors import JaxGDNError


def _demo(args) -> int:
    import jax.numpy as jnp
    import numpy as np

    from .compare import compare_gdn_states, format_table
    from .generate import generate
    from .presets import tiny_model

    model = tiny_model(args.preset, seed=args.seed)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxgdn", description="Gated DeltaNet hybrid models in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="generate with the embedded tiny model and compare prefill vs decode states",
                          description="Builds the embedded tiny model from a fixed seed, generates greedily from a "
                                      "random prompt, prints tokens and logprobs, and a per-GDN-layer table comparing "
                                      "the state after one prefill with the state after prefill + decode.")
    demo.add_argument("--preset", default="tiny", choices=["tiny", "tiny-next"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--prompt-len", type=int, default=100)
    demo.add_argument("--new-tokens", type=int, default=40)
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            if args.prompt_len < 1 or args.new_tokens < 1:
                raise JaxGDNError("--prompt-len and --new-tokens must be >= 1")
            return _demo(args)
    except JaxGDNError as e:
        print(f"jaxgdn: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
