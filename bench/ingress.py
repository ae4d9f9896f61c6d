"""``edgepath bench ingress``: open-loop end-to-end latency, side by side, same client, same run.

Systems (each started fresh, on loopback, with the same echo slot server where one is used):
  floor     -- bare aioquic HTTP/3 server answering a fixed response (HTTP/3);
  edgepath  -- ``edgepath serve --transport quic`` (HTTP/3; loopback data path; echo slot server);
  baseline  -- uvicorn + FastAPI + asyncio.Queue + dynamic batcher feeding the same slot server
               (HTTP/1.1 over TCP, as such stacks are usually driven).

Capacity of each is found by a rate sweep; then each is measured at fractions of the baseline's
capacity and of its own.  Latency runs from each request's scheduled send time (no coordinated
omission) and is recorded in HDR histograms.  Output: JSON, a PNG of percentile curves, a table.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from hdrh.histogram import HdrHistogram
from tqdm import tqdm

from edgepath.bench.loadgen import new_histogram

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 10)
SYSTEMS = ("edgepath", "floor", "baseline")  # edgepath first: the floor copies its response size


@dataclass
class RunStats:
    system: str
    offered_rps: float
    sent: int
    ok: int
    rejected_429: int
    other_status: int
    errors: int
    achieved_rps: float
    seconds: float  # first scheduled send to last response
    schedule_seconds: float  # first to last scheduled send
    p50_us: float
    p90_us: float
    p99_us: float
    p999_us: float
    spread_us: float  # p99 - p50 of accepted (200) requests
    curve: list[tuple[float, float]]  # (percentile, latency us) of accepted requests


def _free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], ready: str, timeout: float = 60.0) -> subprocess.Popen[str]:
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(ready):
            return proc
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{' '.join(args)} did not start")


def _wait_http(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port}")


@contextmanager
def running(
    system: str, workdir: Path, slots: int, certificate: str, key: str, floor_body: int = 1024
) -> Iterator[str]:
    """Start ``system``; yields the URL the load generator drives. The floor answers ``floor_body`` bytes
    (the caller passes the mean size of edgepath's responses, so both put the same bytes on the wire)."""
    py = sys.executable
    procs: list[subprocess.Popen[str]] = []
    try:
        if system == "floor":
            port = _free_port(socket.SOCK_DGRAM)
            procs.append(
                _start(
                    [
                        py,
                        "-m",
                        "edgepath.bench.h3_floor",
                        "--port",
                        str(port),
                        "--body-bytes",
                        str(floor_body),
                        "--certificate",
                        certificate,
                        "--private-key",
                        key,
                    ],
                    "ready",
                )
            )
            yield f"h3://127.0.0.1:{port}/v1/generate"
        elif system == "edgepath":
            port = _free_port(socket.SOCK_DGRAM)
            procs.append(
                _start(
                    [
                        py,
                        "-m",
                        "edgepath",
                        "serve",
                        "--transport",
                        "quic",
                        "--port",
                        str(port),
                        "--slots",
                        str(slots),
                        "--certificate",
                        certificate,
                        "--private-key",
                        key,
                    ],
                    "ready",
                )
            )
            yield f"h3://127.0.0.1:{port}/v1/generate"
        elif system == "baseline":
            address = str(workdir / f"baseline-slots-{time.monotonic_ns()}.sock")
            procs.append(
                _start([py, "-m", "edgepath", "slot-server", "--listen", address, "--slots", str(slots)], "ready")
            )
            port = _free_port(socket.SOCK_STREAM)
            procs.append(
                subprocess.Popen(
                    [py, "-m", "edgepath.bench.baseline", "--port", str(port), "--slot-server", address],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            _wait_http(port)
            yield f"http://127.0.0.1:{port}/v1/generate"
        else:
            raise ValueError(f"unknown system {system!r}: choose from {', '.join(SYSTEMS)}")
    finally:
        for proc in reversed(procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def drive(url: str, schedule: str, count: int, seed: int, timeout: float) -> dict:
    """One load-generator process (its own interpreter, so it never shares a GIL with a server)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 128})
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgepath.bench.loadgen",
            url,
            "--schedule",
            schedule,
            "--count",
            str(count),
            "--seed",
            str(seed),
            "--body",
            body,
            "--timeout",
            str(timeout),
        ],
        capture_output=True,
        text=True,
        timeout=timeout + count / 10 + 120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def mean_body(raw: dict, default: int) -> int:
    """Mean response body size of a run (what the floor should answer to match)."""
    answered = sum(HdrHistogram.decode(v).get_total_count() for v in raw["histograms"].values())
    return int(raw.get("response_bytes", 0) / answered) if answered else default


def summarize(system: str, offered: float, count: int, raw: dict) -> RunStats:
    hists = {int(k): HdrHistogram.decode(v) for k, v in raw["histograms"].items()}
    ok = hists.get(200, new_histogram())
    n_ok = ok.get_total_count()
    seconds = max(raw["seconds"], 1e-9)
    curve = [(p, float(ok.get_value_at_percentile(p))) for p in (0, 50, 75, 90, 95, 99, 99.5, 99.9, 99.99, 100)]
    p = {q: float(ok.get_value_at_percentile(q)) if n_ok else 0.0 for q in (50, 90, 99, 99.9)}
    return RunStats(
        system,
        offered,
        count,
        n_ok,
        hists[429].get_total_count() if 429 in hists else 0,
        sum(h.get_total_count() for s, h in hists.items() if s not in (200, 429)),
        sum(raw["errors"].values()),
        (n_ok + (hists[429].get_total_count() if 429 in hists else 0)) / seconds,
        seconds,
        raw["schedule_seconds"],
        p[50],
        p[90],
        p[99],
        p[99.9],
        p[99] - p[50],
        curve,
    )


def sustainable(stats: RunStats) -> bool:
    """Keeps up: every request answered (200 or 429) without errors, the last answer no later than
    20% (+0.3 s) after the last scheduled send, and accepted requests' p99 under 100 ms."""
    answered = stats.ok + stats.rejected_429
    drained = stats.seconds <= 1.2 * stats.schedule_seconds + 0.3
    return (
        stats.errors == 0 and stats.other_status == 0 and answered == stats.sent and drained and stats.p99_us < 100_000
    )


def find_capacity(
    system: str, url: str, start: float, seconds: float, timeout: float, bar: tqdm
) -> tuple[float, list[RunStats]]:
    """Geometric rate sweep: the highest offered rate the system sustains."""
    rate, best, runs = start, 0.0, []
    while rate < 100_000:
        count = max(200, int(rate * seconds))
        stats = summarize(system, rate, count, drive(url, f"poisson:{rate}", count, seed=len(runs), timeout=timeout))
        runs.append(stats)
        bar.set_postfix_str(f"{system} sweep {rate:.0f}/s → {stats.achieved_rps:.0f}/s p99 {stats.p99_us:.0f}us")
        if not sustainable(stats):
            break
        best = rate
        rate *= 1.5
    return best, runs


def run_ingress(
    out_dir: Path,
    systems: tuple[str, ...] = SYSTEMS,
    seconds: float = 4.0,
    sweep_seconds: float = 2.0,
    slots: int = 64,
    start_rate: float = 100.0,
    loads: tuple[float, ...] = (0.5, 0.8),
    timeout: float = 10.0,
) -> dict:
    from edgepath.edge.tls import resolve

    out_dir.mkdir(parents=True, exist_ok=True)
    tls = resolve(None, None)
    report: dict = {"machine": _machine(), "started": _now(), "capacity": {}, "runs": []}
    with (
        tempfile.TemporaryDirectory(prefix="edgepath-bench-") as tmp,
        tqdm(total=len(systems) * 2, desc="ingress") as bar,
    ):
        workdir = Path(tmp)
        floor_body = 1024
        for system in systems:
            with running(system, workdir, slots, str(tls.certificate), str(tls.private_key), floor_body) as url:
                warm = drive(url, "poisson:50", 50, seed=99, timeout=timeout)  # caches, first connections
                if system == "edgepath":
                    floor_body = mean_body(warm, floor_body)
                report["floor_body_bytes"] = floor_body
                capacity, sweep = find_capacity(system, url, start_rate, sweep_seconds, timeout, bar)
                report["capacity"][system] = capacity
                report.setdefault("sweeps", {})[system] = [asdict(s) for s in sweep]
            bar.update(1)
        base_cap = report["capacity"].get("baseline") or max(report["capacity"].values()) or start_rate
        for system in systems:
            with running(system, workdir, slots, str(tls.certificate), str(tls.private_key), floor_body) as url:
                drive(url, "poisson:50", 50, seed=98, timeout=timeout)
                for frac in loads:
                    rate = max(1.0, frac * base_cap)
                    count = max(200, int(rate * seconds))
                    stats = summarize(system, rate, count, drive(url, f"poisson:{rate}", count, 7, timeout))
                    report["runs"].append({"load": f"{frac:.0%} of baseline capacity", **asdict(stats)})
                own = report["capacity"][system]
                if own:
                    rate = 0.5 * own
                    count = max(200, int(rate * seconds))
                    stats = summarize(system, rate, count, drive(url, f"poisson:{rate}", count, 8, timeout))
                    report["runs"].append({"load": "50% of own capacity", **asdict(stats)})
            bar.update(1)
    report["ratios"] = ratios(report)
    (out_dir / "ingress.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "ingress.png")
    return report


def run_fixed(
    out_dir: Path, schedule: str, count: int, systems: tuple[str, ...] = SYSTEMS, slots: int = 64, timeout: float = 10.0
) -> dict:
    """One run per system on a given schedule (``poisson:RATE`` or ``uniform:LOW_MS-HIGH_MS``), no sweep."""
    from edgepath.bench.schedule import parse
    from edgepath.edge.tls import resolve

    offsets = parse(schedule, count)
    offered = count / max(float(offsets[-1]), 1e-9)
    tls = resolve(None, None)
    report: dict = {"machine": _machine(), "started": _now(), "capacity": {}, "runs": []}
    floor_body = 1024
    with tempfile.TemporaryDirectory(prefix="edgepath-bench-") as tmp:
        for system in tqdm(systems, desc="ingress"):
            with running(system, Path(tmp), slots, str(tls.certificate), str(tls.private_key), floor_body) as url:
                raw = drive(url, schedule, count, 7, timeout)
                if system == "edgepath":
                    floor_body = mean_body(raw, floor_body)
                report["runs"].append({"load": schedule, **asdict(summarize(system, offered, count, raw))})
    report["ratios"] = ratios(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ingress.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "ingress.png")
    return report


def _machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def ratios(report: dict) -> list[dict]:
    rows = []
    by = {(r["load"], r["system"]): r for r in report["runs"]}
    for load in dict.fromkeys(r["load"] for r in report["runs"]):
        e = by.get((load, "edgepath"))
        if e is None:
            continue
        for other in ("floor", "baseline"):
            o = by.get((load, other))
            if o is None or not o["p50_us"]:
                continue
            rows.append(
                {
                    "load": load,
                    "vs": other,
                    "p50": e["p50_us"] / o["p50_us"],
                    "p99": e["p99_us"] / o["p99_us"],
                    "p99_minus_p50": e["spread_us"] / o["spread_us"] if o["spread_us"] else float("inf"),
                }
            )
    cap = report["capacity"]
    if cap.get("floor"):
        rows.append({"load": "capacity", "vs": "floor", "throughput": cap.get("edgepath", 0) / cap["floor"]})
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(dict.fromkeys(r["load"] for r in report["runs"]))
    fig, axes = plt.subplots(1, len(loads), figsize=(6 * len(loads), 4.5), squeeze=False)
    for ax, load in zip(axes[0], loads, strict=True):
        for r in (r for r in report["runs"] if r["load"] == load):
            xs = [100.0 / (100.0 - p) if p < 100 else 1e5 for p, _ in r["curve"]]
            ax.plot(
                xs, [v / 1000.0 for _, v in r["curve"]], marker="o", label=f"{r['system']} ({r['offered_rps']:.0f}/s)"
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ticks = [1, 2, 10, 100, 1000, 10000]
        ax.set_xticks(ticks, ["p0", "p50", "p90", "p99", "p99.9", "p99.99"])
        ax.set_xlabel("percentile")
        ax.set_ylabel("latency from scheduled send (ms)")
        ax.set_title(load)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"Measured {report['started']} on {m['cpu']}, {m['cores']} cores, Python {m['python']} "
        f"(`edgepath bench ingress`). Capacity (highest sustained offered rate): "
        + ", ".join(f"{k} {v:,.0f}/s" for k, v in report["capacity"].items())
        + ".",
        "",
        "| load | system | offered/s | answered/s | 429 % | p50 ms | p90 ms | p99 ms | p99.9 ms | p99-p50 ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["runs"]:
        rej = 100.0 * r["rejected_429"] / max(1, r["sent"])
        lines.append(
            f"| {r['load']} | {r['system']} | {r['offered_rps']:,.0f} | {r['achieved_rps']:,.0f} | {rej:.1f} | "
            f"{r['p50_us'] / 1e3:.2f} | {r['p90_us'] / 1e3:.2f} | {r['p99_us'] / 1e3:.2f} | "
            f"{r['p999_us'] / 1e3:.2f} | {r['spread_us'] / 1e3:.2f} |"
        )
    lines += ["", "| load | edgepath ÷ | p50 | p99 | p99-p50 | throughput |", "|---|---|---:|---:|---:|---:|"]
    for row in report["ratios"]:
        cells = [f"{row[k]:.2f}" if k in row else "" for k in ("p50", "p99", "p99_minus_p50", "throughput")]
        lines.append(f"| {row['load']} | {row['vs']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


INGRESS_BEGIN, INGRESS_END = "<!-- bench:ingress:begin -->", "<!-- bench:ingress:end -->"


def rewrite_readme(readme: Path, text: str, png: Path) -> None:
    """Replace the README's ingress block with ``text`` and the plot (copied next to the README)."""
    import re
    import shutil

    target = readme.parent / "docs" / "ingress.png"
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(png, target)
    block = f"{INGRESS_BEGIN}\n{text}\n\n![latency percentiles](docs/ingress.png)\n{INGRESS_END}"
    pattern = re.compile(re.escape(INGRESS_BEGIN) + ".*?" + re.escape(INGRESS_END), re.S)
    content = readme.read_text()
    if not pattern.search(content):
        raise SystemExit(f"{readme}: no {INGRESS_BEGIN} ... {INGRESS_END} block to rewrite")
    readme.write_text(pattern.sub(lambda _: block, content))
