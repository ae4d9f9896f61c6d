"""Anthropic's Messages API, sans I/O: ``POST /v1/messages`` and ``/v1/messages/count_tokens`` read into the one
chat path every shape shares (:mod:`edgepath.edge.apis.conversation`), and every error in Anthropic's shape.

Coding agents and the ``anthropic`` SDK speak this shape (Claude Code among them).  It follows the SDK's own types
(``anthropic.types.MessageCreateParams``, ``Message``, the ``RawMessageStreamEvent`` union).  As Anthropic's API
does, a field it does not know is a 400 naming it; a field that would change the answer in a way this server
cannot deliver (images, documents, server tools, a prefilled assistant turn) is a 400 naming it too.  The sampling
fields go through the one parser of every route (:mod:`edgepath.edge.apis.sampling`), with Anthropic's range for
``temperature`` (0..1) on top.

Errors: ``{"type": "error", "error": {"type", "message"}}``, the type following from the status (Anthropic's
table); a request refused because no slot could be had now (``no_slot``, ``over_bound``, ``tokenizer_busy``) is
529 ``overloaded_error`` -- what Anthropic answers when it is overloaded --, one refused by its tenant's limits
(``quota_exceeded``, ``slot_cap``) 429 ``rate_limit_error``; both with ``retry-after``, which the SDK honours.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from edgepath.contract.wire import Sampling
from edgepath.edge.apis import tools as tool_calling
from edgepath.edge.apis.conversation import ChatLimits, Conversation, NoGrammar, Turn, conversation
from edgepath.edge.apis.limits import TOOLS_MAX, LimitExceeded, check_messages
from edgepath.edge.apis.sampling import SamplingInvalid, parse_cache_salt, parse_sampling, parse_stops, show
from edgepath.edge.apis.structured import FormatRefused, schema_grammar
from edgepath.edge.apis.tools import Tool, ToolCall, ToolFormat, ToolSpec, ToolsRefused, ToolTurn
from edgepath.edge.http import ApiError, Grammar, Headers, HttpError, json_object, json_type
from edgepath.edge.text.chat import ChatMessage
from edgepath.edge.text.thinking import Thinking, ThinkingFixed, ThinkingModes

#: Anthropic's error ``type`` for each status this server answers with
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
#: refusals that mean no slot could be had now, for anyone: Anthropic's 529 (overloaded), not a rate limit
OVERLOADED = frozenset({"no_slot", "over_bound", "tokenizer_busy"})
#: Anthropic's ``temperature`` range (the shared parser allows OpenAI's 0..2)
TEMPERATURE_MAX = 1.0
#: most ``stop_sequences`` one request may give (each is matched on the text stream)
MAX_STOP_SEQUENCES = 16
ROLES = ("user", "assistant")
CREATE_FIELDS = frozenset(
    {"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
     "tools", "tool_choice", "metadata", "thinking", "service_tier", "output_config", "cache_salt"}
)  # fmt: skip
COUNT_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking", "cache_salt"})
EFFORTS = ("low", "medium", "high", "xhigh", "max")
TOOL_CHOICES = '{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": NAME} or {"type": "none"}'


class AnthropicError(ApiError):
    """An error answered in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""

    def __init__(self, status: int, message: str, *, headers: Headers | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = ERROR_TYPES.get(status, "api_error")
        self.headers: Headers = list(headers or [])

    @classmethod
    def of(cls, exc: HttpError) -> AnthropicError:
        """The edge's error ``exc`` in Anthropic's shape: a refusal for want of a slot is 529 (overloaded)."""
        status = 529 if exc.status == 429 and exc.type in OVERLOADED else exc.status
        return cls(status, f"{exc.message} ({exc.type})", headers=exc.headers)

    def payload(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.type, "message": self.message}}

    def body(self) -> bytes:
        return orjson.dumps(self.payload())

    def event(self) -> bytes:
        """The end of a stream that failed after it had started: Anthropic's ``error`` event."""
        return sse("error", self.payload())


def invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message)


