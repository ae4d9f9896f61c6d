"""``edgepath bench edge-cpu``: the edge's own CPU per request over a real echo slot server, and the
performance page's block its profiled run writes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from edgepath.bench.edge_cpu import breakdown, main, measure, table
from edgepath.cli import build_parser


def test_runs_every_request_to_a_200_and_splits_the_profiled_time_by_stage(tmp_path: Path) -> None:
    results, profiler = asyncio.run(measure(requests=300, concurrency=8, warmup=50, runs=2, profile=True))
    assert len(results) == 2
    for r in results:
        assert r.statuses == {200: 300} and r.requests == 300 and r.cpu_us_per_request > 0
    assert profiler is not None
    shares = breakdown(profiler)
    assert sum(share for share, _ in shares) == pytest.approx(100.0)
    stages = dict((what, share) for share, what in shares)
    assert stages["tokenizing the prompt into the frame"] > 0  # the tokenizer ran on every request
    assert stages["claim + send in Python (`Agent.submit`)"] > 0
    assert all(share >= 0 for what, share in stages.items() if not what.startswith("the rest"))
    text = table(results, shares, "edgepath bench edge-cpu")
    assert "µs** of the edge process's CPU per request (median of 2 runs" in text
    assert text.count("\n| ") == len(shares) + 1  # header row and one row per stage


def test_the_command_rewrites_its_block_and_refuses_bad_counts(tmp_path: Path) -> None:
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text("before\n<!-- bench:edge-cpu:begin -->\nold\n<!-- bench:edge-cpu:end -->\nafter\n")
    parser = build_parser()
    command = ["bench", "edge-cpu", "--requests", "200", "--runs", "1", "--warmup", "20", "--doc", str(doc)]
    args = parser.parse_args(command)
    assert main(args) == 0
    content = doc.read_text()
    assert "old" not in content and "| share of a profiled run | stage |" in content
    assert content.startswith("before\n") and content.endswith("<!-- bench:edge-cpu:end -->\nafter\n")
    with pytest.raises(ValueError, match="--runs must be at least 1"):
        main(parser.parse_args(["bench", "edge-cpu", "--runs", "0"]))
