"""Registers, spills, shared memory, transposed shared-memory copies, dot instructions (wgmma or not) and layout
conversions of the chunked prefill's kernels (or, with --replay, the replay step's) for the H200, on a CPU machine.

  .venv/bin/pip install triton==3.6.0        # once: Triton's compiler and its bundled ptxas (no GPU needed)
  PYTHONPATH=. .venv/bin/python scripts/ptxas_report.py [--shape 8,4096,16,32] [--config '{"warps_prep": 8}']
  PYTHONPATH=. .venv/bin/python scripts/ptxas_report.py --replay --shape 64,64,16,32   # the replay step's kernels
  PYTHONPATH=. .venv/bin/python scripts/ptxas_report.py --shape 1,128,2,4 --dims 16,16  # other head sizes (K, V)
  ... --dump DIR     # also each kernel's TTGIR and PTX as DIR/NAME.ttgir, .ptx (to compare two kernels' code; the
                     # SASS: ptxas -arch=sm_90a NAME.ptx -o NAME.cubin, then nvdisasm, both beside Triton's ptxas)
  ... --lines NAME [--top 30]   # one kernel's SASS instructions by the Python source line they come from, per
                                # straight-line region of its code (e.g. `--replay --lines gdn_replay_prep`: regions
                                # 0-3 are kernel 1's block-row branches 0-3)

Each kernel is lowered to Triton IR for an abstract H200 (as `tests/pallas_kernels/test_cuda_lowering.py` does),
compiled for sm_90a by PyPI's Triton with the kernel's num_warps / num_stages, and its PTX assembled by `ptxas -v`.
A screen before spending GPU time, not the GPU's numbers: XLA compiles the same IR with its own Triton build. Here
against Nsight Compute on the H200 (2026-11-30, default configuration, (8, 4096, 16, 32), here / there): registers
per thread 255 / 255 (prep), 255 / 236 (recurrence), 255 / 255 (output); shared memory 74 / 16 KiB, 48 / 32 KiB,
96 / 96 KiB. Its spill bytes separated the prep variants that spilled and were slow (two value heads per program,
the fused design's prep, the loop-free diagonal inverse, 2 warps) from the default; a variant slow for other reasons
(`lean`, whose reloads cost more than its 100 B of spills) it does not flag (BENCHMARKS.md, runs 27-31).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import jax.numpy as jnp

from pallas_kernels.gated_delta import chunk, replay
from tests.pallas_kernels.test_cuda_lowering import chunk_args, lower_for_h200


def launch(cfg: dict) -> dict:
    """(num_warps, num_stages) of each chunked-prefill kernel, by the name its pallas_call gives it."""
    return {"gdn_chunk_prep": (cfg["warps_prep"], cfg["stages_prep"]),
            "gdn_chunk_inverse": (cfg["warps_prep"], cfg["stages_prep"]),
            "gdn_chunk_apply": (cfg["warps_apply"], 1),
            "gdn_chunk_state": (cfg["warps_state"], cfg["stages_state"]),
            "gdn_chunk_out": (cfg["warps_out"], cfg["stages_out"]),
            # the replay step's kernels (`replay._launch_warps`; each with one stage)
            **{f"gdn_replay_{n}": (w, 1) for n, w in zip(("prep", "intra", "out"), replay._launch_warps(cfg))},
            "gdn_replay_state": (cfg["warps_state"], 1)}


def _triton_compiled(ttir: str, folder: str, num_warps: int, num_stages: int):
    """Triton IR text compiled by PyPI's Triton for sm_90a (the IR written to folder/kernel.ttir first)."""
    import triton
    from triton.backends.compiler import GPUTarget

    src = os.path.join(folder, "kernel.ttir")
    with open(src, "w") as fh:
        fh.write(ttir)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                               num_stages=num_stages))


