"""``edgepath serve``: edge + in-process agent + its slot servers (running ones at ``--slot-server``,
and unless only those are given, a supervised local one).

The local slot server runs as a child process, exactly as it would run alone (``edgepath slot-server``,
its command line made from the same configuration), and is restarted with bounded back-off when it
dies.  The agent has one link per slot server; a link that fails is out of admission at once and is
re-attached with bounded back-off when its slot server is back where it listens, started here or
not.  The agent lives in the edge's process, so the edge writes token ids straight into the agent's
registered frames.  The process prints ``ready <url>`` on stdout once it accepts requests, and stops
everything it started on SIGINT/SIGTERM.

With ``--workers N`` this process only supervises: N edge processes (each this same command with its
own in-process agent, on the shared port with SO_REUSEPORT) and the slot servers they all use.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TypeVar

from aioquic.asyncio.server import QuicServer

from edgepath.builder import build_agent, build_edge, data_path_transport
from edgepath.config import ServeOptions
from edgepath.dpu.agent import Agent
from edgepath.dpu.agent_client import AgentClient
from edgepath.edge.auth import ApiKeys, load_keys
from edgepath.edge.metrics import SHARED_DIR_ENV
from edgepath.edge.service import TOKENIZER_WORKERS, EdgeService
from edgepath.edge.tls import TlsFiles, resolve
from edgepath.edge.tokenizer import Tokenizer, load_tokenizer
from edgepath.hangwatch import HangWatch, read_counts
from edgepath.runtime import runtime_dir
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
            if options.reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # the workers share the port
            probe.bind(infos[0][4])
    except OSError as exc:
        raise _cannot_listen(options, exc) from exc


def _cannot_listen(options: ServeOptions, exc: OSError) -> RuntimeError:
    return RuntimeError(
        f"--host {options.host} --port {options.port}: cannot listen on {options.host}:{options.port} "
        f"({options.transport}): {exc.strerror or exc}; give a free port and an address of this machine"
    )


def _slot_server_listen(options: ServeOptions) -> str:
    if options.slot_server_listen:
        return options.slot_server_listen
    if options.data_path.kind == "verbs":
        raise RuntimeError(
            "--data-path verbs: give --slot-server-listen IP:PORT (an address of the RDMA device) for the "
            "started slot server, or --slot-server ADDR of a running one"
        )
    return str(runtime_dir() / f"serve-{options.transport}-{options.port}.sock")


async def run(options: ServeOptions, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (or SIGINT/SIGTERM when ``stop`` is None); :class:`GaveUp` when a
    started child (the slot server, or an edge worker) keeps dying."""
    loop = asyncio.get_running_loop()
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection at INFO
    options = options.resolved()  # the model found and checked before anything starts
    check_listen(options)
    listen = _slot_server_listen(options) if options.starts_slot_server else None
    keys = load_keys(options.api_keys_file, options.protect_ops)  # checked before anything starts or logs
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    gave_up: list[str] = []

    def give_up(message: str) -> None:  # called on a supervisor's thread
        gave_up.append(message)
        loop.call_soon_threadsafe(stop.set)

    def supervisor(name: str, argv: list[str], env: dict[str, str] | None = None) -> Supervisor:
        policy = RestartPolicy(max_restarts=options.max_restarts, window=options.restart_window)
        made = Supervisor(name, argv, policy, give_up, env=env)
        cleanup.callback(made.stop)
        return made

    with contextlib.ExitStack() as cleanup:
        transport = None
        if options.agent is None:
            transport = data_path_transport(options.data_path)  # an unusable device fails here, before any child
            cleanup.callback(transport.close)
        shared = _shared_metrics_dir(options, cleanup) if options.workers > 1 else None
        slot_servers = options.slot_servers
        counts = _shared_counts()  # this is an edge worker: its parent keeps the counts in the shared directory
        if listen is not None:
            local = supervisor("slot server", options.slot_server_settings(listen).argv())
            listen = local.start().address or listen
            watch = HangWatch(local, listen, options.data_path, options.slots, options.hang_timeout, shared)
            cleanup.callback(watch.stop)  # before the supervisor stops: no kill while everything stops
            watch.start()
            counts = lambda: (local.restarts, local.hangs)  # noqa: E731
            slot_servers = (listen, *slot_servers)
        if options.workers > 1:
            assert shared is not None
            tls = _tls(options)
            if tls is not None:  # one certificate for all workers, made here once
                options = replace(options, certificate=str(tls.certificate), private_key=str(tls.private_key))
            env = dict(os.environ, **{SHARED_DIR_ENV: shared})
            argv = options.worker_argv(slot_servers)
            workers = [supervisor(f"edge worker {i}", argv, env) for i in range(options.workers)]
            await asyncio.gather(*(asyncio.to_thread(worker.start) for worker in workers))  # they start together
            what = f"{options.workers} edge workers"
        else:
            if transport is None:
                assert options.agent is not None
                agent: Agent | AgentClient = _named("--agent", options.agent, AgentClient)
                cleanup.callback(agent.transport.close)
            else:
                flags = {listen: "--slot-server-listen"} if listen is not None else {}
                agent = build_agent(options.agent_settings(slot_servers), transport, flags)
            await _start_edge(options, agent, keys, loop, cleanup, counts)
            what = "edge"
        url = f"{'https' if options.transport == 'quic' else 'http'}://{_host_for_url(options.host)}:{options.port}"
        protocol = "HTTP/3 over QUIC" if options.transport == "quic" else "HTTP/1.1"
        log.info("%s (%s) listening on %s", what, protocol, url)
        print(f"ready {url}", flush=True)
        if ready is not None:
            ready.set()
        await stop.wait()
    if gave_up:
        raise GaveUp(gave_up[0])


