"""Overload: open-loop load at twice capacity for 60 s. Only 200 or 429 come back, accepted requests'
p99 stays within 2x of its value at half capacity, and the processes' memory stays flat."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hdrh.histogram import HdrHistogram
from helpers.edge import free_port

pytestmark = pytest.mark.slow

CAPACITY = 100.0  # echo with delay=0.01: 10 ms per request, one at a time
BODY = json.dumps({"prompt": "overload " * 20, "max_tokens": 64})


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def family(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(int(k) for k in kids)]


def load(port: int, rate: float, seconds: float) -> subprocess.Popen[str]:
    count = int(rate * seconds)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgepath.bench.loadgen",
            f"https://127.0.0.1:{port}/v1/generate",
            "--schedule",
            f"poisson:{rate}",
            "--count",
            str(count),
            "--body",
            BODY,
            "--timeout",
            "10",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[dict[int, HdrHistogram], dict]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    raw = json.loads(out.strip().splitlines()[-1])
    return {int(k): HdrHistogram.decode(v) for k, v in raw["histograms"].items()}, raw["errors"]


def test_twice_capacity_for_a_minute_gives_only_200_or_429_with_latency_and_memory_flat(tmp_path: Path) -> None:
    port = free_port()
    serve = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "edgepath",
            "serve",
            "--port",
            str(port),
            "--slots",
            "2",
            "--frames",
            "64",
            "--handler",
            "echo",
            "--handler-option",
            "delay=0.01",
            "--input-capacity",
            "256",
            "--output-capacity",
            "256",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        assert serve.stdout is not None and serve.stdout.readline().startswith("ready")
        half, errors = finish(load(port, CAPACITY / 2, 20), timeout=120)
        assert set(half) <= {200, 429} and not errors
        p99_half = half[200].get_value_at_percentile(99)

        overload = load(port, 2 * CAPACITY, 60)
        time.sleep(10)  # past warm-up: allocator pools, histograms, connections
        pids = family(serve.pid)
        early = {pid: rss_kib(pid) for pid in pids}
        time.sleep(45)
        late = {pid: rss_kib(pid) for pid in pids}
        hist, errors = finish(overload, timeout=180)
    finally:
        serve.terminate()
        serve.wait(timeout=20)
    assert not errors, errors
    assert set(hist) <= {200, 429}, f"statuses other than 200/429 under overload: {sorted(hist)}"
    ok, refused = hist[200].get_total_count(), hist.get(429, HdrHistogram(1, 2, 1)).get_total_count()
    assert ok + refused == int(2 * CAPACITY * 60)
    assert refused > 0.3 * (ok + refused), "twice capacity should be refused about half the time"
    p99_over = hist[200].get_value_at_percentile(99)
    print(
        f"overload: {ok} accepted, {refused} refused; accepted p99 {p99_over} us (at half load {p99_half} us); "
        f"RSS KiB early {early} late {late}"
    )
    assert p99_over <= 2 * p99_half, f"accepted p99 {p99_over} us at 2x load vs {p99_half} us at 0.5x"
    for pid in pids:
        assert late[pid] <= early[pid] * 1.10 + 4096, f"process {pid} grew from {early[pid]} to {late[pid]} KiB"
