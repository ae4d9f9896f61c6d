"""``edgepath bench hostile``: what one hostile or careless request costs the front door (issue 49).

Against ``edgepath serve`` with two API keys (two tenants) and its default handler (the real model), over HTTP/1.1
and HTTP/3, this sends each case below once -- alone, from tenant A -- while ``/health/live`` is probed every 50 ms
the way a kubelet probes it (a process of its own, a fresh HTTP/1.1 connection to serve's ``--ops-listen`` each
time, 1 s timeout), and reports per case: the answer's status, how much the serve process's resident memory grew
while it was handled (its peak, ``VmHWM`` reset through ``/proc/PID/clear_refs`` before the case, less its ``VmRSS``
before), the worst ``/health/live`` latency meanwhile (targets: 64 MB and 50 ms), and the edge's own worst
event-loop lag meanwhile (``edgepath_event_loop_lag_seconds``: the bucket its worst sample fell in) -- which tells a
stalled edge loop from a probe that waited for a CPU.  (The probe used to share the load generator's event loop, so
a megabyte sent by the aioquic client, packet by packet in Python, delayed the probe's own reading: that was counted
as the edge's.)  Then ``--clients`` clients of tenant A send the case that stalled the edge's loop longest, in a loop
for ``--seconds``, while tenant B's lone chats measure their time to first token against the same chats alone
(target: within 1.2x), and B's streams that were under way when the flood began must all complete (nothing lost).

    edgepath bench hostile [--transports tcp,quic] [--seconds 30] [--clients 10] [--flood CASE]
                           [--doc docs/PERFORMANCE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11

from edgepath.bench.model_compare import machine, stream_chat
from edgepath.bench.readme import rewrite_block
from edgepath.children import free_port
from edgepath.edge.client import H3Client, h3_client

KEYS = ("keyA", "keyB")
MIB = 1 << 20
#: where tenant B's HTTP/1.1 connections (and the load generator's own /health/live poll) come from: another client
#: than tenant A's 127.0.0.1, as another tenant is -- the flood's connections are held against its address's cap
#: (--max-connections-per-address) while their dropped bodies are paced, and B must not share that cap
QUIET_ADDRESS = "127.0.0.2"
#: targets of issue 49
RSS_TARGET_MB, LIVE_TARGET_MS, TTFT_TARGET = 64, 50, 1.2


def _deep(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def cases(model: str) -> list[tuple[str, str, bytes]]:
    """(name, path, body) of each hostile or careless request, every one within the 1 MiB ``--max-body``."""
    chat = {"model": model, "max_tokens": 8}
    user = [{"role": "user", "content": "Say hi."}]

    def body(doc: dict[str, Any]) -> bytes:
        return json.dumps(doc).encode()

    def schema(max_length: int) -> dict[str, Any]:
        return {
            "type": "json_schema",
            "json_schema": {"name": "s", "schema": {"type": "string", "maxLength": max_length}},
        }

    tool = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 4} for i in range(7)}}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": tool}} for i in range(128)]
    return [
        ("stop string of 32,000 chars", "/v1/completions", body({**chat, "prompt": "Hi", "stop": "x" * 32_000})),
        (
            "4 stop strings, 1,024 chars (the limit)",
            "/v1/completions",
            body({**chat, "prompt": "Hi", "stop": ["ab" * 128] * 4}),
        ),
        (
            "json_schema maxLength 10^7",
            "/v1/chat/completions",
            body({**chat, "messages": user, "response_format": schema(10**7)}),
        ),
        (
            "json_schema maxLength 256",
            "/v1/chat/completions",
            body({**chat, "messages": user, "response_format": schema(256)}),
        ),
        (
            "128 tools, tool_choice required",
            "/v1/chat/completions",
            body({**chat, "messages": user, "tools": tools, "tool_choice": "required"}),
        ),
        (
            "chat of 30,000 empty messages",
            "/v1/chat/completions",
            body({**chat, "messages": [{"role": "user", "content": ""}] * 30_000}),
        ),
        (
            "chat of 2,048 empty messages (the limit)",
            "/v1/chat/completions",
            body({**chat, "messages": [{"role": "user", "content": ""}] * 2048}),
        ),
        (
            "chat of 2,048 messages of 400 chars",
            "/v1/chat/completions",
            body({**chat, "messages": [{"role": "user", "content": "w " * 200}] * 2048}),
        ),
        ("prompt of 1,000,000 chars", "/v1/completions", body({**chat, "prompt": "word " * 200_000})),
        ("JSON nested 1,000 deep", "/v1/generate", f'{{"prompt": "hi", "max_tokens": {_deep(1000)}}}'.encode()),
        (
            "JSON nested 100,000 deep",
            "/v1/chat/completions",
            f'{{"model": "{model}", "messages": {_deep(100_000)}}}'.encode(),
        ),
        (
            "1 MiB of flat arrays",
            "/v1/generate",
            ('{"prompt": "hi", "x": [' + ",".join(["[]"] * 340_000) + "]}").encode(),
        ),
    ]


# -- clients ----------------------------------------------------------------------------------------------


async def http11(
    port: int, method: str, path: str, body: bytes, key: str | None, local: str | None = None
) -> tuple[int, bytes]:
    """One request on a connection of its own (closed after), from loopback's address ``local`` (None: 127.0.0.1)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0) if local else None)
    try:
        conn = h11.Connection(h11.CLIENT)
        headers = [("host", "127.0.0.1"), ("content-length", str(len(body))), ("connection", "close")]
        if key:
            headers.append(("x-api-key", key))
        writer.write(conn.send(h11.Request(method=method, target=path, headers=headers)))
        writer.write(conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
        status, data = 0, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(1 << 16))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, bytes(data)
    finally:
        writer.close()


