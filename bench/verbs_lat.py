"""Latency of the verbs transport's hot operations, for comparison with perftest on the same device.

``python -m edgepath.bench.verbs_lat --device rxe0 --addr 10.77.0.1`` connects two endpoints on the
device (both ends on one rxe, like ``ib_write_lat`` run against the local address) and times, per
call, from Python, what the agent does per request:

* ``write_imm64``: one WRITE_WITH_IMM of 64 bytes (data + doorbell in one work request);
* ``write64_doorbell``: a WRITE of 64 bytes and an 8-byte WRITE_WITH_IMM doorbell posted together,
  one completion waited for (``write_then_imm``: what the agent does per request);
* ``cas``: one remote compare-and-swap that succeeds (a claim).

Each operation returns after its send completion, i.e. after the responder's ACK: a full round
trip.  Prints one JSON object: p50/p99/mean in microseconds per operation.

Across two hosts (the soft-RoCE lane's two VMs): ``--serve IP:PORT`` on one runs the responder alone (its
pool, its receive queue drained; ``ready IP:PORT`` once it listens, the immediates it received at the end),
``--connect IP:PORT`` on the other times the same operations against it.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgepath.peer_secret import fresh_keys, peer_keys, secret_given
from edgepath.transports.base import Access, Connection, MemoryRegion
from edgepath.transports.registry import make_transport


def _stats(samples: list[int]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64) / 1e3
    return {
        "p50_us": round(float(np.percentile(a, 50)), 2),
        "p99_us": round(float(np.percentile(a, 99)), 2),
        "mean_us": round(float(a.mean()), 2),
        "n": len(samples),
    }


#: the responder's pool: what the operations below (and the lane's transport test) write, read and swap
POOL_ACCESS = Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC


def measure(
    conn: Connection, local: MemoryRegion, iterations: int, warmup: int, drain: Callable[[], None]
) -> dict[str, object]:
    """Time each operation ``iterations`` times (after ``warmup``) on ``conn``; ``drain`` empties the responder's
    receive queue now and then (a no-op when the responder is another process, which drains its own)."""
    remote = conn.remote["pool"]
    clock = time.perf_counter_ns
    results: dict[str, object] = {"iterations": iterations}

    samples = []
    for i in range(warmup + iterations):
        t0 = clock()
        conn.write_with_imm(local, 0, remote, 1024, 64, i)
        t1 = clock()
        if i >= warmup:
            samples.append(t1 - t0)
        if i % 256 == 0:
            drain()
    results["write_imm64"] = _stats(samples)
    drain()

    samples = []
    for i in range(warmup + iterations):
        t0 = clock()
        conn.write_then_imm(local, 0, remote, 1024, 64, 64, 2048, 8, i)
        t1 = clock()
        if i >= warmup:
            samples.append(t1 - t0)
        if i % 256 == 0:
            drain()
    results["write64_doorbell"] = _stats(samples)
    drain()

    samples = []
    for i in range(warmup + iterations):
        t0 = clock()
        found = conn.compare_and_swap(remote, 0, i, i + 1)
        t1 = clock()
        if found != i:
            raise RuntimeError(f"CAS found {found}, expected {i}")
        if i >= warmup:
            samples.append(t1 - t0)
    results["cas"] = _stats(samples)
    return results


def run(device: str, gid_index: int, addr: str, port: int, iterations: int, warmup: int) -> dict[str, object]:
    """Both ends on ``device``, in this process."""
    keys = peer_keys(None) if secret_given(None) else fresh_keys("this benchmark's own")  # both ends are here
    server = make_transport("verbs", keys, device=device, gid_index=gid_index)
    client = make_transport("verbs", keys, device=device, gid_index=gid_index)
    try:
        pool = server.register("pool", 4096, POOL_ACCESS)
        local = client.register("local", 4096, Access.NONE)
        listener = server.listen(f"{addr}:{port}", [pool], {})
        box: dict[str, object] = {}
        thread = threading.Thread(target=lambda: box.update(conn=listener.accept(timeout=30.0)), daemon=True)
        thread.start()
        conn = client.connect(listener.address, [], {}, timeout=30.0)
        thread.join(30.0)

        def drain() -> None:
            while server.cq.poll(256):
                pass

        results = {"device": device, **measure(conn, local, iterations, warmup, drain)}
        listener.close()
        return results
    finally:
        client.close()
        server.close()


def connect(device: str, gid_index: int, address: str, iterations: int, warmup: int) -> dict[str, object]:
    """The operations against a responder (``--serve``) at ``address``, from ``device``."""
    client = make_transport("verbs", peer_keys(None), device=device, gid_index=gid_index)
    try:
        local = client.register("local", 4096, Access.NONE)
        conn = client.connect(address, [], {}, timeout=30.0)
        return {"device": device, "peer": address, **measure(conn, local, iterations, warmup, lambda: None)}
    finally:
        client.close()


def serve(device: str, gid_index: int, address: str, lifetime: float) -> dict[str, object]:
    """The responder: one pool at ``address``, one peer at a time until one has come and gone (or ``lifetime``
    seconds passed); the immediates it received."""
    server = make_transport("verbs", peer_keys(None), device=device, gid_index=gid_index)
    try:
        pool = server.register("pool", 4096, POOL_ACCESS)
        listener = server.listen(address, [pool], {})
        print(f"ready {address}", flush=True)
        deadline = time.monotonic() + lifetime
        conn = None
        while conn is None and time.monotonic() < deadline:
            conn = listener.accept(timeout=1.0)
        received = 0
        while conn is not None and conn.check_alive() and time.monotonic() < deadline:
            received += len(server.cq.wait(0.1, max_entries=256))
        received += len(server.cq.poll(256))
        listener.close()
        return {"device": device, "connected": conn is not None, "received": received}
    finally:
        server.close()


def parse_perftest(text: str) -> dict[str, float]:
    """The result row of ib_write_lat / ib_atomic_lat: t_typical (their median) and the 99th percentile."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 9 and all(f.replace(".", "", 1).isdigit() for f in fields[:9]):
            return {"p50_us": float(fields[4]), "p99_us": float(fields[7]), "n": int(fields[1])}
    raise ValueError(f"no perftest result row found in:\n{text}")


