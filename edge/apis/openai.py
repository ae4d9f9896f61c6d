"""OpenAI-compatible API, sans-I/O: request validation, error bodies, response and stream builders.

People point the ``openai`` client, LangChain, curl scripts and load testers at an OpenAI-compatible
endpoint, so the shapes here follow the ``openai`` package's own types (``types/completion.py``,
``types/chat/chat_completion.py``, ``types/chat/chat_completion_chunk.py``, ``types/model.py``).

Nothing here touches a socket, a clock or a random source: the service passes the request id, the
``created`` time, the token counts and where fresh seeds come from in, and sends the bytes that come back.
Every field is applied, or taken because it cannot change the answer, or refused with a 400 naming it
(:mod:`edgepath.edge.apis.openai_fields`): a client must never get a silently different answer.  The sampling
fields (``temperature``, ``top_p``, ``seed``, the penalties, ``logit_bias``, and ``top_k``, ``min_p`` and
``repetition_penalty`` as vLLM's and llama.cpp's servers take them) are parsed by
:mod:`edgepath.edge.apis.sampling`, the one parser ``/v1/generate`` uses too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from edgepath.contract.wire import TOP_LOGPROBS_MAX, Sampling, record_words
from edgepath.edge.apis import thinking_fields
from edgepath.edge.apis import tools as tool_calling
from edgepath.edge.apis.conversation import NoGrammar, conversation
from edgepath.edge.apis.limits import STOPS_MAX, LimitExceeded, check_messages
from edgepath.edge.apis.openai_fields import FieldRefused, check_fields
from edgepath.edge.apis.sampling import (
    OPENAI_DEFAULT,
    SamplingInvalid,
    fresh_seed,
    parse_cache_salt,
    parse_sampling,
    parse_stops,
    show,
)
from edgepath.edge.apis.structured import FormatRefused, grammar_of
from edgepath.edge.apis.tools import ToolFormat, ToolSpec, ToolsRefused, ToolTurn
from edgepath.edge.http import ApiError, BodyProblem, Grammar, Headers, HttpError, json_object, json_type
from edgepath.edge.text.chat import ChatMessage
from edgepath.edge.text.thinking import Thinking, ThinkingFixed, ThinkingModes

Kind = Literal["completion", "chat"]
FinishReason = Literal["stop", "length", "tool_calls"]

ROLES = ("system", "user", "assistant", "tool")
#: most alternatives per token of the completions route's ``logprobs`` (OpenAI's limit there)
COMPLETION_LOGPROBS_MAX = 5
SSE_DONE = b"data: [DONE]\n\n"


# -- errors ---------------------------------------------------------------------------------------------

#: OpenAI's error ``type`` for each status this server answers with (the ``code`` is the error's own name)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "requests",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout",
}


class OpenAIError(ApiError):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    Every error on the OpenAI routes is one of these -- the routes' own validation and, through
    :meth:`of`, every refusal or failure of the edge (429 ``no_slot``, 504 ``timeout``, ...) -- so the
    ``type`` always follows from the status by one table, :data:`ERROR_TYPES`."""

    def __init__(
        self, status: int, code: str | None, message: str, *, param: str | None = None, headers: Headers | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = ERROR_TYPES.get(status, "server_error")
        self.param = param
        self.code = code
        self.headers: Headers = list(headers or [])

    @classmethod
    def of(cls, exc: HttpError) -> OpenAIError:
        """The edge's error ``exc`` in OpenAI's shape; ``code`` keeps its name (``no_slot``, ``timeout``)."""
        return cls(exc.status, exc.type, exc.message, param=exc.param, headers=exc.headers)

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def body(self) -> bytes:
        return dumps(self.payload())

    def event(self) -> bytes:
        """The end of a stream that failed after it had started: the error as an event, then ``[DONE]``."""
        return sse_event(self.payload()) + SSE_DONE


def invalid_request(message: str, *, param: str | None = None, code: str | None = None) -> OpenAIError:
    """400 ``invalid_request_error``: the request is malformed or asks for something not allowed."""
    return OpenAIError(400, code, message, param=param)


def unsupported(param: str, value: Any, allowed: str) -> OpenAIError:
    """400 for an option edgepath cannot honour without changing the answer."""
    return invalid_request(
        f"'{param}' = {show(value)} is not supported by this server; allowed: {allowed}",
        param=param,
        code="unsupported_parameter",
    )


def model_not_found(model: str, available: Sequence[str]) -> OpenAIError:
    """404 ``model_not_found``, naming the models this server does serve (as GET /v1/models lists them)."""
    return OpenAIError(
        404,
        "model_not_found",
        f"the model {model!r} does not exist on this server; available: {', '.join(map(repr, available))}",
        param="model",
    )


# -- requests -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenAILimits:
    """What a request may ask for on this server."""

    max_tokens: int
    """Most tokens one answer may have (the slot ABI's output capacity); also the default."""
    vocab_size: int
    """Token ids in a ``prompt`` given as ids must be below this."""
    models: tuple[str, ...]
    """Model names served (what ``GET /v1/models`` lists); ``model`` must be one of them."""
    logprobs: bool = False
    """Whether the model side computes log probabilities (the llama handler does; echo handlers do not)."""
    grammars: bool = False
    """Whether the model side enforces a grammar (``response_format`` json_object / json_schema: the llama handler)."""
    tool_format: ToolFormat = "fallback"
    """How tools are offered to the model and its calls read (:func:`edgepath.edge.apis.tools.template_format`)."""
    choices: int = 1
    """Most choices (``n``) one request may ask for: each takes a slot, all on one slot server, claimed together."""
    thinking: ThinkingModes = field(default_factory=ThinkingModes)
    """How the chat template's model thinks, with thinking on and off (:mod:`edgepath.edge.text.thinking`)."""
    fingerprint: str | None = None
    """The answers' ``system_fingerprint``: which model and build answer (None: not known)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1 or self.vocab_size < 1 or not self.models:
            raise ValueError(f"OpenAILimits needs max_tokens >= 1, vocab_size >= 1 and a model name: {self}")


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` request.

    Exactly one input is set: ``prompt`` (text), ``prompt_ids`` (token ids, completions only) or
    ``messages`` (chat: render them with the model's chat template, :mod:`edgepath.edge.text.chat`)."""

    kind: Kind
    model: str
    max_tokens: int
    sampling: Sampling = field(default_factory=Sampling)  # as it travels in the request header
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage | ToolTurn, ...] | None = None
    """The chat: plain turns, and -- when the template renders tools itself -- turns with calls and results."""
    template_tools: tuple[Mapping[str, Any], ...] | None = None
    """The tools a template that has tools renders (``tools``); None with the fallback or no tools offered."""
    cache_salt: str | None = None  # the prefix cache namespace within the tenant's (as vLLM's cache_salt)
    logprobs: int | None = None
    """None: no log probabilities; else how many likeliest alternatives each token's entry lists."""
    constraint: Grammar | None = None
    """The grammar the answer must match (``response_format``, or the calls of ``tool_choice`` required), checked and
    built later off the event loop, or None."""
    tools: ToolSpec | None = None
    """The tools offered to the model (chat's ``tools``, not ``tool_choice`` ``none``): its answer is read as calls."""
    n: int = 1
    """Choices to generate for the one prompt (:mod:`edgepath.edge.choices`)."""
    thinking: Thinking | None = None
    """How the chat template's model thinks (its thinking goes to ``reasoning_content``); None: it does not."""
    enable_thinking: bool = True
    """False: the request turned the thinking off (the template rendered with ``enable_thinking`` false)."""
    fingerprint: str | None = None
    """The server's ``system_fingerprint`` (:attr:`OpenAILimits.fingerprint`), for the answer."""
    ignore_eos: bool = False
    """vLLM's and llama.cpp's ``ignore_eos``: the model's end-of-generation tokens are never drawn."""


