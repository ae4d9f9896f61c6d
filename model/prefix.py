"""Prefix reuse for the llama.cpp handler, sans I/O: which KV stream serves a request, and what it reuses.

The handler gives every llama.cpp sequence its own KV stream (``kv_unified = False``): a token attends
over its own stream's cells only, as in ``llama-server -np N``.  (With one unified stream every token
attends over the cells of *every* sequence, so the decode step slows down with the sum of all contexts;
docs/MODEL.md has the measurement.)  Two places keep KV of finished requests for the next ones:

* **the streams themselves** -- a stream keeps its finished sequence's KV until another request needs the
  stream.  A request is not bound to the stream of its slot: it gets the free stream that already holds
  the longest prefix of its prompt and reuses those cells in place (nothing copied), so a multi-turn chat
  or a shared system prompt is found whichever slot the agent claimed;
* **host memory** -- every finished sequence is also saved (``llama_state_seq_get_data``) into an LRU of
  at most ``capacity`` bytes; a request whose prefix no free stream holds restores the best saved one
  into its stream (``llama_state_seq_set_data``, a copy of some megabytes) and prefills only the rest.

The host copies live outside the KV cache, so cached prefixes can never crowd out a running sequence:
every stream always has its ``ctx_per_slot`` cells.  Tokens shorter than ``min_reuse`` are not worth a
reuse (a chat template's first few tokens are common to every request).

Every prefix is kept under the **salt** of the request that wrote it (the request header's ``cache_salt``:
the edge's tenant and the request's own ``cache_salt``), and a request reuses -- in place, restored, or
copied from a running stream -- only what was written under its own salt: tenants never read each other's
KV, nor learn from ``cached_tokens`` or a faster first token that another one sent the same prompt.  A reader of
the shared prefix (the header's ``EP_FLAG_READ_PUBLIC``) may also reuse what was written under the public salt --
restored from a host copy, or copied from a stream, never taken over in place, so the public copy stays public --
while its own sequence is kept under its own salt, readable by nobody else.

:class:`PrefixBook` makes every decision and keeps the books; the handler does the llama.cpp calls.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def runs(streams: Iterable[int]) -> int:
    """Runs of consecutive ids among ``streams``: the micro-batches llama.cpp cuts one token of each into (one
    KV stream per sequence: a micro-batch takes consecutive sequence ids only)."""
    ids = sorted(set(streams))
    return (1 + sum(1 for a, b in itertools.pairwise(ids) if b != a + 1)) if ids else 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def _longest(candidates: Mapping[int, np.ndarray], prompt: np.ndarray, limit: int) -> tuple[int | None, int]:
    """The candidate sharing the longest prefix with ``prompt`` (at most ``limit`` tokens) and that length."""
    best, best_len = None, 0
    for key, tokens in candidates.items():
        n = min(common_prefix(tokens, prompt), limit)
        if n > best_len:
            best, best_len = key, n
    return best, best_len


@dataclass(eq=False, slots=True)
class Saved:
    """A finished sequence's KV saved in host memory: the tokens at positions 0..n-1 and llama.cpp's
    state blob for them (opaque here)."""

    tokens: np.ndarray
    blob: Any
    nbytes: int
    used: int = 0  # LRU clock value of the last time it was saved or reused
    salt: int = 0  # the cache namespace it was written under (only requests with the same salt reuse it)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a new request runs: ``stream`` (a llama.cpp sequence id) and the ``reuse`` first prompt tokens
    whose KV is already there -- after ``restore`` (a host copy) or the KV of running stream ``source`` is
    copied into the stream, when one is set."""

    stream: int
    reuse: int
    restore: Saved | None = None
    source: int | None = None


@dataclass(slots=True)
class CacheStats:
    hits: int = 0  # requests that reused cached tokens (in place or restored)
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens not computed thanks to the cache
    in_place: int = 0  # hits served from a stream's own cells
    restored: int = 0  # hits served by a copy from host memory
    shared: int = 0  # hits served by a copy from a running stream (requests arriving together)
    saved: int = 0  # sequences saved into host memory
    evicted: int = 0  # saved sequences dropped to stay within the capacity (least recently used first)
    superseded: int = 0  # saved sequences dropped because a longer one starting with them was saved


@dataclass(slots=True)
class _Stream:
    tokens: np.ndarray | None = None  # what its KV holds (positions 0..n-1); None: nothing
    running: bool = False
    used: int = 0
    salt: int = 0  # the cache namespace of the request that wrote its KV


