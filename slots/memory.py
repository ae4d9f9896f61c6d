"""Where a slot server's pool lives, behind one interface: host memory, host memory mapped into a GPU, or
GPU memory the NIC writes.

Each kind registers the pool with the transport (what agents are given), gives the host a
:class:`~edgepath.contract.pool.SlotPool` view to work on (the memory itself, or a pinned mirror of device
memory), and starts the doorbell poller that fits it (:mod:`edgepath.slots.pollers`).  The slot server
asks it for the few things that differ by kind -- storing the model side's own state steps, making a
result what the NIC sends, reading a cancel word -- and never branches on the kind itself.  The GPU
internals behind the two GPU kinds are :mod:`edgepath.slots.gpu`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgepath.contract import wire
from edgepath.contract.pool import SlotPool
from edgepath.native.abi import Event, ffi, lib
from edgepath.slots.config import SLOT_MEMORY, SlotServerConfig
from edgepath.slots.handlers import Heartbeat
from edgepath.slots.owned import OwnedWords
from edgepath.slots.pollers import DeviceDoorbellPoller, GpuDoorbellPoller, HostPoller, Poller
from edgepath.transports.base import Access, MemoryRegion, Transport

if TYPE_CHECKING:
    from edgepath.slots.gpu import DeviceInfo, DeviceSlots


class PoolMemory:
    """A slot pool registered with a transport, its host view and its doorbell poller."""

    #: the whole pool, registered for this side's own use (what results are sent from); no peer is given it
    region: MemoryRegion
    #: what agents are given: the parts of the pool an agent may touch, and how (:func:`wire.pool_exports`)
    exports: list[MemoryRegion]
    #: the host's view of the pool (for a device pool: its pinned mirror)
    pool: SlotPool
    poller: Poller
    #: the pool in GPU memory, when it is there (``gpu-device``), for code that works on the device
    device_slots: DeviceSlots | None = None

    def __init__(self) -> None:
        #: what the server last stored in each state word (its own steps go through it)
        self.owned = OwnedWords(self.pool.states)
        self._heartbeat_ptr = ffi.cast("uint64_t *", ffi.from_buffer(self.pool.buf[wire.HEARTBEAT_OFFSET :]))
        self._load_ptr = ffi.cast("struct ep_load *", ffi.from_buffer(self.pool.buf[wire.LOAD_OFFSET :]))

    @property
    def beats(self) -> int:
        """The heartbeat word as the host sees it (how often it was advanced: it starts at 0)."""
        return int(lib.ep_load64(self._heartbeat_ptr))

    def beat(self, now: float) -> None:
        """Advance the pool header's heartbeat (``now``: monotonic seconds): what tells readers that the
        server's CPU side is turning.  One atomic increment of the word agents read."""
        lib.ep_heartbeat_tick(self._heartbeat_ptr)

    def drain(self) -> None:
        """Say in the pool header that this server is stopping: agents read it with the heartbeat and claim
        nothing more here."""
        lib.ep_store64(ffi.cast("uint64_t *", ffi.from_buffer(self.pool.buf[wire.DRAINING_OFFSET :])), 1)

    def heartbeat(self) -> Heartbeat:
        """What a handler needs to advance the heartbeat from inside a long step (C code, any thread)."""
        function = ffi.addressof(lib, "ep_heartbeat_tick")
        return Heartbeat(int(ffi.cast("uintptr_t", function)), int(ffi.cast("uintptr_t", self._heartbeat_ptr)))

    def step(self, slot: int, event: Event, generation: int, holder: int = 0) -> bool:
        """One of the model side's own steps (RUNNING -> DONE -> FREE, or DONE -> CLAIMED for a reclaimer:
        ``holder``) on ``slot``'s state word; whether it was allowed."""
        return self.owned.step(slot, event, generation, holder) == lib.EP_OK

    def publish_result(self, slot: int, output_count: int) -> None:
        """Make ``slot``'s result header and first ``output_count`` tokens, as the host wrote them, what the
        NIC sends (host and mapped memory: they already are)."""

    def cancel_word(self, slot: int) -> int:
        return int(self.pool.cancels[slot])

    def reclaim_word(self, slot: int) -> int:
        """What a reclaimer of ``slot`` last wrote: the CLAIMED word it asks the slot to be handed over as."""
        return int(lib.ep_load64(ffi.cast("uint64_t *", ffi.from_buffer(self.pool.reclaims[slot : slot + 1]))))

    def publish_load(self, fields: np.ndarray) -> None:
        """The pool's load region (``fields``: a :func:`~edgepath.contract.wire.load_record`), under its sequence
        lock: a reader that copies it in address order sees one version whole, or knows it did not."""
        lib.ep_load_publish(self._load_ptr, ffi.cast("struct ep_load *", ffi.from_buffer(fields)))

    def publish_prefixes(self, table: np.ndarray) -> None:
        """Make ``table`` (a :func:`~edgepath.contract.wire.prefix_table` of the pool's size) the prefix table
        agents read.  Entries are stored one aligned word at a time: an agent reading meanwhile sees some old
        and some new entries, which only makes its hint less exact (the handler checks the tokens)."""
        self.pool.prefixes[:] = table

    def close(self) -> None:
        """Stop the poller and free what this memory owns (the transport closes the region)."""
        self.poller.close()


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What a pool is made of: its dimensions, lease and epoch, and for a GPU kind the device and how long
    the host waits for the kernel's hand-off after a doorbell."""

    slots: int
    input_capacity: int
    output_capacity: int
    lease_ns: int
    epoch: int
    device: int = 0
    handoff_wait: float = 0.002
    prefix_entries: int = 0  # the prefix table's size (host and mapped pools; a device pool has none yet)

    @classmethod
    def of(cls, config: SlotServerConfig, epoch: int, prefix_entries: int = 0) -> PoolSpec:
        lease_ns = int(config.lease * 1e9)
        dims = (config.slots, config.input_capacity, config.output_capacity)
        return cls(*dims, lease_ns, epoch, config.gpu_device, config.handoff_wait, prefix_entries)

    def create(self, buf: np.ndarray) -> SlotPool:
        """``buf`` initialised as an empty pool of this spec."""
        dims = (self.slots, self.input_capacity, self.output_capacity)
        return SlotPool.create(buf, *dims, self.lease_ns, self.epoch, self.prefix_entries)


