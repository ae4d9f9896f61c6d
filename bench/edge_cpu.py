"""``edgepath bench edge-cpu``: the edge process's own CPU per request, without the QUIC engine.

What edgepath adds on top of an HTTP/3 engine, isolated: a request object goes through the edge
service (parse, route, tokenize into the frame, claim, write, doorbell), an echo slot server in its
own process answers over the loopback data path, and the delivery is formatted into the response
that an adapter would send.  The load is closed (``--concurrency`` requests always in flight) and
bounded in count; this process's CPU (user + system, from /proc/self/stat) is read around the
measured requests only, after a warm-up.  ``--profile FILE`` writes a cProfile of the measured part
(slower; its times are for finding the hot spots, not for the figure).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from edgepath.children import Child
from edgepath.config import ServeOptions
from edgepath.edge.http import Headers, Request, Response
from edgepath.edge.tokenizer import load_tokenizer
from edgepath.native.abi import lib

PROMPT = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 10)
MAX_TOKENS = 128
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """This process's user + system CPU, as /proc counts it (what the ingress benchmark reads for servers)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


@dataclass
class EdgeCpu:
    requests: int
    concurrency: int
    seconds: float
    cpu_us_per_request: float
    statuses: dict[int, int]

    def line(self) -> str:
        return (
            f"{self.requests} requests, {self.concurrency} in flight: {self.requests / self.seconds:,.0f} req/s, "
            f"edge process {self.cpu_us_per_request:.0f} µs CPU per request, statuses {self.statuses}"
        )


class _Reply:
    """Counts the answer and starts the next request (a closed loop)."""

    __slots__ = ("_done",)

    def __init__(self, done: _Done) -> None:
        self._done = done

    def respond(self, response: Response) -> None:
        self._done(response.status)

    def start(self, status: int, headers: Headers) -> None:
        raise AssertionError("the benchmark does not stream")

    def send(self, data: bytes) -> None:
        raise AssertionError("the benchmark does not stream")

    def end(self, data: bytes) -> None:
        raise AssertionError("the benchmark does not stream")


class _Done:
    def __init__(self, loop: asyncio.AbstractEventLoop, send: Callable[[], None], total: int) -> None:
        self.loop = loop
        self.send = send
        self.total = total
        self.answered = 0
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.finished = loop.create_future()

    def __call__(self, status: int) -> None:
        self.answered += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if self.sent < self.total:
            self.sent += 1
            self.loop.call_soon(self.send)
        elif self.answered == self.total and not self.finished.done():
            self.finished.set_result(None)


async def _drive(service: object, requests: int, concurrency: int, profile: cProfile.Profile | None) -> EdgeCpu:
    from edgepath.edge.service import EdgeService

    assert isinstance(service, EdgeService)
    loop = asyncio.get_running_loop()
    body = json.dumps({"prompt": PROMPT, "max_tokens": MAX_TOKENS}).encode()
    headers = [(b"content-type", b"application/json")]

    def send() -> None:
        now = lib.ep_now_ns()
        service.handle(Request("POST", "/v1/generate", headers, body, now, now), _Reply(done))

    done = _Done(loop, send, requests)
    for _ in range(min(concurrency, requests)):
        done.sent += 1
        send()
    t0, c0 = time.perf_counter(), cpu_seconds()
    if profile is not None:
        profile.enable()
    await done.finished
    if profile is not None:
        profile.disable()
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    # the first `concurrency` requests were sent before the clock started; all were answered inside it
    return EdgeCpu(requests, concurrency, seconds, 1e6 * cpu / requests, done.statuses)


async def measure(requests: int, concurrency: int, warmup: int, profile_path: str | None) -> EdgeCpu:
    from edgepath.builder import build_agent, build_edge, data_path_transport

    with tempfile.TemporaryDirectory(prefix="edgepath-edge-cpu-") as tmp:
        listen = str(Path(tmp) / "slots.sock")
        options = ServeOptions(handler="echo", slots=max(64, 2 * concurrency), frames=max(256, 4 * concurrency))
        child = Child.start(options.slot_server_settings(listen).argv())
        transport = data_path_transport(options.link)
        executor = ThreadPoolExecutor(max_workers=2)
        try:
            agent = build_agent(options.agent_settings(child.address or listen), transport)
            loop = asyncio.get_running_loop()
            service = build_edge(options, load_tokenizer(None), agent, None, loop, executor)
            service.start()
            try:
                await _drive(service, warmup, concurrency, None)
                profile = cProfile.Profile() if profile_path else None
                result = await _drive(service, requests, concurrency, profile)
                if profile is not None and profile_path:
                    profile.dump_stats(profile_path)
                return result
            finally:
                service.stop()
        finally:
            executor.shutdown(wait=False)
            transport.close()
            child.stop()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=20_000, help="measured requests (default 20,000)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--warmup", type=int, default=2_000, help="requests before the measurement (default 2,000)")
    p.add_argument("--profile", default=None, help="write a cProfile of the measured requests here")
    p.add_argument("--json", default=None, help="write the result here as JSON")


def main(args: argparse.Namespace) -> int:
    """``edgepath bench edge-cpu``."""
    for name in ("requests", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    result = asyncio.run(measure(args.requests, args.concurrency, args.warmup, args.profile))
    print(result.line())
    if args.json:
        Path(args.json).write_text(json.dumps(result.__dict__, indent=1))
    if set(result.statuses) != {200}:
        print(f"not every request was answered 200: {result.statuses}")
        return 1
    return 0
