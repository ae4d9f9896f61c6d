"""Tool calling, sans I/O: OpenAI's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` checked, the tools shown
to the model, its answer read back as tool calls.

How the tools reach the model depends on the chat template (:func:`template_format`):

* **the template's own way** -- a template that reads ``tools`` (Jinja) renders them itself, as transformers'
  ``apply_chat_template(tools=...)``, llama-server and vLLM pass them; the conversation's calls and results are
  given to it as OpenAI has them (``tool_calls``, ``role: "tool"``), and the answer is read in the call format the
  template asks for: Hermes' ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5, Hermes 2/3; one
  block per call) or Llama 3.1's JSON ``{"name": ..., "parameters": {...}}`` (one call);
* **the fallback** -- a template with no place for tools (SmolLM2's, the default), or one whose call format is
  none of those: a system message that lists each tool (its name, description and JSON schema of arguments) and
  asks for one answer format, a JSON list of calls ``[{"name": ..., "arguments": {...}}]``
  (:func:`fallback_prompt`).  Earlier turns of the conversation are written in that same format: an assistant
  turn's ``tool_calls`` as that list, a ``tool`` turn's result as a user turn that names the call it answers
  (:func:`flatten`).

``tool_choice`` ``required`` and a named function are **enforced**: the grammar of the answer's calls in its
format -- each call's ``name`` one of the tools offered (or the one named) and its ``arguments`` valid against that
tool's ``parameters`` -- travels to the slot as ``response_format``'s grammars do
(:func:`edgepath.edge.apis.structured.schema_grammar`), so the answer is a valid call unless ``max_tokens`` cuts it.
``auto`` constrains nothing: the answer is read as calls when it is calls in its format (:class:`ToolOutput`), else
it is the text.  ``none`` offers no tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from edgepath.edge.apis.call_stream import HERMES_OPEN, CallDelta, CallScanner, argument_spans
from edgepath.edge.apis.limits import TOOLS_MAX
from edgepath.edge.apis.sampling import show as _show
from edgepath.edge.apis.structured import FormatRefused, check_schema, deferred, digest_of, schema_gbnf
from edgepath.edge.http import Grammar
from edgepath.edge.text.chat import ChatMessage

Choice = Literal["auto", "required", "named"]
ToolFormat = Literal["fallback", "hermes", "llama3-json"]
"""How the model is offered tools and answers with calls: the fallback prompt's JSON list, or a template's own."""
TOOL_FORMATS: dict[str, str] = {
    "fallback": "tools offered by edgepath's fallback prompt (the chat template has no place for tools, or asks for "
    "a call format this edge does not read back), calls read as a JSON list",
    "hermes": "tools rendered by the chat template, calls read as its <tool_call> blocks (Hermes, Qwen2.5)",
    "llama3-json": 'tools rendered by the chat template, a call read as its {"name", "parameters"} JSON (Llama 3.1)',
}
HERMES_CLOSE = "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
#: OpenAI's limit on a function's name (on the tools of one request: edge/apis/limits.py)
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
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
    format: ToolFormat = "fallback"
    """How the tools are offered and the calls read (:func:`template_format`)."""

    @property
    def offered(self) -> tuple[Tool, ...]:
        """The tools the answer may call: the named one alone, or all."""
        return tuple(t for t in self.tools if self.named is None or t.name == self.named)

    @property
    def constrained(self) -> bool:
        """Whether the answer must be calls (enforced by a grammar)."""
        return self.choice != "auto"


def template_format(source: str | None) -> ToolFormat:
    """The tool format of a chat template's source: ``hermes`` or ``llama3-json`` when the template reads
    ``tools`` and asks for that call format (its ``<tool_call>`` tags; Llama 3's markers and ``{"name": ...,
    "parameters": ...}``), else ``fallback`` -- no place for tools, or a call format this edge cannot read back
    (Mistral's ``[TOOL_CALLS]`` list among them)."""
    from edgepath.edge.text.chat import ChatTemplate, ChatTemplateError

    if source is None:
        return "fallback"
    try:
        variables = ChatTemplate(source).variables
    except (ChatTemplateError, RecursionError):
        return "fallback"
    if "tools" not in variables:
        return "fallback"
    if "[TOOL_CALLS]" in source:  # Mistral's: a list after a control token, not read back here
        return "fallback"
    if HERMES_OPEN in source:
        return "hermes"
    if '"parameters"' in source and "<|start_header_id|>" in source:  # Llama 3.x's markers, its call's key
        return "llama3-json"
    return "fallback"


# -- the request ----------------------------------------------------------------------------------------


def parse_tools(doc: Mapping[str, Any], format: ToolFormat = "fallback") -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, to be offered in ``format``; None
    when no tool is offered (none given, or ``tool_choice`` ``none``).  ToolsRefused names the field and what is
    allowed."""
    raw, choice = doc.get("tools"), doc.get("tool_choice")
    parallel = doc.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolsRefused("parallel_tool_calls", f"'parallel_tool_calls' must be true or false, got {_show(parallel)}")
    listing = f'\'tools\' must be a list of at most {TOOLS_MAX} {{"type": "function", "function": {{name, '
    tools = tool_list(raw, listing + "description?, parameters?}} objects", _tool)
    mode, named = _choice(choice, tools)
    if mode == "none" or not tools:
        return None
    return ToolSpec(tools, mode, named, parallel is not False, format)


def tool_list(raw: Any, refused: str, read: Callable[[Any, str, Sequence[Tool]], Tool]) -> tuple[Tool, ...]:
    """A request's tools in any shape: ``raw`` (None: none) a list of at most :data:`TOOLS_MAX` entries, else
    ToolsRefused ``tools`` saying ``refused`` and what came; each entry read by ``read(entry, where, taken)``, where
    ``where`` is its place (``tools[i]``) for its refusals and ``taken`` the tools before it (a name given twice is
    refused)."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > TOOLS_MAX:
        raise ToolsRefused("tools", f"{refused}, got {_show(raw)}")
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        tools.append(read(entry, f"tools[{i}]", tools))
    return tuple(tools)


def function_tool(entry: Any, where: str, shape: str) -> Mapping[str, Any]:
    """``entry`` when it is an object of ``"type": "function"`` (the only tools this server has); else ToolsRefused
    naming ``where.type`` and saying that it must be ``shape``."""
    if not isinstance(entry, Mapping) or entry.get("type") != "function":
        raise ToolsRefused(f"{where}.type", f"'{where}' must be {shape}, got {_show(entry)}")
    return entry


def _tool(entry: Any, where: str, taken: Sequence[Tool]) -> Tool:
    """One of OpenAI chat's tools: ``{"type": "function", "function": {name, description?, parameters?}}``."""
    shape = '{"type": "function", "function": {...}} (function tools only)'
    function = function_tool(entry, where, shape).get("function")
    if not isinstance(function, Mapping):
        raise ToolsRefused(
            f"{where}.function",
            f"'{where}.function' must be an object {{name, description?, parameters?}}, got {_show(function)}",
        )
    name, description, parameters = function.get("name"), function.get("description"), function.get("parameters")
    return checked_tool(name, description, parameters, f"{where}.function", taken, strict=function.get("strict"))


def checked_tool(
    name: Any,
    description: Any,
    parameters: Any,
    where: str,
    taken: Sequence[Tool] = (),
    schema: str = "parameters",
    strict: Any = None,
) -> Tool:
    """One function tool as every API shape gives it (a name, an optional description, the JSON schema of its
    arguments as ``schema`` -- Anthropic's ``input_schema`` -- and OpenAI's optional ``strict``), checked:
    ToolsRefused names ``where.<field>`` and what is allowed; a name already ``taken`` is refused."""
    if strict is not None and not isinstance(strict, bool):
        raise ToolsRefused(f"{where}.strict", f"'{where}.strict' must be true or false")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolsRefused(
            f"{where}.name", f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-', got {_show(name)}"
        )
    if any(t.name == name for t in taken):
        raise ToolsRefused(f"{where}.name", f"'{where}.name': {name!r} is given twice")
    if description is not None and not isinstance(description, str):
        raise ToolsRefused(f"{where}.description", f"'{where}.description' must be a string, got {_show(description)}")
    return Tool(name, description or "", _parameters(parameters, where, schema))


def _parameters(parameters: Any, where: str, schema: str = "parameters") -> Mapping[str, Any]:
    at = f"{where}.{schema}"
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


def grammar(spec: ToolSpec) -> Grammar:
    """The grammar of an answer of calls to ``spec``'s tools in its format, checked now and built later: the
    fallback's JSON list of ``{"name", "arguments"}`` objects; Hermes' ``<tool_call>`` blocks of such an object, one
    per call; Llama 3.1's one ``{"name", "parameters"}`` object -- one call unless ``parallel`` (and one with
    Llama's).  FormatRefused (from the schema check) names a keyword that cannot be enforced or a limit passed."""
    key = "parameters" if spec.format == "llama3-json" else "arguments"
    items, arguments = [], {}
    for k, tool in enumerate(spec.offered):
        # each tool's parameters sit in the root's $defs (its own local references made to point there)
        arguments[f"t{k}"] = _relocated(tool.parameters, f"#/$defs/t{k}")
        items.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, key: {"$ref": f"#/$defs/t{k}"}},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any]
    if spec.format == "fallback":
        schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1, "$defs": arguments}
        if not spec.parallel:
            schema["maxItems"] = 1
    else:
        schema = {"anyOf": items, "$defs": arguments}
    where = "tools" if spec.named is None else f"tools[{[t.name for t in spec.tools].index(spec.named)}]"
    try:
        check_schema(schema, where, schema)
    except FormatRefused as exc:
        raise _in_request(exc, spec) from None
    digest = digest_of("tools", spec.format, spec.parallel, schema)
    return deferred(digest, lambda: _calls_gbnf(schema, where, spec), where)


