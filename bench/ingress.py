"""``edgepath bench ingress``: open-loop end-to-end latency and server CPU per request, side by side.

Systems (each started fresh, on loopback; those with a slot server use the same echo slot server):

  edgepath-aioquic  ``edgepath serve --transport quic`` (HTTP/3 on aioquic, the reference engine);
  edgepath-qh3      the same with ``--quic-engine qh3``;
  edgepath-aioquic-w2  ``serve --workers 2``: two edge processes on one UDP port (SO_REUSEPORT), each with
                    its own agent on the one slot server (each worker's CPU is reported on its own);
  floor-aioquic     bare aioquic HTTP/3 server answering a fixed body of edgepath's mean response size;
  floor-qh3         the same on qh3;
  fastapi-batch     uvicorn + FastAPI over TLS (HTTP/1.1) + asyncio.Queue + dynamic batcher (Ray Serve's
                    defaults: 10 requests, 10 ms) feeding the slot server;
  fastapi-direct    uvicorn + FastAPI over TLS (HTTP/1.1) calling the slot server directly, no window.

The load generator is libcurl (bench/loadgen.py, one or more processes), open loop, latency from each
request's scheduled send time, connection set-up and teardown outside the measured window.  Every run
reports errors and timeouts, whether it was sustained (answered rate vs offered), each server
process's CPU per answered request (utime + stime from /proc over the window), and whether the
*client* was the limit (sends behind schedule, its handle pool full, or its CPU near a core): such a
run says "client-bound at N req/s" and is never taken as a server's capacity.

Plan: a geometric rate sweep finds each system's capacity; then each system runs at one offered load
common to all (half the smallest capacity) and at half its own capacity.  Output: ingress.json, a
PNG of percentile curves, a Markdown table (``--doc docs/PERFORMANCE.md`` rewrites that page's block).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

from hdrh.histogram import HdrHistogram

from edgepath.bench.loadgen import new_histogram
from edgepath.bench.proc import cpu_seconds, descendants
from edgepath.bench.readme import place_plot, rewrite_block
from edgepath.bench.schedule import parse
from edgepath.children import free_port
from edgepath.peer_secret import PEER_SECRET_ENV

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 10)
MAX_TOKENS = 128
SYSTEMS = (
    "edgepath-aioquic",
    "edgepath-qh3",
    "edgepath-aioquic-w2",
    "floor-aioquic",
    "floor-qh3",
    "fastapi-batch",
    "fastapi-direct",
)
PROTOCOL_NAMES = {"h3": "HTTP/3", "h1": "HTTP/1.1 over TLS"}

# A run is client-bound when the generator could not apply the schedule: sends issued late (p90 of the
# lag above LAG_P90_US: behind schedule on more than a tenth of the sends, not a stray stall; asyncio's
# timers wake up to 1 ms late by themselves, epoll's timeout being in milliseconds), its
# handle pool full on more than CAPPED_SHARE of the sends, or one of its processes busy CLIENT_CPU of a core.
LAG_P90_US = 2_000
CAPPED_SHARE = 0.01
CLIENT_CPU = 0.85
# Sustained: nothing lost or failed, the answered rate within 5% of the offered rate, the last answer
# no later than 20% (+0.3 s) after the last scheduled send, at most 1% refused (429), p99 under 100 ms.
ANSWERED_SHARE = 0.95
REFUSED_SHARE = 0.01
P99_LIMIT_US = 100_000


@dataclass(frozen=True)
class System:
    name: str
    protocol: str  # loadgen protocol: h3 | h1
    engine: str | None  # QUIC engine for h3 systems
    workers: int = 1  # edgepath: `serve --workers N` (edgepath-ENGINE-wN)


def system(name: str) -> System:
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}: choose from {', '.join(SYSTEMS)}")
    if name.startswith("edgepath-"):
        engine, _, workers = name.removeprefix("edgepath-").partition("-w")
        return System(name, "h3", engine, int(workers or 1))
    if name.startswith("floor-"):
        return System(name, "h3", name.removeprefix("floor-"))
    return System(name, "h1", None)


@dataclass
class RunStats:
    system: str
    protocol: str
    load: str
    offered_rps: float
    sent: int
    ok: int
    rejected_429: int
    other_status: int
    errors: dict[str, int]  # timeouts and transport errors, by kind
    answered_rps: float  # (200 + 429) per second of the measured window
    seconds: float  # measured window: first scheduled send to last answer
    schedule_seconds: float  # first to last scheduled send
    p50_us: float
    p90_us: float
    p99_us: float
    p999_us: float
    spread_us: float  # p99 - p50 of accepted (200) requests
    server_cpu_us: dict[str, float]  # per answered request, by server process role
    client_cpu_cores: list[float]  # each generator process's CPU over the window, in cores
    send_lag_p90_us: float
    send_lag_p99_us: float
    capped: int
    generators: int
    sustained: bool
    client_bound: str  # "" or why the client, not the server, was the limit
    cores_busy: float  # servers + generators over the window, in cores (the machine has os.cpu_count())
    response_bytes_mean: float  # body bytes per answered request (the floors answer edgepath's)
    edge_internal: dict[str, float] = field(default_factory=dict)  # edgepath: its /health?latency window
    curve: list[tuple[float, float]] = field(default_factory=list)  # (percentile, latency us), accepted


# --- server processes and their CPU -------------------------------------------------------------


def _role(pid: int, default: str) -> str:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"slot-server" in cmdline:
        return "slot-server"
    if b"agent" in cmdline:
        return "agent"
    if b"--reuse-port" in cmdline:
        return "edge-worker"  # one of `serve --workers N`'s edges (numbered by Servers.pids)
    return default


class Servers:
    """The processes of one system under test, each with a role (edge, slot-server, agent, floor, fastapi)."""

    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []

    def start(self, role: str, args: list[str], ready: str | None, timeout: float = 60.0) -> None:
        """Start ``args``; wait for a stdout line starting with ``ready`` (None: do not read stdout)."""
        proc = subprocess.Popen(
            args, stdout=subprocess.PIPE if ready else subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
        )
        self.procs.append((role, proc))
        if ready is None:
            return
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.startswith(ready):
                return
            if not line and proc.poll() is not None:
                break
        raise RuntimeError(f"{' '.join(args)} did not print {ready!r} within {timeout:.0f} s")

    def pids(self) -> dict[int, str]:
        """Every live process of the system (started ones and their children) and its role."""
        out: dict[int, str] = {}
        for role, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{role} process {proc.args!r} exited with {proc.returncode} during the benchmark")
            out[proc.pid] = role
            workers = 0
            for child in sorted(descendants(proc.pid)):
                out[child] = _role(child, role)
                if out[child] == "edge-worker":  # each worker's CPU on its own: shows how the kernel spread them
                    workers += 1
                    out[child] = f"edge-worker-{workers}"
        return out

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def _wait_tcp(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout:.0f} s")


@contextmanager
def running(sut: System, workdir: Path, slots: int, certificate: str, key: str, floor_body: int) -> Iterator[tuple]:
    """Start ``sut``; yields (URL, Servers). The floors answer ``floor_body`` bytes (edgepath's mean response)."""
    py = sys.executable
    tls = ["--certificate", certificate, "--private-key", key]
    servers = Servers()
    try:
        if sut.name.startswith("floor-"):
            port = free_port(socket.SOCK_DGRAM)
            args = ["--engine", str(sut.engine), "--port", str(port), "--body-bytes", str(floor_body), *tls]
            servers.start("floor", [py, "-m", "edgepath.bench.h3_floor", *args], "ready")
        elif sut.name.startswith("edgepath-"):
            port = free_port(socket.SOCK_DGRAM)
            args = ["--transport", "quic", "--quic-engine", str(sut.engine), "--port", str(port), "--slots", str(slots)]
            args += ["--handler", "echo", "--workers", str(sut.workers)]  # the ingress benchmark excludes model time
            servers.start("edge", [py, "-m", "edgepath", "serve", *args, *tls], "ready")
        else:
            # the slot server and the FastAPI baseline's agent prove they hold one peer secret: made for this run,
            # inherited by both (a serve under test makes its own)
            os.environ.setdefault(PEER_SECRET_ENV, secrets.token_hex(32))
            address = str(workdir / f"slots-{time.monotonic_ns()}.sock")
            slot_server = [py, "-m", "edgepath", "slot-server", "--listen", address, "--slots", str(slots)]
            servers.start("slot-server", slot_server, "ready")
            port = free_port(socket.SOCK_STREAM)
            mode = sut.name.removeprefix("fastapi-")
            args = ["--port", str(port), "--slot-server", address, "--mode", mode, *tls]
            servers.start("fastapi", [py, "-m", "edgepath.bench.baseline", *args], None)
            _wait_tcp(port)
        yield f"https://127.0.0.1:{port}/v1/generate", servers
    finally:
        servers.stop()


# --- one measured run ---------------------------------------------------------------------------


def _cpu(pids: dict[int, str]) -> dict[int, float]:
    return {pid: cpu_seconds(pid) for pid in pids}


def _readline(proc: subprocess.Popen[str], stderr: IO[str], what: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        stderr.seek(0)
        raise RuntimeError(f"load generator exited ({proc.returncode}) before {what}: {stderr.read()[-2000:]}")
    return line


def drive(
    url: str,
    protocol: str,
    servers: Servers,
    schedule: str,
    count: int,
    seed: int,
    generators: int,
    timeout: float,
    max_clients: int,
    connections: int = 1,
) -> tuple[list[dict], dict[str, float]]:
    """Run one schedule with ``generators`` loadgen processes; returns their results and the servers' CPU
    seconds by role over the measured window."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS})
    common = [url, "--protocol", protocol, "--schedule", schedule, "--count", str(count), "--seed", str(seed)]
    common += ["--body", body, "--timeout", str(timeout), "--max-clients", str(max_clients), "--handshake"]
    common += ["--connections", str(connections)]
    with ExitStack() as stack:
        # stderr to files, so a chatty generator can never block on a full pipe
        errs = [stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(generators)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "edgepath.bench.loadgen", *common, "--part", f"{i}/{generators}"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            for i, err in enumerate(errs)
        ]
        try:
            for proc, err in zip(procs, errs, strict=True):
                line = _readline(proc, err, "warm-up")
                if line.strip() != "warm":
                    raise RuntimeError(f"load generator: expected 'warm', got {line!r}")
            pids = servers.pids()
            before = _cpu(pids)
            start = time.monotonic() + 0.2
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(f"{start}\n")
                proc.stdin.flush()
            results = [json.loads(_readline(proc, err, "its result")) for proc, err in zip(procs, errs, strict=True)]
            after = _cpu(pids)
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write("close\n")
                proc.stdin.flush()
            for proc in procs:
                proc.wait(timeout=30)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    by_role: dict[str, float] = {}
    for pid, role in pids.items():
        by_role[role] = by_role.get(role, 0.0) + after[pid] - before[pid]
    return results, by_role


def summarize(
    sut: System, load: str, offered: float, schedule_seconds: float, raw: list[dict], cpu: dict[str, float]
) -> RunStats:
    hists: dict[int, HdrHistogram] = {}
    lag = new_histogram()
    errors: dict[str, int] = {}
    for part in raw:
        for status, encoded in part["histograms"].items():
            hists.setdefault(int(status), new_histogram()).add(HdrHistogram.decode(encoded))
        lag.add(HdrHistogram.decode(part["lag"]))
        for kind, n in part["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    start = min(p["start"] for p in raw)
    seconds = max(max(p["finished"] for p in raw) - start, 1e-9)
    sent = sum(p["sent"] for p in raw)
    capped = sum(p["capped"] for p in raw)
    ok_hist = hists.get(200, new_histogram())
    ok = ok_hist.get_total_count()
    refused = hists[429].get_total_count() if 429 in hists else 0
    other = sum(h.get_total_count() for s, h in hists.items() if s not in (200, 429))
    answered = ok + refused
    pct = {q: float(ok_hist.get_value_at_percentile(q)) if ok else 0.0 for q in (50, 90, 99, 99.9)}
    curve = [(p, float(ok_hist.get_value_at_percentile(p))) for p in (0, 50, 75, 90, 95, 99, 99.5, 99.9, 99.99, 100)]
    client_cores = [p["cpu_seconds"] / max(p["finished"] - p["start"], 1e-9) for p in raw]
    lag90, lag99 = float(lag.get_value_at_percentile(90)), float(lag.get_value_at_percentile(99))
    reasons = []
    if lag90 > LAG_P90_US:
        busiest = max(client_cores, default=0.0)
        reasons.append(f"sends behind schedule (p90 lag {lag90 / 1e3:.1f} ms, generator at {busiest:.2f} of a core)")
    if capped > CAPPED_SHARE * sent:
        reasons.append(f"handle pool full on {capped} sends")
    if max(client_cores, default=0.0) >= CLIENT_CPU:
        reasons.append(f"generator at {max(client_cores):.2f} of a core")
    cores_busy = sum(cpu.values()) / seconds + sum(client_cores)
    cores = os.cpu_count() or 1
    if reasons and cores_busy >= 0.9 * cores:
        reasons.append(f"the machine's {cores} cores were full ({cores_busy:.1f} busy)")
    answered_rps = answered / seconds
    sustained = (
        not errors
        and other == 0
        and answered == sent
        and refused <= REFUSED_SHARE * sent
        and answered_rps >= ANSWERED_SHARE * offered
        and seconds <= 1.2 * schedule_seconds + 0.3
        and pct[99] < P99_LIMIT_US
    )
    return RunStats(
        system=sut.name,
        protocol=sut.protocol,
        load=load,
        offered_rps=offered,
        sent=sent,
        ok=ok,
        rejected_429=refused,
        other_status=other,
        errors=errors,
        answered_rps=answered_rps,
        seconds=seconds,
        schedule_seconds=schedule_seconds,
        p50_us=pct[50],
        p90_us=pct[90],
        p99_us=pct[99],
        p999_us=pct[99.9],
        spread_us=pct[99] - pct[50],
        server_cpu_us={role: 1e6 * s / max(answered, 1) for role, s in sorted(cpu.items())},
        client_cpu_cores=client_cores,
        send_lag_p90_us=lag90,
        send_lag_p99_us=lag99,
        capped=capped,
        generators=len(raw),
        sustained=sustained,
        client_bound="; ".join(reasons),
        cores_busy=cores_busy,
        response_bytes_mean=sum(p["response_bytes"] for p in raw) / max(answered, 1),
        curve=curve,
    )


@dataclass
class Bench:
    """One ``edgepath bench ingress`` invocation's settings."""

    slots: int = 64
    timeout: float = 10.0
    generators: int = 1
    max_generators: int = 2
    max_clients: int = 256
    connections: int = 4  # HTTP/3 connections per generator process (h1 opens one per request in flight)

    def run(self, sut: System, url: str, servers: Servers, load: str, schedule: str, count: int, seed: int) -> RunStats:
        """One run; a client-bound one is repeated with one more generator process while allowed."""
        offsets = parse(schedule, count, seed)
        schedule_seconds = float(offsets[-1])
        offered = count / max(schedule_seconds, 1e-9)
        generators = self.generators
        while True:
            raw, cpu = drive(
                url,
                sut.protocol,
                servers,
                schedule,
                count,
                seed,
                generators,
                self.timeout,
                self.max_clients,
                self.connections if sut.protocol == "h3" else 1,
            )
            stats = summarize(sut, load, offered, schedule_seconds, raw, cpu)
            if not stats.client_bound or generators >= self.max_generators:
                if sut.name.startswith("edgepath-"):
                    stats.edge_internal = edge_internal_latency(url)
                return stats
            generators += 1


def edge_internal_latency(url: str) -> dict[str, float]:
    """The edge's own view (HTTP/3 request complete -> poller sees the doorbell) from ``/health?latency=P``:
    a live window of the last 10-20 s, so it covers the run just finished (and what ran right before it)."""
    from curl_cffi import CurlHttpVersion, requests

    base = url.rsplit("/v1/", 1)[0]
    out: dict[str, float] = {}
    for pct in (50, 99):
        got = requests.get(
            f"{base}/health?latency={pct}", http_version=CurlHttpVersion.V3ONLY, verify=False, timeout=10
        )
        doc = got.json()["latency"]
        out[f"p{pct}_us"] = float(doc["edge_us"])
        out["samples"], out["window_s"] = float(doc["samples"]), float(doc["window_s"])
    return out


def find_capacity(
    bench: Bench, sut: System, url: str, servers: Servers, start: float, seconds: float, max_rate: float, log: list
) -> dict:
    """Geometric sweep (x1.5): the highest offered rate sustained by the server with the client keeping up."""
    rate, best = start, 0.0
    runs: list[dict] = []
    verdict: dict = {"rps": 0.0, "bound": "none", "note": f"sustained up to the sweep's ceiling {max_rate:,.0f}/s"}
    while rate <= max_rate:
        count = max(100, int(rate * seconds))
        stats = bench.run(sut, url, servers, f"sweep {rate:,.0f}/s", f"poisson:{rate}", count, seed=len(runs))
        runs.append(asdict(stats))
        _progress(
            log,
            f"{sut.name} sweep {rate:,.0f}/s -> {stats.answered_rps:,.0f}/s p99 {stats.p99_us / 1e3:.1f} ms"
            f"{' CLIENT-BOUND ' + stats.client_bound if stats.client_bound else ''}"
            f"{'' if stats.sustained else ' (not sustained)'}",
        )
        if stats.client_bound:
            verdict = {
                "rps": best,
                "bound": "client",
                "note": f"client-bound at {rate:,.0f} req/s ({stats.client_bound})",
            }
            break
        if not stats.sustained:
            verdict = {"rps": best, "bound": "server", "note": f"not sustained at {rate:,.0f} req/s"}
            break
        best = rate
        rate *= 1.5
    verdict["rps"] = best
    verdict["sweep"] = runs
    return verdict


def _progress(log: list, line: str) -> None:
    log.append(line)
    print(line, file=sys.stderr, flush=True)


# --- the whole benchmark ------------------------------------------------------------------------


def _tls() -> tuple[str, str]:
    from edgepath.edge.adapters.tls import resolve

    tls = resolve(None, None)
    return str(tls.certificate), str(tls.private_key)


def _report_head() -> dict:
    import curl_cffi

    return {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
        "client": f"libcurl via curl_cffi {curl_cffi.__version__}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "capacity": {},
        "runs": [],
        "log": [],
    }


def run_ingress(
    out_dir: Path,
    systems: tuple[str, ...] = SYSTEMS,
    bench: Bench | None = None,
    seconds: float = 4.0,
    sweep_seconds: float = 2.0,
    start_rate: float = 200.0,
    max_rate: float = 20_000.0,
) -> dict:
    """Sweep every system's capacity, then measure each at a common load and at half its own capacity."""
    bench = bench or Bench()
    # edgepath first: the floors answer its mean response size
    suts = sorted((system(s) for s in systems), key=lambda s: not s.name.startswith("edgepath-"))
    cert, key = _tls()
    report = _report_head()
    floor_body = 1024
    with tempfile.TemporaryDirectory(prefix="edgepath-bench-") as tmp:
        for sut in suts:
            with running(sut, Path(tmp), bench.slots, cert, key, floor_body) as (url, servers):
                verdict = find_capacity(bench, sut, url, servers, start_rate, sweep_seconds, max_rate, report["log"])
                report["capacity"][sut.name] = verdict
                if sut.name.startswith("edgepath-") and verdict["sweep"]:
                    floor_body = int(verdict["sweep"][0]["response_bytes_mean"]) or floor_body
        # The common load compares one-process edges with the baselines; `--workers` systems run at it but do not
        # set it (on a machine whose cores the load generator shares, more workers can lower what is measurable).
        capacities = [v["rps"] for name, v in report["capacity"].items() if v["rps"] and system(name).workers == 1]
        common = 0.5 * min(capacities) if capacities else start_rate  # none found: the sweep's first rate
        report["common_rps"] = common
        for sut in suts:
            own = report["capacity"][sut.name]["rps"]
            plan = [("same offered load", common)] + ([("50% of own capacity", 0.5 * own)] if own else [])
            with running(sut, Path(tmp), bench.slots, cert, key, floor_body) as (url, servers):
                for i, (load, rate) in enumerate(plan):
                    count = max(100, int(rate * seconds))
                    stats = bench.run(sut, url, servers, load, f"poisson:{rate}", count, seed=7 + i)
                    report["runs"].append(asdict(stats))
                    _progress(report["log"], f"{sut.name} {load}: {_row_summary(stats)}")
    report["floor_body_bytes"] = floor_body
    return _finish(report, out_dir)


def run_fixed(
    out_dir: Path, schedule: str, count: int, systems: tuple[str, ...] = SYSTEMS, bench: Bench | None = None
) -> dict:
    """One run per system on a given schedule (``poisson:RATE`` or ``uniform:LOW_MS-HIGH_MS``), no sweep.
    ``--quick`` is this at a low rate: a smoke test of every system and of the report."""
    bench = bench or Bench()
    cert, key = _tls()
    report = _report_head()
    floor_body = 1024
    with tempfile.TemporaryDirectory(prefix="edgepath-bench-") as tmp:
        for sut in sorted((system(s) for s in systems), key=lambda s: not s.name.startswith("edgepath-")):
            with running(sut, Path(tmp), bench.slots, cert, key, floor_body) as (url, servers):
                stats = bench.run(sut, url, servers, schedule, schedule, count, seed=7)
                report["runs"].append(asdict(stats))
                if sut.name.startswith("edgepath-"):
                    floor_body = int(stats.response_bytes_mean) or floor_body
                _progress(report["log"], f"{sut.name} {schedule}: {_row_summary(stats)}")
    report["floor_body_bytes"] = floor_body
    return _finish(report, out_dir)


def _row_summary(s: RunStats) -> str:
    cpu = " + ".join(f"{r} {v:.0f}" for r, v in s.server_cpu_us.items())
    return (
        f"{s.answered_rps:,.0f}/s of {s.offered_rps:,.0f}/s, p50 {s.p50_us / 1e3:.2f} ms p99 {s.p99_us / 1e3:.2f} ms, "
        f"CPU µs/req {cpu}, errors {sum(s.errors.values())}{', client-bound' if s.client_bound else ''}"
    )


def _finish(report: dict, out_dir: Path) -> dict:
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["ratios"] = ratios(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ingress.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "ingress.png")
    return report


def ratios(report: dict) -> list[dict]:
    """Per-CPU-second and latency comparisons at the same offered load (the load every system shares)."""
    loads = list(dict.fromkeys(r["load"] for r in report["runs"]))
    load = "same offered load" if "same offered load" in loads else (loads[0] if loads else "")
    by = {r["system"]: r for r in report["runs"] if r["load"] == load}
    rows: list[dict] = []

    def cpu(name: str, roles: tuple[str, ...] | None = None) -> float:
        r = by[name]["server_cpu_us"]
        return sum(v for k, v in r.items() if roles is None or k in roles)

    for engine in ("aioquic", "qh3"):
        edge, floor = f"edgepath-{engine}", f"floor-{engine}"
        if edge in by and floor in by and cpu(edge, ("edge",)) and cpu(floor):
            rows.append(
                {
                    "what": f"requests per CPU-second, edge process on {engine} ÷ {engine} floor",
                    "value": cpu(floor) / cpu(edge, ("edge",)),
                    "target": "≥ 0.85" if engine == "aioquic" else "",
                    "load": load,
                }
            )
    if "edgepath-qh3" in by and "floor-aioquic" in by and cpu("floor-aioquic"):
        rows.append(
            {
                "what": "CPU per request, whole edgepath on qh3 (all processes) ÷ aioquic floor",
                "value": cpu("edgepath-qh3") / cpu("floor-aioquic"),
                "target": "< 1",
                "load": load,
            }
        )
    for name in ("edgepath-aioquic", "edgepath-qh3"):
        if name not in by:
            continue
        for other in ("floor-aioquic", "floor-qh3", "fastapi-batch", "fastapi-direct"):
            o = by.get(other)
            if o is None or not o["p50_us"] or not o["p99_us"]:
                continue
            rows.append(
                {
                    "what": f"{name} ÷ {other}: p50 / p99 / p99-p50",
                    "value": by[name]["p50_us"] / o["p50_us"],
                    "p99": by[name]["p99_us"] / o["p99_us"],
                    "spread": by[name]["spread_us"] / o["spread_us"] if o["spread_us"] else float("inf"),
                    "load": load,
                }
            )
    caps = report.get("capacity", {})
    one, two = caps.get("edgepath-aioquic"), caps.get("edgepath-aioquic-w2")
    if one and two:
        # A ratio means something only when both sweeps ended at the server; a client-bound one is a lower bound
        # of a capacity, and a ratio of lower bounds is not a ratio of capacities.
        measured = one["bound"] == two["bound"] == "server" and one["rps"] > 0
        rows.append(
            {
                "what": "capacity, `serve --workers 2` ÷ one worker, aioquic"
                + ("" if measured else f": not measurable here (one worker: {one['note']}; two: {two['note']})"),
                "value": two["rps"] / one["rps"] if measured else None,
                "target": "> 1 where cores are free",
                "load": "capacity sweep",
            }
        )
    for r in report["runs"]:
        if r["load"] == "50% of own capacity" and r["system"].startswith("edgepath-"):
            rows.append(
                {
                    "what": f"{r['system']} P99-P50 at half capacity (ms)",
                    "value": r["spread_us"] / 1e3,
                    "target": "≤ 1.5",
                    "load": r["load"],
                }
            )
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(dict.fromkeys(r["load"] for r in report["runs"]))
    fig, axes = plt.subplots(1, max(1, len(loads)), figsize=(6.5 * max(1, len(loads)), 4.8), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=False):
        for r in (r for r in report["runs"] if r["load"] == load and r["ok"]):
            xs = [100.0 / (100.0 - p) if p < 100 else 1e5 for p, _ in r["curve"]]
            label = f"{r['system']} ({r['offered_rps']:,.0f}/s){' client-bound' if r['client_bound'] else ''}"
            ax.plot(xs, [max(v, 1.0) / 1000.0 for _, v in r["curve"]], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks([1, 2, 10, 100, 1000, 10000], ["p0", "p50", "p90", "p99", "p99.9", "p99.99"])
        ax.set_xlabel("percentile")
        ax.set_ylabel("latency from scheduled send (ms)")
        ax.set_title(load)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu_cell(r: dict) -> str:
    parts = [f"{role} {v:,.0f}" for role, v in r["server_cpu_us"].items()]
    total = sum(r["server_cpu_us"].values())
    return " + ".join(parts) + (f" = {total:,.0f}" if len(parts) > 1 else "")


def table(report: dict) -> str:
    m = report["machine"]
    caps = []
    for name, v in report["capacity"].items():
        if v["bound"] == "server":
            caps.append(f"{name} {v['rps']:,.0f}/s")
        elif v["rps"]:
            caps.append(f"{name} ≥ {v['rps']:,.0f}/s ({v['note']})")
        else:
            caps.append(f"{name} not found ({v['note']})")
    lines = [
        f"Measured {report['started']} on {m['cpu']}, {m['cores']} cores, Python {m['python']}, load average "
        f"{m['loadavg_start'][0]:.2f} at the start (`edgepath bench ingress`; client: {report['client']}).",
    ]
    if caps:
        lines += ["", "Capacity (highest offered rate sustained with the client keeping up): " + "; ".join(caps) + "."]
    lines += [
        "",
        "Latency from each request's scheduled send (open loop), accepted requests. Server CPU: utime + stime "
        "of each server process over the measured window ÷ answered requests (the edge process holds the agent).",
        "",
        "| load | system | protocol | offered/s | answered/s | 429 % | errors / timeouts | sustained | p50 ms "
        "| p99 ms | p99.9 ms | p99-p50 ms | server CPU µs/req | client |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for r in report["runs"]:
        rej = 100.0 * r["rejected_429"] / max(1, r["sent"])
        timeouts = r["errors"].get("timeout", 0)
        errors = sum(r["errors"].values()) - timeouts + r["other_status"]
        lines.append(
            f"| {r['load']} | {r['system']} | {PROTOCOL_NAMES[r['protocol']]} | {r['offered_rps']:,.0f} | "
            f"{r['answered_rps']:,.0f} | {rej:.1f} | {errors} / {timeouts} | {'yes' if r['sustained'] else 'no'} | "
            f"{r['p50_us'] / 1e3:.2f} | {r['p99_us'] / 1e3:.2f} | {r['p999_us'] / 1e3:.2f} | "
            f"{r['spread_us'] / 1e3:.2f} | {_cpu_cell(r)} | {r['client_bound'] or 'kept up'} |"
        )
    inside = [r for r in report["runs"] if r.get("edge_internal")]
    if inside:
        lines += [
            "",
            "Edge-internal latency (request complete at the edge -> slot server's poller sees the doorbell; "
            "the edge's `/health?latency=P` window read after each run):",
            "",
        ]
        for r in inside:
            e = r["edge_internal"]
            lines.append(
                f"- {r['system']}, {r['load']}: p50 {e['p50_us']:,.0f} µs, p99 {e['p99_us']:,.0f} µs "
                f"({e['samples']:,.0f} samples over {e['window_s']:.1f} s)"
            )
    if report["ratios"]:
        lines += ["", "| comparison (at the load named) | value | target |", "|---|---:|---|"]
        for row in report["ratios"]:
            value = "—" if row["value"] is None else f"{row['value']:.2f}"
            if "p99" in row:
                value += f" / {row['p99']:.2f} / {row['spread']:.2f}"
            lines.append(f"| {row['what']} ({row['load']}) | {value} | {row.get('target', '')} |")
    return "\n".join(lines)


INGRESS_BEGIN, INGRESS_END = "<!-- bench:ingress:begin -->", "<!-- bench:ingress:end -->"


def rewrite_doc(doc: Path, text: str, png: Path) -> None:
    """Replace the page's ingress block with ``text`` and the plot (copied next to the page)."""
    if INGRESS_BEGIN not in doc.read_text():  # before the plot is copied
        raise SystemExit(f"{doc}: no {INGRESS_BEGIN} ... {INGRESS_END} block to rewrite")
    link = place_plot(doc, png, "ingress.png")
    rewrite_block(doc, "ingress", f"{text}\n\n![latency percentiles]({link})")


QUICK_SCHEDULE, QUICK_COUNT = "poisson:100", 100


def main(args: argparse.Namespace) -> int:
    """``edgepath bench ingress`` (arguments defined in bench/cli.py)."""
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip()) if args.systems else SYSTEMS
    for name in systems:
        system(name)  # a clear error for an unknown name, before anything starts
    for flag in ("seconds", "sweep_seconds", "start_rate", "max_rate"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number, got {getattr(args, flag)}")
    if args.generators < 1 or args.max_generators < args.generators:
        raise ValueError(f"need 1 <= --generators <= --max-generators, got {args.generators}, {args.max_generators}")
    bench = Bench(slots=args.slots, generators=args.generators, max_generators=args.max_generators)
    out = Path(args.out)
    if args.quick:
        bench.max_generators = bench.generators  # a smoke test: no retries with more generators
        report = run_fixed(out, QUICK_SCHEDULE, QUICK_COUNT, systems, bench)
    elif args.schedule:
        report = run_fixed(out, args.schedule, args.count, systems, bench)
    else:
        report = run_ingress(
            out,
            systems,
            bench,
            seconds=args.seconds,
            sweep_seconds=args.sweep_seconds,
            start_rate=args.start_rate,
            max_rate=args.max_rate,
        )
    text = table(report)
    print(text)
    print(f"report: {out / 'ingress.json'}, plot: {out / 'ingress.png'}")
    if args.doc:
        rewrite_doc(Path(args.doc), text, out / "ingress.png")
    return 0
