"""Building the edge from its settings: the tokenizer and its chat template, the service and its listeners, TLS,
the API keys and tenants' limits (again at SIGHUP), the usage log, and its graceful stop.  The app layer's one
place that wires an edge; ``serve`` (:mod:`edgepath.serve`) asks it for the edge when its turn comes, and the slot
servers, agents and the quota ledger the edge talks to are :mod:`edgepath.builder`'s."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from edgepath.builder import ServePlan, cannot_listen, shared_quotas
from edgepath.config import Capacity, EdgeSettings, ServeOptions
from edgepath.options import split_host_port

if TYPE_CHECKING:
    from aioquic.asyncio.server import QuicServer

    from edgepath.dpu.port import AgentPort
    from edgepath.edge.adapters.tls import TlsFiles
    from edgepath.edge.routes import ApiShape, HttpCore
    from edgepath.edge.service import EdgeService
    from edgepath.edge.tenancy.auth import ApiKeys
    from edgepath.edge.tenancy.gate import TenantGate
    from edgepath.edge.tenancy.usage import UsageLog
    from edgepath.edge.text.tokenizer import Tokenizer

log = logging.getLogger("edgepath")


def with_one_certificate(options: ServeOptions) -> ServeOptions:
    """``options`` naming the TLS files every edge worker uses: the given ones, or one self-signed pair made
    here once."""
    tls = serve_tls(options.edge)
    if tls is None:
        return options
    return replace(
        options, edge=replace(options.edge, certificate=str(tls.certificate), private_key=str(tls.private_key))
    )


async def start_edge(
    plan: ServePlan,
    agent: AgentPort,
    loop: asyncio.AbstractEventLoop,
    cleanup: contextlib.ExitStack,
    supervision: Callable[[], tuple[int, int] | None] | None,
) -> Callable[[], Awaitable[None]]:
    """The edge in this process: tokenizer, service, listener; ``cleanup`` stops them in reverse.
    ``supervision``: the supervised slot server's (restarts, hangs) for /metrics (None: serve supervises none).
    Returns the edge's graceful stop (:func:`drain_edge`), to await before ``cleanup``."""
    from edgepath.edge.service import TOKENIZER_WORKERS, lower_priority
    from edgepath.edge.text.tokenizer import load_tokenizer

    edge = plan.options.edge
    tokenizer = load_tokenizer(edge.tokenizer)
    if edge.chat_template is not None:
        use_chat_template(tokenizer, edge.chat_template)
    log.info("tokenizer %s (%d ids)", tokenizer.name, tokenizer.vocab_size)
    executor = ThreadPoolExecutor(TOKENIZER_WORKERS, thread_name_prefix="tokenize", initializer=lower_priority)
    cleanup.callback(executor.shutdown, wait=False, cancel_futures=True)
    options = plan.options
    from edgepath.edge.tenancy.gate import TenantGate

    usage = None
    if edge.usage_log is not None:
        from edgepath.edge.tenancy.usage import UsageLog

        usage = UsageLog(edge.usage_log, edge.usage_fsync, edge.usage_fsync_interval)
        cleanup.callback(usage.close)
    quotas = shared_quotas(edge.quota_home, options, cleanup) if edge.quota_home is not None else None
    service = build_edge(
        edge,
        options.sizes.capacity,
        tokenizer,
        agent,
        plan.keys,
        loop,
        executor,
        supervision,
        model_side=options.handler.name == "llama",
        gate=TenantGate(quotas, usage),
        fingerprint=serve_fingerprint(options),
    )
    give_limits(plan.keys, agent)
    service.start()
    cleanup.callback(service.stop)

    def reload() -> None:  # SIGHUP
        reload_keys(edge, service.core, agent)
        reopen_usage_log(usage)

    if on_sighup(loop, reload):
        cleanup.callback(loop.remove_signal_handler, signal.SIGHUP)
    try:
        server = await _listen(edge, service, serve_tls(edge))
    except OSError as exc:
        raise cannot_listen(edge, exc) from exc
    cleanup.callback(server.close)
    if edge.ops_listen is not None:  # open until the end: probes and scrapes see the drain
        from edgepath.edge.adapters.ops import serve_ops

        host, port = split_host_port(edge.ops_listen)
        ops = await serve_ops(service, host, port, reuse_port=edge.reuse_port)
        cleanup.callback(ops.close)
        log.info("ops listener (/metrics, /health, probes; HTTP/1.1) on %s", edge.ops_listen)
    # What is loaded by now (modules, the tokenizer, templates, routes) lives as long as the edge: out of the
    # collector's sight, a full collection walks only what requests made.  Every closed asyncio socket transport is
    # cyclic garbage (it holds its own bound read callback), so a flood of connections held open for seconds
    # (issue 49's: refused bodies paced by their tenant's budget) made full collections frequent, each walking the
    # whole heap: 50-100 ms with the loop stopped, the edge's worst stall in the flood.
    gc.freeze()
    return lambda: drain_edge(service, server, edge.grace_period)


