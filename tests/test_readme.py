"""The README's Python examples run as written, on the tiny Hugging Face fixture (keeps the docs true to the API).

Placeholders are bound before each block runs: the checkpoint path "path/to/Qwen3.5-9B" (and `path`) is the
fixture directory; `prompts`, `prompt`, `completion` and the conversation turns are short token-id lists. The last
block (a 2-device mesh) is not run here: `tests/test_sharding.py` runs the same calls on an 8-device CPU mesh.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).absolute().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "qwen3_5_tiny"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def test_readme_examples_run():
    blocks = python_blocks()
    assert len(blocks) == 4, "README's Python examples changed: update this test"
    assert "make_mesh" in blocks[3]  # the 2-device block, covered by test_sharding.py
    ns: dict = {"path": str(FIXTURE), "prompts": [[1, 2, 3, 4, 5], [6, 7, 8]], "prompt": [1, 2, 3, 4],
                "completion": [5, 6, 7], "turn1_ids": [1, 2, 3], "turn2_ids": [4, 5]}
    for code in blocks[:3]:
        code = code.replace('"path/to/Qwen3.5-9B"', repr(str(FIXTURE)))
        exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the README's own examples
    # what the blocks promise: the last prefill (the pure function, on a fresh state) absorbed 4 and 2 tokens, a
    # generation per prompt, a cache that checks out, finite scores
    np.testing.assert_array_equal(np.asarray(ns["state"].position), [4, 2])
    assert len(ns["results"]) == 2 and len(ns["results"][0].tokens) >= 1
    assert ns["cache"].stats().misses == 2 and len(ns["out"].results) == 2
    assert len(ns["lps"][0]) == 3 and np.isfinite(ns["lps"][0]).all()  # one logprob per completion token
