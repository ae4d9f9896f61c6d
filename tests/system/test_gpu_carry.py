"""The GPU check's carry runs where the device runs: prepared here for Python 3.12 (bench/gpu_check.py --prepare),
then what the GPU machine will do (--prove): the tree as the device tool sends it with the carry, a clean venv of
Python 3.12 holding only the device image's packages that the check uses (numpy, pytest, hypothesis, h11), every
product module imported there, and the whole dry run, every step ok.  The first run fetches wheels from PyPI;
pip's cache makes later ones cheap."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRY = "dry-run (CPU twin)"
STEPS = ["build", "probe", "smoke", "baseline", "poller_rtt", "device_pool", "gpu_tests", "echo"]


def _bench(name: str) -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _python312() -> str:
    """``python3.12`` on PATH, else pyenv's newest 3.12 (the GPU machine runs 3.12.3)."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    pyenvs = sorted(pyenv.glob("3.12.*/bin/python3.12"), key=lambda p: [int(n) for n in re.findall(r"\d+", str(p))])
    found = [shutil.which("python3.12"), *reversed(pyenvs)]
    for candidate in filter(None, found):
        done = subprocess.run([str(candidate), "-c", "import sys, venv; print(sys.version_info[:2] == (3, 12))"],
                              capture_output=True, text=True, check=False)  # fmt: skip
        if done.stdout.strip() == "True":
            return str(candidate)
    pytest.skip(f"no Python 3.12 here (python3.12 on PATH, or {pyenv}/3.12.*): the GPU machine's Python is 3.12")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_prepared_carry_runs_in_a_clean_python_312(tmp_path: Path) -> None:
    python = _python312()
    gpu_check = _bench("gpu_check")
    if gpu_check.gpu_steps.cuda_build().find_nvcc() is None:
        if os.environ.get("CI"):
            pytest.fail("nvcc not found on a CI machine: --prepare builds the poller's fatbin with it")
        pytest.skip("nvcc not found: --prepare builds the poller's fatbin with it")
    carry = tmp_path / "carry"
    try:
        gpu_check.prepare(python, carry)
        report = gpu_check.prove(python, carry, tmp_path / "out")
    except SystemExit as exc:
        pytest.fail(str(exc))
    assert report["result"] == f"ok, {DRY}" and list(report["steps"]) == STEPS
    assert all(step["status"].startswith("ok") for step in report["steps"].values()), report["steps"]
    assert report["python"].startswith("3.12.") and report["travels_mib"] <= 64
    # every third-party module the product imports was carried, but what the device image has
    wheels = {name.split("-")[0].lower() for name in report["steps"]["build"]["wheels"]}
    assert {"orjson", "cffi", "aioquic"} <= wheels and not wheels & {"numpy", "h11", "pytest"}, wheels
