"""OpenAI's Responses API on the edge: the route bound to the lifecycle and its answers, whole or streamed.

A body becomes the one chat :class:`~edgepath.edge.http.Work` item every shape makes
(:func:`edgepath.edge.apis.conversation.chat_work`); the answer's ids go through the one text pipeline
(:class:`~edgepath.edge.apis.output.OutputText`) and come out as a ``Response`` whose ``output`` holds a
``reasoning`` item when the model thought, a ``message`` with its ``output_text``, and ``function_call`` items --
or as the typed event stream: ``response.created``, ``response.in_progress``, per item
``response.output_item.added`` / its deltas (``response.reasoning_text.delta``, ``response.output_text.delta``
inside ``response.content_part.added`` / ``.done``, ``response.function_call_arguments.delta``) /
``response.output_item.done``, then ``response.completed`` (``response.incomplete`` when ``max_output_tokens``
cut it), every event numbered by ``sequence_number``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import orjson

from edgepath.edge.apis import openai as oa
from edgepath.edge.apis.conversation import ChatRoutes, chat_work
from edgepath.edge.apis.openai_routes import openai_error
from edgepath.edge.apis.output import EventFormatter, OutputText, Piece
from edgepath.edge.apis.responses import ResponsesRequest, parse_response_request
from edgepath.edge.http import JSON, RESPONSES, HttpError, Outcome, Response, Work
from edgepath.edge.text.tokenizer import Tokenizer


class ResponsesRoutes(ChatRoutes):
    """Parses ``/v1/responses`` requests into :class:`Work` for one served model (an
    :class:`~edgepath.edge.routes.ApiShape`)."""

    errors = oa.OpenAIError

    def error(self, exc: HttpError) -> Response:
        return openai_error(exc)

    def unavailable(self) -> oa.OpenAIError:
        return oa.invalid_request(f"responses are not available: {self.why_not}")

    def parse(self, path: str, body: bytes) -> Work:
        req = parse_response_request(body, self.limits)
        work = chat_work(
            RESPONSES, req.chat, req.constraint, max_tokens=req.max_tokens, stream=req.stream,
            sampling=req.sampling, options={"responses": req}, thinking=req.enable_thinking,
        )  # fmt: skip
        work.cache_salt = req.cache_salt
        return work


def _usage(outcome: Outcome, out: OutputText) -> dict[str, Any]:
    produced = out.token_count
    return {
        "input_tokens": outcome.input_count,
        "input_tokens_details": {"cached_tokens": outcome.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": produced,
        "output_tokens_details": {"reasoning_tokens": out.reasoning_tokens},
        "total_tokens": outcome.input_count + produced,
    }


class ResponsesFormatter(EventFormatter):
    """One Responses answer for the lifecycle (see :class:`edgepath.edge.http.Formatter`)."""

    def __init__(self, request: ResponsesRequest, tokenizer: Tokenizer, rid: str, created: int) -> None:
        self.request = request
        self.rid = rid
        self.created = created
        self.answer_id: str | None = f"resp_{rid}"
        self.model: str | None = request.model
        self.watch = False
        out = OutputText(tokenizer, (), request.chat.tools, f"call_{rid}", request.thinking, count_thinking=True)
        super().__init__(out, request.stream)
        self._seq = 0
        self._started = False
        self._item: str | None = None  # the kind of the output item open on the stream
        self._index = -1
        self._items: list[dict[str, Any]] = []  # the output items the stream has finished
        self._calls: dict[int, dict[str, Any]] = {}  # the function_call items streamed, by call

    # -- the lifecycle's calls --------------------------------------------------------------------------
    def complete(self, outcome: Outcome) -> Response:
        self._feed(outcome.tokens[self._fed :])
        self._out.finish()
        return Response(200, [(b"content-type", JSON)], orjson.dumps(self._response(outcome, self._output())))

    def end(self, outcome: Outcome) -> bytes:
        out = self._opening() + self._feed(outcome.tokens[self._fed :])
        for piece in self._out.finish():
            out += self._piece(piece)
        opened = self._item == "message" or any(item["type"] == "message" for item in self._items)
        if not self._out.calls and not opened:
            out += self._open("message", self._message_item(None, "in_progress"))  # an empty answer: its message
        out += self._close()
        response = self._response(outcome, self._items)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return out + self._event(kind, response=response)

    def failure(self, error: HttpError) -> Response:
        return openai_error(error)

    def error(self, error: HttpError) -> bytes:
        err = oa.OpenAIError.of(error)
        return self._event("error", code=err.code, message=err.message, param=None)

    # -- the answer ---------------------------------------------------------------------------------------
    def _response(self, outcome: Outcome | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        req = self.request
        incomplete = (
            outcome is not None
            and not self._out.calls
            and (outcome.status in ("LENGTH", "RECLAIMED") or self._out.token_count >= req.max_tokens)
        )
        return {
            "id": self.answer_id, "object": "response", "created_at": self.created, "model": req.model,
            "status": "in_progress" if outcome is None else "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "output": output, "instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.sampling.temperature, "top_p": req.sampling.top_p, "tool_choice": req.tool_choice,
            "tools": list(req.tools), "text": {"format": dict(req.text_format)}, "store": False,
            "previous_response_id": None, "truncation": "disabled",
            "reasoning": {"effort": req.effort, "summary": None},
            "usage": None if outcome is None else _usage(outcome, self._out),
        }  # fmt: skip

    def _output(self) -> list[dict[str, Any]]:
        """The whole answer's output items."""
        items: list[dict[str, Any]] = []
        if self._out.reasoning:
            items.append(self._reasoning_item(self._out.reasoning))
        if self._out.text or not self._out.calls:
            items.append(self._message_item(self._out.text))
        items += [
            {"id": f"fc_{self.rid}_{k}", "type": "function_call", "status": "completed", "arguments": c.arguments,
             "call_id": c.id, "name": c.name}
            for k, c in enumerate(self._out.calls)
        ]  # fmt: skip
        return items

    def _reasoning_item(self, text: str, status: str = "completed") -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if text else []
        return {"id": f"rs_{self.rid}", "type": "reasoning", "summary": [], "content": content, "status": status}

    def _message_item(self, text: str | None, status: str = "completed") -> dict[str, Any]:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        return {"id": f"msg_{self.rid}", "type": "message", "role": "assistant", "status": status, "content": content}

    # -- the stream ---------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _opening(self) -> bytes:
        if self._started:
            return b""
        self._started = True
        response = self._response(None, [])
        return self._event("response.created", response=response) + self._event("response.in_progress",
                                                                                 response=response)  # fmt: skip

    def _piece(self, piece: Piece) -> bytes:
        out = b""
        if piece.reasoning:
            out += self._open("reasoning", self._reasoning_item("", "in_progress"))
            out += self._event("response.reasoning_text.delta", item_id=f"rs_{self.rid}", output_index=self._index,
                               content_index=0, delta=piece.reasoning)  # fmt: skip
        if piece.text:
            out += self._open("message", self._message_item(None, "in_progress"))
            out += self._event("response.output_text.delta", item_id=f"msg_{self.rid}", output_index=self._index,
                               content_index=0, delta=piece.text, logprobs=[])  # fmt: skip
        for call in piece.calls:  # each call an item of its own, its arguments as the model writes them
            if call.name is not None:
                item: dict[str, Any] = {"id": f"fc_{self.rid}_{call.index}", "type": "function_call",
                                        "status": "in_progress", "arguments": "", "call_id": call.id,
                                        "name": call.name}  # fmt: skip
                self._calls[call.index] = item
                out += self._open(f"function_call {call.index}", dict(item))
            if call.arguments:
                item = self._calls[call.index]
                item["arguments"] += call.arguments
                out += self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=self._index, delta=call.arguments)  # fmt: skip
        return out

    def _open(self, kind: str, item: dict[str, Any]) -> bytes:
        """Start an output item of ``kind`` unless one is open (the one open before it is finished)."""
        if self._item == kind:
            return b""
        out = self._close()
        self._index += 1
        self._item = kind
        out += self._event("response.output_item.added", output_index=self._index, item=item)
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._event("response.content_part.added", item_id=item["id"], output_index=self._index,
                               content_index=0, part=part)  # fmt: skip
        return out

    def _close(self) -> bytes:
        kind, self._item = self._item, None
        if kind is None:
            return b""
        where = {"output_index": self._index}
        if kind == "reasoning":
            text = self._out.reasoning
            item = self._reasoning_item(text)
            out = self._event("response.reasoning_text.done", item_id=item["id"], **where, content_index=0, text=text)
        elif kind == "message":
            text = self._out.text
            item = self._message_item(text)
            part = item["content"][0]
            out = self._event("response.output_text.done", item_id=item["id"], **where, content_index=0, text=text,
                              logprobs=[])  # fmt: skip
            out += self._event("response.content_part.done", item_id=item["id"], **where, content_index=0, part=part)
        else:  # a function call: its arguments as they went out
            item = {**self._calls[int(kind.split()[1])], "status": "completed"}
            out = self._event("response.function_call_arguments.done", item_id=item["id"], **where,
                              arguments=item["arguments"])  # fmt: skip
        self._items.append(item)
        return out + self._event("response.output_item.done", **where, item=item)


def formatter_factory(clock: Callable[[], float]) -> Callable[[Work, Tokenizer], ResponsesFormatter]:
    """The lifecycle's formatter factory for ``/v1/responses``; ``clock`` (wall seconds) stamps ``created_at``."""
    ids = itertools.count(1)

    def make(work: Work, tokenizer: Tokenizer) -> ResponsesFormatter:
        return ResponsesFormatter(work.options["responses"], tokenizer, f"ep{next(ids)}", int(clock()))

    return make
