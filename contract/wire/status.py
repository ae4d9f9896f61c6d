"""The status region an agent process publishes for its edges: free and total slots, whether a slot server is
reachable, each slot server's link."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: slot servers whose links an agent process publishes, and u64 words per link (the agent's own encoding of
#: a link's state: :meth:`edgepath.dpu.link_state.LinkHealth.words`)
STATUS_LINKS, LINK_WORDS = 8, 5
STATUS_BYTES = 8 * (4 + STATUS_LINKS * LINK_WORDS)


class AgentStatus:
    """The agent process's ``status`` region: free slots, all slots, whether a slot server is reachable, and
    each slot server's link (:data:`LINK_WORDS` words each).  The agent publishes it, edges read it in place
    (aligned u64 words; a reader may see one publication half-written, which the next one mends)."""

    __slots__ = ("_links", "_words")

    def __init__(self, buf: np.ndarray) -> None:
        if buf.nbytes < STATUS_BYTES:
            raise ValueError(f"status region needs {STATUS_BYTES} bytes, got {buf.nbytes}")
        self._words = buf[:32].view(np.uint64)
        self._links = buf[32:STATUS_BYTES].view(np.uint64).reshape(STATUS_LINKS, LINK_WORDS)

    def publish(self, free: int, total: int, alive: bool, links: Sequence[Sequence[int]] = ()) -> None:
        if len(links) > STATUS_LINKS:
            raise ValueError(f"the status region holds {STATUS_LINKS} links, got {len(links)}")
        for i, words in enumerate(links):
            self._links[i] = words
        self._words[:] = (free, total, int(alive), len(links))

    def read(self) -> tuple[int, int, bool]:
        free, total, alive, _ = (int(v) for v in self._words)
        return free, total, bool(alive)

    def links(self) -> list[tuple[int, ...]]:
        """Each published link's words, in the agent's order of its slot servers."""
        count = min(int(self._words[3]), STATUS_LINKS)
        return [tuple(int(v) for v in row) for row in self._links[:count]]
