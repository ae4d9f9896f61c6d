"""A host twin of the CUDA poller, for running the GPU code paths on a machine without a GPU.

``edgepath_poller.h`` (the kernel's per-slot pass, ring hand-off included) is compiled with gcc and
C11 atomics (``bench/gpu_host.c``, the same C ``gpu_check --dry-run`` runs) and run on a CPU thread;
:class:`FakeCupy` stands in for the few cupy calls
``edgepath.slots.gpu`` makes (mapped host memory, a stream, a module, a launch), so ``GpuPoller``, the
slot server's ``--slots gpu`` loop and the device-memory pool (``DeviceSlots``) run unchanged on top;
:class:`TwinNicTransport` lets agents write that "device memory" as a NIC would, so a ``--slots
gpu-device`` slot server runs unchanged too.
The stand-in also keeps two GPU behaviours that have bitten: work queued on a stream (``cp.zeros``'
memset) is done only when that stream's later work runs or the device synchronises, and a device-wide
synchronisation or a free (cudaDeviceSynchronize, cudaFree, cudaFreeHost, cudaHostUnregister) waits for
every running kernel, which for a persistent poller is forever: here it raises :class:`TwinWouldHang`.
What this cannot show: device atomics and ordering over PCIe, the real launch, timing. The ``gpu``
marker's runs on a GPU are for those.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import subprocess
import threading
import time
import types
from pathlib import Path
from typing import Any

import cffi
import numpy as np

from edgepath.peer_secret import peer_keys
from edgepath.transports.base import Access
from edgepath.transports.loopback import LoopbackRegion, LoopbackTransport, _Mapping, sealed_memfd

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "native"
HOST_SOURCE = ROOT / "bench" / "gpu_host.c"  # the twin's C: edgepath_poller.h with C11 atomics

_CDEF = """void ep_twin_poller(char *pool, uint64_t *seen, uint64_t *expire_req, uint64_t *ring, uint32_t ring_capacity,
                    uint64_t *ring_tail, uint64_t *ctrl);"""

STALE = 0x5EE5_5EE5_5EE5_5EE5  # what a reused device block holds until the zeroing work has run


class TwinWouldHang(AssertionError):
    """A call that on a GPU waits for every running kernel (a persistent poller: forever)."""


def build_twin(out_dir: Path) -> Any:
    """gcc-compile the twin (bench/gpu_host.c, the kernel's per-slot pass) into a shared library and
    open it (cffi ABI mode)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found: cannot build the poller's host twin")
    lib_path = out_dir / "libeptwin.so"
    cmd = [gcc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{NATIVE}"]
    subprocess.run([*cmd, str(HOST_SOURCE), str(NATIVE / "edgepath_core.c"), "-o", str(lib_path)], check=True)
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    return ffi, ffi.dlopen(str(lib_path))


def _address(arg: Any) -> int:
    if isinstance(arg, np.ndarray):
        return arg.ctypes.data
    return int(arg)


class _Stream:
    """A stream: the work queued on it (zeroing) and at most one kernel, a CPU thread."""

    current: _Stream | None = None

    def __init__(self, non_blocking: bool = False) -> None:
        self.thread: threading.Thread | None = None
        self.ptr = id(self)
        self.pending: list[np.ndarray] = []

    def __enter__(self) -> _Stream:
        _Stream.current = self
        return self

    def __exit__(self, *exc: object) -> None:
        _Stream.current = None

    @property
    def done(self) -> bool:
        return self.thread is None or not self.thread.is_alive()

    def synchronize(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def run_pending(self) -> None:
        """Work queued on this stream before a launch on it runs first (stream order)."""
        for array in self.pending:
            array[:] = 0
        self.pending.clear()


class _Store:
    """ep_gpu_store: one release store of a u64 (here at once; the real one runs on the stream)."""

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
        from edgepath.native.abi import ffi, lib

        address, value = args
        lib.ep_store64(ffi.cast("uint64_t *", int(address)), int(value))


class _Kernel:
    def __init__(self, twin: Any, fake: FakeCupy) -> None:
        self._ffi, self._lib = twin
        self._fake = fake

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
        pool, seen, expire, ring, capacity, tail, ctrl, _min_sleep, _max_sleep = args
        stream = _Stream.current
        assert stream is not None, "the poller must be launched on its own stream"
        stream.run_pending()
        ptr = self._ffi.cast
        call_args = (
            ptr("char *", _address(pool)),
            ptr("uint64_t *", _address(seen)),
            ptr("uint64_t *", _address(expire)),
            ptr("uint64_t *", _address(ring)),
            int(capacity),
            ptr("uint64_t *", _address(tail)),
            ptr("uint64_t *", _address(ctrl)),
        )
        stream.thread = threading.Thread(target=self._lib.ep_twin_poller, args=call_args, daemon=True)
        stream.thread.start()
        self._fake.launched.append(stream)


class FakeCupy(types.ModuleType):
    """The cupy surface edgepath.slots.gpu uses, backed by host memory and the twin."""

    uint64 = np.uint64
    int32 = np.int32

    def __init__(self, twin: Any, rdma_writes_ordering: int = 100) -> None:
        """``rdma_writes_ordering``: what the device reports for GPUDirect RDMA write ordering; 100
        ("owner") by default, which the twin has: its NIC's writes are CPU stores, seen in order."""
        super().__init__("cupy")
        self._twin = twin
        self._blocks: dict[int, Any] = {}
        self.registered: dict[int, int] = {}
        self.device_blocks: dict[int, Any] = {}
        self.pending_zeros: list[np.ndarray] = []  # queued on any stream: a device synchronisation runs them
        self.launched: list[_Stream] = []
        ffi = cffi.FFI()
        fake = self

        def no_kernel_running(call: str) -> None:
            running = [s for s in fake.launched if not s.done]
            if running:
                raise TwinWouldHang(
                    f"{call} while {len(running)} poller kernel(s) run: on a GPU it waits for them, forever"
                )

        class Runtime:
            @staticmethod
            def getDeviceCount() -> int:
                return 1

            @staticmethod
            def getDeviceProperties(index: int) -> dict[str, Any]:
                return {"name": b"host twin", "major": 9, "minor": 0}

            cudaDevAttrCanMapHostMemory = 19
            cudaDevAttrHostNativeAtomicSupported = 86
            cudaDevAttrGPUDirectRDMASupported = 116
            cudaDevAttrGPUDirectRDMAWritesOrdering = 118
            hostAllocPortable = 1
            hostAllocMapped = 2
            memcpyHostToDevice = 1
            memcpyDeviceToHost = 2

            @staticmethod
            def malloc(nbytes: int) -> int:
                """'Device' memory: a memfd mapped here, touched only by the twin kernel, the copies and
                the twin NIC (:class:`TwinNicTransport`, which hands the memfd to agents as a NIC
                registration of device memory would let them write it)."""
                fd = sealed_memfd("twin-device", nbytes)  # as every loopback region: agents map only sealed memory
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
                view = ffi.from_buffer(mm)
                address = int(ffi.cast("uintptr_t", view))
                fake.device_blocks[address] = (fd, mm, view)
                return address

            @staticmethod
            def free(address: int) -> None:
                no_kernel_running("cudaFree")
                fd, mm, view = fake.device_blocks.pop(address)
                del view
                with contextlib.suppress(BufferError):  # a twin NIC region may still map it
                    mm.close()
                os.close(fd)

            @staticmethod
            def memcpy(dst: int, src: int, nbytes: int, kind: int) -> None:
                ffi.memmove(ffi.cast("char *", dst), ffi.cast("char *", src), nbytes)

            @staticmethod
            def memcpyAsync(dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
                ffi.memmove(ffi.cast("char *", dst), ffi.cast("char *", src), nbytes)

            @staticmethod
            def deviceSynchronize() -> None:
                """Every stream's queued work (cp.zeros) is done now; it waits for running kernels too."""
                no_kernel_running("cudaDeviceSynchronize")
                for array in fake.pending_zeros:
                    array[:] = 0
                fake.pending_zeros.clear()

            @staticmethod
            def deviceGetAttribute(attr: int, index: int) -> int:
                return {19: 1, 118: rdma_writes_ordering}.get(attr, 0)

            @staticmethod
            def hostAlloc(nbytes: int, flags: int) -> int:
                block = ffi.new("char[]", nbytes)
                address = int(ffi.cast("uintptr_t", block))
                fake._blocks[address] = block
                return address

            @staticmethod
            def freeHost(address: int) -> None:
                no_kernel_running("cudaFreeHost")
                del fake._blocks[address]

            @staticmethod
            def pointerGetAttributes(address: int) -> Any:
                return types.SimpleNamespace(devicePointer=address, hostPointer=address)

            @staticmethod
            def hostRegister(address: int, nbytes: int, flags: int) -> None:
                fake.registered[address] = nbytes

            @staticmethod
            def hostUnregister(address: int) -> None:
                no_kernel_running("cudaHostUnregister")
                del fake.registered[address]

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def use(self) -> None:
                pass

        class Module:
            def __init__(self, path: str) -> None:
                self.path = path

            def get_function(self, name: str) -> Any:
                kernels = {"ep_gpu_poller": lambda: _Kernel(fake._twin, fake), "ep_gpu_store": _Store}
                if name not in kernels:
                    raise AttributeError(f"the twin has no kernel {name!r}")
                return kernels[name]()

        self.cuda = types.SimpleNamespace(runtime=Runtime, Device=Device, Stream=_Stream)
        self.RawModule = lambda path: Module(path)

    def zeros(self, n: int, dtype: Any) -> np.ndarray:
        """Like cupy's: zeroed by work queued on the current stream (the legacy one outside ``with
        stream``), so until that stream's next launch or a device synchronisation the block holds what
        it held before (a reused pool block: stale values)."""
        array = np.full(n, STALE, dtype=dtype)
        if _Stream.current is not None:
            _Stream.current.pending.append(array)
        self.pending_zeros.append(array)
        return array


class TwinNicTransport(LoopbackTransport):
    """The loopback transport plus the one capability ``--slots gpu-device`` needs of the verbs one:
    ``register_device``, which here hands agents the twin's "device memory" (a memfd) as a NIC
    registration of HBM would (VerbsTransport.register_device: dma-buf, else nvidia-peermem).  Agents
    then claim, write and ring in that memory with their usual loopback CAS and stores, as a NIC's
    atomics and WRITEs land in HBM; the slot server reads it only through DeviceSlots' copies."""

    name = "twin-nic"

    def __init__(self, cupy: FakeCupy) -> None:
        super().__init__(peer_keys(None))
        self._cupy = cupy

    def register_device(
        self, name: str, memory: Any, access: Access, offset: int = 0, length: int | None = None
    ) -> LoopbackRegion:
        fd, _mm, _view = self._cupy.device_blocks[memory.address]
        length = int(memory.nbytes) - offset if length is None else length
        region = _DeviceRegion(name, fd, length, access, offset)
        self._regions.append(region)
        return region


class _DeviceRegion(LoopbackRegion):
    """A loopback region over ``length`` bytes from ``offset`` of memory someone else allocated (the twin's device
    memfd)."""

    def __init__(self, name: str, fd: int, length: int, access: Access, offset: int = 0) -> None:
        mapping = _Mapping(fd, length, offset=offset)
        super().__init__(name, mapping.array, access, os.dup(fd), offset)
        self._map = mapping


class LocalWriter:
    """Plays the agent on a pool in this process's memory: CAS claim, request write, doorbell last."""

    def __init__(self, pool: Any, claimant: int = 1) -> None:
        from edgepath.native.abi import ffi

        self.pool = pool
        self.claimant = claimant
        self._states = ffi.cast("uint64_t *", ffi.from_buffer(pool.states))
        self._doorbells = ffi.cast("uint64_t *", ffi.from_buffer(pool.doorbells))

    def claim(self, slot: int) -> int:
        """FREE -> CLAIMED by CAS (claimers own FREE words); the generation claimed."""
        from edgepath.contract.wire import claim_word
        from edgepath.native.abi import lib

        cur = self.pool.word(slot)
        new = claim_word(cur, self.claimant)
        if lib.ep_cas64(self._states + slot, cur, new) != cur:
            raise AssertionError(f"slot {slot} changed under the claim")
        return new >> 32

    def write(self, slot: int, generation: int, tokens: Any, request_id: int = 0) -> None:
        req = self.pool.slots.requests[slot]
        n = len(tokens)
        self.pool.slots.tokens[slot, :n] = tokens
        req["request_id"] = request_id
        req["token_count"] = n
        req["max_new_tokens"] = n
        req["generation"] = generation

    def ring(self, slot: int, generation: int, value: int | None = None) -> None:
        """Store the doorbell word last, with release (the loopback NIC's WRITE of it)."""
        from edgepath.contract.wire import doorbell_word
        from edgepath.native.abi import lib

        lib.ep_store64(self._doorbells + slot, doorbell_word(slot, generation) if value is None else value)

    def finish(self, slot: int, generation: int) -> None:
        """RUNNING -> DONE -> FREE, as the model side does after the handler."""
        from edgepath.native.abi import Event, ffi, lib

        for event in (Event.COMPLETE, Event.RELEASE):
            if lib.ep_apply(self._states + slot, event, generation, 0, ffi.NULL) != lib.EP_OK:
                raise AssertionError(f"slot {slot}: {event.name} refused on {self.pool.word(slot):#x}")


def wait_handoff(poller: Any, timeout: float = 1.0) -> tuple[int, int]:
    """The next (slot, generation) the poller hands over, or AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = poller.poll(1)
        if got:
            return got[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no hand-off from the GPU poller within {timeout} s (counters {poller.counters()})")
