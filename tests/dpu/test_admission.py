"""The admission policy alone (sans I/O): the claim decision from what the agent last read of each server (the
predictions it orders by are the step planner's, tests/contract/test_plan.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from edgepath.contract import wire
from edgepath.contract.plan import Costs, Load, PolicyOptions, Prediction, Prompt, predict
from edgepath.dpu.admission import Admission, Choice, Claimed

BLOCK = wire.PREFIX_BLOCK
PACE = {"costs": Costs(overhead_ms=6.0, prompt_ms=3.0, decode_ms=3.0), "options": PolicyOptions(1500.0, 16, 4096)}
NONE = Prediction(0.0, 0.0)
BOUND = 2000.0


@dataclass
class Server:
    free_hint: int
    prefixes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    load: Load = field(default_factory=Load)
    unseen: list[Claimed | None] = field(default_factory=list)


def table_of(*sequences: np.ndarray) -> np.ndarray:
    """A published prefix table holding ``sequences`` (as a slot server writes it)."""
    return wire.prefix_table([(0, tokens) for tokens in sequences], wire.PREFIX_ENTRIES)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n).astype(np.int32)


# -- decisions ---------------------------------------------------------------------------------------------
def test_servers_with_a_free_slot_come_first_then_the_most_free() -> None:
    decision = Admission(256).decide(tokens(8, 1), [Server(0), Server(2), Server(5)], BOUND)
    assert decision.choices == [Choice(2, 0, NONE), Choice(1, 0, NONE), Choice(0, 0, NONE)]


def test_the_longest_held_prefix_wins_over_free_slots_when_nothing_is_predicted() -> None:
    system = tokens(3 * BLOCK, 2)
    request = np.concatenate([system, tokens(BLOCK, 3)])
    servers = [Server(6), Server(1, table_of(system)), Server(2, table_of(system[:BLOCK]))]
    decision = Admission(8 * BLOCK).decide(request, servers, BOUND)
    assert [c.server for c in decision.choices] == [1, 2, 0] and [c.matched for c in decision.choices] == [3, 1, 0]


def test_the_lowest_predicted_time_to_first_token_wins_and_a_held_prefix_lowers_it() -> None:
    system = tokens(4 * BLOCK, 4)
    request = np.concatenate([system, tokens(BLOCK, 5)])
    busy = Server(4, load=Load(decoding=6, **PACE))
    holds = Server(1, table_of(system), load=Load(decoding=2, **PACE))
    idle = Server(8, load=Load(**PACE))
    decision = Admission(8 * BLOCK).decide(request, [busy, holds, idle], BOUND)
    assert [c.server for c in decision.choices] == [1, 2, 0]
    assert decision.choices[0].prediction.ttft_ms < decision.choices[1].prediction.ttft_ms


def test_over_the_bound_everywhere_is_refused_with_the_least_predicted_wait() -> None:
    loaded = [Server(2, load=Load(waiting=(Prompt(0, n),), **PACE)) for n in (3000, 1000)]
    decision = Admission(1024).decide(tokens(100, 6), loaded, bound_ms=500.0)
    assert decision.choices == []
    assert decision.over_bound_ms == pytest.approx(predict(loaded[1].load, Prompt(0, 100)).wait_ms)


def test_an_idle_server_never_refuses_even_a_prompt_far_longer_than_the_bound() -> None:
    decision = Admission(4096).decide(tokens(4000, 7), [Server(1, load=Load(**PACE))], bound_ms=1.0)
    assert [c.server for c in decision.choices] == [0] and decision.choices[0].prediction.wait_ms == 0.0


def test_a_request_shorter_than_a_block_is_ordered_by_free_slots_only() -> None:
    short = tokens(BLOCK - 1, 5)
    servers = [Server(1, table_of(np.concatenate([short, tokens(BLOCK, 6)]))), Server(3)]
    assert [c.server for c in Admission(4 * BLOCK).decide(short, servers, BOUND).choices] == [1, 0]


def test_a_prefix_shared_with_a_claim_not_taken_yet_counts_as_held_there() -> None:
    """A burst of chats sharing a system prompt: the server computes it for the first and the others copy it, so
    the second is predicted behind the first with only its own part to compute, not the whole prompt twice."""
    system = tokens(4 * BLOCK, 8)
    first, second = (np.concatenate([system, tokens(BLOCK // 2, seed)]) for seed in (9, 10))
    admission = Admission(8 * BLOCK)
    empty = np.zeros(wire.PREFIX_ENTRIES, dtype=np.uint64)  # a server that keeps prefixes, holding none yet
    idle = Server(8, empty, Load(**PACE))
    admission.decide(first, [idle], BOUND)
    ahead = Claimed(Prompt(0, len(first)), admission.chain)
    busy = Server(7, empty, Load(**PACE), [ahead])
    choice = admission.decide(second, [busy], BOUND).choices[0]
    assert choice.matched == 4
    assert choice.prediction == predict(busy.load, Prompt(4 * BLOCK, len(second) - 4 * BLOCK), [ahead.prompt])
    keeps_none = Server(7, load=Load(**PACE), unseen=[ahead])  # no prefix table: it copies nothing
    assert admission.decide(second, [keeps_none], BOUND).choices[0].matched == 0
