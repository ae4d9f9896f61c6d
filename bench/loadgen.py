"""One open-loop load-generator process: HTTP/3 (aioquic) or HTTP/1.1 (h11 over TCP).

``python -m edgepath.bench.loadgen h3://127.0.0.1:4433/v1/generate --schedule poisson:500 --count 2000``
prints one JSON line: latency histograms (HDR, base64) per status, counts, errors, achieved rate.
Each request's latency runs from its scheduled send time to its last response byte.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import h11
import numpy as np
from aioquic.asyncio.client import connect
from aioquic.quic.configuration import QuicConfiguration
from hdrh.histogram import HdrHistogram

from edgepath.bench.schedule import parse
from edgepath.edge.client import H3ClientProtocol, client_configuration

LOWEST_US, HIGHEST_US = 1, 60_000_000


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, 3)


@dataclass
class Results:
    histograms: dict[int, HdrHistogram] = field(default_factory=dict)
    errors: Counter = field(default_factory=Counter)
    response_bytes: int = 0  # bodies of all answered requests
    started: float = 0.0
    finished: float = 0.0
    schedule_seconds: float = 0.0

    def record(self, status: int, latency_s: float) -> None:
        hist = self.histograms.get(status)
        if hist is None:
            hist = self.histograms[status] = new_histogram()
        hist.record_value(max(LOWEST_US, min(HIGHEST_US, int(latency_s * 1e6))))

    def to_json(self) -> dict:
        return {
            "histograms": {str(k): h.encode().decode() for k, h in self.histograms.items()},
            "errors": dict(self.errors),
            "seconds": self.finished - self.started,
            "schedule_seconds": self.schedule_seconds,
            "response_bytes": self.response_bytes,
        }


async def _run_h3(
    url: str, offsets: np.ndarray, body: bytes, connections: int, max_streams: int, timeout: float
) -> Results:
    parts = urlsplit(url)
    config = client_configuration(insecure=True, server_name=parts.hostname)
    authority = parts.netloc
    path = parts.path or "/"
    results = Results()
    async with _H3Pool(parts.hostname, parts.port or 443, config, connections) as clients:
        loop = asyncio.get_running_loop()
        tasks = []
        start = loop.time() + 0.05
        results.started = time.monotonic() + 0.05
        for i, off in enumerate(offsets):
            due = start + float(off)
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            client = min(clients, key=lambda c: c.in_flight) if i % 8 == 0 else clients[i % len(clients)]
            if client.in_flight >= max_streams:
                client = min(clients, key=lambda c: c.in_flight)
            if client.in_flight >= max_streams:
                results.errors["client_saturated"] += 1  # counted, never silently delayed
                continue
            tasks.append(asyncio.ensure_future(_one_h3(client, authority, path, body, due, timeout, results)))
        if tasks:
            await asyncio.wait(tasks)
    results.finished = time.monotonic()
    return results


class _H3Pool:
    def __init__(self, host: str, port: int, config: QuicConfiguration, n: int) -> None:
        self._args = (host, port, config)
        self._n = n
        self._cms: list = []

    async def __aenter__(self) -> list[H3ClientProtocol]:
        host, port, config = self._args
        clients = []
        for _ in range(self._n):
            cm = connect(host, port, configuration=config, create_protocol=H3ClientProtocol)
            clients.append(await cm.__aenter__())
            self._cms.append(cm)
        return clients

    async def __aexit__(self, *exc: object) -> None:
        for cm in self._cms:
            await cm.__aexit__(None, None, None)


async def _one_h3(
    client: H3ClientProtocol, authority: str, path: str, body: bytes, due: float, timeout: float, results: Results
) -> None:
    loop = asyncio.get_running_loop()
    try:
        _, future = client.start("POST", authority, path, body)
        response = await asyncio.wait_for(future, timeout)
        status = response.status
        results.response_bytes += len(response.body)
    except TimeoutError:
        results.errors["timeout"] += 1
        return
    except (ConnectionError, OSError) as exc:
        results.errors[type(exc).__name__] += 1
        return
    results.record(status, loop.time() - due)


async def _run_h1(url: str, offsets: np.ndarray, body: bytes, max_connections: int, timeout: float) -> Results:
    parts = urlsplit(url)
    host, port, path = parts.hostname, parts.port or 80, parts.path or "/"
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, h11.Connection]] = []
    open_count = 0
    results = Results()
    loop = asyncio.get_running_loop()
    request = h11.Request(
        method="POST",
        target=path,
        headers=[("host", parts.netloc), ("content-type", "application/json"), ("content-length", str(len(body)))],
    )

    async def one(due: float) -> None:
        nonlocal open_count
        if idle:
            reader, writer, conn = idle.pop()
        else:
            open_count += 1
            reader, writer = await asyncio.open_connection(host, port)
            conn = h11.Connection(h11.CLIENT)
        try:
            writer.write(conn.send(request) + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))
            status = 0
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await asyncio.wait_for(reader.read(65536), timeout)
                    if not data:
                        raise ConnectionResetError("server closed the connection")
                    conn.receive_data(data)
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    break
            results.record(status, loop.time() - due)
            conn.start_next_cycle()
            idle.append((reader, writer, conn))
        except (TimeoutError, ConnectionError, OSError, h11.ProtocolError) as exc:
            results.errors[type(exc).__name__] += 1
            open_count -= 1
            writer.close()

    tasks = []
    start = loop.time() + 0.05
    results.started = time.monotonic() + 0.05
    for off in offsets:
        due = start + float(off)
        delay = due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if not idle and open_count >= max_connections:
            results.errors["client_saturated"] += 1
            continue
        tasks.append(asyncio.ensure_future(one(due)))
    if tasks:
        await asyncio.wait(tasks)
    results.finished = time.monotonic()
    for _, writer, _ in idle:
        writer.close()
    return results


def run(
    url: str, offsets: np.ndarray, body: bytes, connections: int = 4, max_streams: int = 100, timeout: float = 10.0
) -> Results:
    """Drive ``url`` (h3://host:port/path or http://host:port/path) on the schedule ``offsets``."""
    scheme = urlsplit(url).scheme
    if scheme == "h3":
        return asyncio.run(_run_h3(url, offsets, body, connections, max_streams, timeout))
    if scheme == "http":
        return asyncio.run(_run_h1(url, offsets, body, connections * max_streams, timeout))
    raise ValueError(f"unsupported URL scheme {scheme!r}: use h3:// or http://")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("--schedule", default="poisson:200", help="poisson:RATE or uniform:LOW_MS-HIGH_MS")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--body", default='{"prompt": "hello", "max_tokens": 16}')
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--max-streams", type=int, default=100, help="in flight per connection at most")
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args(argv)
    offsets = parse(args.schedule, args.count, args.seed)
    results = run(args.url, offsets, args.body.encode(), args.connections, args.max_streams, args.timeout)
    results.schedule_seconds = float(offsets[-1])
    print(json.dumps(results.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
