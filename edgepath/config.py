"""What each edgepath process is made of, as plain data: the one configuration the builder reads.

The command line only parses flags into these objects; ``edgepath serve`` turns its own configuration
into the command line of the slot server it starts with :meth:`SlotServerSettings.argv`, so the two
can never drift apart.

Names: a ``listen`` field is where a process *this* configuration starts listens; ``slot_server`` and
``agent`` are addresses of processes that already run.  ``transport`` is the client-facing protocol of
an edge (quic | tcp); ``data_path`` is the agent <-> slot-server link (loopback | verbs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgepath.dma.slot_config import DEFAULT_CAPACITY, DEFAULT_SLOTS, SlotServerConfig
from edgepath.dma.slot_config import SLOT_MEMORY as SLOT_MEMORY  # re-exported: the commands' choices
from edgepath.edge.quic_engine import DEFAULT_ENGINE as DEFAULT_QUIC_ENGINE
from edgepath.edge.quic_engine import ENGINES as QUIC_ENGINES

DATA_PATHS = ("loopback", "verbs")
EDGE_TRANSPORTS = ("quic", "tcp")


@dataclass(frozen=True)
class DataPath:
    """The agent <-> slot-server link: shared memory (``loopback``) or RDMA (``verbs``)."""

    kind: str = "loopback"
    device: str | None = None  # RDMA device for verbs (e.g. rxe0); None: the first one
    gid_index: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in DATA_PATHS:
            raise ValueError(f"data path must be one of {', '.join(DATA_PATHS)}, got {self.kind!r}")
        if self.kind != "verbs" and (self.device is not None or self.gid_index is not None):
            raise ValueError(f"--device and --gid-index are for --data-path verbs, not {self.kind}")

    def options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`edgepath.dma.registry.make_transport`."""
        return {k: v for k, v in (("device", self.device), ("gid_index", self.gid_index)) if v is not None}

    def flags(self) -> list[str]:
        """The same choice as command-line flags of ``edgepath slot-server``, ``agent`` or ``serve``."""
        flags = ["--data-path", self.kind]
        for flag, value in (("--device", self.device), ("--gid-index", self.gid_index)):
            if value is not None:
                flags += [flag, str(value)]
        return flags


@dataclass(frozen=True, kw_only=True)
class SlotServerSettings(SlotServerConfig):
    """An ``edgepath slot-server``: the slot server's own configuration (pool, loop; durations in seconds,
    :class:`~edgepath.dma.slot_config.SlotServerConfig`), and where it listens, which handler it runs and
    over which data path.  ``memory``: edgepath.dma.gpu.check_placement says which go with which data path."""

    listen: str
    handler: str = "echo"
    handler_options: tuple[tuple[str, str], ...] = ()  # --handler-option KEY=VALUE, in order
    data_path: DataPath = field(default_factory=DataPath)

    def __post_init__(self) -> None:
        super().__post_init__()
        from edgepath.dma.gpu import check_placement

        check_placement(self.data_path.kind, self.memory)

    def argv(self) -> list[str]:
        """``edgepath`` arguments that start exactly this slot server as its own process."""
        return [
            "slot-server",
            "--listen",
            self.listen,
            "--slots",
            f"{self.memory}:{self.slots}",
            "--input-capacity",
            str(self.input_capacity),
            "--output-capacity",
            str(self.output_capacity),
            "--lease",
            repr(self.lease),
            "--spin-us",
            _units(self.spin, 1e6),
            "--handler",
            self.handler,
            *(arg for key, value in self.handler_options for arg in ("--handler-option", f"{key}={value}")),
            "--handler-deadline",
            repr(self.handler_deadline),
            "--stream-window-ms",
            _units(self.stream_window, 1e3),
            *self.data_path.flags(),
        ]


def _units(seconds: float, per_second: float) -> str:
    """``seconds`` in a flag's unit (micro-, milliseconds), as short as it is exact to 12 digits."""
    return f"{seconds * per_second:.12g}"


@dataclass(frozen=True)
class AgentSettings:
    """An agent: frames edges write into, attached to slot servers over ``data_path``."""

    slot_servers: tuple[str, ...]
    frames: int = 1024
    input_capacity: int = DEFAULT_CAPACITY
    output_capacity: int = DEFAULT_CAPACITY
    data_path: DataPath = field(default_factory=DataPath)


@dataclass(frozen=True)
class AgentServiceSettings:
    """An ``edgepath agent`` process: an agent that serves edges over shared memory at ``listen``."""

    listen: str
    agent: AgentSettings
    frames_per_edge: int = 256
    spin_us: float = 0.0


