"""bench/gpu_check.py without a GPU: the dry run's report is complete, and a run that fails keeps going.

The figures of a dry run come from a CPU thread playing the kernel; these tests check the plumbing and
the labels, never a figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["build", "probe", "smoke", "baseline", "poller_rtt", "device_pool", "gpu_tests", "echo"]
DRY = "dry-run (CPU twin)"


def _bench(name: str) -> Any:
    """bench/gpu_check.py or bench/gpu_steps.py, imported as the scripts import each other."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _dicts(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _dicts(value)
    elif isinstance(node, list):
        for value in node:
            yield from _dicts(value)


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
    """A dry run says so at the top, in its result, in every step's status (but the build's, which is real)
    and on every figure."""
    _no_gpu()
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    done = _check(tmp_path, "--dry-run", "--iterations", "50", "--requests", "20", env=env)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())  # $OUT is the default
    assert next(iter(report)) == "mode" and report["mode"].startswith(DRY)
    assert list(report["steps"]) == STEPS and report["result"] == f"ok, {DRY}" and report["dry_run"] is True
    assert report["worst_case_s"] <= 360
    for name in STEPS[1:]:
        step = report["steps"][name]
        assert step["status"] == f"ok, {DRY}", (name, step)
        assert str(step["gpu"]).startswith("not run: no GPU") and DRY in step["gpu"], (name, step)
    figures = [
        d
        for d in _dicts(report["steps"])
        if any(
            (k.endswith(("_us", "_ns", "_khz_measured")) or k in ("value", "expected")) and isinstance(v, (int, float))
            for k, v in d.items()
        )
    ]
    assert len(figures) > 20
    assert all(d.get("on") == DRY for d in figures), [d for d in figures if d.get("on") != DRY]
    assert all(d["on"] == DRY for d in _dicts(report["steps"]) if "on" in d)
    rtt = report["steps"]["poller_rtt"]
    for backoff in ("backoff_0ns", "backoff_32ns"):
        assert rtt[backoff]["counters"]["accepted"] == 250 and rtt[backoff]["counters"]["lost"] == 0
        assert rtt[backoff]["one_way_doorbell_to_detect"]["n"] == 50
        assert rtt[backoff]["doorbell_to_handoff_round_trip"]["n"] == 50
        assert rtt[backoff]["targets"] == {"judged": f"no: {DRY}; the targets are judged on a GPU run only"}
        assert rtt[backoff]["in_kernel_detect_to_publish"]["n"] == 50
    assert report["steps"]["device_pool"]["counters"]["accepted"] == 400
    cas = report["steps"]["smoke"]["cas_neighbour"]
    assert cas["gpu_cas_word0"] == 100_000 and cas["cpu_add_word1"] == cas["cpu_adds_made_while_the_cas_loop_ran"] > 0
    for c in ("concurrency_1", "concurrency_8"):
        echo = report["steps"]["echo"][c]
        assert echo["ok"] == 20
        assert not any(k.startswith("write_to_ready") for k in echo["stage_us_p50_p99_max"])


def test_a_step_without_its_carry_is_not_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a Python without edgepath's extension or cffi and nothing carried, the steps that import
    edgepath say "not run: no carry" (with what is missing); the rest run, nothing crashes."""
    _no_gpu()
    gpu_check = _bench("gpu_check")
    monkeypatch.setattr(gpu_check, "CARRY", tmp_path / "no-carry")
    monkeypatch.setattr(gpu_check.sysconfig, "get_config_var", lambda name: ".cpython-399-x86_64-linux-gnu.so")
    monkeypatch.setattr(gpu_check, "unimportable", lambda names, site: list(names))
    for name in (gpu_check.gpu_steps.HOST_LIB_ENV, "EDGEPATH_POLLER_FATBIN"):  # main() sets them for its steps
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)  # restored to unset afterwards, whatever main() put there
    code = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--only", "probe", "--only", "echo"])
    report = json.loads((tmp_path / "report.json").read_text())
    assert code == 1 and report["result"] == f"incomplete: echo not run ({DRY})"
    assert report["steps"]["probe"]["status"] == f"ok, {DRY}"
    echo = report["steps"]["echo"]
    assert echo["status"] == "not run: no carry" and "--prepare" in echo["how"]
    assert any("_core.cpython-399" in m for m in echo["missing"]) and any(m.startswith("cffi") for m in echo["missing"])


def test_the_whole_check_fits_its_budget() -> None:
    """Every step's timeout and the build's budget together: about 6 minutes, so one rerun fits the
    15 minutes of device time with the machine's start."""
    gpu_check = _bench("gpu_check")
    assert gpu_check.WORST_CASE_S == gpu_check.BUILD_BUDGET + sum(t for _, t, _ in gpu_check.PLAN) <= 360


