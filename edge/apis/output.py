"""An answer's text from its output ids, sans I/O: the one pipeline every API shape's answer goes through.

The ids are detokenized without broken characters (:class:`~edgepath.edge.text.detokenize.IncrementalDetokenizer`),
cut at a stop string with nothing of it released (:class:`~edgepath.edge.text.stop.StopMatcher`), split into the
model's thinking and its answer when its chat template thinks (:class:`~edgepath.edge.text.thinking.ThinkingSplit`),
and the answer held while it may be tool calls, then read as calls or released as text
(:class:`~edgepath.edge.apis.tools.ToolOutput`).  What comes out are :class:`Piece` s -- thinking and answer text
that may be sent now, and the pieces of the tool calls as the model writes them (each call's head, then its
arguments' text) -- and at the end the calls as read; each shape (OpenAI's chat and completions, Anthropic's Messages,
OpenAI's Responses) only writes them in its own events or body.

``entries`` travel with the text they came from: OpenAI's log probabilities, held with the answer text while it is
held (a shape without them passes none).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgepath.edge.apis.call_stream import CallDelta
from edgepath.edge.apis.tools import ToolCall, ToolOutput, ToolSpec
from edgepath.edge.http import Headers
from edgepath.edge.text.detokenize import Decoder, IncrementalDetokenizer
from edgepath.edge.text.stop import StopMatcher
from edgepath.edge.text.thinking import Thinking, ThinkingSplit


@dataclass(frozen=True, slots=True)
class Piece:
    """What may be sent now: the model's thinking, its answer, the entries of the tokens they came from, and the
    pieces of its tool calls (after the text, in the answer's order)."""

    reasoning: str = ""
    text: str = ""
    entries: tuple[Any, ...] = ()
    calls: tuple[CallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.text or self.entries or self.calls)


class OutputText:
    """One answer's output ids to its thinking, its text and its tool calls.

    ``token_count`` counts every id fed -- what the model produced for this request -- including ids that arrived
    after a stop string matched (they were generated before the cancel landed)."""

    def __init__(
        self,
        decoder: Decoder,
        stops: Sequence[str] = (),
        tools: ToolSpec | None = None,
        call_prefix: str = "call",
        thinking: Thinking | None = None,
        *,
        count_thinking: bool = False,
    ) -> None:
        """``count_thinking``: count the tokens of the thinking (:attr:`reasoning_tokens`; ids are then taken one
        at a time while the thinking may go on)."""
        self._count_thinking = count_thinking and thinking is not None
        self.reasoning_tokens = 0
        self._undecided = 0  # ids fed before the output opened its thinking or showed it would not
        self._detok = IncrementalDetokenizer(decoder)
        self._stop = StopMatcher(stops)
        self._split = ThinkingSplit(thinking) if thinking is not None else None
        self._tools = ToolOutput(tools, call_prefix) if tools is not None else None
        self._parts: list[str] = []
        self._thoughts: list[str] = []
        self._held: list[Any] = []  # entries of the answer text held while it may be tool calls
        self._stopped = False
        self._finished = False
        self.calls: tuple[ToolCall, ...] = ()

    @property
    def token_count(self) -> int:
        return self._detok.token_count

    @property
    def stopped(self) -> bool:
        """A stop string matched: nothing more is released; the slot should be cancelled."""
        return self._stopped

    @property
    def stop_sequence(self) -> str | None:
        """The stop string the answer ended at, if it did."""
        return self._stop.matched

    @property
    def text(self) -> str:
        """The answer text released so far (all of it once finished; with calls, the text beside them)."""
        return "".join(self._parts)

    @property
    def reasoning(self) -> str:
        """The thinking released so far."""
        return "".join(self._thoughts)

    def feed(self, ids: Sequence[int], entries: Sequence[Any] = ()) -> Piece:
        """The next output ids (and their entries): what may be sent now.  Ids after a stop string are counted
        and dropped with their entries."""
        self._expect_open()
        if self._count_thinking and self._split is not None and not self._split.decided and not entries:
            return self._counted(ids)
        delta = self._detok.feed(ids)
        if self._stopped:
            return Piece()
        return self._release(delta, tuple(entries))

    def _counted(self, ids: Sequence[int]) -> Piece:
        """``ids`` one at a time while the thinking may go on, each one whose text was (part of) the thinking
        counted; the rest at once."""
        assert self._split is not None
        reasoning, text, calls = [], [], list[CallDelta]()
        for k, token in enumerate(ids):
            if self._split.decided or self._stopped:
                rest = self.feed(ids[k:])
                reasoning.append(rest.reasoning)
                text.append(rest.text)
                calls += rest.calls
                break
            before = self._split.within
            piece = self._release(self._detok.feed([token]), ())
            if before or self._split.within:  # its text was thinking (the open tag's ids with it)
                self.reasoning_tokens += 1 + self._undecided
                self._undecided = 0
            elif not self._split.decided:
                self._undecided += 1
            reasoning.append(piece.reasoning)
            text.append(piece.text)
            calls += piece.calls
        return Piece("".join(reasoning), "".join(text), calls=tuple(calls))

    def finish(self) -> list[Piece]:
        """The output ended: the text still held, in order; the calls are then in :attr:`calls`."""
        self._expect_open()
        self._finished = True
        pieces: list[Piece] = []
        if not self._stopped:
            pieces.append(self._release(self._detok.flush(), ()))
            if not self._stopped:
                pieces.append(self._answer(self._stop.flush(), ()))
        if self._split is not None:
            reasoning, content = self._split.flush()
            self._thoughts.append(reasoning)
            pieces.append(Piece(reasoning=reasoning))
            pieces.append(self._content(content, ()))
        if self._tools is not None:
            text, self.calls = self._tools.finish()
            held, self._held = tuple(self._held), []
            self._parts.append(text)
            pieces.append(Piece(calls=tuple(self._tools.deltas())))
            pieces.append(Piece(text=text, entries=held))
        return [p for p in pieces if p]

    def _release(self, delta: str, entries: tuple[Any, ...]) -> Piece:
        result = self._stop.feed(delta)
        self._stopped = result.stopped
        return self._answer(result.text, entries)

    def _answer(self, text: str, entries: tuple[Any, ...]) -> Piece:
        """Text past the stop strings: its thinking released, its answer on to the tool calls' reader."""
        if self._split is None:
            return self._content(text, entries)
        reasoning, content = self._split.feed(text)
        self._thoughts.append(reasoning)
        piece = self._content(content, entries if not (reasoning and not content) else ())
        if reasoning and not content:  # the entries go with the thinking they came from
            return Piece(reasoning=reasoning, entries=entries)
        return Piece(reasoning, piece.text, piece.entries, piece.calls)

    def _content(self, text: str, entries: tuple[Any, ...]) -> Piece:
        calls: tuple[CallDelta, ...] = ()
        if self._tools is not None and self._tools.holding:
            text = self._tools.feed(text)
            calls = tuple(self._tools.deltas())
            if not text:  # maybe tool calls: held, with the entries of its tokens (which go with the calls' pieces)
                self._held.extend(entries)
                if not calls:
                    return Piece()
                entries, self._held = tuple(self._held), []
                return Piece(entries=entries, calls=calls)
            entries, self._held = (*self._held, *entries), []
        if text:
            self._parts.append(text)
        return Piece(text=text, entries=entries, calls=calls)

    def _expect_open(self) -> None:
        if self._finished:
            raise RuntimeError("OutputText: the output is finished")


class EventFormatter(ABC):
    """What the formatters of the shapes that stream typed events share (Anthropic's Messages, OpenAI's Responses):
    the stream's head, and the output ids fed through their :class:`OutputText`, each :class:`Piece` written in the
    shape's own events (:meth:`_piece`) after its opening ones (:meth:`_opening`); a stop sequence ends the answer."""

    def __init__(self, out: OutputText, stream: bool) -> None:
        self._out = out
        self._stream = stream
        self._fed = 0  # output ids fed to ``_out`` so far
        self.done = False

    def start(self) -> tuple[int, Headers]:
        return 200, [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    def tokens(self, ids: np.ndarray) -> bytes:
        data = self._feed(ids)
        return data if self._stream else b""

    @abstractmethod
    def _opening(self) -> bytes:
        """The events that open the stream, the first time (nothing after)."""

    @abstractmethod
    def _piece(self, piece: Piece) -> bytes:
        """``piece`` in the shape's events."""

    def _feed(self, ids: np.ndarray) -> bytes:
        head = self._opening() if self._stream else b""
        if not len(ids):
            return head
        self._fed += len(ids)
        if self._out.stopped:
            self._out.feed(ids.tolist())
            return head
        piece = self._out.feed(ids.tolist())
        self.done = self._out.stopped
        return head + (self._piece(piece) if self._stream else b"")
