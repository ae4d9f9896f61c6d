"""OpenAI's routes on the edge: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

The pure pieces live in :mod:`edgepath.edge.apis.openai` (request validation, response and stream shapes,
detokenizer, stop strings); this module binds them to the lifecycle: a body becomes a :class:`Work`
item (sampling parameters travel to the model side in the request header, the chat is tokenized
with the model's own template straight into the frame), and an :class:`OpenAIFormatter` turns
output tokens into OpenAI's JSON or server-sent events.  Errors on these routes are in OpenAI's
shape, so the ``openai`` client raises the exception a user expects (and retries 429 on its own).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from edgepath.contract import wire
from edgepath.edge.apis import openai as oa
from edgepath.edge.apis import openai_answers as oaa
from edgepath.edge.apis import tools as tool_calling
from edgepath.edge.apis.conversation import Conversation, chat_work
from edgepath.edge.apis.sampling import fresh_seed
from edgepath.edge.http import CHAT, JSON, RECLAIMED, Headers, HttpError, Outcome, Response, Work
from edgepath.edge.text.thinking import ThinkingModes, thinking_modes
from edgepath.edge.text.tokenizer import Tokenizer


def openai_error(exc: HttpError) -> Response:
    """An edgepath error on an OpenAI route, in OpenAI's error shape."""
    return oa.OpenAIError.of(exc).response()


@dataclass(frozen=True, slots=True)
class ChatSupport:
    """Whether chat completions can be served: the tokenizer must render the model's own template and
    tokenize it straight into a frame (``encode_chat_into``)."""

    available: bool
    why_not: str = ""
    tool_format: tool_calling.ToolFormat = "fallback"
    """How tools reach the model: the template's own way, or the fallback prompt (:mod:`edgepath.edge.apis.tools`)."""
    thinking: ThinkingModes = field(default_factory=ThinkingModes)
    """How the template's model thinks, with thinking on and off (:mod:`edgepath.edge.text.thinking`)."""


def chat_support(tokenizer: Tokenizer) -> ChatSupport:
    if getattr(tokenizer, "encode_chat_into", None) is None:
        return ChatSupport(False, f"{tokenizer.name} has no chat template; " + oa_chat_hint())
    source = getattr(tokenizer, "chat_template", None)
    if source is None:
        return ChatSupport(False, f"{tokenizer.name} carries no chat template; " + oa_chat_hint())
    return ChatSupport(True, tool_format=tool_calling.template_format(source), thinking=thinking_modes(source))


def oa_chat_hint() -> str:
    return "serve a GGUF model (--model PATH.gguf) whose metadata has one, or give it one with --chat-template FILE"


class OpenAIRoutes:
    """Parses OpenAI requests into :class:`Work` for one served model."""

    def __init__(
        self,
        model: str,
        max_tokens: int,
        vocab_size: int,
        chat: ChatSupport,
        created: int,
        logprobs: bool = False,
        grammars: bool = False,
        choices: int = 1,
        fingerprint: str | None = None,
        seeds: Callable[[], int] = fresh_seed,
    ) -> None:
        """``logprobs``, ``grammars``: whether the model side computes log probabilities and enforces a grammar
        (``response_format``); else asking for them is a 400; ``choices``: the most ``n`` a request may ask;
        ``fingerprint``: the answers' ``system_fingerprint`` (:mod:`edgepath.model.fingerprint`); ``seeds``: where a
        request that samples without a seed gets one."""
        self.model = model
        self.limits = oa.OpenAILimits(
            max_tokens, vocab_size, (model,), logprobs=logprobs, grammars=grammars, tool_format=chat.tool_format,
            choices=choices, thinking=chat.thinking, fingerprint=fingerprint,
        )  # fmt: skip
        self.chat = chat
        self.created = created
        self.seeds = seeds
        if grammars:  # llama.cpp's grammar module loaded now: its import took 110 ms on the first grammar's loop turn
            import llama_cpp.llama_grammar  # noqa: F401

    def error(self, exc: HttpError) -> Response:
        return openai_error(exc)

    def models(self) -> Response:
        body = json.dumps(oaa.models_list([self.model], self.created), separators=(",", ":")).encode()
        return Response(200, [(b"content-type", JSON)], body)

    def handle(self, path: str, method: str, body: bytes) -> Work | Response:
        """``GET /v1/models``: the model listing; a POST: :meth:`parse`."""
        return self.models() if method == "GET" else self.parse(path, body)

    def parse(self, path: str, body: bytes) -> Work | Response:
        """A :class:`Work` item, or the error response (OpenAI's shape) for a body that is refused."""
        try:
            if path == CHAT:
                if not self.chat.available:
                    raise oa.invalid_request(f"chat completions are not available: {self.chat.why_not}")
                req = oa.parse_chat_request(body, self.limits, self.seeds)
            else:
                req = oa.parse_completion_request(body, self.limits, self.seeds)
        except oa.OpenAIError as err:
            return err.response()
        # with log probabilities each token is a record of output words: max_tokens counts words on the wire
        words = req.max_tokens * wire.record_words(req.logprobs)
        try:
            if req.messages is not None:  # a chat: the one path of every chat shape
                chat = Conversation(req.messages, req.tools, req.constraint, req.template_tools)
                work = chat_work(
                    path, chat, req.constraint, max_tokens=words, stream=req.stream, sampling=req.sampling,
                    options={"openai": req}, thinking=req.enable_thinking,
                )  # fmt: skip
            else:
                tokens = list(req.prompt_ids) if req.prompt_ids is not None else None
                # what follows the prompt: the logit biases (after the grammar's words once they are built)
                biases = wire.after_prompt(None, req.sampling.logit_bias) if req.constraint is None else None
                work = Work(
                    "generate", req.prompt, tokens, words, req.stream, req.sampling, path, {"openai": req},
                    grammar=req.constraint, constraint=biases,
                )  # fmt: skip
        except wire.RequestInvalid as exc:
            return oa.invalid_request(f"'logit_bias': {exc}", param="logit_bias").response()
        work.flags = wire.logprobs_flags(req.logprobs) if req.logprobs is not None else 0
        work.flags |= wire.FLAG_IGNORE_EOS if req.ignore_eos else 0
        work.cache_salt = req.cache_salt
        work.choices = req.n
        return work


