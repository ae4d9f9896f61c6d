"""bench/gpu_check.py without a GPU: the dry run's report is complete, and a run that fails keeps going.

The figures of a dry run come from a CPU thread playing the kernel; these tests check the plumbing and
the labels, never a figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["build", "probe", "smoke", "baseline", "poller_rtt", "device_pool", "gpu_tests", "echo"]


def _no_gpu() -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return
    pytest.skip("cupy is installed: this machine may have a GPU")


def _check(out: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=out, env=env)


def test_dry_run_report_is_complete_and_labelled(tmp_path: Path) -> None:
    _no_gpu()
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    done = _check(tmp_path, "--dry-run", "--iterations", "50", "--requests", "20", env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())  # $OUT is the default
    assert list(report["steps"]) == STEPS and report["result"] == "ok" and report["dry_run"] is True
    for name in STEPS[1:]:
        step = report["steps"][name]
        assert step["status"] == "ok", (name, step)
        assert str(step["gpu"]).startswith("not run: no GPU"), (name, step)
    rtt = report["steps"]["poller_rtt"]
    for backoff in ("backoff_0ns", "backoff_32ns"):
        assert rtt[backoff]["counters"]["accepted"] == 250 and rtt[backoff]["counters"]["lost"] == 0
        assert rtt[backoff]["doorbell_to_handoff_round_trip"]["n"] == 50
    assert report["steps"]["device_pool"]["counters"]["accepted"] == 400
    assert report["steps"]["smoke"]["cpu_increments"]["got"] == 100_000
    for c in ("concurrency_1", "concurrency_8"):
        assert report["steps"]["echo"][c]["ok"] == 20


def test_a_failing_step_does_not_stop_the_run(tmp_path: Path) -> None:
    """Without a GPU and without --dry-run, smoke fails (no cupy) and the later steps still run and report."""
    _no_gpu()
    done = _check(tmp_path, "--out", str(tmp_path), "--only", "probe", "--only", "smoke", "--only", "device_pool")
    assert done.returncode == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["steps"]) == ["build", "probe", "smoke", "device_pool"] and report["result"] == "failed"
    assert report["steps"]["probe"]["status"] == "ok" and "not run: no GPU" in report["steps"]["probe"]["gpu"]
    for name in ("smoke", "device_pool"):
        assert report["steps"][name]["status"] == "failed" and "cupy" in report["steps"][name]["error"]


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    """A step that overruns is killed (its whole process group) and recorded as a timeout."""
    _no_gpu()
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    args = types.SimpleNamespace(iterations=10, requests=10**7, dry_run=True)  # an echo run of hours
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = gpu_check.run_step("echo", 20, env, args, tmp_path)
    assert result["status"] == "timeout" and result["error"] == "killed after 20 s", result
    assert not (tmp_path / "echo.json").exists()
