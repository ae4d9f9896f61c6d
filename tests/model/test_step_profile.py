"""bench/step_profile.py's reading of both systems' steps (no model): edgepath's step lines, llama-server's counters."""

from __future__ import annotations

import pytest

from edgepath.bench.step_profile import cpu_shares, metrics_profile, parse_metrics, parse_steps, profile


def line(decode: int, prompt: int, ms: float, ubatches: int, between: float, threads: int = 2) -> str:
    return (
        f"2026-12-07 15:00:00,000 edgepath.model.llama DEBUG step 9: {decode + prompt} tokens ({decode} decode, "
        f"{prompt} prompt) over {decode + (prompt > 0)} slots: llama_decode {ms:.1f} ms, sampling 1.00 ms, "
        f"python 0.50 ms; {ubatches} micro-batches, {threads} threads, {between:.2f} ms since the last step"
    )


def test_a_profile_splits_the_steps_by_what_they_carried_and_the_time_by_where_it_went() -> None:
    log = [
        line(8, 0, 38.5, 1, 500.0),  # the first step's gap is the wait before the load: not counted
        "2026-12-07 15:00:00,000 edgepath.slots.server INFO something else",
        line(8, 0, 38.5, 1, 2.0),
        line(7, 128, 298.5, 2, 2.0, threads=1),
        line(0, 256, 498.5, 2, 2.0),
    ]
    steps = parse_steps(log)
    assert [(s.decode, s.prompt, s.ubatches, s.threads) for s in steps] == [
        (8, 0, 1, 2), (8, 0, 1, 2), (7, 128, 2, 1), (0, 256, 2, 2)
    ]  # fmt: skip
    p = profile(steps)
    assert (p["steps_decode_only"], p["steps_prompt_and_decode"], p["steps_prompt_alone"]) == (2, 1, 1)
    assert p["prompt_rows_per_prompt_step"] == 192.0 and p["decode_rows_in_decode_only_steps"] == 8.0
    assert p["step_ms_p50_decode_only"] == 40.0 and p["step_ms_p50_mixed"] == 300.0
    assert p["ubatches_mixed"] == 2.0
    wall = 40 + 40 + 300 + 500 + 3 * 2.0  # ms: the steps and the three gaps after the first
    assert p["wall_s"] == pytest.approx(wall / 1e3)
    assert p["decoded_tok_s"] == pytest.approx(23 / wall * 1e3)
    assert p["time_shares"]["between_steps"] == pytest.approx(6 / wall)
    assert sum(p["time_shares"].values()) == pytest.approx(1.0)
    assert p["threads"] == {1: 1, 2: 3}


def test_lines_without_the_profile_fields_are_not_steps_and_no_steps_profile_as_none() -> None:
    old = (
        "x edgepath.model.llama DEBUG step 8: 1 tokens (1 decode, 0 prompt) over 1 slots: llama_decode 9.5 ms, "
        "sampling 0.20 ms, python 0.10 ms"
    )
    assert parse_steps([old]) == []
    assert profile([]) == {"steps": 0}


def test_llama_servers_steps_come_from_its_counters_over_the_window() -> None:
    before = parse_metrics(
        "# HELP llamacpp:n_decode_total x\nllamacpp:n_decode_total 100\nllamacpp:n_busy_slots_per_decode 4\n"
        "llamacpp:tokens_predicted_total 300\nllamacpp:prompt_tokens_total 1000\n"
    )
    after = parse_metrics(
        "llamacpp:n_decode_total 300\nllamacpp:n_busy_slots_per_decode 6\nllamacpp:tokens_predicted_total 1800\n"
        "llamacpp:prompt_tokens_total 3048\nllamacpp:broken x\n"
    )
    p = metrics_profile(before, after, 10.0)
    assert p["steps"] == 200 and p["step_period_ms"] == 50.0
    assert p["busy_slots_per_step"] == pytest.approx((6 * 300 - 4 * 100) / 200)  # 7: the window's own mean
    assert p["decode_rows_per_step"] == 7.5 and p["prompt_rows_per_step"] == pytest.approx(10.24)
    assert p["decoded_tok_s"] == 150.0


def test_cpu_shares_are_cores_over_the_window() -> None:
    assert cpu_shares({"server": 1.0}, {"server": 3.0, "slot-server": 15.0}, 10.0) == {
        "server": 0.2,
        "slot-server": 1.5,
    }