def parse_completion_request(
    body: bytes | Mapping[str, Any], limits: OpenAILimits, seeds: Callable[[], int] = fresh_seed
) -> OpenAIRequest:
    """Validate a ``POST /v1/completions`` body; raises :class:`OpenAIError` (``seeds``: where a request that
    samples without a seed gets one)."""
    doc = document(body)
    _check_fields(doc, "completion")
    prompt, prompt_ids = _completion_prompt(doc, limits.vocab_size)
    top = _completion_logprobs(doc)
    return _common(
        doc,
        "completion",
        limits,
        _max_tokens(doc, *_cap(limits, top, "logprobs")),
        seeds,
        prompt=prompt,
        prompt_ids=prompt_ids,
        logprobs=top,
    )


def parse_chat_request(
    body: bytes | Mapping[str, Any], limits: OpenAILimits, seeds: Callable[[], int] = fresh_seed
) -> OpenAIRequest:
    """Validate a ``POST /v1/chat/completions`` body; raises :class:`OpenAIError` (``seeds``: as for
    :func:`parse_completion_request`)."""
    doc = document(body)
    _check_fields(doc, "chat")
    messages, tools, tools_grammar, template_tools = _tool_calling(doc, _messages(doc), limits)
    top = _chat_logprobs(doc)
    legacy = _max_tokens(doc, *_cap(limits, top, "top_logprobs"), "max_tokens")
    current = _max_tokens(doc, *_cap(limits, top, "top_logprobs"), "max_completion_tokens")
    if _given(doc, "max_tokens") and _given(doc, "max_completion_tokens") and legacy != current:
        raise invalid_request(
            f"'max_tokens' ({legacy}) and 'max_completion_tokens' ({current}) disagree; give one of them",
            param="max_completion_tokens",
            code="invalid_value",
        )
    max_tokens = current if _given(doc, "max_completion_tokens") else legacy
    constraint = _constraint(doc, limits)
    if tools is not None and constraint is not None:
        raise invalid_request(
            "'response_format' other than text cannot be combined with 'tools' (the answer may be tool calls); "
            "give 'tool_choice': 'none' or drop one of them",
            param="response_format",
            code="invalid_value",
        )
    enabled, thinking = _thinking(doc, limits)
    return _common(
        doc, "chat", limits, max_tokens, seeds, messages=messages, logprobs=top,
        constraint=constraint or tools_grammar, tools=tools, template_tools=template_tools, thinking=thinking,
        enable_thinking=enabled,
    )  # fmt: skip


