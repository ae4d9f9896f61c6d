"""`edgepath bench stream` end to end on a small schedule: every request answered, the table and the performance
page's block written, the return path read from the edge's Server-Timing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from edgepath.bench.stream import add_arguments, main

BEGIN, END = "<!-- bench:stream:begin -->", "<!-- bench:stream:end -->"

pytestmark = pytest.mark.slow


def test_bench_stream_runs_and_rewrites_its_block(tmp_path: Path) -> None:
    doc = tmp_path / "PERFORMANCE.md"
    doc.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--rates", "10", "--requests", "12", "--seconds", "2", "--slots", "4", "--out", str(tmp_path / "out"),
         "--doc", str(doc)]
    )  # fmt: skip
    assert main(args) == 0
    (row,) = json.loads((tmp_path / "out" / "results.json").read_text())
    assert row["ok"] + row["429"] == row["sent"] > 0
    assert row["return_us"][0] is not None and 0 < row["return_us"][0] < 1e6
    assert row["ttft_ms"][0] is not None and row["itl_ms"][0] is not None
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text and "return path" in text


def test_bench_stream_refuses_bad_rates(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--rates"):
        main(parser.parse_args(["--rates", "0", "--out", str(tmp_path)]))