class Served:
    """``edgepath serve`` over one transport, two API keys, its default handler; and a way to call it."""

    def __init__(self, transport: str, state: Path, log: Path, extra: list[str]) -> None:
        self.transport = transport
        self.port = free_port(kind=socket.SOCK_DGRAM if transport == "quic" else socket.SOCK_STREAM)
        self.ops_port = free_port(kind=socket.SOCK_STREAM)  # the probes' listener, as in a pod (deploy/kubernetes)
        env = dict(os.environ, EDGEPATH_API_KEYS=",".join(KEYS), XDG_STATE_HOME=str(state))
        argv = [
            sys.executable,
            "-m",
            "edgepath.cli",
            "serve",
            "--transport",
            transport,
            "--port",
            str(self.port),
            "--ops-listen",
            f"127.0.0.1:{self.ops_port}",
            *extra,
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            raise RuntimeError(f"serve did not start ({line!r}); see {log}")
        self.clients: dict[str, H3Client] = {}
        self._contexts: list[Any] = []
        self.probe = Probe(self.ops_port, log.with_name(f"probes-{transport}.txt"))

    async def client(self, name: str) -> H3Client:
        """A named HTTP/3 connection (the poller's, tenant A's, tenant B's)."""
        if name not in self.clients:
            context = h3_client("127.0.0.1", self.port, insecure=True)
            self.clients[name] = await context.__aenter__()
            self._contexts.append(context)
        return self.clients[name]

    async def call(self, method: str, path: str, body: bytes, key: str | None, line: str = "a") -> tuple[int, bytes]:
        """``line``: the HTTP/3 connection to use; over HTTP/1.1 tenant A's lines come from 127.0.0.1, the others from
        :data:`QUIET_ADDRESS`."""
        if self.transport == "tcp":
            local = None if line == "a" or line.startswith("flood") else QUIET_ADDRESS
            return await http11(self.port, method, path, body, key, local)
        client = await self.client(f"{line}:{key}")
        client.headers = [(b"x-api-key", key.encode())] if key else []
        answer = await client.request(method, path, body=body, timeout=600)
        return answer.status, answer.body

    async def close(self) -> None:
        for context in self._contexts:
            await context.__aexit__(None, None, None)
        self.probe.close()
        self.proc.terminate()
        self.proc.wait(60)

    def rss(self) -> int:
        return _status(self.proc.pid, "VmRSS")

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def peak(self) -> int:
        return _status(self.proc.pid, "VmHWM")


def _status(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {name}")


# -- the probe --------------------------------------------------------------------------------------------------
#: a probe's timeout, as a kubelet's (timeoutSeconds 1); a probe that timed out counts as this
PROBE_TIMEOUT_S = 1.0


def probe_loop(port: int, path: str, stop: Any) -> None:
    """Ask ``GET /health/live`` on ``port`` (serve's ops listener) every 50 ms, on a fresh connection each time, until
    ``stop`` is set; append ``start latency status`` (monotonic seconds) to ``path`` for each."""
    request = b"GET /health/live HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
    with open(path, "a", buffering=1) as out:
        while not stop.is_set():
            t0 = time.monotonic()
            status = 0
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=PROBE_TIMEOUT_S) as sock:
                    sock.sendall(request)
                    data = b""
                    while chunk := sock.recv(1 << 16):
                        data += chunk
                        if time.monotonic() - t0 > PROBE_TIMEOUT_S:
                            break
                status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0
            except OSError:
                status = 0
            latency = time.monotonic() - t0
            out.write(f"{t0:.6f} {latency:.6f} {status}\n")
            stop.wait(max(0.0, 0.05 - latency))


class Probe:
    """The kubelet-like prober as a process of its own (its CPU is not the load generator's event loop)."""

    def __init__(self, port: int, path: Path) -> None:
        self.path = path
        path.write_text("")
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._proc = context.Process(target=probe_loop, args=(port, str(path), self._stop), daemon=True)
        self._proc.start()
        deadline = time.monotonic() + 60
        while " 200\n" not in path.read_text():  # the prober is up and the edge answers it
            if time.monotonic() > deadline or not self._proc.is_alive():
                raise RuntimeError(f"no /health/live probe answered within 60 s (see {path})")
            time.sleep(0.1)

    def worst_ms(self, start: float, end: float) -> tuple[float, int]:
        """The worst latency (ms; a failed or timed-out probe counts :data:`PROBE_TIMEOUT_S`) of the probes begun
        between ``start`` and ``end`` (monotonic), and how many there were."""
        worst, count = 0.0, 0
        for line in self.path.read_text().splitlines():
            t0, latency, status = line.split()
            if start <= float(t0) <= end:
                count += 1
                worst = max(worst, float(latency) if status == "200" else PROBE_TIMEOUT_S)
        return round(worst * 1e3, 1), count

    def close(self) -> None:
        self._stop.set()
        self._proc.join(10)


def lag_buckets(port: int) -> dict[float, float]:
    """``edgepath_event_loop_lag_seconds``'s cumulative bucket counts from serve's ops listener's ``/metrics``."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    buckets: dict[float, float] = {}
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("edgepath_event_loop_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(le)] = float(line.rsplit(" ", 1)[1])
    return buckets


def worst_lag_ms(before: dict[float, float], after: dict[float, float]) -> float:
    """The upper bound (ms) of the bucket the worst lag sample between two readings fell in (0: no sample)."""
    new = {le: after.get(le, 0.0) - before.get(le, 0.0) for le in after}
    total = new.get(float("inf"), 0.0)
    if total <= 0:
        return 0.0
    return min(le for le, count in new.items() if count >= total) * 1e3


@dataclass
class Case:
    name: str
    transport: str
    status: int
    rss_growth_mb: float
    live_worst_ms: float
    live_polls: int
    loop_lag_ms: float
    inline_worst_ms: float
    message: str = ""


@dataclass
class Watched:
    """What the probes and the edge's loop saw while some work ran."""

    live_worst_ms: float  # the worst /health/live probe's latency (the prober's own process)
    live_polls: int
    loop_lag_ms: float  # the bucket the edge's worst event-loop lag sample fell in (its upper bound)
    inline_worst_ms: float  # the worst /health/live asked from the load generator's own event loop (as before)


async def watched(served: Served, work: Awaitable[tuple[int, bytes]]) -> tuple[tuple[int, bytes], Watched]:
    """Run ``work``; the probes of ``/health/live`` begun meanwhile (and a few before and after), the edge's worst
    event-loop lag meanwhile, and -- to compare -- ``/health/live`` asked every 50 ms from this process's own loop
    (where the load generator's clients run) on the transport under test, as this bench did before."""
    lag_before = await asyncio.to_thread(lag_buckets, served.ops_port)
    inline: list[float] = []
    done = asyncio.Event()

    async def poll() -> None:
        while not done.is_set():
            t0 = time.perf_counter()
            status, _ = await served.call("GET", "/health/live", b"", None, line="live")
            inline.append(time.perf_counter() - t0 if status == 200 else float("inf"))
            await asyncio.sleep(max(0.0, 0.05 - (time.perf_counter() - t0)))

    poller = asyncio.ensure_future(poll())
    start = time.monotonic()
    await asyncio.sleep(0.2)  # a few probes before the case
    try:
        result = await work
    finally:
        await asyncio.sleep(0.2)
        done.set()
        await poller
    end = time.monotonic()
    await asyncio.sleep(PROBE_TIMEOUT_S + 0.1)  # a probe begun before the end has been written
    worst, polls = served.probe.worst_ms(start, end)
    lag = worst_lag_ms(lag_before, await asyncio.to_thread(lag_buckets, served.ops_port))
    return result, Watched(worst, polls, lag, round(max(inline) * 1e3, 1))


async def one_case(served: Served, name: str, path: str, body: bytes) -> Case:
    before = served.rss()
    served.reset_peak()
    (status, answer), seen = await watched(served, served.call("POST", path, body, KEYS[0]))
    growth = max(0, served.peak() - before) / MIB
    try:
        error = json.loads(answer).get("error", {})
        message = str(error.get("message", ""))[:120] if isinstance(error, dict) else ""
    except ValueError:
        message = ""
    return Case(
        name,
        served.transport,
        status,
        round(growth, 1),
        seen.live_worst_ms,
        seen.live_polls,
        seen.loop_lag_ms,
        seen.inline_worst_ms,
        message,
    )


# -- the flood and the quiet tenant ---------------------------------------------------------------------------
@dataclass
class Flood:
    transport: str
    case: str
    clients: int
    seconds: float
    sent: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    ttft_alone_ms: list[float] = field(default_factory=list)
    ttft_flooded_ms: list[float] = field(default_factory=list)
    ttft_ratio_p50: float | None = None
    ttft_ratio_max: float | None = None
    streams_under_way: int = 0
    streams_completed: int = 0
    live_worst_ms: float = 0.0
    loop_lag_ms: float = 0.0
    inline_worst_ms: float = 0.0


async def quiet_chat(served: Served, model: str, max_tokens: int = 8) -> tuple[int, float]:
    """Tenant B's lone chat (streamed): status and time to its first content event (seconds)."""
    doc = {"model": model, "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": "Hello"}]}
    if served.transport == "tcp":
        out = await stream_chat(served.port, doc, 600, [("x-api-key", KEYS[1])], local=QUIET_ADDRESS)
        return (out.status if out.ok else 0), out.ttft or 0.0
    body = json.dumps(doc).encode()
    t0 = time.perf_counter()
    first: list[float] = []
    client = await served.client(f"b:{KEYS[1]}")
    client.headers = [(b"x-api-key", KEYS[1].encode())]

    def seen(status: int, data: bytes) -> None:
        if status == 200 and b'"content"' in data and not first:
            first.append(time.perf_counter())

    answer = await client.request("POST", "/v1/chat/completions", body=body, timeout=600, on_data=seen)
    return answer.status, (first[0] if first else time.perf_counter()) - t0


