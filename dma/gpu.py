"""GPU slot pool and the CUDA persistent poller, through cupy (the optional extra ``edgepath[gpu]``).

Placement (docs/GPU.md says why):
  * ``mapped``: the pool is the transport's registered host memory (the loopback memfd an agent in
    another process writes), page-locked and mapped into the GPU with ``cudaHostRegister``.  The kernel
    polls its doorbell words over PCIe with system-scope acquire loads; the host sees every word as is.
  * ``device``: the pool in device memory (``DevicePool``), exported as a dma-buf for a NIC
    (``register_for_rdma``): the NIC lane, where token data should never cross host memory.
Either way the layout is the one of ``edgepath_slot.h``, and the hand-off to the model side is a ring
in mapped host memory.  Nothing here imports cupy until a GPU is asked for, so the base install (no
cupy) imports this module fine and gets a clear :class:`GpuUnavailable` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from edgepath.dma.pool import SlotPool
from edgepath.native.abi import ffi, lib
from edgepath.native.cuda_build import CudaBuildError, build_poller

log = logging.getLogger("edgepath.gpu")

# ctrl words (edgepath_poller.cu's EP_CTRL_*).
CTRL_STOP, CTRL_RUNNING, CTRL_ACCEPTED, CTRL_REJECTED, CTRL_EXPIRED, CTRL_LOST, CTRL_LOOPS = range(7)
CTRL_WORDS = 8
_CTRL_NAMES = ("accepted", "rejected", "expired", "lost")

# cudaHostRegister flags (cuda_runtime_api.h; cupy names the cudaHostAlloc ones only).
_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2


class GpuUnavailable(RuntimeError):
    """No usable GPU (cupy missing, no device, a driver too old, memory that cannot be mapped)."""


class RdmaRegistrationError(RuntimeError):
    """GPU memory that cannot be registered with the NIC by dma-buf nor by nvidia-peermem."""


def load_cupy() -> ModuleType:
    """cupy, with modules loaded eagerly: a lazily loaded kernel can deadlock behind the persistent one."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    try:
        import cupy
    except ImportError as exc:
        raise GpuUnavailable(
            f"--slots gpu: cupy is not installed ({exc}); install edgepath[gpu] on a CUDA machine, or use --slots host"
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


def require_device(index: int = 0) -> DeviceInfo:
    """The CUDA device ``index``, or :class:`GpuUnavailable` saying why there is none."""
    cp = load_cupy()
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # cupy raises CUDARuntimeError, or a loader error when there is no driver at all
        raise GpuUnavailable(f"--slots gpu: no CUDA device found (cupy: {exc}); use --slots host") from exc
    if not 0 <= index < count:
        raise GpuUnavailable(f"--slots gpu: no CUDA device {index} (found {count}); use --slots host")
    rt = cp.cuda.runtime
    props = rt.getDeviceProperties(index)
    if not rt.deviceGetAttribute(rt.cudaDevAttrCanMapHostMemory, index):
        raise GpuUnavailable(f"--slots gpu: device {index} cannot map host memory; use --slots host")
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
            self._cp.cuda.runtime.freeHost(self.host)
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
            cp.cuda.runtime.hostUnregister(buf.ctypes.data)
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
    ) -> None:
        cp = load_cupy()
        self._cp = cp
        self.device = device
        self.slot_count = slot_count
        self.pool_address = pool_address
        self.min_sleep_ns, self.max_sleep_ns = min_sleep_ns, max_sleep_ns
        try:
            fatbin = build_poller((device.compute_capability,))
        except CudaBuildError as exc:
            raise GpuUnavailable(f"--slots gpu: {exc}") from exc
        cp.cuda.Device(device.index).use()
        module = cp.RawModule(path=str(fatbin))
        # get_function loads the module now, before the persistent kernel occupies the GPU.
        self._kernel = module.get_function("ep_gpu_poller")
        self.ring_capacity = 1 << max(6, (slot_count - 1).bit_length())  # >= slots: the ring cannot overrun
        self._ctrl = _Pinned(cp, 8 * CTRL_WORDS)
        self._expire = _Pinned(cp, 8 * slot_count)
        self._ring = _Pinned(cp, 16 * self.ring_capacity)
        self._seen = cp.zeros(slot_count, dtype=cp.uint64)
        self._tail = cp.zeros(1, dtype=cp.uint64)
        self._head = 0
        self._stream = cp.cuda.Stream(non_blocking=True)
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
        deadline = time.monotonic() + timeout
        while self._ctrl_word(CTRL_RUNNING) != 1:
            if self._stream.done:
                self._stream.synchronize()  # raises the launch error, if any
                raise GpuUnavailable("--slots gpu: the poller kernel exited at once")
            if time.monotonic() > deadline:
                raise GpuUnavailable(f"--slots gpu: the poller kernel did not start within {timeout:.0f} s")
            time.sleep(0.001)

    def stop(self, timeout: float = 5.0) -> None:
        """Set the stop flag (mapped memory: no copy queued behind the running kernel) and wait for it."""
        if not self._launched:
            return
        lib.ep_store64(self._ctrl.ptr + CTRL_STOP, 1)
        deadline = time.monotonic() + timeout
        while not self._stream.done:
            if time.monotonic() > deadline:
                raise RuntimeError(f"GPU poller did not stop within {timeout:.0f} s")
            time.sleep(0.001)
        self._stream.synchronize()
        self._launched = False

    def close(self) -> None:
        self.stop()
        for block in (self._ring, self._expire, self._ctrl):
            block.close()
        if self._unmap is not None:
            self._cp.cuda.runtime.hostUnregister(self._unmap)
            self._unmap = None

    # -- host end ------------------------------------------------------------------
    def _ctrl_word(self, which: int) -> int:
        return int(lib.ep_load64(self._ctrl.ptr + which))

    def poll(self, max_entries: int = 256) -> list[tuple[int, int]]:
        """Slots the kernel moved to RUNNING since the last call: (slot, generation), in hand-off order."""
        out = []
        ring = self._ring.ptr
        mask = self.ring_capacity - 1
        while len(out) < max_entries:
            i = 2 * (self._head & mask)
            if lib.ep_load64(ring + i) != self._head + 1:
                break
            value = int(lib.ep_load64(ring + i + 1))
            out.append((value & 0xFFFF, value >> 32))
            self._head += 1
        return out

    def request_expire(self, slot: int, word: int) -> None:
        """Ask the kernel (the only writer of CLAIMED words) to expire ``slot`` if it still holds ``word``."""
        lib.ep_store64(self._expire.ptr + slot, word)

    def expire_pending(self, slot: int) -> bool:
        return lib.ep_load64(self._expire.ptr + slot) != 0

    def counters(self) -> dict[str, int]:
        return {name: self._ctrl_word(CTRL_ACCEPTED + i) for i, name in enumerate(_CTRL_NAMES)}

    @property
    def running(self) -> bool:
        return self._launched and not self._stream.done


class DevicePool:
    """A slot pool in device memory (the NIC lane): same layout, initialised on the host and copied in.

    Allocated with cudaMalloc on its own, rounded up to 2 MiB, so the host-page-aligned range a dma-buf
    export needs lies inside it (a block from cupy's memory pool could share pages with other arrays).
    """

    ALIGN = 2 << 20

    def __init__(self, cp: ModuleType, slot_count: int, input_capacity: int, output_capacity: int, lease_ns: int):
        dims = SlotPool.layout_for(slot_count, input_capacity, output_capacity)
        staging = np.zeros(int(dims["total_size"]), dtype=np.uint8)
        self.header = SlotPool.create(staging, slot_count, input_capacity, output_capacity, lease_ns, 0)
        self._cp = cp
        self.nbytes = int(staging.nbytes)
        rt = cp.cuda.runtime
        self.address = int(rt.malloc(-(-self.nbytes // self.ALIGN) * self.ALIGN))
        rt.memcpy(self.address, staging.ctypes.data, self.nbytes, rt.memcpyHostToDevice)

    def close(self) -> None:
        if self.address:
            self._cp.cuda.runtime.free(self.address)
            self.address = 0


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