def ptxas_report(ttir: str, num_warps: int, num_stages: int, dump: str = "") -> dict:
    """Compile Triton IR text for sm_90a; ptxas's register, spill and stack figures, Triton's shared memory, and how
    many tensors the kernel writes into shared memory transposed (`transposed = true` layouts: a dot operand stored in
    the other major order than its MMA reads it, the output kernel's bank conflicts in run 30), and how many dots
    became Hopper wgmma (`ttng.warp_group_dot`) or stayed `tt.dot` (mma.sync — an MMA of fewer than 64 rows per warp
    group — or, for ieee-precision dots, FMA loops): different instructions, so a dot that changes kind between
    configurations changes its bits (run 33: mma.sync and wgmma disagree)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        k = _triton_compiled(ttir, d, num_warps, num_stages)
        ptx = k.asm["ptx"]
        ttgir = k.asm["ttgir"]
        if dump:  # the compiled forms, to compare two kernels' instructions (e.g. one dot's layout in each)
            for ext in ("ttgir", "ptx"):
                with open(f"{dump}.{ext}", "w") as fh:
                    fh.write(k.asm[ext])
        transposed = {m.group(1) for m in re.finditer(r"^(#shared\d*) = .*transposed = true", ttgir, re.M)}
        t_allocs = sum(1 for line in ttgir.splitlines() if "ttg.local_alloc" in line
                       and any(re.search(rf"{re.escape(t)}\b", line) for t in transposed))
        wgmma = len(re.findall(r"ttng\.warp_group_dot ", ttgir))
        mma = len(re.findall(r"= tt\.dot ", ttgir))
        converts = len(re.findall(r"ttg\.convert_layout ", ttgir))
        arch = re.search(r"\.target (\S+)", ptx).group(1)
        with open(os.path.join(d, "kernel.ptx"), "w") as fh:
            fh.write(ptx)
        run = subprocess.run([ptxas, f"-arch={arch}", "-v", os.path.join(d, "kernel.ptx"), "-o",
                              os.path.join(d, "kernel.cubin")], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"ptxas failed ({run.returncode}):\n{run.stderr}")
    text = run.stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else 0  # noqa: E731
    return dict(registers=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"),
                shared_bytes=k.metadata.shared, transposed_allocs=t_allocs, wgmma=wgmma, mma=mma,
                converts=converts)


def _resolved_locations(ttir: str) -> dict[str, str]:
    """#locN -> its definition's text, from Triton IR printed with debug info."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^(#loc\d*) = loc\((.*)\)\s*$", ttir, re.M)}


def _source_chain(loc: str, defs: dict[str, str], depth: int = 0) -> list[str]:
    """A location as ["file.py:line", its caller, ...] (innermost first); [] where unknown."""
    loc = loc.strip()
    if depth > 64:
        return []
    if re.fullmatch(r"#loc\d*", loc):
        return _source_chain(defs.get(loc, "unknown"), defs, depth + 1)
    if m := re.match(r'"([^"]+)":(\d+):\d+', loc):
        return [f"{os.path.basename(m.group(1))}:{m.group(2)}"]
    if m := re.fullmatch(r"callsite\((#loc\d*) at (#loc\d*)\)", loc):
        return _source_chain(m.group(1), defs, depth + 1) + _source_chain(m.group(2), defs, depth + 1)
    if m := re.fullmatch(r'"[^"]*"\((#loc\d*)\)', loc):
        return _source_chain(m.group(1), defs, depth + 1)
    return []


