"""The one step planner (sans I/O): the policy the slot server's model side runs, and the prediction an agent makes
by running that policy forward -- checked against a slot server simulated sequence by sequence."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from edgepath.contract import wire
from edgepath.contract.plan import (
    FLOOR_MEMORY_S,
    Costs,
    FloorMemory,
    Load,
    PolicyOptions,
    Prediction,
    Prompt,
    Step,
    StepPolicy,
    chunk_attended,
    decodes,
    floor_lent,
    own_ms,
    predict,
    prefill_order,
)

FLAT = Costs(overhead_ms=10.0, prompt_ms=2.0, decode_ms=2.0)  # one rate, no context term: easy arithmetic
TRUE = Costs(overhead_ms=5.5, prompt_ms=1.9, decode_ms=3.5, context_ms=2.5, decode_context_ms=4.5)


def policy(stall_ms: float = 100.0, min_prefill: int = 8, batch: int = 512) -> StepPolicy:
    return StepPolicy(PolicyOptions(stall_ms, min_prefill, batch))


def fresh(*remaining: int) -> list[Prompt]:
    return [Prompt(0, n) for n in remaining]


# -- the policy ---------------------------------------------------------------------------------------------
def test_decoding_slots_alone_carry_no_prompt_tokens() -> None:
    assert policy().plan(FLAT, 6, 600, []) == []


def test_nothing_decoding_takes_the_oldest_prompt_whole() -> None:
    assert policy().plan(FLAT, 0, 0, fresh(300)) == [300]  # 610 ms, past the 100 ms bound: nobody waits on it


def test_nothing_decoding_whole_prompt_is_capped_by_the_batch() -> None:
    assert policy(batch=256).plan(FLAT, 0, 0, fresh(300)) == [256]


def test_nothing_decoding_later_prompts_join_only_within_the_stall_bound() -> None:
    assert policy().plan(FLAT, 0, 0, fresh(60, 20)) == [60, 0]  # 45 tokens fit 100 ms; the first takes them all
    # each chunk is a micro-batch of its own (10 ms): 30 ms for the first, then at most a quarter of that for those
    # behind it -- 7.5 ms, not even their micro-batch -- within the bound or not
    assert policy().plan(FLAT, 0, 0, fresh(10, 20, 30)) == [10, 0, 0]
    # 210 ms for the first: 52.5 ms behind it, the second whole (50 ms), 2.5 ms left for the third
    assert policy(stall_ms=1000.0).plan(FLAT, 0, 0, fresh(100, 20, 30)) == [100, 20, 0]


def test_a_later_prompt_delays_an_earlier_ones_first_token_by_a_quarter_at_most() -> None:
    """The prompts behind one that gets its first token add at most JOIN_SHARE of the step up to it: its first
    token was predicted, and admitted, without them."""
    # 5 streams (20 ms) and the first prompt's last 30 tokens (70 ms): 90 ms, a quarter of it 22.5 ms behind
    assert policy(stall_ms=1000.0).plan(FLAT, 5, 0, fresh(30, 100, 100)) == [30, 6, 0]
    # a prompt that does not finish leaves nothing behind it: it takes what the bound allows
    assert policy(stall_ms=1000.0).plan(FLAT, 5, 0, fresh(1000, 100)) == [485, 0]


def test_at_a_full_house_the_prompts_behind_a_first_token_fill_the_stall_bound() -> None:
    """Objective 9: while every slot is taken, every waiting prompt starts in one step if the stall bound allows
    them all (nobody can arrive to be delayed); if not, the join share holds as ever."""
    # the same step as above, 90 ms up to the first's first token: both prompts behind it whole (210 ms each)
    assert policy(stall_ms=1000.0).plan(FLAT, 5, 0, fresh(30, 100, 100), full=True) == [30, 100, 100]
    # 300 ms: the second's 210 would fit, the third's not -- gathering would delay the first for no one's start
    join = policy(stall_ms=300.0).plan(FLAT, 5, 0, fresh(30, 100, 100))
    assert policy(stall_ms=300.0).plan(FLAT, 5, 0, fresh(30, 100, 100), full=True) == join == [30, 6, 0]
    # a floor's first token still rides alone (objective 7), and a lent floor still holds the borrowers' prompts to
    # lent_ms (objective 8): 50 ms, a micro-batch and 20 tokens, all of it the first's
    assert policy(stall_ms=1000.0).plan(FLAT, 5, 0, fresh(30, 100), floors=1, full=True) == [30, 0]
    assert policy(stall_ms=1000.0).plan(FLAT, 5, 0, fresh(30, 100), lent_ms=50.0, full=True) == [20, 0]


def test_a_house_is_full_when_its_running_requests_take_every_slot_and_never_when_its_slots_are_unknown() -> None:
    busy = Load(FLAT, PolicyOptions(1000.0, 8, 512), decoding=2, waiting=(Prompt(0, 5),))
    assert replace(busy, slots=3).full and replace(busy, slots=2).full
    assert not replace(busy, slots=4).full and not busy.full  # a slot free; the slots not known (0)


def test_while_slots_decode_prompt_tokens_fill_the_stall_bound() -> None:
    # the streams' micro-batch 20 ms, the chunk's own 10 ms: 35 tokens in the 70 ms left
    assert policy().plan(FLAT, 5, 0, fresh(100)) == [35]
    assert policy().plan(FLAT, 5, 0, fresh(30, 100)) == [30, 0]  # 10 ms left: a second chunk's micro-batch alone
    # 70 ms with the first's 20 tokens: a quarter of it, 17.5 ms, behind it -- its micro-batch and 3 tokens
    assert policy().plan(FLAT, 5, 0, fresh(20, 100)) == [20, 3]


def test_streams_in_several_runs_leave_less_room_for_prompt_tokens() -> None:
    """Decoding streams in two runs of sequence ids cost llama.cpp two micro-batches: 10 ms less for prompts."""
    assert policy().plan(FLAT, 5, 0, fresh(100), runs=2) == [30]


def test_prompts_are_concentrated_not_spread() -> None:
    assert policy().plan(FLAT, 2, 0, fresh(200, 200, 200)) == [38, 0, 0]


def test_under_load_a_waiting_prompt_still_progresses() -> None:
    assert policy(min_prefill=8).plan(FLAT, 40, 0, fresh(100, 50)) == [8, 0]  # 40 streams alone fill 90 ms
    assert policy(min_prefill=8).plan(FLAT, 60, 0, fresh(5, 50)) == [5, 3]


def test_a_step_never_exceeds_the_batch() -> None:
    plan = policy(stall_ms=10_000.0, batch=64).plan(FLAT, 10, 0, fresh(100, 100))
    assert plan == [54, 0]


def test_a_longer_context_means_fewer_prompt_tokens_within_the_bound() -> None:
    costs = Costs(overhead_ms=10.0, prompt_ms=2.0, decode_ms=2.0, context_ms=10.0)
    early = policy(stall_ms=300.0).plan(costs, 2, 0, [Prompt(0, 1000)])[0]
    late = policy(stall_ms=300.0).plan(costs, 2, 0, [Prompt(2000, 1000)])[0]
    assert late < early
    for done, take in ((0, early), (2000, late)):  # the most that fits (two micro-batches): one more would not
        step = Step(take, 2, chunk_attended(done, take), 2, ubatches=2)
        assert (
            costs.step_ms(step)
            <= 300.0
            < costs.step_ms(replace(step, prompt=take + 1, attended=chunk_attended(done, take + 1)))
        )


@pytest.mark.parametrize(
    ("decoding", "waiting", "message"),
    [(-1, [], "decoding >= 0"), (2, [Prompt(0, 5), Prompt(0, 0)], "every waiting prompt >= 1"), (512, [], "no room")],
)
def test_impossible_plans_are_refused(decoding: int, waiting: list[Prompt], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy().plan(FLAT, decoding, 0, waiting)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stall_ms": 0.0}, "stall_ms must be > 0"),
        ({"stall_ms": float("nan")}, "stall_ms must be > 0"),
        ({"min_prefill": 0}, "min_prefill must be >= 1"),
        ({"batch": 1}, "batch must be >= 2"),
    ],
)
def test_bad_options_say_what_is_allowed(kwargs: dict[str, float], message: str) -> None:
    options = {"stall_ms": 100.0, "min_prefill": 8, "batch": 64, **kwargs}
    with pytest.raises(ValueError, match=message):
        PolicyOptions(**options)  # type: ignore[arg-type]


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="finite and >= 0"):
        Costs(1.0, -2.0)


# -- the prediction -----------------------------------------------------------------------------------------
OPTIONS = PolicyOptions(1500.0, 16, 2048)
PACED = Costs(overhead_ms=6.0, prompt_ms=3.0, decode_ms=3.0)


def loaded(**kwargs: object) -> Load:
    return Load(PACED, OPTIONS, **kwargs)  # type: ignore[arg-type]


def test_a_server_without_a_published_load_answers_at_once() -> None:
    assert predict(Load(), Prompt(0, 500)) == Prediction(0.0, 0.0)


def test_an_idle_server_makes_a_prompt_wait_for_nothing_but_its_own_compute() -> None:
    assert predict(loaded(), Prompt(0, 300)) == Prediction(6.0 + 3.0 * 300, 0.0)
    assert own_ms(loaded(), Prompt(0, 300)) == 6.0 + 3.0 * 300


def test_streams_that_decode_add_their_tokens_and_half_a_step() -> None:
    # half of (6 + 12), then one step of 4 + 100 tokens in two micro-batches (the streams', the chunk's)
    got = predict(loaded(decoding=4), Prompt(0, 100))
    assert got.ttft_ms == pytest.approx(9.0 + (6.0 + 3.0 * 4) + (6.0 + 3.0 * 100))
    assert got.wait_ms == pytest.approx(got.ttft_ms - 306.0)


def test_a_prompt_ahead_with_nothing_decoding_is_under_way_then_decodes() -> None:
    got = predict(loaded(waiting=(Prompt(0, 500),)), Prompt(0, 100))
    assert got.ttft_ms == pytest.approx(0.5 * (6.0 + 1500.0) + (6.0 + 3.0 * 1) + (6.0 + 3.0 * 100))


def test_the_step_under_way_counts_for_what_is_left_of_it_when_the_server_says_how_long_it_ran() -> None:
    """ABI 11: the heartbeat and the load's version are the server's clock, so how long the first step planned from
    the load has run is known; then it counts for what is left of it (never less than nothing), not half."""
    load = loaded(waiting=(Prompt(0, 500),))
    step, after = 6.0 + 1500.0, (6.0 + 3.0 * 1) + (6.0 + 3.0 * 100)
    assert predict(load, Prompt(0, 100), under_way_ms=0.0).ttft_ms == pytest.approx(step + after)
    assert predict(load, Prompt(0, 100), under_way_ms=1200.0).ttft_ms == pytest.approx(step - 1200.0 + after)
    assert predict(load, Prompt(0, 100), under_way_ms=9000.0).ttft_ms == pytest.approx(after)  # overdue: ends now
    assert predict(load, Prompt(0, 100), under_way_ms=None) == predict(load, Prompt(0, 100))  # unknown: half
    assert predict(loaded(), Prompt(0, 100), under_way_ms=50.0).wait_ms == 0.0  # idle: nothing under way


def test_how_long_the_step_under_way_ran_is_the_heartbeat_less_the_loads_version() -> None:
    assert wire.under_way_ms(5_000_000_000, 4_250_000_000) == 750.0
    assert wire.under_way_ms(4_000_000_000, 4_250_000_000) == 0.0  # beat stored before the load: the step began
    assert wire.under_way_ms(0, 4_250_000_000) is None and wire.under_way_ms(5_000_000_000, 0) is None


def test_a_prompt_larger_than_a_steps_budget_takes_several_steps_within_the_stall_bound() -> None:
    load = Load(PACED, PolicyOptions(300.0, 16, 2048), decoding=8)
    budget = (300 - 6 - 24 - 6) // 3  # 88 prompt tokens a step beside 8 streams, in a micro-batch of their own
    got = predict(load, Prompt(0, 200))
    assert got.ttft_ms == pytest.approx(0.5 * 30 + 2 * (30 + 6 + 3 * budget) + (30 + 6 + 3 * (200 - 2 * budget)))


def test_a_step_always_carries_some_prompt_however_many_decode() -> None:
    load = Load(PACED, PolicyOptions(300.0, 16, 2048), decoding=200)  # the streams alone fill the bound
    got = predict(load, Prompt(0, 32))
    assert got.ttft_ms == pytest.approx(0.5 * (6 + 600) + 2 * ((6 + 600) + (6 + 3 * 16)))


def test_claims_the_server_has_not_seen_count_ahead_of_this_one() -> None:
    got = predict(loaded(), Prompt(0, 400), [Prompt(0, 400)])
    # the other whole (1206 ms) and, behind its first token, only a quarter of that step of this one: 100 tokens in
    # 301.5 ms less their micro-batch's 6; then beside the other, now decoding, the 300 left
    assert got.ttft_ms == pytest.approx((12.0 + 3.0 * 498) + (6.0 + 3.0 * 1) + (6.0 + 3.0 * 302))


def test_a_prediction_past_any_bound_is_infinite_not_a_hang() -> None:
    load = Load(PACED, PolicyOptions(10.0, 1, 2048), decoding=1000)
    assert math.isinf(predict(load, Prompt(0, 100_000)).ttft_ms)


# -- the same policy on both sides: a slot server simulated sequence by sequence -------------------------------
@dataclass
class Sequence:
    """One running request of the simulated server: its prompt, what of it is computed, what it decoded."""

    prompt: int
    done: int
    decoded: int = 0
    arrived_ms: float = 0.0
    first_ms: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.done < self.prompt


@dataclass
class SimulatedServer:
    """A slot server as the handler runs it: one step at a time, each planned by the policy from its sequences
    (a decoding sequence holds its prompt and all but its last decoded token), each costing what the costs say."""

    costs: Costs
    options: PolicyOptions
    running: list[Sequence] = field(default_factory=list)
    now: float = 0.0
    slots: int = 0  # 0: as many as it runs, never full

    def load(self) -> Load:
        decoding = [s for s in self.running if not s.prefilling]
        waiting = tuple(Prompt(s.done, s.prompt - s.done) for s in self.running if s.prefilling)
        longest = max((s.prompt + s.decoded - 1 for s in decoding), default=0)
        runs = 1 if decoding else 0
        return Load(self.costs, self.options, len(decoding), longest, waiting, runs=runs, slots=self.slots)

    def step(self) -> None:
        decoding = [s for s in self.running if not s.prefilling]
        waiting = [s for s in self.running if s.prefilling]
        load = self.load()
        plan = StepPolicy(self.options).plan
        takes = plan(self.costs, len(decoding), load.longest, load.waiting, load.runs, full=load.full)
        # each attends what the longest holds and itself (llama.cpp pads the streams to the longest)
        context = len(decoding) * max((s.prompt + s.decoded for s in decoding), default=0)
        attended = sum(chunk_attended(s.done, take) for s, take in zip(waiting, takes, strict=True))
        ubatches = (1 if decoding else 0) + sum(1 for take in takes if take)  # its streams in one run
        self.now += self.costs.step_ms(Step(sum(takes), len(decoding), attended, context, ubatches))
        for s in decoding:
            s.decoded += 1
        for s, take in zip(waiting, takes, strict=True):
            s.done += take
            if not s.prefilling:
                s.decoded, s.first_ms = 1, self.now


@settings(max_examples=300, deadline=None)
@given(
    decoding=st.lists(st.tuples(st.integers(1, 600), st.integers(1, 60)), max_size=6),
    waiting=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 900)), max_size=4),
    unseen=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 900)), max_size=2),
    new=st.tuples(st.integers(0, 300), st.integers(1, 900)),
    costs=st.tuples(st.floats(0, 20), st.floats(0.1, 10), st.floats(0.1, 10), st.floats(0, 5), st.floats(0, 10)),
    stall=st.floats(20, 3000),
    min_prefill=st.integers(1, 64),
    spare=st.sampled_from([None, 0, 1]),
)
def test_the_agents_prediction_is_what_the_slot_server_then_does(
    decoding: list[tuple[int, int]],
    waiting: list[tuple[int, int]],
    unseen: list[tuple[int, int]],
    new: tuple[int, int],
    costs: tuple[float, float, float, float, float],
    stall: float,
    min_prefill: int,
    spare: int | None,
) -> None:
    """The server publishes its load at the start of a step; the request arrives half-way through that step (a
    step under way counts half), joins from the next one behind the ``unseen`` claims, and its first token comes
    exactly when the agent predicted (no stream ends meanwhile; steps cost what the costs say) -- its slots not
    known, or ``spare`` more than its requests then take (0: a full house, objective 9)."""
    published = Costs(*costs).published()
    options = PolicyOptions(float(np.float32(stall)), min_prefill, 4096)
    slots = 0 if spare is None else len(decoding) + len(waiting) + len(unseen) + 1 + spare
    server = SimulatedServer(published, options, slots=slots)
    server.running = [Sequence(prompt, prompt, decoded) for prompt, decoded in decoding]
    server.running += [Sequence(done + left, done) for done, left in waiting]
    record = wire.load_record(server.load())
    record["end"] = record["begin"] = 1
    read = wire.read_load(record[0])  # what the agent reads: the load region, float32 and all
    assert read is not None
    seen = replace(read, slots=slots)  # and the pool's slots, from its header (dpu/links.py)
    assert seen == server.load()
    cached, uncached = new
    prediction = predict(seen, Prompt(cached, uncached), [Prompt(done, left) for done, left in unseen])
    # past MAX_STEPS steps a prediction is infinite (a stall bound below a micro-batch's cost leaves prompts
    # min_prefill tokens a step): no server is asked to follow that far
    assume(math.isfinite(prediction.ttft_ms))
    started = server.now
    if server.running:
        server.step()  # the step under way when it arrives
    arrival = started + (server.now - started) / 2
    server.running += [Sequence(done + left, done) for done, left in unseen]
    mine = Sequence(cached + uncached, cached, arrived_ms=arrival)
    server.running.append(mine)
    while mine.first_ms is None:
        server.step()
    assert mine.first_ms - arrival == pytest.approx(prediction.ttft_ms, rel=1e-9, abs=1e-6)
    alone = SimulatedServer(published, options, [Sequence(cached + uncached, cached)])
    while alone.running[0].first_ms is None:
        alone.step()
    assert prediction.wait_ms == pytest.approx(max(0.0, prediction.ttft_ms - alone.now), rel=1e-9, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(
    decoding=st.integers(1, 32),
    runs=st.integers(1, 8),
    longest=st.integers(0, 20_000),
    waiting=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 3000)), min_size=1, max_size=4),
    costs=st.tuples(st.floats(0, 20), st.floats(0.1, 10), st.floats(0.1, 10), st.floats(0, 5), st.floats(0, 10)),
    stall=st.floats(50, 3000),
)
def test_while_streams_decode_a_planned_step_stays_within_the_stall_bound_but_for_min_prefill(
    decoding: int,
    runs: int,
    longest: int,
    waiting: list[tuple[int, int]],
    costs: tuple[float, float, float, float, float],
    stall: float,
) -> None:
    c = Costs(*costs)
    options = PolicyOptions(stall, 16, 4096)
    prompts = [Prompt(done, left) for done, left in waiting]
    takes = StepPolicy(options).plan(c, decoding, longest, prompts, runs)
    step = Step(
        sum(takes),
        decoding,
        sum(chunk_attended(p.done, t) for p, t in zip(prompts, takes, strict=True)),
        decoding * (longest + 1),
        min(runs, decoding) + sum(1 for t in takes if t),  # the streams' runs (at most one each), one per chunk
    )
    if sum(takes) > options.min_prefill:  # more than the least it must carry: then it is within the bound
        assert c.step_ms(step) <= stall * (1 + 1e-9)


def test_the_load_region_carries_the_load_whole_and_sums_what_it_cannot_list() -> None:
    load = Load(TRUE.published(), OPTIONS, 7, 12_345, tuple(Prompt(i, 100 + i) for i in range(3)), runs=3)
    record = wire.load_record(load)
    record["end"] = record["begin"] = 5
    assert wire.read_load(record[0]) == load
    many = Load(TRUE.published(), OPTIONS, 0, 0, tuple(Prompt(0, 10) for _ in range(wire.LOAD_PROMPTS + 4)))
    record = wire.load_record(many)
    record["end"] = record["begin"] = 6
    got = wire.read_load(record[0])
    assert got is not None and len(got.waiting) == wire.LOAD_PROMPTS
    assert got.pending_tokens == many.pending_tokens and got.waiting[-1].remaining == 50
    assert wire.read_load(wire.load_record(Load())[0]) == Load()  # all zero: publishes no load


def test_the_load_region_carries_how_many_prompts_are_a_floors_never_the_summed_entry() -> None:
    load = Load(TRUE.published(), OPTIONS, 2, 300, (Prompt(0, 10), Prompt(0, 20), Prompt(5, 30)), 1, floors=2)
    assert wire.read_load(wire.load_record(load)[0]) == load
    many = replace(load, waiting=tuple(Prompt(0, 10) for _ in range(wire.LOAD_PROMPTS + 2)), floors=99)
    got = wire.read_load(wire.load_record(many)[0])
    assert got is not None and got.floors == wire.LOAD_PROMPTS - 1  # the last entry sums the rest: not a floor's


def test_a_torn_load_region_is_not_taken() -> None:
    record = wire.load_record(Load(TRUE.published(), OPTIONS, 1))
    record["end"], record["begin"] = 5, 6  # the writer began version 6 while the reader copied
    assert wire.read_load(record[0]) is None


def test_prompts_within_their_tenants_floor_are_served_first_then_oldest_first() -> None:
    """docs/TENANTS.md: a tenant's first ``floor`` requests on a server are served before the others, each group
    in arrival order; a tenant without a floor (0) never is."""
    tenants = [(0, 0), (1, 2), (0, 0), (1, 2), (1, 2), (2, 1), (0, 3)]
    assert prefill_order(tenants) == ([1, 3, 5, 0, 2, 4, 6], 3)
    assert prefill_order([(0, 0)] * 3) == ([0, 1, 2], 0)
    assert prefill_order([]) == ([], 0)


def test_nothing_joins_the_step_that_gives_a_floors_prompt_its_first_token() -> None:
    """Objective 7: where a borrower's prompt may add a quarter to an earlier prompt's first-token step, it adds
    nothing to a floor's -- not even ``min_prefill`` --, and the streams decoding decode in the next step."""
    wide = policy(stall_ms=1000.0)
    assert wide.plan(FLAT, 5, 0, fresh(30, 100, 100)) == [30, 6, 0]  # a quarter: 6 tokens
    assert decodes(fresh(30, 100, 100), [30, 6, 0], 0)
    assert wide.plan(FLAT, 5, 0, fresh(30, 100, 100), floors=1) == [30, 0, 0]
    assert not decodes(fresh(30, 100, 100), [30, 0, 0], 1)
    assert wide.plan(FLAT, 5, 0, fresh(3, 100), floors=1) == [3, 0]
    # a floor's prompt that does not finish in this step leaves the bound to those behind it, as any prompt does,
    # and the streams decode beside it
    assert wide.plan(FLAT, 5, 0, fresh(1000, 100), floors=1) == [485, 0]
    assert decodes(fresh(1000, 100), [485, 0], 1)
    assert decodes(fresh(30, 100), [30, 0], 0) and decodes([], [], 0)


