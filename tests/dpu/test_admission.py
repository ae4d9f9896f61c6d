"""The admission policy alone (sans I/O): the claim order from what the agent last read of each server."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgepath.dma import wire
from edgepath.dpu.admission import Admission, Choice

BLOCK = wire.PREFIX_BLOCK


@dataclass
class Server:
    free_hint: int
    prefixes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))


def table_of(*sequences: np.ndarray) -> np.ndarray:
    """A published prefix table holding ``sequences`` (as a slot server writes it)."""
    return wire.prefix_table(sequences, wire.PREFIX_ENTRIES)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n).astype(np.int32)


def test_servers_with_a_free_slot_come_first_then_the_most_free() -> None:
    order = Admission(256).order(tokens(8, 1), [Server(0), Server(2), Server(5)])
    assert order == [Choice(2, 0), Choice(1, 0), Choice(0, 0)]


def test_the_longest_held_prefix_wins_over_free_slots() -> None:
    system = tokens(3 * BLOCK, 2)
    request = np.concatenate([system, tokens(BLOCK, 3)])
    servers = [Server(6), Server(1, table_of(system)), Server(2, table_of(system[:BLOCK]))]
    assert Admission(8 * BLOCK).order(request, servers) == [Choice(1, 3), Choice(2, 1), Choice(0, 0)]


def test_a_held_prefix_counts_for_nothing_on_a_full_server() -> None:
    system = tokens(2 * BLOCK, 4)
    servers = [Server(0, table_of(system)), Server(1)]
    assert Admission(4 * BLOCK).order(system, servers) == [Choice(1, 0), Choice(0, 0)]


def test_a_request_shorter_than_a_block_is_ordered_by_free_slots_only() -> None:
    short = tokens(BLOCK - 1, 5)
    servers = [Server(1, table_of(np.concatenate([short, tokens(BLOCK, 6)]))), Server(3)]
    assert Admission(4 * BLOCK).order(short, servers) == [Choice(1, 0), Choice(0, 0)]