async def flood(served: Served, model: str, case: tuple[str, str, bytes], clients: int, seconds: float) -> Flood:
    name, path, body = case
    report = Flood(served.transport, name, clients, seconds)
    for _ in range(5):  # tenant B alone
        status, ttft = await quiet_chat(served, model)
        if status == 200:
            report.ttft_alone_ms.append(ttft * 1e3)
    under_way = [asyncio.ensure_future(quiet_chat(served, model, max_tokens=64)) for _ in range(2)]
    report.streams_under_way = len(under_way)
    end = time.perf_counter() + seconds

    async def hostile(index: int) -> None:
        while time.perf_counter() < end:
            try:
                status, _ = await served.call("POST", path, body, KEYS[0], line=f"flood{index}")
            except OSError:  # refused past the connection caps, or reset before an answer: counted as 0, sent again
                status = 0
            report.sent += 1
            report.statuses[str(status)] = report.statuses.get(str(status), 0) + 1

    async def quiet() -> None:
        while time.perf_counter() < end:
            status, ttft = await quiet_chat(served, model)
            if status == 200:
                report.ttft_flooded_ms.append(ttft * 1e3)

    async def all_of_it() -> tuple[int, bytes]:
        await asyncio.gather(*(hostile(i) for i in range(clients)), quiet())
        return 200, b""

    _, seen = await watched(served, all_of_it())
    report.live_worst_ms, report.loop_lag_ms = seen.live_worst_ms, seen.loop_lag_ms
    report.inline_worst_ms = seen.inline_worst_ms
    report.streams_completed = sum(1 for status, _ in await asyncio.gather(*under_way) if status == 200)
    if report.ttft_alone_ms and report.ttft_flooded_ms:
        alone = statistics.median(report.ttft_alone_ms)
        report.ttft_ratio_p50 = round(statistics.median(report.ttft_flooded_ms) / alone, 2)
        report.ttft_ratio_max = round(max(report.ttft_flooded_ms) / alone, 2)
    return report