def sse(event: str, payload: Mapping[str, Any]) -> bytes:
    """One server-sent event as Anthropic frames it: its type as the event's name, then its JSON."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


@dataclass(frozen=True, slots=True)
class MessagesRequest:
    """A validated ``/v1/messages`` (or ``count_tokens``) request: the chat as the model sees it and how to answer."""

    model: str
    chat: Conversation
    max_tokens: int = 1
    sampling: Sampling = field(default_factory=Sampling)
    stop: tuple[str, ...] = ()
    stream: bool = False
    cache_salt: str | None = None
    thinking: Thinking | None = None
    """How the answer's model thinks (None: it does not, or the request turned it off and the template has no block)."""
    enable_thinking: bool = True
    """False: ``thinking`` ``disabled``, the template rendered with ``enable_thinking`` false."""
    constraint: Grammar | None = None
    """The grammar the answer must match: ``output_config.format``'s, or the calls' when they are enforced (checked,
    built later off the event loop)."""


#: Anthropic's defaults: temperature 1, no top_p or top_k
DEFAULT = Sampling(temperature=1.0, top_p=1.0, top_k=0, seed=0)


def parse_messages(body: bytes | Mapping[str, Any], limits: ChatLimits, *, count: bool = False) -> MessagesRequest:
    """Validate a ``POST /v1/messages`` body (``count``: a ``count_tokens`` body, which has no ``max_tokens`` and no
    sampling); raises :class:`AnthropicError`."""
    doc = _document(body)
    known = COUNT_FIELDS if count else CREATE_FIELDS
    unknown = sorted(set(doc) - known)
    if unknown:
        raise invalid(f"{unknown[0]}: Extra inputs are not permitted (this server takes {', '.join(sorted(known))})")
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise invalid(f"model: must be a non-empty string naming a served model, got {show(model)}")
    if model not in limits.models:
        raise AnthropicError(
            404, f"model: {model!r} is not served here; available: {', '.join(map(repr, limits.models))}"
        )
    turns = (*_system(doc.get("system")), *_messages(doc.get("messages")))
    enabled = _thinking(doc.get("thinking"), None if count else doc.get("max_tokens"))
    thinking = _chosen(limits.thinking, enabled)
    try:
        spec = _tool_choice(doc.get("tool_choice"), _tools(doc.get("tools")), limits.tool_format)
        chat = conversation(turns, spec, limits.tool_format, limits.grammars)
    except (ToolsRefused, FormatRefused) as exc:
        raise invalid(f"{exc.param}: {exc.message}") from None
    except NoGrammar:
        raise invalid(
            'tool_choice: {"type": "any"} and {"type": "tool"} are not supported by this server (its model side '
            'enforces no grammar); allowed: {"type": "auto"} or {"type": "none"}'
        ) from None
    try:
        salt = parse_cache_salt(doc)
        if count:
            return MessagesRequest(model, chat, cache_salt=salt, thinking=thinking, enable_thinking=enabled)
        sampling = parse_sampling({k: doc[k] for k in ("temperature", "top_p", "top_k") if k in doc}, DEFAULT)
        stop = parse_stops(doc.get("stop_sequences"), "stop_sequences", MAX_STOP_SEQUENCES, single=False)
    except SamplingInvalid as exc:
        raise invalid(f"{exc.param}: {exc.message}") from None
    if sampling.temperature > TEMPERATURE_MAX:
        raise invalid(f"temperature: must be a number in [0, 1], got {show(doc['temperature'])}")
    _metadata(doc.get("metadata"))
    _service_tier(doc.get("service_tier"))
    shaped = _output_format(doc.get("output_config"), limits)
    if shaped is not None and chat.tools is not None:
        raise invalid(
            "output_config.format: cannot be combined with 'tools' (the answer may be tool calls); give "
            '"tool_choice": {"type": "none"} or drop one of them'
        )
    stream = doc.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise invalid(f"stream: must be true or false, got {show(stream)}")
    return MessagesRequest(
        model, chat, _max_tokens(doc.get("max_tokens"), limits.max_tokens), sampling, stop, bool(stream), salt,
        thinking, enabled, shaped or chat.constraint,
    )  # fmt: skip


def _document(body: bytes | Mapping[str, Any]) -> Mapping[str, Any]:
    return json_object(body, lambda problem, _: invalid(f"the request body {problem}"))


