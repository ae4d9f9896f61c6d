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
from functools import lru_cache
from typing import NamedTuple


class StopResult(NamedTuple):
    """What one :meth:`StopMatcher.feed` gives back."""

    text: str
    """Text that is safe to send now (never part of a stop string)."""
    stopped: bool
    """A stop string matched: ``text`` is the last text of the answer; cancel the slot."""


class Automaton:
    """Aho-Corasick over a set of stop strings: a trie of their prefixes with failure links, built once per set
    (:func:`automaton`) and shared by every request that asks for it.

    A state is a node of the trie, which is also the longest tail of the text read so far that is a prefix of some
    stop string -- exactly what must be held back.  Memory is one node per distinct prefix (at most the stop
    strings' total length), time one amortised step per character: the matcher's costs grow linearly with the stop
    strings, where a set of every prefix grew with the square of their length (32,000 characters: 590 MB)."""

    __slots__ = ("depth", "done", "fail", "goto")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        #: the length of the longest stop string that ends at each node (itself or through its failure links)
        self.done = [0]
        for stop in stops:
            node = 0
            for char in stop:
                nxt = self.goto[node].get(char)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][char] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.done.append(0)
                node = nxt
            self.done[node] = len(stop)
        self.fail = [0] * len(self.goto)
        order = list(self.goto[0].values())
        for node in order:  # breadth first: a node's failure link is set before its children's
            for char, child in self.goto[node].items():
                order.append(child)
                back = self.fail[node]
                while back and char not in self.goto[back]:
                    back = self.fail[back]
                target = self.goto[back].get(char, 0)
                self.fail[child] = target if target != child else 0
                self.done[child] = max(self.done[child], self.done[self.fail[child]])

    def step(self, node: int, char: str) -> int:
        """The state after ``char``."""
        goto, fail = self.goto, self.fail
        while node and char not in goto[node]:
            node = fail[node]
        return goto[node].get(char, 0)


@lru_cache(maxsize=256)
def automaton(stops: tuple[str, ...]) -> Automaton:
    """The automaton of one set of stop strings (the same request sent again reuses it)."""
    return Automaton(stops)


class StopMatcher:
    """Incremental matcher for a fixed set of stop strings, fed text deltas in order.

    Cost per :meth:`feed` is O(len(delta)) amortised, whatever the stop strings; at most ``longest - 1``
    characters are ever held back.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            raise TypeError("stops must be a sequence of strings, not one string; wrap it in a list")
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"every stop string must be a non-empty str, got {s!r}")
        self._stops = tuple(dict.fromkeys(stops))
        self._automaton = automaton(self._stops) if self._stops else None
        self._node = 0
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
        machine = self._automaton
        if machine is None:
            return StopResult(delta, False)
        text = self._held + delta
        node, done, base = self._node, machine.done, len(self._held)
        for i, char in enumerate(delta):
            node = machine.step(node, char)
            if done[node]:
                # the first stop string to complete ends here; the longest that does starts earliest
                end = base + i + 1
                self._held, self._done, self._matched = "", True, text[end - done[node] : end]
                return StopResult(text[: end - done[node]], True)
        self._node = node
        keep = machine.depth[node]
        self._held = text[len(text) - keep :] if keep else ""
        return StopResult(text[: len(text) - keep], False)

    def flush(self) -> str:
        """The generation ended without a match: release the held-back text."""
        if self._done:
            raise RuntimeError("StopMatcher.flush after the stream ended (a stop matched or flush was called)")
        self._done = True
        rest, self._held = self._held, ""
        return rest
