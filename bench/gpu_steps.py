"""The steps of bench/gpu_check.py, one per process: ``python bench/gpu_steps.py STEP --json PATH``.

Every step but ``gpu_tests`` and ``echo`` imports only the standard library, numpy and (on a GPU)
cupy and cuda-bindings: the host side is C (bench/gpu_host.c, loaded with ctypes), the kernels come
from the poller's fatbin, and pool offsets come from the C ABI code, never from Python constants.
With ``--dry-run`` a step does everything up to the GPU, then runs its C loop against a CPU thread
playing the kernel (the host twin): the plumbing is exercised, and every figure is labelled
"cpu-twin", never a GPU figure.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-carry"
HOST_LIB_ENV = "EDGEPATH_GPU_HOST_LIB"
LINE = 64
NOT_RUN = "not run: no GPU"
# cudaDeviceAttr numbers (cuda_runtime_api.h): CUDA 13 dropped clockRate and memoryClockRate from
# cudaDeviceProp, and cupy does not name every attribute, so the probe asks by number.
DEVICE_ATTRS = {
    "sm_clock_khz": 13,
    "memory_clock_khz": 36,
    "multiprocessors": 16,
    "can_map_host_memory": 19,
    "pci_bus_id": 33,
    "concurrent_managed_access": 89,
    "pageable_memory_access": 88,
    "host_native_atomic_supported": 86,
    "gpudirect_rdma_supported": 116,
    "gpudirect_rdma_flush_writes_options": 117,
    "gpudirect_rdma_writes_ordering": 118,
}
U64P = ctypes.POINTER(ctypes.c_uint64)


class StepFailed(RuntimeError):
    """A check inside a step failed: the step's result says which."""