def _thinking(doc: Mapping[str, Any], limits: OpenAILimits) -> tuple[bool, Thinking | None]:
    """Whether the request lets the model think (``chat_template_kwargs.enable_thinking``, ``reasoning_effort``:
    :mod:`edgepath.edge.apis.thinking_fields`), and how its answer is split then."""
    try:
        asked = thinking_fields.chat_thinking(doc)
    except thinking_fields.ThinkingRefused as exc:
        raise invalid_request(exc.message, param=exc.param, code="unsupported_parameter") from None
    enabled = asked is not False
    try:
        return enabled, limits.thinking.choose(enabled)
    except ThinkingFixed as exc:
        by_kwargs = (doc.get("chat_template_kwargs") or {}).get("enable_thinking") is False
        param, value = ("chat_template_kwargs.enable_thinking", False) if by_kwargs else (
            "reasoning_effort", doc.get("reasoning_effort"))  # fmt: skip
        raise unsupported(param, value, f"thinking on: {exc}") from None


def _tool_calling(
    doc: Mapping[str, Any], turns: Sequence[ChatMessage | ToolTurn], limits: OpenAILimits
) -> tuple[tuple[ChatMessage | ToolTurn, ...], ToolSpec | None, Grammar | None, tuple[Mapping[str, Any], ...] | None]:
    """The conversation as the model sees it, the tools, the calls' grammar when they are enforced, and the tools
    the template renders (:func:`edgepath.edge.apis.conversation.conversation`, the one way every shape does it)."""
    try:
        spec = tool_calling.parse_tools(doc, limits.tool_format)
        chat = conversation(turns, spec, limits.tool_format, limits.grammars)
    except ToolsRefused as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None
    except FormatRefused as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None
    except NoGrammar:
        raise unsupported(
            "tool_choice", doc.get("tool_choice"), "'none' or 'auto' (this model side enforces no grammar)"
        ) from None
    return chat.messages, chat.tools, chat.constraint, chat.template_tools