def _max_tokens(value: Any, cap: int) -> int:
    if value is None:
        raise invalid("max_tokens: Field required")
    if type(value) is not int or not 1 <= value <= cap:
        raise invalid(f"max_tokens: must be an integer in 1..{cap} (this server's most tokens per answer), got "
                      f"{show(value)}")  # fmt: skip
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(f"{where}: must be a string, got {show(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"{where}: holds an unpaired surrogate escape, which is not valid UTF-8") from None
    return value


def _system(system: Any) -> tuple[ChatMessage, ...]:
    """``system``: a string, or a list of text blocks (joined by newlines)."""
    if system is None:
        return ()
    if isinstance(system, str):
        return (ChatMessage("system", _text(system, "system")),)
    if not isinstance(system, list):
        raise invalid(f"system: must be a string or a list of text blocks, got {show(system)}")
    texts = [_text_block(block, f"system[{i}]") for i, block in enumerate(system)]
    return (ChatMessage("system", "\n".join(texts)),) if texts else ()


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise invalid(f'{where}: must be a text block {{"type": "text", "text": str}}, got {show(block)}')
    _block_fields(block, where, {"text"})
    return _text(block.get("text"), f"{where}.text")


def _block_fields(block: Mapping[str, Any], where: str, fields: set[str]) -> None:
    """A content block carries only its own fields (and ``cache_control``: every prefix is cached here anyway)."""
    extra = sorted(set(block) - fields - {"type", "cache_control", "citations"})
    if extra:
        raise invalid(f"{where}.{extra[0]}: Extra inputs are not permitted")


def _messages(raw: Any) -> list[Turn]:
    if not isinstance(raw, list) or not raw:
        raise invalid(f"messages: must be a non-empty list of {{role, content}} objects, got {show(raw)}")
    try:
        check_messages(len(raw))
    except LimitExceeded as exc:
        raise invalid(f"{exc.param}: {exc.message}") from None
    turns: list[Turn] = []
    made: set[str] = set()  # the ids of the calls made so far (a set kept as it grows: one pass, not one per turn)
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where}: must be an object with 'role' and 'content', got {json_type(message)}")
        _answers_a_call(made, message, where)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise invalid(f"{where}.{extra[0]}: Extra inputs are not permitted")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role: must be 'user' or 'assistant', got {show(role)}")
        content = message.get("content")
        if isinstance(content, str):
            turns.append(ChatMessage(role, _text(content, f"{where}.content")))
        elif isinstance(content, list):
            added = _user(content, where) if role == "user" else _assistant(content, where)
            made.update(c.id for t in added if isinstance(t, ToolTurn) for c in t.calls)
            turns += added
        else:
            raise invalid(f"{where}.content: must be a string or a list of content blocks, got {show(content)}")
    if isinstance(turns[-1], ChatMessage) and turns[-1].role == "assistant":
        raise invalid(
            f"messages[{len(raw) - 1}]: a last assistant turn (a prefill the answer continues) is not supported by "
            "this server; end with a user turn"
        )
    return turns


def _answers_a_call(made: set[str], message: Mapping[str, Any], where: str) -> None:
    """Each ``tool_result`` of ``message`` answers a ``tool_use`` of an earlier assistant turn (``made``: their ids;
    named in Anthropic's places; the shared check names the conversation's turns)."""
    content = message.get("content")
    if not isinstance(content, list):
        return
    for j, block in enumerate(content):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            call_id = block.get("tool_use_id")
            if isinstance(call_id, str) and call_id not in made:
                raise invalid(
                    f"{where}.content[{j}].tool_use_id: {call_id!r} answers no tool_use of an earlier assistant turn"
                )


def _user(blocks: list[Any], where: str) -> list[Turn]:
    """A user turn's blocks in order: runs of text as one user message, each ``tool_result`` a tool turn."""
    turns: list[Turn] = []
    texts: list[str] = []
    for block, at, kind in _typed(blocks, where):
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_result":
            if texts:
                turns.append(ChatMessage("user", "\n".join(texts)))
                texts = []
            turns.append(_tool_result(block, at))
        else:
            raise invalid(f"{at}: {_unsupported_block(block, ('text', 'tool_result'))}")
    if texts:
        turns.append(ChatMessage("user", "\n".join(texts)))
    return turns


