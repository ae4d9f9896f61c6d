"""``--slots gpu-device`` wired end to end: the slot server's pool in "device" memory, the CUDA poller over
it, agents writing it through a NIC registration, the host reading and answering through DeviceSlots'
copies -- all on the poller's host twin (tests/gpu_twin.py: the kernel's per-slot pass compiled for the
CPU under a stand-in for cupy, the "device memory" a memfd only the twin kernel, the copies and the twin
NIC touch).  Twin results: they show the wiring and the ordering of copies and state stores, nothing
about a GPU, a NIC or timing.  Plus the placement refusals of the command line and configuration."""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers.gpu_twin import FakeCupy, TwinNicTransport, build_twin

from edgepath import cli, config
from edgepath.builder import slot_server_argv
from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.dpu.port import Delivery
from edgepath.native.abi import State, Status, ffi, lib
from edgepath.peer_secret import peer_keys
from edgepath.slots import gpu
from edgepath.slots import server as slot_server
from edgepath.slots.handlers import PacedEcho, echo
from edgepath.slots.pollers import DeviceDoorbellPoller
from edgepath.slots.server import SlotServer, SlotServerConfig
from edgepath.transports.base import Access
from edgepath.transports.loopback import LoopbackTransport

CAP = 64


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_twin(tmp_path_factory.mktemp("twin"))


@pytest.fixture
def fake(twin: Any, monkeypatch: pytest.MonkeyPatch) -> FakeCupy:
    """The twin in place of cupy and the poller's fatbin."""
    cupy = FakeCupy(twin)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(gpu, "build_poller", lambda arches: Path("host-twin"))
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    return cupy


