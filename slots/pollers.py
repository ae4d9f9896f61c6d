"""Doorbell pollers: who turns rung doorbells into RUNNING slots, behind one interface.

The slot server does not care whether the CPU or a persistent CUDA kernel watches the doorbells:
a :class:`Poller` takes the doorbell completions that arrived (a wake-up hint for a GPU poller,
the doorbells themselves for the host one) and returns the slots that are now RUNNING, each
with the connection that rang it and its generation; it also owns lease expiry, because only the
poller may move a CLAIMED word (the kernel is the one writer of CLAIMED words on a GPU pool).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import numpy as np

from edgepath.contract import wire
from edgepath.contract.pool import SlotPool
from edgepath.native.abi import Event, State, ffi, lib
from edgepath.slots.owned import OwnedWords

if TYPE_CHECKING:
    from edgepath.slots.gpu import DeviceSlots
    from edgepath.slots.gpu import GpuPoller as CudaPoller

log = logging.getLogger("edgepath.pollers")

#: (slot, connection id of the claimer, generation): a slot that is RUNNING now
Started = tuple[int, int, int]


class Poller(Protocol):
    rejected_doorbells: int
    expired_leases: int
    #: slots are handed over by something that runs on its own (a GPU kernel): a doorbell completion is only
    #: a hint, so :meth:`started` is asked every loop turn, not only when doorbells arrived
    hands_over: bool

    def started(self, doorbells: list[int], now_ns: int) -> list[Started]:
        """Slots made RUNNING by these doorbell completions (:func:`~edgepath.contract.wire.doorbell_entry` each)."""
        ...

    def scan_leases(self, now_ns: int) -> int:
        """Reclaim CLAIMED slots whose doorbell never came within the lease; how many."""
        ...

    def expire_claims_of(self, claimant: int) -> int:
        """Reclaim every slot CLAIMED by a connection that went away; how many."""
        ...

    def close(self) -> None: ...


class HostPoller:
    """The CPU poller: ``ep_accept_doorbells`` (CLAIMED -> READY, same C code as the kernel) then
    READY -> RUNNING at once, in one pass over the completion batch.  Its steps are the server's own
    (``owned``: what the server last stored in each word, shared with the server's other steps)."""

    hands_over = False

    def __init__(self, pool: SlotPool, owned: OwnedWords) -> None:
        self.pool = pool
        self.owned = owned
        self.rejected_doorbells = 0
        self.expired_leases = 0
        self._pool_ptr = ffi.cast("char *", ffi.from_buffer(pool.buf))
        n = pool.slot_count
        self._seen_word = ffi.new("uint64_t[]", n)
        self._seen_ns = ffi.new("uint64_t[]", n)
        self._expired = ffi.new("uint32_t[]", n)
        self._ready_slots = ffi.new("uint32_t[]", 256)
        self._ready_conns = ffi.new("uint32_t[]", 256)
        self._rejected = ffi.new("int *")

    def started(self, doorbells: list[int], now_ns: int) -> list[Started]:
        out: list[Started] = []
        entries = ffi.new("uint64_t[]", doorbells)
        for base in range(0, len(doorbells), 256):
            n = min(256, len(doorbells) - base)
            got = lib.ep_accept_doorbells(
                self._pool_ptr,
                self.owned.ptr,
                self.owned.restored_ptr,
                entries + base,
                n,
                self._ready_slots,
                self._ready_conns,
                now_ns,
                self._rejected,
            )
            self.rejected_doorbells += self._rejected[0]
            for i in range(got):
                slot = int(self._ready_slots[i])
                gen = wire.word_generation(int(self.owned.words[slot]))
                self.owned.step(slot, Event.START, gen)
                out.append((slot, int(self._ready_conns[i]), gen))
        return out

    def scan_leases(self, now_ns: int) -> int:
        n = lib.ep_scan_leases(
            self._pool_ptr,
            self.owned.ptr,
            self.owned.restored_ptr,
            self._seen_word,
            self._seen_ns,
            now_ns,
            self._expired,
            self.pool.slot_count,
        )
        self.expired_leases += n
        return int(n)

    def expire_claims_of(self, claimant: int) -> int:
        n = 0
        for slot in range(self.pool.slot_count):
            w = self.pool.word(slot)
            if wire.claimed_by(w, claimant) and (
                self.owned.step(slot, Event.EXPIRE, wire.word_generation(w)) == lib.EP_OK
            ):
                n += 1
        self.expired_leases += n
        return n

    def close(self) -> None:
        pass


class GpuDoorbellPoller:
    """The CUDA persistent kernel as a poller: it moves rung slots CLAIMED -> READY -> RUNNING and hands
    them over through a ring in mapped memory; completions are only a hint that one is coming, so
    after doorbells the ring is watched for up to ``handoff_wait`` seconds.  Lease expiry is asked of
    the kernel (the one writer of CLAIMED words) with the same rule as ``ep_scan_leases``."""

    hands_over = True

    def __init__(self, pool: SlotPool, cuda: CudaPoller | DeviceSlots, handoff_wait: float) -> None:
        self.pool = pool
        self.cuda = cuda
        self.handoff_wait = handoff_wait
        self.rejected_doorbells = 0
        self.expired_leases = 0
        self._lease_word = np.zeros(pool.slot_count, dtype=np.uint64)
        self._lease_ns = np.zeros(pool.slot_count, dtype=np.int64)

    def started(self, doorbells: list[int], now_ns: int) -> list[Started]:
        out: list[Started] = []
        deadline = time.monotonic() + (self.handoff_wait if doorbells else 0.0)
        while True:
            for slot, gen in self.cuda.poll():
                word = self._word(slot)
                if wire.word_generation(word) != gen or wire.word_state(word) != State.RUNNING:
                    log.error("GPU handed over slot %d generation %d, but its word is %#x", slot, gen, word)
                    continue
                self.pool.slots.results[slot]["t_ready_ns"] = lib.ep_now_ns()
                self._handed_over(slot)
                out.append((slot, wire.word_claimant(word), gen))
            if len(out) >= len(doorbells) or time.monotonic() >= deadline:
                return out

    def _word(self, slot: int) -> int:
        """``slot``'s state word as it is now (mapped memory: read in place)."""
        return self.pool.word(slot)

    def _states(self) -> np.ndarray:
        """Every state word as it is now (mapped memory: the pool's own array)."""
        return self.pool.states

    def _handed_over(self, slot: int) -> None:
        """A slot just became the model side's (mapped memory: its request is readable in place)."""

    def scan_leases(self, now_ns: int) -> int:
        words = self._states().copy()
        claimed = wire.in_state(words, State.CLAIMED)
        changed = words != self._lease_word
        self._lease_ns[changed] = now_ns
        self._lease_word[:] = words
        due = np.flatnonzero(claimed & ~changed & (now_ns - self._lease_ns >= int(self.pool.header["lease_ns"])))
        asked = 0
        for slot in due:
            if not self.cuda.expire_pending(int(slot)):
                self.cuda.request_expire(int(slot), int(words[slot]))
                asked += 1
        self.expired_leases = int(self.cuda.counters()["expired"])
        return asked

    def expire_claims_of(self, claimant: int) -> int:
        n = 0
        for slot in range(self.pool.slot_count):
            w = self._word(slot)
            if wire.claimed_by(w, claimant):
                self.cuda.request_expire(slot, w)
                n += 1
        return n

    def close(self) -> None:
        self.cuda.close()


class DeviceDoorbellPoller(GpuDoorbellPoller):
    """The CUDA persistent kernel over a pool in device memory (``--slots gpu-device``, from
    :func:`edgepath.slots.gpu.start_device_poller`).  The host cannot map that memory, so its view is
    the pool's pinned mirror (``slots.mirror``, this poller's ``pool``): state words are copied out
    before they are read (one word per hand-off, all of them per lease scan), and a handed-over slot's
    request is copied into the mirror at once, before a host handler sees it."""

    def __init__(self, slots: DeviceSlots, handoff_wait: float) -> None:
        super().__init__(slots.mirror, slots, handoff_wait)
        self.slots = slots

    def _word(self, slot: int) -> int:
        return self.slots.load_state(slot)

    def _states(self) -> np.ndarray:
        return self.slots.pull_states()

    def _handed_over(self, slot: int) -> None:
        self.slots.pull_request(slot)