def test_the_prediction_plans_the_floors_steps_as_the_server_does() -> None:
    """A floor's prompt ahead (published as the load's ``floors``) gets its first token in a step no later prompt
    joins: the prediction of a prompt behind it computes none of its own tokens in that step."""
    load = Load(FLAT, PolicyOptions(1000.0, 8, 512), decoding=5, waiting=(Prompt(0, 1000),), runs=1)
    floor = replace(load, floors=1)
    for published in (load, floor):  # the step under way: 20 + 10 + 970 ms
        assert StepPolicy(published.options).plan(FLAT, 5, 0, published.waiting, 1, published.floors) == [485]
    borrower, behind_floor = predict(load, Prompt(0, 100)), predict(floor, Prompt(0, 100))
    # then 485 more of the floor's, then its last 30 -- which the borrower's prompt joins with 6 tokens (a quarter
    # of 90 ms); the floor's alone, its 5 streams decoding in the next step -- then the rest beside 6 streams
    assert borrower.ttft_ms == pytest.approx(500 + 1000 + (90 + 22) + (22 + 10 + 2 * 94))
    assert behind_floor.ttft_ms == pytest.approx(500 + 1000 + 70 + (22 + 10 + 2 * 100))


def test_while_a_floor_is_lent_the_others_prompts_add_at_most_lent_ms_to_a_step() -> None:
    """Objective 8: the step a floor's owner waits out when it takes its slot back stays short -- a borrower's prompt
    adds at most ``lent_ms`` (its chunk's micro-batch included; ``min_prefill`` aside), a floor's prompt is not held
    to it."""
    wide = policy(stall_ms=1000.0)
    assert wide.plan(FLAT, 5, 0, fresh(100)) == [100]  # 20 ms of decoding + 10 + 200: within the stall
    assert wide.plan(FLAT, 5, 0, fresh(100), lent_ms=50.0) == [20]  # 10 + 2 x 20 = 50 ms
    assert wide.plan(FLAT, 5, 0, fresh(100), floors=1, lent_ms=50.0) == [100]  # the floor's own prompt
    assert wide.plan(FLAT, 5, 0, fresh(1000, 100), floors=1, lent_ms=50.0) == [485, 0]
    assert wide.plan(FLAT, 5, 0, fresh(100), lent_ms=5.0) == [8]  # admitted prompts always progress
    # the borrowers share it: the first's 10 tokens spend 30 of the 50 ms, the quarter-share rule leaves 12.5
    assert wide.plan(FLAT, 5, 0, fresh(10, 100), lent_ms=50.0) == [10, 1]
    # nobody decodes: a borrower's prompt is no longer computed whole, a floor's still is
    assert wide.plan(FLAT, 0, 0, fresh(300)) == [300]
    assert wide.plan(FLAT, 0, 0, fresh(300), lent_ms=50.0) == [20]
    assert wide.plan(FLAT, 0, 0, fresh(300, 100), floors=1, lent_ms=50.0) == [300, 0]
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="lent_ms must be finite and >= 0 ms"):
            wide.plan(FLAT, 5, 0, fresh(100), lent_ms=bad)


