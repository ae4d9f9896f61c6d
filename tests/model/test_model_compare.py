"""The comparison harness's own logic: SSE parsing, the figures and targets it derives, its workload, the
llama-server build helper's refusals, and the baseline batcher.  The real runs are in
tests/system/test_bench_model.py."""

from __future__ import annotations

import argparse
import asyncio
import io
import re
import tarfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgepath.bench import llama_server
from edgepath.bench.model_compare import (
    SATURATION_CHATS,
    SYSTEMS,
    Chats,
    IdleCost,
    Outcome,
    Plan,
    Setup,
    Slo,
    Window,
    _check,
    add_arguments,
    command_line,
    percentile,
    read_event,
    read_headers,
    summarize,
    threads_reported,
)
from edgepath.bench.model_report import MODEL_BEGIN, MODEL_END, VERSUS, rewrite_doc, table, targets
from edgepath.bench.model_workload import Workload, log_uniform
from edgepath.model.known_answer import DETERMINISTIC_CMAKE_ARGS, LLAMA_CMAKE_ARGS


def words(text: str) -> int:
    """A stand-in token count for the workload's unit tests (the real runs use the model's tokenizer)."""
    return len(text.split())


WINDOW = Window(wall_s=2.0, server_cpu_s=0.5, client_cpu_s=0.1, loadavg_1m=1.0)


# -- streamed answers --------------------------------------------------------------------------------------
def test_content_chunks_usage_and_cache_figures_are_read_from_the_events() -> None:
    out = Outcome(status=200)
    read_event(out, b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}}], "usage": null}', 1.0)
    read_event(out, b'data: {"choices": [{"delta": {"content": "Hi"}}], "usage": null}', 1.5)
    read_event(out, b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}', 1.6)
    read_event(out, b": ping - 2026-01-01", 1.7)
    read_event(out, b"data: {not json", 1.7)
    read_event(out, b"data: [1, 2]", 1.7)
    assert out.chunks == [1.5] and out.completion_tokens is None
    usage = b'{"prompt_tokens": 300, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 280}}'
    read_event(out, b'data: {"choices": [], "usage": ' + usage + b"}", 1.8)
    read_event(out, b"data: [DONE]", 1.9)
    assert (out.completion_tokens, out.prompt_tokens, out.cached_tokens, out.tokens) == (7, 300, 280, 7)
    # llama-server without a cached_tokens field: its own timings say how many prompt tokens it reused
    other = Outcome(status=200)
    read_event(other, b'data: {"choices": [], "usage": {"completion_tokens": 3}, "timings": {"cache_n": 41}}', 1.0)
    assert other.cached_tokens == 41 and other.tokens == 3


def test_edge_stages_come_from_server_timing() -> None:
    out = Outcome()
    stages = b"queue;dur=0.010, parse;dur=0.020, tokenize;dur=0.300, write;dur=0.004, claim;dur=0.001, "
    read_headers(out, [(b"server-timing", stages + b"doorbell;dur=0.005, edge;dur=150.000")])
    assert out.edge_ms == pytest.approx(0.340)  # edge (t_ready - t_receive) holds model time: not an edge stage
    other = Outcome()
    read_headers(other, [(b"server-timing", b"app;dur=3.0"), (b"x-queued-ms", b"4.5")])
    assert other.edge_ms is None
    assert (other.server_wait_ms, other.server_ttft_ms, other.predicted_ttft_ms) == (None, None, None)


def test_edgepaths_wait_and_prediction_come_from_server_timing() -> None:
    out = Outcome(status=200, sent=0.0, chunks=[1.3])
    timing = b"claim;dur=0.010, first_token;dur=1200.000, wait;dur=150.500, predicted_ttft;dur=1000.000"
    read_headers(out, [(b"server-timing", timing), (b"x-queue-time", b"150500.0us")])
    assert (out.server_wait_ms, out.server_ttft_ms, out.predicted_ttft_ms) == (150.5, 1200.0, 1000.0)
    assert out.prediction_ratio() == pytest.approx(1.2)  # its own TTFT, not the client's
    assert Outcome(status=200, sent=0.0, chunks=[1.3]).prediction_ratio() is None  # no prediction: no ratio