@dataclass
class ServeOptions:
    """``edgepath serve``: an edge, an agent (in-process, or the process at ``agent``) and a slot
    server (started as a child process and supervised, unless ``slot_server`` names a running one)."""

    transport: str = "quic"  # the client-facing protocol: quic (HTTP/3) | tcp (HTTP/1.1)
    host: str = "127.0.0.1"
    port: int = 4433
    slot_server: str | None = None  # address of a running slot server; None: start one
    agent: str | None = None  # address of a running `edgepath agent`; None: an in-process agent
    data_path: str = "loopback"  # the agent <-> slot-server link: loopback | verbs
    device: str | None = None  # RDMA device for data_path verbs (e.g. rxe0)
    gid_index: int | None = None
    slot_server_listen: str | None = None  # where the started slot server listens (verbs: IP:PORT)
    slots: int = DEFAULT_SLOTS
    frames: int = 256
    input_capacity: int = DEFAULT_CAPACITY
    output_capacity: int = DEFAULT_CAPACITY
    max_body: int = 1 << 20
    tokenizer: str | None = None
    served_model_name: str | None = None  # the model id of the OpenAI routes (default: derived, see builder)
    chat_template: str | None = None  # a template file replacing the GGUF's own (chat completions)
    certificate: str | None = None
    private_key: str | None = None
    handler: str = "echo"
    handler_options: tuple[tuple[str, str], ...] = ()  # the started slot server's --handler-option KEY=VALUE
    slot_spin_us: float = 0.0  # the started slot server spins this long on its queue before sleeping
    request_timeout: float = 60.0  # seconds a dispatched request may wait for its result (then 504)
    body_timeout: float = 5.0  # seconds a request may take to arrive complete (then 408)
    quic_retry: bool = False  # QUIC address validation (Retry) before any connection state is kept
    api_keys_file: str | None = None  # one key per line; with $EDGEPATH_API_KEYS, enables x-api-key checks
    protect_ops: bool = False  # /health and /metrics need a key too
    handler_deadline: float = 0.0  # the started slot server's --handler-deadline (0: none)
    max_restarts: int = 5  # a started child may die this often within restart_window ...
    restart_window: float = 60.0  # ... seconds before serve gives up (exit 1)
    workers: int = 1  # > 1: that many edge processes (each with its own agent) share the port
    reuse_port: bool = False  # bind with SO_REUSEPORT: this edge is one of several workers on the port
    quic_engine: str = DEFAULT_QUIC_ENGINE  # transport quic: aioquic (the reference) or qh3 (the [qh3] extra)

    def __post_init__(self) -> None:
        if self.transport not in EDGE_TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(EDGE_TRANSPORTS)}, got {self.transport!r}")
        if self.quic_engine not in QUIC_ENGINES:
            raise ValueError(f"quic_engine must be one of {', '.join(QUIC_ENGINES)}, got {self.quic_engine!r}")
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.workers > 1 and self.agent is not None:
            raise ValueError("--workers N gives every worker its own in-process agent: not with --agent")

    @property
    def link(self) -> DataPath:
        """The agent <-> slot-server link as one value."""
        return DataPath(self.data_path, self.device, self.gid_index)

    def agent_settings(self, slot_server: str) -> AgentSettings:
        return AgentSettings(
            slot_servers=(slot_server,),
            frames=self.frames,
            input_capacity=self.input_capacity,
            output_capacity=self.output_capacity,
            data_path=self.link,
        )

    def worker_argv(self, slot_server: str) -> list[str]:
        """``edgepath`` arguments of one edge worker: this edge, on the shared port (SO_REUSEPORT), with
        its own agent attached to the shared ``slot_server``."""
        argv = [
            "serve",
            "--transport",
            self.transport,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--reuse-port",
            "--quic-engine",
            self.quic_engine,
            "--slot-server",
            slot_server,
            *self.link.flags(),
            "--frames",
            str(self.frames),
            "--input-capacity",
            str(self.input_capacity),
            "--output-capacity",
            str(self.output_capacity),
            "--max-body",
            str(self.max_body),
            "--request-timeout",
            repr(self.request_timeout),
            "--body-timeout",
            repr(self.body_timeout),
            "--handler",  # what the shared slot server runs decides the worker's tokenizer and limits
            self.handler,
        ]
        for key, option in self.handler_options:
            argv += ["--handler-option", f"{key}={option}"]
        optional: tuple[tuple[str, str | None], ...] = (
            ("--tokenizer", self.tokenizer),
            ("--served-model-name", self.served_model_name),
            ("--chat-template", self.chat_template),
            ("--certificate", self.certificate),
            ("--private-key", self.private_key),
            ("--api-keys-file", self.api_keys_file),
        )
        for flag, value in optional:
            if value is not None:
                argv += [flag, value]
        flags = [flag for flag, on in (("--protect-ops", self.protect_ops), ("--quic-retry", self.quic_retry)) if on]
        return argv + flags

    def slot_server_settings(self, listen: str) -> SlotServerSettings:
        """The slot server ``serve`` starts, listening at ``listen``."""
        return SlotServerSettings(
            listen=listen,
            slots=self.slots,
            input_capacity=self.input_capacity,
            output_capacity=self.output_capacity,
            spin=self.slot_spin_us / 1e6,
            handler=self.handler,
            handler_options=self.handler_options,
            handler_deadline=self.handler_deadline,
            data_path=self.link,
        )
