"""``edgepath bench model`` for real, short: edgepath alone, and against llama-server when it is built.

Both start real servers on the real SmolLM2 GGUF and drive every phase with the harness's own client;
they check that every phase answered and that the report is well formed, never the figures (the
machine is shared: timings here mean nothing).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from edgepath.bench import llama_server
from edgepath.bench.model_compare import add_arguments, main
from edgepath.bench.model_report import MODEL_BEGIN, MODEL_END

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

PREFIX = ["prefix-seq-cold", "prefix-seq-warm", "prefix-burst-cold", "prefix-conc-warm"]


def _run(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    doc = tmp_path / "docs" / "PERFORMANCE.md"
    doc.parent.mkdir()
    doc.write_text(f"## Performance\n{MODEL_BEGIN}\nthe previous block\n{MODEL_END}\n")
    args = parser.parse_args(["--quick", "--out", str(tmp_path / "out"), "--doc", str(doc), *flags])
    assert main(args) == 0
    return json.loads((tmp_path / "out" / "results.json").read_text()), doc.read_text()


def _well_formed(block: str) -> None:
    """Every Markdown table in the block has one column count, a separator row, and no empty figure row."""
    tables = [[line for line in part.splitlines() if line.startswith("|")] for part in re.split(r"\n\s*\n", block)]
    tables = [rows for rows in tables if rows]
    assert len(tables) >= 2
    for rows in tables:
        assert len({line.count("|") for line in rows}) == 1, rows
        assert set(rows[1].replace("|", "")) == {"-"} and len(rows) > 2


def _answered_everywhere(
    result: dict, loads: list[str], retrying: tuple[str, ...] = ("retry-200-r2", "retry-200-r8")
) -> None:
    """Every phase answered something (--quick: retrying phases at 200 % of capacity, max_retries 2 and 8); the
    closed loop at saturation (guidellm's, answers of exactly --max-tokens) after the concurrent phase."""
    assert "error" not in result, result
    assert [row["phase"] for row in result["phases"]] == [
        "lone", "concurrent", "saturation", *(f"poisson-{load}" for load in loads), *retrying, "burst", *PREFIX,
    ]  # fmt: skip
    for row in result["phases"]:
        if row["phase"] in retrying:  # users calling through the SDK's retries: at least one call each
            assert row["attempts_mean"] >= 1 and row["first_token_5s_rps"] is not None, row
    for row in result["phases"]:
        assert row["ok"] > 0 and row["ttft_p50_ms"] > 0 and row["output_tokens"] > 0, (result["system"], row)
        assert row["server_cpu_s"] > 0, (result["system"], row)  # the servers' CPU was read around the phase


def test_a_quick_comparison_of_edgepath_alone_fills_its_block(tmp_path: Path) -> None:
    report, doc = _run(tmp_path, "--systems", "edgepath", "--loads", "2", "--no-batching")
    (result,) = report["results"]
    _answered_everywhere(result, ["200"])
    assert result["threads"] == "1" and result["threads_reported"] == 1  # the count it was asked for, as it logged it
    prefix = [row for row in result["phases"] if row["phase"].startswith("prefix")]
    assert all(row["prompt_tokens_p50"] >= 200 for row in prefix)  # the shared system prompt reached the model
    block = doc.split(MODEL_BEGIN)[1].split(MODEL_END)[0]
    assert (
        "the previous block" not in block
        and "| one request at a time | edgepath |" in block
        and "Smoke test (--quick)" in block
    )
    _well_formed(block)
    assert (tmp_path / "docs" / "model.png").stat().st_size > 0
    assert any(t["verdict"].startswith("not measured: needs") for t in report["targets"])  # no peer, said so


def test_a_quick_comparison_against_llama_server(tmp_path: Path) -> None:
    if llama_server.find() is None:
        pytest.skip(
            f"llama-server is not built (about 6 minutes on 2 cores): `{llama_server.BUILD_COMMAND}`; "
            "this test never builds it"
        )
    report, doc = _run(tmp_path, "--no-build")  # every default system, every default load
    assert [r["system"] for r in report["results"]] == ["llama-server", "edgepath", "edgepath-no-bound"]
    for result in report["results"]:
        _answered_everywhere(result, ["100", "200", "400"])
    peer, ours, free = report["results"]  # the reference first
    assert peer["reference"] and ours["rate_basis_rps"] == free["rate_basis_rps"] == peer["capacity_rps"]
    assert all(row["predicted"] > 0 for row in ours["phases"])  # the agent's prediction came with every phase
    warm = next(row for row in peer["phases"] if row["phase"] == "prefix-seq-warm")
    assert warm["cached_tokens_mean"] >= 200  # llama-server reused the shared system prompt, as it reports
    # --quick runs the retrying clients at twice capacity only: the targets at 120 % say they were not measured
    unmeasured = [t for t in report["targets"] if t["verdict"].startswith("not measured")]
    assert unmeasured and all(" at 120% " in t["name"] for t in unmeasured), report["targets"]
    (batching,) = report["batching"]
    assert batching["edgepath"]["many"] > 0 and batching["llama-batched-bench"]["many"] > 0
    _well_formed(doc.split(MODEL_BEGIN)[1].split(MODEL_END)[0])
