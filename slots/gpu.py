"""GPU slot pool and the CUDA persistent poller, through cupy (the optional extra ``edgepath[gpu]``).

Placement (docs/GPU.md says why):
  * ``mapped``: the pool is the transport's registered host memory (the loopback memfd an agent in
    another process writes), page-locked and mapped into the GPU with ``cudaHostRegister``.  The kernel
    polls its doorbell words over PCIe with system-scope acquire loads; the host sees every word as is.
  * ``device`` (``--slots gpu-device``): the pool, its state words and doorbells in ``cudaMalloc``
    memory (:func:`start_device_poller`), registered with the NIC through dma-buf
    (:meth:`DeviceSlots.register_for_rdma`): the GPUDirect lane, where a NIC writes the ids straight into
    HBM, the kernel polls them there and a model on the GPU reads them in place.
Either way the layout is the one of ``edgepath_slot.h``, and the hand-off to the model side is a ring
in mapped host memory.  :func:`check_placement` says which data path goes with which placement.
Nothing here imports cupy until a GPU is asked for, so the base install (no cupy) imports this module
fine and gets a clear :class:`GpuUnavailable` instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from edgepath.contract.pool import SlotPool
from edgepath.native.abi import ffi, lib
from edgepath.native.cuda_build import CudaBuildError, build_poller, ctrl_words, ring_words
from edgepath.slots.config import SLOT_MEMORY

log = logging.getLogger("edgepath.gpu")

# ctrl words, read from edgepath_poller.h (EP_CTRL_*): one 64-byte line per kind of writer.
_CTRL = ctrl_words()
CTRL_STOP, CTRL_RUNNING, CTRL_LOOPS = _CTRL["STOP"], _CTRL["RUNNING"], _CTRL["LOOPS"]
CTRL_WORDS = _CTRL["WORDS"]
_COUNTERS = {
    "accepted": _CTRL["ACCEPTED"],
    "rejected": _CTRL["REJECTED"],
    "expired": _CTRL["EXPIRED"],
    "lost": _CTRL["LOST"],
    "handoff_cycles_sum": _CTRL["HANDOFF_CYCLES"],
    "handoff_cycles_max": _CTRL["HANDOFF_MAX"],
}
# hand-off ring entries, read from edgepath_poller.h (EP_RING_*): {seq, value, detect_ns, cycles}
_RING = ring_words()

# Slot memory kinds (--slots KIND, edgepath.slots.config) and the data paths each can be written by.
_PLACEMENTS = {
    ("loopback", "host"): None,
    ("verbs", "host"): None,
    ("loopback", "gpu"): None,
    ("verbs", "gpu-device"): None,
    ("loopback", "gpu-device"): (
        "loopback agents write the pool with CPU stores into a shared memfd, and device memory cannot be "
        "mapped into their processes; use --slots gpu (host memory mapped into the GPU) with loopback"
    ),
    ("verbs", "gpu"): (
        "over verbs the NIC should write the ids straight into GPU memory (GPUDirect RDMA), not into host "
        "memory the GPU then reads over PCIe; use --slots gpu-device with --data-path verbs"
    ),
}

#: the combinations that work, for the one line a refused one gets
WORKING = (
    "the combinations that work: --data-path loopback with --slots host or gpu, "
    "--data-path verbs with --slots host or gpu-device"
)

# cudaHostRegister flags (cuda_runtime_api.h; cupy names the cudaHostAlloc ones only).
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


class GpuUnavailable(RuntimeError):
    """No usable GPU (cupy missing, no device, a driver too old, memory that cannot be mapped)."""


class RdmaRegistrationError(RuntimeError):
    """GPU memory that cannot be registered with the NIC by dma-buf nor by nvidia-peermem."""


class PollerStuck(RuntimeError):
    """The poller kernel did not stop: its memory is left allocated (freeing would wait for it forever)."""


#: what a poller that did not stop may still read or write: kept referenced, never freed or reused
_LEAKED: list[Any] = []
# cudaFree, cudaFreeHost and cudaHostUnregister wait for every kernel running on the device, which for a
# persistent poller is forever: while any poller of this process runs, frees wait here, and run once
# the last one has stopped.
_RUNNING: set[Any] = set()
_DEFERRED: list[Callable[[], None]] = []
_FREE_LOCK = threading.Lock()


def leaked() -> int:
    """How many pollers (with their memory) were left running because they did not stop."""
    return len(_LEAKED)


def _free_when_idle(free: Callable[[], None]) -> None:
    """Run ``free`` now if no poller kernel of this process runs, else once the last one stopped."""
    with _FREE_LOCK:
        _DEFERRED.append(free)
        if _RUNNING:
            return
        due = _DEFERRED[:]
        _DEFERRED.clear()
    for f in due:
        f()


def _poller_running(poller: Any, running: bool) -> None:
    with _FREE_LOCK:
        (_RUNNING.add if running else _RUNNING.discard)(poller)
        due = [] if _RUNNING else _DEFERRED[:]
        if not _RUNNING:
            _DEFERRED.clear()
    for f in due:
        f()


def check_placement(data_path: str, memory: str) -> None:
    """Refuse a data path and slot memory that do not go together, saying why and what does.

    Possible: loopback or verbs with host memory; loopback with host memory mapped into the GPU
    (``gpu``); verbs with device memory (``gpu-device``, GPUDirect RDMA)."""
    if memory not in SLOT_MEMORY:
        raise ValueError(f"slot memory {memory!r}: expected one of {', '.join(SLOT_MEMORY)}")
    key = (data_path, memory)
    if key not in _PLACEMENTS:
        raise ValueError(f"data path {data_path!r}: expected loopback or verbs")
    reason = _PLACEMENTS[key]
    if reason is not None:
        raise ValueError(f"--slots {memory} with --data-path {data_path} is not possible: {reason} ({WORKING})")


def load_cupy(flag: str = "--slots gpu") -> ModuleType:
    """cupy, with modules loaded eagerly: a lazily loaded kernel can deadlock behind the persistent one.

    ``CUDA_MODULE_LOADING`` is read when CUDA initialises, so it is forced to EAGER before cupy is
    first imported (an image that sets LAZY is overridden, with a warning); once cupy is imported under
    another value it is too late, and that is refused."""
    mode = os.environ.get("CUDA_MODULE_LOADING")
    if mode != "EAGER":
        if sys.modules.get("cupy") is not None:
            raise GpuUnavailable(
                f"{flag}: cupy was imported with CUDA_MODULE_LOADING={mode or 'unset (LAZY)'}; the persistent "
                "poller needs EAGER module loading (a lazily loaded kernel can wait forever behind it): set "
                "CUDA_MODULE_LOADING=EAGER before starting, or let edgepath import cupy first"
            )
        if mode is not None:
            log.warning("CUDA_MODULE_LOADING=%s overridden to EAGER for the persistent GPU poller", mode)
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
    try:
        import cupy
    except ImportError as exc:
        raise GpuUnavailable(
            f"{flag}: cupy is not installed ({exc}); install edgepath[gpu] on a CUDA machine, or use --slots host"
        ) from exc
    return cupy


@dataclass(frozen=True)
class DeviceInfo:
    """What the poller's design depends on, read off the device (and recorded by bench/gpu_check.py)."""

    index: int
    name: str
    compute_capability: str  # "90"
    host_native_atomics: bool  # CPU and GPU atomics on one host word are atomic together (NVLink-C2C)
    gpudirect_rdma: bool
    rdma_writes_ordering: int  # cudaGPUDirectRDMAWritesOrdering: 0 none, 100 owner, 200 all devices


