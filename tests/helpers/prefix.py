"""Reading a published prefix table, for the tests of prefix affinity."""

from __future__ import annotations

import numpy as np

from edgepath.contract import wire


def prefix_match(table: np.ndarray, tokens: np.ndarray) -> int:
    """How many leading whole blocks of ``tokens`` a published prefix table holds."""
    chain = wire.PrefixChain(len(tokens))
    chain.compute(np.ascontiguousarray(tokens, dtype=np.int32))
    return chain.matched(table)