def _finish_reason(outcome: Outcome, produced: int, max_tokens: int, stopped: bool) -> oa.FinishReason:
    if stopped or outcome.status == "STOP":
        return "stop"
    if outcome.status in ("LENGTH", "RECLAIMED") or produced >= max_tokens:
        return "length"
    return "stop"


class OpenAIFormatter:
    """One OpenAI answer for the lifecycle (see :class:`edgepath.edge.http.Formatter`): every output id goes
    through :class:`~edgepath.edge.apis.openai.Answer` once -- detokenized without broken characters, held back
    while it could be the start of a stop string, cut at a stop string (``done``: the lifecycle then
    cancels the slot)."""

    def __init__(
        self, request: oa.OpenAIRequest, tokenizer: Tokenizer, request_id: str, created: int, index: int = 0
    ) -> None:
        """``index``: which choice of the request's ``n`` this formatter shapes (:mod:`edgepath.edge.choices`)."""
        self.request = request
        self.tokenizer = tokenizer
        self.width = wire.record_words(request.logprobs)  # output words per token
        self.answer = oaa.Answer(request, tokenizer, request_id, created, prompt_tokens=0, index=index)
        self.answer_id: str | None = oaa.response_id(request.kind, request_id)  # the answer's "id"
        self.model: str | None = request.model  # the answer's "model"
        self.watch = bool(request.stop)  # stop strings need the output as it is produced
        self.done = False
        self._fed = 0
        self._open = False

    def _opening(self) -> bytes:
        if self._open:
            return b""
        self._open = True
        return self.answer.start()

    def _feed(self, words: np.ndarray) -> bytes:
        """The next output words: token ids, or log-probability records (contract/wire/logprobs.py)."""
        head = self._opening()
        if self.answer.stopped or not len(words):
            self._fed += len(words)
            return head
        if self.request.logprobs is None:
            step = self.answer.feed(words.tolist())
        else:
            records = wire.read_records(words, self.request.logprobs)
            step = self.answer.feed(records.ids.tolist(), self._entries(records))
        self._fed += len(words)
        self.done = step.stopped
        return head + step.data

    def _entries(self, records: wire.TokenRecords) -> list[oaa.TokenLogprob]:
        def text(token: int) -> str:
            return self.tokenizer.decode(np.array([token], dtype=np.int64))

        return [
            oaa.TokenLogprob(
                text(token), float(logprob), tuple((text(t), float(lp)) for t, lp in zip(top, tops, strict=True))
            )
            for token, logprob, top, tops in zip(
                records.ids.tolist(), records.logprobs, records.top_ids.tolist(), records.top_logprobs, strict=True
            )
        ]

    def _close(self, outcome: Outcome) -> bytes:
        self.answer.prompt_tokens = outcome.input_count
        self.answer.cached_tokens = outcome.cached_tokens
        rest = self._feed(outcome.tokens[self._fed :])
        produced = len(outcome.tokens) // self.width
        reason = _finish_reason(outcome, produced, self.request.max_tokens, self.answer.stopped)
        cut = outcome.status == "RECLAIMED" and not self.answer.stopped and produced < self.request.max_tokens
        return rest + self.answer.finish(reason, RECLAIMED if cut else None)

    def complete(self, outcome: Outcome) -> Response:
        body = self._close(outcome)
        headers: Headers = [(b"content-type", JSON)]
        return Response(200, headers, body)

    def start(self) -> tuple[int, Headers]:
        return 200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    def tokens(self, ids: np.ndarray) -> bytes:
        data = self._feed(ids)
        return data if self.request.stream else b""

    def end(self, outcome: Outcome) -> bytes:
        return self._close(outcome)

    def failure(self, error: HttpError) -> Response:
        return openai_error(error)

    def usage(self) -> oaa.Usage:
        return self.answer.usage()

    def closing(self, usage: oaa.Usage) -> bytes:
        return self.answer.closing(usage)

    def error(self, error: HttpError) -> bytes:
        return oa.OpenAIError.of(error).event()


def formatter_factory(clock: Callable[[], float]) -> Callable[[Work, Tokenizer], OpenAIFormatter]:
    """The lifecycle's formatter factory for the OpenAI routes; ``clock`` (wall seconds) stamps ``created``
    -- it is the driver's, so the lifecycle itself reads no clock."""
    ids = itertools.count(1)

    def make(work: Work, tokenizer: Tokenizer) -> OpenAIFormatter:
        choice = work.options.get("choice")
        if choice is not None:  # a choice of several: the request's id and time, its own index
            first: OpenAIFormatter = choice[0]
            return OpenAIFormatter(
                work.options["openai"], tokenizer, str(first.answer.request_id), first.answer.created, choice[1]
            )
        return OpenAIFormatter(work.options["openai"], tokenizer, f"ep{next(ids)}", int(clock()))

    return make
