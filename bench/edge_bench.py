"""Edge benchmark: requests/s per edge core against the QUIC floor, and edge-internal latency at half load.

One run, one machine, three phases (each a fresh server process, bounded in time):

1. floor   -- ``bench/h3_floor.py`` (bare aioquic, fixed response), closed-loop load;
2. edge    -- ``edgepath serve`` (echo slot server child), same load, a 128-token text prompt;
3. latency -- the same edge, open loop at half the capacity measured in phase 2: the edge-internal
   latency (HTTP/3 request complete -> doorbell seen by the slot poller) of every request, taken from
   the ``edge`` entry of its ``Server-Timing`` header, and the edge's own ``/health?latency=P``.

"Per core" divides requests by the CPU seconds the server process used (``/proc/PID/stat``), so a
load generator sharing the two cores does not decide the ratio.  The slot server child's CPU is
reported separately: it stands for the model side, not the edge.

Run: ``.venv/bin/python -m edgepath.bench.edge_bench --duration 8``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edgepath.edge.client import H3Client, H3Response, h3_client

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("ready"):
        proc.kill()
        raise RuntimeError(f"{cmd} did not start: {line!r}")
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@dataclass
class Throughput:
    requests: int
    seconds: float
    statuses: dict[int, int]
    server_cpu_s: float
    server_sys_s: float  # the kernel's share of server_cpu_s
    slot_server_cpu_s: float

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds

    @property
    def per_core_second(self) -> float:
        return self.requests / self.server_cpu_s if self.server_cpu_s else 0.0


async def closed_loop(
    port: int, cafile: str, body: bytes, duration: float, connections: int, inflight: int
) -> tuple[int, float, Counter[int]]:
    """``connections`` connections x ``inflight`` workers, each sending back to back for ``duration``."""
    statuses: Counter[int] = Counter()
    done = 0

    async def worker(client: H3Client, until: float) -> None:
        nonlocal done
        while time.perf_counter() < until:
            r = await client.request("POST", "/v1/generate", body=body)
            statuses[r.status] += 1
            done += 1

    async def connection(until: float) -> None:
        async with h3_client("127.0.0.1", port, cafile, server_name="localhost") as client:
            await client.request("POST", "/v1/generate", body=body)  # warm the connection
            await asyncio.gather(*(worker(client, until) for _ in range(inflight)))

    begin = time.perf_counter()
    await asyncio.gather(*(connection(begin + duration) for _ in range(connections)))
    return done, time.perf_counter() - begin, statuses


def throughput(
    proc: subprocess.Popen[str], port: int, cafile: str, body: bytes, args: argparse.Namespace
) -> Throughput:
    pids = children(proc.pid)
    (user0, sys0), slot0 = cpu_times(proc.pid), sum(cpu_seconds(p) for p in pids)
    done, seconds, statuses = asyncio.run(
        closed_loop(port, cafile, body, args.duration, args.connections, args.inflight)
    )
    (user1, sys1), slot1 = cpu_times(proc.pid), sum(cpu_seconds(p) for p in pids)
    return Throughput(done, seconds, dict(statuses), user1 + sys1 - user0 - sys0, sys1 - sys0, slot1 - slot0)


async def open_loop(
    port: int, cafile: str, body: bytes, rate: float, duration: float, connections: int
) -> dict[str, object]:
    """Requests at fixed spacing 1/``rate`` (not waiting for answers); edge-internal latency of each."""
    edge_us: list[float] = []
    rtt_us: list[float] = []
    statuses: Counter[int] = Counter()
    stages: dict[str, list[float]] = {}
    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(h3_client("127.0.0.1", port, cafile, server_name="localhost"))
            for _ in range(connections)
        ]
        for c in clients:
            await c.request("POST", "/v1/generate", body=body)
        tasks = []

        async def one(client: H3Client) -> None:
            t0 = time.perf_counter()
            r = await client.request("POST", "/v1/generate", body=body)
            rtt_us.append((time.perf_counter() - t0) * 1e6)
            statuses[r.status] += 1
            if r.status == 200:
                timings = r.timings()
                edge_us.append(timings["edge"] * 1000)
                for stage, ms in timings.items():
                    stages.setdefault(stage, []).append(ms * 1000)

        n = int(rate * duration)
        begin = time.perf_counter()
        for i in range(n):
            delay = begin + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(clients[i % len(clients)])))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - begin
        health = {p: (await clients[0].request("GET", f"/health?latency={p}")).json()["latency"] for p in (50, 99)}
    e, r = np.array(edge_us), np.array(rtt_us)
    return {
        "requests": n,
        "offered_rate": rate,
        "achieved_rate": n / elapsed,
        "statuses": dict(statuses),
        "edge_us": {"p50": float(np.percentile(e, 50)), "p99": float(np.percentile(e, 99)), "max": float(e.max())},
        "client_rtt_us": {"p50": float(np.percentile(r, 50)), "p99": float(np.percentile(r, 99))},
        "server_timing_p50_us": {k: float(np.percentile(v, 50)) for k, v in stages.items()},
        "health_window": {str(k): v for k, v in health.items()},
    }


def prompt_of(tokens: int) -> str:
    """A text prompt that the default tokenizer turns into exactly ``tokens`` ids (BOS included)."""
    from edgepath.edge.tokenizer import load_tokenizer

    tok = load_tokenizer()
    words = [f"w{i}" for i in range(tokens * 2)]
    text = ""
    for w in words:
        candidate = f"{text} {w}" if text else w
        if len(tok.encode(candidate)) > tokens:
            break
        text = candidate
    while len(tok.encode(text)) < tokens:
        text += "."
    assert len(tok.encode(text)) == tokens, len(tok.encode(text))
    return text


def summary(tp: Throughput) -> dict[str, object]:
    return {**asdict(tp), "per_second": tp.per_second, "per_core_second": tp.per_core_second}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of load per phase")
    parser.add_argument("--rounds", type=int, default=2, help="edge/floor throughput pairs (alternating)")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--inflight", type=int, default=8, help="requests in flight per connection")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--slot-spin-us", type=float, default=0.0, help="passed to serve")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    state = tempfile.mkdtemp(prefix="edgepath-bench-")
    env = {**os.environ, "XDG_STATE_HOME": state}
    os.environ["XDG_STATE_HOME"] = state
    from edgepath.edge.tls import resolve

    tls = resolve(None, None)
    cafile = str(tls.certificate)
    body = json.dumps({"prompt": prompt_of(args.tokens), "max_tokens": args.tokens}).encode()
    py = sys.executable
    serve_cmd = [py, "-m", "edgepath", "serve", "--slots", str(args.slots), "--slot-spin-us", str(args.slot_spin_us)]
    results: dict[str, object] = {"args": vars(args), "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}

    def edge_round() -> tuple[Throughput, int]:
        port = free_udp_port()
        edge = start([*serve_cmd, "--port", str(port)], env)
        try:
            size = len(asyncio.run(one_request(port, cafile, body)).body)
            return throughput(edge, port, cafile, body, args), size
        finally:
            stop(edge)

    def floor_round(size: int) -> Throughput:
        port = free_udp_port()
        cert = ["--certificate", cafile, "--private-key", str(tls.private_key), "--body-bytes", str(size)]
        floor = start([py, "-m", "edgepath.bench.h3_floor", "--port", str(port), *cert], env)
        try:
            return throughput(floor, port, cafile, body, args)
        finally:
            stop(floor)

    rounds = []
    for _ in range(args.rounds):
        edge_tp, size = edge_round()
        floor_tp = floor_round(size)
        rounds.append(
            {
                "edge": summary(edge_tp),
                "floor": summary(floor_tp),
                "response_bytes": size,
                "edge_vs_floor_per_core": edge_tp.per_core_second / floor_tp.per_core_second,
            }
        )
    results["rounds"] = rounds
    capacity = float(np.median([r["edge"]["per_second"] for r in rounds]))  # type: ignore[index]
    results["median_edge_vs_floor_per_core"] = float(np.median([r["edge_vs_floor_per_core"] for r in rounds]))

    port = free_udp_port()
    edge = start([*serve_cmd, "--port", str(port)], env)
    try:
        results["latency_at_half_capacity"] = asyncio.run(
            open_loop(port, cafile, body, capacity / 2, args.duration, args.connections)
        )
    finally:
        stop(edge)
    results["loadavg_end"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


async def one_request(port: int, cafile: str, body: bytes) -> H3Response:
    async with h3_client("127.0.0.1", port, cafile, server_name="localhost") as client:
        return await client.request("POST", "/v1/generate", body=body)


if __name__ == "__main__":
    sys.exit(main())
