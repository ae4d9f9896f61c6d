"""``system_fingerprint`` (model/fingerprint.py): the same for the same model file, build and options -- across
processes -- and another when any of them changes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

from edgepath.model.fingerprint import system_fingerprint

OPTIONS = (("threads", "2"), ("flash_attn", "auto"))


def test_the_same_file_build_and_options_give_the_same_fingerprint_in_another_process(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    here = system_fingerprint(model, OPTIONS)
    assert here.startswith("fp_") and len(here) == 15
    code = (
        "from pathlib import Path; from edgepath.model.fingerprint import system_fingerprint as f; "
        f"print(f(Path({str(model)!r}), {OPTIONS!r}))"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert there == here
    assert system_fingerprint(model, (*OPTIONS, ("model", "/elsewhere/m.gguf"))) == here  # the path is not the file


def test_another_file_or_options_give_another_fingerprint(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"\0" * 1024)
    first = system_fingerprint(model, OPTIONS)
    assert system_fingerprint(model, (("threads", "2"), ("flash_attn", "off"))) != first
    model.write_bytes(b"GGUF" + b"\0" * 1023 + b"\1")
    assert system_fingerprint(model, OPTIONS) != first