def cuda_build() -> ModuleType:
    """native/cuda_build.py, by path: importing edgepath.native would pull in the cffi extension."""
    spec = importlib.util.spec_from_file_location("ep_cuda_build", ROOT / "native" / "cuda_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host_lib_name() -> str:
    """The host library's file name for these sources: a carried one must match it (a stale library
    would time a protocol the kernel no longer speaks)."""
    h = hashlib.sha256()
    native = ROOT / "native"
    for path in [ROOT / "bench" / "gpu_host.c", *sorted(native.glob("*.h")), native / "edgepath_core.c"]:
        h.update(path.read_bytes())
    return f"libgpucheck-{h.hexdigest()[:16]}.so"


def host_lib_build(out: Path) -> Path:
    """gcc: bench/gpu_host.c + native/edgepath_core.c into ``out`` (no Python headers, no cffi)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise StepFailed(f"gcc not found: carry .gpu-carry/{host_lib_name()} (gpu_check.py --prepare)")
    cmd = [gcc, "-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", f"-I{ROOT / 'native'}"]
    cmd += [str(ROOT / "bench" / "gpu_host.c"), str(ROOT / "native" / "edgepath_core.c"), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise StepFailed(f"gcc failed on bench/gpu_host.c: {done.stderr.strip()[-2000:]}")
    return out


def host_lib() -> ctypes.CDLL:
    """The check's C host side: ``$EDGEPATH_GPU_HOST_LIB`` (set by gpu_check.py), typed for ctypes."""
    path = os.environ.get(HOST_LIB_ENV)
    if not path or not Path(path).is_file():
        raise StepFailed(f"${HOST_LIB_ENV} does not name the built host library (run through gpu_check.py)")
    lib = ctypes.CDLL(path)
    u32, u64, i64, vp = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
    sigs = {
        "ep_chk_pool_size": (u64, [u32, u32, u32]),
        "ep_chk_pool_create": (ctypes.c_int, [vp, u64, u32, u32, u32, u64]),
        "ep_chk_pool_offsets": (None, [vp, U64P]),
        "ep_chk_claim_word": (u64, [u64, u32]),
        "ep_chk_step": (u64, [u64, ctypes.c_int]),
        "ep_chk_write_request": (u64, [vp, u32, u32, u64, u32]),
        "ep_chk_pingpong": (i64, [vp, vp, u32, vp, u64]),
        "ep_chk_poller_rtt": (i64, [vp, vp, u32, vp, u32, u32, vp, u64, ctypes.c_char_p, ctypes.c_size_t]),
        "ep_chk_increment": (None, [vp, u32]),
        "ep_chk_stop": (i64, [vp, vp, u64]),
        "ep_twin_poller": (None, [vp, vp, vp, vp, u32, vp, vp]),
        "ep_twin_pingpong": (None, [vp, vp, vp]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


def percentiles(samples_ns: np.ndarray) -> dict[str, float]:
    us = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    out: dict[str, float] = {"n": int(us.size)}
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99), ("p999", 99.9)):
        out[f"{name}_us"] = round(float(np.percentile(us, q)), 3)
    out["max_us"] = round(float(us.max()), 3)
    return out


def quiet(core: int | None, dry_run: bool) -> dict[str, Any]:
    """Pin this process to one core and turn the garbage collector off for the timed loops (not in a
    dry run: there the twin's thread needs a core of its own)."""
    gc.disable()
    if dry_run:
        return {"pinned_core": None, "gc": "off"}
    cores = sorted(os.sched_getaffinity(0))
    pin = core if core is not None else cores[-1]
    os.sched_setaffinity(0, {pin})
    return {"pinned_core": pin, "gc": "off"}


# -- memory and kernels: the GPU, or the twin (host memory and CPU threads) ----------------------------


class Gpu:
    """What the steps need from cupy: pinned mapped memory, device memory, copies, launches."""

    twin = False

    def __init__(self, load_module: bool = True) -> None:
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"  # before cupy initialises CUDA
        import cupy

        self.cp = cupy
        self.rt = cupy.cuda.runtime
        if self.rt.getDeviceCount() < 1:
            raise StepFailed("no CUDA device")
        props = self.rt.getDeviceProperties(0)
        self.cc = f"{props['major']}{props['minor']}"
        self.clock_khz = int(self.rt.deviceGetAttribute(DEVICE_ATTRS["sm_clock_khz"], 0))
        self._blocks: list[tuple[str, int]] = []
        if not load_module:
            return
        fatbin = cuda_build().build_poller((self.cc,))
        self.module = cupy.RawModule(path=str(fatbin))
        self.fatbin = fatbin.name
        self.kernels = {
            n: self.module.get_function(n)
            for n in ("ep_gpu_poller", "ep_gpu_store", "ep_check_atomics", "ep_check_cas", "ep_check_pingpong")
        }
        self.side = cupy.cuda.Stream(non_blocking=True)

    def pinned(self, nbytes: int) -> tuple[int, int]:
        """(host address, device address) of zeroed page-locked host memory mapped into the GPU."""
        host = self.rt.hostAlloc(nbytes, self.rt.hostAllocMapped | self.rt.hostAllocPortable)
        self._blocks.append(("host", host))
        ctypes.memset(host, 0, nbytes)
        return host, int(self.rt.pointerGetAttributes(host).devicePointer)

    def device(self, nbytes: int) -> int:
        address = int(self.rt.malloc(nbytes))
        self._blocks.append(("device", address))
        return address

    def zeros(self, nbytes: int) -> int:
        address = self.device(nbytes)
        self.rt.memset(address, 0, nbytes)
        self.rt.deviceSynchronize()  # the memset is on the legacy stream; the kernel will not wait for it
        return address

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool) -> None:
        kind = self.rt.memcpyHostToDevice if to_device else self.rt.memcpyDeviceToHost
        self.rt.memcpyAsync(dst, src, nbytes, kind, self.side.ptr)
        self.side.synchronize()

    def store(self, address: int, value: int) -> None:
        with self.side:
            self.kernels["ep_gpu_store"]((1,), (1,), (np.uint64(address), np.uint64(value)))
        self.side.synchronize()

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> Any:
        """Launch on a fresh non-blocking stream; the stream (``.done``, ``.synchronize()``)."""
        stream = self.cp.cuda.Stream(non_blocking=True)
        with stream:
            self.kernels[name]((grid,), (block,), tuple(np.uint64(a) if isinstance(a, int) else a for a in args))
        return stream

    def close(self) -> None:
        for kind, address in reversed(self._blocks):
            (self.rt.freeHost if kind == "host" else self.rt.free)(address)
        self._blocks.clear()


