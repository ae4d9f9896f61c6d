"""The usage log: one JSON line per record, appended, and in the kernel as soon as it is written -- nothing is
buffered in the process, so a killed edge loses no line of a request it answered."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from edgepath.edge.tenancy.usage import Usage, UsageLog


def test_each_record_is_one_line_visible_before_the_log_is_closed(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    path.write_text('{"earlier": true}\n')  # appended to, never truncated
    log = UsageLog(str(path))
    log(Usage("acme", 7, "/v1/chat/completions", "smollm2", 261, 256, 12, "stop", 81.5, 3.25))
    assert len(path.read_text().splitlines()) == 2  # read through another descriptor: already written
    log(Usage("key-0123456789ab", 8, "/v1/generate", None, 5, 0, 1, "cancelled", None, None))
    log.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"earlier": True}
    first, second = lines[1], lines[2]
    assert list(first) == [
        "time", "tenant", "request_id", "route", "model", "prompt_tokens", "cached_tokens", "completion_tokens",
        "finish", "ttft_ms", "wait_ms", "answer_id",
    ]  # fmt: skip
    assert first["time"] > 1.7e9 and (first["prompt_tokens"], first["cached_tokens"]) == (261, 256)
    assert first["model"] == "smollm2" and second["model"] is None
    assert second["finish"] == "cancelled" and second["ttft_ms"] is None


def test_a_log_that_cannot_be_opened_says_which(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--usage-log .*missing/usage.jsonl: cannot open it"):
        UsageLog(str(tmp_path / "missing" / "usage.jsonl"))


def test_a_line_names_the_openai_answers_id_so_a_client_can_join_it(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    log = UsageLog(str(path))
    log(Usage("acme", 9, "/v1/completions", "smollm2", 3, 0, 2, "stop", 10.0, 0.0, "cmpl-ep4"))
    log.close()
    assert json.loads(path.read_text())["answer_id"] == "cmpl-ep4"


LINE = Usage("acme", 1, "/v1/completions", "smollm2", 3, 0, 2, "stop", 10.0, 0.0, "cmpl-ep1")


def synced(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The descriptors ``os.fdatasync`` is called on, in order (the call still made)."""
    calls: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return calls


def test_fsync_line_syncs_each_line_before_the_call_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = synced(monkeypatch)
    log = UsageLog(str(tmp_path / "usage.jsonl"), fsync="line")
    for expected in (1, 2, 3):
        log(LINE)
        assert len(calls) == expected  # on the disk before the answer goes out
    log.close()


def test_fsync_interval_syncs_written_lines_from_a_thread_and_idles_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = synced(monkeypatch)
    log = UsageLog(str(tmp_path / "usage.jsonl"), fsync="interval", interval=0.01)
    log(LINE)
    assert calls == []  # the request does not wait for the disk
    deadline = time.monotonic() + 10
    while not calls:
        assert time.monotonic() < deadline, "the interval's fsync never came"
        time.sleep(0.01)
    done = len(calls)
    log.close()
    assert len(calls) <= done + 1  # nothing written since: no more syncs but close's own


def test_fsync_none_never_syncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = synced(monkeypatch)
    log = UsageLog(str(tmp_path / "usage.jsonl"))
    log(LINE)
    log.close()
    assert calls == []


@pytest.mark.parametrize("fsync", ["none", "line", "interval"])
def test_reopen_after_a_rotation_writes_on_at_the_path_and_loses_no_line(tmp_path: Path, fsync: str) -> None:
    path, rotated = tmp_path / "usage.jsonl", tmp_path / "usage.jsonl.1"
    log = UsageLog(str(path), fsync=fsync, interval=0.01)
    log(LINE)
    path.rename(rotated)  # logrotate's rename
    log(LINE)  # between the rename and the SIGHUP: into the renamed file
    log.reopen()
    log(LINE)
    log.close()
    assert len(rotated.read_text().splitlines()) == 2 and len(path.read_text().splitlines()) == 1


def test_a_reopen_that_cannot_open_keeps_the_file_in_use(tmp_path: Path) -> None:
    folder = tmp_path / "logs"
    folder.mkdir()
    path = folder / "usage.jsonl"
    log = UsageLog(str(path))
    path.rename(tmp_path / "moved.jsonl")
    folder.rmdir()
    with pytest.raises(ValueError, match="cannot open it"):
        log.reopen()
    log(LINE)  # still written, into the file in use
    log.close()
    assert len((tmp_path / "moved.jsonl").read_text().splitlines()) == 1
