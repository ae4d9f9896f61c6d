"""The comparison harness's own logic: SSE parsing, the figures it derives, and the baseline batcher."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgepath.bench.model_compare import SYSTEMS, Outcome, Setup, _has_content, percentile, summarize


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
    late = Outcome(status=200, sent=1.0, chunks=[2.0, 2.1], queued_ms=None)
    refused = Outcome(status=429, sent=1.5)
    broken = Outcome(status=0, sent=1.6, error="timed out after 5 s")
    row = summarize("test", [ok, late, refused, broken], idle_ttft=0.5)
    assert (row["requests"], row["ok"], row["rejected_429_share"]) == (4, 2, 0.25)
    assert row["errors"] == ["timed out after 5 s"]
    assert row["ttft_p50_ms"] == pytest.approx(500.0)
    assert row["ttft_p99_ms"] == pytest.approx(1000.0)
    assert row["tokens_per_s"] == pytest.approx(5 / 2.1)
    # No server report: the queueing is estimated from TTFT above the idle TTFT, and marked so.
    assert row["queued_estimated"] is True and row["queued_ms"] == pytest.approx(250.0)
    reported = summarize("test", [Outcome(status=200, sent=0.0, chunks=[0.1], queued_ms=12.0)], idle_ttft=0.05)
    assert reported["queued_ms"] == 12.0 and reported["queued_estimated"] is False


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
