"""OpenAI's Responses API, sans I/O: a ``POST /v1/responses`` body read into the one chat path every shape shares
(:mod:`edgepath.edge.apis.conversation`).

The ``openai-agents`` SDK and the ``openai`` SDK's newer examples speak this shape.  It follows the SDK's own types
(``openai.types.responses.ResponseCreateParams``, ``Response``, ``ResponseStreamEvent``).  ``input`` is a string or
a list of items -- messages (``user``, ``system``, ``developer``, ``assistant``; text parts), ``function_call`` and
``function_call_output`` items, and ``reasoning`` items, which are not sent back to the model (a thinking template
drops earlier turns' thinking itself).

**Stateless**: nothing is stored.  ``store`` is false whatever the request says it would like by default, ``true``
is a 400, and so is ``previous_response_id`` (and ``conversation``): send the whole conversation in ``input``.  As
on the OpenAI chat route, keys this server does not know are ignored, and a field it knows but cannot honour is a
400 naming it.  Errors are OpenAI's shape (:class:`~edgepath.edge.apis.openai.OpenAIError`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from edgepath.contract.wire import Sampling
from edgepath.edge.apis import thinking_fields
from edgepath.edge.apis import tools as tool_calling
from edgepath.edge.apis.conversation import ChatLimits, Conversation, NoGrammar, Turn, conversation
from edgepath.edge.apis.limits import TOOLS_MAX
from edgepath.edge.apis.openai import (
    check_utf8,
    checked_role,
    document,
    invalid_request,
    served_model,
    turn_list,
    unsupported,
)
from edgepath.edge.apis.sampling import (
    OPENAI_DEFAULT,
    SamplingInvalid,
    parse_cache_salt,
    parse_sampling,
    show,
)
from edgepath.edge.apis.structured import FormatRefused, json_object_grammar, schema_grammar
from edgepath.edge.apis.tools import Tool, ToolCall, ToolFormat, ToolSpec, ToolsRefused, ToolTurn
from edgepath.edge.http import Grammar, json_type
from edgepath.edge.text.chat import ChatMessage
from edgepath.edge.text.thinking import Thinking, ThinkingFixed

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TOOL_CHOICES = "'none', 'auto', 'required' or {\"type\": \"function\", \"name\": NAME}"
FORMATS = '{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", "strict"?}'


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    """A validated ``/v1/responses`` request: the chat as the model sees it and what the answer echoes back."""

    model: str
    chat: Conversation
    max_tokens: int
    max_output_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    stream: bool = False
    constraint: Grammar | None = None  # checked, built later off the event loop
    cache_salt: str | None = None
    thinking: Thinking | None = None
    enable_thinking: bool = True
    """False: ``reasoning.effort`` turned the thinking off (the template rendered with ``enable_thinking`` false)."""
    effort: str | None = None
    """``reasoning.effort`` as given, echoed in the response."""
    instructions: str | None = None
    tool_choice: Any = "auto"
    tools: tuple[dict[str, Any], ...] = ()
    text_format: Mapping[str, Any] = field(default_factory=lambda: {"type": "text"})
    metadata: Mapping[str, str] | None = None
    parallel_tool_calls: bool = True


def parse_response_request(body: bytes | Mapping[str, Any], limits: ChatLimits) -> ResponsesRequest:
    """Validate a ``POST /v1/responses`` body; raises :class:`~edgepath.edge.apis.openai.OpenAIError`."""
    doc = document(body)
    model = served_model(doc, limits.models)
    _refuse_unsupported(doc)
    instructions = doc.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_request(f"'instructions' must be a string, got {show(instructions)}", param="instructions")
    turns: list[Turn] = [ChatMessage("system", instructions)] if instructions else []
    turns += _input(doc.get("input"))
    raw_tools = doc.get("tools")
    try:
        listing = f'\'tools\' must be a list of at most {TOOLS_MAX} {{"type": "function", "name", '
        tools = tool_calling.tool_list(raw_tools, listing + '"description"?, "parameters"?} objects', _tool)
        spec = _tool_choice(doc.get("tool_choice"), tools, doc.get("parallel_tool_calls"), limits.tool_format)
        chat = conversation(turns, spec, limits.tool_format, limits.grammars)
    except (ToolsRefused, FormatRefused) as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None
    except NoGrammar:
        raise unsupported(
            "tool_choice", doc.get("tool_choice"), "'none' or 'auto' (this model side enforces no grammar)"
        ) from None
    fmt, constraint = _text_format(doc.get("text"), limits)
    if constraint is not None and chat.tools is not None:
        raise invalid_request(
            "'text.format' other than text cannot be combined with 'tools' (the answer may be calls); give "
            "'tool_choice': 'none' or drop one of them",
            param="text.format",
            code="invalid_value",
        )
    given = doc.get("max_output_tokens")
    if given is not None and (type(given) is not int or not 1 <= given <= limits.max_tokens):
        raise invalid_request(
            f"'max_output_tokens' must be an integer in 1..{limits.max_tokens} (this server's most tokens per "
            f"answer), got {show(given)}",
            param="max_output_tokens",
            code="invalid_value",
        )
    try:
        sampling = parse_sampling({k: doc[k] for k in ("temperature", "top_p") if k in doc}, OPENAI_DEFAULT)
        salt = parse_cache_salt(doc)
    except SamplingInvalid as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None
    stream = doc.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_request(f"'stream' must be true or false, got {show(stream)}", param="stream")
    metadata = doc.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and len(metadata) <= 16 and all(isinstance(v, str) for v in metadata.values())
    ):
        raise invalid_request(
            f"'metadata' must be an object of at most 16 string values, got {show(metadata)}", param="metadata"
        )
    enabled, thinking = _thinking(doc, limits)
    return ResponsesRequest(
        model, chat, given or limits.max_tokens, given, sampling, bool(stream), constraint or chat.constraint, salt,
        thinking, enabled, (doc.get("reasoning") or {}).get("effort"), instructions, doc.get("tool_choice") or "auto",
        tuple(raw_tools or ()), fmt, metadata, doc.get("parallel_tool_calls") is not False,
    )  # fmt: skip


#: the fields of ``POST /v1/responses`` this route reads: it applies them, takes them as harmless (who asks, a cache
#: hint, a service tier: :data:`~edgepath.edge.apis.openai_fields.HARMLESS`' reasoning), or takes them only at the
#: value that changes nothing (:func:`_refuse_unsupported`); any other field is a 400 naming it, as on the chat routes
#: (:mod:`edgepath.edge.apis.openai_fields`): an answer is never silently other than asked
KNOWN_FIELDS = frozenset(
    {
        # applied
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
        "parallel_tool_calls", "text", "stream", "metadata", "cache_salt",
        # harmless: who asks, hints for caching and latency
        "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier", "stream_options",
        # taken only at the value that changes nothing
        "store", "previous_response_id", "conversation", "prompt", "background", "truncation", "include",
        "top_logprobs", "max_tool_calls", "context_management",
        # applied as far as it switches the thinking (edge/apis/thinking_fields.py)
        "reasoning",
    }
)  # fmt: skip


def _refuse_unsupported(doc: Mapping[str, Any]) -> None:
    """400 for a field this route does not know, and for what it cannot do without a different answer: state,
    background runs, stored prompts."""
    for name, value in doc.items():
        if value is not None and name not in KNOWN_FIELDS:
            raise invalid_request(
                f"Unrecognized request argument supplied: {show(name)} (this server applies or refuses every field "
                "it knows, by name, so that an answer is never silently other than asked; see its docs/API.md)",
                param=name,
                code="unknown_parameter",
            )
    if doc.get("store") not in (None, False):
        raise unsupported("store", doc["store"], "false (this server keeps no responses: send the whole conversation "
                                                 "in 'input')")  # fmt: skip
    for name in ("previous_response_id", "conversation", "prompt"):
        if doc.get(name) is not None:
            raise unsupported(name, doc[name], "null (this server keeps no responses, conversations or prompts: "
                                               "send the whole conversation in 'input')")  # fmt: skip
    if doc.get("background") not in (None, False):
        raise unsupported("background", doc["background"], "false")
    if doc.get("truncation") not in (None, "disabled"):
        raise unsupported("truncation", doc["truncation"], "'disabled' (a prompt too long for a slot is a 400)")
    if doc.get("include") not in (None, []):
        raise unsupported("include", doc["include"], "[] (no extra output data)")
    for name in ("top_logprobs", "max_tool_calls", "context_management"):
        if doc.get(name) is not None:
            raise unsupported(name, doc[name], "null")


def _thinking(doc: Mapping[str, Any], limits: ChatLimits) -> tuple[bool, Thinking | None]:
    """Whether ``reasoning`` lets the model think (:func:`edgepath.edge.apis.thinking_fields.reasoning`), and how its
    answer is split then."""
    try:
        enabled = thinking_fields.reasoning(doc.get("reasoning")) is not False
    except thinking_fields.ThinkingRefused as exc:
        raise invalid_request(exc.message, param=exc.param, code="unsupported_parameter") from None
    try:
        return enabled, limits.thinking.choose(enabled)
    except ThinkingFixed as exc:
        raise unsupported("reasoning.effort", doc["reasoning"]["effort"], f"null (thinking on: {exc})") from None


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid_request(f"'{where}' must be a string, got {show(value)}", param=where, code="invalid_type")
    check_utf8(value, where)
    return value


def _input(raw: Any) -> list[Turn]:
    """``input``: a string (one user message), or items in order; consecutive function calls are one assistant
    turn (with the assistant's text just before them)."""
    if isinstance(raw, str):
        return [ChatMessage("user", _text(raw, "input"))]
    raw = turn_list(raw, "input", "a string or a non-empty list of items", "items")
    turns: list[Turn] = []
    made: set[str] = set()  # the ids of the calls made so far (kept as it grows: one pass, not one per output)
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"'{where}' must be an object, got {json_type(item)}", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            turns.append(_message(item, where))
        elif kind == "function_call":
            call = _call(item, where)
            made.add(call.id)
            last = turns[-1] if turns else None
            if isinstance(last, ToolTurn) and last.role == "assistant":
                turns[-1] = ToolTurn("assistant", last.content, (*last.calls, call))
            elif isinstance(last, ChatMessage) and last.role == "assistant":
                turns[-1] = ToolTurn("assistant", last.content, (call,))
            else:
                turns.append(ToolTurn("assistant", "", (call,)))
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise invalid_request(f"'{where}.call_id' must name the call this output answers", param=where)
            if call_id not in made:
                raise invalid_request(
                    f"'{where}.call_id' = {call_id!r} answers no function_call earlier in 'input'",
                    param=f"{where}.call_id",
                    code="invalid_value",
                )
            output = item.get("output")
            if isinstance(output, list):
                output = "\n".join(_part(p, f"{where}.output[{j}]", ("input_text",)) for j, p in enumerate(output))
            turns.append(ToolTurn("tool", _text(output, f"{where}.output"), call_id=call_id))
        elif kind == "reasoning":
            continue
        else:
            raise invalid_request(
                f"'{where}.type' = {show(kind)} is not supported by this server; allowed: message, function_call, "
                "function_call_output, reasoning",
                param=f"{where}.type",
                code="unsupported_value",
            )
    return turns


def _message(item: Mapping[str, Any], where: str) -> ChatMessage:
    role = checked_role(item, where, ROLES)
    content = item.get("content")
    if isinstance(content, str):
        return ChatMessage(ROLES[role], _text(content, f"{where}.content"))
    if not isinstance(content, list):
        raise invalid_request(
            f"'{where}.content' must be a string or a list of text parts, got {show(content)}",
            param=f"{where}.content",
            code="invalid_type",
        )
    allowed = ("output_text", "refusal") if role == "assistant" else ("input_text",)
    texts = [_part(p, f"{where}.content[{j}]", allowed) for j, p in enumerate(content)]
    return ChatMessage(ROLES[role], "\n".join(texts))


def _part(part: Any, where: str, allowed: tuple[str, ...]) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in allowed:
        raise invalid_request(
            f"'{where}' must be a part of type {' or '.join(allowed)} (text only), got {show(part)}",
            param=where,
            code="unsupported_value",
        )
    return _text(part.get("refusal" if kind == "refusal" else "text"), f"{where}.text")


def _call(item: Mapping[str, Any], where: str) -> ToolCall:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name and isinstance(arguments, str)):
        raise invalid_request(
            f'\'{where}\' must be {{"type": "function_call", "call_id": str, "name": str, "arguments": str '
            f"(JSON)}}, got {show(item)}",
            param=where,
            code="invalid_value",
        )
    _text(arguments, f"{where}.arguments")
    return ToolCall(call_id, name, arguments)


