"""Tensor parallelism on CPU virtual devices (`jaxgdn.sharding`): placement, sharded vs single-device logits, the
sharded loader, deterministic mode on a mesh, generation and the prefix cache on a mesh, Pallas kernels per shard.

The multi-device checks run in one subprocess started with XLA_FLAGS=--xla_force_host_platform_device_count=8 (the
device count is fixed when JAX initialises, and the rest of the suite shares this pytest process), once per
session, one after the other so that they share compiled programs; each test below asserts one of its results.
`python tests/test_sharding.py` prints the raw results (and the seconds each check took).

Mesh sizes and the tiny models (GDN HK=2 / HV=4, attention H=4 / HKV=2, MLP 96, experts 32, shared expert 48, vocab
256): tp=2 splits everything; tp=4 replicates the GDN layers (4 does not divide HK=2) and the KV heads, and splits
attention query heads, MLP / experts and the vocabulary; tp=8 splits only the MLP / experts and the vocabulary.

Tolerance, sharded vs single device (fp32): max |logit difference| <= 1e-4 (measured 2e-7 to 7e-6: the out/o/down
projections sum their inputs in tp pieces, then across devices). Deterministic mode on a fixed mesh: bitwise (on 4
devices with the output projections' partial sums all-gathered and added in device order).
Tests that need a hook in a file outside this change (loader, grouped layout, kernels in shard_map) skip, naming
it, when that hook is not there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).absolute().parents[1]
TOL = 1e-4
PRESETS = ("tiny", "tiny-next")
COMPARE = {"tiny": (2, 4), "tiny-next": (2, 4, 8)}  # 8 splits no head of either: one model covers it (prefill)


# ==== the worker (runs in a subprocess with 8 virtual CPU devices) ================================================

def _worker() -> dict:
    import dataclasses
    import inspect

    import jax
    import numpy as np

    import jaxgdn
    import pallas_kernels.api
    from jaxgdn import sharding as S
    from jaxgdn.cache import checkpoint_from_state, state_from_checkpoints
    from jaxgdn.model import decode_step, prefill_chunk
    from jaxgdn.params import weights_digest
    from jaxgdn.state import GDNLayerState

    assert len(jax.devices()) == 8, jax.devices()
    from tests.xla_cache import use_persistent_cache_if_asked

    use_persistent_cache_if_asked()  # the suite's opt-in persistent compilation cache
    fixtures = ROOT / "tests" / "fixtures"
    hooks = {"loader": "mesh" in inspect.signature(jaxgdn.load_pretrained).parameters,
             "layout": S._GROUPED_LAYOUT, "kernels": hasattr(pallas_kernels.api, "TP_AXIS"),
             "init_state": "sharding" in inspect.getsource(jaxgdn.Model.init_state)}
    out: dict = {"hooks": hooks}
    prefill, decode = jax.jit(prefill_chunk), jax.jit(decode_step)
    rng = np.random.default_rng(0)

    def record(name, fn):
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception:  # noqa: BLE001 - every failure is reported by the test that reads it
            out[name] = {"error": traceback.format_exc()[-3000:]}
        out.setdefault("seconds", {})[name] = round(time.perf_counter() - t0, 1)

    def diff(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))

    def tree_diff(a, b):
        return max(diff(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    def init(model, b, n):  # the hook makes model.init_state sharded; without it, place the state explicitly
        return model.init_state(b, n) if hooks["init_state"] else S.init_state(model, b, n)

    # ---- sharded vs single device: logits, states, placement -----------------------------------------------------
    toks = rng.integers(0, 256, (2, 64)).astype(np.int32)
    lens = np.array([64, 41], np.int32)
    nxt = np.array([7, 9], np.int32)

    def reference(model):
        s, lg = prefill(model, model.init_state(2, 128), toks, lens)
        s2, lg2 = decode(model, s, nxt)
        return s, lg, s2, lg2

    def compare(model, ref, tp, with_decode=True):
        mesh = S.make_mesh(tp)
        sm = S.shard_model(model, mesh)
        st = init(sm, 2, 128)
        s, lg = prefill(sm, st, toks, lens)
        valid = np.arange(64)[None, :] < lens[:, None]
        r = {"plan": S.plan(model.config, mesh).describe(),
             "params_misplaced": S.check_placement(sm.params, S.param_specs(sm.config, mesh)),
             "init_misplaced": S.check_placement(st, S.state_specs(sm.config, mesh)),
             "prefill_state_misplaced": S.check_placement(s, S.state_specs(sm.config, mesh)),
             "prefill_logits": diff(np.asarray(lg)[valid], np.asarray(ref[1])[valid]),
             "prefill_state": tree_diff(S.convert_layout(s, sm, model).layers, ref[0].layers),
             "logits_spec": str(S.spec_of(lg)),
             # the prefix cache's weights digest computed on the mesh = computed on the host copy of the same weights
             "weights_digest_mesh_invariant": sm.weights_digest == weights_digest(jax.tree.map(np.asarray, sm.params))}
        # per-device shard shapes of a few leaves (really split, not just annotated)
        gdn = next(x for x in s.layers if isinstance(x, GDNLayerState))
        attn = s.layers[model.config.attention_layers[0]]
        r["shard_shapes"] = {"recurrent": [list(x.data.shape) for x in gdn.recurrent.addressable_shards][:1],
                             "conv": [list(x.data.shape) for x in gdn.conv.addressable_shards][:1],
                             "keys": [list(x.data.shape) for x in attn.keys.addressable_shards][:1],
                             "lm_head": [list(x.data.shape) for x in sm.params.lm_head.addressable_shards][:1],
                             "n_devices": len(gdn.recurrent.sharding.device_set)}
        if with_decode:
            s2, lg2 = decode(sm, s, nxt)
            r.update(decode_logits=diff(lg2, ref[3]),
                     decode_state=tree_diff(S.convert_layout(s2, sm, model).layers, ref[2].layers),
                     decode_state_misplaced=S.check_placement(s2, S.state_specs(sm.config, mesh)))
        return r

    for name in PRESETS:
        model = jaxgdn.tiny_model(name)
        ref = reference(model)
        for tp in COMPARE[name]:
            record(f"compare/{name}/{tp}", lambda: compare(model, ref, tp, with_decode=tp != 8))

    def grouped_layout():  # on one device the grouped layout changes only the channel order: bitwise equal
        model = jaxgdn.tiny_model("tiny")
        ref = reference(model)
        grouped = S.with_layout(model, model.config.linear_num_key_heads)
        s, lg = prefill(grouped, grouped.init_state(2, 128), toks, lens)
        back = S.convert_layout(s, grouped, model)
        return {"logits_bitwise": bool(np.array_equal(np.asarray(lg), np.asarray(ref[1]))),
                "state_bitwise": all(np.array_equal(np.asarray(a), np.asarray(b))
                                     for a, b in zip(jax.tree.leaves(back.layers), jax.tree.leaves(ref[0].layers))),
                "back_to_hf_config": S.with_layout(grouped, 1).config == model.config}

    if hooks["layout"]:
        record("grouped_layout", grouped_layout)

    # ---- the sharded loader (fixtures): equal to placing the eagerly loaded params; slices read per shard ----
    calls: list = []
    orig_read = S.HostArray.read

    def spy(self, index=None):
        x = orig_read(self, index)
        calls.append((self.shape, x.shape))
        return x

    def loader(fixture, tp):
        mesh = S.make_mesh(tp)
        eager = jaxgdn.load_pretrained(fixtures / fixture)
        calls.clear()
        S.HostArray.read = spy
        try:
            lazy = jaxgdn.load_pretrained(fixtures / fixture, mesh=mesh)
        finally:
            S.HostArray.read = orig_read
        placed = S.shard_model(eager, mesh)
        equal = all(np.array_equal(np.asarray(a), np.asarray(b)) and a.sharding == b.sharding
                    for a, b in zip(jax.tree.leaves(lazy.params), jax.tree.leaves(placed.params)))
        split_reads = [c for c in calls if c[0] != c[1]]
        r = {"equal_to_placed": equal, "reads": len(calls), "split_reads": len(split_reads),
             "split_reads_whole": sum(int(np.prod(c[1])) == int(np.prod(c[0])) for c in split_reads),
             "split_reads_fraction": sorted({round(float(np.prod(c[1]) / np.prod(c[0])), 4)
                                             for c in split_reads}),
             "config_equal": dataclasses.replace(lazy.config, gdn_qkv_groups=1) == eager.config
             if hooks["layout"] else lazy.config == eager.config}
        if fixture == "qwen3_5_tiny":  # same config as the "tiny" preset: shares its compiled programs
            ref = reference(eager)
            r.update(compare(eager, ref, tp))
            s, lg = prefill(lazy, init(lazy, 2, 128), toks, lens)
            r["lazy_vs_placed_logits_bitwise"] = bool(np.array_equal(
                np.asarray(lg), np.asarray(prefill(placed, init(placed, 2, 128), toks, lens)[1])))
        return r

    for fixture, tps in (("qwen3_5_tiny", (2, 4)), ("qwen3_next_tiny", (2, 4, 8))):
        for tp in tps:
            if hooks["loader"]:
                record(f"loader/{fixture}/{tp}", lambda: loader(fixture, tp))

    # ---- Pallas kernels (interpreted) per shard inside shard_map ---------------------------------------------
    def kernels():
        model = jaxgdn.tiny_model("tiny")
        ref = reference(model)
        mesh = S.make_mesh(2)
        sm = S.shard_model(model.with_backend("interpret"), mesh)
        st = init(sm, 2, 128)
        with jax.set_mesh(mesh):
            jp = str(jax.make_jaxpr(prefill_chunk)(sm, st, toks, lens))
            jd = str(jax.make_jaxpr(decode_step)(sm, st, nxt))
            s, lg = prefill(sm, st, toks, lens)
            s2, lg2 = decode(sm, s, nxt)
        valid = np.arange(64)[None, :] < lens[:, None]
        n_gdn = len(model.config.gdn_layers)
        # the token-by-token GDN prefill (gdn_prefill="recurrent") per shard too
        sr = S.shard_model(model.with_backend("interpret").with_gdn_prefill("recurrent"), mesh)
        with jax.set_mesh(mesh):
            jr = str(jax.make_jaxpr(prefill_chunk)(sr, st, toks, lens))
            _, lgr = prefill(sr, init(sr, 2, 128), toks, lens)
        # replay decode over the chunked prefill: the replay step and `prime` per shard, with their caches split
        # over the heads like the recurrent state
        rp = model.with_backend("interpret").with_decode_mode("replay")
        srp = S.shard_model(rp, mesh)
        with jax.set_mesh(mesh):
            jrp = str(jax.make_jaxpr(decode_step)(srp, init(srp, 2, 128), nxt))
            s_rp, _ = prefill(srp, init(srp, 2, 128), toks, lens)
            s_rp, lg_rp = decode(srp, s_rp, nxt)
        _, lg_rp1 = decode(rp, prefill(rp, rp.init_state(2, 128), toks, lens)[0], nxt)
        # deterministic mode: the fixed-tile matmuls (column- and row-split projections, lm_head) and attention
        # per shard as well
        det_model = model.with_backend("interpret").with_deterministic()
        sd = S.shard_model(det_model, mesh)
        with jax.set_mesh(mesh):
            jdet = str(jax.make_jaxpr(prefill_chunk)(sd, st, toks, lens))
            jdet_dec = str(jax.make_jaxpr(decode_step)(sd, st, nxt))
            _, lgd = prefill(sd, init(sd, 2, 128), toks, lens)
        # tp=4 replicates the GDN layers (4 does not divide HK=2) and the KV heads: those products and the attention
        # take the reference path, the rest (q_proj, o_proj, the MLP, the head) run per shard
        mesh4 = S.make_mesh(4)
        sd4 = S.shard_model(det_model, mesh4)
        with jax.set_mesh(mesh4):
            jdet4 = str(jax.make_jaxpr(prefill_chunk)(sd4, init(sd4, 2, 128), toks, lens))
            _, lgd4 = prefill(sd4, init(sd4, 2, 128), toks, lens)
        # score: its prefill per shard as well (before 2026-12-05 it set no mesh, and XLA gathered the kernels'
        # inputs onto every device); counted as the traced calls of the kernels' shard_map
        calls = []
        per_shard = pallas_kernels.api._per_shard
        pallas_kernels.api._per_shard = lambda *a: (calls.append(1), per_shard(*a))[1]
        seqs = [toks[0].tolist(), toks[1, :41].tolist()]
        try:
            scores = jaxgdn.score(sm, seqs)
        finally:
            pallas_kernels.api._per_shard = per_shard
        scores_one = jaxgdn.score(model, seqs)
        # two sequences of one 64-token prefix scored from 65: the prefix prefilled once on the mesh, its state
        # restored into both rows (checkpoint_from_state / state_from_checkpoints on sharded states)
        shared_seqs = [toks[0].tolist() + [5, 6, 7, 8], toks[0].tolist() + [9, 10, 11]]
        scores_shared = jaxgdn.score(sm, shared_seqs, start=65)
        scores_apart_one = jaxgdn.score(model, shared_seqs, start=65, share_prefixes=False)
        cfg = model.config
        # projections: GDN qkv / z / a / b / out, attention q / k / v / o, MLP gate / up / down, the output head
        n_proj = n_gdn * 5 + (cfg.num_layers - n_gdn) * 4 + cfg.num_layers * 3 + 1
        return {"shard_maps_prefill": jp.count("shard_map["), "shard_maps_decode": jd.count("shard_map["),
                "n_gdn": n_gdn, "n_attn": cfg.num_layers - n_gdn, "n_proj": n_proj,
                "det_shard_maps": jdet.count("shard_map["), "det_matmul_kernels": jdet.count("invariant_matmul"),
                "det_matmul_kernels_one_device": str(jax.make_jaxpr(prefill_chunk)(
                    det_model, init(det_model, 2, 128), toks, lens)).count("invariant_matmul"),
                "det_decode_shard_maps": jdet_dec.count("shard_map["),
                "det_prefill_logits": diff(np.asarray(lgd)[valid], np.asarray(ref[1])[valid]),
                "det_tp4_shard_maps": jdet4.count("shard_map["), "det_tp4_all_gathers": jdet4.count("all_gather["),
                "det_tp4_prefill_logits": diff(np.asarray(lgd4)[valid], np.asarray(ref[1])[valid]),
                "prefill_logits": diff(np.asarray(lg)[valid], np.asarray(ref[1])[valid]),
                "decode_logits": diff(lg2, ref[3]),
                "score_shard_maps": len(calls),
                "score_vs_single_device": max(diff(a, b) for a, b in zip(scores, scores_one)),
                "score_shared_vs_single_device_apart": max(diff(a, b) for a, b in zip(scores_shared,
                                                                                      scores_apart_one)),
                "scan_shard_maps": jr.count("shard_map["), "scan_in_jaxpr": "gdn_scan" in jr,
                "scan_prefill_logits": diff(np.asarray(lgr)[valid], np.asarray(ref[1])[valid]),
                "state_misplaced": S.check_placement(s2, S.state_specs(sm.config, mesh)),
                "replay_shard_maps": jrp.count("shard_map["),
                "replay_step_in_jaxpr": "gdn_replay_prep" in jrp and "gdn_replay_out" in jrp,
                "replay_packed_in_jaxpr": "gdn_open_chunk_clear" in jrp,
                "replay_decode_logits": diff(lg_rp, lg_rp1),
                "replay_state_misplaced": S.check_placement(s_rp, S.state_specs(srp.config, mesh, replay=True))}

    if hooks["kernels"]:
        record("kernels", kernels)

    # ---- deterministic mode on a mesh, generation, the prefix cache --------------------------------------------
    W = 64

    shared: dict = {}

    def det_checks(model, tp, full=True):
        """Bitwise: the same call twice; a row alone vs inside a batch of 3 (first, last; `full`: also a prompt
        split on the grid vs one call, a decode step alone vs in the batch, and the single-device difference)."""
        mesh = S.make_mesh(tp)
        sm = S.shard_model(model, mesh)
        V = model.config.vocab_size
        target = rng.integers(0, V, 100).tolist()

        def run(rows, parts):  # prefill rows in calls over `parts` (token ranges), then (full) one decode step
            state = init(sm, len(rows), 128)
            got = []
            for a, b in parts:
                t = np.zeros((len(rows), b - a), np.int32)
                ln = np.zeros((len(rows),), np.int32)
                for i, r in enumerate(rows):
                    seg = r[a:b]
                    t[i, :len(seg)] = seg
                    ln[i] = len(seg)
                state, lg = prefill(sm, state, t, ln)
                got.append(np.asarray(lg))
            if not full:
                return got, np.zeros((len(rows), 1)), state
            state, lg = decode(sm, state, np.full((len(rows),), 5, np.int32))
            return got, np.asarray(lg), state

        split = ((0, W), (W, 2 * W))
        alone, alone_dec, st = run([target], split)
        alone_rows = np.concatenate([alone[0][0], alone[1][0, :100 - W]])
        again, again_dec, _ = run([target], split)
        r = {"twice": bool(np.array_equal(np.concatenate([again[0][0], again[1][0, :100 - W]]), alone_rows)
                           and np.array_equal(again_dec, alone_dec)),
             "state_misplaced": S.check_placement(st, S.state_specs(sm.config, mesh))}
        for where in ((0, 2) if full else (2,)):
            rows = [rng.integers(0, V, int(n)).tolist() for n in (128, 70, 100)]
            rows[where] = target
            got, dec, _ = run(rows, split)
            r[f"in_batch_row{where}"] = bool(np.array_equal(np.concatenate([got[0][where], got[1][where, :100 - W]]),
                                                            alone_rows))
            if full:
                r[f"decode_in_batch_row{where}"] = bool(np.array_equal(dec[where], alone_dec[0]))
        if not full:
            return r
        whole, whole_dec, _ = run([target], ((0, 2 * W),))
        r["grid_split_equals_one_call"] = bool(np.array_equal(whole[0][0, :100], alone_rows)
                                               and np.array_equal(whole_dec, alone_dec))
        _, unsharded = prefill(model, model.init_state(1, 128), np.asarray([target + [0] * 28], np.int32),
                               np.array([100], np.int32))
        r["vs_single_device_max_diff"] = diff(np.asarray(unsharded)[0, :100], alone_rows)
        r["vs_single_device_bitwise"] = bool(np.array_equal(np.asarray(unsharded)[0, :100], alone_rows))
        shared.update(target=target, single_last=np.asarray(unsharded)[0, 99], sharded=sm, mesh=mesh)
        return r

    det_fixture = jaxgdn.load_pretrained(fixtures / "qwen3_5_tiny", deterministic=True)
    record("det/qwen3_5_tiny/2", lambda: det_checks(det_fixture, 2))
    record("det/tiny-next/2", lambda: det_checks(jaxgdn.tiny_model("tiny-next", seed=21, deterministic=True), 2,
                                                 full=False))
    record("det/qwen3_5_tiny/4", lambda: det_checks(det_fixture, 4, full=False))
    det_next = jaxgdn.tiny_model("tiny-next", seed=21, deterministic=True)
    record("det/tiny-next/4", lambda: det_checks(det_next, 4, full=False))

    def fixed_order():
        """Deterministic mode on meshes of more than 2 devices sums the output projections' partial products in a
        fixed device order (all_gather + adds) instead of an all-reduce; on 2 devices the all-reduce stays."""
        counts = {}
        for name, m in (("dense", det_fixture), ("moe", det_next)):
            for tp in (2, 4):
                sm = S.shard_model(m, S.make_mesh(tp))
                with jax.set_mesh(S.mesh_of(sm)):
                    jaxpr = str(jax.make_jaxpr(prefill_chunk)(sm, init(sm, 2, 128), toks, lens))
                counts[f"{name}_all_gathers_tp{tp}"] = jaxpr.count("all_gather")
        return counts

    record("fixed_order", fixed_order)

    def cache_and_generate():
        """generate on a mesh (its first token and logprob = the single-device prefill's, within TOL), the
        deterministic prefix cache on a mesh: its checkpoints stay split, a warm run (restored onto the mesh)
        equals the cold run bitwise, check_cache(recompute=True) passes on the mesh."""
        sm, mesh, prompt, last = shared["sharded"], shared["mesh"], shared["target"], shared["single_last"]
        cache = jaxgdn.PrefixCache(interval=64, deterministic=True)
        cold = jaxgdn.generate(sm, [prompt], max_new_tokens=8, cache=cache)
        warm = jaxgdn.generate(sm, [prompt], max_new_tokens=8, cache=cold.cache)
        [ck] = cold.cache.checkpoints()
        gdn_s, kv_s = S.checkpoint_specs(sm.config, mesh)
        single_lp = last - np.log(np.sum(np.exp(last.astype(np.float64) - last.max()))) - last.max()
        r = {"cold_cached": cold[0].cached_tokens, "warm_cached": warm[0].cached_tokens,
             "n_tokens": len(cold[0].tokens),
             "warm_equals_cold": warm[0].tokens == cold[0].tokens
             and bool(np.array_equal(np.array(warm[0].logprobs), np.array(cold[0].logprobs))),
             "first_token_equals_single_device": cold[0].tokens[0] == int(np.argmax(last)),
             "first_logprob_vs_single_device": abs(cold[0].logprobs[0] - float(single_lp[cold[0].tokens[0]])),
             "checkpoint_misplaced": S.check_placement((ck.gdn, ck.kv), (gdn_s, kv_s))}
        jaxgdn.check_cache(warm.cache, sm, recompute=True)
        r["check_cache_recompute"] = True
        # the restore itself: a state built from the checkpoint is placed as a fresh sharded state
        restored = state_from_checkpoints(init(sm, 1, 128), [ck])
        r["restored_misplaced"] = S.check_placement(restored.layers, S.state_specs(sm.config, mesh).layers)
        again = checkpoint_from_state(restored, 0, ck.tokens)
        r["round_trip_bitwise"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                      zip(jax.tree.leaves((again.gdn, again.kv)), jax.tree.leaves((ck.gdn, ck.kv))))
        return r

    record("cache", cache_and_generate)
    return out


# ==== the tests (in this pytest process) ===========================================================================

def _run_worker() -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(Path(__file__).absolute())], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        return {"worker_failed": f"rc {proc.returncode}:\n{proc.stderr[-5000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The worker's results, computed once per test session: under pytest-xdist the first worker to get here runs
    it and the others (same PYTEST_XDIST_TESTRUNUID) wait on a file lock and read its results, kept in the run's
    temporary directory, which the workers share (pytest removes old runs' directories; these files used to be left
    in /tmp after every run)."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        out = _run_worker()
    else:
        import fcntl

        path = tmp_path_factory.getbasetemp().parent / f"jaxgdn-sharding-{run_id}.json"
        with open(str(path) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                out = json.loads(path.read_text())
            else:
                out = _run_worker()
                path.write_text(json.dumps(out))
    if "worker_failed" in out:
        pytest.fail(f"the sharding worker failed ({out['worker_failed']})")
    return out


def _get(results, key):
    r = results.get(key)
    if r is None:
        pytest.fail(f"no result {key!r}")
    if isinstance(r, dict) and "error" in r:
        pytest.fail(f"{key} raised:\n{r['error']}")
    return r


def _need(results, hook: str, diff: str):
    if not results["hooks"][hook]:
        pytest.skip(f"needs the {hook} hook ({diff}) — not applied in this checkout")


CASES = [(name, tp) for name in PRESETS for tp in COMPARE[name]]


@pytest.mark.parametrize("name,tp", CASES)
def test_sharded_logits_match_single_device(results, name, tp):
    r = _get(results, f"compare/{name}/{tp}")
    assert r["prefill_logits"] <= TOL, r
    assert r["prefill_state"] <= TOL, r
    assert r["weights_digest_mesh_invariant"] is True, r
    if tp != 8:
        assert r["decode_logits"] <= TOL and r["decode_state"] <= TOL, r


@pytest.mark.parametrize("name,tp", CASES)
def test_params_and_states_really_are_sharded(results, name, tp):
    r = _get(results, f"compare/{name}/{tp}")
    assert r["params_misplaced"] == [] and r["init_misplaced"] == [], r
    assert r["prefill_state_misplaced"] == [], r  # XLA kept the planned placement: the state can be donated
    assert r.get("decode_state_misplaced", []) == [], r
    shapes = r["shard_shapes"]
    assert shapes["n_devices"] == tp
    assert shapes["lm_head"] == [[64, 256 // tp]]  # vocabulary split at every size
    assert r["logits_spec"] == "P(None, None, 'tp')"  # logits come out split over the vocabulary
    if tp == 2:  # heads split: each device holds half the GDN heads, conv channels and KV heads
        assert shapes["recurrent"] == [[2, 2, 16, 16]] and shapes["conv"] == [[2, 3, 64]]
        assert shapes["keys"] == [[2, 128, 1, 16]]
    else:  # 4 and 8 do not divide HK=2 / HKV=2: replicated
        assert shapes["recurrent"] == [[2, 4, 16, 16]] and shapes["keys"] == [[2, 128, 2, 16]]


@pytest.mark.parametrize("fixture,tp", [("qwen3_5_tiny", 2), ("qwen3_5_tiny", 4), ("qwen3_next_tiny", 2),
                                        ("qwen3_next_tiny", 4), ("qwen3_next_tiny", 8)])
def test_load_pretrained_on_a_mesh_reads_each_shard(results, fixture, tp):
    _need(results, "loader", "checkpoint.py: load_pretrained(path, mesh=...)")
    r = _get(results, f"loader/{fixture}/{tp}")
    assert r["equal_to_placed"] and r["config_equal"], r
    assert r["split_reads"] > 0 and r["split_reads_whole"] == 0, r  # a split tensor is read one slice per device
    assert r["split_reads_fraction"] == [round(1 / tp, 4)], r
    if fixture == "qwen3_5_tiny":
        assert r["prefill_logits"] <= TOL and r["decode_logits"] <= TOL, r
        assert r["lazy_vs_placed_logits_bitwise"], r


@pytest.mark.parametrize("key", ["det/qwen3_5_tiny/2", "det/tiny-next/2"])
def test_deterministic_mode_is_bitwise_on_a_fixed_mesh(results, key):
    r = _get(results, key)
    assert r["state_misplaced"] == [], r
    assert r["twice"], r
    assert r["in_batch_row2"], r
    if "in_batch_row0" in r:  # the full set (qwen3_5_tiny); tiny-next (MoE): prefill alone vs in a batch only
        assert r["in_batch_row0"] and r["decode_in_batch_row0"] and r["decode_in_batch_row2"], r
        assert r["grid_split_equals_one_call"], r
        # across mesh sizes only within rounding: the row-split projections sum in a different order
        assert r["vs_single_device_max_diff"] <= TOL, r


@pytest.mark.parametrize("key", ["det/qwen3_5_tiny/4", "det/tiny-next/4"])
def test_deterministic_mode_on_four_devices_sums_in_a_fixed_order(results, key):
    r = _get(results, key)
    assert r["twice"] and r["in_batch_row2"] and r["state_misplaced"] == [], r
    f = _get(results, "fixed_order")
    assert f["dense_all_gathers_tp4"] > 0 and f["dense_all_gathers_tp2"] == 0, f
    # the MoE's routed and shared down projections too (per MoE layer, inside the 64-token tile map)
    assert f["moe_all_gathers_tp4"] > f["dense_all_gathers_tp4"] / 2 and f["moe_all_gathers_tp2"] == 0, f


def test_generate_and_prefix_cache_on_a_mesh(results):
    r = _get(results, "cache")
    assert r["cold_cached"] == 0 and r["warm_cached"] == 64, r
    assert r["warm_equals_cold"], r  # bitwise, deterministic mode, restored onto the same mesh
    assert r["n_tokens"] == 8, r
    assert r["first_token_equals_single_device"] and r["first_logprob_vs_single_device"] <= TOL, r
    assert r["checkpoint_misplaced"] == [] and r["restored_misplaced"] == [], r
    assert r["check_cache_recompute"] and r["round_trip_bitwise"], r


def test_grouped_layout_equals_hf_layout_on_one_device(results):
    _need(results, "layout", "config.py gdn_qkv_groups, layers/gdn.py _split_qkv")
    r = _get(results, "grouped_layout")
    assert r["logits_bitwise"] and r["state_bitwise"] and r["back_to_hf_config"], r


def test_pallas_kernels_run_per_shard_in_shard_map(results):
    _need(results, "kernels", "pallas_kernels/api.py: shard_map around the kernels")
    r = _get(results, "kernels")
    n = r["n_gdn"] + r["n_attn"]  # every GDN and every attention layer's kernel, per shard
    assert r["shard_maps_prefill"] == n and r["shard_maps_decode"] == n, r
    assert r["prefill_logits"] <= TOL and r["decode_logits"] <= TOL, r
    assert r["state_misplaced"] == [], r
    assert r["score_shard_maps"] == n and r["score_vs_single_device"] <= TOL, r  # score's prefill per shard too
    assert r["score_shared_vs_single_device_apart"] <= TOL, r  # a shared prefix's state restored on the mesh
    assert r["scan_shard_maps"] == n and r["scan_in_jaxpr"] and r["scan_prefill_logits"] <= TOL, r
    assert r["replay_shard_maps"] == n and r["replay_step_in_jaxpr"] and r["replay_decode_logits"] <= TOL, r
    assert r["replay_packed_in_jaxpr"], r  # the step on each shard's packed open-chunk buffers (their groups)
    assert r["replay_state_misplaced"] == [], r  # the replay caches split over the heads as planned
    # deterministic mode: every projection's fixed-tile kernel per shard too (tp=2 splits every axis of "tiny")
    # (the Pallas kernel inside at least as many as on one device; products too small for its tiles take the
    # reference, and a shard's product is smaller)
    assert r["det_shard_maps"] == n + r["n_proj"] and r["det_decode_shard_maps"] == n + r["n_proj"], r
    assert 0 < r["det_matmul_kernels_one_device"] <= r["det_matmul_kernels"] <= r["n_proj"], r
    assert r["det_prefill_logits"] <= TOL, r
    # tp=4: q_proj, o_proj and the MLP's three per attention layer, the MLP's per GDN layer, the head; o_proj and
    # down_proj sum their partials in device order
    n_attn, n_gdn = r["n_attn"], r["n_gdn"]
    assert r["det_tp4_shard_maps"] == n_attn * 5 + n_gdn * 3 + 1, r
    assert r["det_tp4_all_gathers"] == n_attn * 2 + n_gdn, r
    assert r["det_tp4_prefill_logits"] <= TOL, r


# ---- in-process checks (no devices needed) -------------------------------------------------------------------------

def test_plan_for_the_9b_shape():
    from jaxgdn import qwen3_5_9b
    from jaxgdn.sharding import plan

    c = qwen3_5_9b()  # HK 16, HV 32, H 16, HKV 4, MLP 12288, vocab 248320
    p2, p8, p16 = plan(c, 2), plan(c, 8), plan(c, 16)
    assert p2.gdn_heads and p2.attn_heads and p2.attn_kv and p2.mlp and p2.vocab
    assert p8.gdn_heads and p8.attn_heads and not p8.attn_kv and p8.mlp  # 8 does not divide HKV=4: replicated
    assert p16.gdn_heads and not p16.attn_kv


def test_specs_match_the_param_and_state_trees():
    import jax
    from jax.sharding import PartitionSpec as P

    import jaxgdn
    from jaxgdn.init import random_params
    from jaxgdn.sharding import param_specs, state_specs
    from jaxgdn.state import init_state

    for cfg in (jaxgdn.qwen3_5_9b(), jaxgdn.tiny_qwen3_next()):
        shapes = jax.eval_shape(lambda: random_params(cfg, jax.random.key(0)))
        for tp in (2, 4, 8):
            specs = param_specs(cfg, tp)
            leaves = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
            assert jax.tree.structure(shapes) == jax.tree.structure(specs, is_leaf=lambda s: isinstance(s, P))
            for x, s in zip(jax.tree.leaves(shapes), leaves):
                for n, ax in zip(x.shape, tuple(s)):
                    assert ax is None or n % tp == 0, (x.shape, s)
            for replay in (False, True):
                st = jax.eval_shape(lambda: init_state(cfg, 3, 64, replay=replay))
                ss = state_specs(cfg, tp, replay)
                assert jax.tree.structure(st) == jax.tree.structure(ss, is_leaf=lambda s: isinstance(s, P))
                for x, s in zip(jax.tree.leaves(st), jax.tree.leaves(ss, is_leaf=lambda s: isinstance(s, P))):
                    for n, ax in zip(x.shape, tuple(s)):
                        assert ax is None or n % tp == 0, (x.shape, s)


def test_grouped_qkv_layout():
    import numpy as np

    import jaxgdn
    from jaxgdn.sharding import qkv_permutation

    c = jaxgdn.qwen3_5_9b()
    HK, K, V, r = 16, 128, 128, 2
    perm = qkv_permutation(c, HK)
    assert sorted(perm.tolist()) == list(range(c.gdn_conv_dim))  # a permutation
    assert np.array_equal(qkv_permutation(c, 1), np.arange(c.gdn_conv_dim))
    group = 2 * K + r * V
    for g in (0, 5, 15):  # group g: q head g, k head g, then its r value heads — contiguous
        blk = perm[g * group:(g + 1) * group]
        assert np.array_equal(blk[:K], g * K + np.arange(K))
        assert np.array_equal(blk[K:2 * K], HK * K + g * K + np.arange(K))
        assert np.array_equal(blk[2 * K:], 2 * HK * K + g * r * V + np.arange(r * V))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(json.dumps(_worker()))
