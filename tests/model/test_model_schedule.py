"""The step policy as a pure object: plans from (decoding slots, waiting prompts) and a cost model, no model."""

from __future__ import annotations

import pytest

from edgepath.model.schedule import CostModel, PolicyOptions, StepPolicy


def policy(
    stall_ms: float = 100.0, min_prefill: int = 8, batch: int = 512, overhead: float = 10.0, per_token: float = 2.0
) -> StepPolicy:
    """A policy whose cost model predicts ``overhead + per_token * tokens`` ms (it never learns here)."""
    return StepPolicy(PolicyOptions(stall_ms, min_prefill, batch), CostModel(overhead, per_token))


def test_decoding_slots_alone_carry_no_prompt_tokens() -> None:
    assert policy().plan(6, []) == []


def test_nothing_decoding_takes_the_oldest_prompt_whole() -> None:
    # 300 tokens are predicted at 610 ms, far past the 100 ms bound: nobody waits on this step.
    assert policy().plan(0, [300]) == [300]


def test_nothing_decoding_whole_prompt_is_capped_by_the_batch() -> None:
    assert policy(batch=256).plan(0, [300]) == [256]


def test_nothing_decoding_later_prompts_join_only_within_the_stall_bound() -> None:
    # 45 tokens fit 100 ms (10 + 2 * 45); the first prompt takes them all: the second waits.
    assert policy().plan(0, [60, 20]) == [60, 0]
    # A short first prompt leaves room for the next ones, oldest first.
    assert policy().plan(0, [10, 20, 30]) == [10, 20, 15]


def test_while_slots_decode_prompt_tokens_fill_the_stall_bound() -> None:
    # 45 tokens fit within 100 ms; 5 of them are the decoding slots' tokens.
    assert policy().plan(5, [100]) == [40]
    assert policy().plan(5, [30, 100]) == [30, 10]


def test_prompts_are_concentrated_not_spread() -> None:
    """The oldest prompt takes the whole allowance; a younger one gets only what is left."""
    plan = policy().plan(2, [200, 200, 200])
    assert plan == [43, 0, 0]


def test_under_load_a_waiting_prompt_still_progresses() -> None:
    # 40 decoding slots alone are predicted at 90 ms; nothing else fits in 100 ms, yet min_prefill goes.
    assert policy(min_prefill=8).plan(40, [100, 50]) == [8, 0]
    assert policy(min_prefill=8).plan(60, [5, 50]) == [5, 3]


def test_a_step_never_exceeds_the_batch() -> None:
    p = policy(stall_ms=10_000.0, batch=64)
    plan = p.plan(10, [100, 100])
    assert 10 + sum(plan) == 64
    assert plan == [54, 0]


def test_a_slower_machine_means_smaller_prompt_steps() -> None:
    """The bound is in milliseconds: when steps get slower the policy carries fewer tokens."""
    p = policy(overhead=0.0, per_token=2.0)
    before = p.plan(4, [500])[0]
    for _ in range(100):  # 4 ms per token now, seen on decode-sized and prompt-sized steps
        p.observe(4, 0.016)
        p.observe(100, 0.400)
    after = p.plan(4, [500])[0]
    assert after < before
    assert after == pytest.approx(100 / 4 - 4, abs=2)


def test_cost_model_learns_overhead_and_per_token_cost() -> None:
    model = CostModel(overhead_ms=1.0, token_ms=1.0, alpha=0.2)
    for _ in range(200):  # a machine with 12 ms per step and 3 ms per token
        for tokens in (1, 8, 64, 256):
            model.observe(tokens, 12.0 + 3.0 * tokens)
    assert model.token_ms == pytest.approx(3.0, rel=0.05)
    assert model.overhead_ms == pytest.approx(12.0, rel=0.15)
    assert model.predict(100) == pytest.approx(312.0, rel=0.05)
    assert model.tokens_within(312.0) == pytest.approx(100, abs=5)


def test_cost_model_ignores_empty_and_nonsense_observations() -> None:
    model = CostModel(5.0, 2.0)
    for tokens, ms in ((0, 10.0), (-3, 10.0), (8, float("nan")), (8, float("inf")), (8, -1.0)):
        model.observe(tokens, ms)
    assert (model.overhead_ms, model.token_ms) == (5.0, 2.0)


def test_cost_model_starts_from_the_line_through_measured_steps() -> None:
    model = CostModel(6.0, 3.0)
    model.fit([16, 128], [5.5 + 1.9 * 16, 5.5 + 1.9 * 128])
    assert (model.overhead_ms, model.token_ms) == (pytest.approx(5.5), pytest.approx(1.9))
    model.fit([16, 64, 128], [40.0, 130.0, 250.0])  # least squares over more points
    assert model.token_ms == pytest.approx(1.875, rel=0.01) and model.overhead_ms == pytest.approx(10.0, abs=0.05)


@pytest.mark.parametrize(
    ("tokens", "ms"),
    [([16, 16], [30.0, 40.0]), ([16, 128], [50.0, 40.0]), ([16, 128], [30.0, float("nan")]), ([16], [30.0])],
)
def test_cost_model_keeps_its_estimates_when_the_steps_make_no_line(tokens: list[int], ms: list[float]) -> None:
    model = CostModel(6.0, 3.0)
    model.fit(tokens, ms)
    assert (model.overhead_ms, model.token_ms) == (6.0, 3.0)


def test_cost_model_never_predicts_room_below_zero() -> None:
    assert CostModel(50.0, 2.0).tokens_within(20.0) == 0


@pytest.mark.parametrize(
    ("decoding", "waiting", "message"),
    [
        (-1, [], "decoding >= 0"),
        (2, [5, 0], "every waiting prompt >= 1"),
        (512, [5], "no room in a batch of 512"),
    ],
)
def test_impossible_plans_are_refused(decoding: int, waiting: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        policy().plan(decoding, waiting)


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


def test_bad_cost_model_is_refused() -> None:
    with pytest.raises(ValueError, match="token_ms > 0"):
        CostModel(1.0, 0.0)
