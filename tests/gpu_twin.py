"""A host twin of the CUDA poller, for running the GPU code paths on a machine without a GPU.

``edgepath_poller.h`` (the kernel's per-slot pass, ring hand-off included) is compiled with gcc and
C11 atomics and run on a CPU thread; :class:`FakeCupy` stands in for the few cupy calls
``edgepath.dma.gpu`` makes (mapped host memory, a stream, a module, a launch), so ``GpuPoller``, the
slot server's ``--slots gpu`` loop and ``bench/gpu_check.py``'s measurements run unchanged on top.
What this cannot show: device atomics and ordering over PCIe, the real launch, timing. The ``gpu``
marker's runs on a GPU are for those.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import types
from pathlib import Path
from typing import Any

import cffi
import numpy as np

NATIVE = Path(__file__).resolve().parent.parent / "native"

_SOURCE = r"""
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#define A64(p) ((_Atomic uint64_t *)(p))
static inline uint64_t ep_ld_acq(uint64_t *p) { return atomic_load_explicit(A64(p), memory_order_acquire); }
static inline uint64_t ep_ld_rlx(uint64_t *p) { return atomic_load_explicit(A64(p), memory_order_relaxed); }
static inline uint32_t ep_ld_rlx32(uint32_t *p)
{
    return atomic_load_explicit((_Atomic uint32_t *)p, memory_order_relaxed);
}
static inline void ep_fence_acq(void) { atomic_thread_fence(memory_order_acquire); }
static inline void ep_st_rel(uint64_t *p, uint64_t v) { atomic_store_explicit(A64(p), v, memory_order_release); }
static inline void ep_st_rlx(uint64_t *p, uint64_t v) { atomic_store_explicit(A64(p), v, memory_order_relaxed); }
static inline uint64_t ep_add(uint64_t *p, uint64_t v)
{
    return atomic_fetch_add_explicit(A64(p), v, memory_order_relaxed);
}
static inline int ep_cas(uint64_t *p, uint64_t e, uint64_t d)
{
    return atomic_compare_exchange_strong_explicit(A64(p), &e, d, memory_order_acq_rel, memory_order_acquire);
}
#define EP_PFN static inline
#include "edgepath_poller.h"

/* ep_gpu_poller's loop with one thread doing every slot, and sched_yield for __nanosleep. */
void ep_twin_poller(char *pool, uint64_t *seen, uint64_t *expire_req, uint64_t *ring, uint32_t ring_capacity,
                    uint64_t *ring_tail, uint64_t *ctrl)
{
    const struct ep_pool_header *h = (const struct ep_pool_header *)pool;
    ep_st_rel(&ctrl[EP_CTRL_RUNNING], 1u);
    while (!ep_ld_acq(&ctrl[EP_CTRL_STOP])) {
        int worked = 0;
        for (uint32_t slot = 0; slot < h->slot_count; slot++)
            worked |= ep_poller_slot(pool, h, slot, seen, expire_req, ring, ring_capacity - 1u, ring_tail, ctrl);
        if (!worked)
            sched_yield();
    }
    ep_st_rel(&ctrl[EP_CTRL_RUNNING], 2u);
}
"""
_CDEF = """void ep_twin_poller(char *pool, uint64_t *seen, uint64_t *expire_req, uint64_t *ring, uint32_t ring_capacity,
                    uint64_t *ring_tail, uint64_t *ctrl);"""


def build_twin(out_dir: Path) -> Any:
    """gcc-compile the twin into a shared library and open it (cffi ABI mode)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found: cannot build the poller's host twin")
    src = out_dir / "twin.c"
    lib_path = out_dir / "libeptwin.so"
    src.write_text(_SOURCE)
    cmd = [gcc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{NATIVE}"]
    subprocess.run([*cmd, str(src), "-o", str(lib_path)], check=True)
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    return ffi, ffi.dlopen(str(lib_path))


def _address(arg: Any) -> int:
    if isinstance(arg, np.ndarray):
        return arg.ctypes.data
    return int(arg)


class _Stream:
    current: _Stream | None = None

    def __init__(self, non_blocking: bool = False) -> None:
        self.thread: threading.Thread | None = None

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


class _Kernel:
    def __init__(self, twin: Any) -> None:
        self._ffi, self._lib = twin

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
        pool, seen, expire, ring, capacity, tail, ctrl, _min_sleep, _max_sleep = args
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
        stream = _Stream.current
        assert stream is not None, "the poller must be launched on its own stream"
        stream.thread = threading.Thread(target=self._lib.ep_twin_poller, args=call_args, daemon=True)
        stream.thread.start()


class FakeCupy(types.ModuleType):
    """The cupy surface edgepath.dma.gpu uses, backed by host memory and the twin."""

    uint64 = np.uint64
    int32 = np.int32

    def __init__(self, twin: Any) -> None:
        super().__init__("cupy")
        self._twin = twin
        self._blocks: dict[int, Any] = {}
        self.registered: dict[int, int] = {}
        ffi = cffi.FFI()
        fake = self

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

            @staticmethod
            def deviceGetAttribute(attr: int, index: int) -> int:
                return 1 if attr == 19 else 0

            @staticmethod
            def hostAlloc(nbytes: int, flags: int) -> int:
                block = ffi.new("char[]", nbytes)
                address = int(ffi.cast("uintptr_t", block))
                fake._blocks[address] = block
                return address

            @staticmethod
            def freeHost(address: int) -> None:
                del fake._blocks[address]

            @staticmethod
            def pointerGetAttributes(address: int) -> Any:
                return types.SimpleNamespace(devicePointer=address, hostPointer=address)

            @staticmethod
            def hostRegister(address: int, nbytes: int, flags: int) -> None:
                fake.registered[address] = nbytes

            @staticmethod
            def hostUnregister(address: int) -> None:
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
                return _Kernel(fake._twin) if name == "ep_gpu_poller" else None

        self.cuda = types.SimpleNamespace(runtime=Runtime, Device=Device, Stream=_Stream)
        self.RawModule = lambda path: Module(path)

    @staticmethod
    def zeros(n: int, dtype: Any) -> np.ndarray:
        return np.zeros(n, dtype=dtype)
