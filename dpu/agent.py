"""The DPU-side agent: claims a slot with a remote CAS, writes the request, rings the doorbell.

The agent owns a registered *frame* region.  Whoever feeds it (the edge, in
process or through :mod:`edgepath.dpu.agent_service`) writes a request's token
ids once, straight into a frame; the agent sends that frame to the claimed slot
with one RDMA WRITE (no copy on the way) and the slot server writes the result
back into the same frame's result area.

Admission is decided once, at claim time: a slot is taken only by a CAS of its
state word from FREE to CLAIMED.  If no CAS on any attached slot server succeeds
(after one refresh of the cached state words), the answer is NO_SLOT at once.

With several slot servers, a request goes first to one that has a free slot and
publishes the longest prefix of its ids (the pool's prefix table, read with the
state words in the same READ: the model side there reuses that prefix's KV
instead of computing it), then by free slots -- no queue, no extra round trip.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgepath.dma import wire
from edgepath.dma.pool import AgentFrames, FrameLayout
from edgepath.dma.slot_config import DEFAULT_CAPACITY
from edgepath.dma.transport import Access, Connection, MemoryRegion, RemoteRegion, Transport, TransportError
from edgepath.dma.wire import claim_next
from edgepath.dpu.frame_book import Flight, FrameBook
from edgepath.dpu.port import Delivery
from edgepath.native.abi import ABI_VERSION, MAGIC, POOL_HEADER, REQUEST_HEADER, State, Status, ffi, field_offset, lib

log = logging.getLogger("edgepath.agent")

_DOORBELL_FIELD = field_offset(REQUEST_HEADER, "doorbell")


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
    """One attached slot server: its connection, pool geometry and cached state words."""

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
    cursor: int = 0
    inflight: int = 0
    alive: bool = True
    stats: ClaimStats = field(default_factory=ClaimStats)
    #: the server's prefix table as last read (right after the cached words; empty: it publishes none)
    prefixes: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    #: bytes one refresh READs from the state words on: the words, and the prefix table when there is one
    read_bytes: int = 0

    def __post_init__(self) -> None:
        self.words_ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.words))

    @property
    def claimant(self) -> int:
        return self.conn.peer_assigned_id

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
    ) -> None:
        """Frames are two registered regions (least privilege): requests, which the agent only sends
        from -- no peer may write them (``frames_access`` widens that only for an agent whose edges
        share the region over loopback) -- and replies, the one region slot servers may write.
        ``frames_buffer``/``replies_buffer``: memory owned elsewhere (shared with edges) that
        ``transport`` registers in place (the verbs transport can), so the edges' token writes are
        what the NIC sends and results land where the edges read them."""
        self.transport = transport
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
        # Per server its cached state words and prefix table (as laid out in its pool: one READ), then a cancel
        # word to send from, then a pool header to read into.
        self._link_bytes = -(-8 * max_slots_per_server // 64) * 64 + 8 * wire.PREFIX_ENTRIES_MAX
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
        return any(link.alive for link in self.links)

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

    def revive(self, timeout: float = 0.05) -> list[ServerLink]:
        """Re-attach to slot servers that went away (restarted, say); the links that came back.

        A revived server is a new pool (new epoch, new claimant id): nothing of the old one is
        trusted, and what was in flight there was already answered by :meth:`fail_link`."""
        revived = []
        for position, old in enumerate(self.links):
            if old.alive:
                continue
            try:
                link = self._connect(old.address, position, timeout)
            except AgentError:
                continue
            self.by_conn.pop(old.conn.conn_id, None)
            old.conn.close()
            self.links[position] = link
            self.by_conn[link.conn.conn_id] = link
            revived.append(link)
            log.info("slot server %s is back (epoch %#x)", link.address, link.epoch)
        return revived

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
        words_offset = self._link_bytes * position
        words = self.scratch_mr.buf[words_offset : words_offset + 8 * n].view(np.uint64)
        entries, gap = int(header["prefix_entries"]), int(header["prefixes_offset"]) - int(header["states_offset"])
        if entries and not (8 * n <= gap and gap + 8 * entries <= self._link_bytes):
            raise AgentError(
                f"{address}: a prefix table of {entries} entries at byte {int(header['prefixes_offset'])}, not right "
                f"after the state words; this agent reads at most {wire.PREFIX_ENTRIES_MAX} entries there"
            )
        table_offset = words_offset + gap
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
            prefixes=self.scratch_mr.buf[table_offset : table_offset + 8 * entries].view(np.uint64),
            read_bytes=gap + 8 * entries if entries else 8 * n,
        )
        self._refresh(link)
        return link

    def server_states(self, link: ServerLink) -> np.ndarray:
        """The server's state words now (one RDMA READ), e.g. for exact free-slot counts."""
        self._refresh(link)
        return link.words.copy()

    def _refresh(self, link: ServerLink) -> None:
        """One RDMA READ of the server's state words (and its prefix table, laid out right after them) into
        the cache."""
        link.stats.refreshes += 1
        link.conn.read(self.scratch_mr, link.words_offset, link.pool, link.states_offset, link.read_bytes)

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
        live = [link for link in self.links if link.alive and count <= link.input_capacity]
        if not live:
            return Status.UNAVAILABLE if not any(link.alive for link in self.links) else Status.BAD_REQUEST
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
        if not any(link.alive for link in self.links):
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
            log.warning("slot server %s unavailable: %s", link.address, exc)
        link.alive = False

    def deliver(self, conn_id: int, imm: int) -> Delivery | None:
        """Account one completion from a slot server: streamed progress or a final result. Anything
        that does not match a frame in flight there, in its generation, is counted and dropped."""
        index = wire.imm_index(imm)
        book = self.book
        flight = book.inflight.get(index)
        link = self.by_conn.get(conn_id)
        progress = wire.is_progress_imm(imm)
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
        """Mark ``link`` down; frames that were in flight there (now lost) are returned, except abandoned
        ones, which go straight back to the free list."""
        link.alive = False
        link.inflight = 0
        return self.book.lose(lambda flight: flight.link is link)

    def check_links(self) -> list[int]:
        """Handle connection events; frames lost with a slot server that went away are returned."""
        lost: list[int] = []
        for link in self.links:
            if link.alive and not link.conn.check_alive():
                log.warning("slot server %s disconnected", link.address)
                lost.extend(self.fail_link(link))
        return lost

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
        """(free slots on live servers, slots on all servers), read now: one RDMA READ of the state words per server."""
        free = 0
        for link in self.links:
            if not link.alive:
                continue
            try:
                self._refresh(link)
            except TransportError as exc:
                self._link_down(link, exc)
                continue
            free += link.free_hint
        return free, sum(link.slot_count for link in self.links)

    def describe(self) -> dict[str, Any]:
        return {
            "servers": [
                {
                    "address": link.address,
                    "slots": link.slot_count,
                    "alive": link.alive,
                    "inflight": link.inflight,
                    **link.stats.__dict__,
                }
                for link in self.links
            ]
        }
