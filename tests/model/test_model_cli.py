"""The command-line clients against SmolLM2 as a user runs them: ``edgepath serve`` (HTTP/3, the model) in a
subprocess, asked by ``edgepath chat`` and ``edgepath request``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from edgepath.children import Child, free_port

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
pytestmark = pytest.mark.slow  # a served model in a subprocess


def edgepath(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "edgepath", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_chat_and_request_against_the_model(
    edgepath_process: Callable[..., Child], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``edgepath chat`` goes through the chat template, so the instruct model answers the question (the raw
    route, without the template, once printed an empty answer to it); ``edgepath request`` prints the text and
    stops at its own default of 128 tokens, not at the server's 512."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    port = str(free_port())
    edgepath_process(
        "serve", "--port", port, "--slots", "2", "--input-capacity", "256", "--output-capacity", "512",
        "--handler-option", "threads=1", timeout=180,
    )  # fmt: skip

    chat = edgepath(
        "chat", "--port", port, "--temperature", "0", "--system", "You are a helpful assistant.", "--usage",
        "What is the capital of France?",
    )  # fmt: skip
    assert chat.returncode == 0, chat.stderr
    assert "Paris" in chat.stdout
    assert "finish: stop" in chat.stderr

    done = edgepath("request", "--port", port, "--ids", "Once upon a time")
    assert done.returncode == 0, done.stderr
    status, *text, counts = done.stdout.split("\nserver timing")[0].splitlines()
    assert status == "HTTP/3 200" and "".join(text).strip()
    ids = counts.split(" out: ")[1].split()
    assert counts.endswith(f"{len(ids)} out: {' '.join(ids)}") and 0 < len(ids) <= 128
