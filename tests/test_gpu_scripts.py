"""The GPU scripts' plumbing on CPU, so that a device call is not spent on a script bug: name checks happen before
any device work, and the profiling stages added for the H200 runs write what BENCHMARKS.md reads from them."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path, extra_env=None, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(extra_env or {}))
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _main_exits(script, argv, tmp_path, monkeypatch, capsys):
    """scripts/`script` run as `__main__` in this process with `argv` (its imports are this process's already: a
    subprocess each cost ~2.5 s of CI), in `tmp_path`, the environment variables scripts set at import put back; it
    must exit. Returns (the exit code, what it said: stderr and a SystemExit message)."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / script), run_name="__main__")
    code = exit_.value.code
    return code, capsys.readouterr().err + ("" if code is None or isinstance(code, int) else str(code))


@pytest.mark.parametrize("script,flag,bad,known", [
    ("gpu_kernels.py", "--only", "accuracy,bitwse", "unknown sections ['bitwse']"),
    ("gpu_kernels.py", "--skip", "sweeep", "unknown sections ['sweeep']"),
    ("gpu_model_bench.py", "--stages", "prefill,prefil", "unknown stages ['prefil']"),
    ("gpu_kernels.py", "--replay-dims", "16,16;64", "expected K,V pairs"),
    ("gpu_kernels.py", "--prefill-shapes", "1,32768,16", "expected B,T,HK,HV groups"),
    ("gpu_kernels.py", "--chunk-checks", "split,small-grid", "--chunk-checks: unknown ['small-grid']"),
    ("gpu_prep_ablate.py", "--variants", "as_built,no_subst", "--variants: unknown ['no_subst']"),
    ("gpu_prep_ablate.py", "--config", "warps_prep=8", "--config 'warps_prep=8': expected a JSON object"),
    ("gpu_mgpu_recurrence.py", "--shapes", "2,300,2,4;1,64", "expected B,T,HK,HV groups"),
    ("gpu_mgpu_output.py", "--shapes", "2,300,2", "expected B,T,HK,HV groups"),
    ("gpu_mgpu_output.py", "--orders", "h_acc,sum", "expected a comma list of"),
    ("gpu_kernels.py", "--chunk-config", '{"outptu": "mosaic"}', "unknown keys ['outptu']"),
    ("gpu_kernels.py", "--replay-configs", "default,group4", "--replay-configs: unknown ['group4']"),
    ("gpu_kernels.py", "--replay-schedules", "default,concurent", "--replay-schedules: unknown ['concurent']"),
    ("replay_branch_latency.py", "--config", "[1]", "--config '[1]': expected a JSON object"),
    ("replay_branch_latency.py", "--batches", "4,x", "--batches '4,x': expected a comma list of integers"),
    ("gpu_model_bench.py", "--chunk-config", "output=mosaic", "--chunk-config: not JSON"),
    ("gpu_model_bench.py", "--matmul-config", "[1]", "--matmul-config: expected a JSON dict"),
    ("gpu_model_bench.py", "--context", "32", "--phases mixed needs --context >= 64"),
    ("gpu_model_bench.py", "--ragged-batch", "0", "--ragged-batch and --ragged-tokens must be positive"),
    ("gpu_compile_times.py", "--layers", "4,x", "--layers must be a comma list of integers"),
    ("gpu_compile_times.py", "--layers", "4,33", "--layers must name layer counts from 1 to the preset's 32"),
    ("gpu_compile_times.py", "--order", "generate,prefill", "--order must name prefill, decode, generate once each"),
    ("gpu_prefill_configs.py", "--timing-shapes", "8,4096,16,30", "--timing-shapes '8,4096,16,30': shapes B,T,HK,HV"),
])
def test_unknown_names_are_refused_before_device_work(tmp_path, script, flag, bad, known, monkeypatch, capsys):
    """The script (run as `__main__` in this process: `_main_exits`) exits with an error naming what it refuses and
    writes nothing."""
    more = ["--configs", '{"a": {}, "b": {}}'] if script == "gpu_prefill_configs.py" else []
    code, said = _main_exits(script, [flag, bad, *more, "--out", str(tmp_path)], tmp_path, monkeypatch, capsys)
    assert code not in (0, None) and known in said, said[-2000:]
    assert not any((tmp_path / name).exists() for name in ("model_bench.json", "results.json", "compile_times.json",
                                                               "branch_latency.json"))


