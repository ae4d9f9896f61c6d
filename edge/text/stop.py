"""Stop strings checked at the edge, on the text stream, sans-I/O.

The model side knows token ids, not the text a client asked to stop at, and a stop string can
span tokens (``"\\n\\nUser:"`` is often three).  So the edge watches the detokenized text: it feeds
each delta to a :class:`StopMatcher`, sends what comes back, and cancels the slot when the matcher
says it stopped.  Text that could still be the start of a stop string is held back, so a client
never receives the first half of a stop sequence; on a match the output ends just before it
(OpenAI semantics: the stop sequence is not part of the answer).

The match is the one that *completes first* in the text (smallest end; on a tie the one that starts
earliest), which is what checking after every character would find.  So the answer does not depend
on how the text was cut into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class StopResult(NamedTuple):
    """What one :meth:`StopMatcher.feed` gives back."""

    text: str
    """Text that is safe to send now (never part of a stop string)."""
    stopped: bool
    """A stop string matched: ``text`` is the last text of the answer; cancel the slot."""


class StopMatcher:
    """Incremental matcher for a fixed set of stop strings, fed text deltas in order.

    Cost per :meth:`feed` is O(len(delta) + longest stop string) per stop string: at most
    ``longest - 1`` characters are ever held back.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not one string; wrap it in a list")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"every stop string must be a non-empty str, got {s!r}")
        self._stops = tuple(dict.fromkeys(stops))
        # Every proper prefix of a stop string: a tail of the text equal to one of these may still grow
        # into a match, so it is held back.
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._hold_max = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._done = False
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string the text ended at (None while none has matched): Anthropic's ``stop_sequence``."""
        return self._matched

    @property
    def stops(self) -> tuple[str, ...]:
        return self._stops

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible start of a stop string)."""
        return self._held

    @property
    def done(self) -> bool:
        """A stop string matched, or :meth:`flush` was called: nothing more may be fed."""
        return self._done

    def feed(self, delta: str) -> StopResult:
        """Take the next piece of generated text; return what may be sent and whether to stop."""
        if self._done:
            raise RuntimeError("StopMatcher.feed after the stream ended (a stop matched or flush was called)")
        text = self._held + delta
        cut = self._first_match(text)
        if cut is not None:
            self._held = ""
            self._done = True
            return StopResult(text[:cut], True)
        keep = self._held_tail(text)
        self._held = text[len(text) - keep :]
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The generation ended without a match: release the held-back text."""
        if self._done:
            raise RuntimeError("StopMatcher.flush after the stream ended (a stop matched or flush was called)")
        self._done = True
        rest, self._held = self._held, ""
        return rest

    def _first_match(self, text: str) -> int | None:
        """Start of the stop string that completes first in ``text``, or None."""
        best: tuple[int, int] | None = None
        for s in self._stops:
            i = text.find(s)
            if i >= 0:
                key = (i + len(s), i)
                if best is None or key < best:
                    best, self._matched = key, s
        return None if best is None else best[1]

    def _held_tail(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        for k in range(min(self._hold_max, len(text)), 0, -1):
            if text[len(text) - k :] in self._prefixes:
                return k
        return 0
