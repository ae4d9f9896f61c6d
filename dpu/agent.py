"""The DPU-side agent: claims a slot with a remote CAS, writes the request, rings the doorbell.

The agent owns a registered *frame* region.  Whoever feeds it (the edge, in
process or through :mod:`edgepath.dpu.agent_service`) writes a request's token
ids once, straight into a frame; the agent sends that frame to the claimed slot
with one RDMA WRITE (no copy on the way) and the slot server writes the result
back into the same frame's result area.

Admission is decided once, at claim time: a slot is taken only by a CAS of its
state word from FREE to CLAIMED.  If no CAS on any attached slot server succeeds
(after one refresh of the cached state words), the answer is NO_SLOT at once.

Every link has a state (:mod:`edgepath.dpu.link_state`): the READ that refreshes the
cached state words also reads the slot server's heartbeat word, and :meth:`Agent.check_links`
reads it when nothing else has for a while.  A server whose heartbeat stands still for the
hang timeout is UNRESPONSIVE: nothing is claimed there (UNAVAILABLE at once when no other
server is UP) and the frames in flight on it when that was found are reported once by
:meth:`Agent.stalled`.

With several slot servers, a request goes first to one that is up, has a free slot and
publishes the longest prefix of its ids (the pool's prefix table, read with the
heartbeat and state words in the same READ: the model side there reuses that prefix's KV
instead of computing it), then by free slots -- no queue, no extra round trip.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgepath.dma import wire
from edgepath.dma.pool import AgentFrames, FrameLayout
from edgepath.dma.slot_config import DEFAULT_CAPACITY
from edgepath.dma.transport import Access, Connection, MemoryRegion, RemoteRegion, Transport, TransportError
from edgepath.dma.wire import claim_next
from edgepath.dpu.backoff import Backoff, Retry
from edgepath.dpu.frame_book import Flight, FrameBook
from edgepath.dpu.link_state import (
    DEFAULT_HANG_TIMEOUT,
    LinkHealth,
    LinkState,
    LinkTracker,
    Reason,
    check_hang_timeout,
)
from edgepath.dpu.port import Delivery, SlotServerStatus
from edgepath.native.abi import ABI_VERSION, MAGIC, POOL_HEADER, REQUEST_HEADER, State, Status, ffi, field_offset, lib

log = logging.getLogger("edgepath.agent")

_DOORBELL_FIELD = field_offset(REQUEST_HEADER, "doorbell")
#: bytes before each link's cached state words in the scratch region: ``[heartbeat .. state[0])`` of the
#: pool header lands there, read with the state words in one READ
_HEAD = 64

#: re-attaching to a slot server that went away: first after 0.1 s, then doubling to one try every 2 s --
#: a restarted server (serve's own restarts after 0.1 s at first) is back in use within about 2 s of
#: listening again, and one that stays away costs one connection attempt every 2 s
REATTACH_BACKOFF = Backoff(first_delay=0.1, max_delay=2.0)
#: seconds each step of a re-attach's connection set-up may take (it runs on a thread of its own): generous,
#: since a slot server that has just started, or an emulated RDMA device, can be slow to answer
REATTACH_TIMEOUT = 2.0


class AgentError(RuntimeError):
    """Attaching to a slot server failed (unreachable, incompatible ABI or dimensions)."""


@dataclass
class ClaimStats:
    """How claims on one slot server went (``Agent.describe``)."""

    claims: int = 0  # slots claimed
    cas_attempts: int = 0  # remote CAS sent (a claim that found its cached word stale may need two)
    cas_failures: int = 0  # CAS that found another word than the cached one (the cache learns it)
    refreshes: int = 0  # RDMA READs of the server's state words
    no_slot: int = 0  # claims that found no FREE slot even after a refresh: NO_SLOT, 429
    affine: int = 0  # claims on this server while its prefix table held a prefix of the request


@dataclass(eq=False)
class ServerLink:
    """One attached slot server: its connection, pool geometry, cached state words and heartbeat, and the
    link's state (``tracker``)."""

    address: str
    conn: Connection
    slot_count: int
    input_capacity: int
    output_capacity: int
    states_offset: int
    doorbells_offset: int
    cancels_offset: int
    slots_offset: int
    slot_stride: int
    epoch: int
    words: np.ndarray  # cached state words (a registered local region, target of refresh READs)
    words_offset: int
    pool: RemoteRegion
    beat: np.ndarray  # the heartbeat word as last read, in the same region, ``head`` bytes before the words
    tracker: LinkTracker
    cursor: int = 0
    inflight: int = 0
    stats: ClaimStats = field(default_factory=ClaimStats)
    #: the server's prefix table as last read (right after the cached words; empty: it publishes none)
    prefixes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    #: bytes one refresh READs from the state words on: the words, and the prefix table when there is one
    read_bytes: int = 0
    rejoin: Retry = field(default_factory=Retry)  # when to try re-attaching once it is down
    reattaches: int = 0  # times this slot server came back and was attached again

    def __post_init__(self) -> None:
        self.words_ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.words))
        #: bytes of the pool header read before the state words: from its heartbeat word on
        self.head = self.states_offset - wire.HEARTBEAT_OFFSET

    @property
    def claimant(self) -> int:
        return self.conn.peer_assigned_id

    @property
    def alive(self) -> bool:
        """Connected (UP or UNRESPONSIVE): what it had in flight may still be answered."""
        return self.tracker.state is not LinkState.DOWN

    @property
    def up(self) -> bool:
        """Connected and its heartbeat moving: the only kind of link a slot is claimed on."""
        return self.tracker.state is LinkState.UP

    @property
    def free_hint(self) -> int:
        """Free slots as last seen (cached words), an ordering hint across servers."""
        return int(np.count_nonzero(wire.in_state(self.words, State.FREE)))


