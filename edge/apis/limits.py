"""What a request's fields may hold before it is admitted: every limit in one place, for every API shape.

A front door is judged by what one hostile or careless request can make it spend.  Everything the edge does to a
request before admitting it runs on the one event loop every tenant shares, so each check here costs time and
memory in proportion to the request's bytes, with a small constant, and each field has an explicit limit refused
with a 400 that names the field and the limit (:class:`LimitExceeded`; each shape puts it in its own error shape).
The limits are few and documented (docs/API.md, "Limits"); a new API shape (Anthropic's Messages, OpenAI's
Responses) takes its limits from here, so the same field is held to the same bound on every route.

* JSON shape: a body nesting deeper than :data:`JSON_DEPTH_MAX`, or holding more than :data:`JSON_CONTAINERS_MAX`
  arrays and objects, is refused before any shape reads it (:func:`check_json`; Python's own parser and every
  recursive walk of a document raise ``RecursionError`` near 1,000 levels, which dropped the connection; and each
  array or object parsed is a Python object the garbage collector scans: a megabyte of ``[[],[],...]``, 340,000 of
  them, took 250 ms to parse here, 970 ms of the event loop on a busy machine).
* Stop strings: at most :data:`STOPS_MAX` of at most :data:`STOP_CHARS_MAX` characters each and
  :data:`STOP_TOTAL_MAX` together (the matcher, edge/text/stop.py, is linear in them, and holds back at most the
  longest one's length of the answer).
* Chats: at most :data:`MESSAGES_MAX` messages; each one counts :data:`MESSAGE_CHARS` characters more than its
  content towards the size that decides whether its template runs off the event loop (edge/tokenizing.py).
* Tools: at most :data:`TOOLS_MAX`; JSON schemas (``response_format``, tools' ``parameters``) nest at most
  :data:`SCHEMA_DEPTH_MAX` deep and their repetitions -- ``minLength``/``maxLength``, ``minItems``/``maxItems``,
  a pattern's ``{m,n}`` -- add up to at most :data:`SCHEMA_REPEAT_MAX`, counted from the schema *before* its grammar
  is built (llama.cpp's converter writes each repetition out: ``maxLength`` 10^8 was about 5 s and 1.8 GB).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

#: deepest nesting of arrays and objects in a request body, and how many of them it may hold (a chat at its message
#: limit with text parts, or the most tools with their schemas, holds a few thousand)
JSON_DEPTH_MAX, JSON_CONTAINERS_MAX = 64, 16_384
#: stop strings per request (OpenAI's limit), characters in one, characters in all of them together
STOPS_MAX, STOP_CHARS_MAX, STOP_TOTAL_MAX = 4, 512, 1024
#: messages in one chat
MESSAGES_MAX = 2048
#: what one message costs the template beyond its content, in characters of work (a 30,000-message chat of empty
#: messages took 2.9 s to template and tokenize: about a hundred microseconds a message)
MESSAGE_CHARS = 64
#: tools offered in one request (OpenAI's limit)
TOOLS_MAX = 128
#: deepest nesting of sub-schemas in one JSON schema (``properties``, ``items``, ``anyOf``, ...)
SCHEMA_DEPTH_MAX = 16
#: all the repetitions of one request's schemas together (each is written out in its grammar)
SCHEMA_REPEAT_MAX = 4096

_OPEN, _CLOSE, _QUOTE = (ord(c) for c in '[]"')
_BRACE, _END_BRACE = ord("{"), ord("}")
#: every byte but the quotes and brackets a JSON text's shape is made of
_NOT_SHAPE = bytes(b for b in range(256) if b not in b'[]{}"')


class LimitExceeded(ValueError):
    """A field past its limit: ``param`` names the field, the message the limit and what was given; ``code`` names
    the limit for the error's type."""

    def __init__(self, param: str, message: str, code: str = "limit_exceeded") -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.code = code


def json_shape(body: bytes) -> tuple[int, int]:
    """How deep a JSON text nests arrays and objects, and how many it holds (brackets inside strings not counted),
    without a parser's recursion or per-character Python: its escapes taken out as a parser reads them (an escaped
    backslash, then an escaped quote: neither opens or closes anything), every byte but quotes and brackets deleted
    (``bytes.translate``, one pass in C), then a few numpy steps over what is left -- a chat of 2,048 messages is
    12,000 quotes and brackets in 880 KB.  Meaningful for valid JSON; for anything else numbers the parser then
    refuses anyway."""
    if body.count(b"[") + body.count(b"{") == 0:
        return 0, 0
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"") if b"\\" in body else body
    s = np.frombuffer(text.translate(None, _NOT_SHAPE), dtype=np.uint8)
    outside = (np.cumsum(s == _QUOTE, dtype=np.int32) & 1) == 0  # after an even number of quotes: not in a string
    opening = outside & ((s == _OPEN) | (s == _BRACE))
    closing = outside & ((s == _CLOSE) | (s == _END_BRACE))
    steps = opening.view(np.int8) - closing.view(np.int8)
    return max(0, int(np.cumsum(steps, dtype=np.int32).max())), int(np.count_nonzero(opening))


def json_depth(body: bytes) -> int:
    """How deep a JSON text nests arrays and objects (:func:`json_shape`)."""
    return json_shape(body)[0]