def test_compile_times_script(tmp_path, monkeypatch):
    """scripts/gpu_compile_times.py in this process at the tiny preset's first one and two layers: every entry point's
    first call (its compile included) and warm call recorded, the first the longer; prefill's and decode's trace,
    lower and compile times recorded, the compile longer than a warm call."""
    from scripts import gpu_compile_times

    monkeypatch.setattr(sys, "argv", ["gpu_compile_times.py", "--preset", "tiny", "--layers", "1,2",
                                      "--prefill-tokens", "64", "--decode-batch", "2", "--prompt-tokens", "10",
                                      "--new-tokens", "2", "--out", str(tmp_path / "new")])
    gpu_compile_times.main()
    res = json.loads((tmp_path / "new" / "compile_times.json").read_text())
    assert res["meta"]["device"] == "cpu" and set(res["by_layers"]) == {"1", "2"}
    for by_name in res["by_layers"].values():
        assert set(by_name) == {"prefill", "decode", "generate"}
        assert all(t["first_s"] > t["warm_s"] > 0 for t in by_name.values()), by_name
        for name in ("prefill", "decode"):
            t = by_name[name]
            assert t["trace_s"] > 0 and t["lower_s"] > 0 and t["compile_s"] > t["warm_s"], t
        assert "trace_s" not in by_name["generate"]


