"""The GPU poller's scenarios, each run twice: on the poller's host twin (tests/helpers/gpu_twin.py: the kernel's
per-slot pass compiled for the CPU, under a stand-in for cupy) wherever the tests run, and on a real GPU
(marker ``gpu``; skipped with the reason when there is no device). ``bench/gpu_check.py`` runs the
``gpu`` ones with ``pytest -m gpu`` on a GPU machine."""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.gpu_twin import STALE, FakeCupy, LocalWriter, TwinWouldHang, build_twin, wait_handoff

from edgepath.contract.pool import SlotPool
from edgepath.contract.wire import claim_word, doorbell_word, step
from edgepath.dpu.agent import Agent
from edgepath.native.abi import Event, State, Status, ffi, lib
from edgepath.peer_secret import peer_keys
from edgepath.slots import gpu
from edgepath.slots.handlers import echo
from edgepath.slots.pollers import GpuDoorbellPoller
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.base import Access
from edgepath.transports.loopback import LoopbackTransport


def _real_device() -> gpu.DeviceInfo:
    try:
        return gpu.require_device()
    except gpu.GpuUnavailable as exc:
        pytest.skip(f"no GPU: {exc}")


@pytest.fixture(autouse=True)
def _no_poller_left_running() -> None:
    """A poller that did not stop (an earlier failure) makes every later free wait for it: fail fast."""
    if gpu.leaked():
        pytest.fail(f"{gpu.leaked()} GPU poller(s) from an earlier test did not stop: freeing memory would hang")


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_twin(tmp_path_factory.mktemp("twin"))