def test_clock_calibration_recovers_a_known_offset() -> None:
    """Synthetic ping-pongs with a known GPU-host offset and unequal legs: the midpoint calibration is off
    by half the legs' difference at most, which its uncertainty (half the fastest round trip) covers."""
    steps = _bench("gpu_steps")
    rng = np.random.default_rng(1)
    offset, n = 1_700_000_000_000_000_123, 2000  # as %globaltimer - CLOCK_MONOTONIC: not a float64
    t0 = np.cumsum(rng.integers(1_000, 3_000, n)) + 10**12
    there = rng.integers(600, 900, n) + (rng.random(n) < 0.05) * rng.integers(0, 20_000, n)  # host -> GPU
    back = rng.integers(400, 700, n)  # GPU -> host
    samples = np.stack([t0, t0 + there + back, t0 + there + offset], axis=1).astype(np.uint64)
    got = steps.calibration(samples)
    assert abs(got["offset_ns"] - offset) <= got["uncertainty_ns"]
    assert got["min_round_trip_ns"] == int((there + back).min())
    symmetric = samples.copy()
    symmetric[:, 1] = t0 + 2 * there
    assert steps.calibration(symmetric)["offset_ns"] == offset  # exact: integer arithmetic, no float rounding
    later = {**got, "offset_ns": got["offset_ns"] + 100, "at_host_ns": got["at_host_ns"] + 10**9}
    mid = steps.offset_at(got, later, np.array([got["at_host_ns"] + 5 * 10**8], dtype=np.int64))
    assert mid.dtype == np.int64 and mid[0] == got["offset_ns"] + 50


def test_host_atomic_capabilities_are_decoded_by_name() -> None:
    steps = _bench("gpu_steps")
    assert steps.decode_capabilities(0b11011) == ["signed", "unsigned", "scalar_32", "scalar_64"]
    assert steps.decode_capabilities(1 << 9) == ["bits 0x200"]
    assert steps.ATOMIC_OPERATIONS.index("cas") == 9  # CU_ATOMIC_OPERATION_CAS in cuda.h


def test_a_failing_step_does_not_stop_the_run(tmp_path: Path) -> None:
    """Without a GPU and without --dry-run, smoke fails (no cupy) and the later steps still run and report."""
    _no_gpu()
    done = _check(tmp_path, "--out", str(tmp_path), "--only", "probe", "--only", "smoke", "--only", "device_pool")
    assert done.returncode == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["steps"]) == ["build", "probe", "smoke", "device_pool"]
    assert report["result"] == "failed: smoke, device_pool", report["steps"]["build"]
    assert report["mode"] == "GPU run"
    assert report["steps"]["probe"]["status"] == "ok" and "not run: no GPU" in report["steps"]["probe"]["gpu"]
    for name in ("smoke", "device_pool"):
        assert report["steps"][name]["status"] == "failed" and "cupy" in report["steps"][name]["error"]


def test_a_step_past_its_timeout_is_killed_with_its_children(tmp_path: Path) -> None:
    """A step that overruns is killed (its whole process group) and recorded as a timeout."""
    _no_gpu()
    gpu_check = _bench("gpu_check")
    args = types.SimpleNamespace(iterations=10, requests=10**7, dry_run=True)  # an echo run of hours
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = gpu_check.run_step("echo", 20, env, args, tmp_path)
    assert result["status"] == "timeout" and result["error"] == "killed after 20 s", result
    assert not (tmp_path / "echo.json").exists()