def served_model(doc: Mapping[str, Any], models: Sequence[str]) -> str:
    """The request's ``model``, one of the ``models`` this server serves: 400 when it is missing or not a string,
    404 ``model_not_found`` when it is another (OpenAI's chat, completions and Responses alike)."""
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request(
            f"'model' must be a non-empty string naming a served model, got {show(model)}; "
            f"available: {', '.join(map(repr, models))}",
            param="model",
            code="missing_required_parameter" if model is None else "invalid_type",
        )
    if model not in models:
        raise model_not_found(model, models)
    return model


def turn_list(raw: Any, param: str, shape: str, what: str = "messages") -> list[Any]:
    """``raw``, the turns of a chat (``param``: its field, ``shape``: what it must be, ``what``: what its entries are
    called), when it is a non-empty list of at most :data:`~edgepath.edge.apis.limits.MESSAGES_MAX`; else 400
    ``missing_required_parameter``, ``invalid_type`` or ``limit_exceeded`` (OpenAI's chat and Responses alike)."""
    if not isinstance(raw, list) or not raw:
        raise invalid_request(
            f"'{param}' must be {shape}, got {show(raw)}",
            param=param,
            code="missing_required_parameter" if raw is None else "invalid_type",
        )
    try:
        check_messages(len(raw), param, what)
    except LimitExceeded as exc:
        raise invalid_request(exc.message, param=exc.param, code="limit_exceeded") from None
    return raw


def checked_role(turn: Mapping[str, Any], where: str, roles: Collection[str]) -> str:
    """The ``role`` of the turn at ``where``, one of ``roles`` (its shape's); else 400 ``invalid_value`` naming them."""
    role = turn.get("role")
    if not isinstance(role, str) or role not in roles:
        raise invalid_request(
            f"'{where}.role' = {show(role)} is not supported; allowed: {', '.join(roles)}",
            param=f"{where}.role",
            code="invalid_value",
        )
    return role


def document(body: bytes | Mapping[str, Any]) -> Mapping[str, Any]:
    """A request body of OpenAI's routes (chat, completions, Responses) as the JSON object it must be; else 400
    ``invalid_json`` (``invalid_type`` for JSON that is no object)."""
    return json_object(body, _refuse_body)


def _refuse_body(problem: str, kind: BodyProblem) -> OpenAIError:
    return invalid_request(f"the request body {problem}", code="invalid_type" if kind == "type" else "invalid_json")


def _common(
    doc: Mapping[str, Any],
    kind: Kind,
    limits: OpenAILimits,
    max_tokens: int,
    seeds: Callable[[], int],
    **inputs: Any,
) -> OpenAIRequest:
    model = served_model(doc, limits.models)
    stream = _optional_bool(doc, "stream", False)
    return OpenAIRequest(
        n=_choices(doc, limits),
        kind=kind,
        model=model,
        max_tokens=max_tokens,
        sampling=_sampling(doc, limits.vocab_size, seeds),
        stop=_stop(doc),
        stream=stream,
        include_usage=_include_usage(doc, stream),
        cache_salt=_cache_salt(doc),
        fingerprint=limits.fingerprint,
        ignore_eos=_optional_bool(doc, "ignore_eos", False),
        **inputs,
    )


def _choices(doc: Mapping[str, Any], limits: OpenAILimits) -> int:
    """``n``: how many choices, each on a slot of its own (all on one slot server, claimed all or none)."""
    value = doc.get("n")
    if value is None:
        return 1
    if type(value) is not int or not 1 <= value <= limits.choices:
        raise invalid_request(
            f"'n' must be an integer in 1..{limits.choices} (choices per request: each takes a slot of one slot "
            f"server, claimed together), got {show(value)}",
            param="n",
            code="invalid_value",
        )
    return value


def _check_fields(doc: Mapping[str, Any], kind: Kind) -> None:
    """400 for a field the route neither applies, nor takes as harmless, nor finds at a value that changes nothing."""
    try:
        check_fields(doc, kind)
    except FieldRefused as exc:
        raise invalid_request(exc.message, param=exc.param, code=exc.code) from None