def compare(ours: dict[str, Any], write_lat: str, atomic_lat: str) -> list[str]:
    """Report lines: each of our operations against the perftest figure it is compared with."""
    rows = [
        ("write_imm64", "ib_write_lat -s 64", parse_perftest(write_lat)),
        ("write64_doorbell", "ib_write_lat -s 64", parse_perftest(write_lat)),
        ("cas", "ib_atomic_lat CMP_AND_SWAP", parse_perftest(atomic_lat)),
    ]
    lines = [
        f"{'edgepath verbs op':<18} {'p50 us':>8} {'p99 us':>8}   {'perftest':<28} "
        f"{'p50 us':>8} {'p99 us':>8}  p50 ratio"
    ]
    for key, tool, ref in rows:
        mine = ours[key]
        ratio = mine["p50_us"] / ref["p50_us"]
        lines.append(
            f"{key:<18} {mine['p50_us']:>8.2f} {mine['p99_us']:>8.2f}   {tool:<28} {ref['p50_us']:>8.2f} "
            f"{ref['p99_us']:>8.2f}  {ratio:.2f}"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", nargs=3, metavar=("OURS_JSON", "WRITE_LAT_OUT", "ATOMIC_LAT_OUT"))
    parser.add_argument("--device", default="rxe0")
    parser.add_argument("--gid-index", type=int, default=1)
    parser.add_argument("--addr", default="10.77.0.1")
    parser.add_argument("--port", type=int, default=19999)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    peer = parser.add_mutually_exclusive_group()
    peer.add_argument("--serve", metavar="IP:PORT", help="be the responder for a --connect on another host")
    peer.add_argument("--connect", metavar="IP:PORT", help="time the operations against a --serve responder")
    parser.add_argument("--lifetime", type=float, default=600.0, help="--serve: seconds at most")
    parser.add_argument("--result", type=Path, help="--serve: also write the outcome (JSON) here")
    args = parser.parse_args()
    if args.compare:
        ours, write_lat, atomic_lat = (Path(f).read_text() for f in args.compare)
        print("\n".join(compare(json.loads(ours), write_lat, atomic_lat)))
        return
    if args.serve:
        outcome = serve(args.device, args.gid_index, args.serve, args.lifetime)
        if args.result is not None:
            args.result.write_text(json.dumps(outcome))
    elif args.connect:
        outcome = connect(args.device, args.gid_index, args.connect, args.iterations, args.warmup)
    else:
        outcome = run(args.device, args.gid_index, args.addr, args.port, args.iterations, args.warmup)
    print(json.dumps(outcome))


if __name__ == "__main__":
    main()
