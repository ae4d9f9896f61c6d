"""``edgepath serve``: edge + in-process agent + (unless given one) a local slot server, in one command.

The slot server runs as a child process on the loopback transport, exactly as it would run alone
(``python -m edgepath slot-server``); the agent lives in the edge's process, so the edge writes token
ids straight into the agent's registered frames.  The process prints ``ready <url>`` on stdout once
it accepts requests, and stops everything it started on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import selectors
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from aioquic.asyncio.server import QuicServer

from edgepath.dma.transport import make_transport
from edgepath.dpu.agent import Agent
from edgepath.dpu.agent_client import AgentClient
from edgepath.edge.auth import load_keys
from edgepath.edge.http import HttpCore, Limits
from edgepath.edge.service import EdgeService
from edgepath.edge.tokenizer import load_tokenizer

log = logging.getLogger("edgepath.serve")


@dataclass
class ServeOptions:
    transport: str = "quic"  # "quic" | "tcp"
    host: str = "127.0.0.1"
    port: int = 4433
    slot_server: str | None = None  # address of an existing slot server; None: start one
    agent: str | None = None  # address of an `edgepath agent` process to use instead of an in-process agent
    data_path: str = "loopback"  # transport between the in-process agent and the slot server: loopback | verbs
    device: str | None = None  # RDMA device for data_path verbs (e.g. rxe0)
    gid_index: int | None = None
    slot_server_listen: str | None = None  # where a started slot server listens (verbs: IP:PORT of the device)
    slot_server_address: str | None = None  # where the started one listens
    slots: int = 64
    frames: int = 256
    input_capacity: int = 4096
    output_capacity: int = 4096
    max_body: int = 1 << 20
    tokenizer: str | None = None
    certificate: str | None = None
    private_key: str | None = None
    handler: str = "echo"
    slot_spin_us: float = 0.0  # the started slot server spins this long on its queue before sleeping
    request_timeout: float = 60.0  # seconds a dispatched request may wait for its result (then 504)
    api_keys_file: str | None = None  # one key per line; with $EDGEPATH_API_KEYS, enables x-api-key checks
    protect_ops: bool = False  # /health and /metrics need a key too
    handler_deadline: float = 0.0  # the started slot server's --handler-deadline (0: none)


class SlotServerProcess:
    """A ``python -m edgepath slot-server`` child; started, waited for, stopped."""

    def __init__(self, options: ServeOptions, address: str) -> None:
        self.address = address
        cmd = [
            sys.executable,
            "-m",
            "edgepath",
            "slot-server",
            "--listen",
            address,
            "--slots",
            str(options.slots),
            "--input-capacity",
            str(options.input_capacity),
            "--output-capacity",
            str(options.output_capacity),
            "--handler",
            options.handler,
            "--spin-us",
            str(options.slot_spin_us),
            "--handler-deadline",
            str(options.handler_deadline),
            *data_path_args(options),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self._wait_ready(30.0)

    def _wait_ready(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            line = self.proc.stdout.readline() if sel.select(timeout) else ""
        if not line.startswith("ready"):
            self.stop()
            raise RuntimeError(f"slot server did not start (exit {self.proc.poll()}): {line.strip()!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)


def data_path_options(options: ServeOptions) -> dict[str, object]:
    """Transport options of the agent <-> slot server hop."""
    if options.data_path != "verbs":
        return {}
    return {k: v for k, v in (("device", options.device), ("gid_index", options.gid_index)) if v is not None}


def data_path_args(options: ServeOptions) -> list[str]:
    """The same choice as ``edgepath slot-server`` flags."""
    args = ["--transport", options.data_path]
    for flag, value in (("--device", options.device), ("--gid-index", options.gid_index)):
        if options.data_path == "verbs" and value is not None:
            args += [flag, str(value)]
    return args


def build_agent(options: ServeOptions, address: str) -> Agent:
    agent = Agent(
        make_transport(options.data_path, **data_path_options(options)),
        frames=options.frames,
        input_capacity=options.input_capacity,
        output_capacity=options.output_capacity,
    )
    link = agent.attach(address)
    log.info(
        "agent attached to slot server %s: %d slots, %d input tokens each",
        address,
        link.slot_count,
        link.input_capacity,
    )
    return agent


async def run(options: ServeOptions, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None)."""
    from edgepath.runtime import default_address, runtime_dir

    loop = asyncio.get_running_loop()
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
    tokenizer = load_tokenizer(options.tokenizer)
    log.info("tokenizer %s (%d ids)", tokenizer.name, tokenizer.vocab_size)
    child = None
    if options.agent is not None:
        address = options.agent
    elif options.slot_server is None:
        if options.data_path == "verbs" and not options.slot_server_listen:
            raise RuntimeError(
                "--data-path verbs: give --slot-server-listen IP:PORT (an address of the RDMA device) for the "
                "started slot server, or --slot-server ADDR of a running one"
            )
        address = (
            options.slot_server_listen
            or options.slot_server_address
            or str(runtime_dir() / f"serve-{options.transport}-{options.port}.sock")
        )
        child = SlotServerProcess(options, address)
    else:
        address = options.slot_server or default_address("slot-server")
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
    agent = None
    try:
        agent = AgentClient(address) if options.agent is not None else build_agent(options, address)
        link = agent.links[0]
        limits = Limits(
            max_body=options.max_body,
            input_capacity=min(options.input_capacity, link.input_capacity),
            output_capacity=min(options.output_capacity, link.output_capacity),
            vocab_size=tokenizer.vocab_size,
        )
        service = EdgeService(
            HttpCore(limits, load_keys(options.api_keys_file, options.protect_ops)),
            tokenizer,
            agent,
            loop,
            executor,
            request_timeout=options.request_timeout,
        )
        service.start()
        try:
            server = await _listen(options, service)
        except OSError as exc:
            raise RuntimeError(f"cannot listen on {options.host}:{options.port} ({options.transport}): {exc}") from exc
        url = f"{'https' if options.transport == 'quic' else 'http'}://{_host_for_url(options.host)}:{options.port}"
        log.info("edge (%s) listening on %s", "HTTP/3 over QUIC" if options.transport == "quic" else "HTTP/1.1", url)
        print(f"ready {url}", flush=True)
        if ready is not None:
            ready.set()
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()
        service.stop()
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        if agent is not None:
            agent.transport.close()
        if child is not None:
            child.stop()


async def _listen(options: ServeOptions, service: EdgeService) -> asyncio.Server | QuicServer:
    if options.transport == "tcp":
        from edgepath.edge.tcp import serve_tcp

        return await serve_tcp(service, options.host, options.port)
    from edgepath.edge.quic import serve_quic, server_configuration
    from edgepath.edge.tls import resolve

    tls = resolve(options.certificate, options.private_key)
    return await serve_quic(
        service, options.host, options.port, server_configuration(str(tls.certificate), str(tls.private_key))
    )


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(options: ServeOptions) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(options))
    return 0