def _tool_result(block: Mapping[str, Any], where: str) -> ToolTurn:
    _block_fields(block, where, {"tool_use_id", "content", "is_error"})
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.tool_use_id: must name the tool_use this result answers, got {show(call_id)}")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    text = _text(content, f"{where}.content")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid(f"{where}.is_error: must be true or false, got {show(is_error)}")
    return ToolTurn("tool", f"Error: {text}" if is_error else text, call_id=call_id)


def _assistant(blocks: list[Any], where: str) -> list[Turn]:
    """An assistant turn: its text, and its ``tool_use`` blocks as calls; its thinking blocks are not sent back to
    the model (the templates of thinking models drop earlier turns' thinking themselves)."""
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block, at, kind in _typed(blocks, where):
        if kind == "text":
            texts.append(_text_block(block, at))
        elif kind == "tool_use":
            _block_fields(block, at, {"id", "name", "input"})
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                raise invalid(f"{at}: a tool_use needs a non-empty 'id' and 'name', got {show(block)}")
            if not isinstance(arguments, dict):
                raise invalid(f"{at}.input: must be an object (the call's arguments), got {show(arguments)}")
            calls.append(ToolCall(call_id, name, json.dumps(arguments, ensure_ascii=False)))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        else:
            raise invalid(f"{at}: {_unsupported_block(block, ('text', 'tool_use', 'thinking', 'redacted_thinking'))}")
    text = "\n".join(texts)
    if calls:
        try:
            return [tool_calling.turn("assistant", text, {"tool_calls": [c.payload() for c in calls]}, where)]
        except ToolsRefused as exc:
            raise invalid(f"{exc.param}: {exc.message}") from None
    return [ChatMessage("assistant", text)]


def _typed(blocks: list[Any], where: str) -> Iterator[tuple[Any, str, Any]]:
    """Each of a turn's content ``blocks`` with its place (``where.content[j]``, for its errors) and its type (None:
    not an object)."""
    for j, block in enumerate(blocks):
        yield block, f"{where}.content[{j}]", block.get("type") if isinstance(block, dict) else None