def _in_request(exc: FormatRefused, spec: ToolSpec) -> FormatRefused:
    """``exc`` naming places as the request has them (the check names places in the composed schema)."""
    param = _request_place(exc.param, spec)
    return FormatRefused(param, exc.message.replace(exc.param, param))


def _calls_gbnf(schema: Mapping[str, Any], where: str, spec: ToolSpec) -> str:
    """The GBNF of the calls (on a tokenizer worker): the composed schema's, wrapped in ``<tool_call>`` blocks for
    Hermes."""
    try:
        made = schema_gbnf(schema, where)
    except FormatRefused as exc:
        raise _in_request(exc, spec) from None
    if spec.format != "hermes":
        return made
    # the JSON object's grammar becomes one rule, and the answer is its <tool_call> blocks
    call = "edgepath-tool-call"
    made, renamed = re.subn(r"^root ::= ", f"{call} ::= ", made, count=1, flags=re.M)
    assert renamed == 1, "the schema converter names its top rule root"
    block = f'"{HERMES_OPEN}\\n" {call} "\\n{HERMES_CLOSE}"'
    more = f' ("\\n" {block})*' if spec.parallel else ""
    return f"root ::= {block}{more}\n{made}"


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
    names = call_names(turns)
    out = []
    for t in turns:
        if isinstance(t, ChatMessage):
            out.append(t)
        elif t.role == "assistant":
            text = calls_text(t.calls)
            out.append(ChatMessage("assistant", f"{t.content}\n{text}" if t.content else text))
        else:
            assert t.call_id is not None
            out.append(ChatMessage("user", f"Result of the call {t.call_id} to {names[t.call_id]}:\n{t.content}"))
    return tuple(out)


