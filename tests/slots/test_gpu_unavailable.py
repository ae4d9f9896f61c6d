"""What ``--slots gpu`` and the GPU module do on a machine without a GPU (this one, and CI): fail at once
with a message that says why and names the alternative; and the RDMA registration fallback order."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from edgepath import cli
from edgepath.config import DEFAULT_SLOTS, SlotServerSettings
from edgepath.options import from_args
from edgepath.peer_secret import peer_keys
from edgepath.slots import gpu
from edgepath.slots.server import SlotServerConfig


def _fake_cupy(get_device_count: Any) -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count))  # type: ignore[attr-defined]
    return mod


def test_cupy_absent_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    with pytest.raises(gpu.GpuUnavailable, match=r"cupy is not installed .*edgepath\[gpu\].*use --slots host"):
        gpu.require_device()


def test_cupy_without_device_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> int:
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")

    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")  # as load_cupy leaves it before importing cupy
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(no_driver))
    with pytest.raises(gpu.GpuUnavailable, match=r"no CUDA device found \(cupy: cudaErrorNoDevice.*use --slots host"):
        gpu.require_device()
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(lambda: 0))
    with pytest.raises(gpu.GpuUnavailable, match=r"no CUDA device 0 \(found 0\); use --slots host"):
        gpu.require_device()


def test_slots_gpu_fails_at_once_without_a_gpu(tmp_path: Any) -> None:
    """The real command, in this environment (cupy absent, or present with no driver or device)."""
    try:
        gpu.require_device()
    except gpu.GpuUnavailable:
        pass
    else:
        pytest.skip("a CUDA device is present: the no-GPU path cannot be shown here")
    done = subprocess.run(
        [sys.executable, "-m", "edgepath", "slot-server", "--slots", "gpu", "--listen", str(tmp_path / "s.sock")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "ready" not in done.stdout
    assert "edgepath slot-server: error: --slots gpu: " in done.stderr
    assert "use --slots host" in done.stderr
    assert ("no CUDA device found (cupy: " in done.stderr) or ("cupy is not installed" in done.stderr)
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("8", ("host", 8)), ("host", ("host", None)), ("gpu", ("gpu", None)), ("gpu:16", ("gpu", 16))],
)
def test_slots_option_takes_count_and_or_memory(text: str, parsed: tuple[str, int | None]) -> None:
    args = cli.build_parser().parse_args(["slot-server", "--slots", text])
    assert args.slots == parsed


def test_slots_default_is_host() -> None:
    settings = from_args(SlotServerSettings, cli.build_parser().parse_args(["slot-server"]))
    assert (settings.memory, settings.slots) == ("host", DEFAULT_SLOTS)


@pytest.mark.parametrize("text", ["tpu", "gpu:0", "0", "gpu:x", ""])
def test_slots_option_refuses_nonsense(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["slot-server", "--slots", text])
    assert "--slots" in capsys.readouterr().err


def test_config_refuses_unknown_memory() -> None:
    with pytest.raises(ValueError, match="slot memory must be one of host, gpu"):
        SlotServerConfig(memory="tpu")


# -- RDMA registration of GPU memory: dma-buf first, nvidia-peermem only with a logged reason ------


class _FakeMR:
    def __init__(self, pd: Any, length: int, access: int, **kwargs: Any) -> None:
        self.args = (pd, length, access, kwargs)


def _fake_pyverbs(monkeypatch: pytest.MonkeyPatch, dmabuf_mr: Any, mr: Any) -> None:
    pkg = types.ModuleType("pyverbs")
    mod = types.ModuleType("pyverbs.mr")
    mod.DmaBufMR = dmabuf_mr  # type: ignore[attr-defined]
    mod.MR = mr  # type: ignore[attr-defined]
    pkg.mr = mod  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pyverbs", pkg)
    monkeypatch.setitem(sys.modules, "pyverbs.mr", mod)


def _refuse(*_a: Any, **_k: Any) -> Any:
    raise OSError("ibv_reg_mr: Bad address")


def test_registration_prefers_dmabuf(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    fd = os.open(tmp_path / "fd", os.O_CREAT | os.O_RDWR)  # stands in for the dma-buf fd
    monkeypatch.setattr(gpu, "dmabuf_export", lambda address, length, device=0: (fd, 0x40, 1 << 16))
    _fake_pyverbs(monkeypatch, _FakeMR, _refuse)
    mr, how = gpu.register_for_rdma("pd", 0x7F0000000040, 4096, 7)
    assert how == "dma-buf"
    assert mr.args == ("pd", 4096, 7, {"dmabuf": fd, "offset": 0x40})
    with pytest.raises(OSError):
        os.fstat(fd)  # closed after registration: the MR keeps its own reference


def test_registration_falls_back_to_peermem_with_a_logged_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_dmabuf(address: int, length: int, device: int = 0) -> Any:
        raise gpu.RdmaRegistrationError("device 0 does not support dma-buf (needs the open kernel modules)")

    monkeypatch.setattr(gpu, "dmabuf_export", no_dmabuf)
    _fake_pyverbs(monkeypatch, _refuse, _FakeMR)
    with caplog.at_level(logging.WARNING, logger="edgepath.gpu"):
        mr, how = gpu.register_for_rdma("pd", 0x1000, 4096, 7)
    assert how == "nvidia-peermem"
    assert mr.args == ("pd", 4096, 7, {"address": 0x1000})
    assert "dma-buf registration of GPU memory failed (device 0 does not support dma-buf" in caplog.text


def test_registration_error_names_both_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dmabuf(address: int, length: int, device: int = 0) -> Any:
        raise gpu.RdmaRegistrationError("cuMemGetHandleForAddressRange failed: CUDA_ERROR_NOT_SUPPORTED")

    monkeypatch.setattr(gpu, "dmabuf_export", no_dmabuf)
    _fake_pyverbs(monkeypatch, _refuse, _refuse)
    with pytest.raises(gpu.RdmaRegistrationError) as info:
        gpu.register_for_rdma("pd", 0x1000, 4096, 7)
    text = str(info.value)
    assert "dma-buf: cuMemGetHandleForAddressRange failed: CUDA_ERROR_NOT_SUPPORTED" in text
    assert "nvidia-peermem (ibv_reg_mr on the device pointer): ibv_reg_mr: Bad address" in text


def test_dmabuf_export_without_cuda_bindings_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(gpu.RdmaRegistrationError, match=r"needs cuda-bindings \(edgepath\[gpu\]\)"):
        gpu.dmabuf_export(0x1000, 4096)


def test_dmabuf_export_without_a_driver_is_clear() -> None:
    pytest.importorskip("cuda.bindings", reason="cuda-bindings not installed (edgepath[gpu] extra)")
    try:
        gpu.require_device()
    except gpu.GpuUnavailable:
        pass
    else:
        pytest.skip("a CUDA device is present")
    with pytest.raises(gpu.RdmaRegistrationError, match=r"dma-buf export: no CUDA driver|cuInit failed"):
        gpu.dmabuf_export(0x1000, 4096)


def test_slot_server_gpu_start_failure_leaves_no_listener(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from edgepath.slots.handlers import echo
    from edgepath.slots.server import SlotServer
    from edgepath.transports.loopback import LoopbackTransport

    monkeypatch.setitem(sys.modules, "cupy", None)
    transport = LoopbackTransport(peer_keys(None))
    address = tmp_path / "s.sock"
    try:
        with pytest.raises(gpu.GpuUnavailable, match="cupy is not installed"):
            SlotServer(transport, str(address), echo, SlotServerConfig(slots=2, memory="gpu"))
        assert not address.exists()
    finally:
        transport.close()
