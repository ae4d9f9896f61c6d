"""Tool calling, sans I/O: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked, the tools shown
to the model, its answer read back as tool calls.

The tools reach the model by a fallback that works with any chat template (SmolLM2's, the default, has no place
for tools; rendering them with a template that has one, and reading that template's own call format back, is not
built): a system message that lists each tool (its name, description and JSON schema of arguments) and asks for one
answer format, a JSON list of calls ``[{"name": ..., "arguments": {...}}]`` (:func:`fallback_prompt`).  Earlier
turns of the conversation are written in that same format: an assistant turn's ``tool_calls`` as that list, a
``tool`` turn's result as a user turn that names the call it answers (:func:`flatten`).

``tool_choice`` ``required`` and a named function are **enforced**: the list's grammar -- each call's ``name`` one
of the tools offered (or the one named) and its ``arguments`` valid against that tool's ``parameters`` -- travels to
the slot as ``response_format``'s grammars do (:func:`edgepath.edge.structured.schema_grammar`), so the answer is a
valid call unless ``max_tokens`` cuts it.  ``auto`` constrains nothing: the answer is read as calls when it is such a
list (:class:`ToolOutput`), else it is the text.  ``none`` offers no tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from edgepath.edge.chat import ChatMessage
from edgepath.edge.sampling import show as _show
from edgepath.edge.structured import FormatRefused, schema_grammar

Choice = Literal["auto", "required", "named"]
#: OpenAI's limits on a function's name and on the tools of one request
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128
CHOICES = '\'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": NAME}}'
#: the parameters of a function that takes none (OpenAI: ``parameters`` left out)
NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


class ToolsRefused(ValueError):
    """A tool field this server cannot take; ``param`` names where, the message what is allowed."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True, slots=True)
