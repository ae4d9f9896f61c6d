"""The admission policy alone (sans I/O): predictions from a server's published load, and the claim decision
from what the agent last read of each server."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from edgepath.contract import wire
from edgepath.contract.wire import Load
from edgepath.dpu.admission import MIN_PREFILL, Admission, Choice, Prediction, predict

BLOCK = wire.PREFIX_BLOCK
PACE = {"token_ms": 3.0, "overhead_ms": 6.0, "stall_ms": 1500.0}
NONE = Prediction(0.0, 0.0)
BOUND = 2000.0


@dataclass
class Server:
    free_hint: int
    prefixes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    load: Load = field(default_factory=Load)
    unseen: int = 0


def table_of(*sequences: np.ndarray) -> np.ndarray:
    """A published prefix table holding ``sequences`` (as a slot server writes it)."""
    return wire.prefix_table(sequences, wire.PREFIX_ENTRIES)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n).astype(np.int32)


# -- predictions -------------------------------------------------------------------------------------------
def test_the_load_words_carry_the_load_whole() -> None:
    load = Load(1234, 7, 3, 2.5, 6.25, 1500.0)
    assert Load.of(*load.words()) == load
    assert Load.of(0, 0) == Load() and not Load().published
    huge = Load(2**40, 2**20, 2**20, 1e4, 1e7, 1e9)  # saturated, never wrapped
    assert Load.of(*huge.words()) == Load(2**32 - 1, 2**16 - 1, 2**16 - 1, 4294.967295, 1048.575, 40950.0)


def test_a_server_without_a_published_load_answers_at_once() -> None:
    assert predict(Load(), 500) == NONE


def test_an_idle_server_makes_a_prompt_wait_for_nothing_but_its_own_compute() -> None:
    assert predict(Load(**PACE), 300) == Prediction(6.0 + 3.0 * 300, 0.0)


def test_streams_that_decode_add_their_tokens_and_half_a_step() -> None:
    # 4 decoding: half the step under way (6 + 12) / 2, then one step of 4 + 100 tokens
    got = predict(Load(decoding=4, **PACE), 100)
    assert got.ttft_ms == pytest.approx(9.0 + 6.0 + 3.0 * 104)
    assert got.wait_ms == pytest.approx(got.ttft_ms - 306.0)


def test_prompts_ahead_with_nothing_decoding_go_first_in_one_step_then_decode() -> None:
    got = predict(Load(pending_tokens=500, prefilling=1, **PACE), 100)
    assert got.ttft_ms == pytest.approx((6.0 + 1500.0) + (6.0 + 3.0 * 101))
    assert got.wait_ms == pytest.approx(got.ttft_ms - 306.0)


def test_a_prompt_larger_than_a_steps_budget_takes_several_steps_within_the_stall_bound() -> None:
    load = Load(decoding=8, token_ms=3.0, overhead_ms=6.0, stall_ms=300.0)
    budget = (300 - 6) // 3 - 8  # 90 prompt tokens a step beside 8 streams
    got = predict(load, 200)
    assert got.ttft_ms == pytest.approx(0.5 * (6 + 24) + 2 * (6 + 3 * (8 + budget)) + (6 + 3 * (8 + 200 - 2 * budget)))


def test_a_step_always_carries_some_prompt_however_many_decode() -> None:
    load = Load(decoding=200, token_ms=3.0, overhead_ms=6.0, stall_ms=300.0)  # the streams alone fill the bound
    got = predict(load, MIN_PREFILL * 2)
    assert got.ttft_ms == pytest.approx(0.5 * (6 + 600) + 2 * (6 + 3 * (200 + MIN_PREFILL)))


def test_claims_the_server_has_not_seen_count_as_prompts_as_long_as_this_one() -> None:
    seen = predict(Load(pending_tokens=200, prefilling=1, **PACE), 200)
    assert predict(Load(**PACE), 200, unseen=1, tokens=200) == seen


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
    loaded = [Server(2, load=Load(pending_tokens=n, prefilling=1, **PACE)) for n in (3000, 1000)]
    decision = Admission(1024).decide(tokens(100, 6), loaded, bound_ms=500.0)
    assert decision.choices == []
    assert decision.over_bound_ms == pytest.approx(predict(loaded[1].load, 100).wait_ms)


def test_an_idle_server_never_refuses_even_a_prompt_far_longer_than_the_bound() -> None:
    decision = Admission(4096).decide(tokens(4000, 7), [Server(1, load=Load(**PACE))], bound_ms=1.0)
    assert [c.server for c in decision.choices] == [0] and decision.choices[0].prediction.wait_ms == 0.0


def test_a_request_shorter_than_a_block_is_ordered_by_free_slots_only() -> None:
    short = tokens(BLOCK - 1, 5)
    servers = [Server(1, table_of(np.concatenate([short, tokens(BLOCK, 6)]))), Server(3)]
    assert [c.server for c in Admission(4 * BLOCK).decide(short, servers, BOUND).choices] == [1, 0]