@pytest.fixture
def serve(fake: FakeCupy, tmp_path: Path) -> Iterator[Callable[..., SlotServer]]:
    """A --slots gpu-device slot server on the twin NIC, its real loop on a thread."""
    started: list[tuple[SlotServer, threading.Thread]] = []

    def start(handler: Any, slots: int = 4, **options: Any) -> SlotServer:
        cfg = SlotServerConfig(slots=slots, input_capacity=CAP, output_capacity=CAP, memory="gpu-device", **options)
        server = SlotServer(TwinNicTransport(fake), str(tmp_path / f"s{len(started)}.sock"), handler, cfg)
        thread = threading.Thread(target=server.serve, daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield start
    for server, thread in started:
        server.stop()
        thread.join(timeout=5)
        server.close()
        server.transport.close()
    assert fake.device_blocks == {}, "device memory left allocated after close"


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent(LoopbackTransport(peer_keys(None)), frames=4, input_capacity=CAP, output_capacity=CAP)
    yield a
    a.transport.close()


def _device_states(server: SlotServer) -> list[int]:
    assert server.device_slots is not None
    return [int(w) & 0xFF for w in server.device_slots.pull_states()]


def _settle(check: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _send(agent: Agent, tokens: list[int], stream: bool = False) -> int:
    index = agent.acquire()
    assert index is not None
    flags = wire.FLAG_STREAM if stream else 0
    write_request(agent.frames, index, tokens, request_id=index + 1, max_new_tokens=len(tokens), flags=flags)
    assert agent.submit(index) is None
    return index


def _collect(agent: Agent, index: int, check: Callable[[Delivery], None] | None = None) -> list[Delivery]:
    """Deliveries for ``index`` until its final one (bounded: 10 s on a loaded 2-core machine)."""
    got: list[Delivery] = []
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline and not (got and got[-1].final):
        for d in agent.poll(timeout=0.5):
            if d.index == index:
                if check is not None:
                    check(d)
                got.append(d)
    return got


def test_device_slots_serve_echo_end_to_end(serve: Callable[..., SlotServer], agent: Agent) -> None:
    """[twin] Agents claim, write and ring in device memory; the kernel hands over; the host handler sees
    the request only through pull_request; the result goes back from device memory after push_result;
    RUNNING -> DONE -> FREE by the model side's stores on the device."""
    server = serve(echo)
    assert isinstance(server.poller, DeviceDoorbellPoller)
    assert server.pool is server.device_slots.mirror  # type: ignore[union-attr]
    agent.attach(server.address)
    for i in range(120):
        tokens = list(range(i, i + 1 + i % CAP))
        index = _send(agent, tokens)
        got = _collect(agent, index)
        assert got and got[-1].final, (i, server.stats, server.poller.cuda.counters())
        res = agent.frames.results[index]
        assert int(res["status"]) == Status.OK and int(res["output_count"]) == len(tokens)
        assert agent.frames.outputs[index, : len(tokens)].tolist() == tokens
        agent.release(index)
    assert server.stats.served == 120 and server.stats.bad_requests == 0
    assert _settle(lambda: _device_states(server) == [State.FREE] * 4)
    assert _settle(lambda: server.poller.cuda.counters()["accepted"] == 120), server.poller.cuda.counters()
    counters = server.poller.cuda.counters()
    assert counters["lost"] == 0 and counters["rejected"] == 0


def test_device_slots_stream_progress_from_device_memory(serve: Callable[..., SlotServer], agent: Agent) -> None:
    """[twin] Streamed output works on device slots: each progress write sends tokens pushed to the device
    first, so every progress delivery finds exactly the tokens it announces."""
    server = serve(PacedEcho(0.002), stream_window=0.0)
    agent.attach(server.address)
    tokens = list(range(500, 530))

    def placed(d: Delivery) -> None:
        assert agent.frames.outputs[d.index, : d.count].tolist() == tokens[: d.count], d

    index = _send(agent, tokens, stream=True)
    got = _collect(agent, index, placed)
    assert got[-1].final and got[-1].count == 30
    assert [d for d in got if not d.final], "no streamed progress before the final result"
    assert server.stats.progress_writes >= 1
    agent.release(index)
    assert _settle(lambda: _device_states(server) == [State.FREE] * 4)


def test_device_slots_cancel_reads_the_cancel_word_on_the_device(
    serve: Callable[..., SlotServer], agent: Agent
) -> None:
    """[twin] A cancel is honoured only if the cancel word the agent wrote into device memory names the
    running generation: the server copies it out (load_word) to check."""
    server = serve(PacedEcho(0.02), stream_window=0.0)
    agent.attach(server.address)
    index = _send(agent, list(range(50)), stream=True)
    first: list[Delivery] = []
    deadline = time.monotonic() + 10
    while not first and time.monotonic() < deadline:
        first = agent.poll(timeout=0.5)
    assert first and not first[0].final
    agent.cancel(index)
    got = _collect(agent, index)
    assert got[-1].final and int(agent.frames.results[index]["status"]) == Status.CANCELLED
    assert server.stats.cancelled == 1 and server.stats.cancels_ignored == 0
    assert _settle(lambda: _device_states(server) == [State.FREE] * 4)


def test_device_slots_lease_expiry(serve: Callable[..., SlotServer]) -> None:
    """[twin] A claim in device memory never rung is expired by the kernel on the host's request, found
    by a lease scan over the states copied out of the device."""
    server = serve(echo, slots=2, lease=0.05, scan_interval=0.01)
    states = ffi.cast("uint64_t *", server.pool_mr.ptr + server.pool.states_offset)  # type: ignore[attr-defined]
    free = int(lib.ep_load64(states))
    claimed = wire.claim_word(free, 7)
    assert lib.ep_cas64(states, free, claimed) == free  # the NIC's CAS on the device word
    assert _settle(lambda: _device_states(server)[0] == State.FREE)
    assert _settle(lambda: server.poller.cuda.counters()["expired"] == 1), server.poller.cuda.counters()
    assert _settle(lambda: server.stats.expired_leases == 1)
    assert int(lib.ep_load64(states)) >> 32 == claimed >> 32  # EXPIRE keeps the generation: a late bell is stale


@pytest.mark.transport
def test_device_slots_over_verbs_on_the_twin(
    transport_name: str,
    new_transport: Callable[[], Any],
    new_address: Callable[[str], str],
    fake: FakeCupy,
) -> None:
    """[twin + rxe] --slots gpu-device over the real verbs transport: the pool's memory is the twin's
    "device memory" (host memory), registered through DeviceSlots.register_for_rdma -- dma-buf is
    tried and fails (no cuda-bindings, no GPU), nvidia-peermem's ibv_reg_mr on the pointer then works
    because the pointer is host memory here.  Agents claim (NIC CAS), write and ring over rxe; the twin
    kernel hands over; results go back by RDMA WRITE from that memory, streamed ones included."""
    if transport_name != "verbs":
        pytest.skip("needs an RDMA device: runs in the soft-RoCE lane (tests/softroce/run, --transport verbs)")
    cfg = SlotServerConfig(slots=4, input_capacity=CAP, output_capacity=CAP, memory="gpu-device", stream_window=0.0)
    server = SlotServer(new_transport(), new_address("slot-server"), PacedEcho(0.0), cfg)
    assert server.pool_mr.how == "nvidia-peermem"  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    agent = Agent(new_transport(), frames=4, input_capacity=CAP, output_capacity=CAP)
    try:
        agent.attach(server.address)
        for i in range(16):
            tokens = list(range(i, i + 2 + i % (CAP - 2)))
            index = _send(agent, tokens, stream=i % 2 == 1)

            def placed(d: Delivery, tokens: list[int] = tokens) -> None:
                assert agent.frames.outputs[d.index, : d.count].tolist() == tokens[: d.count], d

            got = _collect(agent, index, placed)
            assert got and got[-1].final and got[-1].count == len(tokens), (i, server.stats)
            # paced-echo: max_new_tokens == len(tokens), so it stops at the output's end: LENGTH
            assert int(agent.frames.results[index]["status"]) == Status.LENGTH
            agent.release(index)
        assert server.stats.served == 16 and server.stats.progress_writes >= 8
        assert _settle(lambda: _device_states(server) == [State.FREE] * 4)
        assert _settle(lambda: server.poller.cuda.counters()["accepted"] == 16), server.poller.cuda.counters()
    finally:
        server.stop()
        thread.join(timeout=5)
        server.close()


def test_device_pool_is_refused_on_a_transport_without_register_device(fake: FakeCupy, tmp_path: Path) -> None:
    """Loopback agents cannot write GPU memory: refused before any GPU memory or listener is made."""
    transport = LoopbackTransport(peer_keys(None))
    address = tmp_path / "s.sock"
    try:
        with pytest.raises(ValueError, match=r"--slots gpu-device: the loopback data path .* use --data-path verbs"):
            SlotServer(transport, str(address), echo, SlotServerConfig(slots=2, memory="gpu-device"))
        assert not address.exists() and fake.device_blocks == {}
    finally:
        transport.close()


def test_a_failed_registration_frees_the_device_pool(fake: FakeCupy, tmp_path: Path) -> None:
    class NoNic(TwinNicTransport):
        def register_device(self, name: str, memory: Any, access: Access) -> Any:
            raise gpu.RdmaRegistrationError("dma-buf: no; nvidia-peermem: no")

    transport = NoNic(fake)
    try:
        with pytest.raises(gpu.RdmaRegistrationError):
            SlotServer(transport, str(tmp_path / "s.sock"), echo, SlotServerConfig(slots=2, memory="gpu-device"))
        assert fake.device_blocks == {} and not (tmp_path / "s.sock").exists()
    finally:
        transport.close()


def test_a_device_without_rdma_write_ordering_is_refused(
    twin: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """[twin] A GPU that may show a doorbell before its request is refused (agents do not flush yet),
    and the device memory it took is freed."""
    fake = FakeCupy(twin, rdma_writes_ordering=0)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(gpu, "build_poller", lambda arches: Path("host-twin"))
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    transport = TwinNicTransport(fake)
    try:
        with pytest.raises(gpu.GpuUnavailable, match=r"WritesOrdering = 0, needs >= 100.*use --slots host"):
            SlotServer(transport, str(tmp_path / "s.sock"), echo, SlotServerConfig(slots=2, memory="gpu-device"))
        assert fake.device_blocks == {} and not (tmp_path / "s.sock").exists()
    finally:
        transport.close()


# -- the verbs transport's registration of device memory (fake MR: no NIC here) -----------------------


def test_verbs_registers_device_memory_at_the_mrs_own_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dma-buf MR's address space starts at its iova (pyverbs: its offset into the dma-buf); an
    nvidia-peermem MR's at the device pointer. Peers and local work requests must name those -- for the whole
    pool (the server's own) and for each part agents are given (``offset``, ``length``)."""
    verbs = pytest.importorskip("edgepath.transports.verbs", reason="the verbs extension is not built here")
    from edgepath.transports import verbs_datapath

    monkeypatch.setattr(verbs, "ibv_access", lambda access: int(access) << 4)
    transport = object.__new__(verbs.VerbsTransport)
    transport.pd, transport.qp_access, transport._regions = "pd", 0, []
    for how, whole, part in (("dma-buf", 0x40, 0x40), ("nvidia-peermem", 0x7F00_0000_0000, 0x7F00_0000_0100)):
        mr = types.SimpleNamespace(lkey=11, rkey=22, offset=0x40)
        seen: list[tuple[Any, int, int, int]] = []

        def register(pd: Any, access: int, offset: int, length: int, mr: Any = mr, how: str = how) -> tuple[Any, str]:
            seen.append((pd, access, offset, length))  # noqa: B023 (consumed in this iteration)
            return mr, how

        memory = types.SimpleNamespace(address=0x7F00_0000_0000, nbytes=4096, register_for_rdma=register)
        region = transport.register_device("pool", memory, wire.POOL_ACCESS)
        states = transport.register_device("states", memory, wire.STATES_ACCESS, 0x100, 64)
        assert seen == [("pd", int(wire.POOL_ACCESS) << 4, 0, 4096), ("pd", int(wire.STATES_ACCESS) << 4, 0x100, 64)]
        assert region.describe() == {
            "name": "pool",
            "length": 4096,
            "access": int(wire.POOL_ACCESS),
            "addr": whole,
            "rkey": 22,
        }
        assert (states.addr, states.length) == (part, 64)
        assert verbs_datapath._local(region, 4000, 96) == (whole + 4000, 11)
        with pytest.raises(verbs_datapath.TransportError, match="outside region 'pool' of 4096 bytes"):
            verbs_datapath._local(region, 4000, 97)
        assert region.buf.nbytes == 0  # the host has no view of device memory
    assert len(transport._regions) == 4


# -- placement: the command line and the configuration -------------------------------------------------


def test_slot_memory_kinds_agree() -> None:
    assert config.SLOT_MEMORY == gpu.SLOT_MEMORY == slot_server.SLOT_MEMORY


@pytest.mark.parametrize(
    ("data_path", "memory"),
    [("loopback", "gpu-device"), ("verbs", "gpu")],
)
def test_cli_refuses_a_placement_at_once_in_one_line(
    data_path: str, memory: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    address = str(tmp_path / "s.sock") if data_path == "loopback" else "127.0.0.1:7471"
    argv = ["slot-server", "--slots", memory, "--data-path", data_path, "--listen", address]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"edgepath slot-server: error: --slots {memory} with --data-path {data_path} is not possible")
    assert (
        "the combinations that work: --data-path loopback with --slots host or gpu, "
        "--data-path verbs with --slots host or gpu-device" in err
    )
    assert not (tmp_path / "s.sock").exists()


def test_cli_gpu_device_without_a_gpu_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """verbs + gpu-device is a valid placement: without cupy it fails before any transport, naming it."""
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError, as on this machine
    argv = ["slot-server", "--slots", "gpu-device:8", "--data-path", "verbs", "--listen", "127.0.0.1:7471"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgepath slot-server: error: --slots gpu-device: cupy is not installed"), err
    assert "install edgepath[gpu]" in err and "use --slots host" in err
    assert "RDMA" not in err  # the GPU is checked before the verbs transport (no RDMA device here) is made


def test_settings_check_the_placement_and_round_trip_gpu_device() -> None:
    with pytest.raises(ValueError, match="--slots gpu-device with --data-path loopback is not possible"):
        config.SlotServerSettings(listen="x", memory="gpu-device")
    settings = config.SlotServerSettings(
        listen="10.0.0.1:7471", memory="gpu-device", data_path=config.DataPath("verbs")
    )
    args = cli.build_parser().parse_args(slot_server_argv(settings))
    assert args.slots == ("gpu-device", settings.slots) and args.data_path == "verbs"


@pytest.mark.parametrize(
    ("text", "parsed"), [("gpu-device", ("gpu-device", None)), ("gpu-device:4", ("gpu-device", 4))]
)
def test_slots_option_takes_gpu_device(text: str, parsed: tuple[str, int | None]) -> None:
    assert cli.build_parser().parse_args(["slot-server", "--slots", text]).slots == parsed


def test_slots_option_names_the_kinds_when_refusing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["slot-server", "--slots", "hbm"])
    assert "KIND one of host, gpu, gpu-device" in capsys.readouterr().err


def test_push_result_copies_only_what_is_asked(fake: FakeCupy) -> None:
    """[twin] push_result(slot, n): the result header and n tokens, nothing past them; bad n is refused."""
    slots = gpu.start_device_poller(2, 8, 8, 10**9, epoch=3)
    try:
        mirror = slots.mirror
        mirror.slots.outputs[1, :8] = np.arange(1, 9, dtype=np.int32)
        slots.push_result(1, 3)
        off = slots.slot_offset(1) + mirror.layout.result_offset + mirror.layout.result_bytes(0)
        device = np.frombuffer(ffi.buffer(ffi.cast("char *", slots.address + off), 32), dtype=np.int32)
        assert device.tolist() == [1, 2, 3, 0, 0, 0, 0, 0]
        with pytest.raises(ValueError, match=r"output_count 9: expected 0\.\.8"):
            slots.push_result(1, 9)
        with pytest.raises(ValueError, match="offset 4: expected a multiple of 8"):
            slots.load_word(4)
    finally:
        slots.close()


def test_the_heartbeat_agents_read_is_the_one_on_the_device(serve: Callable[..., SlotServer], agent: Agent) -> None:
    """[twin] The loop stores its heartbeat into the device pool (at most every millisecond): an agent, whose
    READ goes to device memory, sees it move; the host mirror alone would tell it nothing."""
    server = serve(echo)
    link = agent.attach(server.address)
    first = int(link.beat[0])
    assert _settle(lambda: agent.free_slots() is not None and int(link.beat[0]) != first)
    assert server.device_slots is not None
    on_device = server.device_slots.load_word(wire.HEARTBEAT_OFFSET)
    assert 0 < on_device <= server.memory.beats  # the mirror runs ahead between stores