def _tool(entry: Any, where: str, taken: Sequence[Tool]) -> Tool:
    """One of a Responses request's tools: ``{"type": "function", "name", "description"?, "parameters"?}``."""
    shape = 'a function tool {"type": "function", "name", ...} (this server has no hosted tools)'
    entry = tool_calling.function_tool(entry, where, shape)
    name, description, parameters = entry.get("name"), entry.get("description"), entry.get("parameters")
    return tool_calling.checked_tool(name, description, parameters, where, taken, strict=entry.get("strict"))


def _tool_choice(raw: Any, tools: tuple[Tool, ...], parallel: Any, fmt: ToolFormat) -> ToolSpec | None:
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolsRefused("parallel_tool_calls", f"'parallel_tool_calls' must be true or false, got {show(parallel)}")
    serial = parallel is False
    if raw is None or raw == "auto":
        return ToolSpec(tools, "auto", None, not serial, fmt) if tools else None
    if raw == "none":
        return None
    if raw != "required" and not (isinstance(raw, dict) and raw.get("type") == "function"):
        raise ToolsRefused("tool_choice", f"'tool_choice' = {show(raw)} is not supported; allowed: {TOOL_CHOICES}")
    if not tools:
        raise ToolsRefused("tool_choice", f"'tool_choice' = {show(raw)} needs 'tools' to choose from")
    if raw == "required":
        return ToolSpec(tools, "required", None, not serial, fmt)
    names = [t.name for t in tools]
    if raw.get("name") not in names:
        raise ToolsRefused(
            "tool_choice.name", f"'tool_choice.name' = {show(raw.get('name'))} is not one of the tools: {names}"
        )
    return ToolSpec(tools, "named", raw["name"], not serial, fmt)