def require_device(index: int = 0, flag: str = "--slots gpu") -> DeviceInfo:
    """The CUDA device ``index``, or :class:`GpuUnavailable` saying why there is none (naming ``flag``,
    the option that asked for a GPU)."""
    cp = load_cupy(flag)
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError, or a loader error when there is no driver at all
        raise GpuUnavailable(f"{flag}: no CUDA device found (cupy: {exc}); use --slots host") from exc
    if not 0 <= index < count:
        raise GpuUnavailable(f"{flag}: no CUDA device {index} (found {count}); use --slots host")
    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(index)
    if not rt.deviceGetAttribute(rt.cudaDevAttrCanMapHostMemory, index):
        raise GpuUnavailable(f"{flag}: device {index} cannot map host memory; use --slots host")
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    return DeviceInfo(
        index,
        name,
        f"{props['major']}{props['minor']}",
        bool(rt.deviceGetAttribute(rt.cudaDevAttrHostNativeAtomicSupported, index)),
        bool(rt.deviceGetAttribute(rt.cudaDevAttrGPUDirectRDMASupported, index)),
        int(rt.deviceGetAttribute(rt.cudaDevAttrGPUDirectRDMAWritesOrdering, index)),
    )


def _device_address(cp: ModuleType, host_address: int) -> int:
    """Where the GPU sees mapped host memory (cudaHostGetDevicePointer, through the pointer's attributes)."""
    return int(cp.cuda.runtime.pointerGetAttributes(host_address).devicePointer)