async def drain_edge(service: EdgeService, server: asyncio.Server | QuicServer, grace: float) -> None:
    """Stop gracefully: take no new requests -- over TCP no new connections; over QUIC, whose one socket
    carries the streams under way, new requests get 503 ``draining`` -- and return once every request under
    way is answered (its stream ended) or after ``grace`` seconds.  /health/ready answers 503 meanwhile, so a
    load balancer sends nothing more here."""
    service.drain()
    if isinstance(server, asyncio.Server):
        server.close()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    pending = service.pending
    log.info("draining: %d requests under way, grace period %g s", pending, grace)
    while service.pending and loop.time() < deadline:
        await asyncio.sleep(0.02)
    log.info("drained: %d requests left unanswered", service.pending)


def reload_keys(edge: EdgeSettings, core: HttpCore, agent: AgentPort | None = None) -> bool:
    """SIGHUP: read the API keys and the tenants file again and serve new requests with them (and give ``agent``
    their slot floors); streams in flight keep the tenant they were admitted as.  A file that cannot be used is
    one error line, and the keys in use are kept."""
    from edgepath.edge.tenancy.auth import load_keys

    try:
        keys = load_keys(edge.api_keys_file, edge.protect_ops, tenants_file=edge.tenants_file)
    except ValueError as exc:
        log.error("SIGHUP: %s; keeping the %s in use", exc, "tenants" if core.api_keys is not None else "no keys")
        return False
    core.api_keys = keys
    log.info("SIGHUP: %s", f"{len(keys.tenants)} tenant(s) reloaded" if keys is not None else "no API keys")
    if agent is not None:
        give_limits(keys, agent)
    return True


def reopen_usage_log(usage: UsageLog | None) -> None:
    """SIGHUP: the usage log opened again at its path (log rotation renamed it); one that cannot be opened is one
    error line, and the file in use is kept."""
    if usage is None:
        return
    try:
        usage.reopen()
    except ValueError as exc:
        log.error("SIGHUP: %s; keeping the usage log file in use", exc)
        return
    log.info("SIGHUP: usage log %s reopened", usage.path)


def give_limits(keys: ApiKeys | None, agent: AgentPort) -> None:
    """The tenants' slot floors and caps to the edge's agent, by their ids in the state words (docs/TENANTS.md): an
    agent in this process takes lent slots back and counts caps by them (an agent process learns each tenant's from
    its requests' headers).  Floors that add up to more than the slots attached cannot all be had at once: said once
    per start or reload."""
    from edgepath.dpu.port import SlotLimits

    tenants = keys.tenants if keys is not None else []
    limits = {t.floor_id: SlotLimits(t.slot_floor, t.slot_cap) for t in tenants if t.floor_id}
    agent.set_limits(limits)
    floors = sum(limit.floor for limit in limits.values())
    slots = sum(server.total_slots or 0 for server in agent.servers())
    if floors and slots and floors > slots:
        log.warning(
            "the tenants' slot floors add up to %d, more than the %d slots of the slot servers attached: a tenant "
            "under its floor is refused (429 no_slot) when every slot is held by tenants within their floors",
            floors,
            slots,
        )


