"""The step cost model the slot server's handler learns (model/cost.py): calibrated from warm-up steps, followed
robustly within bounds, back to its calibration when nothing recent is left -- and the plans it makes smaller on a
slower machine."""

from __future__ import annotations

from dataclasses import replace

import pytest

from edgepath.contract.plan import Costs, PolicyOptions, Prompt, Step, StepPolicy, chunk_attended
from edgepath.model.cost import CostModel

FLAT = Costs(overhead_ms=10.0, prompt_ms=2.0, decode_ms=2.0)  # one rate, no context term: easy arithmetic


def policy(stall_ms: float = 100.0, min_prefill: int = 8, batch: int = 512) -> StepPolicy:
    return StepPolicy(PolicyOptions(stall_ms, min_prefill, batch))


def fresh(*remaining: int) -> list[Prompt]:
    return [Prompt(0, n) for n in remaining]


def test_a_slower_machine_means_smaller_prompt_steps() -> None:
    """The bound is in milliseconds: when steps get slower the policy carries fewer tokens."""
    model = CostModel(FLAT)
    before = policy().plan(model.costs(), 4, 0, fresh(500))[0]
    for i in range(40):  # every step now takes twice what the calibration says
        model.observe(Step(40, 4, 100), 2 * FLAT.step_ms(Step(40, 4, 100)), now=float(i))
    after = policy().plan(model.costs(), 4, 0, fresh(500))[0]
    assert model.factor == pytest.approx(2.0) and after < before


def test_a_cost_model_without_a_prompt_or_decode_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="need a prompt or a decode cost"):
        CostModel(Costs(overhead_ms=5.0))


TRUE = Costs(overhead_ms=5.5, prompt_ms=1.9, decode_ms=3.5, context_ms=2.5, decode_context_ms=4.5)
CALIBRATION = [  # the llama handler's warm-up (LlamaHandler._warm_up)
    Step(0, 1, 0, 1),
    Step(0, 8, 0, 8),
    Step(0, 1, 0, 2),
    Step(0, 8, 0, 10),
    Step(16, 0, chunk_attended(0, 16)),
    Step(128, 0, chunk_attended(0, 128)),
    Step(128, 0, chunk_attended(128, 128)),
    Step(0, 8, 0, 8 * 257),
    Step(0, 4, 0, 4 * 258, ubatches=4),
    Step(0, 8, 0, 4 * 258 + 4 * 259),
    Step(0, 4, 0, 4 * 260, ubatches=4),
]


def test_calibration_recovers_the_five_costs_from_the_warm_up_steps() -> None:
    model = CostModel(FLAT)
    assert model.calibrate(CALIBRATION, [TRUE.step_ms(s) for s in CALIBRATION])
    for name in ("overhead_ms", "prompt_ms", "decode_ms", "context_ms", "decode_context_ms"):
        assert getattr(model.base, name) == pytest.approx(getattr(TRUE, name), rel=1e-6)
    assert model.costs() == TRUE.published()  # what it plans with is what the load region carries


def test_calibration_keeps_no_negative_cost() -> None:
    model = CostModel(FLAT)
    steps = [Step(16, 0, 136), Step(128, 0, 8256)]
    assert model.calibrate(steps, [40.0, 250.0])  # two points: overhead and one rate; no context, no decode cost
    assert min(model.base.overhead_ms, model.base.prompt_ms, model.base.decode_ms, model.base.context_ms) >= 0
    assert model.base.decode_ms == model.base.prompt_ms  # unmeasured: it costs what a prompt token does


@pytest.mark.parametrize(
    ("steps", "ms"),
    [
        ([Step(16, 0, 0)], [30.0]),
        ([Step(16, 0, 0), Step(128, 0, 0)], [30.0, float("nan")]),
        ([Step(16, 0, 0), Step(128, 0, 0)], [30.0, 0.0]),
        ([Step(16, 0, 0), Step(128, 0, 0)], [50.0, 40.0]),  # falls with tokens: no cost model
    ],
)
def test_calibration_that_makes_no_cost_model_changes_nothing(steps: list[Step], ms: list[float]) -> None:
    model = CostModel(FLAT)
    assert not model.calibrate(steps, ms)
    assert model.base == FLAT