def check_json(body: bytes) -> None:
    """LimitExceeded when ``body`` nests deeper than :data:`JSON_DEPTH_MAX` or holds more than
    :data:`JSON_CONTAINERS_MAX` arrays and objects (a body with fewer brackets than the depth limit is not scanned)."""
    if body.count(b"[") + body.count(b"{") <= JSON_DEPTH_MAX:
        return
    depth, containers = json_shape(body)
    if depth > JSON_DEPTH_MAX:
        raise LimitExceeded(
            "body",
            f"the request body nests arrays and objects {depth} deep; the limit is {JSON_DEPTH_MAX}",
            "json_too_deep",
        )
    if containers > JSON_CONTAINERS_MAX:
        raise LimitExceeded(
            "body",
            f"the request body holds {containers} arrays and objects; the limit is {JSON_CONTAINERS_MAX}",
            "json_too_many_values",
        )


def check_stops(stops: tuple[str, ...], param: str = "stop") -> None:
    """LimitExceeded when a stop string is longer than :data:`STOP_CHARS_MAX` characters or all together are longer
    than :data:`STOP_TOTAL_MAX` (how many a request may give is its shape's: OpenAI's :data:`STOPS_MAX`)."""
    longest = max((len(s) for s in stops), default=0)
    if longest > STOP_CHARS_MAX:
        raise LimitExceeded(
            param, f"'{param}' holds a string of {longest} characters; each may have at most {STOP_CHARS_MAX}"
        )
    total = sum(len(s) for s in stops)
    if total > STOP_TOTAL_MAX:
        raise LimitExceeded(
            param, f"'{param}' holds {total} characters in all; together they may have at most {STOP_TOTAL_MAX}"
        )


def check_messages(count: int, param: str = "messages", what: str = "messages") -> None:
    """LimitExceeded when a chat has more than :data:`MESSAGES_MAX` messages (``what``: how its shape calls them --
    Responses' ``input`` holds items)."""
    if count > MESSAGES_MAX:
        raise LimitExceeded(param, f"'{param}' holds {count} {what}; at most {MESSAGES_MAX}")


class SchemaBudget:
    """The repetitions of one request's schemas, counted as they are checked (one budget for a request: its
    ``response_format``, or all of its tools' ``parameters`` together)."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        self.used = 0

    def depth(self, depth: int, where: str) -> None:
        """LimitExceeded when a sub-schema at ``where`` sits ``depth`` levels down, past :data:`SCHEMA_DEPTH_MAX`."""
        if depth > SCHEMA_DEPTH_MAX:
            raise LimitExceeded(
                where, f"'{where}' nests sub-schemas {depth} deep; a schema may nest at most {SCHEMA_DEPTH_MAX}"
            )

    def schema(self, schema: Mapping[str, Any], where: str) -> None:
        """Count one schema object's own repetitions (its sub-schemas are counted as the caller walks them)."""
        for key in ("minLength", "maxLength", "minItems", "maxItems"):
            value = schema.get(key)
            if value is None:
                continue
            if type(value) is not int or value < 0:
                raise LimitExceeded(f"{where}.{key}", f"'{where}.{key}' must be a non-negative integer, got {value!r}")
            self._add(value, f"{where}.{key}")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            self._add(pattern_size(pattern), f"{where}.pattern")

    def _add(self, count: int, where: str) -> None:
        self.used += count
        if self.used > SCHEMA_REPEAT_MAX:
            raise LimitExceeded(
                where,
                f"'{where}': the schema's repetitions (minLength, maxLength, minItems, maxItems, a pattern's "
                f"{{m,n}}) add up to {self.used} or more; at most {SCHEMA_REPEAT_MAX} are allowed in one request, "
                "since each is written out in the grammar",
            )


def pattern_size(pattern: str) -> int:
    """An upper bound on how many pieces a regular expression's grammar writes out: each atom one, a quantified
    atom or group its size times its count (``{m,n}``: n; ``{m,}``: m + 1), nested groups multiplied -- the way
    llama.cpp's converter expands ``{m,n}`` textually.  One pass over the pattern; capped just past
    :data:`SCHEMA_REPEAT_MAX` (no need to count further)."""
    cap = SCHEMA_REPEAT_MAX + 1
    stack: list[int] = [0]  # the size of each open group so far
    last = 0  # the size of the atom just read (what a quantifier repeats)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = 1
            stack[-1] += 1
            continue
        if c == "[":
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            last = 1
            stack[-1] += 1
            continue
        if c == "(":
            stack.append(0)
            last = 0
        elif c == ")":
            group = stack.pop() if len(stack) > 1 else 0
            last = max(group, 1)
            stack[-1] += last
        elif c == "{":
            j = pattern.find("}", i)
            counts = pattern[i + 1 : j].split(",") if j > i else []
            if 1 <= len(counts) <= 2 and all(part.strip().isdigit() or part == "" for part in counts) and counts[0]:
                low = int(counts[0])
                high = int(counts[1]) if len(counts) == 2 and counts[1] else low + (len(counts) == 2)
                times = min(max(low, high), cap)
                stack[-1] += last * (times - 1)  # the atom is counted once already
                last = last * times
                i = j + 1
                if stack[-1] >= cap:
                    return cap
                continue
            last = 1
            stack[-1] += 1
        elif c in "*+?|^$":
            pass  # no copies written: a rule that refers to the atom again
        else:
            last = 1
            stack[-1] += 1
        if stack[-1] >= cap:
            return cap
        i += 1
    return min(sum(stack), cap)