def test_compile_times_script_fills_a_compile_cache(tmp_path):
    """--compile-cache DIR (a subprocess: JAX's cache settings are the process's): the programs land in DIR, and the
    JSON records the directory and that it was empty before; --order sets the order of the first calls; --names-check
    finds the prefill's arrays equal with and without stable kernel names (on a CPU no Mosaic GPU kernel is lowered:
    the plumbing, and that the context changes nothing else). A second process calling in the other order finds
    every entry point's program in DIR: what it adds are small eager programs (random inputs, casts) that the
    first process compiled in its --names-check, before the cache was open (run 191's "19 -> 30 entries")."""
    cache = tmp_path / "xla"
    args = [str(ROOT / "scripts" / "gpu_compile_times.py"), "--preset", "tiny", "--layers", "1", "--prefill-tokens",
            "64", "--decode-batch", "2", "--prompt-tokens", "10", "--new-tokens", "2", "--compile-cache", str(cache)]
    r = _run(args + ["--order", "generate,decode,prefill", "--names-check", "--out", str(tmp_path)], tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    res = json.loads((tmp_path / "compile_times.json").read_text())
    meta = res["meta"]
    assert meta["compile_cache"] == str(cache) and meta["cache_entries_before"] == 0
    assert list(res["by_layers"]["1"]) == ["generate", "decode", "prefill"]  # --order: the order they were called in
    assert len(list(cache.iterdir())) >= 3  # prefill, decode and generate's programs at least
    assert res["names_check"]["equal"] is True and res["names_check"]["arrays"] >= 2

    entry_points = ("jit_prefill_chunk-", "jit_decode_step-", "jit__generate_core-", "jit__prefill_core-")
    first = {p.name for p in cache.iterdir()}
    assert all(any(name.startswith(e) for name in first) for e in entry_points), sorted(first)
    r = _run(args + ["--order", "prefill,decode,generate", "--out", str(tmp_path / "second")], tmp_path)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    added = {p.name for p in cache.iterdir()} - first
    assert not [name for name in added if name.startswith(entry_points)], sorted(added)


@pytest.fixture(scope="module")
def model_bench(tmp_path_factory):
    """One run of scripts/gpu_model_bench.py at the tiny preset through the stages the tests below read (one process:
    four took ~3x its time in CI): (the run, its model_bench.json)."""
    out = tmp_path_factory.mktemp("model_bench")
    r = _run([str(ROOT / "scripts" / "gpu_model_bench.py"), "--preset", "tiny", "--stages",
              "ceilings,digest,prefill_profile,shared_prompt,replay_profile,bitwise,prefill_ragged", "--prefill-tokens",
              "128", "--shared-batch", "2", "--shared-prompt-len", "70", "--decode-batch", "2", "--context", "64",
              "--ragged-batch", "3", "--ragged-tokens", "200",
              "--bitwise-lengths", "130", "--bitwise-batches", "1,2", "--out", str(out)], out)
    assert r.returncode == 0 and "errors: none" in r.stdout, (r.stdout + r.stderr)[-3000:]
    return r, json.loads((out / "model_bench.json").read_text())


def test_model_bench_prefill_profile_stage(model_bench):
    res = model_bench[1]
    assert res["digest"]["stable"] is True and len(res["digest"]["digest"]) == 16 and res["digest"]["median_s"] > 0
    for tag in ("normal", "deterministic"):
        rows = res[f"prefill_profile_{tag}"]
        assert rows and all(row["us"] >= 0 and row["count"] >= 1 for row in rows)


def test_model_bench_shared_prompt_stage(model_bench):
    res = model_bench[1]["shared_prompt"]
    assert res["request 0 alone == in the shared batch"] is True and res["score shared == apart"] is True
    assert all(res[k]["median_s"] > 0 and len(res[k]["times_s"]) == 3
               for k in ("one prompt", "distinct prompts", "score, shared prefix", "score, apart"))


def test_model_bench_replay_profile_stage(model_bench):
    res = model_bench[1]
    for tag in ("replay", "deterministic"):
        rows = res[f"profile_{tag}"]
        assert rows and all(row["us_per_step"] >= 0 and row["count"] >= 0 for row in rows)


def test_model_bench_prefill_ragged_stage(model_bench):
    """The batch of mixed lengths (rows of about 1/3, 2/3 and all of 200 tokens), prefilled with and without the
    kernels skipping chunks of padding: the same last logits, both timed, normal and deterministic."""
    for tag in ("normal", "deterministic"):
        res = model_bench[1][f"prefill_ragged_{tag}"]
        assert res["lengths"] == [66, 110, 200] and res["logits_equal"] is True, res
        assert res["seconds_skip_padding"] > 0 and res["seconds_every_chunk"] > 0
        assert len(res["times"]["skip_padding"]) == len(res["times"]["every_chunk"]) == 3


def test_model_bench_bitwise_stage_takes_its_batch_sizes(model_bench, tmp_path, monkeypatch, capsys):
    """--bitwise-batches picks the bitwise stage's batch sizes (1 and 2 here: rows alone, first and last, and the
    split), and a list that is not one of positive ints is refused before anything runs."""
    checks = model_bench[1]["bitwise_len130"]
    assert sorted(checks) == ["B=1 row=0", "B=2 row=0", "B=2 row=1", "split at 64"] and all(checks.values())
    for bad in ("0,8", "1,x", ""):
        code, said = _main_exits("gpu_model_bench.py", ["--preset", "tiny", "--stages", "bitwise", "--bitwise-batches",
                                                        bad, "--out", str(tmp_path)], tmp_path, monkeypatch, capsys)
        assert code == 2 and "--bitwise-batches" in said, bad
    assert not (tmp_path / "model_bench.json").exists()


def test_model_bench_mixed_phases_cover_every_block_row():
    """The decode stages' default prompts put the rows at every position class of the open chunk (replay decode's
    cost depends on the block row a step falls in); "aligned" keeps every row at `context`."""
    from scripts.gpu_model_bench import prompt_lengths

    mixed = prompt_lengths(64, 1024, "mixed")
    assert sorted(mixed % 64) == list(range(64))  # 64 rows, every phase once (23 is odd, so b -> 23 b mod 64 is 1:1)
    assert mixed.min() > 1024 - 64 and mixed.max() == 1024
    assert set(((mixed % 64) // 16).tolist()) == {0, 1, 2, 3}
    assert (prompt_lengths(8, 1024, "aligned") == 1024).all()


def test_sharding_bench_profile_stage(tmp_path):
    r = _run([str(ROOT / "scripts" / "gpu_sharding_bench.py"), "--cpu-smoke", "--stages", "profile", "--out",
              str(tmp_path)], tmp_path, {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    assert r.returncode == 0 and "errors: none" in r.stdout, (r.stdout + r.stderr)[-3000:]
    prof = json.loads((tmp_path / "sharding_bench.json").read_text())["profile"]
    one, two = prof["decode_B8_1dev"], prof["decode_B8_2dev"]
    assert one["total_us"] > 0 and two["total_us"] > 0 and one["kernels"] and two["kernels"]
    assert one["collectives_us"] == 0 and two["collective_kernels"] > 0  # the mesh's step has collectives


def test_mma_rows_screen_runs_in_interpret_mode():
    """`scripts/gpu_mma_rows.py` (the M-independence screen for the replay step's dots) on CPU, interpreted: every
    variant of the chosen forms is counted, and one substitution step equals the loop (as it does on the H200)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_mma_rows
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    res = gpu_mma_rows.main(["--interpret", "--instances", "2", "--only", "av,substitution"])
    assert sorted(res) == sorted([f"av M={m} warps={w}" for m, w in ((16, 4), (16, 2), (16, 1), (32, 4), (64, 8))]
                                 + ["substitution step"])
    assert res["substitution step"] == 0


def test_replay_timing_writes_each_new_row_from_its_source():
    """The replay step's timing loop (`gpu_kernels.new_token_row`) feeds each step a new row at i % 64, taken from
    another buffer (as the model's one-row scatter writes a row computed elsewhere), and leaves every other row."""
    import jax.numpy as jnp
    import numpy as np

    from scripts.gpu_kernels import new_token_row

    x = jnp.arange(2 * 64 * 3, dtype=jnp.float32).reshape(2, 64, 3)
    src = -x - 1
    for i in (0, 5, 63, 64 + 7):
        got = np.asarray(new_token_row(x, src, i))
        want = np.asarray(x).copy()
        want[:, i % 64] = np.asarray(src)[:, (i % 64 + 1) % 64]
        assert np.array_equal(got, want), i


def test_replay_diff_finds_nothing_interpreted_and_a_planted_difference(capsys, monkeypatch):
    """`scripts/replay_diff.py` on CPU, interpreted: the replay step's v_new rows (the completing row included) and
    boundary states equal the prefill's (exit 0); with a step that nudges a completed chunk's boundary state by one
    ulp it reports those states and the v_new rows computed from them (exit 1)."""
    import jax.numpy as jnp

    from pallas_kernels.gated_delta import replay as rp
    from scripts import replay_diff

    argv = ["--interpret", "--heads", "1,2", "--dims", "16,16", "--prompts", "60,5", "--steps", "12"]
    assert replay_diff.main(argv) == 0
    out = capsys.readouterr().out
    assert "primed v_new rows != prefill: 0" in out and "decoded v_new rows != prefill: 0" in out

    step = rp.chunk_replay_step_pallas

    def nudged(q, k, v, g, beta, state, x_cache, vn_cache, lengths, **kw):  # (priming calls it too, with
        # lengths < 64: they pass through)
        o, s, xc, vc = step(q, k, v, g, beta, state, x_cache, vn_cache, lengths, **kw)
        if (kw.get("config") or {}).get("stop_after") == "out":
            return o, s, xc, vc
        done = (lengths == 64)[:, None, None, None]
        return o, jnp.where(done, jnp.nextafter(s, jnp.inf), s), xc, vc

    monkeypatch.setattr(rp, "chunk_replay_step_pallas", nudged)
    assert replay_diff.main(argv) == 1
    out = capsys.readouterr().out
    assert "boundary states != prefill: 1 " in out  # row 0's state at 64, read by its steps 64 .. 71
    assert "primed v_new rows != prefill: 0" in out and "decoded v_new rows != prefill: 0" not in out


def test_replay_diff_passes_its_config_to_the_step():
    """--config reaches the replay step (and its priming): a value the step refuses fails the run."""
    from scripts import replay_diff

    argv = ["--interpret", "--heads", "1,2", "--dims", "16,16", "--prompts", "20,5", "--steps", "2"]
    with pytest.raises(ValueError, match="replay_s0_dots"):
        replay_diff.main(argv + ["--config", '{"replay_s0_dots": 3}'])


def test_mosaic_probe_lowers_its_kernel_on_cpu(capsys):
    """`scripts/mosaic_tf32_probe.py --lower-only`: its Mosaic GPU TF32 wgmma kernel lowers for CUDA here (the jax
    0.11.2 API it uses: TMA copies into swizzled shared memory, a barrier each, wgmma, the store back), at an output
    narrower than a 128-byte swizzle too, and its elementwise / row-sum kernel with and without approx_math; its
    TF32 roundings: to nearest, ties away from zero, and toward zero; and `--tile-sums`' kernel."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import mosaic_tf32_probe as probe
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert probe.main(["--lower-only", "--shapes", "128,64;64,16"]) == 0
    out = capsys.readouterr().out
    assert out.count("lowered, a Mosaic GPU custom call") == 4, out  # two dots, then the ops kernel twice
    assert "ops (approx_math=True): lowered" in out, out
    ulp = 2.0 ** -10  # TF32's spacing at 1
    x = np.array([1 + ulp / 2, 1 + ulp / 4, 1 + 3 * ulp / 4, -(1 + ulp / 2), 3.0], np.float32)
    assert probe.tf32_rna(x).tolist() == [1 + ulp, 1.0, 1 + ulp, -(1 + ulp), 3.0]
    assert probe.tf32_rz(x).tolist() == [1.0, 1.0, 1.0, -1.0, 3.0]
    # --tile-sums: the Mosaic GPU kernel of 64-row wgmmas on [16, 16] tiles (K = 16, a 64-byte swizzle), chained and
    # summed, for 2 and 4 tiles, and the prep's block row in Pallas-Triton (`chunk._wy_block_row` as the probe calls it)
    assert probe.main(["--lower-only", "--tile-sums"]) == 0
    out = capsys.readouterr().out
    assert out.count("lowered, a Mosaic GPU custom call") == 4, out
    assert "block row 3 (Pallas-Triton): lowered, a GPU custom call" in out, out


def test_triton_order_probe_models_an_inverse_and_lowers_its_kernels(capsys):
    """`scripts/triton_order_probe.py`: each modelled summation order computes the inverse of I + A by forward
    substitution (to fp32 rounding), the orders differ in some elements (so one matching a GPU kernel's tiles in every
    element tells them apart), the Mosaic GPU kernel computes the inverse under every row placement (interpret mode)
    and hands back the tiles in the tile's own row order, the Mosaic GPU gram kernel computes the gram tiles of the
    fp16 operands, and every kernel lowers for CUDA here."""
    import numpy as np

    from scripts import triton_order_probe as probe

    rng = np.random.default_rng(3)
    at = np.triu(rng.uniform(-0.5, 0.5, (16, 16)), 1).astype(np.float32)  # A^T: A strictly lower
    eye = np.eye(16)
    models = {order: probe.substitution_model(at, order) for order in ("g", "g8", "tree", "plain")}
    for order, t in models.items():
        np.testing.assert_allclose((eye + at.T.astype(np.float64)) @ t, eye, atol=1e-5, err_msg=order)
    assert not np.array_equal(models["g"], models["plain"]) and not np.array_equal(models["g"], models["g8"])
    assert not np.array_equal(models["g"], models["tree"])
    ats = np.stack([at, np.triu(rng.uniform(-0.5, 0.5, (16, 16)), 1).astype(np.float32)])
    for placement, rows in probe.MOSAIC_PLACEMENTS.items():
        assert sorted(rows) == list(range(16)), placement
        call = probe.mosaic_substitution_call(placement, interpret=True, tiles=2)
        placed = np.asarray(call(*probe.mosaic_inputs(ats, placement)))
        others = np.setdiff1d(np.arange(probe.MOSAIC_ROWS), rows)
        assert not placed[:, others].any(), placement  # the rows outside the tile stay zeros
        for a_t, t in zip(ats, probe.mosaic_tiles(placed, placement)):
            np.testing.assert_allclose((eye + a_t.T.astype(np.float64)) @ t, eye, atol=1e-5, err_msg=placement)
    k, _, beta = probe.inputs(5)
    k16, kb16 = probe.gram_inputs(k, beta)
    exact = np.asarray(k16, np.float64) @ np.asarray(kb16, np.float64).T  # the fp16 products are exact in fp32
    gram = probe.gram_diagonal(probe.mosaic_gram_call(interpret=True)(k16, kb16))
    np.testing.assert_allclose(gram, probe.gram_diagonal(exact), rtol=0, atol=1e-6)
    assert probe.main(["--lower-only"]) == 0
    out = capsys.readouterr().out
    assert "lowered: lowered, a GPU custom call" in out
    for placement in probe.MOSAIC_PLACEMENTS:  # only "rev_rn" multiplies by mul.rn.f32 (no FMA contraction)
        rn = placement.endswith("_rn")
        assert (f"Mosaic GPU ({placement}) lowered: lowered, a Mosaic GPU custom call; mul.rn.f32 in its code: {rn}"
                in out), out
    assert "Mosaic GPU gram lowered: lowered, a Mosaic GPU custom call" in out, out


def test_cache_memory_script(tmp_path):
    """scripts/gpu_cache_memory.py at a tiny size: a prompt's checkpoints hold less than with a key/value copy each,
    and the longer request restored from them equals it cold; a batch restored from them by `state_from_checkpoints`
    equals the old row-by-row writes."""
    r = _run([str(ROOT / "scripts" / "gpu_cache_memory.py"), "--preset", "tiny", "--prompt", "320", "--interval", "64",
              "--extra", "70", "--restore-rows", "3", "--out", str(tmp_path / "new")], tmp_path)
    assert r.returncode == 0 and "[PASS]" in r.stdout, (r.stdout + r.stderr)[-3000:]
    res = json.loads((tmp_path / "new" / "cache_memory.json").read_text())  # (--out made where missing)
    assert res["restore"]["equal"] is True and res["restore"]["state_from_checkpoints"] > 0
    cold, warm = res["rows"]
    assert (cold["entries"], cold["positions"], warm["cached_tokens"]) == (5, [64, 320], 320)
    for row in (cold, warm):
        assert row["gdn_bytes"] < row["cache_nbytes"] < row["own_copies_bytes"]


def test_gpu_results_are_kept_when_a_timeout_stops_the_script(tmp_path):
    """`run_and_save` (the Mosaic GPU scripts' and gpu_prefill_configs.py's results.json): a SIGTERM, as `timeout`
    sends at its limit, still writes what ran."""
    code = (
        "import os, signal, sys\n"
        "from scripts.gpu_mgpu_recurrence import run_and_save\n"
        "def body(results):\n"
        "    results['timing'].append({'shape': [1, 64, 1, 1], 'ms': 1.0})\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    results['timing'].append('never')\n"
        f"run_and_save({str(tmp_path)!r}, body)\n")
    r = _run(["-c", code], tmp_path)
    assert r.returncode == 128 + 15, r.stderr[-2000:]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["timing"] == [{"shape": [1, 64, 1, 1], "ms": 1.0}] and saved["seconds"] >= 0


def test_prep_ablations_compile_each_variant_apart(tmp_path, monkeypatch):
    """scripts/gpu_prep_ablate.py in interpret mode at a tiny shape: every variant compiled ahead of time under its
    own swaps and timed, and what each computes, read after all were compiled, is its own — the variants that change
    w give other w than as built, those that only drop u's or kd's stores give as built's w (runs 177-178 timed one
    variant under every name: BENCHMARKS.md) — and no swap outlives the script."""
    from pallas_kernels.gated_delta import chunk, wy
    from scripts import gpu_prep_ablate

    before = (wy.diag_tiles_by_substitution, wy.merged_block_row, chunk._wy_block_row, chunk._store_tiled_wy,
              chunk._load_key, chunk._prep_split_kernel)
    monkeypatch.setattr(sys, "argv", ["gpu_prep_ablate.py", "--shapes", "1,128,1,2", "--reps", "1", "--interpret",
                                      "--out", str(tmp_path)])
    gpu_prep_ablate.main()
    res = json.loads((tmp_path / "results.json").read_text())
    [row] = res["timing"]
    sums = row["w_abs_sum"]
    assert set(row["ms"]) == set(sums) == set(gpu_prep_ablate.VARIANTS)
    assert all(ms > 0 for ms in row["ms"].values())
    for name in ("no_substitution", "no_merge", "diag_wu", "no_l2", "copy"):
        assert sums[name] != sums["as_built"], name
    assert sums["no_u"] == sums["no_kd"] == sums["as_built"]
    assert (wy.diag_tiles_by_substitution, wy.merged_block_row, chunk._wy_block_row, chunk._store_tiled_wy,
            chunk._load_key, chunk._prep_split_kernel) == before


def test_padding_ab_compiles_each_variant_apart(tmp_path, monkeypatch):
    """scripts/gpu_padding_ab.py in interpret mode on two rows of 64 and 128 tokens: the three variants' outputs and
    final states equal element by element, each timed; as built the prep was asked to leave the chunks of padding
    unwritten, under "written" (its swap) to write them, under "no_skip" to write them — and the swap is undone."""
    from pallas_kernels.gated_delta import chunk
    from scripts import gpu_padding_ab

    asked, swapped_asked = [], []
    real = chunk._prep_one_call

    def spy(log):
        return lambda *a, **kw: log.append(kw["padding_read"]) or real(*a, **kw)

    monkeypatch.setattr(chunk, "_prep_one_call", spy(asked))
    monkeypatch.setattr(gpu_padding_ab, "_PREP_ONE_CALL", spy(swapped_asked))
    before = chunk._prep_one_call
    monkeypatch.setattr(sys, "argv", ["gpu_padding_ab.py", "--shapes", "2,128,1,2", "--reps", "1", "--interpret",
                                      "--out", str(tmp_path)])
    gpu_padding_ab.main()
    res = json.loads((tmp_path / "results.json").read_text())
    assert len(res["checks"]) == 4 and all(c["equal"] for c in res["checks"])
    [row] = res["timing"]
    assert row["lengths"] == [64, 128] and set(row["ms"]) == set(gpu_padding_ab.VARIANTS)
    assert all(ms > 0 for ms in row["ms"].values())
    assert asked == [False, True] and swapped_asked == [True]  # as_built, no_skip; written
    assert chunk._prep_one_call is before


def test_ragged_lengths_leave_chunks_of_padding_only():
    """`gpu_prefill_configs.py --ragged` (how run 185 measured `skip_padding`): row b holds about (b + 1) / B of the T
    tokens, the last row all of them; every other row ends before T - 64, so its last chunks are padding only, and a
    single row is full."""
    from scripts.gpu_prefill_configs import ragged_lengths

    got = [int(n) for n in ragged_lengths(8, 4096)]
    assert got == [512, 1001, 1490, 2043, 2532, 3021, 3574, 4096]
    for B, T in ((2, 300), (3, 1000), (4, 4096), (2, 8192)):
        lens = [int(n) for n in ragged_lengths(B, T)]
        assert lens[-1] == T and all(0 < n <= T - 64 for n in lens[:-1]), (B, T, lens)
    assert [int(n) for n in ragged_lengths(1, 8192)] == [8192]