def test_one_pathological_step_moves_nothing_and_a_slower_machine_is_followed_within_bounds() -> None:
    model = CostModel(TRUE)
    step = Step(100, 4, 5000)
    for i in range(10):
        model.observe(step, TRUE.step_ms(step), now=float(i))
    model.observe(step, 15 * TRUE.step_ms(step), now=10.0)  # a step starved by a neighbour: 15x
    assert model.factor == pytest.approx(1.0, abs=0.05)  # a Huber weight: it counts as a step 1.25x off at most
    for i in range(40):  # the machine stays 10x slower: followed, but no further than the bound (4x)
        model.observe(step, 10 * TRUE.step_ms(step), now=11.0 + i)
    assert model.factor == 4.0


def test_a_calibration_starved_by_a_neighbour_is_followed_down_to_the_machine() -> None:
    """A warm-up beside a busy neighbour measured every cost 4x too high; once steps run as the machine allows,
    the model follows them down (admission then predicts waits as they are, not 4x over)."""
    model = CostModel(TRUE.scaled(4.0))
    step = Step(100, 4, 5000)
    for i in range(40):
        model.observe(step, TRUE.step_ms(step), now=float(i))
    assert model.factor == pytest.approx(0.25, rel=0.02)
    assert model.costs().step_ms(step) == pytest.approx(TRUE.step_ms(step), rel=0.02)
    for i in range(40):  # ever faster: no further than the bound (1/5)
        model.observe(step, TRUE.step_ms(step) / 10, now=40.0 + i)
    assert model.factor == 0.2


def test_the_context_cost_is_learned_from_steps_whose_contexts_differ() -> None:
    """The warm-up cannot measure it (its prompts are short); steps at contexts of a few hundred to a few thousand
    positions can, and a machine that is also 1.5x slower than calibrated is told apart from it."""
    model = CostModel(replace(TRUE, context_ms=0.0))
    for i in range(64):
        step = Step(64, 4, chunk_attended(50 * i, 64) + 4 * (100 + 50 * i))
        model.observe(step, 1.5 * replace(TRUE, context_ms=0.0).step_ms(step) + 2.5 * step.attended / 1e3, now=i / 10)
    assert model.factor == pytest.approx(1.5, rel=0.02)
    assert model.costs().context_ms == pytest.approx(2.5, rel=0.05)  # what a step pays, the factor in it


def test_steps_all_of_one_shape_leave_the_context_cost_as_calibrated() -> None:
    model = CostModel(TRUE)
    step = Step(40, 4, 3000)
    for i in range(32):
        model.observe(step, 2 * TRUE.step_ms(step), now=float(i))
    assert model.factor == pytest.approx(2.0)  # the machine is slower, all of its costs alike
    assert model.costs().context_ms == pytest.approx(2 * TRUE.context_ms, rel=1e-6)


def test_the_cost_model_returns_to_its_calibration_when_nothing_recent_is_left() -> None:
    model = CostModel(TRUE, horizon_s=30.0)
    step = Step(100, 4, 5000)
    for i in range(32):
        model.observe(step, 3 * TRUE.step_ms(step), now=float(i))
    assert model.factor == pytest.approx(3.0)
    model.forget(now=100.0)
    assert model.factor == 1.0 and model.costs() == TRUE.published()


def test_the_cost_model_ignores_tiny_and_nonsense_steps() -> None:
    model = CostModel(TRUE)
    for step, ms in ((Step(1, 0, 1), 500.0), (Step(0, 8, 8), float("nan")), (Step(0, 8, 8), -1.0)):
        model.observe(step, ms, now=0.0)
    assert model.factor == 1.0
