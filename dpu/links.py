"""The slot servers an agent is attached to: connect, verify, watch, lose and re-attach each one.

A :class:`LinkSet` owns the link lifecycle and nothing of the requests: it connects to a slot server and
verifies its pool (magic, ABI, geometry), keeps a cache of its header-from-the-heartbeat, state words and
prefix table -- all read by one RDMA READ, :meth:`LinkSet.refresh` -- and judges each link by its heartbeat
(:mod:`edgepath.dpu.link_state`): UP, UNRESPONSIVE or DOWN.  Whoever sends requests (the
:class:`~edgepath.dpu.agent.Agent`) hears of a link that went down or unresponsive through two callbacks,
so it can answer what it had in flight there; :class:`~edgepath.hangwatch.HangWatch` uses a link set alone
to read a heartbeat.  A link that went away is re-attached with bounded back-off, on a thread of its own
(:meth:`LinkSet.revive`).  The set may change while it serves (:mod:`edgepath.dpu.discovery`): a slot server
added is attached the same way (:meth:`LinkSet.add`), one removed is drained -- no new claims, what it holds
finishes there or moves -- and then let go of (:meth:`LinkSet.remove`, :meth:`LinkSet.settle`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from edgepath.contract import wire
from edgepath.contract.plan import Load
from edgepath.dpu.admission import Claimed
from edgepath.dpu.backoff import Backoff, Retry
from edgepath.dpu.link_state import LinkHealth, LinkState, LinkTracker, Reason, check_hang_timeout
from edgepath.dpu.port import SlotServerStatus
from edgepath.native.abi import ABI_VERSION, MAGIC, POOL_HEADER, State, ffi
from edgepath.transports.base import Access, Connection, MemoryRegion, RemoteRegion, Transport, TransportError

log = logging.getLogger("edgepath.agent")

#: bytes before each link's cached state words in the scratch region: ``[heartbeat .. state[0])`` of the
#: pool header lands there, read with the state words in one READ
HEAD = 256

#: re-attaching to a slot server that went away: first after 0.1 s, then doubling to one try every 2 s --
#: a restarted server (serve's own restarts after 0.1 s at first) is back in use within about 2 s of
#: listening again, and one that stays away costs one connection attempt every 2 s
REATTACH_BACKOFF = Backoff(first_delay=0.1, max_delay=2.0)
#: seconds each step of a re-attach's connection set-up may take (it runs on a thread of its own): generous,
#: since a slot server that has just started, or an emulated RDMA device, can be slow to answer
REATTACH_TIMEOUT = 2.0
#: seconds a draining slot server keeps the requests it runs before they move to another (``--drain-timeout``):
#: Kubernetes' default grace period, within which a terminating slot server finishes what it runs
DEFAULT_DRAIN_TIMEOUT = 30.0


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
    unclaims: int = 0  # claims given back unrung: a request's choices could not all be claimed (all or none)
    reclaims: int = 0  # running slots asked back for a tenant under its slot floor (docs/TENANTS.md)
    handovers: int = 0  # of those, slots handed over to this agent (or found FREE and claimed)


@dataclass(eq=False)
class ServerLink:
    """One attached slot server: its connection, pool geometry, cached state words and heartbeat, and the
    link's state (``tracker``)."""

    address: str
    conn: Connection
    slot_count: int
    input_capacity: int
    output_capacity: int
    states_offset: int  # in the pool (and its ``pool`` region); the words are the whole of ``states``
    doorbells_offset: int  # this and the next three: in ``inbox``
    cancels_offset: int
    reclaims_offset: int
    slots_offset: int
    slot_stride: int
    epoch: int
    words: np.ndarray  # cached state words (a registered local region, target of refresh READs)
    words_offset: int
    pool: RemoteRegion  # what the agent READs: the header, the load region, the state words, the prefix table
    states: RemoteRegion  # what it swaps by CAS: the state words
    inbox: RemoteRegion  # what it writes: doorbell, cancel and reclaim words, the slots
    beat: np.ndarray  # the heartbeat word as last read, in the same region, ``head`` bytes before the words
    loads: np.ndarray  # the load region as last read (with the heartbeat): one record of wire.LOAD_REGION
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
    position: int = 0  # its place in the link set's scratch region (kept over re-attaches, freed when let go)
    leaving: bool = False  # removed from the source of slot servers: let go of once drained, never re-attached
    #: the pool header's draining word as last read (with the heartbeat): nonzero once the server is stopping
    stopping: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.uint64))

    def __post_init__(self) -> None:
        self.words_ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.words))
        #: per slot, when its current claim (the word's tenant, generation and claimant) was first seen here (this
        #: link set's clock): how long a stream has run, to within a read -- a floor takes back the youngest first
        self.claimed_since = np.zeros(len(self.words))
        self._claims_seen = np.zeros(len(self.words), dtype=np.uint64)
        #: bytes of the pool header and load region read before the state words: from the heartbeat word on
        self.head = self.states_offset - wire.HEARTBEAT_OFFSET
        self._load = Load()  # the last whole load region read, parsed (a torn read keeps it)
        self._load_version = 0
        self._load_end = self.loads.view(np.uint64)[:1]  # its version word, cheap to read
        #: what this agent wrote into each slot it claimed, with that claim's generation and order
        self._written: dict[int, tuple[int, int, Claimed]] = {}
        self._writes = 0

    @property
    def claimant(self) -> int:
        return self.conn.peer_assigned_id

    @property
    def alive(self) -> bool:
        """Connected (UP, UNRESPONSIVE or DRAINING): what it had in flight may still be answered."""
        return self.tracker.state is not LinkState.DOWN

    @property
    def up(self) -> bool:
        """Connected, not draining and its heartbeat moving: the only kind of link a slot is claimed on."""
        return self.tracker.state is LinkState.UP

    @property
    def draining(self) -> bool:
        return self.tracker.state is LinkState.DRAINING

    @property
    def free_hint(self) -> int:
        """Free slots as last seen (cached words), an ordering hint across servers."""
        return int(np.count_nonzero(wire.in_state(self.words, State.FREE)))

    @property
    def load(self) -> Load:
        """What the server's model side had to do when last read whole (:class:`~edgepath.contract.plan.Load`;
        parsed once per version it publishes)."""
        version = int(self._load_end[0])
        if version != self._load_version:
            load = wire.read_load(self.loads[0])
            if load is not None:  # the slots are the pool's (objective 9's full house), not the region's
                self._load, self._load_version = replace(load, slots=len(self.words)), version
        return self._load

    def under_way_ms(self, now: float) -> float | None:
        """How long the step the server planned from :attr:`load` has been running at ``now`` (this link set's clock):
        what it had run when last read (:func:`~edgepath.contract.wire.under_way_ms`, the server's own clock) and the
        time since; None when the server does not say."""
        if not self.load.published:  # (reading it also takes the version last read whole)
            return None
        ran = wire.under_way_ms(int(self.beat[0]), self._load_version)
        return None if ran is None else ran + max(0.0, now - self.tracker.observed) * 1e3

    def saw(self, now: float) -> None:
        """The words were read at ``now``: a slot whose claim changed since the last read was claimed then (to within
        the time between two reads)."""
        claims = self.words >> np.uint64(8)
        changed = claims != self._claims_seen
        if changed.any():
            self._claims_seen[changed] = claims[changed]
            self.claimed_since[changed] = now

    def wrote(self, slot: int, generation: int, claim: Claimed) -> None:
        """This agent wrote ``claim`` into ``slot``, claimed in ``generation``: what :attr:`unseen` counts for it
        until the model side takes it."""
        self._writes += 1
        self._written[slot] = (generation, self._writes, claim)

    @property
    def unseen(self) -> list[Claimed | None]:
        """Slots claimed (by anyone) whose request the model side had not taken when last read, and this
        agent's claims since (CLAIMED or READY in the cached words), in the order the model side takes them:
        another claimant's first (None: its prompt is not known here), then this agent's in the order it rang
        them (a server takes doorbells in the order they arrive), each as it wrote it."""
        words = self.words
        slots = np.flatnonzero(wire.in_state(words, State.CLAIMED) | wire.in_state(words, State.READY))
        if not len(slots):
            return []
        mine: list[tuple[int, Claimed]] = []
        others: list[Claimed | None] = []
        for slot in slots.tolist():
            written = self._written.get(slot)
            if written is not None and written[0] == wire.word_generation(int(words[slot])):
                mine.append((written[1], written[2]))
            else:
                others.append(None)
        mine.sort(key=lambda entry: entry[0])
        return others + [claim for _, claim in mine]


