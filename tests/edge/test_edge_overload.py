"""Shedding before the memory limit (edge/overload.py): above the high-water mark new work is a 503 ``overloaded``
with ``Retry-After`` in its route's shape, the ops pages still answer, and ``/metrics`` says so (issue 49)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edgepath.dpu.port import DeliveryStats
from edgepath.edge.apis.openai_routes import ChatSupport, OpenAIRoutes
from edgepath.edge.http import Limits, Request, Response
from edgepath.edge.lifecycle import EdgeLifecycle, Respond
from edgepath.edge.metrics import EdgeMetrics
from edgepath.edge.overload import RESUME, MemoryGuard, MemoryReading, cgroup_limit, read_memory
from edgepath.edge.routes import HttpCore

MIB = 1 << 20


def test_the_guard_sheds_above_the_mark_and_resumes_a_little_below_it() -> None:
    guard = MemoryGuard(0.8)
    assert not guard.update(MemoryReading(79 * MIB, 100 * MIB))
    assert guard.update(MemoryReading(80 * MIB, 100 * MIB))
    assert guard.update(MemoryReading(int(80 * MIB * RESUME) + 1, 100 * MIB))  # no flapping at the mark
    assert not guard.update(MemoryReading(int(80 * MIB * RESUME) - 1, 100 * MIB))
    assert not guard.update(MemoryReading(10**12, None))  # no limit known: nothing to guard
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        MemoryGuard(1.5)


def _proc(tmp_path: Path, cgroup: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "statm").write_text("1000 256 10 1 0 100 0\n")
    (proc / "cgroup").write_text(cgroup)
    return proc


def test_the_limit_is_the_cgroups_unless_one_is_given(tmp_path: Path) -> None:
    cgroups = tmp_path / "cgroup"
    (cgroups / "pod" / "edge").mkdir(parents=True)
    (cgroups / "pod" / "edge" / "memory.max").write_text("2147483648\n")
    v2 = _proc(tmp_path, "0::/pod/edge\n")
    reading = read_memory(proc=v2, cgroups=cgroups)
    assert reading.limit == 2 << 30 and reading.used == 256 * os.sysconf("SC_PAGE_SIZE")
    assert read_memory(123, proc=v2, cgroups=cgroups).limit == 123
    (cgroups / "pod" / "edge" / "memory.max").write_text("max\n")
    assert cgroup_limit(v2, cgroups) is None
    (cgroups / "memory" / "box").mkdir(parents=True)
    (cgroups / "memory" / "box" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cgroup").write_text("4:memory:/box\n0::/\n")
    assert cgroup_limit(v1, cgroups) is None
    (cgroups / "memory" / "box" / "memory.limit_in_bytes").write_text("536870912\n")
    assert cgroup_limit(v1, cgroups) == 512 * MIB


class _Port:
    """Nothing is ever asked of the port while the edge sheds: the request is answered before it takes a frame."""

    frames = None


def test_new_work_is_shed_with_503_in_its_routes_shape_and_the_ops_pages_still_answer() -> None:
    metrics = EdgeMetrics(lambda: 0.0, DeliveryStats)
    core = HttpCore(Limits(1 << 20, 16, 16, 100), openai=OpenAIRoutes("m", 16, 100, ChatSupport(False, ""), 0))
    edge = EdgeLifecycle(core, None, _Port(), metrics, lambda: 0, workers=1, request_timeout_ns=1)  # type: ignore[arg-type]
    edge.admission.memory.update(MemoryReading(900 * MIB, 1000 * MIB))
    metrics.watch_memory(edge.admission.memory)
    requests = [
        Request("POST", "/v1/generate", [], b'{"prompt": "hi"}', 0),
        Request("POST", "/v1/completions", [], b'{"model": "m", "prompt": "hi"}', 0),
    ]
    answers = [edge.receive(i, r, now=0) for i, r in enumerate(requests)]
    for (answer,) in answers:
        assert isinstance(answer, Respond) and answer.response.status == 503
        assert (b"retry-after", b"1") in answer.response.headers
    generate, completions = (json.loads(a[0].response.body)["error"] for a in answers)
    assert generate["type"] == "overloaded" and "900 MiB of its 1000 MiB" in generate["message"]
    assert completions["code"] == "overloaded"  # OpenAI's shape on an OpenAI route
    assert metrics.registry.get_sample_value("edgepath_overloaded") == 1
    assert metrics.registry.get_sample_value("edgepath_memory_limit_bytes") == 1000 * MIB
    (live,) = edge.receive(9, Request("GET", "/health/live", [], b"", 0), now=0)
    assert isinstance(live.response, Response) and live.response.status == 200