def _completion_prompt(doc: Mapping[str, Any], vocab_size: int) -> tuple[str | None, tuple[int, ...] | None]:
    shape = "a string, a list with one string, a list of token ids, or a list with one list of token ids"
    if "prompt" not in doc or doc["prompt"] is None:
        raise invalid_request(f"'prompt' is required: {shape}", param="prompt", code="missing_required_parameter")
    prompt = doc["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid_request("'prompt' is empty", param="prompt", code="invalid_value")
        check_utf8(prompt, "prompt")
        return prompt, None
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise invalid_request(
                f"'prompt' holds token id {bad}; ids must be in 0..{vocab_size - 1}",
                param="prompt",
                code="invalid_value",
            )
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise invalid_request(
            f"'prompt' holds {len(prompt)} prompts; this server takes one prompt per request",
            param="prompt",
            code="unsupported_value",
        )
    raise invalid_request(f"'prompt' must be {shape}, got {show(prompt)}", param="prompt", code="invalid_type")


def _messages(doc: Mapping[str, Any]) -> tuple[ChatMessage | ToolTurn, ...]:
    messages = turn_list(doc.get("messages"), "messages", "a non-empty list of {role, content} objects")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _message(m: Any, where: str) -> ChatMessage | ToolTurn:
    if not isinstance(m, dict):
        raise invalid_request(f"'{where}' must be an object with 'role' and 'content', got {json_type(m)}", param=where)
    role = checked_role(m, where, ROLES)
    if m.get("function_call") is not None:
        raise unsupported(f"{where}.function_call", m["function_call"], "none (deprecated: give 'tool_calls')")
    calls = m.get("tool_calls") not in (None, [])
    if role == "tool" or calls:
        content = None if m.get("content") is None and role == "assistant" else _content(m, role, where).content
        try:
            return tool_calling.turn(role, content, m, where)
        except ToolsRefused as exc:
            raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None
    return _content(m, role, where)


def _content(m: Mapping[str, Any], role: str, where: str) -> ChatMessage:
    content = m.get("content")
    if isinstance(content, str):
        check_utf8(content, f"{where}.content")
        return ChatMessage(role, content)
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise invalid_request(
                    f'\'{where}.content[{j}]\' must be {{"type": "text", "text": str}}, got {show(part)}; '
                    "only text parts are supported",
                    param=f"{where}.content[{j}]",
                    code="invalid_value" if kind != "text" else "invalid_type",
                )
            check_utf8(part["text"], f"{where}.content[{j}].text")
            texts.append(part["text"])
        # Several text parts are one message: joined by newlines, as vLLM does.
        return ChatMessage(role, "\n".join(texts))
    raise invalid_request(
        f"'{where}.content' must be a string or a list of text parts, got {show(content)}",
        param=f"{where}.content",
        code="invalid_type",
    )


def _constraint(doc: Mapping[str, Any], limits: OpenAILimits) -> Grammar | None:
    """``response_format`` as the grammar the model side enforces (:mod:`edgepath.edge.apis.structured`), or None."""
    fmt = doc.get("response_format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not limits.grammars:
        raise unsupported("response_format", fmt, '{"type": "text"} (this model side enforces no grammar)')
    try:
        return grammar_of(fmt)
    except FormatRefused as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None


def _chat_logprobs(doc: Mapping[str, Any]) -> int | None:
    """``logprobs`` (true: each token's log probability) and ``top_logprobs`` (0..20 alternatives, with
    ``logprobs`` only, as OpenAI has it): None when not asked, else the alternatives per token."""
    wanted = _optional_bool(doc, "logprobs", False)
    top = doc.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    if type(top) is not int or not 0 <= top <= TOP_LOGPROBS_MAX:
        raise invalid_request(
            f"'top_logprobs' must be an integer in 0..{TOP_LOGPROBS_MAX}, got {show(top)}",
            param="top_logprobs",
            code="invalid_value",
        )
    if not wanted and top == 0:
        return None
    if not wanted:
        raise invalid_request(
            "'top_logprobs' needs 'logprobs': true (the alternatives come with each token's log probability)",
            param="top_logprobs",
            code="invalid_value",
        )
    return top


def _completion_logprobs(doc: Mapping[str, Any]) -> int | None:
    """``logprobs`` of the completions route: null, or how many alternatives per token (0..5)."""
    value = doc.get("logprobs")
    if value is None:
        return None
    if type(value) is not int or not 0 <= value <= COMPLETION_LOGPROBS_MAX:
        raise invalid_request(
            f"'logprobs' must be null or an integer in 0..{COMPLETION_LOGPROBS_MAX} (the likeliest alternatives "
            f"listed per token), got {show(value)}",
            param="logprobs",
            code="invalid_value",
        )
    return value


def _cap(limits: OpenAILimits, top: int | None, param: str) -> tuple[int, str]:
    """Most tokens one answer may have, and why: a slot's output holds ``max_tokens`` words, and with log
    probabilities each token takes a record of them (contract/wire/logprobs.py)."""
    if top is None:
        return limits.max_tokens, "this server's most tokens per answer"
    if not limits.logprobs:
        raise invalid_request(
            f"'{param}' is not supported by this server: its model side does not compute log probabilities "
            "(the llama handler does)",
            param=param,
            code="unsupported_parameter",
        )
    cap = limits.max_tokens // record_words(top)
    if cap < 1:
        raise invalid_request(
            f"this server's answers hold {limits.max_tokens} output words, too few for one token with {top} "
            "log-probability alternatives; ask for fewer",
            param=param,
            code="invalid_value",
        )
    return cap, f"this server's most tokens per answer with log probabilities and {top} alternatives"


def _max_tokens(doc: Mapping[str, Any], cap: int, why: str, name: str = "max_tokens") -> int:
    value = doc.get(name)
    if value is None:
        return cap
    if type(value) is not int or not 1 <= value <= cap:
        raise invalid_request(
            f"'{name}' must be an integer in 1..{cap} ({why}), got {show(value)}",
            param=name,
            code="invalid_value",
        )
    return value


def _sampling(doc: Mapping[str, Any], vocab_size: int, seeds: Callable[[], int]) -> Sampling:
    """The request's sampling (OpenAI's defaults), parsed as on every route (:mod:`edgepath.edge.apis.sampling`)."""
    try:
        return parse_sampling(doc, OPENAI_DEFAULT, vocab_size=vocab_size, seeds=seeds)
    except SamplingInvalid as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None


def _cache_salt(doc: Mapping[str, Any]) -> str | None:
    try:
        return parse_cache_salt(doc)
    except SamplingInvalid as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None


def _stop(doc: Mapping[str, Any]) -> tuple[str, ...]:
    try:
        return parse_stops(doc.get("stop"), "stop", STOPS_MAX, single=True)
    except SamplingInvalid as exc:
        raise invalid_request(exc.message, param=exc.param, code="invalid_value") from None


def _include_usage(doc: Mapping[str, Any], stream: bool) -> bool:
    options = doc.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid_request(
            "'stream_options' is only allowed when 'stream' is true", param="stream_options", code="invalid_value"
        )
    if not isinstance(options, dict):
        raise invalid_request(
            f"'stream_options' must be an object, got {json_type(options)}",
            param="stream_options",
            code="invalid_type",
        )
    return _optional_bool(options, "include_usage", False, where="stream_options.include_usage")


def _optional_bool(doc: Mapping[str, Any], name: str, default: bool, *, where: str | None = None) -> bool:
    value = doc.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        where = where or name
        raise invalid_request(f"'{where}' must be true or false, got {show(value)}", param=where, code="invalid_type")
    return value


def check_utf8(text: str, where: str) -> None:
    """400 ``invalid_value`` when ``text`` holds an unpaired surrogate (JSON can carry one; UTF-8 cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_request(
            f"'{where}' holds an unpaired surrogate escape, which is not valid UTF-8", param=where, code="invalid_value"
        ) from None


def _given(doc: Mapping[str, Any], name: str) -> bool:
    return doc.get(name) is not None


def sse_event(payload: Mapping[str, Any]) -> bytes:
    """One server-sent event as OpenAI frames it: ``data: <json>`` and a blank line."""
    return b"data: " + dumps(payload) + b"\n\n"


def dumps(payload: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON (orjson: the responses and stream chunks are on every request's path)."""
    return orjson.dumps(payload)