def source_lines_report(ttir: str, num_warps: int, num_stages: int, top: int) -> None:
    """Print one kernel's SASS instructions (per warp, as compiled by PyPI's Triton and ptxas) counted by the Python
    source line they come from: Triton IR with JAX's source locations is compiled with Triton's IR locations on
    (USE_IR_LOC), so the SASS line table points at IR lines, whose `loc` names the Python call chain. The code is
    split into straight-line regions at its branch labels; each region's instruction mix, then its top source lines
    (innermost frame first, up to three frames). ptxas's line table for optimised code is approximate (instructions
    merged or moved keep one line), so the per-line counts are a map of the code, not exact costs."""
    import collections

    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    defs = _resolved_locations(ttir)
    ir_lines = ttir.splitlines()
    old = os.environ.get("USE_IR_LOC")
    os.environ["USE_IR_LOC"] = "ttir"
    try:
        with tempfile.TemporaryDirectory() as d:
            k = _triton_compiled(ttir, d, num_warps, num_stages)
            ptx, cubin = os.path.join(d, "kernel.ptx"), os.path.join(d, "kernel.cubin")
            with open(ptx, "w") as fh:
                fh.write(k.asm["ptx"])
            arch = re.search(r"\.target (\S+)", k.asm["ptx"]).group(1)
            subprocess.run([os.path.join(bin_dir, "ptxas"), f"-arch={arch}", "-lineinfo", ptx, "-o", cubin],
                           check=True, capture_output=True)
            sass = subprocess.run([os.path.join(bin_dir, "nvdisasm"), "-c", "-g", cubin], check=True,
                                  capture_output=True, text=True).stdout
    finally:
        if old is None:
            os.environ.pop("USE_IR_LOC", None)
        else:
            os.environ["USE_IR_LOC"] = old
    regions, line = [[]], None
    for text in sass.splitlines():
        if m := re.search(r'//## File ".*", line (\d+)', text):
            line = int(m.group(1))
        elif re.match(r"^\.L_x_\d+:", text):
            regions.append([])
        elif m := re.match(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", text):
            ir = ir_lines[line - 1] if line and line <= len(ir_lines) else ""
            loc = re.search(r"loc\((#loc\d*)\)\s*$", ir)
            chain = _source_chain(loc.group(1), defs) if loc else []
            regions[-1].append((m.group(1), " <- ".join(chain[:3]) or "(no source line)"))
    kinds = ("HMMA", "BAR", "LDG", "STS", "LDS", "LDSM", "SHFL", "MUFU")
    for i, region in enumerate(regions):
        if not region:  # a label right after a branch: numbered, not printed
            continue
        ops = collections.Counter(op for op, _ in region)
        print(f"  region {i}: {len(region)} instructions; " + ", ".join(f"{o} {ops[o]}" for o in kinds))
    for i, region in enumerate(regions):
        if len(region) < 50:
            continue
        by_line = collections.Counter(where for _, where in region)
        ops = collections.defaultdict(collections.Counter)
        for op, where in region:
            ops[where][op] += 1
        print(f"\n  region {i}, top {top} source lines (instructions, then the five commonest opcodes):")
        for where, n in by_line.most_common(top):
            mix = " ".join(f"{o} {c}" for o, c in ops[where].most_common(5))
            print(f"    {n:5d}  {where:75s} {mix}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,4096,16,32", help="B,T,HK,HV (bf16 inputs)")
    ap.add_argument("--dims", default="128,128", help="K,V: the key and value head sizes")
    ap.add_argument("--config", default="", help="JSON: chunk.DEFAULT_CONFIG keys to override")
    ap.add_argument("--replay", action="store_true", help="the replay step's kernels (B from --shape) instead")
    ap.add_argument("--dump", default="", help="a folder: write each kernel's TTGIR and PTX there (NAME.ttgir, .ptx)")
    ap.add_argument("--lines", default="", help="a kernel's name: its SASS instructions by Python source line")
    ap.add_argument("--top", type=int, default=30, help="--lines: source lines shown per region")
    args = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("needs Triton's compiler: .venv/bin/pip install triton==3.6.0")
    B, T, HK, HV = (int(x) for x in args.shape.split(","))
    K, V = (int(x) for x in args.dims.split(","))
    config = json.loads(args.config) if args.config else None
    cfg = chunk._recurrence_blocks(chunk._checked_config(config, V), config, B, HV, V, False)
    if args.replay:  # one decode step over open chunks of B rows
        q, k, v, g, b, s0, n = chunk_args(B, 64, HK, HV, K, V, jnp.bfloat16)
        xc, vc = replay.replay_caches(B, HV, V)
        _, modules = lower_for_h200(lambda *a: replay.chunk_replay_step_pallas(*a, config=config),
                                    q, k, v, g, b, s0, xc, vc, n)
    else:
        f = lambda q, k, v, g, b, s0, n: chunk.chunk_gated_delta_rule_pallas(  # noqa: E731
            q, k, v, g, b, initial_state=s0, lengths=n, config=config)
        _, modules = lower_for_h200(f, *chunk_args(B, T, HK, HV, K, V, jnp.bfloat16))
    print(f"shape {args.shape}, K, V {K}, {V}, config {config or 'default'}")
    names = [m.operation.attributes["sym_name"].value for m in modules]
    if args.lines and args.lines not in names:
        raise SystemExit(f"--lines {args.lines}: no such kernel here; these are: {', '.join(names)}")
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for module in modules:
        name = module.operation.attributes["sym_name"].value
        warps, stages = launch(cfg)[name]
        if args.lines:
            if name == args.lines:
                print(f"  {name}: SASS instructions per warp by source line")
                source_lines_report(module.operation.get_asm(enable_debug_info=True), warps, stages, args.top)
            continue
        r = ptxas_report(module.operation.get_asm(enable_debug_info=False), warps, stages,
                         dump=os.path.join(args.dump, name) if args.dump else "")
        print(f"  {name:18s} warps {warps} stages {stages}: {r['registers']} registers, spills "
              f"{r['spill_stores']} B stored / {r['spill_loads']} B loaded, stack {r['stack']} B, "
              f"shared {r['shared_bytes'] / 1024:.1f} KiB, {r['transposed_allocs']} transposed shared-memory copies, "
              f"dots: {r['wgmma']} wgmma + {r['mma']} other (mma.sync or FMA), {r['converts']} layout conversions")


if __name__ == "__main__":
    main()