def _ignore(link: ServerLink) -> None:
    """The default reaction to a link that went down or unresponsive: a link set used only to watch."""


class LinkSet:
    """The slot servers one agent is attached to (at most ``max_servers``, in attach order)."""

    def __init__(
        self,
        transport: Transport,
        hello: wire.AgentHello,
        exports: list[MemoryRegion],
        max_servers: int,
        max_slots_per_server: int,
        hang_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        reattach: Backoff = REATTACH_BACKOFF,
        on_down: Callable[[ServerLink], None] = _ignore,
        on_unresponsive: Callable[[ServerLink], None] = _ignore,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
    ) -> None:
        """``hello``: what the agent tells each slot server of itself (frames, capacities); ``exports``: the
        regions each server is given (the agent's replies); ``on_down``/``on_unresponsive``: called once
        each time a link goes DOWN, or from UP to UNRESPONSIVE (the caller answers what it had there);
        ``drain_timeout``: seconds a draining server keeps what it runs before the link is let go of (its
        requests then move, through ``on_down``)."""
        if not drain_timeout >= 0:
            raise ValueError(f"drain timeout must be >= 0 seconds, got {drain_timeout}")
        self.drain_timeout = drain_timeout
        self.hang_timeout = check_hang_timeout(hang_timeout)  # before anything is registered
        self.transport = transport
        self.clock = clock
        self.reattach = reattach
        #: seconds after which :meth:`check` reads a link's heartbeat that nothing else has read
        self.probe_interval = min(0.1, hang_timeout / 4)
        self._hello = hello
        self._exports = exports
        self._on_down = on_down
        self._on_unresponsive = on_unresponsive
        self._words_per_link = max_slots_per_server
        # Per server [pool header from its heartbeat][cached state words, padded to a cache line][its prefix
        # table] (as laid out in its pool: one READ), then the word a signal (a cancel, a reclaim) is sent from --
        # a WRITE returns once its data is placed, so one word serves every signal --, then a pool header to read
        # into.
        self._link_bytes = HEAD + -(-8 * max_slots_per_server // 64) * 64 + 8 * wire.PREFIX_ENTRIES_MAX
        words_size = self._link_bytes * max_servers
        self.scratch_mr = transport.register("words", words_size + 8 + POOL_HEADER.itemsize, Access.NONE)
        self._signal_off = words_size
        self._signal_src = self.scratch_mr.buf[words_size : words_size + 8].view(np.uint64)
        self.links: list[ServerLink] = []
        self.by_conn: dict[int, ServerLink] = {}
        self.max_servers = max_servers
        #: connection ids of links let go of after a drain: a completion still queued from one is late, not stray
        self.retired: set[int] = set()
        #: slot servers added (:meth:`add`) and not attached yet, each with its attach schedule
        self.joining: dict[str, Retry] = {}
        self._positions = list(range(max_servers))  # scratch positions no link holds, lowest first
        #: the attach under way: the address, its scratch position, the down link it replaces (None: a new one)
        #: and its outcome
        self._attempt: tuple[str, int, ServerLink | None, Future[ServerLink]] | None = None

    def __iter__(self) -> Iterator[ServerLink]:
        return iter(self.links)

    def alive(self) -> bool:
        """Whether any slot server is connected (UP, UNRESPONSIVE or DRAINING)."""
        return any(link.alive for link in self.links)

    def health(self) -> list[LinkHealth]:
        """Every slot server's link: state, reason, since when (one per attached server, in order)."""
        return [link.tracker.health() for link in self.links]

    # -- attaching ------------------------------------------------------------------
    def attach(self, address: str, timeout: float = 5.0) -> ServerLink:
        """Connect to a slot server and verify its pool (magic, ABI version, geometry)."""
        if not self._positions:
            raise AgentError(f"already attached to {self.max_servers} slot servers")
        position = self._positions.pop(0)
        try:
            link = self._connect(address, position, timeout)
        except BaseException:
            self._free(position)
            raise
        self._join(link)
        return link

    def join_now(self, timeout: float = 5.0) -> None:
        """Attach every slot server added and not attached yet, now, on the caller's thread (at start, before
        serving); one that does not answer is tried again by :meth:`revive`, with back-off."""
        for address, retry in list(self.joining.items()):
            try:
                link = self.attach(address, timeout)
            except AgentError as exc:
                retry.failed(self.clock())
                log.warning("slot server %s: not attached yet (%s); trying again with back-off", address, exc)
            else:
                log.info(
                    "attached to slot server %s: %d slots, claimant id %d", address, link.slot_count, link.claimant
                )

    def _join(self, link: ServerLink) -> None:
        self.joining.pop(link.address, None)
        self.links.append(link)
        self.by_conn[link.conn.conn_id] = link

    def _free(self, position: int) -> None:
        self._positions.append(position)
        self._positions.sort()

    def find(self, address: str) -> ServerLink | None:
        """The link to the slot server at ``address``, if attached."""
        return next((link for link in self.links if link.address == address), None)

    def add(self, address: str) -> None:
        """A slot server to attach: :meth:`revive` attaches it (bounded back-off until it answers); one being
        drained is claimed again at once."""
        link = self.find(address)
        if link is None:
            self.joining.setdefault(address, Retry(self.reattach))
        elif link.leaving:
            link.leaving = False
            link.tracker.undrain(self.clock())  # a link down meanwhile is re-attached as any other
            log.info("slot server %s is back in the source: claimed again", address)

    def remove(self, address: str, why: str = "it left the source of slot servers") -> None:
        """A slot server to let go of: nothing new is claimed there, what it holds finishes there (or moves
        after the drain timeout; :meth:`settle`); one not attached yet is forgotten."""
        self.joining.pop(address, None)
        link = self.find(address)
        if link is not None and not link.leaving:
            link.leaving = True
            link.tracker.drain(self.clock(), why)
            log.info("slot server %s: draining (%s); %d requests in flight there", address, why, link.inflight)

    def settle(self) -> None:
        """Finish drains: a draining link still holding requests after the drain timeout, or whose heartbeat
        stood still for the hang timeout, is taken down -- its requests move (``on_down``); one that left the
        source is let go of (its connection closed, its place freed) once nothing is in flight there or it is
        down."""
        now = self.clock()
        for link in [link for link in self.links if link.leaving or link.draining]:
            tracker = link.tracker
            if link.draining and link.inflight:
                if now - tracker.health().since >= self.drain_timeout or now - tracker.heard >= self.hang_timeout:
                    link.conn.close()
                    self.down(link, Reason.DRAINED, "its requests did not finish within the drain")
                continue
            if link.leaving and (self._attempt is None or self._attempt[2] is not link):
                self._retire(link)

    def _retire(self, link: ServerLink) -> None:
        self.links.remove(link)
        self.by_conn.pop(link.conn.conn_id, None)
        self.retired.add(link.conn.conn_id)
        link.conn.close()
        self._free(link.position)
        log.info("slot server %s drained: let go of (%d claims there)", link.address, link.stats.claims)

    def _connect(self, address: str, position: int, timeout: float) -> ServerLink:
        try:
            conn = self.transport.connect(address, self._exports, self._hello.info(), timeout=timeout)
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
        epoch, new claimant id): nothing of the old one is trusted, and what was in flight there was
        answered when the old link went down."""
        revived = []
        now = self.clock()
        attempt = self._attempt
        if attempt is not None and attempt[3].done():
            self._attempt = None
            address, position, old, future = attempt
            try:
                link = future.result()
            except Exception as exc:  # AgentError or TransportError: nobody there yet, or not ready
                self._attempt_failed(address, position, old, exc, now)
            else:
                if old is not None and old.leaving:  # removed from the source while it was being re-attached
                    link.conn.close()
                elif old is not None:
                    self.by_conn.pop(old.conn.conn_id, None)
                    old.conn.close()
                    link.stats, link.reattaches = old.stats, old.reattaches + 1  # counted over every attach
                    self.links[self.links.index(old)] = link
                    self.by_conn[link.conn.conn_id] = link
                    log.info(
                        "slot server %s is back (epoch %#x) after %d tries", address, link.epoch, old.rejoin.failures
                    )
                    revived.append(link)
                elif address in self.joining:
                    self._join(link)
                    log.info(
                        "attached to slot server %s: %d slots, claimant id %d", address, link.slot_count, link.claimant
                    )
                    revived.append(link)
                else:  # removed from the source while it was being attached
                    link.conn.close()
                    self._free(position)
        if self._attempt is None:
            self._start_attempt(now, timeout)
        return revived

    def _attempt_failed(self, address: str, position: int, old: ServerLink | None, exc: Exception, now: float) -> None:
        retry = old.rejoin if old is not None else self.joining.get(address)
        if old is None:
            self._free(position)
        if retry is not None:
            delay = retry.failed(now)
            log.debug("slot server %s: attach try %d failed (%s); next in %.2f s", address, retry.failures, exc, delay)

    def _start_attempt(self, now: float, timeout: float) -> None:
        """Start the due attach that has waited longest: a link that went down (not one being drained), or a
        slot server added and not attached yet (when a place is free)."""
        due: list[tuple[float, str, ServerLink | None]] = [
            (old.rejoin.next_at, old.address, old)
            for old in self.links
            if not old.alive and not old.leaving and old.rejoin.due(now)
        ]
        if self._positions:
            due += [(retry.next_at, address, None) for address, retry in self.joining.items() if retry.due(now)]
        if not due:
            return
        _, address, old = min(due, key=lambda entry: entry[0])
        position = old.position if old is not None else self._positions.pop(0)
        self._attempt = (address, position, old, self._try_attach(address, position, timeout))

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
        if pool is None or Access.REMOTE_READ not in pool.access:
            raise AgentError(f"{address}: peer exports no readable {wire.POOL_REGION!r} region")
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
        if int(header["load_offset"]) != wire.LOAD_OFFSET or not 8 <= head <= HEAD:
            raise AgentError(
                f"{address}: the pool's load region starts at byte {int(header['load_offset'])} and its state words "
                f"at byte {int(header['states_offset'])}, not right after its header"
            )
        words_offset = self._link_bytes * position + HEAD
        words = self.scratch_mr.buf[words_offset : words_offset + 8 * n].view(np.uint64)
        beat = self.scratch_mr.buf[words_offset - head : words_offset - head + 8].view(np.uint64)
        at = words_offset - head + wire.LOAD_OFFSET - wire.HEARTBEAT_OFFSET
        loads = self.scratch_mr.buf[at : at + wire.LOAD_REGION.itemsize].view(wire.LOAD_REGION)
        entries, gap = int(header["prefix_entries"]), int(header["prefixes_offset"]) - int(header["states_offset"])
        if entries and not (8 * n <= gap and HEAD + gap + 8 * entries <= self._link_bytes):
            raise AgentError(
                f"{address}: a prefix table of {entries} entries at byte {int(header['prefixes_offset'])}, not right "
                f"after the state words; this agent reads at most {wire.PREFIX_ENTRIES_MAX} entries there"
            )
        regions = {}
        layout = (int(header["states_offset"]), n, int(header["doorbells_offset"]), int(header["total_size"]))
        for export in wire.pool_exports(*layout):
            region = conn.remote.get(export.name)
            if region is None or export.access not in region.access or region.length != export.length:
                raise AgentError(
                    f"{address}: peer exports no {export.name!r} region of {export.length} bytes granting "
                    f"{export.access.name} (pool geometry of ABI {ABI_VERSION})"
                )
            regions[export.name] = region
        inbox = int(header["doorbells_offset"])  # where the inbox region starts in the pool
        table_offset = words_offset + gap
        at_drain = words_offset - head + wire.DRAINING_OFFSET - wire.HEARTBEAT_OFFSET
        now = self.clock()
        link = ServerLink(
            address,
            conn,
            n,
            int(header["input_capacity"]),
            int(header["output_capacity"]),
            int(header["states_offset"]),
            0,
            int(header["cancels_offset"]) - inbox,
            int(header["reclaims_offset"]) - inbox,
            int(header["slots_offset"]) - inbox,
            int(header["slot_stride"]),
            int(header["server_epoch"]),
            words,
            words_offset,
            pool,
            regions[wire.STATES_REGION],
            regions[wire.INBOX_REGION],
            beat,
            loads,
            LinkTracker(address, self.hang_timeout, now),
            rejoin=Retry(self.reattach),
            position=position,
            stopping=self.scratch_mr.buf[at_drain : at_drain + 8].view(np.uint64),
            prefixes=self.scratch_mr.buf[table_offset : table_offset + 8 * entries].view(np.uint64),
            read_bytes=gap + 8 * entries if entries else 8 * n,
        )
        self._read(link)
        link.tracker.attached(int(link.beat[0]), now)
        self._heed_drain(link, now)
        return link

    def _heed_drain(self, link: ServerLink, now: float) -> None:
        """A server that says it drains (its pool header's word, read with the heartbeat) is claimed no more."""
        if link.stopping[0] and not link.draining and link.alive:
            link.tracker.drain(now, "the slot server is stopping")
            log.info(
                "slot server %s is stopping: draining it; %d requests in flight there", link.address, link.inflight
            )

    # -- reading --------------------------------------------------------------------
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

    def refresh(self, link: ServerLink) -> None:
        """Read the server's heartbeat and state words; the heartbeat tells the link's state (TransportError
        when the READ fails: the caller takes the link down)."""
        self._read(link)
        tracker = link.tracker
        now = self.clock()
        link.saw(now)
        self._heed_drain(link, now)
        before = tracker.state
        state = tracker.observe(int(link.beat[0]), now)
        if state is not before:
            health = tracker.health()
            if state is LinkState.UP:
                log.warning("slot server %s responds again (its heartbeat moved)", link.address)
            else:
                log.warning("slot server %s is unresponsive: %s", link.address, health.describe(health.since))
                self._on_unresponsive(link)

    def probe(self, link: ServerLink) -> None:
        """Refresh ``link`` for its heartbeat; a failed read takes it down."""
        try:
            self.refresh(link)
        except TransportError as exc:
            self.failed(link, exc)

    def probe_stale(self) -> None:
        """Look again at connected links that are not UP (one may have come back), at most every probe
        interval each: what a request does before it is refused for want of an UP server."""
        now = self.clock()
        for link in self.links:
            if link.alive and not link.up and not link.draining and now - link.tracker.observed >= self.probe_interval:
                self.probe(link)

    def check(self) -> None:
        """Handle connection events and read the heartbeat of every connected server not read within the
        probe interval."""
        now = self.clock()
        for link in self.links:
            if not link.alive:
                continue
            if not link.conn.check_alive():
                log.warning("slot server %s disconnected", link.address)
                self.down(link, Reason.DISCONNECTED)
            elif now - link.tracker.observed >= self.probe_interval:
                self.probe(link)

    # -- losing ---------------------------------------------------------------------
    def failed(self, link: ServerLink, exc: Exception) -> None:
        """An operation on ``link`` failed: it is down."""
        if link.alive:
            log.warning("slot server %s unavailable: %s; out of admission until it is back", link.address, exc)
        self.down(link, Reason.FAILED, str(exc))

    def down(self, link: ServerLink, reason: Reason, detail: str = "") -> None:
        """``link`` is gone: its state says why, the first loss starts its re-attach schedule
        (:meth:`revive`), and the agent hears of it (``on_down``) to answer what it had there."""
        now = self.clock()
        if link.alive:
            link.rejoin.failed(now)
        link.tracker.lost(reason, now, detail)
        link.inflight = 0
        self._on_down(link)

    # -- writing --------------------------------------------------------------------
    def send_cancel(self, link: ServerLink, slot: int, generation: int) -> bool:
        """Write ``slot``'s cancel word (its generation) and ring it; False when that fails (the link is then down)."""
        return self._signal(
            link, link.cancels_offset, slot, wire.cancel_word(generation), wire.cancel_imm(slot, generation)
        )

    def send_reclaim(self, link: ServerLink, slot: int, generation: int, word: int) -> bool:
        """Write ``slot``'s reclaim word -- ``word``, the CLAIMED word of the generation after ``generation`` this
        agent asks the slot to be handed over as -- and ring it; False when that fails (the link is then down)."""
        if not self._signal(link, link.reclaims_offset, slot, word, wire.reclaim_imm(slot, generation)):
            return False
        link.stats.reclaims += 1
        return True

    def _signal(self, link: ServerLink, words_offset: int, slot: int, word: int, imm: int) -> bool:
        """The one way an agent signals a slot: write ``word`` into the slot's entry of the word array at
        ``words_offset`` of the inbox region and ring it with ``imm`` (one WRITE_WITH_IMM, from the link set's
        scratch word); a failure takes the link down."""
        self._signal_src[0] = word
        try:
            link.conn.write_with_imm(self.scratch_mr, self._signal_off, link.inbox, words_offset + 8 * slot, 8, imm)
        except TransportError as exc:
            self.failed(link, exc)
            return False
        return True

    # -- reporting ------------------------------------------------------------------
    def free_slots(self) -> tuple[int, int]:
        """(free slots on UP servers, slots on all servers), read now: one RDMA READ of the heartbeat and state
        words per connected server (which also tells whether it is still UP)."""
        free = 0
        for link in self.links:
            if not link.alive:
                continue
            self.probe(link)
            if link.up:
                free += link.free_hint
        return free, sum(link.slot_count for link in self.links)

    def servers(self) -> list[SlotServerStatus]:
        """Every slot server attached, in attach order: the link's health, free slots read now (one RDMA READ
        of the heartbeat and state words per connected server; 0 unless it is up), slots, claims and
        re-attaches (over every attach)."""
        out = []
        for link in self.links:
            if link.alive:
                self.probe(link)
            free = link.free_hint if link.up else 0
            out.append(
                SlotServerStatus(link.tracker.health(), free, link.slot_count, link.stats.claims, link.reattaches)
            )
        return out

    def describe(self) -> list[dict[str, Any]]:
        return [
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