class _Pinned:
    """Page-locked host memory mapped into the GPU: a host view (numpy + cffi) and the device address."""

    def __init__(self, cp: ModuleType, nbytes: int) -> None:
        self._cp = cp
        rt = cp.cuda.runtime
        self.host = rt.hostAlloc(nbytes, rt.hostAllocMapped | rt.hostAllocPortable)
        self.device = _device_address(cp, self.host)
        self.ptr = ffi.cast("uint64_t *", self.host)
        ffi.memmove(self.ptr, bytes(nbytes), nbytes)  # cudaHostAlloc does not zero

    def close(self) -> None:
        if self.host:
            _free_when_idle(functools.partial(self._cp.cuda.runtime.freeHost, self.host))
            self.host = 0


def map_host_buffer(cp: ModuleType, buf: np.ndarray) -> int:
    """Page-lock ``buf`` (e.g. the loopback memfd mapping) and map it: its address as the GPU sees it."""
    try:
        cp.cuda.runtime.hostRegister(buf.ctypes.data, buf.nbytes, _HOST_REGISTER_MAPPED | _HOST_REGISTER_PORTABLE)
    except Exception as exc:
        raise GpuUnavailable(f"--slots gpu: cannot page-lock and map the slot pool into the GPU ({exc})") from exc
    return _device_address(cp, buf.ctypes.data)


def start_mapped_poller(buf: np.ndarray, slot_count: int, device: int = 0, **options: Any) -> GpuPoller:
    """The poller over a pool in host memory ``buf`` (mapped placement), launched; unmaps on close."""
    info = require_device(device)
    cp = load_cupy()
    cp.cuda.Device(device).use()
    address = map_host_buffer(cp, buf)
    poller: GpuPoller | None = None
    try:
        poller = GpuPoller(address, slot_count, info, **options)
        poller.unmap_on_close(buf.ctypes.data)
        poller.start()
    except BaseException:
        if poller is None:
            _free_when_idle(functools.partial(cp.cuda.runtime.hostUnregister, buf.ctypes.data))
        else:
            with contextlib.suppress(Exception):  # the start error is the one to report
                poller.close()
        raise
    return poller