def call_names(turns: Sequence[ChatMessage | ToolTurn]) -> dict[str, str]:
    """The name of each call the conversation's assistant turns made, by id; ToolsRefused names a ``tool`` turn
    that answers no call made before it."""
    names: dict[str, str] = {}
    for i, t in enumerate(turns):
        if isinstance(t, ChatMessage):
            continue
        if t.role == "assistant":
            names.update((c.id, c.name) for c in t.calls)
        elif t.call_id not in names:
            raise ToolsRefused(
                f"messages[{i}].tool_call_id",
                f"'messages[{i}].tool_call_id' = {t.call_id!r} answers no call of an earlier assistant message",
            )
    return names


def template_messages(turns: Sequence[ChatMessage | ToolTurn]) -> tuple[dict[str, Any], ...]:
    """The conversation as a template that has tools reads it -- OpenAI's messages, as transformers, llama-server
    and vLLM give them to it: an assistant's ``tool_calls`` with their ``arguments`` an object (the JSON text
    decoded; text that is not JSON kept as it is), its ``content`` None when it has none; a ``tool`` turn with
    ``tool_call_id``.  ToolsRefused names a result that answers no earlier call."""
    call_names(turns)
    out: list[dict[str, Any]] = []
    for t in turns:
        if isinstance(t, ChatMessage):
            out.append({"role": t.role, "content": t.content})
        elif t.role == "tool":
            out.append({"role": "tool", "content": t.content, "tool_call_id": t.call_id})
        else:
            calls = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _decoded(c.arguments)}}
                for c in t.calls
            ]
            out.append({"role": "assistant", "content": t.content or None, "tool_calls": calls})
    return tuple(out)


def template_tools(spec: ToolSpec) -> tuple[dict[str, Any], ...]:
    """The tools offered, as a template that has tools reads them (OpenAI's ``tools`` entries)."""
    out = []
    for t in spec.offered:
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = dict(t.parameters)
        out.append({"type": "function", "function": function})
    return tuple(out)


