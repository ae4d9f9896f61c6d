"""The usage log's cost per line under each fsync policy (docs/TENANTS.md, "Usage a billing system can consume"):
what a request's end pays on the edge's event loop.  On a real disk (``tmp_path`` is under the system's temporary
folder: on a tmpfs an fsync costs nothing and the figure says nothing).  Run with ``make bench``, or
``pytest bench/bench_usage_log.py --benchmark-enable``."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgepath.edge.tenancy.usage import FSYNC, Usage, UsageLog

LINE = Usage("acme", 7, "/v1/chat/completions", "smollm2", 261, 256, 12, "stop", 81.5, 3.25, "chatcmpl-ep7")


@pytest.mark.parametrize("fsync", FSYNC)
def test_usage_log_line(benchmark, tmp_path: Path, fsync: str) -> None:
    log = UsageLog(str(tmp_path / "usage.jsonl"), fsync=fsync, interval=1.0)
    calls = 0

    def line() -> None:
        nonlocal calls
        calls += 1
        log(LINE)

    try:
        benchmark.pedantic(line, rounds=2000, iterations=1, warmup_rounds=20)
    finally:
        log.close()
    # one line per call, however many the benchmark made (one with --benchmark-disable, 2,020 enabled)
    assert calls >= 1
    assert len((tmp_path / "usage.jsonl").read_text().splitlines()) == calls
