"""How llama.cpp cuts a step into micro-batches (one KV stream per sequence): what the step cost model counts."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

from edgepath.model.llama_context import micro_batches
from edgepath.model.prefix import runs


@pytest.mark.parametrize(
    ("parts", "expected"),
    [
        ([(0, 1)], 1),
        ([(0, 1), (1, 1), (2, 1), (3, 1)], 1),  # one run of consecutive sequence ids: one micro-batch
        ([(0, 1), (2, 1), (4, 1), (6, 1)], 4),  # every other id: a micro-batch each
        ([(0, 1), (1, 1), (2, 8)], 2),  # a prompt chunk beside decoding streams: its first token rides along
        ([(0, 1), (1, 1), (5, 8)], 2),  # ... or, away from them, it is a micro-batch of its own
        ([(0, 1), (1, 8), (2, 64)], 3),  # chunks of two lengths: one more level each
        ([(3, 700)], 2),  # one prompt past n_ubatch (512)
        ([(0, 300), (1, 300)], 2),  # two chunks of 300: at most 256 tokens each within 512
        ([], 0),
    ],
)
def test_micro_batches_follow_llama_cpps_equal_split(parts: list[tuple[int, int]], expected: int) -> None:
    assert micro_batches(parts, 512) == expected


def test_runs_count_consecutive_ids() -> None:
    assert runs([]) == 0
    assert runs([4]) == 1
    assert runs([0, 1, 2, 5, 6, 9]) == 3
    assert runs([6, 5, 0]) == 2  # order does not matter: the handler sorts a step by sequence id
