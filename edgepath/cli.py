"""The ``edgepath`` command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from edgepath.runtime import default_address, setup_logging

log = logging.getLogger("edgepath")
DEFAULT_SLOTS = 64


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _slots_spec(text: str) -> tuple[str, int | None]:
    """``--slots``: a count (``64``), a memory kind (``host``, ``gpu``) or both (``gpu:64``)."""
    kind, sep, count = text.partition(":")
    if not sep and kind.isdigit():
        kind, count = "host", text
    if kind not in ("host", "gpu"):
        raise argparse.ArgumentTypeError(f"expected N, host, gpu, host:N or gpu:N, got {text!r}")
    return kind, _positive_int(count) if count else None


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _add_transport(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        choices=("loopback", "verbs"),
        default="loopback",
        help="data-path transport (default: loopback, shared memory on this machine)",
    )
    p.add_argument("--device", default=None, help="RDMA device for --transport verbs (e.g. rxe0)")
    p.add_argument("--gid-index", type=int, default=None, help="GID index for --transport verbs")


def _transport_options(args: argparse.Namespace) -> dict[str, object]:
    if args.transport == "verbs":
        return {k: v for k, v in (("device", args.device), ("gid_index", args.gid_index)) if v is not None}
    return {}


def _run_until_signal(serve: Callable[[], None], stop: Callable[[], None]) -> None:
    """Run ``serve`` on this thread; SIGINT/SIGTERM call ``stop``."""

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    serve()


def cmd_slot_server(args: argparse.Namespace) -> int:
    from edgepath.dma.handlers import load_handler
    from edgepath.dma.slot_server import SlotServer, SlotServerConfig
    from edgepath.dma.transport import make_transport

    memory, count = args.slots
    slots = count or DEFAULT_SLOTS
    if memory == "gpu":
        from edgepath.dma.gpu import require_device

        require_device()  # fail at once, before any transport is set up
    handler = load_handler(args.handler)
    config = SlotServerConfig(
        slots=slots,
        memory=memory,
        input_capacity=args.input_capacity,
        output_capacity=args.output_capacity,
        lease=args.lease,
        spin=args.spin_us / 1e6,
        handler_deadline=args.handler_deadline,
    )
    server = SlotServer(make_transport(args.transport, **_transport_options(args)), args.listen, handler, config)
    log.info(
        "slot server on %s (%s): %d slots in %s memory, %d/%d tokens in/out, handler %s",
        args.listen,
        args.transport,
        slots,
        memory,
        args.input_capacity,
        args.output_capacity,
        args.handler,
    )
    print(f"ready {args.listen}", flush=True)
    try:
        _run_until_signal(server.serve, server.stop)
    finally:
        server.close()
        log.info("stats: %s", server.stats)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from edgepath.dma.loopback import LoopbackTransport
    from edgepath.dma.transport import Access, make_transport
    from edgepath.dpu.agent import Agent
    from edgepath.dpu.agent_service import AgentService

    transport = LoopbackTransport()  # edges reach the agent through shared memory, always
    edge_frames = None
    if args.transport == "loopback":
        # Edges write requests into the agent's frames (shared memory): that region is exported to
        # edges only, never to slot servers, which see just the replies region.
        agent = Agent(
            transport,
            frames=args.frames,
            input_capacity=args.input_capacity,
            output_capacity=args.output_capacity,
            frames_access=Access.REMOTE_WRITE,
        )
    else:
        # Slot servers over RDMA: requests and replies live in shared memory that edges map, and the
        # same pages are registered with the NIC (requests with no remote access at all), so the edge's
        # one write of the tokens is what is sent and results land where the edge reads them.
        from edgepath.dpu.agent_service import edge_regions

        server_side = make_transport(args.transport, **_transport_options(args))
        edge_frames = edge_regions(transport, args.frames, args.input_capacity, args.output_capacity)
        agent = Agent(
            server_side,
            frames=args.frames,
            input_capacity=args.input_capacity,
            output_capacity=args.output_capacity,
            frames_buffer=edge_frames[0].buf,
            replies_buffer=edge_frames[1].buf,
        )
    for address in args.slot_server:
        link = agent.attach(address)
        log.info("attached to slot server %s: %d slots, claimant id %d", address, link.slot_count, link.claimant)
    service = AgentService(
        agent,
        transport,
        args.listen,
        frames_per_edge=args.frames_per_edge,
        spin=args.spin_us / 1e6,
        edge_frames=edge_frames,
    )
    print(f"ready {args.listen}", flush=True)
    try:
        _run_until_signal(service.serve, service.stop)
    finally:
        service.close()
        log.info("agent: %s", agent.describe())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from edgepath.dpu.demo import run_demo

    report = run_demo(
        requests=args.requests,
        slots=args.slots,
        concurrency=args.concurrency,
        tokens=args.tokens,
        spin=args.spin_us / 1e6,
    )
    print("edgepath demo: edge frames -> agent (CAS claim, write, doorbell) -> slot server (echo) -> result")
    for line in report.lines():
        print(line)
    bad = report.errors or report.mismatches or report.slots_free_after != report.slots
    return 1 if bad else 0


def cmd_bench_ingress(args: argparse.Namespace) -> int:
    from pathlib import Path

    from edgepath.bench.ingress import SYSTEMS, rewrite_readme, run_fixed, run_ingress, table

    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(sorted(unknown))}: choose from {', '.join(SYSTEMS)}")
    out = Path(args.out)
    if args.schedule:
        report = run_fixed(out, args.schedule, args.count, systems, slots=args.slots)
    else:
        report = run_ingress(
            out,
            systems,
            seconds=args.seconds,
            sweep_seconds=args.sweep_seconds,
            slots=args.slots,
            start_rate=args.start_rate,
        )
    text = table(report)
    print(text)
    print(f"report: {out / 'ingress.json'}, plot: {out / 'ingress.png'}")
    if args.readme:
        rewrite_readme(Path(args.readme), text, out / "ingress.png")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from edgepath.edge.serve import ServeOptions, serve

    return serve(
        ServeOptions(
            transport=args.transport,
            host=args.host,
            port=args.port if args.port is not None else (4433 if args.transport == "quic" else 8080),
            slot_server=args.slot_server_address,
            agent=args.agent,
            data_path=args.data_path,
            device=args.device,
            gid_index=args.gid_index,
            slot_server_listen=args.slot_server_listen,
            slots=args.slots,
            frames=args.frames,
            input_capacity=args.input_capacity,
            output_capacity=args.output_capacity,
            max_body=args.max_body,
            tokenizer=args.tokenizer,
            certificate=args.certificate,
            private_key=args.private_key,
            handler=args.handler,
            slot_spin_us=args.slot_spin_us,
            request_timeout=args.request_timeout,
            api_keys_file=args.api_keys_file,
            protect_ops=args.protect_ops,
            handler_deadline=args.handler_deadline,
        )
    )


def cmd_request(args: argparse.Namespace) -> int:
    import asyncio

    from edgepath.edge.client import request_main

    return asyncio.run(request_main(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgepath", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("slot-server", help="own a slot pool and serve it with a handler")
    _add_transport(p)
    p.add_argument("--listen", default=default_address("slot-server"), help="address agents connect to")
    p.add_argument(
        "--slots",
        type=_slots_spec,
        default=("host", None),
        metavar="{N,host,gpu,host:N,gpu:N}",
        help=f"slot count (default {DEFAULT_SLOTS}) and/or where doorbells are polled: host (CPU poller, default) "
        "or gpu (CUDA persistent poller over the pool mapped into the GPU; needs edgepath[gpu] and a CUDA device)",
    )
    p.add_argument("--input-capacity", type=_positive_int, default=4096, help="tokens per slot")
    p.add_argument("--output-capacity", type=_positive_int, default=4096, help="output tokens per slot")
    p.add_argument("--lease", type=float, default=1.0, help="seconds a claimed slot may wait for its doorbell")
    p.add_argument(
        "--handler-deadline",
        type=_non_negative_float,
        default=0.0,
        help="answer a request HANDLER_ERROR when its handler runs longer than this (seconds; handlers then run "
        "on worker threads and an overdue one keeps its slot until it returns); 0: no deadline, run inline",
    )
    p.add_argument(
        "--spin-us",
        type=_non_negative_float,
        default=0.0,
        help="spin this long on the completion queue before sleeping (lowest latency, burns a core)",
    )
    p.add_argument("--handler", default="echo", help="'echo' or module:function")
    p.set_defaults(func=cmd_slot_server)

    p = sub.add_parser("agent", help="claim slots and write requests for edges (a separate process)")
    _add_transport(p)
    p.add_argument(
        "--slot-server",
        action="append",
        default=None,
        help="slot server address (repeat for several; default: the local one)",
    )
    p.add_argument("--listen", default=default_address("agent"), help="address edges connect to")
    p.add_argument("--frames", type=_positive_int, default=1024)
    p.add_argument("--frames-per-edge", type=_positive_int, default=256)
    p.add_argument("--input-capacity", type=_positive_int, default=4096)
    p.add_argument("--output-capacity", type=_positive_int, default=4096)
    p.add_argument("--spin-us", type=_non_negative_float, default=0.0)
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("demo", help="run the whole loopback data path in one process and report")
    p.add_argument("--requests", type=_positive_int, default=10_000)
    p.add_argument("--slots", type=_positive_int, default=8)
    p.add_argument(
        "--concurrency",
        type=_positive_int,
        default=12,
        help="requests in flight at once (more than --slots shows 429s)",
    )
    p.add_argument("--tokens", type=_positive_int, default=128, help="tokens per request")
    p.add_argument("--spin-us", type=_non_negative_float, default=0.0)
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("bench", help="benchmarks")
    bench = p.add_subparsers(dest="bench", required=True)
    p = bench.add_parser("ingress", help="open-loop HTTP latency: edgepath vs the QUIC floor vs queue-and-batch")
    p.add_argument("--systems", default="edgepath,floor,baseline", help="comma-separated: edgepath, floor, baseline")
    p.add_argument(
        "--schedule",
        default=None,
        help="one run on this schedule (poisson:RATE or uniform:LOW_MS-HIGH_MS) instead of a rate sweep",
    )
    p.add_argument("--count", type=_positive_int, default=1000, help="requests for --schedule")
    p.add_argument("--seconds", type=float, default=5.0, help="length of each measured run")
    p.add_argument("--sweep-seconds", type=float, default=2.0, help="length of each capacity-sweep step")
    p.add_argument("--start-rate", type=float, default=100.0, help="first rate of the capacity sweep (req/s)")
    p.add_argument("--slots", type=_positive_int, default=64)
    p.add_argument("--out", default="out/ingress", help="folder for ingress.json and ingress.png")
    p.add_argument("--readme", default=None, help="rewrite this README's ingress table (between its markers)")
    p.set_defaults(func=cmd_bench_ingress)

    p = sub.add_parser("serve", help="the edge: HTTP/3 (or HTTP/1.1) API, tokenizer, agent and a local slot server")
    p.add_argument("--transport", choices=("quic", "tcp"), default="quic", help="quic: HTTP/3 (default); tcp: HTTP/1.1")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 4433 for quic, 8080 for tcp)")
    p.add_argument(
        "--slot-server",
        dest="slot_server_address",
        default=None,
        help="address of a running slot server (default: start one as a child process)",
    )
    p.add_argument("--slots", type=_positive_int, default=64, help="slots of the started slot server")
    p.add_argument("--frames", type=_positive_int, default=256, help="agent frames (requests in flight)")
    p.add_argument("--input-capacity", type=_positive_int, default=4096, help="prompt tokens per slot")
    p.add_argument("--output-capacity", type=_positive_int, default=4096, help="output tokens per slot")
    p.add_argument("--max-body", type=_positive_int, default=1 << 20, help="largest request body in bytes")
    p.add_argument(
        "--tokenizer", default=None, help="a Hugging Face tokenizer.json (default: Tekken from mistral-common)"
    )
    p.add_argument("--certificate", default=None, help="TLS certificate (PEM); default: a generated self-signed one")
    p.add_argument("--private-key", default=None, help="TLS private key (PEM) for --certificate")
    p.add_argument("--handler", default="echo", help="handler of the started slot server: 'echo' or module:function")
    p.add_argument(
        "--slot-spin-us",
        type=_non_negative_float,
        default=0.0,
        help="the started slot server spins this long before sleeping (fewer wake-ups, burns CPU)",
    )
    p.add_argument(
        "--api-keys-file",
        default=None,
        help="require an API key (x-api-key or Authorization: Bearer) from this file, one per line; "
        "$EDGEPATH_API_KEYS (comma-separated) adds more",
    )
    p.add_argument("--protect-ops", action="store_true", help="require a key for /health and /metrics too")
    p.add_argument(
        "--data-path",
        choices=("loopback", "verbs"),
        default="loopback",
        help="transport between the agent and the slot server (verbs: RDMA, e.g. soft-RoCE rxe0)",
    )
    p.add_argument("--device", default=None, help="RDMA device for --data-path verbs (e.g. rxe0)")
    p.add_argument("--gid-index", type=int, default=None, help="GID index for --data-path verbs")
    p.add_argument(
        "--slot-server-listen",
        default=None,
        help="where the started slot server listens (--data-path verbs: IP:PORT of the RDMA device's netdev)",
    )
    p.add_argument(
        "--agent",
        default=None,
        help="use a running `edgepath agent` process at this address (shared memory) instead of an in-process "
        "agent; the edge survives its restarts",
    )
    p.add_argument(
        "--handler-deadline",
        type=_non_negative_float,
        default=0.0,
        help="the started slot server answers a request 502 when its handler runs longer (seconds; 0: none)",
    )
    p.add_argument(
        "--request-timeout",
        type=_non_negative_float,
        default=60.0,
        help="seconds a dispatched request may wait for its result before it is answered 504",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("request", help="send one request to an edge over HTTP/3 and print the result and timings")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=4433)
    p.add_argument("--max-tokens", type=_positive_int, default=None)
    p.add_argument("--stream", action="store_true", help="ask for server-sent events")
    p.add_argument("--tokenize", action="store_true", help="only tokenize (POST /v1/tokenize)")
    p.add_argument("--cacert", default=None, help="CA file to verify the server (default: the local self-signed one)")
    p.add_argument("--insecure", action="store_true", help="do not verify the server's certificate")
    p.add_argument("--api-key", default=None, help="API key to send as x-api-key (default: $EDGEPATH_API_KEY)")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(func=cmd_request)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    if getattr(args, "slot_server", "unset") is None:
        args.slot_server = [default_address("slot-server")]
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError) as exc:
        print(f"edgepath {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
