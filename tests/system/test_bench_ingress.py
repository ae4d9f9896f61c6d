"""``edgepath bench ingress``: the verdicts of a run (sustained, client-bound), the split of one schedule over
generator processes, the comparisons and the performance page's block -- and, slow-marked, the whole ``--quick`` run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgepath.bench.ingress import (
    INGRESS_BEGIN,
    INGRESS_END,
    SYSTEMS,
    RunStats,
    ratios,
    rewrite_doc,
    summarize,
    system,
    table,
)
from edgepath.bench.loadgen import Results, part_of
from edgepath.bench.schedule import parse

EDGE = system("edgepath-aioquic")


def raw(
    n: int = 1000,
    seconds: float = 1.0,
    latency_s: float = 0.002,
    lag_us: int = 100,
    refused: int = 0,
    errors: dict[str, int] | None = None,
    capped: int = 0,
    cpu_seconds: float = 0.3,
    drain_s: float = 0.01,
) -> dict:
    """One generator's result line, as bench/loadgen.py prints it."""
    r = Results(sent=n, capped=capped, start=100.0, schedule_seconds=seconds, cpu_seconds=cpu_seconds)
    lost = sum((errors or {}).values())
    for i in range(n - lost):
        r.record(429 if i < refused else 200, latency_s)
        r.lag.record_value(lag_us)
    r.errors.update(errors or {})
    r.response_bytes = 300 * (n - lost)
    r.finished = r.start + seconds + drain_s
    return r.to_json()


def stats(**kw: object) -> RunStats:
    return summarize(EDGE, "test", 1000.0, 1.0, [raw(**kw)], {"edge": 0.4, "slot-server": 0.1})  # type: ignore[arg-type]


def test_a_clean_run_is_sustained_with_cpu_per_answered_request() -> None:
    s = stats()
    assert s.sustained and not s.client_bound
    assert s.ok == s.sent == 1000 and s.errors == {}
    assert s.server_cpu_us == pytest.approx({"edge": 400.0, "slot-server": 100.0})
    assert s.p50_us == pytest.approx(2000, rel=0.01)
    assert s.response_bytes_mean == pytest.approx(300)


@pytest.mark.parametrize(
    ("kw", "why"),
    [
        ({"errors": {"timeout": 3}}, "timeouts"),
        ({"refused": 50}, "5% refused"),
        ({"drain_s": 0.8}, "answers long after the last send"),
        ({"latency_s": 0.2}, "p99 over 100 ms"),
        ({"seconds": 1.0, "n": 900}, "answered rate below the offered rate"),
    ],
)
def test_unsustained_runs(kw: dict, why: str) -> None:
    assert not stats(**kw).sustained, why


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"lag_us": 5000}, "sends behind schedule"),
        ({"capped": 50}, "handle pool full"),
        ({"cpu_seconds": 0.95}, "of a core"),
    ],
)
def test_client_bound_runs_say_why(kw: dict, reason: str) -> None:
    s = stats(**kw)
    assert reason in s.client_bound


def test_a_client_bound_run_on_full_cores_says_so() -> None:
    cores = os.cpu_count() or 1
    s = summarize(EDGE, "test", 1000.0, 1.0, [raw(lag_us=5000)], {"edge": float(cores)})
    assert f"the machine's {cores} cores were full" in s.client_bound
    assert s.cores_busy >= cores
    assert "cores were full" not in stats(lag_us=5000).client_bound


def test_generator_parts_send_the_whole_schedule_once() -> None:
    offsets = parse("poisson:500", 1001, seed=3)
    parts = [part_of(offsets, f"{i}/3") for i in range(3)]
    assert sorted(np.concatenate(parts).tolist()) == offsets.tolist()
    with pytest.raises(ValueError, match="0 <= I < N"):
        part_of(offsets, "3/3")


def test_unknown_system_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="choose from edgepath-aioquic"):
        system("edgepath")
    assert system("fastapi-direct").protocol == "h1" and system("floor-qh3").engine == "qh3"
    workers = system("edgepath-aioquic-w2")
    assert (workers.protocol, workers.engine, workers.workers) == ("h3", "aioquic", 2)
    assert system("edgepath-qh3").workers == 1


def _run(name: str, load: str, edge_cpu: float, other_cpu: float, spread: float) -> dict:
    cpu = {"edge": edge_cpu, "slot-server": other_cpu} if name.startswith("edgepath") else {"floor": edge_cpu}
    return {
        "system": name,
        "protocol": system(name).protocol,
        "load": load,
        "offered_rps": 500.0,
        "sent": 100,
        "ok": 100,
        "rejected_429": 0,
        "other_status": 0,
        "errors": {},
        "answered_rps": 500.0,
        "sustained": True,
        "p50_us": 1000.0,
        "p99_us": 1000.0 + spread,
        "p999_us": 3000.0,
        "spread_us": spread,
        "server_cpu_us": cpu,
        "client_bound": "",
        "curve": [],
    }


