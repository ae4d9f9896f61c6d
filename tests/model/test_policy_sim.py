"""bench/policy_sim.py (no model): the step policies replayed on a cost model in guidellm's closed loop."""

from __future__ import annotations

import pytest

from edgepath.bench.policy_sim import retrying, rules, simulate
from edgepath.contract.plan import Costs, PolicyOptions, Prompt

COSTS = Costs(overhead_ms=9.0, prompt_ms=1.6, decode_ms=2.2, context_ms=0.3, decode_context_ms=1.0)
RULES = rules(PolicyOptions(1500.0, 16, 1224), [16])


def run(name: str, together: bool = True, seed: int = 1):
    return simulate(RULES[name], COSTS, 8, 140, 64, 60.0, seed, together)


def test_every_rule_that_never_splits_a_prompt_does_the_same_work_so_only_who_waits_differs() -> None:
    shipped, before, whole, chunked = run("edgepath"), run("without-9"), run("whole"), run("budget-16")
    assert shipped.output_tok_s == pytest.approx(whole.output_tok_s, rel=0.03)
    assert before.output_tok_s == pytest.approx(whole.output_tok_s, rel=0.03)
    # whole prompts at once from a common start keep the streams in lockstep: every gap is a decode step...
    decode_step = COSTS.overhead_ms + 8 * COSTS.decode_ms + COSTS.decode_context_ms * 8 * (140 + 64) / 1e3
    assert whole.itl_p50_ms == pytest.approx(decode_step, rel=0.1)
    # ... and every first token waits for all eight prompts; the join share at a full house traded the other way
    assert before.ttft_p50_ms < whole.ttft_p50_ms / 3 and before.itl_p50_ms > 1.5 * whole.itl_p50_ms
    # objective 9 gathers a full house's prompts within the stall bound: gaps within 1.15x of whole batching's,
    # first tokens no later than its
    assert shipped.itl_p50_ms < 1.15 * whole.itl_p50_ms and shipped.ttft_p50_ms <= whole.ttft_p50_ms
    # a prompt cut into 16-token chunks pays a micro-batch per chunk: fewer tokens a second, and both waits longer
    assert chunked.output_tok_s < 0.9 * shipped.output_tok_s
    assert chunked.itl_p50_ms > before.itl_p50_ms and chunked.ttft_p50_ms > before.ttft_p50_ms


def test_the_shipped_rule_gathers_only_at_a_full_house() -> None:
    waiting = [Prompt(0, 140), Prompt(0, 140)]
    assert RULES["edgepath"](COSTS, 6, 100, waiting, True) == [140, 140]  # every slot taken: both whole, together
    shipped = RULES["edgepath"](COSTS, 6, 100, waiting, False)
    assert shipped == RULES["without-9"](COSTS, 6, 100, waiting, True) and shipped[1] < 140  # the join share holds


def test_a_loop_too_short_for_its_warm_up_is_refused() -> None:
    with pytest.raises(ValueError, match="no request ended after the 20 s warm-up"):
        simulate(RULES["edgepath"], COSTS, 8, 140, 64, 10.0, 1, True)


def test_retrying_clients_below_capacity_all_start_soon_and_far_over_it_some_give_up() -> None:
    rule = RULES["edgepath"]
    calm = retrying(rule, COSTS, 8, 0.1, (140, 1036), 64, 300.0, 1)
    assert calm.calls > 10 and calm.completed == calm.calls and calm.soon_per_s == pytest.approx(calm.calls / 300)
    flood = retrying(rule, COSTS, 8, 4.0, (140, 1036), 64, 120.0, 1, retries=2)
    assert flood.completed < flood.calls / 2  # 4x capacity, two retries: most calls find no slot three times