def test_the_idle_cost_is_a_line_through_the_lone_phase_and_the_wait_is_what_lies_above_it() -> None:
    lone = [
        Outcome(status=200, sent=0.0, chunks=[0.1 + 0.002 * n], prompt_tokens=n + 10, cached_tokens=10)
        for n in (100, 300, 500)
    ]
    idle = IdleCost.fit([*lone, Outcome(status=429)])
    assert idle is not None
    assert (idle.base_s, idle.per_token_s) == (pytest.approx(0.1), pytest.approx(0.002))
    late = Outcome(status=200, sent=0.0, chunks=[2.0], prompt_tokens=400)  # 0.9 s of its own, 1.1 s waited
    assert late.wait(idle) == pytest.approx(1.1)
    assert late.wait(None) == 2.0  # no fit: the whole TTFT, an upper bound
    early = Outcome(status=200, sent=0.0, chunks=[0.5], prompt_tokens=400)
    assert early.wait(idle) == 0.0  # faster than the fit: it waited for nothing
    assert IdleCost.fit(lone[:1]) is None and IdleCost.fit([lone[0], lone[0]]) is None  # one length: no line


def test_a_request_meets_the_slo_only_when_it_waited_within_the_bound_and_streamed_fast() -> None:
    slo = Slo(wait_s=2.0, itl_p50_s=0.1)
    assert Outcome(status=200, sent=0.0, chunks=[1.0, 1.05, 1.1]).met(slo, None)
    assert Outcome(status=200, sent=0.0, chunks=[1.0]).met(slo, None)  # one chunk: no gap to miss
    assert not Outcome(status=200, sent=0.0, chunks=[2.5, 2.55]).met(slo, None)  # waited too long
    long = Outcome(status=200, sent=0.0, chunks=[2.5, 2.55], prompt_tokens=1000)
    assert long.met(slo, IdleCost(0.0, 0.002))  # a 2 s prompt of its own: waited 0.5 s
    assert not Outcome(status=200, sent=0.0, chunks=[1.0, 1.2, 1.4, 1.45]).met(slo, None)  # median gap 200 ms
    assert not Outcome(status=429, sent=0.0).met(slo, None)
    assert not Outcome(status=200, sent=0.0, chunks=[0.5], error="timed out after 5 s").met(slo, None)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(x) for x in range(1, 101)], 99) == 99.0


def test_summary_counts_refusals_against_goodput_and_keeps_latency_over_answers() -> None:
    fast = Outcome(status=200, sent=0.0, done=1.0, chunks=[0.5, 0.55, 0.6], completion_tokens=4)
    slow = Outcome(status=200, sent=1.0, done=4.0, chunks=[3.5, 3.6], prompt_tokens=200, cached_tokens=150)
    refused = Outcome(status=429, sent=1.5, done=1.51)
    broken = Outcome(status=0, sent=1.6, done=3.0, error="timed out after 5 s")
    row = summarize("test", [fast, slow, refused, broken], WINDOW, Slo(), rate=2.0)
    assert (row["requests"], row["ok"], row["refused_429"], row["not_finished"]) == (4, 2, 1, 1)
    assert row["refused_share"] == 0.25 and row["errors"] == ["timed out after 5 s"]
    assert row["ttft_p50_ms"] == pytest.approx(500.0) and row["ttft_p99_ms"] == pytest.approx(2500.0)
    assert row["output_tokens"] == 4 + 2  # usage where the server sent it, else the chunks
    assert row["tokens_per_chunk"] == pytest.approx(6 / 5)
    assert row["span_s"] == pytest.approx(4.0) and row["output_tok_s"] == pytest.approx(6 / 4.0)
    assert row["goodput_share"] == 0.25 and row["goodput_rps"] == pytest.approx(1 / 4.0)  # only `fast` met it
    assert row["server_cpu_ms_per_request"] == pytest.approx(250.0)  # per answered request
    assert row["cached_tokens_mean"] == 150 and row["prompt_tokens_p50"] == 200
    assert row["rate_rps"] == 2.0 and row["client_bound"] is False and row["client_cpu_share"] == pytest.approx(0.05)
    # guidellm's ITL: each request's own mean gap, then the median over requests (not over the gaps pooled)
    stalled = Outcome(status=200, sent=0.0, done=2.0, chunks=[0.5, 0.54, 0.58, 1.58])  # a 1 s stall in its stream
    even = Outcome(status=200, sent=0.0, done=2.0, chunks=[0.5, 0.6, 0.7, 0.8])
    row = summarize("test", [stalled, even, stalled], WINDOW, Slo())
    assert row["itl_p50_ms"] == pytest.approx(100.0) and row["itl_mean_p50_ms"] == pytest.approx(360.0)