def test_ratios_compare_cpu_per_request_at_the_same_load_and_the_table_shows_every_row(tmp_path: Path) -> None:
    load = "same offered load"
    report = {
        "machine": {"cpu": "x86_64", "cores": 2, "python": "3.11", "loadavg_start": [0.1, 0.1, 0.1]},
        "client": "libcurl",
        "started": "now",
        "capacity": {
            "edgepath-aioquic": {"rps": 1000.0, "bound": "server", "note": ""},
            "edgepath-aioquic-w2": {"rps": 1500.0, "bound": "client", "note": "client-bound at 2,250 req/s (cpu)"},
        },
        "runs": [
            _run("edgepath-aioquic", load, 500.0, 60.0, 400.0),
            _run("floor-aioquic", load, 400.0, 0.0, 300.0),
            _run("edgepath-qh3", load, 200.0, 60.0, 400.0),
            _run("edgepath-aioquic", "50% of own capacity", 500.0, 60.0, 1200.0),
        ],
    }
    report["ratios"] = ratios(report)
    rows = {r["what"]: r for r in report["ratios"]}
    assert rows["requests per CPU-second, edge process on aioquic ÷ aioquic floor"]["value"] == pytest.approx(0.8)
    assert rows["CPU per request, whole edgepath on qh3 (all processes) ÷ aioquic floor"]["value"] == pytest.approx(
        260 / 400
    )
    assert rows["edgepath-aioquic P99-P50 at half capacity (ms)"]["value"] == pytest.approx(1.2)
    workers = next(r for what, r in rows.items() if what.startswith("capacity, `serve --workers 2`"))
    assert workers["value"] is None and "not measurable here" in workers["what"]  # two is a client-bound lower bound
    assert "two: client-bound at 2,250 req/s (cpu)" in workers["what"]
    report["capacity"]["edgepath-aioquic-w2"] = {"rps": 1500.0, "bound": "server", "note": "not sustained at 2,250"}
    (measured,) = [r for r in ratios(report) if r["what"] == "capacity, `serve --workers 2` ÷ one worker, aioquic"]
    assert measured["value"] == pytest.approx(1.5)
    text = table(report)
    assert "edge 500 + slot-server 60 = 560" in text and text.count("| same offered load |") == 3

    png = tmp_path / "ingress.png"
    png.write_bytes(b"png")
    doc = tmp_path / "docs" / "PERFORMANCE.md"  # the plot goes next to the page, linked by its name
    doc.parent.mkdir()
    doc.write_text(f"# x\n{INGRESS_BEGIN}\nstale figures\n{INGRESS_END}\ntail\n")
    rewrite_doc(doc, text, png)
    content = doc.read_text()
    assert "![latency percentiles](ingress.png)" in content
    assert "stale figures" not in content and text in content and content.endswith("tail\n")
    assert (tmp_path / "docs" / "ingress.png").read_bytes() == b"png"


@pytest.mark.slow
def test_quick_run_reaches_every_system_and_writes_the_report(tmp_path: Path) -> None:
    """``edgepath bench ingress --quick``: every system answers every request; the report has every field."""
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "edgepath", "bench", "ingress", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "ingress.json").read_text())
    assert [r["system"] for r in report["runs"]] == list(SYSTEMS)
    roles = {
        "edgepath-aioquic": {"edge", "slot-server"},
        "edgepath-qh3": {"edge", "slot-server"},
        "edgepath-aioquic-w2": {"edge", "edge-worker-1", "edge-worker-2", "slot-server"},
        "floor-aioquic": {"floor"},
        "floor-qh3": {"floor"},
        "fastapi-batch": {"fastapi", "slot-server"},
        "fastapi-direct": {"fastapi", "slot-server"},
    }
    for r in report["runs"]:
        assert r["errors"] == {} and r["other_status"] == 0, r
        assert r["ok"] + r["rejected_429"] == r["sent"] > 0 and r["ok"] > 0, r
        assert set(r["server_cpu_us"]) == roles[r["system"]], r
        assert r["generators"] == 1 and isinstance(r["client_bound"], str) and isinstance(r["sustained"], bool)
    for r in report["runs"]:
        inside = r["edge_internal"]  # the edge's /health?latency window, read after its run
        if r["system"] == "edgepath-aioquic-w2":  # the window of the worker that answered /health: its share
            assert inside["samples"] > 0 and inside["p99_us"] >= inside["p50_us"] > 0, r
        elif r["system"].startswith("edgepath-"):
            assert inside["samples"] >= r["ok"] and inside["p99_us"] >= inside["p50_us"] > 0, r
        else:
            assert inside == {}, r
    floor = next(r for r in report["runs"] if r["system"] == "floor-aioquic")
    edge = next(r for r in report["runs"] if r["system"] == "edgepath-aioquic")
    assert abs(floor["response_bytes_mean"] - edge["response_bytes_mean"]) <= 2  # the floor answers edge's size
    assert (out / "ingress.png").stat().st_size > 0
    assert all(f"| {name} |" in done.stdout for name in SYSTEMS)


def test_the_command_runs_every_system_by_default_and_its_help_names_them_all() -> None:
    from edgepath.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "ingress"])
    assert args.systems is None  # bench.ingress.main takes every system
    bench = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices["bench"]  # type: ignore[union-attr]
    ingress = next(a for a in bench._subparsers._group_actions if a.dest == "bench").choices["ingress"]  # type: ignore[union-attr]
    text = ingress.format_help().replace("\n", " ").replace(" ", "")
    assert all(name.replace("-", "") in text.replace("-", "") for name in SYSTEMS)


@pytest.mark.parametrize("command", ["ingress", "model", "stream", "edge-cpu"])
def test_every_benchmark_takes_the_page_to_rewrite_as_doc_and_as_its_old_name_readme(command: str) -> None:
    from edgepath.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["bench", command]).doc is None  # no page named: nothing is rewritten
    for flag in ("--doc", "--readme"):
        assert str(parser.parse_args(["bench", command, flag, "docs/PERFORMANCE.md"]).doc) == "docs/PERFORMANCE.md"