def test_a_floor_is_lent_while_its_tenant_holds_less_than_it_and_a_request_outside_every_floor_runs() -> None:
    assert floor_lent([(1, 2), (0, 0)], {1: 2})  # tenant 1 holds 1 of its 2; tenant 0's request can be taken back
    assert floor_lent([(0, 0)] * 8, {1: 2})
    assert not floor_lent([(1, 2), (1, 2), (0, 0)], {1: 2})  # it holds its floor
    assert not floor_lent([(1, 2)], {1: 2})  # nobody to take a slot back from
    assert not floor_lent([(0, 0)] * 8, {})  # no floor known
    assert not floor_lent([(1, 2)] * 3, {1: 2})  # above its floor, and no other floor
    assert floor_lent([(1, 2)] * 3, {1: 2, 2: 1})  # tenant 2 holds none of its 1; tenant 1's third is outside


def test_the_prediction_plans_a_borrowers_steps_within_lent_ms_as_the_server_does() -> None:
    """The load region carries ``lent_ms``; the prediction replays it: a 100-token prompt beside five decoding streams
    in five steps of 20 + 10 + 40 ms instead of one of 230."""
    load = Load(FLAT, PolicyOptions(1000.0, 8, 512), decoding=5, runs=1)
    lent = replace(load, lent_ms=50.0)
    assert wire.read_load(wire.load_record(lent)[0]) == lent
    assert predict(load, Prompt(0, 100)).ttft_ms == pytest.approx(10 + 230)  # half the step under way, then one
    assert predict(lent, Prompt(0, 100)).ttft_ms == pytest.approx(10 + 5 * 70)


def test_a_floor_unnamed_for_an_hour_is_forgotten_when_another_is_learned() -> None:
    """The one forgetting rule, the slot server's handler's and the agents' alike: what a request last said an hour ago
    or more is gone by the next time anything is learned."""
    memory: FloorMemory[int] = FloorMemory()
    memory.learn(1, 2, now=0.0)
    memory.learn(2, 1, now=100.0)
    memory.learn(1, 3, now=1000.0)  # said again: remembered from then, with what it says now
    assert memory.table() == {1: 3, 2: 1}
    memory.learn(3, 1, now=100.0 + FLOOR_MEMORY_S)
    assert memory.table() == {1: 3, 3: 1}  # tenant 2 was last named an hour ago
    memory.learn(3, 1, now=1000.0 + FLOOR_MEMORY_S + FloorMemory.SWEEP_S)
    assert memory.table() == {3: 1} and memory
    assert not FloorMemory()
