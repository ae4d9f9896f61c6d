"""The ``edgepath`` command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from edgepath.config import AgentServiceSettings, DataPath, ServeOptions, SlotServerSettings
from edgepath.options import (
    add_options,
    from_args,
    non_negative_float,
    once_only,
    port_number,
    positive_float,
    positive_int,
    readable_file,
)
from edgepath.runtime import setup_logging
from edgepath.supervisor import GaveUp

log = logging.getLogger("edgepath")


class _Parser(argparse.ArgumentParser):
    """Mistakes on the command line are one line on stderr and exit status 2, never usage pages; an
    option that takes one value may be given once (see edgepath.options)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        once_only(self)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Renamed(argparse.Action):
    """An option that was renamed: one line naming the new one instead of a usage page."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(self.new)


def _add_renamed_transport(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        action=_Renamed,
        new="--transport is now --data-path (loopback|verbs): the agent <-> slot-server link; "
        "--transport names the client-facing protocol of `edgepath serve` (quic|tcp)",
    )


def _run_until_signal(serve: Callable[[], None], stop: Callable[[], None]) -> None:
    """Run ``serve`` on this thread; SIGINT/SIGTERM call ``stop``."""

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    serve()


def _serve_until_signal(server: Any, listen: str, report: Callable[[], str]) -> int:
    """Print the ready line, serve until SIGINT/SIGTERM, close; ``report`` is logged at the end."""
    print(f"ready {listen}", flush=True)
    try:
        _run_until_signal(server.serve, server.stop)
    finally:
        server.close()
        log.info("%s", report())
    return 0


def cmd_slot_server(args: argparse.Namespace) -> int:
    from edgepath.builder import build_slot_server

    settings = from_args(SlotServerSettings, args)
    server = build_slot_server(settings)
    return _serve_until_signal(server, settings.listen, lambda: f"stats: {server.stats}")


def cmd_agent(args: argparse.Namespace) -> int:
    from edgepath.builder import build_agent_service

    settings = from_args(AgentServiceSettings, args)
    service = build_agent_service(settings)
    return _serve_until_signal(service, settings.listen, lambda: f"agent: {service.agent.describe()}")


def cmd_demo(args: argparse.Namespace) -> int:
    from edgepath.demo import run_demo

    report = run_demo(
        requests=args.requests,
        slots=args.slots,
        concurrency=args.concurrency,
        tokens=args.tokens,
        spin=args.spin_us / 1e6,
        data_path=from_args(DataPath, args),
        slot_server_listen=args.slot_server_listen,
    )
    print("edgepath demo: edge frames -> agent (CAS claim, write, doorbell) -> slot server (echo) -> result")
    for line in report.lines():
        print(line)
    bad = report.errors or report.mismatches or report.slots_free_after != report.slots
    return 1 if bad else 0


def cmd_bench_ingress(args: argparse.Namespace) -> int:
    from edgepath.bench.ingress import main

    return main(args)


def cmd_bench_model(args: argparse.Namespace) -> int:
    from edgepath.bench.model_compare import main

    return main(args)


def cmd_bench_stream(args: argparse.Namespace) -> int:
    from edgepath.bench.stream import main

    return main(args)


def cmd_bench_edge_cpu(args: argparse.Namespace) -> int:
    from edgepath.bench.edge_cpu import main

    return main(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from edgepath.serve import serve

    return serve(from_args(ServeOptions, args))


def cmd_request(args: argparse.Namespace) -> int:
    import asyncio

    from edgepath.edge.client import request_main

    return asyncio.run(request_main(args))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgepath", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("slot-server", help="own a slot pool and serve it with a handler")
    add_options(p, SlotServerSettings)
    _add_renamed_transport(p)
    p.set_defaults(func=cmd_slot_server)

    p = sub.add_parser("agent", help="claim slots and write requests for edges (a separate process)")
    add_options(p, AgentServiceSettings)
    _add_renamed_transport(p)
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("demo", help="run the whole loopback data path in one process and report")
    p.add_argument("--requests", type=positive_int, default=10_000)
    p.add_argument("--slots", type=positive_int, default=8)
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=12,
        help="requests in flight at once (more than --slots shows 429s)",
    )
    p.add_argument("--tokens", type=positive_int, default=128, help="tokens per request")
    p.add_argument("--spin-us", type=non_negative_float, default=0.0)
    add_options(p, DataPath)
    _add_renamed_transport(p)
    p.add_argument(
        "--slot-server-listen",
        default=None,
        help="where the demo's slot server listens (--data-path verbs: IP:PORT of the RDMA device's netdev)",
    )
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser(
        "ingress", help="open-loop HTTP latency and server CPU per request: edgepath vs the QUIC floors vs FastAPI"
    )
    p.add_argument(
        "--systems",
        default=None,
        help="comma-separated, from: edgepath-aioquic, edgepath-qh3, edgepath-aioquic-w2, floor-aioquic, floor-qh3, "
        "fastapi-batch, fastapi-direct (default: all)",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: one short low-rate run per system, no sweep")
    p.add_argument(
        "--schedule",
        default=None,
        help="one run on this schedule (poisson:RATE or uniform:LOW_MS-HIGH_MS) instead of a rate sweep",
    )
    p.add_argument("--count", type=positive_int, default=1000, help="requests for --schedule")
    p.add_argument("--seconds", type=positive_float, default=4.0, help="length of each measured run")
    p.add_argument("--sweep-seconds", type=positive_float, default=2.0, help="length of each capacity-sweep step")
    p.add_argument("--start-rate", type=positive_float, default=200.0, help="first rate of the sweep (req/s)")
    p.add_argument("--max-rate", type=positive_float, default=20_000.0, help="the sweep stops here (req/s)")
    p.add_argument("--generators", type=positive_int, default=1, help="load-generator processes to start with")
    p.add_argument(
        "--max-generators", type=positive_int, default=2, help="a client-bound run is retried with more, up to this"
    )
    p.add_argument("--slots", type=positive_int, default=64)
    p.add_argument("--out", default="out/ingress", help="folder for ingress.json and ingress.png")
    p.add_argument(
        "--doc",
        "--readme",
        dest="doc",
        default=None,
        help="rewrite this page's ingress block between its markers (docs/PERFORMANCE.md; --readme: its old name)",
    )
    p.set_defaults(func=cmd_bench_ingress)
    p = bench.add_parser(
        "model", help="streamed chat load on the same GGUF, phase by phase: edgepath vs llama.cpp's own llama-server"
    )
    from edgepath.bench.model_compare import add_arguments as add_model_arguments

    add_model_arguments(p)
    p.set_defaults(func=cmd_bench_model)
    p = bench.add_parser("stream", help="streamed responses under open-loop load (paced echo): TTFT, ITL, return path")
    from edgepath.bench.stream import add_arguments as add_stream_arguments

    add_stream_arguments(p)
    p.set_defaults(func=cmd_bench_stream)
    p = bench.add_parser(
        "edge-cpu", help="the edge process's CPU per request without the QUIC engine (echo slot server, closed loop)"
    )
    # defined here, not in bench/edge_cpu.py: importing that module (the edge, numpy) would slow every command
    p.add_argument("--requests", type=int, default=10_000, help="measured requests per run (default 10,000)")
    p.add_argument("--runs", type=int, default=3, help="measured runs (default 3; the figure is their median)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--warmup", type=int, default=2_000, help="requests before the measurement (default 2,000)")
    p.add_argument("--no-profile", action="store_true", help="skip the profiled run and its breakdown")
    p.add_argument("--profile", default=None, help="keep the profiled run's cProfile here")
    p.add_argument(
        "--doc",
        "--readme",
        dest="doc",
        default=None,
        help="rewrite this page's edge-cpu block between its markers (docs/PERFORMANCE.md; --readme: its old name)",
    )
    p.set_defaults(func=cmd_bench_edge_cpu)

    p = sub.add_parser("serve", help="the edge: HTTP/3 (or HTTP/1.1) API, tokenizer, agent and a local slot server")
    add_options(p, ServeOptions)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("request", help="send one request to an edge over HTTP/3 and print the result and timings")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=4433)
    p.add_argument("--max-tokens", type=positive_int, default=None)
    p.add_argument("--stream", action="store_true", help="ask for server-sent events")
    p.add_argument("--tokenize", action="store_true", help="only tokenize (POST /v1/tokenize)")
    p.add_argument(
        "--cacert",
        type=readable_file,
        default=None,
        help="CA file to verify the server (default: the local self-signed one)",
    )
    p.add_argument("--insecure", action="store_true", help="do not verify the server's certificate")
    p.add_argument("--api-key", default=None, help="API key to send as x-api-key (default: $EDGEPATH_API_KEY)")
    p.add_argument("--timeout", type=positive_float, default=30.0)
    p.set_defaults(func=cmd_request)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except GaveUp as exc:
        print(f"edgepath {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"edgepath {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