class _Thread:
    """A twin 'launch': a CPU thread, with the stream's done/synchronize."""

    def __init__(self, target: Any, args: tuple[Any, ...]) -> None:
        self._t = threading.Thread(target=target, args=args, daemon=True)
        self._t.start()

    @property
    def done(self) -> bool:
        return not self._t.is_alive()

    def synchronize(self) -> None:
        self._t.join()


class Twin:
    """The same surface over host memory and the C twins (gpu_host.c): the dry run's stand-in."""

    twin = True
    cc = "twin"
    clock_khz = 1_000_000  # the twin's ep_clock() is CLOCK_MONOTONIC ns: "cycles" of 1 GHz
    fatbin = None

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self._keep: list[Any] = []

    def pinned(self, nbytes: int) -> tuple[int, int]:
        block = (ctypes.c_uint64 * (-(-nbytes // 8)))()
        self._keep.append(block)
        return ctypes.addressof(block), ctypes.addressof(block)

    def device(self, nbytes: int) -> int:
        return self.pinned(nbytes)[0]

    zeros = device

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool) -> None:
        ctypes.memmove(dst, src, nbytes)

    def store(self, address: int, value: int) -> None:
        ctypes.c_uint64.from_address(address).value = value

    def launch(self, name: str, grid: int, block: int, args: tuple[Any, ...]) -> _Thread:
        if name == "ep_gpu_poller":
            pool, seen, expire, ring, capacity, tail, ctrl, _lo, _hi = args
            return _Thread(self.lib.ep_twin_poller, (pool, seen, expire, ring, capacity, tail, ctrl))
        if name == "ep_check_pingpong":
            return _Thread(self.lib.ep_twin_pingpong, args)
        raise StepFailed(f"the twin has no {name}")

    def close(self) -> None:
        self._keep.clear()


def u64(address: int) -> int:
    return ctypes.c_uint64.from_address(address).value


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise StepFailed(f"{what}: not within {timeout} s")
        time.sleep(0.0005)


# -- steps ----------------------------------------------------------------------------------------------


def step_probe(args: argparse.Namespace) -> dict[str, Any]:
    """Driver, clocks, PCIe link (nvidia-smi) and the device attributes the design depends on."""
    out: dict[str, Any] = {"CUDA_MODULE_LOADING(env)": os.environ.get("CUDA_MODULE_LOADING")}
    smi = shutil.which("nvidia-smi")
    fields = (
        "name,driver_version,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
        "pcie.link.width.max,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,persistence_mode,"
        "compute_mode,temperature.gpu,power.draw"
    )
    if smi is None:
        out["nvidia_smi"] = "not found"
    else:
        done = subprocess.run(
            [smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
        values = [v.strip() for v in done.stdout.strip().splitlines()[0].split(",")] if done.returncode == 0 else []
        out["nvidia_smi"] = dict(zip(fields.split(","), values, strict=False)) or done.stderr.strip()[-500:]
    if args.dry_run:
        return {**out, "gpu": NOT_RUN}
    try:
        g = Gpu(load_module=False)
    except ImportError as exc:
        return {**out, "gpu": f"{NOT_RUN} (cupy: {exc})"}
    rt = g.rt
    props = rt.getDeviceProperties(0)
    out["device"] = {
        "name": props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"]),
        "compute_capability": g.cc,
        "runtime_version": rt.runtimeGetVersion(),
        "driver_version": rt.driverGetVersion(),
    }
    for name, number in DEVICE_ATTRS.items():
        try:
            out["device"][name] = int(rt.deviceGetAttribute(number, 0))
        except Exception as exc:  # one attribute the driver does not know must not hide the others
            out["device"][name] = f"error: {exc}"
    try:
        from cuda.bindings import driver

        driver.cuInit(0)
        _err, dev = driver.cuDeviceGet(0)
        err, dmabuf = driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev)
        out["device"]["dma_buf_supported"] = int(dmabuf) if int(err) == 0 else f"error {err}"
    except Exception as exc:
        out["device"]["dma_buf_supported"] = f"unknown ({type(exc).__name__}: {exc})"
    out["gpu"] = True
    g.close()
    return out


def step_smoke(args: argparse.Namespace) -> dict[str, Any]:
    """cudaHostRegister of a memfd; exact counts from system-scope atomics; GPU CAS on word 0 while a CPU
    thread increments word 1 (same line) without a lost update."""
    import mmap

    lib = host_lib()
    size = 1 << 16
    fd = os.memfd_create("edgepath-gpu-smoke")
    try:
        os.ftruncate(fd, size)
        mem = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    buf = np.frombuffer(mem, dtype=np.uint64)
    host = buf.ctypes.data
    out: dict[str, Any] = {"memfd_bytes": size}
    n = 100_000
    if args.dry_run:
        lib.ep_chk_increment(host + 8, n)
        out["cpu_increments"] = {"expected": n, "got": int(buf[1])}
        del buf
        mem.close()
        return {**out, "gpu": NOT_RUN}
    g = Gpu()
    rt = g.rt
    try:
        rt.hostRegister(host, size, 2 | 1)  # cudaHostRegisterMapped | Portable
        dev = int(rt.pointerGetAttributes(host).devicePointer)
        out["host_register"] = "ok"
        threads, per = 256, 1000
        g.launch("ep_check_atomics", 4, threads, (dev + 128, np.uint32(per))).synchronize()
        out["atomics"] = {"expected": 4 * threads * per, "got": int(buf[16])}
        stream = g.launch("ep_check_cas", 1, 32, (dev, np.uint32(n)))
        lib.ep_chk_increment(host + 8, n)
        stream.synchronize()
        out["cas_neighbour"] = {"gpu_cas_word0": int(buf[0]), "cpu_add_word1": int(buf[1]), "expected_each": n}
        rt.hostUnregister(host)
    finally:
        g.close()
        del buf
        mem.close()
    ok = out["atomics"]["got"] == out["atomics"]["expected"] and buf_ok(out["cas_neighbour"], n)
    if not ok:
        raise StepFailed(f"lost updates: {out}")
    return out


def buf_ok(cas: dict[str, int], n: int) -> bool:
    return cas["gpu_cas_word0"] == n and cas["cpu_add_word1"] == n


def step_baseline(args: argparse.Namespace) -> dict[str, Any]:
    """GPU polls a pinned word and echoes it; the host loop (C) stores, spins, times: a round trip."""
    lib = host_lib()
    g: Any = Twin(lib) if args.dry_run else Gpu()
    try:
        host, dev = g.pinned(3 * LINE)  # ping, pong, stop: one line each
        out: dict[str, Any] = {"quiet": quiet(args.core, args.dry_run)}
        stream = g.launch("ep_check_pingpong", 1, 32, (dev, dev + LINE, dev + 2 * LINE))
        n = args.iterations
        samples = np.zeros(n + 1000, dtype=np.uint64)
        got = lib.ep_chk_pingpong(host, host + LINE, n + 1000, samples.ctypes.data, 10**9)
        stop_ns = lib.ep_chk_stop(host + 2 * LINE, host + 2 * LINE, 5 * 10**9)
        stream.synchronize()
        if got != n + 1000:
            raise StepFailed(f"ping-pong round trip {-got} did not come back within 1 s")
        if stop_ns < 0:
            raise StepFailed("the ping-pong kernel did not answer its stop flag within 5 s")
        out["round_trip"] = percentiles(samples[1000:])
        out["stop_latency_us"] = round(stop_ns / 1000, 1)
        out["what"] = (
            "round trip: host store -> GPU thread sees it (system-scope load over PCIe) -> GPU store -> host "
            "sees it; timed in C, first 1000 dropped; stop latency: host sets the flag -> kernel's answer seen"
        )
        return {**out, "gpu": NOT_RUN + " (cpu-twin figures: a CPU thread echoes)"} if args.dry_run else out
    finally:
        g.close()


def _pool(lib: ctypes.CDLL, g: Any, slots: int, tokens: int, device_memory: bool) -> dict[str, Any]:
    size = lib.ep_chk_pool_size(slots, tokens, tokens)
    if size == 0:
        raise StepFailed(f"invalid pool dimensions {slots} slots x {tokens} tokens")
    host, dev = g.pinned(size)
    if lib.ep_chk_pool_create(host, size, slots, tokens, tokens, 10**12) != 0:
        raise StepFailed("ep_pool_init refused the pool")
    offsets = (ctypes.c_uint64 * 6)()
    lib.ep_chk_pool_offsets(host, offsets)
    names = ("states", "doorbells", "slots", "stride", "result", "request_header")
    pool = {"host": host, "dev": dev, "size": size, **dict(zip(names, map(int, offsets), strict=True))}
    if device_memory:
        pool["dev"] = g.device(-(-size // (2 << 20)) * (2 << 20))
        g.copy(pool["dev"], host, size, to_device=True)
    return pool


class Poller:
    """ep_gpu_poller over a pool: its private words, the ring and ctrl (offsets from edgepath_poller.h)."""

    def __init__(self, g: Any, pool_dev: int, slots: int, min_sleep_ns: int, max_sleep_ns: int) -> None:
        self.ctrl_words = cuda_build().ctrl_words()
        self.g = g
        self.capacity = 1 << max(6, (slots - 1).bit_length())
        self.ctrl, ctrl_dev = g.pinned(8 * self.ctrl_words["WORDS"])
        self.ring, ring_dev = g.pinned(16 * self.capacity)
        _expire, expire_dev = g.pinned(8 * slots)
        seen, tail = g.zeros(8 * slots), g.zeros(8)
        self.head = ctypes.c_uint64(0)
        args = (pool_dev, seen, expire_dev, ring_dev, np.uint32(self.capacity), tail, ctrl_dev)
        threads = min(1024, max(32, (slots + 31) // 32 * 32))  # as edgepath.dma.gpu.GpuPoller launches it
        self.stream = g.launch("ep_gpu_poller", 1, threads, (*args, np.uint32(min_sleep_ns), np.uint32(max_sleep_ns)))
        wait_until(lambda: self.word("RUNNING") == 1, 10, "poller start")

    def word(self, name: str) -> int:
        return u64(self.ctrl + 8 * self.ctrl_words[name])

    def stop(self, lib: ctypes.CDLL) -> int:
        """Set STOP, C-timed until the poller says it stopped (ns); then wait for its launch to end."""
        base = self.ctrl
        ns = lib.ep_chk_stop(base + 8 * self.ctrl_words["STOP"], base + 8 * self.ctrl_words["RUNNING"], 5 * 10**9)
        self.stream.synchronize()
        if ns < 0:
            raise StepFailed("the poller did not stop within 5 s")
        return int(ns)

    def counters(self) -> dict[str, int]:
        names = ("ACCEPTED", "REJECTED", "EXPIRED", "LOST", "HANDOFF_CYCLES", "HANDOFF_MAX")
        return {n.lower(): self.word(n) for n in names}


def step_poller_rtt(args: argparse.Namespace) -> dict[str, Any]:
    """The poller's round trip timed in C (claim, write, doorbell, spin on the ring), at back-off 0 and 32."""
    lib = host_lib()
    g: Any = Twin(lib) if args.dry_run else Gpu()
    slots, tokens, warm = 64, 128, 200
    out: dict[str, Any] = {"quiet": quiet(args.core, args.dry_run), "slots": slots, "tokens": tokens}
    try:
        for backoff in (0, 32):
            pool = _pool(lib, g, slots, tokens, device_memory=False)
            poller = Poller(g, pool["dev"], slots, backoff, 256 if backoff else 0)
            n = args.iterations + warm
            samples = np.zeros(2 * n, dtype=np.uint64)
            err = ctypes.create_string_buffer(256)
            got = lib.ep_chk_poller_rtt(
                pool["host"], poller.ring, poller.capacity, ctypes.byref(poller.head), n, tokens,
                samples.ctypes.data, 10**9, err, 256,
            )  # fmt: skip
            stop_ns = poller.stop(lib)
            c = poller.counters()
            if got != n:
                raise StepFailed(f"back-off {backoff}: {err.value.decode()} (counters {c})")
            if c["accepted"] != n or c["lost"] or c["rejected"] or c["expired"]:
                raise StepFailed(f"back-off {backoff}: counters {c} after {n} requests")
            mean_cycles = c["handoff_cycles"] / c["accepted"]
            out[f"backoff_{backoff}ns"] = {
                "doorbell_to_handoff_round_trip": percentiles(samples[2 * warm :: 2]),
                "write_doorbell_to_handoff_round_trip": percentiles(samples[2 * warm + 1 :: 2]),
                "in_kernel_detect_to_publish_one_way": {
                    "mean_cycles": round(mean_cycles, 1),
                    "max_cycles": c["handoff_max"],
                    "mean_ns": round(mean_cycles * 1e6 / g.clock_khz, 1),
                    "max_ns": round(c["handoff_max"] * 1e6 / g.clock_khz, 1),
                },
                "stop_latency_us": round(stop_ns / 1000, 1),
                "counters": c,
                "nothing_lost": True,
            }
        out["what"] = (
            "round trips timed in C on a pinned core, GC off: the host claims, writes the request, stores the "
            "doorbell and spins on the hand-off ring (mapped host memory); in-kernel figures are one-way "
            "(clock64 from the doorbell's detection to the ring entry's publication, SM clock)"
        )
        return (
            {**out, "gpu": NOT_RUN + " (cpu-twin figures: a CPU thread runs the kernel's pass)"}
            if args.dry_run
            else out
        )
    finally:
        g.close()


def ids_match(cp: ModuleType, address: int, tokens: int, request_id: int) -> bool:
    """The model side's read, in place on the device: are the ids at ``address`` the ones
    ep_chk_write_request wrote for ``request_id``?"""
    mem = cp.cuda.UnownedMemory(address, 4 * tokens, None)
    ids = cp.ndarray((tokens,), cp.int32, cp.cuda.MemoryPointer(mem, 0))
    expected = (cp.arange(tokens, dtype=cp.int64) + request_id) & 0x1FFFF
    return bool((ids.astype(cp.int64) == expected).all())


def step_device_pool(args: argparse.Namespace) -> dict[str, Any]:
    """The pool in device memory: claims, requests and doorbells written there (as a NIC would), the
    kernel polling HBM, the tokens checked in place on the device, the model side freeing the slot."""
    lib = host_lib()
    g: Any = Twin(lib) if args.dry_run else Gpu()
    slots, tokens, n = 8, 64, 400
    try:
        pool = _pool(lib, g, slots, tokens, device_memory=True)
        if not g.twin:  # compile and load cupy's kernels now: no module load while the poller runs
            ids_match(g.cp, pool["dev"] + pool["slots"] + pool["request_header"], tokens, 0)
        poller = Poller(g, pool["dev"], slots, 32, 256)
        staging, dev = pool["host"], pool["dev"]
        mask = poller.capacity - 1
        word = ctypes.c_uint64()
        t0 = time.monotonic()
        for i in range(n):
            slot = i % slots
            state_at = pool["states"] + 8 * slot
            g.copy(ctypes.addressof(word), dev + state_at, 8, to_device=False)
            claimed = lib.ep_chk_claim_word(word.value, 3)
            if claimed == 0:
                raise StepFailed(f"request {i}: slot {slot} not FREE ({word.value:#x})")
            g.store(dev + state_at, claimed)
            gen = claimed >> 32
            bell = lib.ep_chk_write_request(staging, slot, gen, i, tokens)
            at = pool["slots"] + slot * pool["stride"]
            g.copy(dev + at, staging + at, pool["result"], to_device=True)
            g.store(dev + pool["doorbells"] + 8 * slot, bell)
            entry = poller.ring + 16 * (poller.head.value & mask)
            wait_until(lambda e=entry: u64(e) == poller.head.value + 1, 2, f"hand-off of request {i}")
            if u64(entry + 8) != (gen << 32 | slot):
                raise StepFailed(f"request {i}: hand-off {u64(entry + 8):#x}, expected slot {slot} gen {gen}")
            poller.head.value += 1
            if not g.twin and not ids_match(g.cp, dev + at + pool["request_header"], tokens, i):
                raise StepFailed(f"request {i}: the ids in device memory are not the ones written")
            g.copy(ctypes.addressof(word), dev + state_at, 8, to_device=False)
            done = lib.ep_chk_step(word.value, 4)  # EP_EV_COMPLETE
            g.store(dev + state_at, done)
            g.store(dev + state_at, lib.ep_chk_step(done, 5))  # EP_EV_RELEASE
        seconds = time.monotonic() - t0
        stop_ns = poller.stop(lib)
        c = poller.counters()
        if c["accepted"] != n or c["lost"] or c["rejected"]:
            raise StepFailed(f"counters {c} after {n} requests")
        out = {
            "requests": n,
            "counters": c,
            "stop_latency_us": round(stop_ns / 1000, 1),
            "requests_per_s_python_driven": round(n / seconds, 1),
            "what": (
                "correctness of the device-memory lane: every request handed over once, ids verified in place "
                "on the device; the rate is of a Python loop of cudaMemcpy calls, not a latency figure"
            ),
        }
        return {**out, "gpu": NOT_RUN + " (cpu-twin: host memory stands in for HBM)"} if args.dry_run else out
    finally:
        g.close()


def step_gpu_tests(args: argparse.Namespace) -> dict[str, Any]:
    """The GPU test file, named (no collection of the rest): on a GPU its gpu-marked tests, which must
    pass; in a dry run its twin tests."""
    files = ["tests/dma/test_gpu_poller.py"]  # the one file with gpu-marked tests
    marker = "not gpu" if args.dry_run else "gpu"
    # -P: the working directory (the repository root, whose edgepath/ holds only part of the package)
    # must not shadow the package view on PYTHONPATH.
    cmd = [sys.executable, "-P", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-o", "addopts=", "-m", marker]
    done = subprocess.run([*cmd, *files], capture_output=True, text=True, cwd=ROOT, timeout=args.timeout, check=False)
    lines = done.stdout.strip().splitlines()
    summary = lines[-1] if lines else ""
    out: dict[str, Any] = {"files": files, "marker": marker, "exit": done.returncode, "summary": summary}
    out["tail"] = done.stdout[-3000:] + done.stderr[-1000:]
    if done.returncode != 0:
        raise StepFailed(f"{out['summary']}\n{out['tail']}")
    if not args.dry_run and " passed" not in summary:
        raise StepFailed(f"no GPU test passed on a GPU machine: {summary}")
    return {**out, "gpu": NOT_RUN + " (the twin and CPU tests of those files ran)"} if args.dry_run else out


def step_echo(args: argparse.Namespace) -> dict[str, Any]:
    """Echo requests through a --slots gpu slot server and an agent over loopback, concurrency 1 and 8."""
    if args.dry_run:  # the poller's host twin under the stand-in for cupy
        sys.path.insert(0, str(ROOT / "tests"))
        from helpers.gpu_twin import FakeCupy, build_twin

        from edgepath.dma import gpu

        tmp = Path(tempfile.mkdtemp(prefix="edgepath-echo-twin-"))
        os.environ["CUDA_MODULE_LOADING"] = "EAGER"
        sys.modules["cupy"] = FakeCupy(build_twin(tmp))
        gpu.build_poller = lambda *_: Path("host-twin")
    from edgepath.demo import run_demo

    out: dict[str, Any] = {}
    for concurrency in (1, 8):
        r = run_demo(requests=args.requests, slots=8, concurrency=concurrency, tokens=128, memory="gpu")
        run = {
            "requests": r.requests,
            "ok": r.ok,
            "errors": r.errors,
            "wrong_tokens": r.mismatches,
            "slots_free_after": f"{r.slots_free_after}/{r.slots}",
            "requests_per_s": round(r.requests / r.seconds, 1),
            "stage_us_p50_p99_max": {k: list(v) for k, v in r.stage_us.items()},
        }
        out[f"concurrency_{concurrency}"] = run
        if r.ok != r.requests or r.mismatches or r.slots_free_after != r.slots:
            raise StepFailed(f"echo at concurrency {concurrency}: {run}")
    out["what"] = "end to end through the slot server and agent (Python), round trips per request"
    return {**out, "gpu": NOT_RUN + " (cpu-twin under a stand-in for cupy)"} if args.dry_run else out


STEPS = {
    "probe": step_probe,
    "smoke": step_smoke,
    "baseline": step_baseline,
    "poller_rtt": step_poller_rtt,
    "device_pool": step_device_pool,
    "gpu_tests": step_gpu_tests,
    "echo": step_echo,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--json", type=Path, required=True, help="where this step writes its result")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=2_000)
    parser.add_argument("--core", type=int, default=None, help="core to pin the timed loops to (default: the last)")
    parser.add_argument("--timeout", type=float, default=150, help="for gpu_tests' pytest")
    args = parser.parse_args(argv)
    try:
        result: dict[str, Any] = {"status": "ok", **STEPS[args.step](args)}
    except StepFailed as exc:
        result = {"status": "failed", "error": str(exc)}
    except Exception as exc:
        result = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