@dataclass(slots=True, kw_only=True)
class InFlight(Flight):
    """A frame sent to a slot server: where it runs, in which generation."""

    link: ServerLink
    slot: int
    generation: int
    cancelled: bool = False


class Agent:
    """Claims slots on attached slot servers and moves frames into them."""

    def __init__(
        self,
        transport: Transport,
        frames: int = 256,
        input_capacity: int = DEFAULT_CAPACITY,
        output_capacity: int = DEFAULT_CAPACITY,
        max_servers: int = 8,
        max_slots_per_server: int = 65536,
        frames_buffer: np.ndarray | None = None,
        replies_buffer: np.ndarray | None = None,
        frames_access: Access = Access.NONE,
        hang_timeout: float = DEFAULT_HANG_TIMEOUT,
        clock: Callable[[], float] = time.monotonic,
        reattach: Backoff = REATTACH_BACKOFF,
    ) -> None:
        """Frames are two registered regions (least privilege): requests, which the agent only sends
        from -- no peer may write them (``frames_access`` widens that only for an agent whose edges
        share the region over loopback) -- and replies, the one region slot servers may write.
        ``frames_buffer``/``replies_buffer``: memory owned elsewhere (shared with edges) that
        ``transport`` registers in place (the verbs transport can), so the edges' token writes are
        what the NIC sends and results land where the edges read them.  ``hang_timeout``: seconds of a
        still heartbeat that make a slot server UNRESPONSIVE; ``clock``: monotonic seconds (a test's own);
        ``reattach``: how often :meth:`revive` tries a slot server that went away."""
        self.hang_timeout = check_hang_timeout(hang_timeout)  # before anything is registered
        self.transport = transport
        self.clock = clock
        self.reattach = reattach
        #: seconds after which :meth:`check_links` reads a link's heartbeat that nothing else has read
        self.probe_interval = min(0.1, hang_timeout / 4)
        self.layout = FrameLayout(input_capacity, output_capacity)
        req_size, rep_size = AgentFrames.sizes(frames, self.layout)
        self.frames_mr: MemoryRegion = transport.register(
            wire.REQUESTS_REGION, req_size, frames_access, buffer=frames_buffer
        )
        self.replies_mr: MemoryRegion = transport.register(
            wire.REPLIES_REGION, rep_size, wire.REPLIES_ACCESS, buffer=replies_buffer
        )
        self.frames = AgentFrames(self.frames_mr.buf, self.replies_mr.buf, frames, self.layout)
        self._words_per_link = max_slots_per_server
        # Per server [pool header from its heartbeat][cached state words, padded to a cache line][its prefix
        # table] (as laid out in its pool: one READ), then a cancel word to send from, then a pool header to
        # read into.
        self._link_bytes = _HEAD + -(-8 * max_slots_per_server // 64) * 64 + 8 * wire.PREFIX_ENTRIES_MAX
        words_size = self._link_bytes * max_servers
        self.scratch_mr = transport.register("words", words_size + 8 + POOL_HEADER.itemsize, Access.NONE)
        self._cancel_off = words_size
        self._cancel_src = self.scratch_mr.buf[words_size : words_size + 8].view(np.uint64)
        self.links: list[ServerLink] = []
        self.by_conn: dict[int, ServerLink] = {}
        self.max_servers = max_servers
        self.book: FrameBook[InFlight] = FrameBook(frames)
        self.inflight = self.book.inflight
        self.delivery_stats = self.book.stats
        self._chain = wire.PrefixChain(input_capacity)
        self._lost: list[int] = []  # frames lost with a link that went down, for check_links to return
        self._stalled: list[int] = []  # frames in flight on a link when it became unresponsive, for stalled()
        self._attempt: tuple[int, Future[ServerLink]] | None = None  # the re-attach under way: position, outcome

    # -- frames ---------------------------------------------------------------------
    def acquire(self) -> int | None:
        """A frame index the caller may fill (tokens, request header), or None if all are taken."""
        return self.book.acquire()

    def release(self, index: int) -> None:
        """Give a frame back once its result has been read (or it was refused)."""
        self.book.release(index)

    def capacity(self) -> FrameLayout:
        """The largest request and answer the first slot server takes in these frames."""
        if not self.links:
            return self.layout
        link = self.links[0]
        return FrameLayout(
            min(self.layout.input_capacity, link.input_capacity), min(self.layout.output_capacity, link.output_capacity)
        )

    def fileno(self) -> int:
        return self.transport.cq.fileno()

    def arm(self) -> bool:
        return self.transport.cq.arm()

    def alive(self) -> bool:
        """Whether any slot server is connected (UP or UNRESPONSIVE)."""
        return any(link.alive for link in self.links)

    def links_health(self) -> list[LinkHealth]:
        """Every slot server's link: state, reason, since when (one per attached server, in order)."""
        return [link.tracker.health() for link in self.links]

    # -- attaching ------------------------------------------------------------------
    def attach(self, address: str, timeout: float = 5.0) -> ServerLink:
        """Connect to a slot server and verify its pool (magic, ABI version, geometry)."""
        if len(self.links) >= self.max_servers:
            raise AgentError(f"already attached to {self.max_servers} slot servers")
        link = self._connect(address, len(self.links), timeout)
        self.links.append(link)
        self.by_conn[link.conn.conn_id] = link
        return link

    def _connect(self, address: str, position: int, timeout: float) -> ServerLink:
        info = wire.AgentHello(self.frames.count, self.layout.input_capacity, self.layout.output_capacity).info()
        try:
            conn = self.transport.connect(address, [self.replies_mr], info, timeout=timeout)
        except TransportError as exc:
            raise AgentError(f"cannot attach to slot server at {address}: {exc}") from exc
        try:
            return self._verify(address, conn, position)
        except Exception:
            conn.close()
            raise

    def revive(self, timeout: float = REATTACH_TIMEOUT) -> list[ServerLink]:
        """Re-attach slot servers that went away (restarted, say); the links that came back.

        Each down link is tried again with bounded exponential back-off (:data:`REATTACH_BACKOFF`), one try
        at a time, on a thread of its own: a connection set-up (each of its steps waits up to ``timeout``
        seconds) never holds the caller's loop, so this is cheap to call at every tick -- it starts a try
        that is due, and swaps in the link of a try that succeeded.  A revived server is a new pool (new
        epoch, new claimant id): nothing of the old one is trusted, and what was in flight there is answered
        by :meth:`check_links`."""
        revived = []
        now = self.clock()
        attempt = self._attempt
        if attempt is not None and attempt[1].done():
            self._attempt = None
            position, future = attempt
            old = self.links[position]
            try:
                link = future.result()
            except Exception as exc:  # AgentError or TransportError: nobody there yet, or not ready
                delay = old.rejoin.failed(now)
                tries = old.rejoin.failures - 1
                log.debug(
                    "slot server %s: re-attach try %d failed (%s); next in %.2f s", old.address, tries, exc, delay
                )
            else:
                self.by_conn.pop(old.conn.conn_id, None)
                old.conn.close()
                link.stats, link.reattaches = old.stats, old.reattaches + 1  # counted over every attach
                self.links[position] = link
                self.by_conn[link.conn.conn_id] = link
                revived.append(link)
                tries = old.rejoin.failures
                log.info("slot server %s is back (epoch %#x) after %d tries", old.address, link.epoch, tries)
        if self._attempt is None:
            for position, old in enumerate(self.links):
                if not old.alive and old.rejoin.due(now):
                    self._attempt = (position, self._try_attach(old.address, position, timeout))
                    break
        return revived

    @property
    def reattaching(self) -> bool:
        """Whether a re-attach try is under way (its outcome is taken by the next :meth:`revive`)."""
        return self._attempt is not None

    def _try_attach(self, address: str, position: int, timeout: float) -> Future[ServerLink]:
        """:meth:`_connect` on a thread of its own; what it made (or why not) arrives in the future.  Safe
        beside the caller's data path: it uses a new connection, the pool-header scratch (one try at a
        time) and the cached words of ``position``, whose old link is down and read by nobody."""
        future: Future[ServerLink] = Future()

        def attach() -> None:
            try:
                future.set_result(self._connect(address, position, timeout))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=attach, name=f"reattach-{position}", daemon=True).start()
        return future

    def _verify(self, address: str, conn: Connection, position: int) -> ServerLink:
        pool = conn.remote.get(wire.POOL_REGION)
        if pool is None or Access.REMOTE_ATOMIC not in pool.access or Access.REMOTE_WRITE not in pool.access:
            raise AgentError(f"{address}: peer exports no writable, atomic {wire.POOL_REGION!r} region")
        hdr_off = self.scratch_mr.buf.nbytes - POOL_HEADER.itemsize
        conn.read(self.scratch_mr, hdr_off, pool, 0, POOL_HEADER.itemsize)
        header = self.scratch_mr.buf[hdr_off : hdr_off + POOL_HEADER.itemsize].view(POOL_HEADER)[0]
        if int(header["magic"]) != MAGIC:
            raise AgentError(
                f"{address}: not an edgepath slot pool (magic {int(header['magic']):#x}, expected {MAGIC:#x})"
            )
        if int(header["abi_version"]) != ABI_VERSION:
            raise AgentError(
                f"{address}: slot pool ABI version {int(header['abi_version'])}, this agent "
                f"speaks {ABI_VERSION}; run agent and slot server from the same release"
            )
        n = int(header["slot_count"])
        if n > self._words_per_link:
            raise AgentError(f"{address}: pool has {n} slots, this agent caches at most {self._words_per_link}")
        head = int(header["states_offset"]) - wire.HEARTBEAT_OFFSET
        if not 8 <= head <= _HEAD:
            raise AgentError(
                f"{address}: the pool's state words start at byte {int(header['states_offset'])}, not right after "
                "its header"
            )
        words_offset = self._link_bytes * position + _HEAD
        words = self.scratch_mr.buf[words_offset : words_offset + 8 * n].view(np.uint64)
        beat = self.scratch_mr.buf[words_offset - head : words_offset - head + 8].view(np.uint64)
        entries, gap = int(header["prefix_entries"]), int(header["prefixes_offset"]) - int(header["states_offset"])
        if entries and not (8 * n <= gap and _HEAD + gap + 8 * entries <= self._link_bytes):
            raise AgentError(
                f"{address}: a prefix table of {entries} entries at byte {int(header['prefixes_offset'])}, not right "
                f"after the state words; this agent reads at most {wire.PREFIX_ENTRIES_MAX} entries there"
            )
        table_offset = words_offset + gap
        now = self.clock()
        link = ServerLink(
            address,
            conn,
            n,
            int(header["input_capacity"]),
            int(header["output_capacity"]),
            int(header["states_offset"]),
            int(header["doorbells_offset"]),
            int(header["cancels_offset"]),
            int(header["slots_offset"]),
            int(header["slot_stride"]),
            int(header["server_epoch"]),
            words,
            words_offset,
            pool,
            beat,
            LinkTracker(address, self.hang_timeout, now),
            rejoin=Retry(self.reattach),
            prefixes=self.scratch_mr.buf[table_offset : table_offset + 8 * entries].view(np.uint64),
            read_bytes=gap + 8 * entries if entries else 8 * n,
        )
        self._read(link)
        link.tracker.attached(int(link.beat[0]), now)
        return link

    def server_states(self, link: ServerLink) -> np.ndarray:
        """The server's state words now (one RDMA READ), e.g. for exact free-slot counts."""
        self._refresh(link)
        return link.words.copy()

    def _read(self, link: ServerLink) -> None:
        """One RDMA READ of the server's heartbeat and state words (and its prefix table, laid out right after
        them) into the cache."""
        link.stats.refreshes += 1
        link.conn.read(
            self.scratch_mr,
            link.words_offset - link.head,
            link.pool,
            wire.HEARTBEAT_OFFSET,
            link.head + link.read_bytes,
        )

    def _refresh(self, link: ServerLink) -> None:
        """Read the server's heartbeat and state words; the heartbeat tells the link's state."""
        self._read(link)
        tracker = link.tracker
        before = tracker.state
        state = tracker.observe(int(link.beat[0]), self.clock())
        if state is not before:
            health = tracker.health()
            if state is LinkState.UP:
                log.warning("slot server %s responds again (its heartbeat moved)", link.address)
            else:
                log.warning("slot server %s is unresponsive: %s", link.address, health.describe(health.since))
                self._stalled += [i for i, f in self.book.inflight.items() if f.link is link and not f.abandoned]

    def _probe(self, link: ServerLink) -> None:
        """Refresh ``link`` for its heartbeat; a failed read takes it down."""
        try:
            self._refresh(link)
        except TransportError as exc:
            self._link_down(link, exc)

    # -- claiming -------------------------------------------------------------------
    def _try_claim(self, link: ServerLink, slot: int) -> int | None:
        """CAS ``slot`` FREE -> CLAIMED; the generation claimed, or None. Learns the word on failure."""
        offset = link.states_offset + 8 * slot
        words = link.words_ptr
        expected = int(words[slot])
        for _ in range(2):  # second try only when the slot was FREE in a newer generation
            desired = claim_next(expected, link.claimant)
            if not desired:
                return None
            link.stats.cas_attempts += 1
            found = link.conn.compare_and_swap(link.pool, offset, expected, desired)
            if found == expected:
                words[slot] = desired
                return wire.word_generation(desired)
            link.stats.cas_failures += 1
            words[slot] = found
            if not wire.is_free(found):
                return None
            expected = found
        return None

    def claim(self, link: ServerLink) -> tuple[int, int] | None:
        """Claim any free slot of ``link``: (slot, generation), or None when none is free.

        Candidates are the slots the cache says are FREE, from a rotating cursor; a failed CAS
        teaches the cache the real word.  When the cache has no FREE slot left, one RDMA READ
        refreshes it and the scan runs once more; then the answer is final."""
        n = link.slot_count
        for attempt in range(2):
            slot = lib.ep_next_free(link.words_ptr, n, link.cursor)
            for _ in range(n):
                if slot < 0:
                    break
                gen = self._try_claim(link, slot)
                if gen is not None:
                    link.cursor = (slot + 1) % n
                    link.stats.claims += 1
                    return slot, gen
                slot = lib.ep_next_free(link.words_ptr, n, (slot + 1) % n)
            if attempt == 0:
                self._refresh(link)
        link.stats.no_slot += 1
        return None

    # -- requests -------------------------------------------------------------------
    def check_frame(self, index: int) -> str | None:
        """Why frame ``index`` cannot be sent (None if it can)."""
        if not 0 <= index < self.frames.count:
            return f"frame index {index} outside 0..{self.frames.count - 1}"
        if index in self.inflight:
            return f"frame {index} is already in flight"
        req = self.frames.request_headers[index]
        return wire.request_problem(
            req.token_count, req.max_new_tokens, self.layout.input_capacity, self.layout.output_capacity
        )

    def submit(self, index: int) -> Status | None:
        """Send frame ``index``. None: in flight (its result arrives via :meth:`poll`);
        otherwise the immediate outcome: NO_SLOT, UNAVAILABLE (no live server) or BAD_REQUEST."""
        if self.check_frame(index) is not None:
            return Status.BAD_REQUEST
        count = self.frames.request_headers[index].token_count
        links = self.links
        if not all(link.up for link in links):
            now = self.clock()  # an unresponsive server may have come back: look again, at most every probe interval
            for link in links:
                if link.alive and not link.up and now - link.tracker.observed >= self.probe_interval:
                    self._probe(link)
        live = [link for link in links if link.up and count <= link.input_capacity]
        if not live:
            return Status.UNAVAILABLE if not any(link.up for link in links) else Status.BAD_REQUEST
        matched = self._order(live, index, count) if len(live) > 1 else None
        for link in live:
            try:
                claimed = self.claim(link)
            except TransportError as exc:
                self._link_down(link, exc)
                continue
            if claimed is None:
                continue
            if matched and matched[link]:
                link.stats.affine += 1
            slot, gen = claimed
            try:
                self._send(link, index, slot, gen, count)
            except TransportError as exc:
                self.book.unsent(index)  # the caller still owns the frame: it answers and releases it
                link.inflight -= 1
                self._link_down(link, exc)
                return Status.UNAVAILABLE
            return None
        if not any(link.up for link in links):
            return Status.UNAVAILABLE
        return Status.NO_SLOT

    def _order(self, links: list[ServerLink], index: int, count: int) -> dict[ServerLink, int]:
        """Sort ``links`` into claim order: those with a free slot (as last seen) first; among them the one
        whose prefix table holds the longest prefix of frame ``index``'s ids, then the most free slots.  The
        blocks of it each server holds."""
        chain = self._chain
        chain.blocks = 0
        if count >= wire.PREFIX_BLOCK and any(len(link.prefixes) for link in links):
            chain.compute(self.frames.tokens[index, :count])
        free = {link: link.free_hint for link in links}
        matched = {link: chain.matched(link.prefixes) if free[link] else 0 for link in links}
        links.sort(key=lambda link: (not free[link], -matched[link], -free[link]))
        return matched

    def _send(self, link: ServerLink, index: int, slot: int, gen: int, count: int) -> None:
        frame_off = self.frames.frame_offset(index)
        self.frames.request_headers[index].stamp(gen, slot, index)
        pool = link.pool
        self.book.sent(index, InFlight(link=link, slot=slot, generation=gen))
        link.inflight += 1
        link.conn.write_then_imm(
            self.frames_mr,
            frame_off,
            pool,
            link.slots_offset + slot * link.slot_stride,
            self.layout.request_bytes(count),
            frame_off + _DOORBELL_FIELD,
            link.doorbells_offset + 8 * slot,
            8,
            wire.doorbell_imm(slot, gen),
        )

    def _link_down(self, link: ServerLink, exc: Exception) -> None:
        if link.alive:
            log.warning("slot server %s unavailable: %s; out of admission until it is back", link.address, exc)
        self._down(link, Reason.FAILED, str(exc))

    def _down(self, link: ServerLink, reason: Reason, detail: str = "") -> None:
        """``link`` is gone: its state says why, and what was in flight there is lost -- abandoned frames go
        back to the free list, the others wait in ``_lost`` for :meth:`check_links` to return them; the first
        loss starts its re-attach schedule (:meth:`revive`)."""
        now = self.clock()
        if link.alive:
            link.rejoin.failed(now)
        link.tracker.lost(reason, now, detail)
        link.inflight = 0
        self._lost += self.book.lose(lambda flight: flight.link is link)

    def deliver(self, conn_id: int, imm: int) -> Delivery | None:
        """Account one completion from a slot server: streamed progress or a final result. Anything
        that does not match a frame in flight there, in its generation, is counted and dropped."""
        index = wire.imm_index(imm)
        book = self.book
        flight = book.inflight.get(index)
        link = self.by_conn.get(conn_id)
        progress = wire.is_progress_imm(imm)
        if link is not None and not link.alive:
            # Sent before its link went down, polled after: what was in flight there is answered already (lost,
            # 503) and its frame maybe reused -- late, never a second answer (nor "unknown").
            book.stats.late += 1
            return None
        if flight is None or link is None or flight.link is not link:
            answered = self.frames.result_headers[index].generation if 0 <= index < self.frames.count else -1
            book.stray(index, not progress, answered)
            log.warning("ignoring a completion for frame %d from connection %d: not in flight", index, conn_id)
            return None
        gen = flight.generation
        result = self.frames.result_headers[index]
        if progress:
            count = result.placed_for(gen)
            if count is None:
                book.unknown()
                return None
            return book.progress(index, count)
        if result.generation != gen:
            book.unknown()
            log.warning("ignoring stale result for frame %d", index)
            return None
        link.inflight -= 1
        # The server frees the slot before notifying: remember it as FREE in this generation.
        link.words_ptr[flight.slot] = wire.free_word(gen)
        return book.final(index, result.output_count, gen)

    def cancel(self, index: int) -> None:
        """Write the slot's cancel word (its generation) and ring it: the slot server stops the handler at
        its next step and answers CANCELLED (or the result already on its way arrives)."""
        flight = self.inflight.get(index)
        if flight is None or flight.cancelled:
            return
        flight.cancelled = True
        link = flight.link
        if not link.alive:
            return
        self._cancel_src[0] = wire.cancel_word(flight.generation)
        try:
            link.conn.write_with_imm(
                self.scratch_mr,
                self._cancel_off,
                link.pool,
                link.cancels_offset + 8 * flight.slot,
                8,
                wire.cancel_imm(flight.slot, flight.generation),
            )
        except TransportError as exc:
            self._link_down(link, exc)

    def abandon(self, index: int) -> None:
        """Give up on frame ``index``: cancel its slot, deliver nothing more for it, and put the frame
        back on the free list when its final result arrives (or its slot server is lost) -- never
        before, so nothing of this request can land in the frame's next use."""
        if self.book.abandon(index) is not None:
            self.cancel(index)

    def fail_link(self, link: ServerLink) -> list[int]:
        """Mark ``link`` down (disconnected); frames lost with it (or with any link since the last call) are
        returned, except abandoned ones, which go straight back to the free list."""
        self._down(link, Reason.DISCONNECTED)
        lost, self._lost = self._lost, []
        return sorted(lost)

    def check_links(self) -> list[int]:
        """Handle connection events and read the heartbeat of every connected server not read within the
        probe interval; frames lost with a slot server that went away are returned (answer them 503)."""
        now = self.clock()
        for link in self.links:
            if not link.alive:
                continue
            if not link.conn.check_alive():
                log.warning("slot server %s disconnected", link.address)
                self._down(link, Reason.DISCONNECTED)
            elif now - link.tracker.observed >= self.probe_interval:
                self._probe(link)
        lost, self._lost = self._lost, []
        return sorted(lost)

    def stalled(self) -> list[int]:
        """Frames that were in flight on a slot server when it was found UNRESPONSIVE (even if it has come back
        since), each reported once; the caller answers them and abandons them (they stay fenced until that
        server lets go of them or its link is lost)."""
        stalled, self._stalled = self._stalled, []
        inflight = self.book.inflight
        return [index for index in stalled if index in inflight and not inflight[index].abandoned]

    def poll(self, timeout: float | None = 0.0, spin: float = 0.0) -> list[Delivery]:
        """What arrived for frames in flight: streamed progress and final results (in ``frames.results`` /
        ``frames.outputs``)."""
        out = []
        for c in self.transport.cq.wait(timeout, spin=spin, max_entries=256):
            delivery = self.deliver(c.conn_id, c.imm)
            if delivery is not None:
                out.append(delivery)
        return out

    def free_slots(self) -> tuple[int, int]:
        """(free slots on UP servers, slots on all servers), read now: one RDMA READ of the heartbeat and state
        words per connected server (which also tells whether it is still UP)."""
        free = 0
        for link in self.links:
            if not link.alive:
                continue
            self._probe(link)
            if link.up:
                free += link.free_hint
        return free, sum(link.slot_count for link in self.links)

    def servers(self) -> list[SlotServerStatus]:
        """Every slot server this agent attached, in attach order: the link's health, free slots read now
        (one RDMA READ of the heartbeat and state words per connected server; 0 unless it is up), slots,
        claims and re-attaches (over every attach)."""
        out = []
        for link in self.links:
            if link.alive:
                self._probe(link)
            free = link.free_hint if link.up else 0
            out.append(
                SlotServerStatus(link.tracker.health(), free, link.slot_count, link.stats.claims, link.reattaches)
            )
        return out

    def describe(self) -> dict[str, Any]:
        return {
            "servers": [
                {
                    "address": link.address,
                    "slots": link.slot_count,
                    "alive": link.alive,
                    "state": link.tracker.state.value,
                    "inflight": link.inflight,
                    **link.stats.__dict__,
                }
                for link in self.links
            ]
        }