def test_late_sends_or_a_busy_client_mark_a_phase_client_bound() -> None:
    late = [Outcome(status=200, sent=float(i), done=i + 0.2, chunks=[i + 0.1], lag=0.2) for i in range(3)]
    assert summarize("test", late, WINDOW, Slo())["client_bound"] is True
    busy = Window(wall_s=1.0, server_cpu_s=0.1, client_cpu_s=0.9, loadavg_1m=1.0)
    on_time = [Outcome(status=200, sent=0.0, done=0.2, chunks=[0.1])]
    assert summarize("test", on_time, busy, Slo())["client_bound"] is True
    assert summarize("test", on_time, WINDOW, Slo())["client_bound"] is False


# -- flags -------------------------------------------------------------------------------------------------
def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--systems", "edgepath,vllm"), r"unknown \['vllm'\]; choose from llama-server, edgepath"),
        (("--systems", "llama-server"), "include edgepath"),
        (("--threads", "1,two"), "integer >= 1 or 'default', got 'two'"),
        (("--threads", "0"), "integer >= 1 or 'default', got '0'"),
        (("--threads", "2,default,2"), "repeated"),
        (("--loads", "0.5,x"), "--loads must be comma-separated numbers"),
        (("--loads", "0,1"), r"in \(0, 4\]"),
        (("--prompt-tokens", "512-128"), "LOW-HIGH with 16 <= LOW <= HIGH"),
        (("--prompt-tokens", "300"), "LOW-HIGH"),
        (("--handler-option", "chunk"), "expected KEY=VALUE, got 'chunk'"),
        (("--handler-option", "threads=2"), "set it with --threads"),
        (("--handler-option", "ctx_per_slot=64"), "set it with --ctx-per-slot"),
        (("--prefix-chats", "1"), "a cold chat, then warm ones"),
        (("--max-tokens", "1"), "--max-tokens must be >= 2"),
        (("--slots", "0"), "--slots must be >= 1"),
        (("--ctx-per-slot", "512"), r"cannot hold the longest chat .* give >= 1216"),
        (("--saturation-prompt-tokens", "2000"), r"0 \(no such phase\) or 16..1024"),
    ],
)
def test_bad_flags_are_named_with_what_is_allowed(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _check(_parsed(*argv))


def test_flags_become_the_plan() -> None:
    checked = _check(_parsed("--systems", "fastapi-batcher,edgepath,llama-server", "--threads", "2,default"))
    assert checked.systems == ["llama-server", "edgepath", "fastapi-batcher"]  # the reference runs first
    assert checked.threads == [2, None] and checked.fractions == (1.0, 2.0, 4.0)
    assert checked.prompt_range == (128, 1024)
    checked = _check(_parsed("--handler-option", "prefill_budget=64", "--handler-option", "x=y=z"))
    assert checked.handler_options == ("prefill_budget=64", "x=y=z")


def test_the_command_line_names_what_differs_from_the_defaults() -> None:
    args = _parsed("--systems", "edgepath", "--threads", "2", "--handler-option", "a=1", "--no-batching", "--quick")
    args.func = print  # what the edgepath CLI adds is not a flag of this command
    assert command_line(args) == (
        "edgepath bench model --systems edgepath --threads 2 --handler-option a=1 --no-batching --quick"
    )
    assert command_line(_parsed()) == "edgepath bench model"


def test_every_system_serves_the_same_model_slots_and_context(monkeypatch: pytest.MonkeyPatch) -> None:
    built = llama_server.Binaries(Path("/cache/llama.cpp-0.3.36"), "0.3.36")
    monkeypatch.setattr(llama_server, "require", lambda version=None: built)  # no build needed to read a command
    setup = Setup("/m.gguf", 8, 1216, 64, ("prefill_budget=64",))
    for system in SYSTEMS.values():
        default, pinned = system.command(setup, 8123, None), system.command(setup, 8123, 3)
        assert "8123" in default and "/m.gguf" in default, system.name

        def threads(argv: list[str]) -> list[str]:
            return [a for a in argv if a == "3" or a.endswith("=3")]

        assert threads(pinned) and not threads(default), system.name  # a default leaves the threads to the system
    server = SYSTEMS["llama-server"].command(setup, 8123, 3)
    assert server[0] == "/cache/llama.cpp-0.3.36/bin/llama-server"
    assert server[server.index("-np") + 1] == "8" and server[server.index("-c") + 1] == str(8 * 1216)
    assert server[server.index("-t") + 1] == server[server.index("-tb") + 1] == "3"
    edge = " ".join(SYSTEMS["edgepath"].command(setup, 8123, 3))
    assert "--slots 8" in edge and "threads=3" in edge and "ctx_per_slot=1216" in edge
    assert "--handler-option prefill_budget=64" in edge


def test_the_thread_count_a_system_reported_is_read_from_its_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("load_tensors: ...\ncommon_init_result: llama threadpool init, n_threads = 2\n")
    assert threads_reported(SYSTEMS["llama-server"], log) == 2
    log.write_text("edgepath.model.llama INFO llama: m.gguf, 8 slots x 512 positions, 1 threads, batch 40\n")
    assert threads_reported(SYSTEMS["edgepath"], log) == 1
    assert threads_reported(SYSTEMS["llama-cpp-python"], log) is None  # it does not log one


# -- the workload ------------------------------------------------------------------------------------------
def test_prompts_are_deterministic_distinct_per_phase_and_of_the_drawn_length() -> None:
    workload = Workload(words, seed=7, low=128, high=1024)
    lone = workload.chats("lone", 6)
    assert lone == Workload(words, seed=7).chats("lone", 6)
    assert lone != Workload(words, seed=8).chats("lone", 6)
    texts = [chat[0]["content"] for chat in lone + workload.chats("concurrent", 6)]
    assert len(set(texts)) == len(texts)
    first_sentences = {text.split(". ")[1] for text in texts}
    assert len(first_sentences) > len(texts) // 2  # documents differ from their start, not only in the middle
    for text in texts:
        assert 128 <= words(text) <= 1024 + 60, words(text)  # at least the drawn length, one sentence more at most
    lengths = [words(chat[0]["content"]) for chat in workload.chats("spread", 40)]
    assert min(lengths) < 300 and max(lengths) > 500  # drawn over the range, not one size


def test_the_saturation_phase_has_chats_of_one_length_and_none_when_turned_off() -> None:
    plan = Plan(2, 4, 4, 8.0, (1.0,), (), (), 3, 2, saturation_prompt=160, seed=1, start_timeout=1.0, rate_basis="own")
    chats = Chats.make(Workload(words, seed=3), plan, 2, 200)
    lengths = {words(chat[0]["content"]) for chat in chats.saturation}
    assert len(chats.saturation) == 2 * SATURATION_CHATS and 150 <= min(lengths) <= max(lengths) < 160 + 60
    assert Chats.make(Workload(words), replace(plan, saturation_prompt=0), 2, 200).saturation == []


def test_log_uniform_lengths_stay_in_their_range() -> None:
    rng = __import__("random").Random(3)
    draws = [log_uniform(rng, 128, 1024) for _ in range(2000)]
    assert min(draws) >= 128 and max(draws) <= 1024
    assert 0.4 < sum(d < 362 for d in draws) / len(draws) < 0.6  # the geometric middle splits them
    with pytest.raises(ValueError, match="low <= high"):
        Workload(words, low=300, high=200)


def test_shared_prefix_chats_share_the_system_prompt_and_nothing_across_phases() -> None:
    workload = Workload(words, seed=1)
    sequential, concurrent = workload.shared_prefix("sequential", 6), workload.shared_prefix("concurrent", 6)
    systems = {chat[0]["content"] for chat in sequential}
    assert len(systems) == 1 and 450 <= words(next(iter(systems))) <= 520
    assert len({chat[1]["content"] for chat in sequential}) == 6  # each its own question
    assert sequential[0][0]["content"] != concurrent[0][0]["content"]
    a, b = sequential[0][0]["content"], concurrent[0][0]["content"]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert common < 60  # the assistant's opening words at most: no cache carries over between phases


# -- the report --------------------------------------------------------------------------------------------
def _row(phase: str, **figures: Any) -> dict[str, Any]:
    outcomes = [Outcome(status=200, sent=0.0, done=1.0, chunks=[0.4, 0.45])] * 4
    row = summarize(phase, outcomes, WINDOW, Slo())
    row.update(figures)
    return row


def _report(
    edge: dict[str, dict],
    peer: dict[str, dict] | None,
    batching: list[dict] | None = None,
    no_bound: dict[str, dict] | None = None,
) -> dict:
    results = [{"system": "edgepath", "threads": "1", "phases": [_row(p, **f) for p, f in edge.items()]}]
    if peer is not None:
        results.insert(0, {"system": "llama-server", "threads": "1", "phases": [_row(p, **f) for p, f in peer.items()]})
    if no_bound is not None:
        phases = [_row(p, **f) for p, f in no_bound.items()]
        results.append({"system": "edgepath-no-bound", "threads": "1", "phases": phases})
    report = {
        "measured_at": "2026-01-01T00:00:00Z",
        "machine": "x86_64, 2 CPUs",
        "loadavg_at_start": 0.5,
        "command": "edgepath bench model",
        "quick": False,
        "setup": {
            "model": "/m/SmolLM2.gguf",
            "slots": 8,
            "ctx_per_slot": 1216,
            "max_tokens": 64,
            "handler_options": [],
        },
        "prompts": {"tokens": "128-1024", "prefix_tokens": 450, "seed": 1},
        "slo": {"wait_s": 2.0, "itl_p50_s": 0.1},
        "systems": ["llama-server", "edgepath"] if peer is not None else ["edgepath"],
        "threads": ["1"],
        "results": results,
        "batching": batching or [],
        "llama_server": {"built_from": "llama.cpp 0c1e570 from llama-cpp-python 0.3.36"},
    }
    report["targets"] = targets(report)
    return report


EDGE = {
    "lone": {"ttft_p50_ms": 500.0},
    "concurrent": {"output_tok_s": 80.0, "itl_p50_ms": 40.0},
    "saturation": {"output_tok_s": 90.0, "itl_mean_p50_ms": 75.0, "ttft_p50_ms": 400.0},
    "poisson-200": {"goodput_rps": 0.3, "refused_429": 3, "refused_share": 0.3, "requests": 10, "ok": 7},
    "prefix-seq-cold": {"ttft_p50_ms": 2000.0},
    "prefix-seq-warm": {"ttft_p50_ms": 150.0},
    "retry-120-r2": {"first_token_5s_rps": 0.6},
    "retry-120-r8": {"answered_rps": 0.7, "first_token_5s_rps": 0.5},
    "retry-200-r2": {"first_token_5s_rps": 0.3},
    "retry-200-r8": {"answered_rps": 0.5, "first_token_5s_rps": 0.4},
}
PEER = {
    "lone": {"ttft_p50_ms": 400.0},
    "concurrent": {"output_tok_s": 76.8, "itl_p50_ms": 41.0},
    "saturation": {"output_tok_s": 100.0, "itl_mean_p50_ms": 40.0, "ttft_p50_ms": 2000.0},
    "poisson-200": {"goodput_rps": 0.1},
    "prefix-seq-cold": {"ttft_p50_ms": 2500.0},
    "prefix-seq-warm": {"ttft_p50_ms": 80.0},
    "retry-120-r2": {"first_token_5s_rps": 0.5},
    "retry-120-r8": {"answered_rps": 0.7, "first_token_5s_rps": 0.25},
    "retry-200-r2": {"first_token_5s_rps": 0.1},
    "retry-200-r8": {"answered_rps": 0.6, "first_token_5s_rps": 0.1},
}


def test_targets_are_judged_with_how_many_requests_were_answered() -> None:
    batching = [{"threads": 1, "slots": 8, "edgepath": {"one": 70.0, "many": 100.0}, "llama-batched-bench": {
        "one": 77.0, "many": 105.0}}]  # fmt: skip
    rows = _report(EDGE, PEER, batching)["targets"]
    judged = {
        t["name"].split(",")[0]: t for t in rows if t["name"] not in ADMISSION_TARGETS and "advised" not in t["name"]
    }
    assert {name: (round(t["value"], 3), t["verdict"]) for name, t in judged.items()} == {
        "output tokens/s at concurrency = slots": (1.042, "met"),
        "ITL p50 at concurrency = slots": (0.976, "met"),
        "output tokens/s at saturation (guidellm's closed loop)": (0.9, "missed"),
        "ITL p50 at saturation": (1.875, "missed"),
        "TTFT p50 at saturation": (0.2, "met"),
        "completed requests/s at 120% with clients retrying (max_retries 8)": (1.0, "met"),
        "first tokens within 5 s of the call per second at 120% (max_retries 2)": (1.2, "missed"),
        "first tokens within 5 s of the call per second at 120% (max_retries 8)": (2.0, "met"),
        "TTFT p50 of a lone request": (1.25, "missed"),
        "shared prefix: warm TTFT p50 (one at a time)": (1.875, "met"),
        "goodput at 200% of capacity": (3.0, "met"),
        "shared prefix: edgepath warm TTFT p50 / its cold TTFT": (0.075, "met"),
        "decode tokens/s at 8 sequences": (0.952, "met"),
        "completed requests/s at 200% with clients retrying (max_retries 8)": (0.833, "missed"),
        "first tokens within 5 s of the call per second at 200% (max_retries 2)": (3.0, "met"),
        "first tokens within 5 s of the call per second at 200% (max_retries 8)": (4.0, "met"),
    }
    assert judged["goodput at 200% of capacity"]["answered"] == "7/10 (3 refused) vs 4/4"
    none_good = {**PEER, "poisson-200": {"goodput_rps": 0.0}}
    (goodput,) = [t for t in _report(EDGE, none_good)["targets"] if t["name"].startswith("goodput")]
    assert (goodput["value"], goodput["verdict"]) == (None, "met (the other is 0)")
    (goodput,) = [t for t in _report({**EDGE, "poisson-200": {"goodput_rps": 0.0}}, none_good)["targets"]
                  if t["name"].startswith("goodput")]  # fmt: skip
    assert goodput["verdict"] == "no ratio: both are 0"


ADMISSION_TARGETS = {
    "poisson-200: edgepath wait p99 / the bound",
    "poisson-200: edgepath TTFT p99 / its lone TTFT p99",
    "poisson-400: edgepath wait p99 / the bound",
    "poisson-400: edgepath TTFT p99 / its lone TTFT p99",
    "output tokens/s at 100% of capacity, edgepath / edgepath-no-bound",
    "poisson-100: share of edgepath's TTFT within 0.75-1.33 x its prediction",
    "poisson-200: share of edgepath's TTFT within 0.75-1.33 x its prediction",
    "poisson-400: share of edgepath's TTFT within 0.75-1.33 x its prediction",
    "burst: share of edgepath's TTFT within 0.75-1.33 x its prediction",
    "edgepath refusals with nothing else running (lone phase), share",
}


def test_the_admission_targets_hold_edgepath_to_its_bound_its_prediction_and_its_unbounded_self() -> None:
    edge = {
        "lone": {"ttft_p99_ms": 3000.0, "refused_429": 0},
        "poisson-100": {"output_tok_s": 50.0, "prediction_in_band": 0.95},
        "poisson-200": {"wait_p99_ms": 2300.0, "ttft_p99_ms": 7000.0, "prediction_in_band": 0.8},
        "poisson-400": {"wait_p99_ms": 3000.0, "ttft_p99_ms": 5000.0, "prediction_in_band": 0.9},
    }
    rows = {t["name"]: t for t in _report(edge, PEER, no_bound={"poisson-100": {"output_tok_s": 52.0}})["targets"]}
    assert set(rows) >= ADMISSION_TARGETS
    got = {name: (None if rows[name]["value"] is None else round(rows[name]["value"], 3), rows[name]["verdict"])
           for name in ADMISSION_TARGETS}  # fmt: skip
    assert got == {
        "poisson-200: edgepath wait p99 / the bound": (1.15, "missed"),  # 2.3 s over a 2 s bound: past 1.1
        "poisson-200: edgepath TTFT p99 / its lone TTFT p99": (2.333, "missed"),
        "poisson-400: edgepath wait p99 / the bound": (1.5, "missed"),
        "poisson-400: edgepath TTFT p99 / its lone TTFT p99": (1.667, "met"),
        "output tokens/s at 100% of capacity, edgepath / edgepath-no-bound": (0.962, "met"),
        "poisson-100: share of edgepath's TTFT within 0.75-1.33 x its prediction": (0.95, "met"),
        "poisson-200: share of edgepath's TTFT within 0.75-1.33 x its prediction": (0.8, "missed"),
        "poisson-400: share of edgepath's TTFT within 0.75-1.33 x its prediction": (0.9, "missed"),  # 0.95 wanted
        "burst: share of edgepath's TTFT within 0.75-1.33 x its prediction": (
            None, "not measured: needs edgepath's burst phase with predictions"),
        "edgepath refusals with nothing else running (lone phase), share": (0.0, "met"),
    }  # fmt: skip
    refused = _report({**edge, "lone": {"refused_429": 1}}, PEER)["targets"]
    (idle,) = [t for t in refused if t["name"].startswith("edgepath refusals")]
    assert (idle["value"], idle["verdict"]) == (0.25, "missed")  # one of 4 refused with nothing running
    (cost,) = [t for t in refused if t["name"].startswith("output tokens/s at 100%")]
    assert cost["verdict"] == "not measured: needs a poisson-100 phase of edgepath and edgepath-no-bound"


def test_targets_without_the_peer_say_why_they_were_not_measured() -> None:
    failed = {"threads": 1, "slots": 8, "edgepath": {"one": 1.0, "many": 2.0}}
    failed["llama-batched-bench"] = {"error": "llama-server ... is not built"}
    rows = _report(EDGE, None, [failed])["targets"]
    verdicts = [t["verdict"] for t in rows]
    assert verdicts[0] == "not measured: needs a concurrent phase of both"
    assert verdicts[len(VERSUS)] == "met"  # edgepath against itself needs no peer
    assert verdicts[-1] == "not measured: llama-server ... is not built"


def test_the_table_is_well_formed_and_says_what_its_columns_mean() -> None:
    report = _report(EDGE, PEER)
    report["results"].append({"system": "fastapi-batcher", "threads": "1", "phases": [], "error": "exited with 1"})
    text = table(report)
    tables: list[list[str]] = []
    for block in re.split(r"\n\s*\n", text):
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            tables.append(rows)
    assert len(tables) == 2  # one per thread setting, then the targets
    for rows in tables:
        widths = {line.count("|") for line in rows}
        assert len(widths) == 1, rows  # every row has the header's columns
        assert set(rows[1].replace("|", "")) == {"-"}
    assert "| one request at a time | llama-server | 4/4 |" in text
    assert "| Poisson, 200% of capacity | edgepath | 7/10 (30% 429) |" in text
    assert "| - | fastapi-batcher | did not finish: exited with 1 |" in text
    assert "llama.cpp 0c1e570 from llama-cpp-python 0.3.36" in text and "-np 8 -c 9728" in text
    assert "the same measure for every system" in text and "refused and failed requests count as missing it" in text
    assert "| phase | system | answered/sent | TTFT p50 / p99 ms | wait p50 / p99 ms |" in text


def test_the_performance_block_is_rewritten(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "PERFORMANCE.md"  # the plot goes next to the page, linked by its name
    doc.parent.mkdir()
    png = tmp_path / "model.png"
    png.write_bytes(b"png")
    doc.write_text("# x\n")
    with pytest.raises(SystemExit, match="bench:model:begin"):
        rewrite_doc(doc, "table", png)
    doc.write_text(f"# x\n{MODEL_BEGIN}\nold\n{MODEL_END}\ntail\n")
    rewrite_doc(doc, "| new |", png)
    content = doc.read_text()
    assert "](model.png)" in content
    assert "old" not in content and "| new |" in content and content.endswith(f"{MODEL_END}\ntail\n")
    assert (tmp_path / "docs" / "model.png").read_bytes() == b"png"


# -- the llama-server build helper -------------------------------------------------------------------------
def test_a_missing_build_is_refused_with_the_command_that_makes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert llama_server.find("0.0.1") is None
    with pytest.raises(llama_server.BuildError, match=r"not built .*llama.cpp-0.0.1.*--build"):
        llama_server.require("0.0.1")
    root = llama_server.cache_root("0.0.1") / "bin"
    assert root.parent.parent == tmp_path / "edgepath"
    root.mkdir(parents=True)
    for name in llama_server.TARGETS:
        (root / name).write_text("#!/bin/sh\n")
        (root / name).chmod(0o755)
    found = llama_server.require("0.0.1")
    assert found.server == root / "llama-server" and found.describe() == "llama.cpp from llama-cpp-python 0.0.1"


def test_the_peer_is_built_as_its_users_build_it_with_the_flags_of_edgepaths_own_llama_cpp() -> None:
    """llama-server with llama.cpp's cmake defaults (llamafile on), the kernels the handler runs by default
    (llama-cpp-python's build needs llamafile asked for); a build with other flags is kept apart."""
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    declared = {
        name.strip(): value.strip()
        for name, value in (line.split(":=", 1) for line in makefile.splitlines() if ":=" in line)
    }
    assert declared["LLAMA_CMAKE_ARGS"] == LLAMA_CMAKE_ARGS == "-DGGML_LLAMAFILE=ON"
    assert declared["DETERMINISTIC_CMAKE_ARGS"] == DETERMINISTIC_CMAKE_ARGS == "-DGGML_LLAMAFILE=OFF"
    assert not [flag for flag in llama_server.CMAKE_FLAGS if "GGML" in flag]  # llama.cpp's defaults: llamafile on
    assert llama_server.cache_root("1.0").name.startswith("llama.cpp-1.0-")


def test_a_build_without_a_compiler_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(llama_server.shutil, "which", lambda tool: None if tool == "cmake" else f"/usr/bin/{tool}")
    with pytest.raises(llama_server.BuildError, match="needs 'cmake', not on PATH: apt-get install cmake"):
        llama_server.build("0.0.1", quiet=True)


def test_an_sdist_member_that_would_land_outside_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("pkg/ok.txt", "../escape.txt"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    with tarfile.open(archive) as tar, pytest.raises(llama_server.BuildError, match=r"'../escape.txt'.*refusing"):
        llama_server._checked(tar, tmp_path / "src")


# -- the FastAPI baseline ----------------------------------------------------------------------------------
def test_batcher_runs_a_batch_to_completion_and_queues_the_rest() -> None:
    pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
    from edgepath.bench.model_fastapi import END, Batcher, Job
    from edgepath.contract.wire import Sampling
    from edgepath.edge.text.tokenizer import GGUFTokenizer
    from edgepath.model.gguf import default_model_path
    from edgepath.model.llama import LlamaHandler
    from edgepath.slots.handlers import HandlerConfig

    handler = LlamaHandler.from_config(HandlerConfig(2, 64, 8, {"threads": "1", "ctx_per_slot": "64"}))
    tok = GGUFTokenizer(default_model_path())
    batcher = Batcher(handler, batch=2, max_wait=0.05, depth=2)

    async def scenario() -> list[tuple[list[int], float, str]]:
        loop = asyncio.get_running_loop()
        jobs = [Job(tok.encode(f"Count: {i}, "), 4, Sampling(), loop) for i in range(4)]
        accepted = [batcher.submit(job) for job in jobs]
        assert accepted[:2] == [True, True]
        results = []
        for job, ok in zip(jobs, accepted, strict=True):
            if not ok:
                continue
            ids = []
            while (token := await asyncio.wait_for(job.tokens.get(), 120)) != END:
                ids.append(token)
            results.append((ids, job.queued_s, job.finish_reason))
        return results

    try:
        results = asyncio.run(scenario())
    finally:
        batcher.close()
        handler.close()
        tok.close()
    assert len(results) >= 2
    for ids, queued, reason in results:
        assert (len(ids), reason) == (4, "length") or (len(ids) < 4 and reason == "stop")
        assert np.isfinite(queued) and queued >= 0
