"""Building edgepath's parts from :mod:`edgepath.config`: the one place that wires them together.

The command line (``edgepath.cli``), ``edgepath serve`` and the demo call these; none of them knows
which regions an agent shares with whom or how a transport is chosen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING

from edgepath.config import AgentServiceSettings, AgentSettings, DataPath, ServeOptions, SlotServerSettings

if TYPE_CHECKING:
    from edgepath.dma.slot_server import SlotServer
    from edgepath.dma.transport import Transport
    from edgepath.dpu.agent import Agent
    from edgepath.dpu.agent_service import AgentService
    from edgepath.dpu.port import AgentPort
    from edgepath.edge.auth import ApiKeys
    from edgepath.edge.service import EdgeService
    from edgepath.edge.tokenizer import Tokenizer

log = logging.getLogger("edgepath")


def data_path_transport(data_path: DataPath) -> Transport:
    """A transport endpoint for the agent <-> slot-server link; when it cannot be had, an error that
    names the flags that chose it."""
    from edgepath.dma.registry import make_transport
    from edgepath.dma.transport import TransportUnavailable

    try:
        return make_transport(data_path.kind, **data_path.options())
    except TransportUnavailable as exc:
        raise TransportUnavailable(f"{' '.join(data_path.flags())}: {exc}") from exc


def build_slot_server(settings: SlotServerSettings) -> SlotServer:
    """A slot server listening at ``settings.listen``, not yet serving (call ``serve()``)."""
    from edgepath.dma.slot_server import SlotServer, handler_config
    from edgepath.handlers import load_handler

    if settings.memory in ("gpu", "gpu-device"):
        from edgepath.dma.gpu import require_device

        require_device(settings.gpu_device, flag=f"--slots {settings.memory}")  # at once, before any transport
    handler = load_handler(settings.handler, handler_config(settings, dict(settings.handler_options)))
    server = SlotServer(data_path_transport(settings.data_path), settings.listen, handler, settings)
    log.info(
        "slot server on %s (%s): %d slots in %s memory, %d/%d tokens in/out, handler %s",
        settings.listen,
        settings.data_path.kind,
        settings.slots,
        settings.memory,
        settings.input_capacity,
        settings.output_capacity,
        settings.handler,
    )
    return server


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


def build_agent(settings: AgentSettings, transport: Transport, flags: Mapping[str, str] | None = None) -> Agent:
    """An in-process agent on ``transport`` (made by :func:`data_path_transport` first, so a bad device
    is reported before anything else starts), attached to its slot servers (``flags``: see
    :func:`attach_all`); the caller closes ``transport``."""
    from edgepath.dpu.agent import Agent

    agent = Agent(
        transport,
        frames=settings.frames,
        input_capacity=settings.input_capacity,
        output_capacity=settings.output_capacity,
        hang_timeout=settings.hang_timeout,
        max_wait=settings.max_wait,
        migration_limit=settings.migration_limit,
    )
    attach_all(agent, settings.slot_servers, flags)
    return agent


def build_agent_service(settings: AgentServiceSettings) -> AgentService:
    """An agent that serves edges over shared memory at ``settings.listen``, attached to its slot servers.

    Edges always reach the agent through shared memory.  Over a loopback data path the agent's own
    request frames are exported to edges (never to slot servers, which see only the replies region);
    over verbs the requests and replies live in shared memory that edges map, and the same pages are
    registered with the NIC, so the edge's one write of the tokens is what is sent and results land
    where the edge reads them."""
    from edgepath.dma.loopback import LoopbackTransport
    from edgepath.dma.transport import Access
    from edgepath.dpu.agent import Agent
    from edgepath.dpu.agent_service import AgentService, edge_regions

    spec = settings.agent
    edge_transport = LoopbackTransport()
    made: list[Transport] = [edge_transport]
    try:
        if spec.data_path.kind == "loopback":
            edge_frames = None
            agent = Agent(
                edge_transport,
                frames=spec.frames,
                input_capacity=spec.input_capacity,
                output_capacity=spec.output_capacity,
                frames_access=Access.REMOTE_WRITE,
                hang_timeout=spec.hang_timeout,
                max_wait=spec.max_wait,
                migration_limit=spec.migration_limit,
            )
        else:
            edge_frames = edge_regions(edge_transport, spec.frames, spec.input_capacity, spec.output_capacity)
            made.append(data_path_transport(spec.data_path))
            agent = Agent(
                made[-1],
                frames=spec.frames,
                input_capacity=spec.input_capacity,
                output_capacity=spec.output_capacity,
                frames_buffer=edge_frames[0].buf,
                replies_buffer=edge_frames[1].buf,
                hang_timeout=spec.hang_timeout,
                max_wait=spec.max_wait,
                migration_limit=spec.migration_limit,
            )
        attach_all(agent, spec.slot_servers)
        return AgentService(
            agent,
            edge_transport,
            settings.listen,
            frames_per_edge=settings.frames_per_edge,
            spin=settings.spin_us / 1e6,
            edge_frames=edge_frames,
        )
    except BaseException:
        for transport in reversed(made):
            transport.close()
        raise


def build_edge(
    options: ServeOptions,
    tokenizer: Tokenizer,
    agent: AgentPort,
    keys: ApiKeys | None,
    loop: asyncio.AbstractEventLoop,
    executor: Executor,
    supervision: Callable[[], tuple[int, int] | None] | None = None,
) -> EdgeService:
    """The edge service of ``serve``: HTTP core with limits no larger than the slot server's, API keys
    (None: no authentication), tokenizer and agent (not started: call ``start()``); ``supervision``: the
    supervised slot server's (restarts, hangs), for /metrics."""
    import time

    from edgepath.edge.http import CHAT, COMPLETIONS, HttpCore, Limits
    from edgepath.edge.lifecycle import DEFAULT_FORMATTERS
    from edgepath.edge.openai_routes import OpenAIRoutes, chat_support, formatter_factory
    from edgepath.edge.service import TOKENIZER_WORKERS, EdgeService

    upstream = agent.capacity()
    limits = Limits(
        max_body=options.max_body,
        input_capacity=min(options.input_capacity, upstream.input_capacity),
        output_capacity=min(options.output_capacity, upstream.output_capacity),
        vocab_size=tokenizer.vocab_size,
        max_wait_ms=round(options.max_wait * 1e3),
    )
    openai = OpenAIRoutes(
        served_model_name(options, tokenizer),
        limits.output_capacity,
        tokenizer.vocab_size,
        chat_support(tokenizer),
        int(time.time()),
    )
    openai_format = formatter_factory(time.time)
    return EdgeService(
        HttpCore(limits, keys, openai),
        tokenizer,
        agent,
        loop,
        executor,
        workers=TOKENIZER_WORKERS,
        request_timeout=options.request_timeout,
        body_timeout=options.body_timeout,
        formatters={**DEFAULT_FORMATTERS, COMPLETIONS: openai_format, CHAT: openai_format},
        supervision=supervision,
    )


def served_model_name(options: ServeOptions, tokenizer: Tokenizer) -> str:
    """The model id the OpenAI routes answer to: ``--served-model-name``, else the GGUF's file stem (or the
    tokenizer's name when no model is served)."""
    if options.served_model_name:
        return options.served_model_name
    path = getattr(tokenizer, "path", None)
    return Path(path).stem if path else tokenizer.name