@dataclass(slots=True)
class PrefixBook:
    """Streams (what each holds, which run) and the host-memory copies of finished sequences."""

    streams: int
    capacity: int  # bytes of host memory for saved sequences (0: no host copies)
    min_reuse: int = 16
    stats: CacheStats = field(default_factory=CacheStats)
    #: changes whenever what :meth:`held` returns may have changed (the slot server republishes then)
    version: int = field(init=False, default=0)
    _streams: list[_Stream] = field(init=False)
    _saved: list[Saved] = field(init=False, default_factory=list)
    _clock: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.streams < 1 or self.capacity < 0 or self.min_reuse < 1:
            raise ValueError(
                f"prefix book: need streams >= 1, capacity >= 0, min_reuse >= 1; "
                f"got {self.streams}, {self.capacity}, {self.min_reuse}"
            )
        self._streams = [_Stream() for _ in range(self.streams)]

    # -- requests ---------------------------------------------------------------------------------
    def place(
        self,
        prompt: np.ndarray,
        reuse: bool = True,
        computed: Mapping[int, np.ndarray] | None = None,
        salt: int = 0,
        reads: Collection[int] = (),
    ) -> Placement:
        """A stream for a new request and how much of ``prompt`` it reuses (never all of it: the last
        prompt token is always decoded, its logits give the first output token; nothing when ``reuse`` is
        false), from prefixes written under ``salt`` -- or under one of ``reads`` (the public salt, for a reader of
        the shared prefix), by a copy only.  Marks it running under ``salt``.

        ``computed``: running streams and the tokens whose KV they hold so far -- a request that arrived
        together with others sharing its prefix (a system prompt) copies the prefix from the one that
        computed it first.  Sources by preference at equal length: a free stream's own cells (no copy), a
        host copy, a running stream or another salt's free stream (two copies)."""
        free = [i for i, s in enumerate(self._streams) if not s.running]
        if not free:
            raise RuntimeError(f"prefix book: all {self.streams} streams are running")
        self._clock += 1
        if not reuse:
            return self._run(Placement(self._spare(free), 0), salt)
        limit = len(prompt) - 1
        streams = self._streams
        readable = {salt, *reads}
        held = {i: t for i in free if (t := streams[i].tokens) is not None and streams[i].salt == salt}
        here, here_len = _longest(held, prompt, limit)
        saved, saved_len = self._best_saved(prompt, limit, readable)
        ours = {i: t for i, t in (computed or {}).items() if streams[i].running and streams[i].salt in readable}
        if len(free) > 1:  # another salt's free stream is copied from, into another free stream: never taken over
            ours.update((i, t) for i in free if (t := streams[i].tokens) is not None and streams[i].salt in readable)
            ours = {i: t for i, t in ours.items() if streams[i].running or streams[i].salt != salt}
        running, running_len = _longest(ours, prompt, limit)
        if max(here_len, saved_len, running_len) < self.min_reuse:
            placement = Placement(self._spare(free), 0)
        elif here is not None and here_len >= max(saved_len, running_len):
            placement = Placement(here, here_len)
            self.stats.in_place += 1
        elif saved is not None and saved_len >= running_len:
            placement = Placement(self._spare(free), saved_len, saved)
            saved.used = self._clock
            self.stats.restored += 1
        else:
            assert running is not None
            placement = Placement(self._spare([i for i in free if i != running]), running_len, source=running)
            self.stats.shared += 1
        if placement.reuse:
            self.stats.hits += 1
            self.stats.cached_tokens += placement.reuse
        else:
            self.stats.misses += 1
        return self._run(placement, salt)

    def reusable(
        self, prompt: np.ndarray, ahead: Iterable[np.ndarray] = (), salt: int = 0, reads: Collection[int] = ()
    ) -> int:
        """How much of ``prompt`` a request placed now would reuse, without placing it: what a free stream or a host
        copy of ``salt`` (or of ``reads``) holds, or what it shares with ``ahead`` -- the prompts it may read placed
        or waiting before it, whose shared prefix it copies once computed.  What the slot server publishes for a
        prompt not placed yet: counting it whole made agents predict a burst of chats sharing a system prompt at
        several times what the model side then does (each copies the prefix the first computed)."""
        limit = len(prompt) - 1
        readable = {salt, *reads}
        free = {i: s.tokens for i, s in enumerate(self._streams) if not s.running and s.tokens is not None}
        held = {i: t for i, t in free.items() if self._streams[i].salt in readable}
        best = max(_longest(held, prompt, limit)[1], self._best_saved(prompt, limit, readable)[1])
        for tokens in ahead:
            best = max(best, min(common_prefix(tokens, prompt), limit))
        return best if best >= self.min_reuse else 0

    def compaction(self, decoding: Iterable[int], movable: Mapping[int, int]) -> tuple[int, int] | None:
        """A move that leaves the decoding streams in fewer runs of consecutive ids (fewer micro-batches a step):
        ``(source, destination)`` -- one of ``movable`` (running stream -> positions its KV holds) into a free
        stream -- or None when no move helps.  The fewest runs first, then the shortest KV to copy, then the
        destination :meth:`_spare` would overwrite first."""
        decoding = set(decoding)
        now = runs(decoding)
        free = [i for i, s in enumerate(self._streams) if not s.running]
        best: tuple[tuple[int, int, bool, int, int], int, int] | None = None
        for source, held in movable.items():
            rest = decoding - {source}
            for dest in free:
                after = runs(rest | {dest})
                if after >= now:
                    continue
                stream = self._streams[dest]
                key = (after, held, stream.tokens is not None, stream.used, dest)
                if best is None or key < best[0]:
                    best = (key, source, dest)
        return None if best is None else (best[1], best[2])

    def move(self, source: int, dest: int) -> None:
        """Running stream ``source``'s request now runs on free stream ``dest`` (its KV copied there); ``source`` is
        free and empty."""
        src, dst = self._streams[source], self._streams[dest]
        if not src.running or dst.running:
            raise ValueError(f"prefix book: cannot move running stream {source} onto stream {dest}")
        dst.running, dst.salt, dst.used, dst.tokens = True, src.salt, src.used, None
        src.running, src.tokens = False, None
        self.version += 1

    def finished(self, stream: int, tokens: np.ndarray | None) -> None:
        """``stream`` is free again; its KV holds ``tokens`` (positions 0..n-1), or nothing (None)."""
        s = self._streams[stream]
        if not s.running:
            raise ValueError(f"prefix book: stream {stream} is not running")
        s.running = False
        s.tokens = tokens if tokens is not None and len(tokens) else None
        self.version += 1

    def holding(self) -> list[np.ndarray | None]:
        """What each idle stream holds (None: nothing, or a running request): the prefixes the model side
        could serve without computing them."""
        return [None if s.running else s.tokens for s in self._streams]

    def held(self) -> list[tuple[int, np.ndarray]]:
        """Every prefix the book could serve a new request from, with the salt it serves it under, the cheapest
        first: idle streams (reused in place), then host copies (restored), each by most recent use."""
        idle = sorted((s for s in self._streams if not s.running and s.tokens is not None), key=lambda s: -s.used)
        saved = sorted(self._saved, key=lambda s: -s.used)
        return [(s.salt, s.tokens) for s in idle if s.tokens is not None] + [(s.salt, s.tokens) for s in saved]

    # -- host copies ------------------------------------------------------------------------------
    def wants(self, tokens: np.ndarray, nbytes: int, salt: int = 0) -> bool:
        """Whether a finished sequence of ``tokens`` (``nbytes`` of state, written under ``salt``) is worth
        saving: not when a saved one of the same salt already starts with all of it (that one is refreshed
        instead), nor when it alone exceeds the capacity or is too short to be reused."""
        if len(tokens) < self.min_reuse or nbytes > self.capacity:
            return False
        for saved in self._saved:
            if saved.salt != salt:
                continue
            if len(saved.tokens) >= len(tokens) and common_prefix(saved.tokens, tokens) == len(tokens):
                self._clock += 1
                saved.used = self._clock
                return False
        return True

    def save(self, tokens: np.ndarray, blob: Any, nbytes: int, salt: int = 0) -> list[Saved]:
        """Keep a copy written under ``salt`` (after :meth:`wants` said yes); returns the copies dropped for it:
        those of its salt it supersedes (they are prefixes of it), then the least recently used until it fits."""
        self._clock += 1
        new = Saved(tokens, blob, nbytes, self._clock, salt)
        dropped = [s for s in self._saved if s.salt == salt and common_prefix(s.tokens, tokens) == len(s.tokens)]
        self.stats.superseded += len(dropped)
        kept = [s for s in self._saved if s not in dropped]
        kept.sort(key=lambda s: s.used)
        total = sum(s.nbytes for s in kept) + nbytes
        while kept and total > self.capacity:
            old = kept.pop(0)
            total -= old.nbytes
            dropped.append(old)
            self.stats.evicted += 1
        self._saved = [*kept, new]
        self.stats.saved += 1
        self.version += 1
        return dropped

    @property
    def saved_bytes(self) -> int:
        return sum(s.nbytes for s in self._saved)

    @property
    def saved(self) -> Sequence[Saved]:
        return tuple(self._saved)

    # -- internals --------------------------------------------------------------------------------
    def _run(self, placement: Placement, salt: int) -> Placement:
        stream = self._streams[placement.stream]
        stream.salt = salt
        stream.running = True
        stream.used = self._clock
        stream.tokens = None  # until it finishes, the stream's content is the running request's
        self.version += 1
        return placement

    def _best_saved(self, prompt: np.ndarray, limit: int, salts: Collection[int]) -> tuple[Saved | None, int]:
        ours = {i: s.tokens for i, s in enumerate(self._saved) if s.salt in salts}
        index, n = _longest(ours, prompt, limit)
        return (None, 0) if index is None else (self._saved[index], n)

    def _spare(self, free: list[int]) -> int:
        """The free stream to overwrite: one that keeps the running streams in the fewest contiguous runs
        (llama.cpp cuts a step into one micro-batch per run of consecutive sequence ids), then an empty one,
        then the least recently used (its content is also in host memory when it was worth saving)."""
        running = {i for i, s in enumerate(self._streams) if s.running}
        return min(
            free,
            key=lambda i: (runs(running | {i}), self._streams[i].tokens is not None, self._streams[i].used, i),
        )
