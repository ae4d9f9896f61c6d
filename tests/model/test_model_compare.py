"""The comparison harness's own logic: SSE parsing, the figures it derives, and the baseline batcher."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgepath.bench.model_compare import (
    MODEL_BEGIN,
    MODEL_END,
    SYSTEMS,
    Outcome,
    Setup,
    _check,
    _has_content,
    add_arguments,
    edge_latency_totals,
    main,
    percentile,
    ratios,
    read_headers,
    rewrite_readme,
    summarize,
    table,
)


def test_only_content_chunks_count_as_tokens() -> None:
    assert _has_content(b'data: {"choices": [{"delta": {"content": "Hi"}}]}')
    assert not _has_content(b'data: {"choices": [{"delta": {"role": "assistant"}}]}')
    assert not _has_content(b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}')
    assert not _has_content(b"data: [DONE]")
    assert not _has_content(b": ping - 2026-01-01")
    assert not _has_content(b"data: {not json")


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(x) for x in range(1, 101)], 99) == 99.0


def test_summary_figures() -> None:
    ok = Outcome(status=200, sent=0.0, chunks=[0.5, 0.6, 0.8], queued_ms=None)
    late = Outcome(status=200, sent=1.0, chunks=[2.0, 2.1], queued_ms=None, lag=0.01)
    refused = Outcome(status=429, sent=1.5)
    broken = Outcome(status=0, sent=1.6, error="timed out after 5 s")
    row = summarize("test", [ok, late, refused, broken], idle_ttft=0.5, rate=2.0)
    assert (row["requests"], row["ok"], row["rejected_429_share"]) == (4, 2, 0.25)
    assert row["errors"] == ["timed out after 5 s"] and row["not_finished"] == 1
    assert row["offered_rps"] == pytest.approx(3 / 1.6) and row["answered_rps"] == pytest.approx(2 / 2.1)
    assert row["rate_rps"] == 2.0 and row["client_bound"] is False
    assert row["edge_ms_p50"] is None and row["edge_share_of_ttft_p50"] is None
    assert row["ttft_p50_ms"] == pytest.approx(500.0)
    assert row["ttft_p99_ms"] == pytest.approx(1000.0)
    assert row["tokens_per_s"] == pytest.approx(5 / 2.1)
    # No server report: the queueing is estimated from TTFT above the idle TTFT, and marked so.
    assert row["queued_estimated"] is True and row["queued_ms"] == pytest.approx(250.0)
    reported = summarize("test", [Outcome(status=200, sent=0.0, chunks=[0.1], queued_ms=12.0)], idle_ttft=0.05)
    assert reported["queued_ms"] == 12.0 and reported["queued_estimated"] is False


def test_edge_stages_and_queue_time_come_from_the_servers_headers() -> None:
    out = Outcome(status=200, sent=0.0, chunks=[0.2])
    read_headers(
        out,
        [
            (b"server-timing", b"queue;dur=0.010, parse;dur=0.020, tokenize;dur=0.300, write;dur=0.004, "
             b"claim;dur=0.001, doorbell;dur=0.005, edge;dur=150.000, first_token;dur=190.000"),
            (b"x-queue-time", b"10.0us"),
        ],
    )  # fmt: skip
    # The edge's own stages only: edge (t_ready - t_receive) and first_token hold model time.
    assert out.edge_ms == pytest.approx(0.340)
    assert out.queued_ms == pytest.approx(0.010)
    row = summarize("test", [out], idle_ttft=None)
    assert row["edge_share_of_ttft_p50"] == pytest.approx(0.340 / 200.0)
    assert row["queued_ms"] == pytest.approx(0.010) and row["queued_estimated"] is False
    other = Outcome()
    read_headers(other, [(b"server-timing", b"app;dur=3.0"), (b"x-queued-ms", b"4.5")])
    assert other.edge_ms is None and other.queued_ms == 4.5
    with pytest.raises(ValueError, match="x-queue-time"):
        read_headers(Outcome(), [(b"x-queue-time", b"10ms")])


def test_late_sends_mark_a_run_client_bound() -> None:
    late = [Outcome(status=200, sent=float(i), chunks=[i + 0.1], lag=0.2) for i in range(3)]
    assert summarize("test", late, idle_ttft=None)["client_bound"] is True


def _parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_bad_flags_are_named() -> None:
    with pytest.raises(ValueError, match=r"unknown .*vllm.*choose from"):
        _check(_parsed("--systems", "edgepath,vllm"))
    with pytest.raises(ValueError, match="include edgepath"):
        _check(_parsed("--systems", "llama-cpp-server"))
    with pytest.raises(ValueError, match="--loads"):
        _check(_parsed("--loads", "0.5,x"))
    with pytest.raises(ValueError, match="--loads"):
        _check(_parsed("--loads", "0"))
    with pytest.raises(ValueError, match="--max-tokens must be >= 2"):
        _check(_parsed("--max-tokens", "1"))
    # edgepath runs first whatever the order given: its idle requests set the 2x-slots rate
    assert _check(_parsed("--systems", "fastapi-batcher,edgepath"))[0] == ["edgepath", "fastapi-batcher"]


def _run_row(load: str, ttft_ms: float | None, edge_ms: float | None = None) -> dict[str, Any]:
    row = summarize(load, [], idle_ttft=None)
    row.update(ok=10, requests=10, ttft_p50_ms=ttft_ms, ttft_p99_ms=ttft_ms, ttft_mean_ms=ttft_ms)
    row["edge_latency_mean_ms"] = edge_ms
    return row


def test_edge_latency_comes_from_the_metrics_histogram() -> None:
    body = (
        b"# HELP edgepath_edge_latency_seconds Request complete at the edge -> doorbell seen by the slot poller\n"
        b"# TYPE edgepath_edge_latency_seconds histogram\n"
        b'edgepath_edge_latency_seconds_bucket{le="0.001"} 3.0\n'
        b"edgepath_edge_latency_seconds_count 4.0\n"
        b"edgepath_edge_latency_seconds_sum 0.0025\n"
        b"edgepath_edge_latency_seconds_created 1.7e+09\n"
    )
    assert edge_latency_totals(body) == (0.0025, 4.0)
    with pytest.raises(RuntimeError, match="no edgepath_edge_latency_seconds"):
        edge_latency_totals(b"edgepath_requests_total 3.0\n")


def _report(results: list[dict[str, Any]], batching: dict[str, Any]) -> dict[str, Any]:
    report = {
        "measured_at": "2026-01-01T00:00:00Z",
        "machine": "x86_64, 2 cores",
        "command": "edgepath bench model",
        "quick": False,
        "setup": {"model": "/m/SmolLM2.gguf", "slots": 8, "threads": 2, "ctx_per_slot": 512},
        "plan": {"requests": 40, "max_tokens": 32, "seconds": 30.0, "seed": 1},
        "results": results,
        "batching": batching,
    }
    report["ratios"] = ratios(report)
    return report


def test_targets_are_judged_or_said_not_measured() -> None:
    edge = {"system": "edgepath", "capacity_rps": 5.0, "runs": [_run_row("50% capacity", 100.0, 0.4)]}
    llama = {"system": "llama-cpp-server", "capacity_rps": 2.0, "runs": [_run_row("50% capacity", 400.0)]}
    report = _report([edge, llama], {"ratio": 3.0, "slots": 8})
    assert [(r["value"], r["verdict"]) for r in report["ratios"]] == [
        (3.0, "met"), (0.25, "met"), (0.004, "met")
    ]  # fmt: skip
    text = table(report)
    assert "| edgepath | 50% capacity |" in text and "| 0.40% | <= 1% | met |" in text
    failed = {"system": "llama-cpp-server", "error": "exited with 1 before serving", "runs": []}
    report = _report([edge, failed], {"error": "did not finish in 300 s"})
    verdicts = [r["verdict"] for r in report["ratios"]]
    assert verdicts[0] == "not measured: did not finish in 300 s"
    assert verdicts[1].startswith("not measured: needs a 50% capacity run of edgepath and llama-cpp-server")
    assert "| llama-cpp-server | did not finish: exited with 1 before serving |" in table(report)


def test_readme_block_is_rewritten(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    png = tmp_path / "model.png"
    png.write_bytes(b"png")
    readme.write_text("# x\n")
    with pytest.raises(SystemExit, match="bench:model:begin"):
        rewrite_readme(readme, "table", png)
    readme.write_text(f"# x\n{MODEL_BEGIN}\nold\n{MODEL_END}\ntail\n")
    rewrite_readme(readme, "| new |", png)
    content = readme.read_text()
    assert "old" not in content and "| new |" in content and content.endswith(f"{MODEL_END}\ntail\n")
    assert (tmp_path / "docs" / "model.png").read_bytes() == b"png"


def test_every_system_is_started_on_the_given_port() -> None:
    setup = Setup("/m.gguf", 8, 1, 512)
    for system in SYSTEMS:
        argv = system.command(setup, 8123)
        assert "8123" in argv and "/m.gguf" in " ".join(argv), system.name


def test_batcher_runs_a_batch_to_completion_and_queues_the_rest() -> None:
    pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
    from edgepath.bench.model_fastapi import END, Batcher, Job
    from edgepath.dma.handlers import HandlerConfig
    from edgepath.dma.wire import Sampling
    from edgepath.edge.tokenizer import GGUFTokenizer
    from edgepath.model.gguf import default_model_path
    from edgepath.model.llama import LlamaHandler

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


@pytest.mark.slow
def test_quick_run_answers_on_every_system(tmp_path: Path) -> None:
    """``edgepath bench model --quick``: all three systems started, every load answered, the README filled."""
    pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
    pytest.importorskip("sse_starlette", reason="llama_cpp.server's deps: pip install -e '.[bench]'")
    readme = tmp_path / "README.md"
    readme.write_text(f"## Performance\n{MODEL_BEGIN}\n{MODEL_END}\n")
    args = _parsed("--quick", "--out", str(tmp_path / "out"), "--readme", str(readme))
    assert main(args) == 0
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["system"] for r in report["results"]] == ["edgepath", "llama-cpp-server", "fastapi-batcher"]
    for result in report["results"]:
        assert "error" not in result, result
        assert [run["load"] for run in result["runs"]] == ["50% capacity", "80% capacity", "2x2 slots"]
        for run in result["runs"]:
            assert run["ok"] > 0 and run["ttft_p50_ms"] > 0 and run["tokens_per_s"] > 0, (result["system"], run)
    edge_runs = report["results"][0]["runs"]
    assert all(run["queued_ms"] is not None and not run["queued_estimated"] for run in edge_runs)
    assert all(run["edge_ms_p50"] is not None and run["edge_latency_mean_ms"] > 0 for run in edge_runs)
    assert report["batching"]["slots"] == 2 and report["batching"]["ratio"] > 0
    assert len(report["ratios"]) == 3 and all(r["value"] is not None for r in report["ratios"])
    content = readme.read_text()
    assert "| edgepath | 50% capacity |" in content and "Smoke test (--quick)" in content
    assert (tmp_path / "docs" / "model.png").stat().st_size > 0
    shutil.rmtree(tmp_path / "out")