def on_sighup(loop: asyncio.AbstractEventLoop, callback: Callable[[], object]) -> bool:
    """Call ``callback`` on SIGHUP (False where signals cannot be had: not the main thread, as in tests that run
    ``serve`` on a thread of their own)."""
    try:
        loop.add_signal_handler(signal.SIGHUP, callback)
    except (ValueError, RuntimeError, NotImplementedError):
        return False
    return True


def serve_tls(edge: EdgeSettings) -> TlsFiles | None:
    """The edge's TLS files (QUIC only): the given ones, or the self-signed pair (made when missing)."""
    from edgepath.edge.adapters.tls import resolve

    return resolve(edge.certificate, edge.private_key) if edge.transport == "quic" else None


async def _listen(edge: EdgeSettings, service: EdgeService, tls: TlsFiles | None) -> asyncio.Server | QuicServer:
    if tls is None:
        from edgepath.edge.adapters.tcp import serve_tcp

        return await serve_tcp(service, edge.host, edge.port, reuse_port=edge.reuse_port)
    from edgepath.edge.adapters.quic import serve_quic, server_configuration

    configuration = server_configuration(
        str(tls.certificate), str(tls.private_key), edge.quic_engine, idle_timeout=edge.idle_timeout
    )
    return await serve_quic(
        service,
        edge.host,
        edge.port,
        configuration,
        reuse_port=edge.reuse_port,
        retry=edge.quic_retry,
        engine=edge.quic_engine,
    )


def use_chat_template(tokenizer: Tokenizer, path: str) -> None:
    """``--chat-template FILE`` replaces the model's own template; chats are tokenized with the template's
    markers as control tokens, which only the GGUF tokenizer can do (checked here, before serving)."""
    from edgepath.edge.text.chat import load_chat_template

    set_template = getattr(tokenizer, "set_chat_template", None)
    if set_template is None:
        raise ValueError(
            f"--chat-template: {tokenizer.name} cannot tokenize a chat template's control tokens; "
            "use it with a GGUF tokenizer (--model or --tokenizer PATH.gguf)"
        )
    set_template(load_chat_template(path).source)


