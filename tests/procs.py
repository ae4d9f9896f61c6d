"""Running tests/claimer.py processes from tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CLAIMER = str(Path(__file__).with_name("claimer.py"))


def start_claimer(mode: str, config: dict, stdin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, CLAIMER, mode, json.dumps(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        text=True,
    )


def result_of(proc: subprocess.Popen[str], timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"claimer failed ({proc.returncode}):\n{err}"
    return json.loads(out.strip().splitlines()[-1])
