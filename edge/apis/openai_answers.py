"""OpenAI's answers, sans I/O: whole responses, server-sent event streams, usage and log probabilities, shaped as
the ``openai`` package's own types (``types/completion.py``, ``types/chat/chat_completion.py``,
``types/chat/chat_completion_chunk.py``, ``types/model.py``).  :class:`Answer` turns one request's output tokens into
text deltas (incremental detokenizing, stop strings, tool calls) and those into OpenAI's chunks or body; the request
side is :mod:`edgepath.edge.apis.openai`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

from edgepath.edge.apis.call_stream import CallDelta
from edgepath.edge.apis.openai import SSE_DONE, FinishReason, Kind, OpenAIRequest, dumps, sse_event
from edgepath.edge.apis.output import OutputText, Piece
from edgepath.edge.apis.tools import ToolCall
from edgepath.edge.text.detokenize import Decoder

# -- responses ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """Exact token counts of one request.  ``cached_tokens``: prompt tokens the model side reused from its
    prefix cache (OpenAI's ``usage.prompt_tokens_details.cached_tokens``); None: not known, left out."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.completion_tokens < 0:
            raise ValueError(f"token counts cannot be negative: {self}")
        if self.cached_tokens is not None and not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(f"cached tokens must be between 0 and the prompt's tokens: {self}")

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            body["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return body


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log probability, and its likeliest alternatives (text, log probability), likeliest
    first; ``token`` is the token's text decoded alone (a token that is part of a character shows as U+FFFD)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


def _chat_entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def logprobs_payload(kind: Kind, entries: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """A choice's ``logprobs`` in OpenAI's shape: chat's ``{content: [{token, logprob, bytes, top_logprobs}],
    refusal}``, or the completions route's ``{tokens, token_logprobs, top_logprobs, text_offset}`` (offsets of
    each token's text in the answer, from ``text_offset``)."""
    if kind == "chat":
        content = [
            {**_chat_entry(e.token, e.logprob), "top_logprobs": [_chat_entry(t, lp) for t, lp in e.top]}
            for e in entries
        ]
        return {"content": content, "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }


def response_id(kind: Kind, request_id: int | str) -> str:
    """``cmpl-…`` or ``chatcmpl-…`` from the edge's own request id (no randomness here)."""
    rid = str(request_id)
    if not rid or not all(c.isascii() and (c.isalnum() or c in "-_") for c in rid):
        raise ValueError(f"request id must be non-empty letters, digits, '-' or '_', got {request_id!r}")
    return f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{rid}"


def text_completion(
    request_id: int | str, created: int, model: str, text: str, finish_reason: FinishReason, usage: Usage
) -> dict[str, Any]:
    """A non-streamed ``text_completion`` object."""
    return _whole("completion", request_id, created, model, text, finish_reason, usage)


def chat_completion(
    request_id: int | str, created: int, model: str, text: str, finish_reason: FinishReason, usage: Usage
) -> dict[str, Any]:
    """A non-streamed ``chat.completion`` object."""
    return _whole("chat", request_id, created, model, text, finish_reason, usage)


class Extras(TypedDict, total=False):
    """What a whole answer may carry beyond its text (:func:`completion_body` says what each is)."""

    logprobs: Sequence[TokenLogprob] | None
    tool_calls: Sequence[ToolCall]
    index: int
    details: Mapping[str, str] | None
    reasoning: str | None


def _whole(
    kind: Kind,
    request_id: int | str,
    created: int,
    model: str,
    text: str,
    finish_reason: FinishReason,
    usage: Usage,
    fingerprint: str | None = None,
    **extras: Unpack[Extras],
) -> dict[str, Any]:
    logprobs, tool_calls, index = extras.get("logprobs"), extras.get("tool_calls", ()), extras.get("index", 0)
    details, reasoning = extras.get("details"), extras.get("reasoning")
    reason = _finish(finish_reason)
    shaped = None if logprobs is None else logprobs_payload(kind, logprobs)
    if kind == "completion":
        choice = {"text": text, "index": index, "logprobs": shaped, "finish_reason": reason}
    else:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if tool_calls:  # OpenAI's shape: the calls, and no content unless text came beside them
            message.update(content=text or None, tool_calls=[c.payload() for c in tool_calls])
        if reasoning is not None:  # a thinking model's thinking, where vLLM and llama-server put it
            message["reasoning_content"] = reasoning or None
        choice = {"index": index, "message": message, "logprobs": shaped, "finish_reason": reason}
    if details is not None:
        choice["finish_details"] = dict(details)
    return {
        "id": response_id(kind, request_id),
        "object": "text_completion" if kind == "completion" else "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [choice],
        "usage": usage.payload(),
    }


def completion_body(
    request: OpenAIRequest,
    request_id: int | str,
    created: int,
    text: str,
    finish_reason: FinishReason,
    usage: Usage,
    **extras: Unpack[Extras],
) -> bytes:
    """The JSON body of a non-streamed answer to ``request``, whichever endpoint it came from (``logprobs``: the
    tokens' entries when the request asked for them; ``tool_calls``: the calls the answer made; ``index``: the
    choice's, of ``n``; ``details``: why it ended, beside ``finish_reason``, when the answer was cut short by the
    server: :data:`~edgepath.edge.http.RECLAIMED`; ``reasoning``: a thinking model's thinking, None when its
    template does not think)."""
    kind, model, fingerprint = request.kind, request.model, request.fingerprint
    return dumps(_whole(kind, request_id, created, model, text, finish_reason, usage, fingerprint, **extras))


def models_list(models: Sequence[str], created: int, owned_by: str = "edgepath") -> dict[str, Any]:
    """The ``GET /v1/models`` body."""
    return {
        "object": "list",
        "data": [{"id": m, "object": "model", "created": created, "owned_by": owned_by} for m in models],
    }


class StreamEncoder:
    """The server-sent events of one streamed answer, in OpenAI's chunk shape.

    Call :meth:`start` once, :meth:`text` for each text delta, :meth:`finish` once with the reason,
    then :meth:`end` (the usage chunk when ``include_usage``, then ``data: [DONE]``).  Each returns
    the bytes to send.  Chat streams open with a chunk carrying the ``assistant`` role; completion
    streams have no such chunk (``start`` returns nothing for them).  One choice of several (``index``) leaves
    the end to its group (``closes`` false: :meth:`end` sends nothing; :meth:`closing` ends the whole stream).
    """

    def __init__(
        self,
        kind: Kind,
        request_id: int | str,
        created: int,
        model: str,
        include_usage: bool,
        index: int = 0,
        closes: bool = True,
        fingerprint: str | None = None,
    ) -> None:
        self.kind = kind
        self.fingerprint = fingerprint
        self.index = index
        self.closes = closes
        self.id = response_id(kind, request_id)
        self.created = created
        self.model = model
        self.include_usage = include_usage
        self._state = "new"
        self._offset = 0  # characters of text sent: the completions route's text_offset

    @classmethod
    def for_request(cls, request: OpenAIRequest, request_id: int | str, created: int, index: int = 0) -> StreamEncoder:
        """The encoder of choice ``index`` of ``request`` (one of several closes nothing itself)."""
        if not request.stream:
            raise ValueError("StreamEncoder.for_request: the request did not ask for a stream")
        return cls(
            request.kind, request_id, created, request.model, request.include_usage, index, request.n == 1,
            request.fingerprint,
        )  # fmt: skip

    def start(self) -> bytes:
        self._advance("new", "open")
        if self.kind == "completion":
            return b""
        return sse_event(self._chunk({"role": "assistant", "content": ""}, None))

    def text(self, delta: str, logprobs: Sequence[TokenLogprob] | None = None) -> bytes:
        """A text delta and the entries of the tokens it came from, when asked for (a chunk with neither sends
        nothing; entries whose text is held back come with an empty delta)."""
        self._expect("open")
        if not delta and not logprobs:
            return b""
        shaped = logprobs_payload(self.kind, logprobs, self._offset) if logprobs else None
        self._offset += len(delta)
        if self.kind == "completion":
            return sse_event(self._chunk(delta, None, shaped))
        return sse_event(self._chunk({"content": delta}, None, shaped))

    def reasoning(self, delta: str) -> bytes:
        """A thinking model's thinking, in ``delta.reasoning_content`` (vLLM's and llama-server's name)."""
        self._expect("open")
        return sse_event(self._chunk({"reasoning_content": delta}, None)) if delta else b""

    def tool_calls(self, deltas: Sequence[CallDelta]) -> bytes:
        """The pieces of the answer's calls as OpenAI streams them: a call's first chunk with its index, id, type and
        name (and empty arguments), then a chunk per piece of its arguments."""
        self._expect("open")
        out = b""
        for d in deltas:
            if d.name is not None:
                function = {"name": d.name, "arguments": ""}
                head = {"index": d.index, "id": d.id, "type": "function", "function": function}
                out += sse_event(self._chunk({"tool_calls": [head]}, None))
            if d.arguments:
                piece = {"index": d.index, "function": {"arguments": d.arguments}}
                out += sse_event(self._chunk({"tool_calls": [piece]}, None))
        return out

    def finish(self, finish_reason: FinishReason, details: Mapping[str, str] | None = None) -> bytes:
        self._advance("open", "finished")
        reason = _finish(finish_reason)
        chunk = self._chunk("" if self.kind == "completion" else {}, reason)
        if details is not None:
            chunk["choices"][0]["finish_details"] = dict(details)
        return sse_event(chunk)

    def end(self, usage: Usage | None) -> bytes:
        """The usage chunk (when the client asked for it: ``usage`` is then required) and ``[DONE]``."""
        self._advance("finished", "ended")
        return self.closing(usage) if self.closes else b""

    def closing(self, usage: Usage | None) -> bytes:
        """The end of the whole stream: the usage chunk (when the client asked for it) and ``[DONE]``."""
        if not self.include_usage:
            return SSE_DONE
        if usage is None:
            raise ValueError("the client asked for stream_options.include_usage: the stream's end needs the usage")
        return sse_event(self._envelope([], usage.payload())) + SSE_DONE

    def _chunk(self, delta: Any, finish_reason: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "completion":
            choice = {"text": delta, "index": self.index, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope([choice], None)

    def _envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion" if self.kind == "completion" else "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        }
        if self.include_usage:
            # OpenAI: with include_usage every chunk has "usage", null except on the last one.
            chunk["usage"] = usage
        return chunk

    def _advance(self, expected: str, new: str) -> None:
        self._expect(expected)
        self._state = new

    def _expect(self, expected: str) -> None:
        if self._state != expected:
            raise RuntimeError(f"StreamEncoder: stream is {self._state!r}, this call needs {expected!r}")


@dataclass(frozen=True, slots=True)
class AnswerStep:
    """What :meth:`Answer.feed` gives back."""

    data: bytes
    """Bytes to send now: SSE events for a stream, nothing for a non-streamed answer."""
    stopped: bool
    """A stop string matched: cancel the slot, then call :meth:`Answer.finish` with ``"stop"``."""


class Answer:
    """One request's answer, from output token ids to the bytes a client receives.

    The ids go through :class:`~edgepath.edge.apis.output.OutputText` (detokenized without broken characters, cut
    at a stop string with nothing of it leaked, the model's thinking split from its answer, tool calls read back),
    then through :class:`StreamEncoder` for ``stream: true`` or into one JSON body at the end otherwise.
    ``completion_tokens`` counts every id fed, i.e. what the model produced for this request,
    including ids that arrived after a stop matched (they were generated before the cancel landed).
    """

    def __init__(
        self,
        request: OpenAIRequest,
        tokenizer: Decoder,
        request_id: int | str,
        created: int,
        prompt_tokens: int,
        index: int = 0,
    ) -> None:
        """``index``: which choice of the request's ``n`` this answer is."""
        self.request = request
        self.index = index
        self.request_id = request_id
        self.created = created
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: int | None = None  # known once the model side has answered
        self._out = OutputText(tokenizer, request.stop, request.tools, f"call_{request_id}", request.thinking)
        self._stream = StreamEncoder.for_request(request, request_id, created, index) if request.stream else None
        self._logprobs: list[TokenLogprob] = []
        self._state = "new"

    @property
    def text(self) -> str:
        """The answer's text released so far (all of it once finished)."""
        return self._out.text

    @property
    def completion_tokens(self) -> int:
        return self._out.token_count

    @property
    def stopped(self) -> bool:
        return self._out.stopped

    def start(self) -> bytes:
        """The opening bytes of a stream (the chat role chunk), sent before the first token."""
        self._expect("new")
        self._state = "open"
        return self._stream.start() if self._stream is not None else b""

    def feed(self, ids: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> AnswerStep:
        """The next output ids from the model side, and their entries when the request asked for log
        probabilities (one per id; those that come after a stop string matched are dropped with their ids)."""
        self._expect("open")
        if self._out.stopped:
            self._out.feed(ids)
            return AnswerStep(b"", True)
        if logprobs:
            self._logprobs.extend(logprobs)
        piece = self._out.feed(ids, logprobs or ())
        return AnswerStep(self._send(piece), self._out.stopped)

    def finish(self, reason: FinishReason, details: Mapping[str, str] | None = None) -> bytes:
        """The model side ended (``"length"`` at max_tokens, ``"stop"`` at its end-of-sequence) or a stop
        string matched (``"stop"``); ``details``: why the server cut it short, when it did
        (:data:`~edgepath.edge.http.RECLAIMED`).  Returns the closing SSE events and ``[DONE]``, or the JSON body."""
        self._expect("open")
        if self._out.stopped and reason != "stop":
            raise ValueError(f"a stop string matched, so the finish reason is 'stop', not {reason!r}")
        self._state = "finished"
        out = b"".join(self._send(piece) for piece in self._out.finish())
        if self._out.stopped:
            reason = "stop"
        calls = self._out.calls
        if calls:
            reason = "tool_calls"
        usage = self.usage()
        if self._stream is None:
            logprobs = self._logprobs if self.request.logprobs is not None else None
            reasoning = self._out.reasoning if self.request.thinking is not None else None
            return completion_body(
                self.request,
                self.request_id,
                self.created,
                self.text,
                reason,
                usage,
                logprobs=logprobs,
                tool_calls=calls,
                index=self.index,
                details=details,
                reasoning=reasoning,
            )
        return (
            out + self._stream.finish(reason, details) + self._stream.end(usage if self._stream.include_usage else None)
        )

    def usage(self) -> Usage:
        """This answer's token counts (final once :meth:`finish` was called)."""
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def closing(self, usage: Usage) -> bytes:
        """The end of a stream of several choices, which the group sends after the last one's finish."""
        assert self._stream is not None, "only a stream is closed"
        return self._stream.closing(usage if self._stream.include_usage else None)

    def _send(self, piece: Piece) -> bytes:
        """A piece's chunks on a stream (nothing for a whole answer, which is written at the end)."""
        if self._stream is None:
            return b""
        out = self._stream.reasoning(piece.reasoning) if piece.reasoning else b""
        out += self._stream.text(piece.text, piece.entries)
        return out + (self._stream.tool_calls(piece.calls) if piece.calls else b"")

    def _expect(self, state: str) -> None:
        if self._state != state:
            raise RuntimeError(f"Answer: it is {self._state!r}, this call needs {state!r}")


def _finish(reason: str) -> str:
    if reason not in ("stop", "length", "tool_calls"):
        raise ValueError(f"finish_reason must be 'stop', 'length' or 'tool_calls', got {reason!r}")
    return reason