@pytest.fixture(params=["twin", pytest.param("gpu", marks=pytest.mark.gpu)])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the poller runs: the host twin (cupy replaced) or the real GPU."""
    if request.param == "gpu":
        _real_device()
    else:
        monkeypatch.setitem(sys.modules, "cupy", FakeCupy(request.getfixturevalue("twin")))
        monkeypatch.setattr(gpu, "build_poller", lambda arches: Path("host-twin"))
        monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    return request.param


@pytest.fixture
def device() -> gpu.DeviceInfo:
    """A real GPU only (tests of device memory and the device's own ep_step)."""
    return _real_device()


class Mapped:
    """A pool in loopback (memfd) memory, mapped into the GPU, with the poller running over it."""

    def __init__(self, slots: int, tokens: int = 128, lease_ns: int = 10**9) -> None:
        self.transport = LoopbackTransport(peer_keys(None))
        dims = SlotPool.layout_for(slots, tokens, tokens)
        region = self.transport.register("pool", int(dims["total_size"]), Access.REMOTE_WRITE)
        self.pool = SlotPool.create(region.buf, slots, tokens, tokens, lease_ns, 1)
        self.poller = gpu.start_mapped_poller(region.buf, slots)
        self.writer = LocalWriter(self.pool)

    def close(self) -> None:
        self.poller.close()
        self.transport.close()


@pytest.fixture
def mapped(backend: str) -> Iterator[Any]:
    made: list[Mapped] = []

    def make(slots: int = 8, **kw: Any) -> Mapped:
        m = Mapped(slots, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def _cuda(server: SlotServer) -> gpu.GpuPoller:
    """The CUDA poller behind a ``memory="gpu"`` slot server's doorbell poller."""
    assert isinstance(server.poller, GpuDoorbellPoller), server.poller
    return server.poller.cuda


def _settle(check: Any, timeout: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0005)
    return True


@pytest.mark.gpu
def test_device_step_equals_host_step(device: gpu.DeviceInfo) -> None:
    """ep_step compiled by nvcc for the device gives the host's answer on every input of the CPU tests."""
    cp = gpu.load_cupy()
    rows = list(
        itertools.product(
            [0, 1, 2, 3, 4, 5, 255],
            [0, 1, 2, 3, 4, 5, 6, 7],
            [0, 1, 0xFFFFFFFF],
            [0, 5],
            [0, 1, lib.EP_CLAIMANT_MAX, lib.EP_CLAIMANT_MAX + 1],
            [-1, 0, 1],
        )
    )
    words = np.array([(g << 32) | (w << 8) | s for s, _, g, w, _, _ in rows], dtype=np.uint64)
    events = np.array([e for _, e, *_ in rows], dtype=np.int32)
    gens = np.array([(g + d) & 0xFFFFFFFF for _, _, g, _, _, d in rows], dtype=np.uint32)
    claimants = np.array([c for *_, c, _ in rows], dtype=np.uint32)
    n = len(rows)
    rc = cp.zeros(n, dtype=cp.int32)
    nxt = cp.zeros(n, dtype=cp.uint64)
    module = cp.RawModule(path=str(gpu.build_poller((device.compute_capability,))))
    module.get_function("ep_gpu_step_table")(
        ((n + 255) // 256,),
        (256,),
        (cp.asarray(words), cp.asarray(events), cp.asarray(gens), cp.asarray(claimants), np.int32(n), rc, nxt),
    )
    cp.cuda.runtime.deviceSynchronize()
    rc_h, next_h = cp.asnumpy(rc), cp.asnumpy(nxt)
    out = ffi.new("uint64_t *")
    for i in range(n):
        out[0] = 0
        host_rc = lib.ep_step_word(int(words[i]), int(events[i]), int(gens[i]), int(claimants[i]), out)
        assert rc_h[i] == host_rc, rows[i]
        if host_rc == 0:
            assert int(next_h[i]) == int(out[0]), rows[i]


def test_doorbell_is_handed_over_running(mapped: Any) -> None:
    m = mapped(8)
    gen = m.writer.claim(3)
    m.writer.write(3, gen, np.arange(128, dtype=np.int32), request_id=42)
    assert m.poller.poll() == []  # claimed, not rung: nothing
    m.writer.ring(3, gen)
    assert wait_handoff(m.poller) == (3, gen)
    assert m.pool.slot_word(3).state == State.RUNNING
    m.writer.finish(3, gen)
    assert m.pool.slot_word(3).state == State.FREE
    # the kernel counts after it publishes the hand-off: the host can see the entry first
    assert _settle(lambda: m.poller.counters()["accepted"] == 1), m.poller.counters()
    assert m.poller.counters()["lost"] == 0


def test_bad_doorbells_change_nothing(mapped: Any) -> None:
    m = mapped(8)
    gen = m.writer.claim(2)
    m.writer.write(2, gen, np.arange(16, dtype=np.int32))
    bad = [
        doorbell_word(2, gen - 1),  # a late doorbell of an older claim
        doorbell_word(3, gen),  # another slot's index
        doorbell_word(2, gen) & ~lib.EP_DOORBELL_VALID,  # no valid bit
    ]
    for i, value in enumerate(bad, 1):
        m.writer.ring(2, gen, value)
        assert _settle(lambda i=i: m.poller.counters()["rejected"] == i)
    m.pool.slots.requests[2]["generation"] = gen + 7  # header of another claim
    m.writer.ring(2, gen)
    assert _settle(lambda: m.poller.counters()["rejected"] == 4)
    assert m.pool.slot_word(2).state == State.CLAIMED and m.poller.poll() == []


def test_expire_request_frees_an_unrung_claim_only(mapped: Any) -> None:
    m = mapped(4)
    gen = m.writer.claim(1)
    stale = m.pool.word(1) ^ (1 << 32)
    m.poller.request_expire(1, stale)  # not the current word: dropped
    assert _settle(lambda: not m.poller.expire_pending(1))
    assert m.pool.slot_word(1).state == State.CLAIMED
    m.poller.request_expire(1, m.pool.word(1))
    assert _settle(lambda: m.pool.slot_word(1).state == State.FREE)
    assert m.poller.counters()["expired"] == 1
    m.writer.write(1, gen, np.arange(4, dtype=np.int32))
    m.writer.ring(1, gen)  # the writer rings too late
    assert _settle(lambda: m.poller.counters()["rejected"] == 1)
    assert m.pool.slot_word(1).state == State.FREE


def test_all_slots_many_rounds_through_the_ring(mapped: Any) -> None:
    """256 slots rung at once, 12 rounds: the ring wraps; each claim is handed over exactly once."""
    m = mapped(256, tokens=16)
    for _ in range(12):
        gens = {}
        for slot in range(256):
            gens[slot] = m.writer.claim(slot)
            m.writer.write(slot, gens[slot], np.full(16, slot, dtype=np.int32))
        for slot in range(256):
            m.writer.ring(slot, gens[slot])
        got: list[tuple[int, int]] = []
        deadline = time.monotonic() + 5
        while len(got) < 256 and time.monotonic() < deadline:
            got += m.poller.poll()
        assert sorted(got) == sorted(gens.items())
        for slot, gen in got:
            m.writer.finish(slot, gen)
    assert _settle(lambda: m.poller.counters()["accepted"] == 256 * 12), m.poller.counters()
    assert m.poller.counters()["lost"] == 0


def test_stop_is_clean_and_prompt(mapped: Any) -> None:
    m = mapped(8)
    t = time.monotonic()
    m.poller.stop()
    assert time.monotonic() - t < 1.0
    assert not m.poller.running
    assert lib.ep_load64(m.poller._ctrl.ptr + gpu.CTRL_RUNNING) == 2


def test_poller_over_device_memory(backend: str) -> None:
    """The same kernel over a pool in device memory (the NIC lane's placement), its words written with
    plain cudaMemcpy calls on the legacy stream while the kernel runs on its own non-blocking stream."""
    cp = gpu.load_cupy()
    rt = cp.cuda.runtime
    pool = gpu.DevicePool(cp, 8, 32, 32, 10**9)
    poller = gpu.GpuPoller(pool.address, 8, gpu.require_device())
    word = np.zeros(1, dtype=np.uint64)

    def poke(offset: int, value: int) -> None:
        word[0] = value
        rt.memcpy(pool.address + offset, word.ctypes.data, 8, rt.memcpyHostToDevice)

    def peek(offset: int) -> int:
        rt.memcpy(word.ctypes.data, pool.address + offset, 8, rt.memcpyDeviceToHost)
        return int(word[0])

    try:
        poller.start()
        m, slot = pool.mirror, 5
        state_at = m.states_offset + 8 * slot
        claimed = claim_word(peek(state_at), 9)
        gen = claimed >> 32
        poke(state_at, claimed)
        req = m.slots.requests[slot]
        req["request_id"], req["token_count"], req["max_new_tokens"], req["generation"] = 1, 4, 4, gen
        at, size = m.slots.frame_offset(slot), m.slots.requests.dtype.itemsize
        rt.memcpy(pool.address + at, m.buf[at : at + size].ctypes.data, size, rt.memcpyHostToDevice)
        poke(m.doorbells_offset + 8 * slot, doorbell_word(slot, gen))
        assert wait_handoff(poller, timeout=2.0) == (slot, gen)
        assert peek(state_at) == step(step(claimed, Event.DOORBELL, gen, 0), Event.START, gen, 0)
    finally:
        poller.close()
        pool.close()


@pytest.mark.gpu
def test_dmabuf_export_of_device_memory(device: gpu.DeviceInfo) -> None:
    cp = gpu.load_cupy()
    pool = gpu.DevicePool(cp, 8, 32, 32, 10**9)
    try:
        fd, offset, span = gpu.dmabuf_export(pool.address, pool.nbytes, device.index)
    except gpu.RdmaRegistrationError as exc:
        pool.close()
        pytest.skip(f"dma-buf export not available on this machine: {exc}")
    try:
        assert fd >= 0 and offset == 0 and span >= pool.nbytes
    finally:
        os.close(fd)
        pool.close()


def test_slot_server_with_gpu_slots_echoes(backend: str, tmp_path: Any) -> None:
    """--slots gpu end to end: agent (loopback) claims, writes, rings; the kernel hands over; echo; result."""
    server = SlotServer(
        LoopbackTransport(peer_keys(None)),
        str(tmp_path / "s.sock"),
        echo,
        SlotServerConfig(slots=4, input_capacity=64, output_capacity=64, memory="gpu"),
    )
    worker = threading.Thread(target=server.serve, daemon=True)
    worker.start()
    agent = Agent(LoopbackTransport(peer_keys(None)), frames=4, input_capacity=64, output_capacity=64)
    try:
        agent.attach(server.address)
        for i in range(300):
            index = agent.acquire()
            assert index is not None
            n = 1 + i % 64
            req = agent.frames.requests[index]
            req["request_id"], req["token_count"], req["max_new_tokens"] = i, n, n
            agent.frames.tokens[index, :n] = np.arange(i, i + n, dtype=np.int32)
            assert agent.submit(index) is None
            done: list[int] = []
            deadline = time.monotonic() + 10.0  # generous: a loaded 2-core CI machine runs three busy threads here
            while not done and time.monotonic() < deadline:
                done = [d.index for d in agent.poll(timeout=0.5) if d.final]
            assert done == [index], (i, server.stats, _cuda(server).counters(), server.pool.states)
            res = agent.frames.results[index]
            assert res["status"] == Status.OK and int(res["output_count"]) == n
            assert np.array_equal(agent.frames.outputs[index, :n], np.arange(i, i + n, dtype=np.int32))
            agent.release(index)
        assert server.stats.served == 300
        assert _settle(lambda: server.pool.free_count() == 4)
        assert _settle(lambda: _cuda(server).counters()["accepted"] == 300), _cuda(server).counters()
    finally:
        server.close()
        worker.join(timeout=5)
        agent.transport.close()
        server.transport.close()


def test_slot_server_gpu_lease_expiry(backend: str, tmp_path: Any) -> None:
    """A claim never rung is expired by the kernel on the host's request after the lease."""
    server = SlotServer(
        LoopbackTransport(peer_keys(None)),
        str(tmp_path / "s.sock"),
        echo,
        SlotServerConfig(slots=2, input_capacity=8, output_capacity=8, memory="gpu", lease=0.05, scan_interval=0.01),
    )
    worker = threading.Thread(target=server.serve, daemon=True)
    worker.start()
    try:
        states = ffi.cast("uint64_t *", ffi.from_buffer(server.pool.states))
        free = server.pool.word(0)
        claimed = (((free >> 32) + 1) << 32) | (7 << 8) | State.CLAIMED
        assert lib.ep_cas64(states, free, claimed) == free
        assert _settle(lambda: server.pool.slot_word(0).state == State.FREE, timeout=3.0)
        assert _settle(lambda: _cuda(server).counters()["expired"] == 1), _cuda(server).counters()
        assert lib.ep_apply(states, Event.EXPIRE, claimed >> 32, 0, ffi.NULL) == lib.EP_E_STATE
    finally:
        server.close()
        worker.join(timeout=5)
        server.transport.close()


@pytest.fixture
def twin_backend(monkeypatch: pytest.MonkeyPatch, twin: Any) -> None:
    monkeypatch.setitem(sys.modules, "cupy", FakeCupy(twin))
    monkeypatch.setattr(gpu, "build_poller", lambda arches: Path("host-twin"))
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")


@pytest.mark.gpu
def test_twin_fakes_only_what_cupy_has() -> None:
    """The stand-in must not make up cupy API: every name it offers exists in the real cupy, with the
    same value for constants.  Needs cupy, not a device: gpu_check's gpu_tests step runs it there."""
    cupy = pytest.importorskip("cupy", reason="cupy not installed (edgepath[gpu] extra): cannot compare the stand-in")
    fake = FakeCupy(None)
    names = [n for n in vars(fake.cuda.runtime) if not n.startswith("_")]
    assert "pointerGetAttributes" in names and "hostRegister" in names
    missing = [n for n in names if not hasattr(cupy.cuda.runtime, n)]
    assert not missing, f"FakeCupy offers runtime calls cupy does not have: {missing}"
    for n in ("Device", "Stream"):
        assert hasattr(cupy.cuda, n)
    assert hasattr(cupy, "RawModule") and hasattr(cupy, "zeros") and hasattr(cupy, "uint64")
    assert hasattr(cupy.cuda.Stream, "done") and hasattr(cupy.cuda.Stream, "synchronize")
    assert hasattr(cupy.cuda.Stream, "ptr") and hasattr(cupy.cuda.Stream, "__enter__")
    assert hasattr(cupy.cuda.runtime.PointerAttributes, "devicePointer")
    for n in names:
        real = getattr(cupy.cuda.runtime, n)
        if isinstance(real, int):
            assert getattr(fake.cuda.runtime, n) == real, n


@pytest.mark.gpu
def test_zeros_follow_the_current_stream(device: gpu.DeviceInfo) -> None:
    """What GpuPoller relies on (and the twin models): cp.zeros inside ``with stream`` queues its memset on
    that stream, behind the stream's earlier work, and cupy's pool hands a freed block back to the same
    stream with its old contents.  A kernel that waits for a host flag holds the stream; until it is let
    go, another stream reads the old values in the zeroed array."""
    cp = gpu.load_cupy()
    rt = cp.cuda.runtime
    kernel = cp.RawModule(path=str(gpu.build_poller((device.compute_capability,)))).get_function("ep_check_pingpong")
    flags = gpu._Pinned(cp, 4 * 64)  # ping, pong (+ stamp), stop: one line each
    stream, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    n = 1 << 16
    seen = np.zeros(n, dtype=np.uint64)
    stop = flags.ptr + 16  # the stop flag's line (u64 index 16 = byte 128)
    try:
        with stream:
            a = cp.full(n, 7, dtype=cp.uint64)
            stream.synchronize()
            block = a.data.ptr
            del a  # back to this stream's free list, contents kept
            d = flags.device
            kernel((1,), (32,), (np.uint64(d), np.uint64(d + 64), np.uint64(d + 72), np.uint64(d + 128)))
            b = cp.zeros(n, dtype=cp.uint64)  # queued behind the waiting kernel
        assert b.data.ptr == block, "cupy's pool did not hand the freed block back to its stream"
        rt.memcpyAsync(seen.ctypes.data, b.data.ptr, b.nbytes, rt.memcpyDeviceToHost, other.ptr)
        other.synchronize()
        assert (seen == 7).all()  # the memset has not run: it waits on its stream
    finally:
        lib.ep_store64(stop, 1)
        deadline = time.monotonic() + 5
        while not stream.done and time.monotonic() < deadline:
            time.sleep(0.001)
        assert stream.done, "the waiting kernel did not return after its stop flag"
    stream.synchronize()
    rt.memcpyAsync(seen.ctypes.data, b.data.ptr, b.nbytes, rt.memcpyDeviceToHost, other.ptr)
    other.synchronize()
    assert (seen == 0).all()
    flags.close()


def test_a_kernel_that_never_polls_is_an_error_and_cleans_up(twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that returns at once (no RUNNING flag) fails start() and leaves nothing mapped."""
    fake = FakeCupy(twin)

    class DeadKernel:
        def __call__(self, grid: Any, block: Any, args: Any) -> None:
            stream = fake.cuda.Stream.current
            stream.thread = threading.Thread(target=lambda: None)
            stream.thread.start()

    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(gpu, "build_poller", lambda arches: Path("host-twin"))
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    monkeypatch.setattr(fake, "RawModule", lambda path: types.SimpleNamespace(get_function=lambda n: DeadKernel()))
    buf = np.zeros(SlotPool.layout_for(2, 8, 8)["total_size"], dtype=np.uint8)
    SlotPool.create(buf, 2, 8, 8, 10**9, 1)
    with pytest.raises(gpu.GpuUnavailable, match="exited at once"):
        gpu.start_mapped_poller(buf, 2)
    assert fake.registered == {} and fake._blocks == {}


# -- fixes of issues #15 and #23, shown on the twin ----------------------------------------------------


def test_private_words_are_zeroed_in_stream_order(twin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's private words are zeroed on its own stream, ahead of its launch: a second poller starts
    while the first runs (a device synchronisation before the launch would wait for the first forever:
    the twin raises TwinWouldHang), and both hand over.  Zeroed on the legacy stream instead, with no
    synchronisation, a reused block's stale tail hides every hand-off: the ordering is what matters."""
    fake = FakeCupy(twin)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(gpu, "build_poller", lambda arches: Path("host-twin"))
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    with pytest.raises(TwinWouldHang):  # what a device-wide synchronisation does beside a running poller
        first = Mapped(4)
        try:
            fake.cuda.runtime.deviceSynchronize()
        finally:
            first.close()
    first, second = Mapped(4), Mapped(4)  # the second starts while the first runs
    try:
        for m in (first, second):
            gen = m.writer.claim(0)
            m.writer.write(0, gen, np.arange(4, dtype=np.int32))
            m.writer.ring(0, gen)
            assert wait_handoff(m.poller) == (0, gen)
    finally:
        second.close()  # its frees wait for the first poller (a free would wait for its kernel)
        first.close()
    assert fake._blocks == {} and fake.registered == {}  # and run once the last poller stopped

    def zeros_on_the_legacy_stream(n: int, dtype: Any) -> np.ndarray:
        array = np.full(n, STALE, dtype=dtype)
        fake.pending_zeros.append(array)  # done at the next device synchronisation, which never comes
        return array

    monkeypatch.setattr(fake, "zeros", zeros_on_the_legacy_stream)
    m = Mapped(4)
    try:
        gen = m.writer.claim(0)
        m.writer.write(0, gen, np.arange(4, dtype=np.int32))
        m.writer.ring(0, gen)
        with pytest.raises(AssertionError, match="no hand-off"):
            wait_handoff(m.poller, timeout=0.3)
    finally:
        m.close()


class _Stubborn:
    """A poller kernel that reports RUNNING and then ignores the stop flag until ``release`` is set."""

    def __init__(self, fake: FakeCupy) -> None:
        self.fake, self.release = fake, threading.Event()

    def __call__(self, grid: Any, block: Any, args: Any) -> None:
        running = ffi.cast("uint64_t *", int(args[6])) + gpu.CTRL_RUNNING
        stream = self.fake.cuda.Stream.current

        def run() -> None:
            lib.ep_store64(running, 1)
            self.release.wait()

        stream.thread = threading.Thread(target=run, daemon=True)
        stream.thread.start()
        self.fake.launched.append(stream)


@pytest.mark.parametrize("placement", ["mapped", "device"])
def test_a_poller_that_does_not_stop_keeps_its_memory(
    twin: Any, monkeypatch: pytest.MonkeyPatch, placement: str
) -> None:
    """Stop before free: a kernel that does not stop is a PollerStuck, and nothing it may touch is freed or
    unmapped (on a GPU a free would wait for it forever; the twin would raise TwinWouldHang instead)."""
    fake = FakeCupy(twin)
    kernel = _Stubborn(fake)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(gpu, "build_poller", lambda arches: Path("host-twin"))
    for name, empty in (("_LEAKED", []), ("_RUNNING", set()), ("_DEFERRED", [])):  # this test's own books
        monkeypatch.setattr(gpu, name, empty)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    monkeypatch.setattr(fake, "RawModule", lambda path: types.SimpleNamespace(get_function=lambda n: kernel))
    try:
        if placement == "mapped":
            buf = np.zeros(SlotPool.layout_for(2, 8, 8)["total_size"], dtype=np.uint8)
            SlotPool.create(buf, 2, 8, 8, 10**9, 1)
            poller: Any = gpu.start_mapped_poller(buf, 2, stop_timeout=0.2)
        else:
            poller = gpu.start_device_poller(2, 8, 8, 10**9, epoch=1, stop_timeout=0.2)
        blocks, mapped, device = dict(fake._blocks), dict(fake.registered), dict(fake.device_blocks)
        with pytest.raises(gpu.PollerStuck, match=r"did not stop within 0\.2 s"):
            poller.close()
        assert fake._blocks == blocks and fake.registered == mapped and fake.device_blocks == device
        assert gpu.leaked() >= 1
    finally:
        kernel.release.set()


def test_expire_request_is_written_only_while_none_is_pending(twin_backend: None) -> None:
    """The host never overwrites a request the kernel has not decided on (it owns the entry only at 0)."""
    buf = np.zeros(SlotPool.layout_for(2, 8, 8)["total_size"], dtype=np.uint8)
    SlotPool.create(buf, 2, 8, 8, 10**9, 1)
    poller = gpu.GpuPoller(buf.ctypes.data, 2, gpu.require_device())  # not started: nobody clears
    try:
        assert poller.request_expire(1, 0x1_0000_0101) is True
        assert poller.request_expire(1, 0x2_0000_0101) is False
        assert lib.ep_load64(poller._expire.ptr + 1) == 0x1_0000_0101 and poller.expire_pending(1)
        with pytest.raises(ValueError, match="0 is not a state word"):
            poller.request_expire(0, 0)
    finally:
        poller.close()


def test_ctrl_host_and_device_words_live_on_separate_lines() -> None:
    """The stop flag (host-written) shares its 64-byte line with no word the poller writes."""
    from edgepath.native.cuda_build import ctrl_words

    words = ctrl_words()
    line = words.pop("LINE")
    total = words.pop("WORDS")
    assert line == 8 and total % line == 0
    device_written = {k: v for k, v in words.items() if k != "STOP"}
    assert all(v // line != words["STOP"] // line for v in device_written.values()), words
    assert all(0 <= v < total for v in words.values())
    assert words["STOP"] == gpu.CTRL_STOP and total == gpu.CTRL_WORDS


def test_module_loading_is_forced_eager_or_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    with pytest.raises(gpu.GpuUnavailable):  # no cupy here; what matters is the variable it left
        gpu.load_cupy()
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    assert "CUDA_MODULE_LOADING=LAZY overridden to EAGER" in caplog.text
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    with pytest.raises(gpu.GpuUnavailable, match="imported with CUDA_MODULE_LOADING=LAZY"):
        gpu.load_cupy()


@pytest.mark.parametrize(
    ("data_path", "memory", "error"),
    [
        ("loopback", "host", None),
        ("verbs", "host", None),
        ("loopback", "gpu", None),
        ("verbs", "gpu-device", None),
        ("loopback", "gpu-device", "use --slots gpu"),
        ("verbs", "gpu", "use --slots gpu-device with --data-path verbs"),
        ("verbs", "hbm", "expected one of host, gpu, gpu-device"),
        ("tcp", "host", "expected loopback or verbs"),
    ],
)
def test_placements(data_path: str, memory: str, error: str | None) -> None:
    if error is None:
        gpu.check_placement(data_path, memory)
    else:
        with pytest.raises(ValueError, match=error):
            gpu.check_placement(data_path, memory)


# -- the device-memory pool (--slots gpu-device) ----------------------------------------------------------


def test_device_pool_round_trip(backend: str) -> None:
    """A request written into device memory (as the NIC would), rung there, handed over by the kernel
    polling HBM, read back, answered and freed by the model side: twin (host memory standing in for
    HBM) and GPU."""
    from edgepath.contract.wire import claim_word, step

    slots = gpu.start_device_poller(4, 32, 16, 10**9, epoch=7)
    try:
        mirror = slots.mirror
        assert int(mirror.header["server_epoch"]) == 7
        for round_ in range(3):
            for slot in range(4):
                word = claim_word(slots.load_state(slot), 9)
                slots.store_word(mirror.states_offset + 8 * slot, word)  # the NIC's CAS, uncontended here
                gen = word >> 32
                ids = np.arange(32, dtype=np.int32) + 100 * slot + round_
                LocalWriter(mirror).write(slot, gen, ids, request_id=slot)
                slots.push_request(slot)
                slots.store_word(mirror.doorbells_offset + 8 * slot, doorbell_word(slot, gen))
                assert wait_handoff(slots, timeout=2.0) == (slot, gen)
                assert slots.load_state(slot) & 0xFF == State.RUNNING
                mirror.slots.tokens[slot, :] = 0
                slots.pull_request(slot)
                assert list(mirror.slots.tokens[slot, :32]) == list(ids)
                mirror.slots.outputs[slot, :16] = ids[:16]
                slots.push_result(slot)
                done = step(slots.load_state(slot), Event.COMPLETE, gen, 0)
                slots.store_state(slot, done)
                slots.store_state(slot, step(done, Event.RELEASE, gen, 0))
                assert slots.load_state(slot) & 0xFF == State.FREE
        assert _settle(lambda: slots.counters()["accepted"] == 12), slots.counters()
        assert slots.counters()["lost"] == 0
        assert slots.tokens_address(2) == slots.address + slots.slot_offset(2) + mirror.slots.requests.dtype.itemsize
        with pytest.raises(IndexError, match=r"slots 0\.\.3"):
            slots.slot_offset(4)
    finally:
        slots.close()


def test_device_pool_registers_its_whole_range_for_rdma(twin_backend: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """register_for_rdma gets the pool's device range (fake pyverbs and a fake dma-buf export)."""
    seen: dict[str, Any] = {}

    class FakeDmaBufMR:
        def __init__(self, pd: Any, length: int, access: int, dmabuf: int, offset: int) -> None:
            seen.update(length=length, access=access, offset=offset)

    pkg, mod = types.ModuleType("pyverbs"), types.ModuleType("pyverbs.mr")
    mod.DmaBufMR = FakeDmaBufMR  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.mr", mod)

    def export(address: int, length: int, device: int = 0) -> tuple[int, int, int]:
        seen["export"] = (address, length)
        return os.open(os.devnull, os.O_RDONLY), 0, length

    monkeypatch.setattr(gpu, "dmabuf_export", export)
    slots = gpu.start_device_poller(2, 8, 8, 10**9, epoch=1)
    try:
        mr, how = slots.register_for_rdma(object(), 7)
        assert how == "dma-buf" and isinstance(mr, FakeDmaBufMR)
        assert seen["export"] == (slots.address, slots.nbytes) and seen["length"] == slots.nbytes
    finally:
        slots.close()
