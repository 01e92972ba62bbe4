"""Deterministic mode: a sequence's logits never depend on its neighbours in the batch or on how its prompt was
split on the 64-token grid; sampling depends on the request, not its batch slot."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgdn

FIXTURES = Path(__file__).parent / "fixtures"
WIDTH = 128  # every prefill below is padded to this width: one compiled program per batch size


@pytest.fixture(scope="module", params=["fixture-qwen3_5", "preset-tiny-next"])
def det_model(request):
    if request.param == "fixture-qwen3_5":
        return jaxgdn.load_pretrained(FIXTURES / "qwen3_5_tiny", deterministic=True)
    return jaxgdn.tiny_model("tiny-next", seed=21, deterministic=True)


def _prefill(model, rows):
    toks = np.zeros((len(rows), WIDTH), np.int32)
    for i, r in enumerate(rows):
        toks[i, :len(r)] = r
    lengths = jnp.asarray([len(r) for r in rows], jnp.int32)
    state, logits = jax.jit(jaxgdn.prefill_chunk)(model, model.init_state(len(rows), WIDTH), jnp.asarray(toks),
                                                  lengths)
    return state, np.asarray(logits)


def test_logits_alone_equal_inside_any_batch(det_model):
    rng = np.random.default_rng(0)
    V = det_model.config.vocab_size
    target = rng.integers(0, V, 100).tolist()
    _, alone = _prefill(det_model, [target])
    alone = alone[0, :100]
    for batch in (2, 5, 8):
        for where in sorted({0, batch // 2, batch - 1}):
            rows = [rng.integers(0, V, int(rng.integers(1, WIDTH + 1))).tolist() for _ in range(batch)]
            rows[where] = target
            _, logits = _prefill(det_model, rows)
            assert np.array_equal(logits[where, :100], alone), f"batch {batch}, row {where}"


def test_logits_equal_when_the_prompt_is_split_on_the_grid(det_model):
    rng = np.random.default_rng(1)
    target = rng.integers(0, det_model.config.vocab_size, 120).tolist()
    _, whole = _prefill(det_model, [target])
    f = jax.jit(jaxgdn.prefill_chunk)
    state = det_model.init_state(1, WIDTH)
    parts = []
    for a, b in ((0, 64), (64, 120)):
        toks = np.zeros((1, 64), np.int32)
        toks[0, :b - a] = target[a:b]
        state, logits = f(det_model, state, jnp.asarray(toks), jnp.asarray([b - a], jnp.int32))
        parts.append(np.asarray(logits)[0, :b - a])
    assert np.array_equal(np.concatenate(parts), whole[0, :120])


def test_generation_alone_equals_batched_greedy_and_sampled(det_model):
    rng = np.random.default_rng(2)
    V = det_model.config.vocab_size
    prompts = [rng.integers(0, V, n).tolist() for n in (30, 77, 5, 64)]
    for kwargs in (dict(), dict(temperature=0.9, top_p=0.95)):  # one compiled program: both are traced values
        batched = jaxgdn.generate(det_model, prompts, max_new_tokens=12, seed=[7, 8, 9, 10], **kwargs)
        for i in (0, 3):
            [alone] = jaxgdn.generate(det_model, [prompts[i]], max_new_tokens=12, seed=7 + i, **kwargs)
            assert alone.tokens == batched[i].tokens
            assert np.array_equal(np.array(alone.logprobs), np.array(batched[i].logprobs))


def test_negative_control_default_mode_differs():
    """Without deterministic mode the split case is visibly different on this CPU (XLA's GEMM for the attention
    probabilities @ values picks its blocking by the number of query rows), so the tests above can fail."""
    model = jaxgdn.load_pretrained(FIXTURES / "qwen3_5_tiny")  # deterministic=False
    rng = np.random.default_rng(1)
    target = rng.integers(0, model.config.vocab_size, 192).tolist()
    f = jax.jit(jaxgdn.prefill_chunk)
    _, whole = f(model, model.init_state(1, 256), jnp.asarray([target], jnp.int32), jnp.asarray([192], jnp.int32))
    s, _ = f(model, model.init_state(1, 256), jnp.asarray([target[:128]], jnp.int32), jnp.asarray([128], jnp.int32))
    _, later = f(model, s, jnp.asarray([target[128:]], jnp.int32), jnp.asarray([64], jnp.int32))
    diff = np.abs(np.asarray(later)[0] - np.asarray(whole)[0, 128:])
    assert diff.max() > 0  # not bitwise ...
    assert diff.max() < 1e-4  # ... though within fp32 tolerance


def test_deterministic_recurrent_mode_refuses_off_grid_prefill():
    model = jaxgdn.tiny_model("tiny", deterministic=True)
    state, _ = model.prefill_chunk(model.init_state(1, 128), jnp.ones((1, 10), jnp.int32))
    with pytest.raises(jaxgdn.InputError, match="off the 64-token grid"):
        model.prefill_chunk(state, jnp.ones((1, 5), jnp.int32))
    # replay decode mode continues exactly from anywhere, so it accepts the same call
    replay = model.with_decode_mode("replay")
    state, _ = replay.prefill_chunk(replay.init_state(1, 128), jnp.ones((1, 10), jnp.int32))
    state, _ = replay.prefill_chunk(state, jnp.ones((1, 5), jnp.int32))
    assert int(state.position[0]) == 15 and int(state.provenance[0]) == jaxgdn.Provenance.PREFILL


def test_library_compiles_its_functions_with_its_compiler_options():
    """Every compilation inside jaxgdn goes through `jaxgdn.model.jit` (COMPILER_OPTIONS: no XLA excess precision).
    With plain `jax.jit` a fusion may keep bf16 intermediates in fp32, and on a 2-GPU mesh that broke batch
    invariance (BENCHMARKS.md, runs S3-S6). Allowed: the definition itself, the sharded zero state (no
    arithmetic) and the weights digest's sums (`params._leaf_sums`: integer arithmetic only, exact in any order;
    params.py cannot import model.py, which imports it)."""
    import ast

    class PlainJits(ast.NodeVisitor):  # (file, enclosing function) of every jax.jit / `from jax import jit`
        def __init__(self, name):
            self.name, self.scope, self.found = name, ["<module>"], []

        def visit_FunctionDef(self, node):
            self.scope.append(node.name)
            self.generic_visit(node)
            self.scope.pop()

        visit_AsyncFunctionDef = visit_FunctionDef

        def visit_Attribute(self, node):
            if node.attr == "jit" and isinstance(node.value, ast.Name) and node.value.id == "jax":
                self.found.append((self.name, self.scope[-1]))
            self.generic_visit(node)

        def visit_ImportFrom(self, node):
            if node.module == "jax" and any(a.name == "jit" for a in node.names):
                self.found.append((self.name, "from jax import jit"))

    allowed = {("model.py", "jit"), ("sharding.py", "_sharded_zeros"), ("params.py", "_leaf_sums")}
    found = []
    for path in sorted(Path(jaxgdn.__file__).parent.rglob("*.py")):
        finder = PlainJits(path.name)
        finder.visit(ast.parse(path.read_text()))
        found += finder.found
    assert found, "the scan found no jax.jit at all: it is broken"
    assert set(found) <= allowed, sorted(set(found) - allowed)