def exports_of(pool: SlotPool) -> list[wire.Export]:
    """The regions ``pool`` is exported as (:func:`~edgepath.contract.wire.pool_exports`)."""
    h = pool.header
    return wire.pool_exports(
        int(h["states_offset"]), int(h["slot_count"]), int(h["doorbells_offset"]), int(h["total_size"])
    )


def _host_pool(transport: Transport, spec: PoolSpec) -> tuple[MemoryRegion, SlotPool, list[MemoryRegion]]:
    """The pool in memory the transport allocates (no peer access: this side sends results from it), and the
    regions agents are given over that same memory."""
    dims = SlotPool.layout_for(spec.slots, spec.input_capacity, spec.output_capacity, spec.prefix_entries)
    region = transport.register("pool-memory", int(dims["total_size"]), Access.NONE)
    pool = spec.create(region.buf)
    exports = [
        transport.register(e.name, e.length, e.access, buffer=region.buf[e.start : e.start + e.length])
        for e in exports_of(pool)
    ]
    return region, pool, exports


class HostMemory(PoolMemory):
    """The pool in host memory the transport allocates, polled by the CPU."""

    def __init__(self, transport: Transport, spec: PoolSpec) -> None:
        self.region, self.pool, self.exports = _host_pool(transport, spec)
        super().__init__()
        self.poller = HostPoller(self.pool, self.owned)


class MappedMemory(PoolMemory):
    """``--slots gpu``: the pool in host memory, mapped into the GPU, where the CUDA poller watches it."""

    def __init__(self, transport: Transport, spec: PoolSpec) -> None:
        from edgepath.slots.gpu import start_mapped_poller

        self.region, self.pool, self.exports = _host_pool(transport, spec)
        cuda = start_mapped_poller(self.region.buf, spec.slots, spec.device)
        self.poller = GpuDoorbellPoller(self.pool, cuda, spec.handoff_wait)
        super().__init__()


