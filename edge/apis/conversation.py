"""A chat as the model sees it, and the work item that runs it, for every API shape that speaks in turns.

OpenAI's chat completions, Anthropic's Messages and OpenAI's Responses each read their own fields into the same
things -- turns (:class:`~edgepath.edge.text.chat.ChatMessage`, or :class:`~edgepath.edge.apis.tools.ToolTurn` for
calls and their results), the tools offered (:class:`~edgepath.edge.apis.tools.ToolSpec`), a ``response_format``'s
grammar -- and from there on one path: :func:`conversation` makes the turns the chat template renders (the tools in
the template's own way, or the fallback prompt) and the calls' grammar when they are enforced, and :func:`chat_work`
the :class:`~edgepath.edge.http.Work` item the lifecycle tokenizes with the model's template, admits and submits.
So every shape gets the same tokenizer, template, tools rendering, grammars, admission, quotas and usage log.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from edgepath.contract import wire
from edgepath.contract.wire import Sampling
from edgepath.edge.apis import tools as tool_calling
from edgepath.edge.apis.tools import ToolFormat, ToolSpec, ToolTurn
from edgepath.edge.http import ApiError, Grammar, HttpError, Response, Work
from edgepath.edge.text.chat import ChatMessage
from edgepath.edge.text.thinking import ThinkingModes

Turn = ChatMessage | ToolTurn


@dataclass(frozen=True, slots=True)
class ChatLimits:
    """What a chat request may ask for on this server (Anthropic's Messages and OpenAI's Responses alike)."""

    max_tokens: int
    models: tuple[str, ...]
    grammars: bool = False
    tool_format: ToolFormat = "fallback"
    thinking: ThinkingModes = field(default_factory=ThinkingModes)
    """How the chat template's model thinks, with thinking on and off (:mod:`edgepath.edge.text.thinking`)."""


class ChatRoutes(ABC):
    """The routes of one chat shape for one served model (an :class:`~edgepath.edge.routes.ApiShape`): a body parsed
    into the one chat :class:`Work` item, or refused in the shape's own error (:attr:`errors`); the shape says how
    its body is parsed (:meth:`parse`) and what it answers when the model side has no chat template."""

    #: the shape's own error, which its parser raises and its routes answer in
    errors: ClassVar[type[ApiError]]

    def __init__(self, limits: ChatLimits, chat_available: bool, why_not: str = "") -> None:
        self.limits = limits
        self.chat_available = chat_available
        self.why_not = why_not

    @abstractmethod
    def error(self, exc: HttpError) -> Response: ...

    @abstractmethod
    def unavailable(self) -> ApiError:
        """The error of every request when the model side has no chat template (:attr:`why_not` says why)."""

    @abstractmethod
    def parse(self, path: str, body: bytes) -> Work:
        """``body`` sent to ``path`` as the chat's work item; raises :attr:`errors`."""

    def handle(self, path: str, method: str, body: bytes) -> Work | Response:
        try:
            if not self.chat_available:
                raise self.unavailable()
            return self.parse(path, body)
        except self.errors as err:
            return err.response()


class NoGrammar(ValueError):
    """The tools must be called (a grammar enforces it), and this model side enforces no grammar."""


@dataclass(frozen=True, slots=True)
class Conversation:
    """The turns the template renders, the tools offered, the grammar of their calls when enforced, and the tools
    the template renders itself (None with the fallback prompt or no tools)."""

    messages: tuple[Turn, ...]
    tools: ToolSpec | None
    constraint: Grammar | None
    template_tools: tuple[Mapping[str, Any], ...] | None


def conversation(turns: Sequence[Turn], spec: ToolSpec | None, fmt: ToolFormat, grammars: bool) -> Conversation:
    """``turns`` and the tools of ``spec`` as the model is offered them in ``fmt``: with the fallback
    (:mod:`edgepath.edge.apis.tools`), the tools offered by its prompt and earlier calls and results as text; with a
    template that has tools, the turns as they are and the tools for it.  ToolsRefused names a result that answers
    no call; FormatRefused a tool schema that cannot be enforced; :class:`NoGrammar` a call that must be made on a
    model side without grammars."""
    if fmt == "fallback":
        messages: tuple[Turn, ...] = tool_calling.flatten(turns)
    else:
        tool_calling.call_names(turns)
        messages = tuple(turns)
    if spec is None:
        return Conversation(messages, None, None, None)
    constraint = None
    if spec.constrained:
        if not grammars:
            raise NoGrammar("this model side enforces no grammar")
        constraint = tool_calling.grammar(spec)
    if spec.format == "fallback":
        plain = tuple(m for m in messages if isinstance(m, ChatMessage))
        return Conversation(tool_calling.offer(plain, spec), spec, constraint, None)
    return Conversation(messages, spec, constraint, tool_calling.template_tools(spec))


def chat_work(
    route: str,
    chat: Conversation,
    grammar: Grammar | None,
    *,
    max_tokens: int,
    stream: bool,
    sampling: Sampling,
    options: dict[str, Any],
    thinking: bool = True,
) -> Work:
    """The work item of a chat on ``route``: its turns and tools for the template, ``grammar`` (a
    ``response_format``'s or the calls'), built later off the event loop (edge/grammars.py), and the sampling's logit
    biases encoded for the slot, after the prompt (after the grammar's words once they are built); ``options`` is what
    the route's formatter needs; ``thinking`` false renders the template with ``enable_thinking`` false (the request
    turned the model's thinking off).  wire.RequestInvalid when the biases cannot travel."""
    options = {**options, "messages": list(tool_calling.template_messages(chat.messages))}
    if not thinking:
        options["enable_thinking"] = False
    if chat.template_tools is not None:
        options["tools"] = list(chat.template_tools)
    encoded = wire.after_prompt(None, sampling.logit_bias) if grammar is None else None
    return Work(
        "generate", None, None, max_tokens, stream, sampling, route, options, grammar=grammar, constraint=encoded
    )