class Tool:
    """One function the model may call."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    """The JSON schema of its arguments (an object)."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: ``arguments`` is JSON text, as OpenAI carries it."""

    id: str
    name: str
    arguments: str

    def payload(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """The tools offered to the model and how it must use them."""

    tools: tuple[Tool, ...]
    choice: Choice
    named: str | None = None
    """The function ``tool_choice`` names (``choice`` ``named``)."""
    parallel: bool = True
    """Several calls in one answer (``parallel_tool_calls``); else at most one."""

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the answer may call: the named one alone, or all."""
        return tuple(t for t in self.tools if self.named is None or t.name == self.named)

    @property
    def constrained(self) -> bool:
        """Whether the answer must be calls (enforced by a grammar)."""
        return self.choice != "auto"


# -- the request ----------------------------------------------------------------------------------------


def parse_tools(doc: Mapping[str, Any]) -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request; None when no tool is offered
    (none given, or ``tool_choice`` ``none``).  ToolsRefused names the field and what is allowed."""
    raw, choice = doc.get("tools"), doc.get("tool_choice")
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolsRefused("parallel_tool_calls", f"'parallel_tool_calls' must be true or false, got {_show(parallel)}")
    tools = _tools(raw) if raw is not None else ()
    mode, named = _choice(choice, tools)
    if mode == "none" or not tools:
        return None
    return ToolSpec(tools, mode, named, parallel is not False)


def _tools(raw: Any) -> tuple[Tool, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ToolsRefused(
            "tools",
            f'\'tools\' must be a list of at most {MAX_TOOLS} {{"type": "function", "function": {{name, '
            f"description?, parameters?}}}} objects, got {_show(raw)}",
        )
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(entry, Mapping) or entry.get("type") != "function":
            raise ToolsRefused(
                f"{where}.type",
                f'\'{where}\' must be {{"type": "function", "function": {{...}}}} (function tools only), '
                f"got {_show(entry)}",
            )
        function = entry.get("function")
        if not isinstance(function, Mapping):
            raise ToolsRefused(
                f"{where}.function",
                f"'{where}.function' must be an object {{name, description?, parameters?}}, got {_show(function)}",
            )
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolsRefused(
                f"{where}.function.name",
                f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-', got {_show(name)}",
            )
        if any(t.name == name for t in tools):
            raise ToolsRefused(f"{where}.function.name", f"'{where}.function.name': {name!r} is given twice")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolsRefused(
                f"{where}.function.description",
                f"'{where}.function.description' must be a string, got {_show(description)}",
            )
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolsRefused(f"{where}.function.strict", f"'{where}.function.strict' must be true or false")
        tools.append(Tool(name, description or "", _parameters(function.get("parameters"), f"{where}.function")))
    return tuple(tools)


def _parameters(parameters: Any, where: str) -> Mapping[str, Any]:
    at = f"{where}.parameters"
    if parameters is None:
        return NO_PARAMETERS
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise ToolsRefused(
            at, f'\'{at}\' must be a JSON schema of an object ("type": "object"), got {_show(parameters)}'
        )
    _encodable(parameters, at)
    return parameters


def _choice(choice: Any, tools: Sequence[Tool]) -> tuple[Choice | Literal["none"], str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto"):
        return choice, None
    if (choice == "required" or isinstance(choice, Mapping)) and not tools:
        raise ToolsRefused("tool_choice", f"'tool_choice' = {_show(choice)} needs 'tools' to choose from")
    if choice == "required":
        return "required", None
    if isinstance(choice, Mapping) and choice.get("type") == "function" and isinstance(choice.get("function"), Mapping):
        name = choice["function"].get("name")
        names = [t.name for t in tools]
        if name not in names:
            raise ToolsRefused(
                "tool_choice.function.name",
                f"'tool_choice.function.name' = {_show(name)} is not one of the tools given: {', '.join(names)}",
            )
        return "named", str(name)
    raise ToolsRefused("tool_choice", f"'tool_choice' = {_show(choice)} is not supported; allowed: {CHOICES}")


def grammar(spec: ToolSpec) -> str:
    """The grammar of an answer of calls to ``spec``'s tools: a JSON list of ``{"name", "arguments"}`` objects, one
    call unless ``parallel``.  FormatRefused (from the schema check) names a keyword that cannot be enforced."""
    items, arguments = [], {}
    for k, tool in enumerate(spec.offered):
        # each tool's parameters sit in the root's $defs (its own local references made to point there)
        arguments[f"t{k}"] = _relocated(tool.parameters, f"#/$defs/t{k}")
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": {"$ref": f"#/$defs/t{k}"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1, "$defs": arguments}
    if not spec.parallel:
        schema["maxItems"] = 1
    where = "tools" if spec.named is None else f"tools[{[t.name for t in spec.tools].index(spec.named)}]"
    try:
        return schema_grammar(schema, where)
    except FormatRefused as exc:
        # the check names places in the composed schema: say them as the request has them
        param = _request_place(exc.param, spec)
        raise FormatRefused(param, exc.message.replace(exc.param, param)) from None


def _relocated(schema: Any, base: str) -> Any:
    """``schema`` with its local references (``#/$defs/x``) pointing where it now sits in the calls' schema."""
    if isinstance(schema, list):
        return [_relocated(s, base) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in ("properties", "$defs", "definitions") and isinstance(value, Mapping):
            out[key] = {name: _relocated(sub, base) for name, sub in value.items()}
        elif key in ("enum", "const", "default", "examples"):
            out[key] = value  # values, not schemas
        else:
            out[key] = _relocated(value, base)
    return out


_PLACE = re.compile(r"^tools(?:\[\d+\])?\.\$defs\.t(\d+)")


def _request_place(place: str, spec: ToolSpec) -> str:
    m = _PLACE.match(place)
    if m is None:
        return place
    tool = spec.offered[int(m.group(1))]
    return f"tools[{spec.tools.index(tool)}].function.parameters" + place[m.end() :]


# -- the conversation -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolTurn:
    """An assistant turn with ``tool_calls``, or a ``tool`` turn (the result of the call ``call_id``)."""

    role: str
    content: str
    calls: tuple[ToolCall, ...] = ()
    call_id: str | None = None


def turn(role: str, content: str | None, message: Mapping[str, Any], where: str) -> ToolTurn:
    """The tool parts of one message (``content`` already read as text, None when absent)."""
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ToolsRefused(
                f"{where}.tool_call_id",
                f"'{where}.tool_call_id' must name the call this result answers (a non-empty string), "
                f"got {_show(call_id)}",
            )
        if content is None:
            raise ToolsRefused(f"{where}.content", f"'{where}.content' must hold the tool's result (a string)")
        return ToolTurn(role, content, call_id=call_id)
    raw = message.get("tool_calls")
    if role != "assistant":
        raise ToolsRefused(f"{where}.tool_calls", f"'{where}.tool_calls' is only allowed on assistant messages")
    if not isinstance(raw, list):
        raise ToolsRefused(f"{where}.tool_calls", f"'{where}.tool_calls' must be a list of calls, got {_show(raw)}")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        ok = (
            isinstance(function, Mapping)
            and isinstance(call.get("id"), str)
            and call.get("type", "function") == ("function")
        )
        name, arguments = (function.get("name"), function.get("arguments")) if ok else (None, None)  # type: ignore[union-attr]
        if not ok or not isinstance(name, str) or not isinstance(arguments, str):
            raise ToolsRefused(
                at,
                f'\'{at}\' must be {{"id": str, "type": "function", "function": {{"name": str, '
                f'"arguments": str (JSON)}}}}, got {_show(call)}',
            )
        _encodable(arguments, f"{at}.function.arguments")
        calls.append(ToolCall(call["id"], name, arguments))
    return ToolTurn(role, content or "", tuple(calls))


def flatten(turns: Sequence[ChatMessage | ToolTurn]) -> tuple[ChatMessage, ...]:
    """The conversation as plain turns (system, user, assistant) that any template renders: an assistant's calls
    written as the answer format asks (:func:`calls_text`), a tool's result as a user turn naming its call.  A
    result must answer a call made earlier in the conversation (ToolsRefused names the message)."""
    names: dict[str, str] = {}
    out = []
    for i, t in enumerate(turns):
        if isinstance(t, ChatMessage):
            out.append(t)
        elif t.role == "assistant":
            names.update((c.id, c.name) for c in t.calls)
            text = calls_text(t.calls)
            out.append(ChatMessage("assistant", f"{t.content}\n{text}" if t.content else text))
        else:
            assert t.call_id is not None
            if t.call_id not in names:
                raise ToolsRefused(
                    f"messages[{i}].tool_call_id",
                    f"'messages[{i}].tool_call_id' = {t.call_id!r} answers no call of an earlier assistant message",
                )
            out.append(ChatMessage("user", f"Result of the call {t.call_id} to {names[t.call_id]}:\n{t.content}"))
    return tuple(out)


def calls_text(calls: Sequence[ToolCall]) -> str:
    """Calls in the answer format the fallback prompt asks for (arguments that are not JSON kept as text)."""

    def arguments(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text

    return json.dumps([{"name": c.name, "arguments": arguments(c.arguments)} for c in calls], ensure_ascii=False)


def fallback_prompt(spec: ToolSpec) -> str:
    """The system text that offers ``spec``'s tools to a model whose chat template has no place for them."""
    lines = [
        "You can call the following tools (functions). Each is given as JSON: its name, what it does, and the "
        "JSON schema of its arguments.",
    ]
    lines += [
        json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters}, ensure_ascii=False)
        for t in spec.offered
    ]
    lines.append(
        'To call tools, answer with only a JSON list of calls and nothing else: [{"name": "<tool name>", '
        '"arguments": {<the arguments, as the tool\'s schema says>}}].'
    )
    if not spec.parallel:
        lines.append("Make one call at a time: the list holds exactly one call.")
    if spec.named is not None:
        lines.append(f"You must call the tool {spec.named}.")
    elif spec.choice == "required":
        lines.append("You must call at least one tool.")
    else:
        lines.append("If no tool is needed, answer in plain text instead.")
    return "\n".join(lines)


def offer(messages: Sequence[ChatMessage], spec: ToolSpec) -> tuple[ChatMessage, ...]:
    """``messages`` with the fallback prompt in their system turn (a system turn put first when there is none)."""
    prompt = fallback_prompt(spec)
    if messages and messages[0].role == "system":
        first = messages[0]
        return (ChatMessage("system", f"{first.content}\n\n{prompt}" if first.content else prompt), *messages[1:])
    return (ChatMessage("system", prompt), *messages)


# -- the answer -----------------------------------------------------------------------------------------


class ToolOutput:
    """An answer's text, held back while it may be tool calls, then read as calls or released as text.

    ``auto``: text that starts (after white space) with anything but ``[`` or ``{`` is text, released at once;
    otherwise it is held to the end and read as calls (:func:`read_calls`), or released then if it is not calls.
    ``required`` and a named function: the grammar made it calls, so it is all held and read at the end."""

    def __init__(self, spec: ToolSpec, call_prefix: str) -> None:
        self.spec = spec
        self.call_prefix = call_prefix
        self._held: list[str] = []
        self._holding = True

    @property
    def holding(self) -> bool:
        return self._holding

    def feed(self, text: str) -> str:
        """The text to release now (empty while it is held)."""
        if not self._holding:
            return text
        self._held.append(text)
        start = "".join(self._held).lstrip()
        if self.spec.constrained or not start or start[0] in "[{":
            return ""
        self._holding = False
        return self._take()

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """At the answer's end: the text still held and the calls it holds (none: the text is the answer's)."""
        text = self._take()
        calls = read_calls(text, self.spec, self.call_prefix) if self._holding else ()
        self._holding = False
        return ("", calls) if calls else (text, ())

    def _take(self) -> str:
        text = "".join(self._held)
        self._held.clear()
        return text


def read_calls(text: str, spec: ToolSpec, call_prefix: str) -> tuple[ToolCall, ...]:
    """The calls ``text`` makes in the answer format (a JSON list of ``{"name", "arguments"}``; a single such
    object is taken too), each to a tool offered with an object of arguments; () when it is not that."""
    try:
        doc = json.loads(text)
    except ValueError:
        return ()
    entries = [doc] if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries or (len(entries) > 1 and not spec.parallel):
        return ()
    names = {t.name for t in spec.offered}
    calls = []
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"name", "arguments"}:
            return ()
        if entry["name"] not in names or not isinstance(entry["arguments"], dict):
            return ()
        arguments = json.dumps(entry["arguments"], ensure_ascii=False)
        calls.append(ToolCall(f"{call_prefix}_{k}", entry["name"], arguments))
    return tuple(calls)


def _encodable(value: Any, where: str) -> None:
    """No unpaired surrogate (not UTF-8) anywhere in ``value``."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ToolsRefused(where, f"'{where}' holds an unpaired surrogate escape, which is not valid UTF-8") from None
