"""The wire contract: everything two edgepath processes agree on, in one place.

Layouts come from the C header (``native/edgepath_slot.h``, via :mod:`edgepath.native.abi`); this
module owns what the header cannot say on its own and every component needs: the names of the
regions peers export and the access each grants, the encodings of the 64-bit words written
through the transport (state, doorbell, cancel, progress) and of the 32-bit immediates that
announce them (slot server <-> agent and edge <-> agent), the private data each side sends when a
connection is set up, the agent's status region, typed views of the request and result headers, the
prefix table a slot server publishes (chain hashes of token blocks), and the request validation both
the writer and the reader apply.  No component imports another component to learn a name, and no
component decodes a word with its own bit masks.

Streams of a request, by direction:

* agent -> slot server: request header + tokens (one WRITE), then the doorbell word with
  ``doorbell_imm``; later, maybe, the cancel word with ``cancel_imm``.
* slot server -> agent: output tokens as they are produced (WRITEs into the reply entry), each
  batch followed by the ``progress`` word of the result header with ``progress_imm``; at the end
  the whole result header with ``final_imm``.  Every word carries the request's generation, so a
  write for an older request of the same entry is recognised and ignored.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from edgepath.contract.plan import Costs, Load, PolicyOptions, Prompt
from edgepath.native.abi import POOL_HEADER, Event, State, Status, StepError, ffi, field_offset, lib, struct_dtype
from edgepath.transports.base import Access

# -- regions -------------------------------------------------------------------------------------
#: A slot server's pool is exported as three regions over the one memory, each granting an agent only what it
#: needs (docs/DATAPATH.md, "Who may touch what"): ``pool`` -- the header, the load region, the state words and the
#: prefix table, what admission reads (READ); ``states`` -- the state words, what a claim swaps (ATOMIC); ``inbox``
#: -- the doorbell, cancel and reclaim words and the slots, what claiming and submitting write (WRITE).  No agent
#: can READ a slot: another's prompt or answer.
POOL_REGION = "pool"
POOL_ACCESS = Access.REMOTE_READ
STATES_REGION = "states"
STATES_ACCESS = Access.REMOTE_ATOMIC
INBOX_REGION = "inbox"
INBOX_ACCESS = Access.REMOTE_WRITE


@dataclass(frozen=True)
class Export:
    """A region a slot server exports: ``length`` bytes of its pool from byte ``start``, granting ``access``."""

    name: str
    start: int
    length: int
    access: Access


def pool_exports(states_offset: int, slot_count: int, doorbells_offset: int, total_size: int) -> list[Export]:
    """The regions a pool of this layout (its header's fields) is exported as: what the slot server registers and
    what an agent checks it was given."""
    return [
        Export(POOL_REGION, 0, doorbells_offset, POOL_ACCESS),
        Export(STATES_REGION, states_offset, 8 * slot_count, STATES_ACCESS),
        Export(INBOX_REGION, doorbells_offset, total_size - doorbells_offset, INBOX_ACCESS),
    ]


#: an agent's request entries ``[request header][tokens]``: edges fill them, the agent sends from them
REQUESTS_REGION = "requests"
#: an agent's reply entries ``[result header][output]``: the one region a slot server may write
REPLIES_REGION = "replies"
REPLIES_ACCESS = Access.REMOTE_WRITE
#: an agent process's published status (free slots, total slots, slot servers alive), read by edges
STATUS_REGION = "status"
#: an edge's 8-byte landing spot for its agent's zero-length WRITE_WITH_IMM answers
COMPLETIONS_REGION = "completions"

#: byte offset of the pool header's heartbeat word: the slot server advances it at every turn of its loop (and from
#: inside long steps) to its CLOCK_MONOTONIC in ns; readers compare its values for liveness, and subtract the load
#: region's version from it (:func:`under_way_ms`) -- an agent reads ``[heartbeat .. state[n-1]]`` in one READ
HEARTBEAT_OFFSET = field_offset(POOL_HEADER, "heartbeat")
#: byte offset of the pool header's draining word (in the same READ): nonzero once the slot server is stopping
DRAINING_OFFSET = field_offset(POOL_HEADER, "draining")
#: the load region (``struct ep_load``; micro-batch costs since ABI 9): right after the pool header, before the
#: state words, so the READ from the heartbeat on carries it; the step policy's costs, knobs and work
#: (:class:`~edgepath.contract.plan.Load`)
LOAD_REGION = struct_dtype("ep_load")
LOAD_OFFSET = POOL_HEADER.itemsize
#: prompts in prefill the region lists one by one (more are summed into the last entry)
LOAD_PROMPTS = int(lib.EP_LOAD_PROMPTS)


def load_record(load: Load) -> np.ndarray:
    """The load region's fields for ``load`` (its sequence-lock words left 0: ``ep_load_publish`` sets them)."""
    record = np.zeros(1, dtype=LOAD_REGION)
    if not load.published:
        return record
    r = record[0]
    costs, options = load.costs, load.options
    assert options is not None
    r["overhead_ms"], r["prompt_ms"], r["decode_ms"] = costs.overhead_ms, costs.prompt_ms, costs.decode_ms
    r["context_ms"], r["decode_context_ms"] = costs.context_ms, costs.decode_context_ms
    r["stall_ms"], r["min_prefill"], r["batch"] = options.stall_ms, options.min_prefill, options.batch
    r["decoding"], r["runs"], r["longest"], r["prefilling"] = load.decoding, load.runs, load.longest, len(load.waiting)
    waiting = load.waiting
    if len(waiting) > LOAD_PROMPTS:  # the rest summed into the last entry: they follow it, oldest first
        rest = waiting[LOAD_PROMPTS - 1 :]
        waiting = (*waiting[: LOAD_PROMPTS - 1], Prompt(rest[0].done, sum(p.remaining for p in rest)))
    r["listed"] = len(waiting)
    r["floors"] = min(load.floors, len(waiting) - (len(load.waiting) > LOAD_PROMPTS))  # never the summed entry
    r["lent_ms"] = load.lent_ms
    pairs = r["prompts"]
    for i, prompt in enumerate(waiting):
        pairs[2 * i], pairs[2 * i + 1] = min(prompt.done, 0xFFFFFFFF), min(prompt.remaining, 0xFFFFFFFF)
    return record


def under_way_ms(beat: int, version: int) -> float | None:
    """How long the step planned from a load region of ``version`` had run when the heartbeat word read ``beat``:
    both are the server's CLOCK_MONOTONIC in ns when stored (ABI 11), and the server publishes its load after each
    step, so the next starts then.  0 when the heartbeat was stored before the load (the step had just begun);
    None when either word was never stored (no load published, no heartbeat yet): nothing is known."""
    if not beat or not version:
        return None
    return max(0, beat - version) / 1e6


def read_load(region: np.void) -> Load | None:
    """The :class:`~edgepath.contract.plan.Load` in a copy of a load region; None when the copy is torn (read
    while the server rewrote it: keep the previous one).  All zero: the server publishes no load."""
    if int(region["end"]) != int(region["begin"]):
        return None
    batch = int(region["batch"])
    if not batch:
        return Load()
    costs = Costs(
        float(region["overhead_ms"]),
        float(region["prompt_ms"]),
        float(region["decode_ms"]),
        float(region["context_ms"]),
        float(region["decode_context_ms"]),
    )
    options = PolicyOptions(float(region["stall_ms"]), int(region["min_prefill"]), batch)
    pairs = region["prompts"]
    listed = min(int(region["listed"]), LOAD_PROMPTS)
    waiting = tuple(Prompt(int(pairs[2 * i]), int(pairs[2 * i + 1])) for i in range(listed) if pairs[2 * i + 1])
    floors = min(int(region["floors"]), len(waiting))
    decoding, longest, runs = int(region["decoding"]), int(region["longest"]), int(region["runs"])
    return Load(costs, options, decoding, longest, waiting, runs, floors, float(region["lent_ms"]))


# -- connection private data (what each side tells the other when a connection is set up) ---------------
#: keys both hops send: token capacities of a frame
INPUT_CAPACITY, OUTPUT_CAPACITY = "input_capacity", "output_capacity"
#: keys an agent sends a slot server: how many reply entries it exports, and where the first one starts
FRAMES, REPLIES_OFFSET = "frames", "replies_offset"
#: keys an agent process sends an edge on accept: the edge's own range of frames
FRAME_BASE, FRAME_COUNT = "frame_base", "frame_count"
#: the key an agent process sends every edge: its slot servers' addresses (the status region's links, in order)
SLOT_SERVERS = "slot_servers"
#: the key an edge sends an agent process, and its value: who is connecting
ROLE, ROLE_EDGE = "role", "edge"


class InfoInvalid(ValueError):
    """Connection private data that lacks a key or carries a value of the wrong kind."""


def _ints(info: Mapping[str, Any], *keys: str) -> list[int]:
    try:
        return [int(info[key]) for key in keys]
    except KeyError as exc:
        raise InfoInvalid(f"missing {exc.args[0]!r} (has {sorted(info)})") from None
    except (TypeError, ValueError) as exc:
        raise InfoInvalid(f"not an integer: {exc}") from None


@dataclass(frozen=True, slots=True)
class AgentHello:
    """What an agent tells a slot server: its ``replies`` region holds ``frames`` entries of
    ``[result header][output]`` from byte ``replies_offset``, for frames of these capacities."""

    frames: int
    input_capacity: int
    output_capacity: int
    replies_offset: int = 0

    def info(self) -> dict[str, int]:
        return {
            FRAMES: self.frames,
            INPUT_CAPACITY: self.input_capacity,
            OUTPUT_CAPACITY: self.output_capacity,
            REPLIES_OFFSET: self.replies_offset,
        }

    @classmethod
    def parse(cls, info: Mapping[str, Any]) -> AgentHello:
        frames, inputs, outputs = _ints(info, FRAMES, INPUT_CAPACITY, OUTPUT_CAPACITY)
        (offset,) = _ints({REPLIES_OFFSET: 0, **info}, REPLIES_OFFSET)
        return cls(frames, inputs, outputs, offset)


def edge_hello() -> dict[str, str]:
    """What an edge tells an agent process."""
    return {ROLE: ROLE_EDGE}


def is_edge_hello(info: Mapping[str, Any]) -> bool:
    return info.get(ROLE) == ROLE_EDGE


@dataclass(frozen=True, slots=True)
class EdgeGrant:
    """What an agent process tells an edge: frame capacities and its slot servers' addresses, in the order
    of the status region's links (for every edge, at listen), and the edge's own range of frames
    ``[frame_base, frame_base + frame_count)`` (at accept)."""

    input_capacity: int
    output_capacity: int
    frame_base: int
    frame_count: int
    slot_servers: tuple[str, ...] = ()

    @staticmethod
    def capacities(input_capacity: int, output_capacity: int, slot_servers: Sequence[str] = ()) -> dict[str, Any]:
        return {INPUT_CAPACITY: input_capacity, OUTPUT_CAPACITY: output_capacity, SLOT_SERVERS: list(slot_servers)}

    @staticmethod
    def frames(base: int, count: int) -> dict[str, int]:
        return {FRAME_BASE: base, FRAME_COUNT: count}

    @classmethod
    def parse(cls, info: Mapping[str, Any]) -> EdgeGrant:
        servers = info.get(SLOT_SERVERS, [])
        if not isinstance(servers, list) or not all(isinstance(a, str) for a in servers):
            raise InfoInvalid(f"{SLOT_SERVERS!r} must be a list of addresses, got {servers!r}")
        inputs, outputs, base, count = _ints(info, INPUT_CAPACITY, OUTPUT_CAPACITY, FRAME_BASE, FRAME_COUNT)
        return cls(inputs, outputs, base, count, tuple(servers))


# -- state word: tenant (8) | generation (24) | claimant (24) | state (8) ------------------------------
_STATE_MASK = 0xFF
_STATE_MASK_U64 = np.uint64(_STATE_MASK)
CLAIMANT_MAX = lib.EP_CLAIMANT_MAX
GENERATION_MAX = lib.EP_GENERATION_MAX
TENANT_MAX = lib.EP_TENANT_MAX
_TENANT_SHIFT = 56
_TENANT_SHIFT_U64 = np.uint64(_TENANT_SHIFT)


def word_state(word: int) -> int:
    return word & _STATE_MASK


def word_generation(word: int) -> int:
    return (word >> 32) & GENERATION_MAX


def word_claimant(word: int) -> int:
    return (word >> 8) & CLAIMANT_MAX


def word_tenant(word: int) -> int:
    """The floor id of the tenant whose request holds the slot (0: a tenant without a floor, or FREE)."""
    return word >> _TENANT_SHIFT


def words_tenants(words: np.ndarray) -> np.ndarray:
    """The tenant field of an array of state words (what :func:`word_tenant` is for one)."""
    return words >> _TENANT_SHIFT_U64


def word_holder(word: int) -> int:
    """The claimant and its tenant as one value (tenant << 24 | claimant): what a claim or a hand-over names."""
    return (word_tenant(word) << 24) | word_claimant(word)


def holder(claimant: int, tenant: int = 0) -> int:
    """What a claim or a hand-over names, as ``ep_step`` takes it: the tenant's floor id << 24 | the claimant."""
    if not 0 <= tenant <= TENANT_MAX:
        raise ValueError(f"tenant floor id must be in 0..{TENANT_MAX}, got {tenant}")
    return (tenant << 24) | (claimant & CLAIMANT_MAX)


def next_generation(generation: int) -> int:
    """The generation a claim of a word in ``generation`` begins (generations wrap at 2^24)."""
    return (generation + 1) & GENERATION_MAX


def is_free(word: int) -> bool:
    return word & _STATE_MASK == State.FREE


def claimed_by(word: int, claimant: int) -> bool:
    """The slot is CLAIMED (no doorbell yet) by ``claimant``."""
    return word & _STATE_MASK == State.CLAIMED and (word >> 8) & CLAIMANT_MAX == claimant


def in_state(words: np.ndarray, state: State) -> np.ndarray:
    """Which of an array of state words are in ``state`` (a boolean array of the same shape)."""
    return (words & _STATE_MASK_U64) == int(state)


def free_word(generation: int) -> int:
    """A FREE word in ``generation`` (what a slot server leaves when it releases a slot)."""
    return (generation & GENERATION_MAX) << 32


@dataclass(frozen=True, slots=True)
class SlotWord:
    generation: int
    state: State | int
    claimant: int
    tenant: int = 0

    @classmethod
    def unpack(cls, word: int) -> SlotWord:
        """Unpack a word; a state byte outside the ABI (corrupt memory) is kept as a plain int."""
        code = word & _STATE_MASK
        state = State(code) if code in State._value2member_map_ else code
        return cls(word_generation(word), state, word_claimant(word), word_tenant(word))

    def pack(self) -> int:
        return (
            (self.tenant << _TENANT_SHIFT)
            | ((self.generation & GENERATION_MAX) << 32)
            | ((self.claimant & CLAIMANT_MAX) << 8)
            | int(self.state)
        )


class TransitionRefused(Exception):
    """``ep_step`` refused an event: the word is left as it was."""

    def __init__(self, word: int, event: Event, reason: StepError) -> None:
        self.word, self.event, self.reason = word, event, reason
        name = event.name if isinstance(event, Event) else f"event {event}"
        super().__init__(f"{name} refused on {SlotWord.unpack(word)}: {reason.name.lower()}")


def step(word: int, event: Event, generation: int = 0, claimant: int = 0) -> int:
    """The state word after ``event``; raises :class:`TransitionRefused` when not allowed (``claimant``: CLAIM's
    and HANDOVER's holder, :func:`holder`)."""
    out = ffi.new("uint64_t *")
    rc = lib.ep_step_word(word, int(event), generation & 0xFFFFFFFF, claimant, out)
    if rc != lib.EP_OK:
        raise TransitionRefused(word, event, StepError(rc))
    return int(out[0])


def claim_word(free_word: int, claimant: int, tenant: int = 0) -> int:
    """The word a claimer CASes in for ``free_word`` (FREE): generation + 1, CLAIMED, claimant and its tenant."""
    return step(free_word, Event.CLAIM, 0, holder(claimant, tenant))


#: the claimer's hot path: ``claim_next(word, holder)`` is :func:`claim_word` without the exception,
#: 0 when ``word`` cannot be claimed (no claimed word is 0)
claim_next = lib.ep_claim_next


# -- towards a slot server: doorbell and cancel ------------------------------------------------------
IMM_CANCEL = lib.EP_IMM_CANCEL
IMM_RECLAIM = lib.EP_IMM_RECLAIM
IMM_GEN_MASK = lib.EP_IMM_GEN_MASK


def doorbell_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a doorbell: generation's low 14 bits << 16 | slot (bits 31 and 30 clear)."""
    return lib.ep_doorbell_imm_of(generation & 0xFFFFFFFF, slot)


def doorbell_word(slot: int, generation: int) -> int:
    """The u64 rung into ``doorbell[slot]`` (what a GPU poller watches)."""
    return lib.ep_doorbell_word(generation & 0xFFFFFFFF, slot)


def cancel_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a cancel: bit 31 | generation's low 14 bits << 16 | slot."""
    return IMM_CANCEL | ((generation & IMM_GEN_MASK) << 16) | (slot & lib.EP_SLOT_MAX)


def reclaim_imm(slot: int, generation: int) -> int:
    """32-bit immediate of a reclaim of ``slot`` running ``generation``: bits 31 and 30 | its low 14 bits << 16 |
    slot.  ``reclaim[slot]`` holds the word the slot is to be handed over as (:func:`claim_word` of it)."""
    return lib.ep_reclaim_imm_of(generation & 0xFFFFFFFF, slot)


def is_reclaim_imm(imm: int) -> bool:
    return imm & (IMM_CANCEL | IMM_RECLAIM) == IMM_CANCEL | IMM_RECLAIM


def cancel_word(generation: int) -> int:
    """The u64 written into ``cancel[slot]``: the generation being cancelled, and a set bit."""
    return ((generation & 0xFFFFFFFF) << 32) | 1


def is_cancel_imm(imm: int) -> bool:
    return bool(imm & IMM_CANCEL)


def imm_slot(imm: int) -> int:
    return imm & lib.EP_SLOT_MAX


def imm_generation_matches(imm: int, generation: int) -> bool:
    """Whether an immediate names ``generation`` (it carries only the low 14 bits)."""
    return (imm >> 16) & IMM_GEN_MASK == generation & IMM_GEN_MASK


def doorbell_entry(conn_id: int, imm: int) -> int:
    """A doorbell completion as the poller core takes it (``ep_accept_doorbells``): the connection that
    rang in the high 32 bits, the immediate in the low 32."""
    return (conn_id << 32) | (imm & 0xFFFFFFFF)


# -- towards an agent: progress and final results ---------------------------------------------------
IMM_PROGRESS = lib.EP_IMM_PROGRESS
IMM_FINAL = lib.EP_IMM_FINAL
IMM_STALLED = lib.EP_IMM_STALLED
IMM_HANDOVER = lib.EP_IMM_HANDOVER
IMM_KIND_MASK = lib.EP_IMM_KIND_MASK
IMM_INDEX_MASK = lib.EP_IMM_INDEX_MASK


def progress_imm(index: int) -> int:
    return IMM_PROGRESS | (index & IMM_INDEX_MASK)


def final_imm(index: int) -> int:
    return IMM_FINAL | (index & IMM_INDEX_MASK)


def imm_index(imm: int) -> int:
    return imm & IMM_INDEX_MASK


def is_progress_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_PROGRESS


def stalled_imm(index: int) -> int:
    """An agent process tells its edge: frame ``index``'s slot server is unresponsive (it stays in flight)."""
    return IMM_STALLED | (index & IMM_INDEX_MASK)


def is_stalled_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_STALLED


def handover_imm(slot: int) -> int:
    """A slot server tells a reclaiming agent: its reclaim of ``slot`` was acted on (handed over or not: the state
    word says which)."""
    return IMM_HANDOVER | (slot & IMM_INDEX_MASK)


def is_handover_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_HANDOVER


def progress_word(generation: int, count: int) -> int:
    """``progress`` of a result header: the generation it belongs to and the tokens placed so far."""
    return ((generation & 0xFFFFFFFF) << 32) | (count & 0xFFFFFFFF)


def progress_generation(word: int) -> int:
    return word >> 32


def progress_count(word: int) -> int:
    return word & 0xFFFFFFFF


# -- edge <-> agent process: submissions and cancels (the answers are final_imm / progress_imm) -----------
def submit_imm(index: int) -> int:
    """An edge hands its frame ``index`` (within its own range) to the agent."""
    return index & IMM_INDEX_MASK


def group_member_imm(index: int) -> int:
    """An edge hands its frame ``index`` as a choice of a group whose last frame follows with :func:`submit_imm`: the
    agent claims the group's slots together (OpenAI's ``n``; an edge never sends the progress kind this bit is)."""
    return IMM_PROGRESS | (index & IMM_INDEX_MASK)


def is_group_member_imm(imm: int) -> bool:
    return imm & IMM_KIND_MASK == IMM_PROGRESS


def edge_cancel_imm(index: int) -> int:
    """An edge asks the agent to cancel its frame ``index``."""
    return IMM_CANCEL | (index & IMM_INDEX_MASK)


def edge_imm_frame(imm: int) -> int:
    """The frame (within the edge's range) an edge's immediate names."""
    return imm & IMM_INDEX_MASK


# -- the status region an agent process publishes for its edges ----------------------------------------
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


# -- prefix affinity: what a slot server's model side holds, as chain hashes of token blocks -------------
#: tokens per block: a prefix is published and matched in whole blocks
PREFIX_BLOCK = lib.EP_PREFIX_BLOCK
#: the prefix table a slot server publishes when its handler keeps KV of earlier requests (8 bytes each)
PREFIX_ENTRIES = 256
PREFIX_ENTRIES_MAX = lib.EP_PREFIX_ENTRIES_MAX


def prefix_chain(tokens: np.ndarray, salt: int = 0) -> np.ndarray:
    """The chain hashes under ``salt`` (a request's ``cache_salt``) of the whole blocks of ``tokens`` (int32
    ids): entry ``b`` names the prefix of blocks ``0..b`` (the hash is defined in ``native/edgepath_slot.h``)."""
    ids = np.ascontiguousarray(tokens, dtype=np.int32)
    out = np.empty(len(ids) // PREFIX_BLOCK, dtype=np.uint64)
    n = lib.ep_prefix_chain(
        salt, ffi.from_buffer("int32_t[]", ids), len(ids), ffi.from_buffer("uint64_t[]", out), len(out)
    )
    return out[:n]


def cache_salt(namespace: bytes, salt: str | None = None) -> int:
    """The request header's ``cache_salt``: the prefix cache's namespace of a tenant (``namespace``: empty for
    the anonymous tenant) and a request's own ``cache_salt`` string, as 64 bits of SHA-256 (never 0); 0 when
    both are empty -- the one namespace of a server without tenants.  Two requests share cached KV only when
    their values are equal, so one tenant cannot name another's namespace without its key."""
    if not namespace and salt is None:
        return 0
    material = b"edgepath-cache-salt\0" + namespace + b"\0" + (b"" if salt is None else b"\1" + salt.encode())
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "little") or 1


#: the namespace of tenants that share their prefixes (``share_prefix``), which readers of the shared prefix read
PUBLIC_NAMESPACE = b"public"
#: its cache salt: what a request with :data:`FLAG_READ_PUBLIC` may reuse besides its own salt's prefixes
PUBLIC_SALT = cache_salt(PUBLIC_NAMESPACE)


def prefix_table(sequences: Iterable[tuple[int, np.ndarray]], entries: int) -> np.ndarray:
    """The table a slot server publishes for the token sequences its model side holds, each with the salt it
    was written under, the most useful first: the chain hashes of every whole block of each, each hash once,
    in that order, until ``entries`` are taken; unused entries are 0 (never a chain hash)."""
    table = np.zeros(entries, dtype=np.uint64)
    seen: set[int] = set()
    for salt, tokens in sequences:
        chain = prefix_chain(tokens, salt).tolist()
        if not chain or chain[-1] in seen:  # its last block is in: so is every block before it
            continue
        for h in chain:
            if len(seen) == entries:
                return table
            if h not in seen:
                table[len(seen)] = h
                seen.add(h)
    return table


class PrefixChain:
    """A request's chain hashes in a reusable buffer (an agent computes them once per request, from the ids
    already in its frame), and how much of it a server's published table holds."""

    __slots__ = ("_out", "blocks", "hashes")

    def __init__(self, max_tokens: int) -> None:
        self.hashes = np.zeros(max(1, max_tokens // PREFIX_BLOCK), dtype=np.uint64)
        self._out = ffi.from_buffer("uint64_t[]", self.hashes)
        self.blocks = 0

    def compute(self, tokens: np.ndarray, salt: int = 0) -> int:
        """Hash the whole blocks of ``tokens`` (a contiguous int32 view; those beyond the buffer are left
        out) under ``salt``; how many."""
        self.blocks = lib.ep_prefix_chain(
            salt, ffi.from_buffer("int32_t[]", tokens), len(tokens), self._out, len(self.hashes)
        )
        return self.blocks

    def matched(self, table: np.ndarray) -> int:
        """How many leading blocks of the chain ``table`` (a published prefix table) holds."""
        if not self.blocks or not len(table):
            return 0
        return lib.ep_prefix_match(ffi.from_buffer("uint64_t[]", table), len(table), self._out, self.blocks)


# -- typed views of the request and result headers ---------------------------------------------------
class _StructView:
    """A typed view of one C struct in registered memory, through a cffi pointer (reading a field costs
    about a tenth of a numpy structured field).  Subclasses declare the struct's scalar fields as
    annotations; each becomes a property read through the pointer, and the declaration is checked
    against the C header when the class is made, so a field added to the ABI cannot go unseen."""

    __slots__ = ("_p",)
    ctype: ClassVar[str]

    def __init__(self, pointer: Any) -> None:
        self._p = pointer

    def __init_subclass__(cls, struct: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.ctype = f"struct {struct} *"
        fields = [name for name, f in ffi.typeof(f"struct {struct}").fields if f.type.kind == "primitive"]
        declared = [name for name in inspect.get_annotations(cls) if name != "ctype"]
        if declared != fields:
            raise TypeError(
                f"{cls.__name__} declares {declared}, but struct {struct} (native/edgepath_slot.h) has {fields}: "
                "declare exactly the header's scalar fields, in order"
            )
        for name in fields:
            setattr(cls, name, property(operator.attrgetter(f"_p.{name}"), _setter(name)))

    @classmethod
    def at(cls, address: int) -> Any:
        """A view of the struct at ``address`` (memory its owner keeps alive)."""
        return cls(ffi.cast(cls.ctype, address))


def _setter(name: str) -> Any:
    def set_field(self: _StructView, value: Any) -> None:
        setattr(self._p, name, value)

    return set_field


class RequestHeader(_StructView, struct="ep_request_header"):
    """A slot's or a frame's request header: the writer's fields, the agent's stamp, sampling."""

    __slots__ = ()
    request_id: int
    token_count: int
    max_new_tokens: int
    flags: int  # FLAG_STREAM: stream the output
    generation: int  # the claim's generation, stamped by the agent
    t_receive_ns: int  # CLOCK_MONOTONIC, at the edge: the request arrived ...
    t_tokenized_ns: int  # ... its ids are in the frame ...
    t_written_ns: int  # ... the agent sends it
    doorbell: int  # the word rung into doorbell[slot] (doorbell_word)
    reply_index: int
    top_k: int
    temperature: float
    top_p: float
    seed: int
    stream_window_us: int
    max_wait_ms: int  # the requester's bound on waiting for its first token (0: the agent's default)
    predicted_ttft_us: int  # the agent's prediction at claim time (0: none made) ...
    predicted_wait_us: int  # ... and the wait in it (the prediction minus its own prompt on an idle server)
    output_offset: int  # a migrated request: output tokens its answer already has; its output goes after them
    migrations: int  # how often it has moved to another slot server
    cache_salt: int  # the prefix cache's namespace (cache_salt()): KV and placement only from the same salt
    tenant: int  # the tenant's id in the state words (0: no floor and no cap), claimed with: the state word's tenant
    slot_floor: int  # that tenant's slot floor
    slot_cap: int  # that tenant's slot cap (0: none)
    min_p: float  # sampling, continued (ABI 14): 0 = off
    presence_penalty: float  # 0 = off
    frequency_penalty: float  # 0 = off
    repetition_penalty: float  # 0 or 1 = off
    logit_biases: int  # (id, bias) pairs at the end of the constraint words after the prompt
    reserved32: int

    def fill(
        self,
        request_id: int,
        token_count: int,
        max_new_tokens: int,
        flags: int,
        sampling: Sampling,
        t_receive_ns: int,
        t_tokenized_ns: int,
    ) -> None:
        """The writer's fields (values already checked); the agent stamps the rest when it sends."""
        lib.ep_request_fill(
            self._p,
            request_id,
            token_count,
            max_new_tokens,
            flags,
            sampling.temperature,
            sampling.top_p,
            sampling.top_k,
            sampling.seed,
            sampling.min_p,
            sampling.presence_penalty,
            sampling.frequency_penalty,
            sampling.repetition_penalty,
            len(sampling.logit_bias),
            t_receive_ns,
            t_tokenized_ns,
        )

    def bound(self, max_wait_ms: int) -> None:
        """The requester's bound on waiting for the first token (0: the agent's default)."""
        self._p.max_wait_ms = max_wait_ms

    def salted(self, salt: int) -> None:
        """The prefix cache namespace the request reads and writes (:func:`cache_salt`; 0: none)."""
        self._p.cache_salt = salt

    def floored(self, tenant: int, slot_floor: int, slot_cap: int = 0) -> None:
        """The request's tenant's id in the state words (0: a tenant with neither a slot floor nor a slot cap), its
        floor and its cap: what the agent claims with (the state word's tenant), decides a reclaim by and counts a
        cap by, across every edge (docs/TENANTS.md)."""
        if not 0 <= tenant <= TENANT_MAX:
            raise ValueError(f"tenant floor id must be in 0..{TENANT_MAX}, got {tenant}")
        if not 0 <= slot_floor <= 0xFFFFFFFF or not 0 <= slot_cap <= 0xFFFFFFFF:
            raise ValueError(f"slot floor and cap must be in 0..{0xFFFFFFFF}, got {slot_floor} and {slot_cap}")
        self._p.tenant = tenant
        self._p.slot_floor = slot_floor if tenant else 0
        self._p.slot_cap = slot_cap if tenant else 0

    def predicted(self, ttft_ms: float, wait_ms: float) -> None:
        """The agent's prediction at claim time, for the edge's ``Server-Timing`` and metrics."""
        p = self._p
        p.predicted_ttft_us = min(int(ttft_ms * 1e3), 0xFFFFFFFF)
        p.predicted_wait_us = min(int(wait_ms * 1e3), 0xFFFFFFFF)

    def migrate(self, token_count: int, max_new_tokens: int, output_offset: int, migrations: int) -> None:
        """The request moves to another slot server: its prompt is the old prompt and the answer so far, it may
        produce what is left, and its output goes after the ``output_offset`` tokens its answer has."""
        p = self._p
        p.token_count = token_count
        p.max_new_tokens = max_new_tokens
        p.output_offset = output_offset
        p.migrations = migrations

    def unsent(self) -> None:
        """Not sent yet (``t_written_ns`` 0): the writer clears it and :meth:`stamp` sets it when the agent sends the
        request -- at once, or at the hand-over of a slot taken back for it (docs/TENANTS.md) -- so the writer can
        tell the two apart."""
        self._p.t_written_ns = 0

    def stamp(self, generation: int, slot: int, reply_index: int) -> None:
        """What a claim decides, just before the request is written: the generation claimed, the doorbell
        word that rings for it, the reply entry, the time."""
        lib.ep_request_stamp(self._p, generation & 0xFFFFFFFF, slot, reply_index)

    def streaming(self, default_window: float) -> float | None:
        """None: the request wants only its final result; else the seconds within which its streamed tokens
        after the first are coalesced (``default_window`` when the request names none)."""
        p = self._p
        if not p.flags & FLAG_STREAM:
            return None
        us = p.stream_window_us
        return us / 1e6 if us else default_window

    def sampling(self, logit_bias: LogitBias = ()) -> Sampling:
        """The request's sampling parameters, with ``logit_bias`` read from the words after its prompt
        (:func:`read_after_prompt`; the header holds only their count).  A zeroed header, greedy, is one shared
        value: no allocation."""
        p = self._p
        temperature, top_p, top_k, seed = p.temperature, p.top_p, p.top_k, p.seed
        min_p, presence, frequency, repetition = p.min_p, p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        if not (temperature or top_p or top_k or seed or min_p or presence or frequency or repetition or logit_bias):
            return _ZEROED
        return Sampling(temperature, top_p, top_k, seed, min_p, presence, frequency, repetition, logit_bias)


class ResultHeader(_StructView, struct="ep_result_header"):
    """A slot's or a reply entry's result header: whose result, how it ended, what is placed so far."""

    __slots__ = ()
    request_id: int
    generation: int
    slot: int
    status: int  # a Status
    output_count: int
    t_ready_ns: int  # CLOCK_MONOTONIC, at the slot server: the poller saw the doorbell ...
    t_start_ns: int  # ... the handler started ...
    t_done_ns: int  # ... it finished
    progress: int  # progress_word(generation, tokens placed so far): see placed_for
    t_first_ns: int
    cached_tokens: int  # prompt tokens the model side took from its prefix cache (sent with every progress word)
    prefill_us: int  # its uncached prompt's cost on an idle server (the step cost model; with cached_tokens)
    refusal_wait_us: int  # OVER_BOUND: the least predicted wait among the servers tried
    refusal_bound_ms: int  # OVER_BOUND: the bound the agent applied
    retry_after_ms: int  # NO_SLOT, OVER_BOUND, SLOT_CAP: when a retry is predicted to be admitted (0: no estimate)
    reserved32: int

    def begin(self, request_id: int, generation: int, slot: int) -> None:
        """A slot starts running a request: whose it is, when (now), nothing produced yet."""
        lib.ep_result_begin(self._p, request_id, generation & 0xFFFFFFFF, slot)

    def first_token(self, t_first_ns: int) -> None:
        """When the first output token was produced (sent with every progress word)."""
        self._p.t_first_ns = t_first_ns

    def cached(self, tokens: int) -> None:
        """How many prompt tokens the model side reused from its prefix cache (not recomputed)."""
        self._p.cached_tokens = tokens

    def prefill(self, seconds: float) -> None:
        """What the request's uncached prompt costs on an idle server, by the model side's cost model."""
        self._p.prefill_us = min(int(seconds * 1e6), 0xFFFFFFFF)

    def placed(self, generation: int, count: int) -> None:
        """``count`` output tokens of ``generation`` are placed (the progress word)."""
        self._p.progress = progress_word(generation, count)

    def end(self, generation: int, status: int, output_count: int) -> None:
        """The final result: how it ended, how many tokens, when (now)."""
        lib.ep_result_end(self._p, generation & 0xFFFFFFFF, status, output_count)

    def refuse(self, status: int) -> None:
        """An answer without a slot (NO_SLOT, OVER_BOUND, SLOT_CAP, UNAVAILABLE, BAD_REQUEST), written by an agent
        process (an OVER_BOUND's wait is already written: :meth:`over_bound`)."""
        p = self._p
        p.status = status
        p.output_count = 0

    def over_bound(self, wait_ms: float, bound_ms: float, retry_ms: float) -> None:
        """Refused OVER_BOUND: the least predicted wait among the servers, the bound it is over and when to come
        back, for the edge's answer."""
        p = self._p
        p.status = Status.OVER_BOUND
        p.output_count = 0
        p.refusal_wait_us = min(int(wait_ms * 1e3), 0xFFFFFFFF)
        p.refusal_bound_ms = min(round(bound_ms), 0xFFFFFFFF)
        p.retry_after_ms = min(math.ceil(retry_ms), 0xFFFFFFFF)

    def no_slot(self, retry_ms: float) -> None:
        """Refused NO_SLOT: when the first slot is predicted to free (0: no estimate)."""
        p = self._p
        p.status = Status.NO_SLOT
        p.output_count = 0
        p.retry_after_ms = min(math.ceil(retry_ms), 0xFFFFFFFF)

    def capped(self, retry_ms: float) -> None:
        """Refused SLOT_CAP: the request's tenant holds its slot cap across every pool; when one of its slots is
        predicted to free (0: no estimate)."""
        p = self._p
        p.status = Status.SLOT_CAP
        p.output_count = 0
        p.retry_after_ms = min(math.ceil(retry_ms), 0xFFFFFFFF)

    def placed_for(self, generation: int) -> int | None:
        """Output tokens placed for ``generation`` as the progress word says, or None when the word is
        another generation's (a late write for an older request of the same entry)."""
        word = self._p.progress
        return progress_count(word) if progress_generation(word) == generation & 0xFFFFFFFF else None


#: final statuses that mean "the model side ran the request" (output, if any, is valid)
FINISHED = (Status.OK, Status.LENGTH, Status.STOP, Status.CANCELLED, Status.RECLAIMED)
#: statuses the data path answers before any slot ran the request
REFUSALS = (Status.NO_SLOT, Status.OVER_BOUND, Status.SLOT_CAP, Status.UNAVAILABLE, Status.BAD_REQUEST)
FLAG_STREAM = lib.EP_FLAG_STREAM


# -- log probabilities in the output area (native/edgepath_slot.h, issue 36) --------------------------------
FLAG_LOGPROBS = lib.EP_FLAG_LOGPROBS
#: most alternatives one token's record carries (OpenAI's ``top_logprobs`` limit)
TOP_LOGPROBS_MAX = lib.EP_TOP_LOGPROBS_MAX


def logprobs_flags(top: int) -> int:
    """The request flags asking for each output token's log probability and its ``top`` likeliest alternatives."""
    if not 0 <= top <= TOP_LOGPROBS_MAX:
        raise RequestInvalid(f"top log probabilities must be between 0 and {TOP_LOGPROBS_MAX}, got {top}")
    return FLAG_LOGPROBS | top << lib.EP_FLAG_TOP_SHIFT


def logprobs_top(flags: int) -> int | None:
    """None: the output area holds plain token ids; else how many alternatives each token's record carries (as
    written: a reader checks it against :data:`TOP_LOGPROBS_MAX`)."""
    if not flags & FLAG_LOGPROBS:
        return None
    return int(flags >> lib.EP_FLAG_TOP_SHIFT & lib.EP_FLAG_TOP_MASK)


def record_words(top: int | None) -> int:
    """Output words one token takes: 1 (its id), or its log-probability record with ``top`` alternatives."""
    return 1 if top is None else 2 + 2 * top


def write_record(
    out: np.ndarray, index: int, token: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray
) -> None:
    """Token ``index``'s record in the int32 output area ``out``: id, log probability, then the alternatives'
    ids and log probabilities (likeliest first), the floats as float32 bits."""
    top = len(top_ids)
    record = out[index * (2 + 2 * top) : (index + 1) * (2 + 2 * top)]
    record[0] = token
    floats = record.view(np.float32)
    floats[1] = logprob
    record[2 : 2 + top] = top_ids
    floats[2 + top :] = top_logprobs


@dataclass(frozen=True, slots=True)
class TokenRecords:
    """Output records read back: per token its id and log probability, and its alternatives (``top`` columns)."""

    ids: np.ndarray  # int32 (n,)
    logprobs: np.ndarray  # float32 (n,)
    top_ids: np.ndarray  # int32 (n, top)
    top_logprobs: np.ndarray  # float32 (n, top)


def read_records(words: np.ndarray, top: int) -> TokenRecords:
    """The records in ``words`` (a whole number of them, as :func:`write_record` placed them)."""
    width = 2 + 2 * top
    if len(words) % width:
        raise ValueError(f"{len(words)} output words are not a whole number of {width}-word records")
    records = np.ascontiguousarray(words, dtype=np.int32).reshape(-1, width)
    floats = records.view(np.float32)
    return TokenRecords(records[:, 0], floats[:, 1], records[:, 2 : 2 + top], floats[:, 2 + top :])


# -- request validation (writer and reader apply the same rules) ---------------------------------------
TOKEN_MIN = -(2**31)
TOKEN_MAX = 2**31 - 1


class RequestInvalid(ValueError):
    """A request that does not fit the slot format; the message says what is allowed."""


#: a request's logit biases: (token id, bias added to its logit) pairs, ids ascending, each id once
LogitBias = tuple[tuple[int, float], ...]
#: most logit biases one request carries (the bound OpenAI's API applies)
LOGIT_BIAS_MAX = int(lib.EP_LOGIT_BIAS_MAX)
#: the window of the presence, frequency and repetition penalties: the sequence's last tokens, prompt included
PENALTY_LAST_N = int(lib.EP_PENALTY_LAST_N)
#: the ranges the slot checks (an API may allow less): presence and frequency penalties, repetition penalty, bias
PENALTY_MAX, REPETITION_MAX, BIAS_MAX = 2.0, 10.0, 100.0


@dataclass(frozen=True, slots=True)
class Sampling:
    """Sampling parameters carried to the model side: in the request header, but for ``logit_bias``, whose pairs
    follow the prompt (:func:`after_prompt`) and whose count the header holds."""

    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 0 (a zeroed header) or 1: no nucleus cut
    top_k: int = 0  # 0: off
    seed: int = 0
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0  # 0: off
    frequency_penalty: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 0 (a zeroed header) or 1: off
    logit_bias: LogitBias = ()

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (they need the sequence's last :data:`PENALTY_LAST_N` tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty not in (0.0, 1.0)

    @property
    def shaped(self) -> bool:
        """Whether anything but temperature, top-k and top-p shapes the draw (then even greedy needs llama.cpp's
        samplers: a bias or a penalty moves the likeliest token)."""
        return self.penalized or bool(self.logit_bias) or self.min_p > 0.0

    def check(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestInvalid(f"temperature must be between 0 and 2, got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            raise RequestInvalid(f"top_p must be between 0 and 1 (0 or 1: off), got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise RequestInvalid(f"top_k must be a non-negative integer, got {self.top_k}")
        if not 0 <= self.seed < 2**64:
            raise RequestInvalid(f"seed must be an unsigned 64-bit integer, got {self.seed}")
        if not 0.0 <= self.min_p <= 1.0:
            raise RequestInvalid(f"min_p must be between 0 and 1 (0: off), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_MAX <= value <= PENALTY_MAX:
                raise RequestInvalid(f"{name} must be between -{PENALTY_MAX:g} and {PENALTY_MAX:g}, got {value}")
        if not 0.0 <= self.repetition_penalty <= REPETITION_MAX:
            raise RequestInvalid(
                f"repetition_penalty must be between 0 and {REPETITION_MAX:g} (0 or 1: off), "
                f"got {self.repetition_penalty}"
            )
        check_logit_bias(self.logit_bias)


def check_logit_bias(logit_bias: LogitBias, vocab_size: int = 2**31) -> None:
    """RequestInvalid unless ``logit_bias`` is at most :data:`LOGIT_BIAS_MAX` pairs of ascending ids below
    ``vocab_size`` with finite biases within +-:data:`BIAS_MAX`."""
    if len(logit_bias) > LOGIT_BIAS_MAX:
        raise RequestInvalid(f"at most {LOGIT_BIAS_MAX} logit biases, got {len(logit_bias)}")
    last = -1
    for token, bias in logit_bias:
        if not last < token < vocab_size:
            raise RequestInvalid(
                f"logit bias token ids must ascend within 0..{vocab_size - 1}, got {token} after {last}"
            )
        if not -BIAS_MAX <= bias <= BIAS_MAX:
            raise RequestInvalid(
                f"a logit bias must be between -{BIAS_MAX:g} and {BIAS_MAX:g}, got {bias} (token {token})"
            )
        last = token


#: the sampling of a zeroed request header: greedy, no nucleus cut, no penalty
_ZEROED = Sampling(0.0, 0.0, 0, 0, repetition_penalty=0.0)


# -- a constraint after the prompt (native/edgepath_slot.h, issue 36) -------------------------------------
FLAG_CONSTRAINT = lib.EP_FLAG_CONSTRAINT
#: most words a constraint may take
CONSTRAINT_WORDS_MAX = lib.EP_FLAG_CONSTRAINT_MASK


#: the request may also reuse prefixes written under :data:`PUBLIC_SALT`; what it writes stays under its own salt
FLAG_READ_PUBLIC = lib.EP_FLAG_READ_PUBLIC
#: the model's end-of-generation tokens are never drawn: the answer runs to its max_new_tokens (``ignore_eos``)
FLAG_IGNORE_EOS = lib.EP_FLAG_IGNORE_EOS


def readable_salts(salt: int, flags: int) -> tuple[int, ...]:
    """The cache salts a request of ``salt`` and ``flags`` may reuse KV from: its own, and the public one when it
    reads the shared prefix (:data:`FLAG_READ_PUBLIC`)."""
    return (salt, PUBLIC_SALT) if flags & FLAG_READ_PUBLIC and salt != PUBLIC_SALT else (salt,)


def constraint_encoding(grammar: str) -> np.ndarray:
    """A GBNF grammar as the int32 words that follow the prompt: its UTF-8, zero-padded to whole words."""
    data = grammar.encode()
    words = np.frombuffer(data + b"\0" * (-len(data) % 4), dtype=np.int32)
    if not 0 < len(words) <= CONSTRAINT_WORDS_MAX:
        raise RequestInvalid(f"a constraint takes 1 to {CONSTRAINT_WORDS_MAX} words, this one {len(words)}")
    return words


def logit_bias_encoding(logit_bias: LogitBias) -> np.ndarray:
    """Logit biases as the int32 words that end the constraint: per pair its token id, then its bias (float32 bits)."""
    words = np.zeros(2 * len(logit_bias), dtype=np.int32)
    if logit_bias:
        words[0::2] = [token for token, _ in logit_bias]
        words.view(np.float32)[1::2] = [bias for _, bias in logit_bias]
    return words


def after_prompt(grammar: str | None, logit_bias: LogitBias) -> np.ndarray | None:
    """The words that follow a request's prompt: its grammar (:func:`constraint_encoding`), then its logit biases
    (:func:`logit_bias_encoding`; the request header says how many); None when it has neither."""
    if grammar is None and not logit_bias:
        return None
    parts = [constraint_encoding(grammar)] if grammar is not None else []
    words = np.concatenate([*parts, logit_bias_encoding(logit_bias)])
    if len(words) > CONSTRAINT_WORDS_MAX:
        raise RequestInvalid(f"a constraint takes 1 to {CONSTRAINT_WORDS_MAX} words, this one {len(words)}")
    return words


def read_after_prompt(words: np.ndarray, logit_biases: int) -> tuple[str | None, LogitBias]:
    """The grammar (None: none) and the logit biases in the words after a prompt (as :func:`after_prompt` made
    them; ``logit_biases``: the request header's count).  ValueError when they cannot be: more biases than words, a
    grammar that is not UTF-8."""
    bias_words = 2 * logit_biases
    if bias_words > len(words):
        raise ValueError(f"{logit_biases} logit biases take {bias_words} words; {len(words)} follow the prompt")
    pairs = np.ascontiguousarray(words[len(words) - bias_words :], dtype=np.int32)
    ids, biases = pairs[0::2].tolist(), pairs.view(np.float32)[1::2].tolist()
    try:
        grammar = read_constraint(words[: len(words) - bias_words]) if bias_words < len(words) else None
    except UnicodeDecodeError as exc:
        raise ValueError(f"its grammar is not UTF-8 ({exc})") from None
    return grammar, tuple(zip(ids, biases, strict=True))


def constraint_flags(words: int) -> int:
    """The request flags saying ``words`` words of constraint follow the prompt."""
    if not 0 < words <= CONSTRAINT_WORDS_MAX:
        raise RequestInvalid(f"a constraint takes 1 to {CONSTRAINT_WORDS_MAX} words, got {words}")
    return FLAG_CONSTRAINT | words << lib.EP_FLAG_CONSTRAINT_SHIFT


def constraint_words(flags: int) -> int:
    """Words of constraint after the prompt (0: none)."""
    if not flags & FLAG_CONSTRAINT:
        return 0
    return int(flags >> lib.EP_FLAG_CONSTRAINT_SHIFT & lib.EP_FLAG_CONSTRAINT_MASK)


def input_words(token_count: int, flags: int) -> int:
    """What a request's input takes of a slot: its prompt's ids and the constraint after them."""
    return token_count + constraint_words(flags)


def read_constraint(words: np.ndarray) -> str:
    """The grammar in ``words`` (as :func:`constraint_encoding` made them); ValueError when it is not UTF-8."""
    return np.ascontiguousarray(words, dtype=np.int32).tobytes().rstrip(b"\0").decode()


def request_problem(token_count: int, max_new_tokens: int, input_capacity: int, output_capacity: int) -> str | None:
    """Why a request with these counts cannot go into a slot of these capacities (None: it can)."""
    if token_count <= 0:
        return f"a request needs at least 1 token, got {token_count}"
    if token_count > input_capacity:
        return f"request has {token_count} tokens; a slot holds at most {input_capacity}"
    if not 0 <= max_new_tokens <= output_capacity:
        return f"max_new_tokens must be between 0 and {output_capacity}, got {max_new_tokens}"
    return None


# -- the quota ledger: tenants' quota buckets as words every edge debits by remote CAS (docs/TENANTS.md) ---------
#: the region a ledger home exports: ``entries`` pairs of u64 words ``[key][bucket]``, all 0 when made
LEDGER_REGION = "ledger"
#: edges only compare-and-swap its words (a failed CAS is their read): nothing else is granted
LEDGER_ACCESS = Access.REMOTE_ATOMIC
#: entries of a ledger: one per (tenant, unit, window, limit) used since the home started
LEDGER_ENTRIES = 16384
#: the keys a ledger home sends every edge: what it is, and how many entries its region holds
LEDGER_ROLE, LEDGER_ENTRIES_KEY = "ledger", "ledger_entries"
#: the largest quota a bucket word keeps exact: a bucket's clock wraps at 2^64, and an idle bucket's word must stay
#: within 2^63 tokens of it (2^40 a minute: 16 years idle)
QUOTA_MAX = 2**40
_U64 = (1 << 64) - 1


def ledger_hello(entries: int) -> dict[str, Any]:
    """What a ledger home tells an edge."""
    return {ROLE: LEDGER_ROLE, LEDGER_ENTRIES_KEY: entries}


def read_ledger_hello(info: Mapping[str, Any]) -> int:
    """The entries of the ledger a home's ``info`` describes; :class:`InfoInvalid` when it is not a ledger home."""
    if info.get(ROLE) != LEDGER_ROLE:
        raise InfoInvalid(f"not a quota ledger (role {info.get(ROLE)!r})")
    (entries,) = _ints(info, LEDGER_ENTRIES_KEY)
    if entries < 1:
        raise InfoInvalid(f"a ledger of {entries} entries")
    return entries


def ledger_key(tenant: str, unit: str, window: str, limit: int) -> int:
    """The key word of a tenant's bucket: 64 bits of SHA-256 of its tenant, unit (tokens, requests), window
    (minute, day) and limit (a changed limit is another bucket, so that every word is read at one scale); never
    0, the key of an unused entry."""
    material = f"edgepath-quota\0{tenant}\0{unit}\0{window}\0{limit}".encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "little") or 1


def bucket_clock(now_ns: int, limit: int, period_ns: int) -> int:
    """A bucket's clock at ``now_ns`` (Unix time: every edge reads its own): tokens (or requests) that have refilled
    since the epoch at ``limit`` per ``period_ns``, modulo 2^64."""
    return (now_ns * limit // period_ns) & _U64


def bucket_debt(word: int, clock: int) -> int:
    """What a bucket word owes at ``clock``: how far its word is ahead of the clock (the bucket holds its limit less
    that); 0 or less: full.  A word of 0 is a bucket never used: full."""
    if not word:
        return 0
    ahead = (word - clock) & _U64
    return ahead - (1 << 64) if ahead >> 63 else ahead


def bucket_word(clock: int, debt: int) -> int:
    """The word of a bucket that owes ``debt`` at ``clock``."""
    return (clock + debt) & _U64
