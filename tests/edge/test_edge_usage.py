"""The usage log: one JSON line per record, appended, and in the kernel as soon as it is written -- nothing is
buffered in the process, so a killed edge loses no line of a request it answered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgepath.edge.usage import Usage, UsageLog


def test_each_record_is_one_line_visible_before_the_log_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    path.write_text('{"earlier": true}\n')  # appended to, never truncated
    log = UsageLog(str(path))
    log(Usage("acme", 7, "/v1/chat/completions", 261, 256, 12, "stop", 81.5, 3.25))
    assert len(path.read_text().splitlines()) == 2  # read through another descriptor: already written
    log(Usage("key-0123456789ab", 8, "/v1/generate", 5, 0, 1, "cancelled", None, None))
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"earlier": True}
    first, second = lines[1], lines[2]
    assert list(first) == [
        "time", "tenant", "request_id", "route", "prompt_tokens", "cached_tokens", "completion_tokens", "finish",
        "ttft_ms", "wait_ms", "answer_id",
    ]  # fmt: skip
    assert first["time"] > 1.7e9 and (first["prompt_tokens"], first["cached_tokens"]) == (261, 256)
    assert second["finish"] == "cancelled" and second["ttft_ms"] is None


def test_a_log_that_cannot_be_opened_says_which(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--usage-log .*missing/usage.jsonl: cannot open it"):
        UsageLog(str(tmp_path / "missing" / "usage.jsonl"))


def test_a_line_names_the_openai_answers_id_so_a_client_can_join_it(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    log = UsageLog(str(path))
    log(Usage("acme", 9, "/v1/completions", 3, 0, 2, "stop", 10.0, 0.0, "cmpl-ep4"))
    log.close()
    assert json.loads(path.read_text())["answer_id"] == "cmpl-ep4"