# -- the run ------------------------------------------------------------------------------------------------
async def run_transport(transport: str, args: argparse.Namespace, out: Path) -> tuple[list[Case], Flood]:
    extra = ["--start-timeout", str(args.start_timeout), *(["--handler", args.handler] if args.handler else [])]
    served = Served(transport, Path(tempfile.mkdtemp()), out / f"serve-{transport}.log", extra)
    try:
        _, listing = await served.call("GET", "/v1/models", b"", KEYS[0])
        model = json.loads(listing)["data"][0]["id"]
        await served.call(
            "POST", "/v1/completions", json.dumps({"model": model, "prompt": "Hi", "max_tokens": 2}).encode(), KEYS[0]
        )
        by_name = {c[0]: c for c in cases(model)}
        if args.flood is not None:  # that flood alone: no single cases
            if args.flood not in by_name:
                raise SystemExit(f"--flood {args.flood!r} is no case of this bench; the cases: {', '.join(by_name)}")
            results, chosen = [], args.flood
        else:
            results = [await one_case(served, *case) for case in cases(model)]
            chosen = max(results, key=lambda r: (r.loop_lag_ms, r.live_worst_ms)).name
        flooded = await flood(served, model, by_name[chosen], args.clients, args.seconds)
        return results, flooded
    finally:
        await served.close()