class DeviceMemory(PoolMemory):
    """``--slots gpu-device``: the pool in GPU memory with the CUDA poller over it, registered with the
    transport's NIC (``register_device``: dma-buf, else nvidia-peermem), so agents write the ids straight
    into HBM; the host works on the pool's pinned mirror, and state words it steps are stored on the
    device."""

    def __init__(self, transport: Transport, spec: PoolSpec) -> None:
        register = getattr(transport, "register_device", None)
        if register is None:
            raise ValueError(
                f"--slots gpu-device: the {transport.name} data path cannot let agents write GPU memory "
                "(it has no register_device); use --data-path verbs (GPUDirect RDMA), or --slots gpu with loopback"
            )
        from edgepath.slots.gpu import start_device_poller

        device_slots = start_device_poller(
            spec.slots, spec.input_capacity, spec.output_capacity, spec.lease_ns, spec.epoch, spec.device
        )
        try:
            _require_write_ordering(device_slots.poller.device)
            self.region = register("pool-memory", device_slots, Access.NONE)
            self.exports = [
                register(e.name, device_slots, e.access, e.start, e.length) for e in exports_of(device_slots.mirror)
            ]
        except BaseException:
            device_slots.close()
            raise
        self.device_slots = device_slots
        self.pool = device_slots.mirror
        self.poller = DeviceDoorbellPoller(device_slots, spec.handoff_wait)
        self._beat_at = -self.BEAT_EVERY
        super().__init__()

    def step(self, slot: int, event: Event, generation: int, holder: int = 0) -> bool:
        """Stepped in the mirror (current: read at hand-off and at every lease scan), stored on the device."""
        done = super().step(slot, event, generation, holder)
        if done:
            self.device_slots.store_state(slot, int(self.pool.states[slot]))  # type: ignore[union-attr]
        return done

    def publish_result(self, slot: int, output_count: int) -> None:
        self.device_slots.push_result(slot, output_count)  # type: ignore[union-attr]

    #: seconds between heartbeat stores into device memory (each is a kernel launch and a synchronise)
    BEAT_EVERY = 0.001

    def beat(self, now: float) -> None:
        """Advanced in the mirror, stored on the device at most every :attr:`BEAT_EVERY` seconds: readers
        need the word to move within a hang timeout (seconds), not at every turn of the loop.  (A handler's
        beats within a step advance the mirror only; the next turn publishes them.)"""
        if now - self._beat_at < self.BEAT_EVERY:
            return
        self._beat_at = now
        super().beat(now)
        self.device_slots.store_word(wire.HEARTBEAT_OFFSET, self.beats)  # type: ignore[union-attr]

    def drain(self) -> None:
        """Said in the mirror and in device memory, where agents read it."""
        super().drain()
        self.device_slots.store_word(wire.DRAINING_OFFSET, 1)  # type: ignore[union-attr]

    def cancel_word(self, slot: int) -> int:
        return self.device_slots.load_word(self.pool.cancels_offset + 8 * slot)  # type: ignore[union-attr]

    def reclaim_word(self, slot: int) -> int:
        return self.device_slots.load_word(self.pool.reclaims_offset + 8 * slot)  # type: ignore[union-attr]

    def publish_load(self, fields: np.ndarray) -> None:
        """Written in the mirror, then stored on the device in the sequence lock's order (the NIC reads the
        device's copy): the begin word, the fields, the end word, each store after the copies before it."""
        super().publish_load(fields)
        device, at = self.device_slots, wire.LOAD_OFFSET
        mirror = self.pool.buf[at : at + wire.LOAD_REGION.itemsize].view(np.uint64)
        device.store_word(at + wire.LOAD_REGION.itemsize - 8, int(mirror[-1]))  # type: ignore[union-attr]
        device.push_range(at + 8, wire.LOAD_REGION.itemsize - 16)  # type: ignore[union-attr]
        device.store_word(at, int(mirror[0]))  # type: ignore[union-attr]

    def close(self) -> None:
        """Deregister the pool from the NIC before its memory is freed (a region's close may run again when
        the transport closes), then stop the poller and free the device memory."""
        try:
            for region in (*self.exports, self.region):
                region.close()  # type: ignore[attr-defined]
        finally:
            self.device_slots.close()  # type: ignore[union-attr]


#: ``--slots KIND`` -> the memory it names
KINDS: dict[str, type[HostMemory | MappedMemory | DeviceMemory]] = {
    "host": HostMemory,
    "gpu": MappedMemory,
    "gpu-device": DeviceMemory,
}
assert tuple(KINDS) == SLOT_MEMORY, "every kind --slots names has its memory"


def open_pool_memory(transport: Transport, kind: str, spec: PoolSpec) -> PoolMemory:
    """A pool of ``kind`` (one of :data:`SLOT_MEMORY`) registered with ``transport``, its poller started."""
    if kind not in KINDS:
        raise ValueError(f"slot memory must be one of {', '.join(SLOT_MEMORY)}, got {kind!r}")
    return KINDS[kind](transport, spec)


def _require_write_ordering(device: DeviceInfo) -> None:
    """Refuse a GPU that may show a NIC's doorbell before the request it rings for.

    The kernel trusts a slot's data once its doorbell is visible; that holds for NIC writes into HBM
    only if the device orders GPUDirect RDMA writes for its own readers (attribute >= 100, "owner").
    Otherwise the writer would have to flush (an RDMA READ of the slot) before ringing, which agents do
    not do yet (docs/GPU.md)."""
    from edgepath.slots.gpu import GpuUnavailable

    if device.rdma_writes_ordering < 100:
        raise GpuUnavailable(
            f"--slots gpu-device: device {device.index} ({device.name}) does not order GPUDirect RDMA writes "
            f"(cudaDevAttrGPUDirectRDMAWritesOrdering = {device.rdma_writes_ordering}, needs >= 100), so a "
            "doorbell could be seen before its request, and agents do not flush before ringing yet; "
            "use --slots host with --data-path verbs"
        )
