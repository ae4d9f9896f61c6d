"""An answer's tool calls read as its text grows, sans I/O: each call's name as soon as its arguments start, then the
arguments' text piece by piece, as the model writes them.

The calls come in one of the formats of :mod:`edgepath.edge.apis.tools`: the fallback's JSON list of
``{"name", "arguments"}`` objects (or one such object), Hermes' ``<tool_call>`` blocks of one such object each, or
Llama 3.1's one ``{"name", "parameters"}`` object.  :class:`CallScanner` follows the JSON's structure character by
character (strings and their escapes, nesting), finds each call object, and in it the ``name`` member and the
arguments' object: once the name is read and is one of the tools offered, and the arguments' ``{`` has come, the
call's head goes out (:class:`CallDelta` with its id and name) and from then on every piece of the arguments' text
as it arrives, up to its closing ``}``.  The pieces are the model's own text, so their concatenation is the call's
arguments exactly -- the same text a whole answer gives (:func:`argument_spans`, which
:func:`edgepath.edge.apis.tools.read_answer` uses).  Arguments written before the name, or as a JSON string (Hermes'
models sometimes quote them), are not streamed: they go out whole once the answer is read.

Whether the text is calls at all is still decided at the end, by the reader (a call object with another key, a name
not offered, a list with something else in it): the scanner only says what each call looks like so far.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass

HERMES_OPEN = "<tool_call>"
_WHITE = " \t\r\n"


@dataclass(frozen=True, slots=True)
class CallDelta:
    """One piece of a streamed call: its first carries ``id`` and ``name`` (and maybe arguments), the rest only
    ``arguments`` text; ``index`` is the call's place in the answer."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass(slots=True)
class _Call:
    """A call object being read: where it is and what of it has been seen."""

    index: int
    depth: int  # the container stack's size inside it
    key: str | None = None  # the member being read
    expect_key: bool = True
    name: str | None = None
    args_start: int = -1  # where its arguments' text starts (-1: not yet)
    streaming: bool = False  # its head went out: its arguments go out as they come
    sent: int = 0  # how far its arguments' text went out


class CallScanner:
    """The calls of an answer in ``fmt`` (``fallback``, ``hermes``, ``llama3-json``), fed its text in order.

    ``names``: the tools offered (a call to another is not streamed); ``keys``: the arguments' member names;
    ``call_prefix``: the calls' ids are ``<call_prefix>_<index>``, as the reader names them."""

    def __init__(self, fmt: str, names: Collection[str], call_prefix: str, keys: Collection[str]) -> None:
        self.fmt = fmt
        self.names = frozenset(names)
        self.keys = frozenset(keys)
        self.call_prefix = call_prefix
        self.spans: dict[int, str] = {}
        """Each call object's arguments text, by its index: a JSON object's, or a JSON string's (the last given)."""
        self._text = ""
        self._pos = 0
        self._stack: list[str] = []
        self._string = -1  # where the string being read starts (-1: not in one)
        self._escape = False
        self._inside = fmt != "hermes"  # reading JSON (Hermes': inside a block)
        self._over = False  # the one JSON value of the answer ended (fallback, Llama)
        self._calls = 0
        self._call: _Call | None = None
        self._out: list[CallDelta] = []

    def feed(self, text: str) -> list[CallDelta]:
        """The call deltas ``text`` (the answer's next text) lets go."""
        self._text += text
        while self._pos < len(self._text) and not self._over:
            if not self._inside:
                if not self._seek_block():
                    break
                continue
            self._step(self._text[self._pos])
            self._pos += 1
        call = self._call
        if call is not None and call.streaming and self._pos > call.sent:
            self._send(call, self._pos)
        out, self._out = self._out, []
        return out

    def _seek_block(self) -> bool:
        """Hermes', between blocks: on past the next ``<tool_call>``; False when there is none yet (what may be the
        start of one is kept for the next text)."""
        at = self._text.find(HERMES_OPEN, self._pos)
        if at >= 0:
            self._pos, self._inside = at + len(HERMES_OPEN), True
            return True
        tail = self._text[self._pos :]
        keep = next(
            (k for k in range(min(len(tail), len(HERMES_OPEN) - 1), 0, -1) if HERMES_OPEN.startswith(tail[-k:])), 0
        )
        self._pos = len(self._text) - keep
        return False

    def _step(self, ch: str) -> None:
        if self._string >= 0:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._string_end(self._text[self._string : self._pos + 1])
                self._string = -1
            return
        if ch in _WHITE:
            return
        call = self._call
        direct = call is not None and len(self._stack) == call.depth  # directly inside the call object
        if ch == '"':
            self._string = self._pos
        elif ch in "{[":
            if ch == "{" and self._is_call_level():
                self._call = _Call(self._calls, len(self._stack) + 1)
                self._calls += 1
            elif direct and ch == "{" and call is not None and call.key in self.keys and not call.expect_key:
                call.args_start = self._pos
                if call.name in self.names:
                    self._start(call)
            self._stack.append(ch)
        elif ch in "}]":
            if self._stack:
                self._stack.pop()
            if call is not None and call.args_start >= 0 and len(self._stack) == call.depth:
                self._args_end(call, self._pos + 1)  # its arguments' object closed
            elif call is not None and len(self._stack) == call.depth - 1:
                self._call = None  # the call object closed
            if not self._stack:
                self._value_end()
        elif direct and call is not None:
            if ch == ":":
                call.expect_key = False
            elif ch == ",":
                call.expect_key, call.key = True, None
        elif not self._stack:
            self._value_end()  # a scalar as the whole value: not calls

    def _is_call_level(self) -> bool:
        if self.fmt == "fallback":
            return self._stack in ([], ["["])
        return not self._stack

    def _string_end(self, token: str) -> None:
        call = self._call
        if call is None or len(self._stack) != call.depth:
            if not self._stack:
                self._value_end()
            return
        value = _string_value(token)
        if call.expect_key:
            call.key = value
        elif call.key == "name" and value is not None:
            call.name = value
        elif call.key in self.keys:  # arguments written as a JSON string: read whole at the end
            self.spans[call.index] = token

    def _start(self, call: _Call) -> None:
        call.streaming = True
        call.sent = call.args_start
        self._out.append(CallDelta(call.index, "", f"{self.call_prefix}_{call.index}", call.name))

    def _send(self, call: _Call, upto: int) -> None:
        self._out.append(CallDelta(call.index, self._text[call.sent : upto]))
        call.sent = upto

    def _args_end(self, call: _Call, end: int) -> None:
        self.spans[call.index] = self._text[call.args_start : end]
        if call.streaming:
            self._send(call, end)
        call.args_start, call.streaming, call.key = -1, False, None

    def _value_end(self) -> None:
        """The JSON value at the top ended: a Hermes block is over (on to the next), the rest of the formats' is."""
        if self.fmt == "hermes":
            self._inside = False
        else:
            self._over = True


def _string_value(token: str) -> str | None:
    try:
        value = json.loads(token)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def argument_spans(text: str, fmt: str, keys: Collection[str]) -> dict[int, str]:
    """The arguments' text of each call object of a whole answer, by its index (:attr:`CallScanner.spans`)."""
    scanner = CallScanner(fmt, (), "", keys)
    scanner.feed(text)
    return scanner.spans