def markdown(results: list[Case], floods: list[Flood], load: str, when: str) -> str:
    lines = [
        f"`edgepath bench hostile` ({when}; {machine()}; load average before the run: {load}; "
        f"targets: RSS growth <= {RSS_TARGET_MB} MB, /health/live <= {LIVE_TARGET_MS} ms, quiet TTFT <= "
        f"{TTFT_TARGET}x alone)",
        "",
        "| case | transport | answer | serve RSS growth (MB) | /health/live worst (ms) "
        "| edge loop lag worst (ms, <=) | /health/live worst from the load generator's loop (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.transport} | {r.status} | {r.rss_growth_mb:g} | {r.live_worst_ms:g} | {r.loop_lag_ms:g} "
            f"| {r.inline_worst_ms:g} |"
        )
    lines += [
        "",
        "| flood | transport | clients x s | sent (statuses) | quiet TTFT alone p50 (ms) | under flood p50 / max "
        "(x alone) | streams under way completed | /health/live worst (ms) | edge loop lag worst (ms, <=) "
        "| /health/live worst from the load generator's loop (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in floods:
        alone = statistics.median(f.ttft_alone_ms) if f.ttft_alone_ms else float("nan")
        lines.append(
            f"| {f.case} | {f.transport} | {f.clients} x {f.seconds:g} | {f.sent} ({f.statuses}) | {alone:.0f} | "
            f"{f.ttft_ratio_p50} / {f.ttft_ratio_max} | {f.streams_completed} of {f.streams_under_way} | "
            f"{f.live_worst_ms:g} | {f.loop_lag_ms:g} | {f.inline_worst_ms:g} |"
        )
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transports", default="tcp,quic", help="comma-separated: tcp, quic (default both)")
    p.add_argument("--seconds", type=float, default=30.0, help="length of the flood (default 30)")
    p.add_argument("--clients", type=int, default=10, help="clients of the flood (default 10)")
    p.add_argument(
        "--flood",
        default=None,
        metavar="CASE",
        help="run only the flood, of this case (its name as in the table); default: every case once, then the flood "
        "of the one that held the edge's loop longest",
    )
    p.add_argument("--handler", default=None, help="serve's --handler (default: serve's own, the real model)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds serve's slot server may take to start")
    p.add_argument("--out", default="out/hostile", help="folder for hostile.json and the servers' logs")
    p.add_argument("--doc", default=None, help="rewrite this page's hostile block (docs/PERFORMANCE.md)")


def main(args: argparse.Namespace) -> int:
    if args.flood is not None and args.doc:
        raise SystemExit("--doc rewrites the whole hostile block: it needs every case (leave --flood out)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    when = time.strftime("%Y-%m-%d", time.gmtime())
    results: list[Case] = []
    floods: list[Flood] = []
    for transport in args.transports.split(","):
        cases_of, flood_of = asyncio.run(run_transport(transport, args, out))
        results += cases_of
        floods.append(flood_of)
    report = {
        "machine": machine(),
        "load": load,
        "cases": [asdict(r) for r in results],
        "floods": [asdict(f) for f in floods],
    }
    (out / "hostile.json").write_text(json.dumps(report, indent=1))
    text = markdown(results, floods, load, when)
    print(text)
    if args.doc:
        rewrite_block(Path(args.doc), "hostile", text)
    return 0