def _unsupported_block(block: Any, allowed: Sequence[str]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if isinstance(kind, str):
        return f"content blocks of type {kind!r} are not supported by this server; allowed here: {', '.join(allowed)}"
    return f"must be a content block with a 'type' ({', '.join(allowed)}), got {show(block)}"


def _tools(raw: Any) -> tuple[Tool, ...]:
    listing = f"must be a list of at most {TOOLS_MAX} tools {{name, description?, input_schema}}"
    return tool_calling.tool_list(raw, listing, _tool)


def _tool(entry: Any, where: str, taken: Sequence[Tool]) -> Tool:
    """One of a Messages request's tools: a client tool ``{name, description?, input_schema}``."""
    if not isinstance(entry, dict):
        raise ToolsRefused(where, f"must be an object {{name, description?, input_schema}}, got {show(entry)}")
    kind = entry.get("type", "custom")
    if kind != "custom":
        raise ToolsRefused(
            f"{where}.type",
            f"tools of type {kind!r} (Anthropic's server tools) are not supported by this server; give client "
            "tools: {name, description?, input_schema}",
        )
    extra = sorted(set(entry) - {"type", "name", "description", "input_schema", "cache_control"})
    if extra:
        raise ToolsRefused(f"{where}.{extra[0]}", "Extra inputs are not permitted")
    if entry.get("input_schema") is None:
        raise ToolsRefused(f"{where}.input_schema", "Field required (the JSON schema of the tool's input)")
    return tool_calling.checked_tool(
        entry.get("name"), entry.get("description"), entry.get("input_schema"), where, taken, "input_schema"
    )


def _tool_choice(raw: Any, tools: tuple[Tool, ...], fmt: ToolFormat) -> ToolSpec | None:
    """``tool_choice`` over ``tools``: auto (the default), any (a call must be made), tool (that one), none."""
    if raw is None:
        return ToolSpec(tools, "auto", format=fmt) if tools else None
    if not isinstance(raw, dict) or raw.get("type") not in ("auto", "any", "tool", "none"):
        raise ToolsRefused("tool_choice", f"must be {TOOL_CHOICES}, got {show(raw)}")
    kind = raw["type"]
    extra = sorted(set(raw) - {"type", "name", "disable_parallel_tool_use"})
    if extra or ("name" in raw) != (kind == "tool"):
        raise ToolsRefused("tool_choice", f"must be {TOOL_CHOICES}, got {show(raw)}")
    serial = raw.get("disable_parallel_tool_use", False)
    if not isinstance(serial, bool):
        raise ToolsRefused("tool_choice.disable_parallel_tool_use", f"must be true or false, got {show(serial)}")
    if kind == "none":
        return None
    if not tools:
        raise ToolsRefused("tool_choice", f"{show(raw)} needs 'tools' to choose from")
    if kind == "tool":
        names = [t.name for t in tools]
        if raw["name"] not in names:
            raise ToolsRefused("tool_choice.name", f"{show(raw['name'])} is not one of the tools: {', '.join(names)}")
        return ToolSpec(tools, "named", raw["name"], not serial, fmt)
    return ToolSpec(tools, "required" if kind == "any" else "auto", None, not serial, fmt)


def _output_format(raw: Any, limits: ChatLimits) -> Grammar | None:
    """``output_config``: ``format`` (a JSON schema the answer must match) as the grammar that enforces it (the
    chat route's ``response_format``: :mod:`edgepath.edge.apis.structured`); ``effort`` is checked, not used."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) - {"effort", "format"}:
        raise invalid(f'output_config: must be {{"format"?: ..., "effort"?: ...}}, got {show(raw)}')
    if raw.get("effort") not in (None, *EFFORTS):
        raise invalid(f"output_config.effort: must be one of {', '.join(EFFORTS)}, got {show(raw['effort'])}")
    fmt = raw.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) != {"type", "schema"}:
        raise invalid(f'output_config.format: must be {{"type": "json_schema", "schema": {{...}}}}, got {show(fmt)}')
    if not limits.grammars:
        raise invalid("output_config.format: not supported by this server (its model side enforces no grammar)")
    try:
        return schema_grammar(fmt["schema"], "output_config.format.schema")
    except FormatRefused as exc:
        raise invalid(f"{exc.param}: {exc.message}") from None


def _thinking(raw: Any, max_tokens: Any) -> bool:
    """``thinking``, checked as Anthropic checks it: whether the model may think -- false for ``disabled``, which
    renders the template with ``enable_thinking`` false; ``budget_tokens`` is checked, not applied (docs/API.md)."""
    if raw is None:
        return True
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("disabled", "adaptive") and set(raw) == {"type"}:
        return kind != "disabled"
    if kind == "enabled" and set(raw) == {"type", "budget_tokens"}:
        budget = raw["budget_tokens"]
        if type(budget) is not int or budget < 1024:
            raise invalid(f"thinking.budget_tokens: must be an integer >= 1024, got {show(budget)}")
        if type(max_tokens) is int and budget >= max_tokens:
            raise invalid(f"max_tokens: must be greater than thinking.budget_tokens ({budget}), got {max_tokens}")
        return True
    raise invalid('thinking: must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}, got ' + show(raw))


def _chosen(modes: ThinkingModes, enabled: bool) -> Thinking | None:
    """The answer's thinking when the request asked for it ``enabled`` (:meth:`ThinkingModes.choose`), or the 400
    naming ``thinking``."""
    try:
        return modes.choose(enabled)
    except ThinkingFixed as exc:
        raise invalid(f'thinking: {{"type": "disabled"}} cannot be applied: {exc}; allowed here: "enabled" or '
                      '"adaptive"') from None  # fmt: skip


def _metadata(raw: Any) -> None:
    """``metadata``: ``{"user_id": str}`` at most, as Anthropic takes it; not stored here."""
    if raw is None:
        return
    if not isinstance(raw, dict) or set(raw) - {"user_id"}:
        raise invalid(f'metadata: must be {{"user_id": str}}, got {show(raw)}')
    user = raw.get("user_id")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise invalid(f"metadata.user_id: must be a string of at most 256 characters, got {show(user)}")


def _service_tier(raw: Any) -> None:
    if raw not in (None, "auto", "standard_only"):
        raise invalid(f"service_tier: must be 'auto' or 'standard_only', got {show(raw)}")
