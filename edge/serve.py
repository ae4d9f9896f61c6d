"""``edgepath serve``: edge + in-process agent + (unless given one) a supervised local slot server.

The slot server runs as a child process, exactly as it would run alone (``edgepath slot-server``,
its command line made from the same configuration), and is restarted with bounded back-off when it
dies; the agent re-attaches to it where it listens.  The agent lives in the edge's process, so the
edge writes token ids straight into the agent's registered frames.  The process prints
``ready <url>`` on stdout once it accepts requests, and stops everything it started on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from aioquic.asyncio.server import QuicServer

from edgepath.builder import build_agent, build_edge, data_path_transport
from edgepath.config import ServeOptions
from edgepath.dpu.agent import Agent
from edgepath.dpu.agent_client import AgentClient
from edgepath.edge.auth import load_keys
from edgepath.edge.service import EdgeService
from edgepath.edge.tls import TlsFiles, resolve
from edgepath.edge.tokenizer import load_tokenizer
from edgepath.supervisor import GaveUp, RestartPolicy, Supervisor

log = logging.getLogger("edgepath.serve")
T = TypeVar("T")


def check_listen(options: ServeOptions) -> None:
    """Fail before anything starts when ``--host``/``--port`` cannot be listened on (in use, say);
    the real bind later reports the same way if it loses a race for the port."""
    kind = socket.SOCK_STREAM if options.transport == "tcp" else socket.SOCK_DGRAM
    try:
        infos = socket.getaddrinfo(options.host, options.port, type=kind)
        with socket.socket(infos[0][0], kind) as probe:
            if kind == socket.SOCK_STREAM:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
            probe.bind(infos[0][4])
    except OSError as exc:
        raise _cannot_listen(options, exc) from exc


def _cannot_listen(options: ServeOptions, exc: OSError) -> RuntimeError:
    return RuntimeError(
        f"--host {options.host} --port {options.port}: cannot listen on {options.host}:{options.port} "
        f"({options.transport}): {exc.strerror or exc}; give a free port and an address of this machine"
    )


def _slot_server_listen(options: ServeOptions) -> str:
    from edgepath.runtime import runtime_dir

    if options.slot_server_listen:
        return options.slot_server_listen
    if options.data_path == "verbs":
        raise RuntimeError(
            "--data-path verbs: give --slot-server-listen IP:PORT (an address of the RDMA device) for the "
            "started slot server, or --slot-server ADDR of a running one"
        )
    return str(runtime_dir() / f"serve-{options.transport}-{options.port}.sock")


async def run(options: ServeOptions, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None); :class:`GaveUp` when the
    started slot server keeps dying."""
    loop = asyncio.get_running_loop()
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
    link = options.link
    check_listen(options)
    listen = _slot_server_listen(options) if options.agent is None and options.slot_server is None else None
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    gave_up: list[str] = []

    def give_up(message: str) -> None:  # called on the supervisor's thread
        gave_up.append(message)
        loop.call_soon_threadsafe(stop.set)

    keys = load_keys(options.api_keys_file, options.protect_ops)  # checked before anything starts or logs
    with contextlib.ExitStack() as cleanup:
        agent: Agent | AgentClient
        if options.agent is not None:
            agent = _named("--agent", options.agent, AgentClient)
            cleanup.callback(agent.transport.close)
        else:
            transport = data_path_transport(link)  # an unusable device fails here, before any child
            cleanup.callback(transport.close)
            if listen is not None:
                policy = RestartPolicy(max_restarts=options.max_restarts, window=options.restart_window)
                supervisor = Supervisor("slot server", options.slot_server_settings(listen).argv(), policy, give_up)
                cleanup.callback(supervisor.stop)
                address = supervisor.start().address or listen
                agent = build_agent(options.agent_settings(address), transport)
            else:
                assert options.slot_server is not None
                agent = _named(
                    "--slot-server", options.slot_server, lambda a: build_agent(options.agent_settings(a), transport)
                )
        tokenizer = load_tokenizer(options.tokenizer)
        log.info("tokenizer %s (%d ids)", tokenizer.name, tokenizer.vocab_size)
        executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")
        cleanup.callback(executor.shutdown, wait=False, cancel_futures=True)
        service = build_edge(options, tokenizer, agent, keys, loop, executor)
        service.start()
        tls = resolve(options.certificate, options.private_key) if options.transport == "quic" else None
        try:
            server = await _listen(options, service, tls)
        except OSError as exc:
            raise _cannot_listen(options, exc) from exc
        url = f"{'https' if options.transport == 'quic' else 'http'}://{_host_for_url(options.host)}:{options.port}"
        log.info("edge (%s) listening on %s", "HTTP/3 over QUIC" if options.transport == "quic" else "HTTP/1.1", url)
        print(f"ready {url}", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
        server.close()
        service.stop()
    if gave_up:
        raise GaveUp(gave_up[0])


async def _listen(options: ServeOptions, service: EdgeService, tls: TlsFiles | None) -> asyncio.Server | QuicServer:
    if tls is None:
        from edgepath.edge.tcp import serve_tcp

        return await serve_tcp(service, options.host, options.port)
    from edgepath.edge.quic import serve_quic, server_configuration

    return await serve_quic(
        service, options.host, options.port, server_configuration(str(tls.certificate), str(tls.private_key))
    )


def _named(option: str, address: str, connect: Callable[[str], T]) -> T:
    """``connect(address)``; a failure names the option the address came from."""
    try:
        return connect(address)
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"{option} {address}: {exc}") from exc


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def serve(options: ServeOptions) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(options))
    return 0