def _decoded(arguments: str) -> Any:
    """A call's arguments: the object its JSON text holds, or the text when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def calls_text(calls: Sequence[ToolCall]) -> str:
    """Calls in the answer format the fallback prompt asks for (arguments that are not JSON kept as text)."""
    return json.dumps([{"name": c.name, "arguments": _decoded(c.arguments)} for c in calls], ensure_ascii=False)


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
    """An answer's text, held back while it may be tool calls, then read as calls or released as text -- and the
    calls streamed as the model writes them.

    ``auto``, the fallback's and Llama's JSON: text that starts (after white space) with anything but ``[`` or
    ``{`` (Llama's: ``{``) is text, released at once; otherwise it is held to the end and read as calls
    (:func:`read_answer`), or released then if it is not calls.  ``auto``, Hermes': text is released up to a
    ``<tool_call>`` tag (what may be the start of one is held), and from the tag on it is held to the end.
    ``required`` and a named function: the grammar made it calls, so it is all held and read at the end.

    While it is held, the text goes through a :class:`~edgepath.edge.apis.call_stream.CallScanner`: each call's head
    and its arguments' pieces are ready as they come (:meth:`deltas`), and at the end what is left of them, so that
    the pieces of each call add up to its arguments as read.  An answer whose calls had started to go out and that
    is not those calls after all (cut short by ``max_tokens``, or off its format) ends with its text released: the
    calls sent stay as they were, and nothing of the answer is lost."""

    def __init__(self, spec: ToolSpec, call_prefix: str) -> None:
        self.spec = spec
        self.call_prefix = call_prefix
        self._held: list[str] = []
        self._holding = True
        self._tagged = False  # Hermes': a <tool_call> tag was seen, so the rest is held
        names = [t.name for t in spec.offered]
        self._scanner = CallScanner(spec.format, names, call_prefix, _argument_keys(spec))
        self._deltas: list[CallDelta] = []
        self._streamed: dict[int, tuple[str, str]] = {}  # each call gone out: its name and the arguments sent

    @property
    def holding(self) -> bool:
        """Whether text fed may still be held (once false, :meth:`feed` releases everything)."""
        return self._holding

    def feed(self, text: str) -> str:
        """The text to release now (empty while it is held)."""
        if not self._holding:
            return text
        self._held.append(text)
        if self.spec.constrained or self._tagged:
            self._scan(text)
            return ""
        held = "".join(self._held)
        if self.spec.format == "hermes":
            at = held.find(HERMES_OPEN)
            if at >= 0:
                self._tagged = True
                self._scan(held[at:])
            else:  # keep what may be the start of a tag
                at = next((i for i in range(max(0, len(held) - len(HERMES_OPEN)), len(held))
                           if HERMES_OPEN.startswith(held[i:])), len(held))  # fmt: skip
            self._held[:] = [held[at:]]
            return held[:at]
        start = held.lstrip()
        if not start or start[0] in ("{" if self.spec.format == "llama3-json" else "[{"):
            self._scan(text)
            return ""
        self._holding = False
        return self._take()

    def deltas(self) -> list[CallDelta]:
        """The pieces of the calls that may go out now (each given once)."""
        out, self._deltas = self._deltas, []
        return out

    def finish(self) -> tuple[str, tuple[ToolCall, ...]]:
        """At the answer's end: the text still to release and the calls (none: all of the text is the answer's;
        with calls, the text beside them -- Hermes' text around its blocks -- or nothing).  The pieces of the calls
        not gone out yet are then ready (:meth:`deltas`)."""
        text = self._take()
        if not self._holding:
            return text, ()
        self._holding = False
        beside, calls = read_answer(text, self.spec, self.call_prefix)
        if not calls or not self._agrees(calls):
            return text, ()  # not calls; or not the calls that went out: the text is the answer's
        for k, call in enumerate(calls):
            streamed = self._streamed.get(k)
            if streamed is None:
                self._deltas.append(CallDelta(k, call.arguments, call.id, call.name))
            elif len(call.arguments) > len(streamed[1]):
                self._deltas.append(CallDelta(k, call.arguments[len(streamed[1]) :]))
        return beside, calls

    def _scan(self, text: str) -> None:
        """Held ``text`` through the scanner: the pieces of the calls it lets go are ready."""
        for delta in self._scanner.feed(text):
            name, sent = self._streamed.get(delta.index, (delta.name or "", ""))
            self._streamed[delta.index] = (name, sent + delta.arguments)
            self._deltas.append(delta)

    def _agrees(self, calls: Sequence[ToolCall]) -> bool:
        """Whether every call gone out is the call read at that place, its arguments sent a start of its own."""
        return all(
            k < len(calls) and calls[k].name == name and calls[k].arguments.startswith(sent)
            for k, (name, sent) in self._streamed.items()
        )

    def _take(self) -> str:
        text = "".join(self._held)
        self._held.clear()
        return text


def read_answer(text: str, spec: ToolSpec, call_prefix: str) -> tuple[str, tuple[ToolCall, ...]]:
    """``text`` read in ``spec``'s format: the text beside the calls and the calls, each to a tool offered with
    an object of arguments; ``(text, ())`` when it is not calls.

    * fallback: a JSON list of ``{"name", "arguments"}`` (a single such object is taken too);
    * ``hermes``: ``<tool_call>`` blocks of ``{"name", "arguments"}`` (the last one's closing tag may be missing,
      as the answer may end there; ``arguments`` may be the JSON text of the object), the text around them kept;
    * ``llama3-json``: one ``{"name", "parameters"}`` object (``arguments`` is taken for ``parameters`` too)."""
    if spec.format == "hermes":
        blocks = list(_HERMES_BLOCK.finditer(text))
        if not blocks or (len(blocks) > 1 and not spec.parallel):
            return text, ()
        entries = []
        for block in blocks:
            try:
                entries.append(json.loads(block.group(1)))
            except ValueError:
                return text, ()
        calls = _calls(entries, spec, call_prefix, ("arguments",), _spans(text, spec), decode=True)
        edges = [0, *(i for b in blocks for i in b.span()), len(text)]
        beside = "".join(text[a:b] for a, b in zip(edges[::2], edges[1::2], strict=True))
        return ((beside if beside.strip() else ""), calls) if calls else (text, ())
    try:
        doc = json.loads(text)
    except ValueError:
        return text, ()
    if spec.format == "llama3-json":
        keys = ("parameters", "arguments")
        calls = _calls([doc], spec, call_prefix, keys, _spans(text, spec)) if isinstance(doc, dict) else ()
    else:
        entries = [doc] if isinstance(doc, dict) else doc
        ok = isinstance(entries, list) and bool(entries) and (len(entries) == 1 or spec.parallel)
        calls = _calls(entries, spec, call_prefix, ("arguments",), _spans(text, spec)) if ok else ()
    return ("", calls) if calls else (text, ())


def read_calls(text: str, spec: ToolSpec, call_prefix: str) -> tuple[ToolCall, ...]:
    """The calls ``text`` makes in ``spec``'s format (:func:`read_answer`); () when it is not calls."""
    return read_answer(text, spec, call_prefix)[1]


def _argument_keys(spec: ToolSpec) -> tuple[str, ...]:
    """The member names of a call's arguments in ``spec``'s format."""
    return ("parameters", "arguments") if spec.format == "llama3-json" else ("arguments",)


def _spans(text: str, spec: ToolSpec) -> dict[int, str]:
    return argument_spans(text, spec.format, _argument_keys(spec))


def _calls(
    entries: list[Any],
    spec: ToolSpec,
    call_prefix: str,
    keys: tuple[str, ...],
    spans: Mapping[int, str],
    decode: bool = False,
) -> tuple[ToolCall, ...]:
    """Each entry a call ``{"name": <a tool offered>, <one of keys>: {arguments}}``; () if any is not.  ``decode``:
    arguments given as the JSON text of an object are taken too.  A call's ``arguments`` is the model's own text of
    them (``spans``: by call, :func:`~edgepath.edge.apis.call_stream.argument_spans`) -- what its streamed pieces
    add up to -- and the object re-encoded only where that text does not hold it (a key given twice)."""
    names = {t.name for t in spec.offered}
    calls = []
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or len(entry) != 2 or "name" not in entry:
            return ()
        key = next((key for key in keys if key in entry), None)
        arguments = entry.get(key) if key is not None else None
        if decode and isinstance(arguments, str):
            arguments = _decoded(arguments)
        if entry["name"] not in names or not isinstance(arguments, dict):
            return ()
        calls.append(ToolCall(f"{call_prefix}_{k}", entry["name"], _own_text(spans.get(k), arguments)))
    return tuple(calls)


def _own_text(span: str | None, arguments: dict[str, Any]) -> str:
    """The model's text of a call's ``arguments``: ``span`` (an object's JSON, or a string's holding it) when it
    reads back as them, else their JSON."""
    try:
        text = json.loads(span) if span is not None and span.startswith('"') else span
        if isinstance(text, str) and json.loads(text) == arguments:
            return text
    except ValueError:
        pass
    return json.dumps(arguments, ensure_ascii=False)


def _encodable(value: Any, where: str) -> None:
    """No unpaired surrogate (not UTF-8) anywhere in ``value``."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ToolsRefused(where, f"'{where}' holds an unpaired surrogate escape, which is not valid UTF-8") from None
