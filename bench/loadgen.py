"""One open-loop load-generator process: libcurl (through curl_cffi) over HTTP/3, or HTTP/1.1 / HTTP/2 over TLS.

``python -m edgepath.bench.loadgen https://127.0.0.1:4433/v1/generate --schedule poisson:500 --count 2000``

The client is not ours: libcurl's multi interface does the QUIC/TLS and HTTP work in C, so one process
drives a few thousand requests per second where a Python QUIC client saturates near one thousand.

Open loop, free of coordinated omission: the send times are precomputed (bench/schedule.py), every
request is issued at its scheduled time whether or not earlier ones were answered, and its latency
runs from that *scheduled* time to its last response byte.  The generator watches itself: how late
each send was issued (``lag``), how often its own handle pool was full (``capped``: that request
waited inside the client), and its CPU over the run.  From those the caller decides whether a run
measured the server or the client (``client_bound``).

Connection set-up and teardown are outside the measured window: the process opens its connections
with a warm-up burst, prints ``warm``, waits for the start time (a ``time.monotonic()`` value on one
stdin line, shared by every generator process and the caller that reads server CPU), runs the schedule,
prints its result as one JSON line, and closes its connections only after a ``close`` line (or at once
when stdin is not a pipe).  ``--part I/N`` takes every N-th send from offset I, so N processes together
send exactly one schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from curl_cffi import CurlHttpVersion
from curl_cffi.requests import AsyncSession
from curl_cffi.requests.exceptions import RequestException, Timeout
from hdrh.histogram import HdrHistogram

from edgepath.bench.schedule import parse

LOWEST_US, HIGHEST_US = 1, 60_000_000
PROTOCOLS = {"h3": CurlHttpVersion.V3ONLY, "h2": CurlHttpVersion.V2TLS, "h1": CurlHttpVersion.V1_1}
WARM_REQUESTS = {"h3": 16, "h2": 16, "h1": 64}  # h1: one connection per request in flight, so open more


def new_histogram() -> HdrHistogram:
    return HdrHistogram(LOWEST_US, HIGHEST_US, 3)


def _record(hist: HdrHistogram, seconds: float) -> None:
    hist.record_value(max(LOWEST_US, min(HIGHEST_US, int(seconds * 1e6))))


@dataclass
class Results:
    """What one generator saw; ``to_json`` is the line it prints (histograms HDR-encoded)."""

    histograms: dict[int, HdrHistogram] = field(default_factory=dict)
    lag: HdrHistogram = field(default_factory=new_histogram)  # issue time - scheduled time
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0
    capped: int = 0  # sends that found every curl handle busy (waited in the client)
    response_bytes: int = 0
    start: float = 0.0  # monotonic: first scheduled send
    finished: float = 0.0  # monotonic: last answer (or error)
    schedule_seconds: float = 0.0  # first to last scheduled send of this part
    cpu_seconds: float = 0.0  # this process, user + system, over start..finished

    def record(self, status: int, latency_s: float) -> None:
        hist = self.histograms.get(status)
        if hist is None:
            hist = self.histograms[status] = new_histogram()
        _record(hist, latency_s)

    def to_json(self) -> dict:
        return {
            "histograms": {str(k): h.encode().decode() for k, h in self.histograms.items()},
            "lag": self.lag.encode().decode(),
            "errors": dict(self.errors),
            "sent": self.sent,
            "capped": self.capped,
            "response_bytes": self.response_bytes,
            "start": self.start,
            "finished": self.finished,
            "schedule_seconds": self.schedule_seconds,
            "cpu_seconds": self.cpu_seconds,
        }


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _read_line() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def drive(
    url: str,
    offsets: np.ndarray,
    body: bytes,
    protocol: str = "h3",
    max_clients: int = 256,
    timeout: float = 10.0,
    handshake: bool = False,
    warm: int | None = None,
    connections: int = 1,
) -> Results:
    """Send ``body`` to ``url`` at ``offsets`` (seconds after the start). ``handshake``: the stdin protocol;
    ``warm``: concurrent warm-up requests that open the connections (default by protocol); ``connections``:
    client sessions, each with its own connection pool, taking the requests in turn -- several clients'
    connections, as an edge sees them (and what lets SO_REUSEPORT spread them over edge workers)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}: choose from {', '.join(PROTOCOLS)}")
    if connections < 1:
        raise ValueError(f"connections must be at least 1, got {connections}")
    results = Results(schedule_seconds=float(offsets[-1] - offsets[0]) if len(offsets) else 0.0)
    loop = asyncio.get_running_loop()  # loop.time() is time.monotonic(): comparable across processes
    headers = {"content-type": "application/json"}
    in_flight = 0
    warm_count = min(max_clients, warm if warm is not None else WARM_REQUESTS[protocol])
    async with contextlib.AsyncExitStack() as stack:
        sessions = [
            await stack.enter_async_context(
                AsyncSession(http_version=PROTOCOLS[protocol], max_clients=max_clients, verify=False)
            )
            for _ in range(connections)
        ]

        async def one(session: AsyncSession, due: float) -> None:
            nonlocal in_flight
            try:
                response = await session.post(url, data=body, headers=headers, timeout=timeout)
            except Timeout:
                results.errors["timeout"] += 1
            except RequestException as exc:
                results.errors[type(exc).__name__] += 1
            else:
                results.response_bytes += len(response.content)
                results.record(response.status_code, loop.time() - due)
            finally:
                in_flight -= 1
                results.finished = max(results.finished, loop.time())

        per_session = -(-warm_count // connections)
        warmed = await asyncio.gather(
            *(s.post(url, data=body, headers=headers, timeout=timeout) for s in sessions for _ in range(per_session)),
            return_exceptions=True,
        )
        failed = [w for w in warmed if isinstance(w, BaseException)]
        if failed:
            raise RuntimeError(f"warm-up against {url} failed: {failed[0]!r}")
        if handshake:
            print("warm", flush=True)
            start = float((await _read_line()).strip())
        else:
            start = loop.time() + 0.05
        results.start = start
        tasks = []
        cpu0 = _cpu()
        for i, off in enumerate(offsets):
            due = start + float(off)
            delay = due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            _record(results.lag, max(0.0, loop.time() - due))
            if in_flight >= max_clients:
                results.capped += 1
            in_flight += 1  # counted at issue: a burst of late sends has not started running yet
            results.sent += 1
            tasks.append(asyncio.ensure_future(one(sessions[i % connections], due)))
        if tasks:
            await asyncio.wait(tasks)
        results.cpu_seconds = _cpu() - cpu0
        if handshake:
            print(json.dumps(results.to_json()), flush=True)
            await _read_line()  # "close": the caller has read the servers' CPU; teardown is not measured
    return results


def part_of(offsets: np.ndarray, part: str) -> np.ndarray:
    """``I/N``: every N-th offset from I (N processes together send the whole schedule)."""
    index, _, total = part.partition("/")
    i, n = int(index), int(total)
    if not 0 <= i < n:
        raise ValueError(f"--part {part!r}: need I/N with 0 <= I < N")
    return offsets[i::n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url", help="https://host:port/path")
    parser.add_argument("--protocol", choices=tuple(PROTOCOLS), default="h3", help="h3, or h1/h2 over TLS")
    parser.add_argument("--schedule", default="poisson:200", help="poisson:RATE or uniform:LOW_MS-HIGH_MS")
    parser.add_argument("--count", type=int, default=1000, help="requests in the whole schedule")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", default="0/1", help="I/N: this process sends every N-th request from I")
    parser.add_argument("--body", default='{"prompt": "hello", "max_tokens": 16}')
    parser.add_argument("--max-clients", type=int, default=256, help="curl handles, i.e. requests in flight at most")
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--handshake", action="store_true", help="print 'warm', read the start time from stdin")
    parser.add_argument("--connections", type=int, default=1, help="client sessions taking the requests in turn")
    args = parser.parse_args(argv)
    offsets = part_of(parse(args.schedule, args.count, args.seed), args.part)
    results = asyncio.run(
        drive(
            args.url,
            offsets,
            args.body.encode(),
            args.protocol,
            args.max_clients,
            args.timeout,
            args.handshake,
            connections=args.connections,
        )
    )
    if not args.handshake:
        print(json.dumps(results.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