def build_edge(
    edge: EdgeSettings,
    capacity: Capacity,
    tokenizer: Tokenizer,
    agent: AgentPort,
    keys: ApiKeys | None,
    loop: asyncio.AbstractEventLoop,
    executor: Executor,
    supervision: Callable[[], tuple[int, int] | None] | None = None,
    model_side: bool = False,
    gate: TenantGate | None = None,
    fingerprint: str | None = None,
) -> EdgeService:
    """The edge service of ``serve``: HTTP core with limits no larger than ``capacity`` and the agent's slot
    servers', API keys (None: no authentication), tokenizer and agent (not started: call ``start()``; the bound
    on waiting is the agent's alone: the edge only passes on what a request asks); ``supervision``:
    the supervised slot server's (restarts, hangs), for /metrics; ``model_side``: whether the model side computes
    log probabilities and enforces grammars (the llama handler); ``fingerprint``: the OpenAI answers'
    ``system_fingerprint`` (:func:`serve_fingerprint`)."""
    from edgepath.edge.apis import anthropic_answers, responses_answers
    from edgepath.edge.apis.conversation import ChatLimits
    from edgepath.edge.apis.generate import GenerateFormatter
    from edgepath.edge.apis.llama_utils import LlamaUtilRoutes, has_vocabulary
    from edgepath.edge.apis.openai_routes import OpenAIRoutes, chat_support, formatter_factory
    from edgepath.edge.apis.tools import TOOL_FORMATS
    from edgepath.edge.connections import ConnectionLimits
    from edgepath.edge.http import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES, Limits
    from edgepath.edge.overload import read_memory
    from edgepath.edge.routes import HttpCore
    from edgepath.edge.service import TOKENIZER_WORKERS, EdgeService

    upstream = agent.capacity()
    limits = Limits(
        max_body=edge.max_body,
        input_capacity=min(capacity.input_capacity, upstream.input_capacity),
        output_capacity=min(capacity.output_capacity, upstream.output_capacity),
        vocab_size=tokenizer.vocab_size,
    )
    chat = chat_support(tokenizer)
    if chat.available:
        log.info("tool calling: %s", TOOL_FORMATS[chat.tool_format])
    model = served_model_name(edge, tokenizer)
    openai = OpenAIRoutes(
        model,
        limits.output_capacity,
        tokenizer.vocab_size,
        chat,
        int(time.time()),
        logprobs=model_side,
        grammars=model_side,
        choices=most_choices(agent),
        fingerprint=fingerprint,
    )
    openai_format = formatter_factory(time.time)
    # the other shapes of a chat: the same template, tools, grammars and thinking as the chat route's
    cap, tools, thinking = limits.output_capacity, chat.tool_format, chat.thinking
    anthropic = anthropic_answers.AnthropicRoutes(
        ChatLimits(cap, (model,), model_side, tools, thinking), chat.available, chat.why_not
    )
    responses = responses_answers.ResponsesRoutes(
        ChatLimits(cap, (model,), model_side, tools, thinking), chat.available, chat.why_not
    )
    if chat.thinking.on is not None:
        switch = "a request may turn it off" if chat.thinking.switch else "its template has no switch to turn it off"
        log.info("thinking: the chat template's model thinks in <think> blocks (split from its answers; %s)", switch)
    shapes: dict[str, ApiShape] = {"anthropic": anthropic, "responses": responses}
    if has_vocabulary(tokenizer):  # llama-server's /tokenize and /detokenize need the model's own vocabulary
        shapes["llama"] = LlamaUtilRoutes(tokenizer)
    return EdgeService(
        HttpCore(limits, keys, openai, shapes=shapes, ops_listener=edge.ops_listen),
        tokenizer,
        agent,
        loop,
        executor,
        workers=TOKENIZER_WORKERS,
        request_timeout=edge.request_timeout,
        body_timeout=edge.body_timeout,
        connections=ConnectionLimits(edge.max_connections, edge.max_connections_per_address, edge.idle_timeout),
        memory=functools.partial(read_memory, edge.memory_limit),
        memory_high_water=edge.memory_high_water,
        body_rate=edge.body_rate,
        formatters={
            GENERATE: lambda work, tok: GenerateFormatter(tok.decode, model),  # the usage log names the model
            COMPLETIONS: openai_format,
            CHAT: openai_format,
            MESSAGES: anthropic_answers.formatter_factory(),
            RESPONSES: responses_answers.formatter_factory(time.time),
        },
        supervision=supervision,
        gate=gate,
    )


def serve_fingerprint(options: ServeOptions) -> str | None:
    """The ``system_fingerprint`` of what ``serve`` runs: its model file, llama.cpp build and handler options
    (:mod:`edgepath.model.fingerprint`); None without a model (the echo handler)."""
    if options.handler.name != "llama" or options.model is None:
        return None
    from edgepath.model.fingerprint import system_fingerprint

    return system_fingerprint(Path(options.model), options.handler.options)


def most_choices(agent: AgentPort) -> int:
    """The most choices (OpenAI's ``n``) one request may ask for: its n slots are claimed together on one slot
    server, so no more than the largest has (and frames to hold them).  Behind an agent process, which publishes
    only the sum of its servers' slots, that sum: a group larger than each of them is refused by the agent."""
    counts = [server.total_slots for server in agent.servers()]
    known = [count for count in counts if count is not None]
    slots = max(known) if known and len(known) == len(counts) else agent.free_slots()[1]
    return max(1, min(slots, agent.frames.count))


def served_model_name(edge: EdgeSettings, tokenizer: Tokenizer) -> str:
    """The model id the OpenAI routes answer to: ``--served-model-name``, else the GGUF's file stem (or the
    tokenizer's name when no model is served)."""
    if edge.served_model_name:
        return edge.served_model_name
    path = getattr(tokenizer, "path", None)
    return Path(path).stem if path else tokenizer.name
