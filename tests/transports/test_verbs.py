"""The verbs transport's own promises: it refuses loudly where there is no RDMA device, and where
there is one (the soft-RoCE lane) its operations really cross the NIC: the device's packet
counters rise by exactly what the operations need."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from edgepath.peer_secret import peer_keys
from edgepath.transports.base import Access, Transport, TransportUnavailable
from edgepath.transports.registry import make_transport

pytestmark = pytest.mark.transport


def test_verbs_without_the_device_fails_at_once_saying_what_to_use_instead() -> None:
    with pytest.raises(TransportUnavailable, match=r"no RDMA device found.*--data-path loopback"):
        make_transport("verbs", peer_keys(None), device="nosuchdev0", gid_index=1)


def test_the_cli_refuses_verbs_without_the_device_and_names_the_alternative() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "edgepath", "slot-server", "--data-path", "verbs", "--device", "nosuchdev0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "no RDMA device found" in proc.stderr and "--data-path loopback" in proc.stderr
    assert "ready" not in proc.stdout


def _counters(device: str) -> dict[str, int]:
    """The port's packet counters, read after the kernel's cache of them (``lifespan`` ms) has expired."""
    base = Path(f"/sys/class/infiniband/{device}/ports/1/hw_counters")
    time.sleep(3 * int((base / "lifespan").read_text()) / 1000 + 0.05)
    return {name: int((base / name).read_text()) for name in ("sent_pkts", "rcvd_pkts")}


def test_operations_cross_the_nic_as_counted_by_the_device(
    transport_name: str,
    transport_options: dict[str, object],
    new_transport: Callable[[], Transport],
    new_address: Callable[[str], str],
) -> None:
    if transport_name != "verbs":
        pytest.skip("needs an RDMA device: runs in the soft-RoCE lane (tests/softroce/run, --transport verbs)")
    import threading

    device = str(transport_options["device"])
    server, client = new_transport(), new_transport()
    pool = server.register("pool", 4096, Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC)
    local = client.register("local", 4096, Access.NONE)
    listener = server.listen(new_address("server"), [pool], {})
    box: dict[str, object] = {}
    thread = threading.Thread(target=lambda: box.update(conn=listener.accept(timeout=10.0)), daemon=True)
    thread.start()
    conn = client.connect(listener.address, [], {}, timeout=10.0)
    thread.join(10.0)
    remote = conn.remote["pool"]
    n = 50
    before = _counters(device)
    for i in range(n):
        assert conn.compare_and_swap(remote, 8, i, i + 1) == i
        conn.write(local, 0, remote, 64, 64)
        conn.write_with_imm(local, 0, remote, 128, 64, i)
        conn.read(local, 256, remote, 0, 64)
    after = _counters(device)
    got = []
    while len(got) < n:
        batch = server.cq.wait(5.0, max_entries=256)
        assert batch, "doorbells missing"
        got += batch
    assert [c.imm for c in got] == list(range(n))
    assert server.cq.errors == 0  # no receive completion failed (every one reposted by the C poller)
    # Both ends live on the one device: each operation is one request packet and one response
    # (ACK, atomic ACK or read response), each sent once and received once by rxe0.
    expected = 4 * n * 2
    for name in ("sent_pkts", "rcvd_pkts"):
        assert expected <= after[name] - before[name] <= expected + 4, (name, before, after)
    listener.close()
