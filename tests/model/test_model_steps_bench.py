"""bench/model_steps.py's arithmetic (no model): the table it prints and the step-cost line it fits."""

from __future__ import annotations

import pytest

from edgepath.bench.model_steps import Row, cost_line, table


def rows() -> list[Row]:
    # a machine whose steps cost 10 ms + 2 ms per token, with one slow outlier per shape (a neighbour)
    return [
        Row(shape, size, tokens, {"1 thread": [10 + 2 * tokens, 10 + 2 * tokens + 50]})
        for shape, size, tokens in (("prefill", 1, 1), ("prefill", 64, 64), ("decode", 8, 8), ("mixed", 16, 23))
    ]


def test_the_cost_line_is_fitted_to_the_fastest_steps() -> None:
    overhead, per_token = cost_line(rows(), "1 thread")
    assert overhead == pytest.approx(10.0) and per_token == pytest.approx(2.0)


def test_the_table_shows_fastest_median_and_rate() -> None:
    text = table(rows(), ["1 thread"]).splitlines()
    assert text[0] == "| step | tokens | 1 thread: ms fastest (median) | tok/s |"
    assert text[2] == "| prefill 1 tokens | 1 | 12.0 (37.0) | 83 |"
    assert text[4] == "| decode 8 sequences | 8 | 26.0 (51.0) | 308 |"
    assert text[5] == "| 16 prompt tokens + decoding | 23 | 56.0 (81.0) | 411 |"


def test_the_serving_steps_report_counts_the_band_per_kind_of_step() -> None:
    from edgepath.bench.serving_steps import Measured, report

    measured = [
        Measured(0, 8, 1, 30.0, 30.0, 29.0),  # decode only: on the mark
        Measured(0, 8, 2, 45.0, 30.0, 44.0),  # two micro-batches: the calibration 1.5x short, online close
        Measured(64, 7, 2, 100.0, 200.0, 110.0),  # both: the calibration 2x over
    ]
    totals = {"decoded": 23, "llama_decode_s": 0.175, "moves": 1, "moves_s": 0.004}
    text = report(measured, totals).splitlines()
    assert text[2] == "| all | 3 | 1.00, 33.3 % | 1.02, 100.0 % |"
    assert text[3] == "| decode only | 2 | 1.25, 50.0 % | 1.03, 100.0 % |"
    assert text[4] == "| prompt and decode | 1 | 0.50, 0.0 % | 0.91, 100.0 % |"
    assert text[-1].startswith("decode-only steps in more than one micro-batch: 1 of 2; 23 tokens decoded")


def test_the_serving_steps_request_report_and_streams_that_end_on_the_way() -> None:
    from edgepath.bench.serving_steps import Arrival, report_arrivals
    from edgepath.contract.plan import Costs, PolicyOptions, Prompt, StepPolicy, _run

    costs = Costs(overhead_ms=10.0, prompt_ms=2.0, decode_ms=2.0)
    policy = StepPolicy(PolicyOptions(100.0, 16, 2048))  # a 100 ms stall bound: a 200-token prompt takes steps
    args = (costs, policy, 6, 50, 1, [Prompt(0, 200)])
    going_on = _run(*args, 0.0)
    ending = _run(*args, 0.0, [1] * 6)  # every stream ahead ends after one more token: later steps cost less
    assert 0 < ending < going_on
    assert _run(*args, 0.0, [10_000] * 6) == going_on

    arrivals = [Arrival(100, 0, 100.0, 100.0, 100.0), Arrival(100, 3, 200.0, 400.0, 210.0)]
    text = report_arrivals(arrivals).splitlines()
    assert text[2] == "| all | 2 | 0.50 / 1.00 / 1.00, 50.0 % | 0.95 / 1.00 / 1.00, 100.0 % |"
    assert text[3] == "| behind others | 1 | 0.50 / 0.50 / 0.50, 0.0 % | 0.95 / 0.95 / 0.95, 100.0 % |"


def test_the_lone_prefill_bench_reads_both_servers_model_time() -> None:
    from edgepath.bench.lone_prefill import llama_server_prompt_ms, prompt_ms, report

    log = (
        "x edgepath.model.llama DEBUG step 7: 807 tokens (0 decode, 807 prompt) over 1 slots: llama_decode 1055.0 ms, "
        "sampling 0.20 ms, python 0.10 ms\n"
        "x edgepath.model.llama DEBUG step 8: 1 tokens (1 decode, 0 prompt) over 1 slots: llama_decode 9.5 ms, "
        "sampling 0.20 ms, python 0.10 ms\n"
    )
    assert prompt_ms(log) == 1055.0  # the decode step after it is not the prompt's
    line = b'data: {"choices": [], "timings": {"prompt_n": 830, "prompt_ms": 890.9, "cache_n": 0}}\n'
    assert llama_server_prompt_ms(line) == 890.9
    assert llama_server_prompt_ms(b'data: {"choices": []}') is None
    rows = [
        {"words": 800, "system": "llama-server", "computed": 830, "model_ms": 900.0},
        {"words": 800, "system": "edgepath", "computed": 805, "model_ms": 1080.0},
    ]
    assert report(rows).splitlines()[4] == "| 800 words | 830, 900.0 | 805, 1080.0 | 1.20 |"