async def _start_edge(
    options: ServeOptions,
    agent: Agent | AgentClient,
    keys: ApiKeys | None,
    loop: asyncio.AbstractEventLoop,
    cleanup: contextlib.ExitStack,
    supervision: Callable[[], tuple[int, int] | None] | None,
) -> None:
    """The edge in this process: tokenizer, service, listener; ``cleanup`` stops them in reverse.
    ``supervision``: the supervised slot server's (restarts, hangs) for /metrics (None: serve supervises none)."""
    tokenizer = load_tokenizer(options.tokenizer)
    if options.chat_template is not None:
        use_chat_template(tokenizer, options.chat_template)
    log.info("tokenizer %s (%d ids)", tokenizer.name, tokenizer.vocab_size)
    executor = ThreadPoolExecutor(max_workers=TOKENIZER_WORKERS, thread_name_prefix="tokenize")
    cleanup.callback(executor.shutdown, wait=False, cancel_futures=True)
    service = build_edge(options, tokenizer, agent, keys, loop, executor, supervision)
    service.start()
    cleanup.callback(service.stop)
    tls = _tls(options)
    try:
        server = await _listen(options, service, tls)
    except OSError as exc:
        raise _cannot_listen(options, exc) from exc
    cleanup.callback(server.close)


def _shared_metrics_dir(options: ServeOptions, cleanup: contextlib.ExitStack) -> str:
    """A fresh directory where the workers keep their metrics (one /metrics view), removed at the end."""
    path = runtime_dir() / f"serve-{options.transport}-{options.port}.metrics"
    shutil.rmtree(path, ignore_errors=True)  # counts of an earlier run are not this one's
    path.mkdir(mode=0o700)
    cleanup.callback(shutil.rmtree, path, ignore_errors=True)
    return str(path)


def _shared_counts() -> Callable[[], tuple[int, int] | None] | None:
    """In an edge worker of ``serve --workers``: the supervision counts its parent's hang watch keeps in the
    shared metrics directory; elsewhere None."""
    shared = os.environ.get(SHARED_DIR_ENV)
    return None if shared is None else functools.partial(read_counts, shared)


def _tls(options: ServeOptions) -> TlsFiles | None:
    return resolve(options.certificate, options.private_key) if options.transport == "quic" else None


async def _listen(options: ServeOptions, service: EdgeService, tls: TlsFiles | None) -> asyncio.Server | QuicServer:
    if tls is None:
        from edgepath.edge.tcp import serve_tcp

        return await serve_tcp(service, options.host, options.port, reuse_port=options.reuse_port)
    from edgepath.edge.quic import serve_quic, server_configuration

    configuration = server_configuration(str(tls.certificate), str(tls.private_key), options.quic_engine)
    return await serve_quic(
        service,
        options.host,
        options.port,
        configuration,
        reuse_port=options.reuse_port,
        retry=options.quic_retry,
        engine=options.quic_engine,
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


def use_chat_template(tokenizer: Tokenizer, path: str) -> None:
    """``--chat-template FILE`` replaces the model's own template; chats are tokenized with the template's
    markers as control tokens, which only the GGUF tokenizer can do (checked here, before serving)."""
    from edgepath.edge.chat import load_chat_template

    set_template = getattr(tokenizer, "set_chat_template", None)
    if set_template is None:
        raise ValueError(
            f"--chat-template: {tokenizer.name} cannot tokenize a chat template's control tokens; "
            "use it with a GGUF tokenizer (--model or --tokenizer PATH.gguf)"
        )
    set_template(load_chat_template(path).source)