class GpuPoller:
    """The persistent kernel over one slot pool, and the host end of its hand-off ring.

    ``pool_address`` is the pool as the GPU sees it: from :func:`map_host_buffer` (mapped placement,
    where the host reads the same words directly) or a :class:`DevicePool`'s address.
    """

    def __init__(
        self,
        pool_address: int,
        slot_count: int,
        device: DeviceInfo,
        min_sleep_ns: int = 32,
        max_sleep_ns: int = 256,
        stop_timeout: float = 5.0,
    ) -> None:
        cp = load_cupy()
        self._cp = cp
        self.device = device
        self.slot_count = slot_count
        self.pool_address = pool_address
        self.min_sleep_ns, self.max_sleep_ns = min_sleep_ns, max_sleep_ns
        self.stop_timeout = stop_timeout
        try:
            fatbin = build_poller((device.compute_capability,))
        except CudaBuildError as exc:
            raise GpuUnavailable(f"--slots gpu: {exc}") from exc
        cp.cuda.Device(device.index).use()
        self.module = cp.RawModule(path=str(fatbin))
        # get_function loads the module now, before the persistent kernel occupies the GPU.
        self._kernel = self.module.get_function("ep_gpu_poller")
        self.ring_capacity = 1 << max(6, (slot_count - 1).bit_length())  # >= slots: the ring cannot overrun
        self._ctrl = _Pinned(cp, 8 * CTRL_WORDS)
        self._expire = _Pinned(cp, 8 * slot_count)
        self._ring = _Pinned(cp, 8 * _RING["WORDS"] * self.ring_capacity)
        # The kernel's private words are zeroed on its own stream, ahead of its launch there: stream order,
        # not a device-wide synchronisation (which would wait forever for any other persistent kernel in
        # the process).  cp.zeros queues its memset on the current stream, and cupy's pool hands a block
        # back to the stream that freed it, so a reused block is zeroed before this kernel reads it.
        self._stream = cp.cuda.Stream(non_blocking=True)
        with self._stream:
            self._seen = cp.zeros(slot_count, dtype=cp.uint64)
            self._tail = cp.zeros(1, dtype=cp.uint64)
        self._head = 0
        self._launched = False
        self._unmap: int | None = None

    def unmap_on_close(self, host_address: int) -> None:
        """Unregister this page-locked host range when the poller closes (after the kernel stopped)."""
        self._unmap = host_address

    # -- lifecycle -----------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> None:
        """Launch the kernel and wait until it reports that it is polling."""
        threads = min(1024, max(32, (self.slot_count + 31) // 32 * 32))
        args = (
            np.uint64(self.pool_address),
            self._seen,
            np.uint64(self._expire.device),
            np.uint64(self._ring.device),
            np.uint32(self.ring_capacity),
            self._tail,
            np.uint64(self._ctrl.device),
            np.uint32(self.min_sleep_ns),
            np.uint32(self.max_sleep_ns),
        )
        with self._stream:
            self._kernel((1,), (threads,), args)
        self._launched = True
        _poller_running(self, True)
        deadline = time.monotonic() + timeout
        while self._ctrl_word(CTRL_RUNNING) != 1:
            if self._stream.done:
                self._stream.synchronize()  # raises the launch error, if any
                raise GpuUnavailable("--slots gpu: the poller kernel exited at once")
            if time.monotonic() > deadline:
                raise GpuUnavailable(f"--slots gpu: the poller kernel did not start within {timeout:.0f} s")
            time.sleep(0.001)

    def stop(self, timeout: float | None = None) -> None:
        """Set the stop flag (mapped memory: no copy queued behind the running kernel) and wait for the
        kernel to end, checking the deadline before anything blocks: a kernel that does not stop is a
        :class:`PollerStuck` (and this poller's memory is kept: see :meth:`close`), never a hang."""
        if not self._launched:
            return
        timeout = self.stop_timeout if timeout is None else timeout
        lib.ep_store64(self._ctrl.ptr + CTRL_STOP, 1)
        deadline = time.monotonic() + timeout
        while not self._stream.done:
            if time.monotonic() > deadline:
                raise PollerStuck(
                    f"GPU poller did not stop within {timeout:g} s (running word {self._ctrl_word(CTRL_RUNNING)}); "
                    "its memory is left allocated: freeing it would wait for the kernel forever"
                )
            time.sleep(0.001)
        self._launched = False
        _poller_running(self, False)
        self._stream.synchronize()  # the kernel ended: returns at once, raising its error if it had one

    def close(self) -> None:
        """Stop the kernel, then free what it used.  If it does not stop, nothing is freed or unmapped:
        the memory stays referenced for the life of the process and :class:`PollerStuck` is raised."""
        try:
            self.stop()
        except PollerStuck:
            _LEAKED.append(self)
            log.error("GPU poller left running and its memory leaked: it did not stop")
            raise
        for block in (self._ring, self._expire, self._ctrl):
            block.close()
        if self._unmap is not None:
            _free_when_idle(functools.partial(self._cp.cuda.runtime.hostUnregister, self._unmap))
            self._unmap = None

    # -- host end ------------------------------------------------------------------
    def _ctrl_word(self, which: int) -> int:
        return int(lib.ep_load64(self._ctrl.ptr + which))

    def poll(self, max_entries: int = 256) -> list[tuple[int, int]]:
        """Slots the kernel moved to RUNNING since the last call: (slot, generation), in hand-off order."""
        out: list[tuple[int, int]] = []
        ring = self._ring.ptr
        mask = self.ring_capacity - 1
        width, seq, val = _RING["WORDS"], _RING["SEQ"], _RING["VALUE"]
        while len(out) < max_entries:
            i = width * (self._head & mask)
            if lib.ep_load64(ring + i + seq) != self._head + 1:
                break
            value = int(lib.ep_load64(ring + i + val))
            out.append((value & 0xFFFF, value >> 32))
            self._head += 1
        return out

    def request_expire(self, slot: int, word: int) -> bool:
        """Ask the kernel (the only writer of CLAIMED words) to expire ``slot`` if it still holds ``word``.

        Written only while no request is pending (the kernel clears the entry once it decided), so a
        request is never overwritten before the kernel saw it; False when one is pending (ask again
        later)."""
        if word == 0:
            raise ValueError(f"slot {slot}: 0 is not a state word to expire (0 means no request)")
        if lib.ep_load64(self._expire.ptr + slot) != 0:
            return False
        lib.ep_store64(self._expire.ptr + slot, word)
        return True

    def expire_pending(self, slot: int) -> bool:
        return lib.ep_load64(self._expire.ptr + slot) != 0

    def counters(self) -> dict[str, int]:
        """accepted / rejected / expired / lost doorbells and claims, and the kernel's own clock from a
        doorbell's detection to its ring entry's publication (sum and max over accepted ones, in GPU
        clock cycles)."""
        return {name: self._ctrl_word(word) for name, word in _COUNTERS.items()}

    @property
    def running(self) -> bool:
        return self._launched and not self._stream.done


class DevicePool:
    """A slot pool in device memory: same layout, initialised in a pinned host mirror and copied in.

    Allocated with cudaMalloc on its own, rounded up to 2 MiB, so the host-page-aligned range a dma-buf
    export needs lies inside it (a block from cupy's memory pool could share pages with other arrays).
    The mirror (``self.mirror``, a :class:`SlotPool` over pinned host memory) is where the host side
    stages what it copies in and out; the device copy is the pool.
    """

    ALIGN = 2 << 20

    def __init__(
        self, cp: ModuleType, slot_count: int, input_capacity: int, output_capacity: int, lease_ns: int, epoch: int = 0
    ) -> None:
        dims = SlotPool.layout_for(slot_count, input_capacity, output_capacity)
        self._cp = cp
        self.nbytes = int(dims["total_size"])
        self._staging = _Pinned(cp, self.nbytes)
        staging = np.frombuffer(ffi.buffer(self._staging.ptr, self.nbytes), dtype=np.uint8)
        self.mirror = SlotPool.create(staging, slot_count, input_capacity, output_capacity, lease_ns, epoch)
        rt = cp.cuda.runtime
        self.address = int(rt.malloc(-(-self.nbytes // self.ALIGN) * self.ALIGN))
        rt.memcpy(self.address, self._staging.host, self.nbytes, rt.memcpyHostToDevice)

    def close(self) -> None:
        if self.address:
            _free_when_idle(functools.partial(self._cp.cuda.runtime.free, self.address))
            self.address = 0
        self._staging.close()


def start_device_poller(
    slot_count: int,
    input_capacity: int,
    output_capacity: int,
    lease_ns: int,
    epoch: int,
    device: int = 0,
    **options: Any,
) -> DeviceSlots:
    """A pool in device memory (``--slots gpu-device``) with the poller running over it in HBM."""
    info = require_device(device, "--slots gpu-device")
    cp = load_cupy()
    cp.cuda.Device(device).use()
    pool = DevicePool(cp, slot_count, input_capacity, output_capacity, lease_ns, epoch)
    try:
        poller = GpuPoller(pool.address, slot_count, info, **options)
    except BaseException:
        pool.close()
        raise
    slots = DeviceSlots(pool, poller)
    try:
        poller.start()
    except BaseException:
        with contextlib.suppress(Exception):  # the start error is the one to report
            slots.close()
        raise
    return slots


class DeviceSlots:
    """A device-memory slot pool and its poller: the poller's API, plus the host's access to slot memory
    it cannot map.

    The model side owns a slot from RUNNING to FREE (edgepath_poll.h), so it writes those state words
    with plain release stores (:meth:`store_state`, a one-thread kernel on a side stream: one 8-byte
    store, after the copies queued before it).  A model on the GPU reads a slot in place
    (:meth:`tokens_address`); a host handler works on the mirror: :meth:`pull_request` copies a slot's
    request part out, :meth:`push_result` copies its result part back.  Every copy runs on a
    non-blocking side stream, so none waits behind the persistent kernel.
    """

    def __init__(self, pool: DevicePool, poller: GpuPoller) -> None:
        self._pool = pool
        self.poller = poller
        self.mirror = pool.mirror
        self.address = pool.address
        self.nbytes = pool.nbytes
        cp = load_cupy()
        self._cp = cp
        self._stream = cp.cuda.Stream(non_blocking=True)
        self._store = poller.module.get_function("ep_gpu_store")
        layout = self.mirror.layout
        self._slots_offset = self.mirror.slots.offset
        self._stride = layout.stride
        self._result_offset = layout.result_offset

    # -- the poller's API (what the slot server calls) -------------------------------
    def poll(self, max_entries: int = 256) -> list[tuple[int, int]]:
        return self.poller.poll(max_entries)

    def request_expire(self, slot: int, word: int) -> bool:
        return self.poller.request_expire(slot, word)

    def expire_pending(self, slot: int) -> bool:
        return self.poller.expire_pending(slot)

    def counters(self) -> dict[str, int]:
        return self.poller.counters()

    @property
    def running(self) -> bool:
        return self.poller.running

    def close(self) -> None:
        """Stop the kernel, then free the device pool; a kernel that did not stop keeps its pool (freeing
        device memory waits for every running kernel: it would hang)."""
        try:
            self.poller.close()
        except PollerStuck:
            _LEAKED.append(self._pool)
            raise
        self._pool.close()

    # -- slot memory on the device ---------------------------------------------------
    def slot_offset(self, slot: int) -> int:
        if not 0 <= slot < self.mirror.slot_count:
            raise IndexError(f"slot {slot}: the pool has slots 0..{self.mirror.slot_count - 1}")
        return self._slots_offset + slot * self._stride

    def tokens_address(self, slot: int) -> int:
        """The device address of ``slot``'s token ids: where a model on the GPU reads them in place."""
        return self.address + self.slot_offset(slot) + int(self.mirror.slots.requests.dtype.itemsize)

    def _copy(self, dst: int, src: int, nbytes: int, kind: int) -> None:
        self._cp.cuda.runtime.memcpyAsync(dst, src, nbytes, kind, self._stream.ptr)
        self._stream.synchronize()

    def _host(self, offset: int) -> int:
        return self._pool._staging.host + offset

    def pull_request(self, slot: int) -> None:
        """Copy ``slot``'s request header and tokens from the device into the mirror."""
        off = self.slot_offset(slot)
        rt = self._cp.cuda.runtime
        self._copy(self._host(off), self.address + off, self._result_offset, rt.memcpyDeviceToHost)

    def push_request(self, slot: int) -> None:
        """Copy ``slot``'s request part from the mirror onto the device: what the NIC's data WRITE does
        on the GPUDirect lane, for a writer on this host (tests, bench/gpu_check.py's stand-in agent)."""
        off = self.slot_offset(slot)
        rt = self._cp.cuda.runtime
        self._copy(self.address + off, self._host(off), self._result_offset, rt.memcpyHostToDevice)

    def push_result(self, slot: int, output_count: int | None = None) -> None:
        """Copy ``slot``'s result header and output from the mirror onto the device: the first
        ``output_count`` output tokens (None: the whole output area), so a streamed result copies what
        it sends, not the slot's whole capacity."""
        off = self.slot_offset(slot) + self._result_offset
        capacity = self.mirror.layout.output_capacity
        if output_count is None:
            output_count = capacity
        elif not 0 <= output_count <= capacity:
            raise ValueError(f"output_count {output_count}: expected 0..{capacity} (the slot's output capacity)")
        nbytes = self.mirror.layout.result_bytes(output_count)
        rt = self._cp.cuda.runtime
        self._copy(self.address + off, self._host(off), nbytes, rt.memcpyHostToDevice)

    def push_range(self, offset: int, nbytes: int) -> None:
        """Copy bytes ``[offset, offset + nbytes)`` of the pool from the mirror onto the device (and wait)."""
        if not 0 <= offset <= offset + nbytes <= self.nbytes:
            raise ValueError(f"range {offset}+{nbytes}: expected within the pool's {self.nbytes} bytes")
        rt = self._cp.cuda.runtime
        self._copy(self.address + offset, self._host(offset), nbytes, rt.memcpyHostToDevice)

    def pull_states(self) -> np.ndarray:
        """Copy every state word from the device into the mirror (lease scans); the mirror's array."""
        off = self.mirror.states_offset
        rt = self._cp.cuda.runtime
        self._copy(self._host(off), self.address + off, self.mirror.states.nbytes, rt.memcpyDeviceToHost)
        return self.mirror.states

    def load_word(self, offset: int) -> int:
        """One u64 of the pool at byte ``offset``, copied from the device (e.g. a slot's cancel word)."""
        if offset % 8 or not 0 <= offset <= self.nbytes - 8:
            raise ValueError(f"offset {offset}: expected a multiple of 8 in 0..{self.nbytes - 8}")
        rt = self._cp.cuda.runtime
        self._copy(self._host(offset), self.address + offset, 8, rt.memcpyDeviceToHost)
        return int(self.mirror.buf[offset : offset + 8].view(np.uint64)[0])

    def load_state(self, slot: int) -> int:
        self.slot_offset(slot)
        off = self.mirror.states_offset + 8 * slot
        rt = self._cp.cuda.runtime
        self._copy(self._host(off), self.address + off, 8, rt.memcpyDeviceToHost)
        return int(self.mirror.states[slot])

    def store_word(self, offset: int, value: int) -> None:
        """One release store of a u64 at byte ``offset`` of the pool, after every copy queued before it."""
        if offset % 8 or not 0 <= offset <= self.nbytes - 8:
            raise ValueError(f"offset {offset}: expected a multiple of 8 in 0..{self.nbytes - 8}")
        with self._stream:
            self._store((1,), (1,), (np.uint64(self.address + offset), np.uint64(value)))
        self._stream.synchronize()

    def store_state(self, slot: int, word: int) -> None:
        """The model side's RUNNING -> DONE -> FREE steps: it is the only writer of those words."""
        self.slot_offset(slot)
        self.store_word(self.mirror.states_offset + 8 * slot, word)

    def register_for_rdma(self, pd: Any, access: int, offset: int = 0, length: int | None = None) -> tuple[Any, str]:
        """Register ``length`` bytes of the pool (default: the rest) from byte ``offset`` with the NIC (dma-buf,
        nvidia-peermem as the logged fallback): the whole of it for this side, each part agents are given apart."""
        length = self.nbytes - offset if length is None else length
        return register_for_rdma(pd, self.address + offset, length, access, self.poller.device.index)


def dmabuf_export(address: int, length: int, device: int = 0) -> tuple[int, int, int]:
    """A dma-buf fd for device memory ``[address, address+length)``: (fd, offset of address in it, length).

    ``cuMemGetHandleForAddressRange`` wants a host-page-aligned range, so the range is widened to pages.
    """
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise RdmaRegistrationError(f"dma-buf export needs cuda-bindings (edgepath[gpu]): {exc}") from exc
    try:
        init = driver.cuInit(0)
    except Exception as exc:  # cuda-bindings raises its own loader error when there is no driver
        raise RdmaRegistrationError(f"dma-buf export: no CUDA driver ({exc})") from exc
    _check(init, "cuInit")
    dev = _check(driver.cuDeviceGet(device), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
    if not _check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"):
        raise RdmaRegistrationError(f"device {device} does not support dma-buf (needs the open kernel modules)")
    page = os.sysconf("SC_PAGE_SIZE")
    base = address & ~(page - 1)
    span = (address + length - base + page - 1) & ~(page - 1)
    kind = driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
    fd = _check(driver.cuMemGetHandleForAddressRange(base, span, kind, 0), "cuMemGetHandleForAddressRange")
    return int(fd), address - base, span


def _check(result: tuple[Any, ...], what: str) -> Any:
    err, *rest = result
    if int(err) != 0:
        raise RdmaRegistrationError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else tuple(rest)


def register_for_rdma(pd: Any, address: int, length: int, access: int, device: int = 0) -> tuple[Any, str]:
    """Register device memory with a NIC: ``(mr, "dma-buf")`` through pyverbs' DmaBufMR, or, when that
    cannot be had, ``(mr, "nvidia-peermem")`` through ibv_reg_mr on the device pointer, with the reason
    logged.  :class:`RdmaRegistrationError` names both reasons when neither works."""
    try:
        from pyverbs.mr import DmaBufMR

        fd, offset, _span = dmabuf_export(address, length, device)
        try:
            return DmaBufMR(pd, length, access, dmabuf=fd, offset=offset), "dma-buf"
        finally:
            os.close(fd)  # the MR holds its own reference to the dma-buf
    except Exception as exc:
        dmabuf_reason = str(exc) or type(exc).__name__
    log.warning("dma-buf registration of GPU memory failed (%s); trying nvidia-peermem", dmabuf_reason)
    try:
        from pyverbs.mr import MR

        return MR(pd, length, access, address=address), "nvidia-peermem"
    except Exception as exc:
        peermem_reason = str(exc) or type(exc).__name__
        raise RdmaRegistrationError(
            f"GPU memory at {address:#x} ({length} bytes) cannot be registered for RDMA: "
            f"dma-buf: {dmabuf_reason}; nvidia-peermem (ibv_reg_mr on the device pointer): {peermem_reason}. "
            "Needs a NIC driver with dma-buf support and the NVIDIA open kernel modules, or nvidia-peermem loaded."
        ) from exc