def _text_format(raw: Any, limits: ChatLimits) -> tuple[Mapping[str, Any], Grammar | None]:
    """``text.format`` as the answer's format and the grammar that enforces it (the chat route's
    ``response_format``, :mod:`edgepath.edge.apis.structured`, whose ``json_schema`` is nested one level down)."""
    if raw is None:
        return {"type": "text"}, None
    if not isinstance(raw, dict) or set(raw) - {"format", "verbosity"}:
        raise invalid_request(f"'text' must be {{\"format\": ...}}, got {show(raw)}", param="text")
    if raw.get("verbosity") is not None:
        raise unsupported("text.verbosity", raw["verbosity"], "null (the served model's verbosity is not configurable)")
    fmt = raw.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return {"type": "text"}, None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise invalid_request(
            f"'text.format' must be {FORMATS}, got {show(fmt)}", param="text.format", code="invalid_value"
        )
    if not limits.grammars:
        raise unsupported("text.format", fmt, '{"type": "text"} (this model side enforces no grammar)')
    if fmt["type"] == "json_object":
        return fmt, json_object_grammar("text.format")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not name or not isinstance(schema, dict):
        raise invalid_request(
            f"'text.format' of type json_schema needs 'name' (a string) and 'schema' (an object), got {show(fmt)}",
            param="text.format",
            code="invalid_value",
        )
    try:
        return fmt, schema_grammar(schema, "text.format.schema")
    except FormatRefused as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None
