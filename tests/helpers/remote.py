"""The soft-RoCE lane's second host, driven from the first: a small control channel between its two VMs.

The slot VM (tests/softroce/in-two-vms) runs :func:`serve` on its address of the inter-VM network; the
agent VM's tests hold a :class:`Remote` and ask it to start, kill and restart slot servers there, to hurt
its end of the wire (``tc netem``, its link down for a while), to run the far end of perftest or of
``edgepath.bench.verbs_lat``, and to read its rxe and NIC counters.  One JSON object per line each way; a
fixed set of operations (no shell); requests are handled one at a time; the server ends on ``done`` or
after its lifetime, stopping what it started.  Both ends are VMs the lane made, on a network only they
are on.

    python -m helpers.remote serve --listen 10.77.5.2:7400 --netdev enp0s9 --device rxe0 --lifetime 3000
    python -m helpers.remote call 10.77.5.2:7400 perftest '{"tool": "ib_write_lat", "args": ["-s", "64"]}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgepath.children import Child

PORT = 7400
#: seconds a call waits for its answer: a slot server starts slowly in an emulated VM
CALL_TIMEOUT = 300.0
PERFTEST = ("ib_write_lat", "ib_atomic_lat")


class RemoteError(RuntimeError):
    """The slot host refused or failed an operation (its reason)."""


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30).stdout


@dataclass
class SlotHost:
    """What the slot VM does on request: its children by name, its NIC and RDMA device."""

    netdev: str
    device: str
    children: dict[str, Child] = field(default_factory=dict)
    results: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="slot-host-")))
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One operation: ``{"op": NAME, ...}`` -> its answer (``{"error": ...}`` when it cannot be done)."""
        op = getattr(self, "op_" + str(request.get("op")), None)
        if op is None:
            return {"error": f"no operation {request.get('op')!r}"}
        args = {k: v for k, v in request.items() if k != "op"}
        try:
            return op(**args) or {}
        except Exception as exc:  # the caller's test fails with it; the host keeps serving
            return {"error": f"{type(exc).__name__}: {exc}"}

    def _child(self, name: str) -> Child:
        if name not in self.children:
            raise KeyError(f"no child named {name!r}")
        return self.children[name]

    # -- processes ---------------------------------------------------------------------------------
    def op_slot_server(self, name: str, args: list[str], timeout: float = 240.0) -> dict[str, Any]:
        """``edgepath slot-server ARGS`` as ``name`` (a name used before: its process must have ended)."""
        old = self.children.get(name)
        if old is not None and old.poll() is None:
            raise RuntimeError(f"{name} is still running")
        child = self.children[name] = Child.start(["slot-server", *args], ready_timeout=timeout)
        return {"address": child.address, "pid": child.pid}

    def op_responder(self, name: str, address: str, lifetime: float = 300.0) -> dict[str, Any]:
        """``edgepath.bench.verbs_lat --serve ADDRESS``: a pool and a drained receive queue, one peer."""
        result = self.results / f"{name}.json"
        result.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "edgepath.bench.verbs_lat", "--device", self.device, "--serve", address]
        argv += ["--lifetime", str(lifetime), "--result", str(result)]
        child = self.children[name] = Child.start([], argv=argv, ready_timeout=120.0)
        return {"address": child.address, "pid": child.pid}

    def op_outcome(self, name: str, timeout: float = 60.0) -> dict[str, Any]:
        """Wait for responder ``name`` to end; what it wrote (its received immediates)."""
        code = self._child(name).wait(timeout)
        result = self.results / f"{name}.json"
        return {"returncode": code, **(json.loads(result.read_text()) if result.exists() else {})}

    def op_kill(self, name: str) -> dict[str, Any]:
        child = self._child(name)
        child.kill()
        return {"returncode": child.wait(10.0)}

    def op_wait(self, name: str, timeout: float = 10.0) -> dict[str, Any]:
        return {"returncode": self._child(name).wait(timeout)}

    def op_stop(self, name: str) -> dict[str, Any]:
        return {"returncode": self._child(name).stop()}

    def op_log(self, name: str) -> dict[str, Any]:
        """The last lines ``name`` wrote on stderr (what it logged)."""
        return {"stderr": self._child(name).stderr_tail()}

    def op_perftest(self, tool: str, args: list[str], timeout: float = 180.0) -> dict[str, Any]:
        """The server end of ``tool`` on this device, in the background (bounded by ``timeout``)."""
        if tool not in PERFTEST:
            raise ValueError(f"{tool} is not one of {PERFTEST}")
        argv = ["timeout", str(int(timeout)), tool, "-d", self.device, "-x", "1", *args]
        self.background.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return {}

    # -- this end of the wire ------------------------------------------------------------------------
    def op_netem(self, spec: list[str]) -> dict[str, Any]:
        """``tc netem SPEC`` on this end's egress; an empty SPEC removes it.  The drops it counted so far."""
        shown = json.loads(_run("tc", "-s", "-j", "qdisc", "show", "dev", self.netdev))
        drops = sum(int(q.get("drops", 0)) for q in shown if q.get("kind") == "netem")
        if spec:
            _run("tc", "qdisc", "replace", "dev", self.netdev, "root", "netem", *spec)
        else:
            subprocess.run(["tc", "qdisc", "del", "dev", self.netdev, "root"], capture_output=True, timeout=30)
        return {"drops": drops}

    def op_outage(self, seconds: float) -> dict[str, Any]:
        """This end's link down for ``seconds``, then up again, before answering (this channel crosses it)."""
        _run("ip", "link", "set", self.netdev, "down")
        try:
            time.sleep(seconds)
        finally:
            _run("ip", "link", "set", self.netdev, "up")
        return {}

    def op_counters(self) -> dict[str, Any]:
        """This NIC's packet counts and the rxe device's hardware counters."""
        net = Path("/sys/class/net", self.netdev, "statistics")
        hw = Path("/sys/class/infiniband", self.device, "ports/1/hw_counters")
        return {
            "tx_packets": int((net / "tx_packets").read_text()),
            "rx_packets": int((net / "rx_packets").read_text()),
            "rxe": {p.name: int(p.read_text()) for p in sorted(hw.iterdir())},
        }

    def close(self) -> None:
        for child in self.children.values():
            with contextlib.suppress(Exception):
                child.stop()
        for proc in self.background:
            if proc.poll() is None:
                proc.kill()
            proc.wait(5.0)


def serve(listen: str, host: SlotHost, lifetime: float) -> int:
    """Answer requests on ``listen`` (IP:PORT) until ``done`` (exit status 0) or ``lifetime`` seconds (3)."""
    lock = threading.Lock()
    finished = threading.Event()
    ip, port = listen.rsplit(":", 1)

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                request = json.loads(line)
                with lock:
                    answer = {"done": True} if request.get("op") == "done" else host.handle(request)
                self.wfile.write(json.dumps(answer).encode() + b"\n")
                if request.get("op") == "done":
                    finished.set()
                    return

    socketserver.ThreadingTCPServer.allow_reuse_address = True
    with socketserver.ThreadingTCPServer((ip, int(port)), Handler) as server:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, name="slot-host", daemon=True).start()
        print(f"slot host: serving on {listen} for {lifetime:g} s at most", flush=True)
        done = finished.wait(lifetime)
        server.shutdown()
    host.close()
    print(f"slot host: {'done' if done else 'lifetime over, no done'}", flush=True)
    return 0 if done else 3


@dataclass
class Remote:
    """The agent VM's end: one connection to the slot host, one call at a time."""

    address: str
    timeout: float = CALL_TIMEOUT
    _sock: socket.socket | None = None
    _file: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def reach(cls, address: str, patience: float) -> Remote:
        """Connect, retrying for ``patience`` seconds (the other VM may still be booting)."""
        remote = cls(address)
        deadline = time.monotonic() + patience
        while True:
            try:
                remote.call("counters")
                return remote
            except OSError:
                remote.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            if self._sock is None:
                ip, port = self.address.rsplit(":", 1)
                self._sock = socket.create_connection((ip, int(port)), timeout=self.timeout)
                self._file = self._sock.makefile("rwb")
            self._file.write(json.dumps({"op": op, **args}).encode() + b"\n")
            self._file.flush()
            line = self._file.readline()
        if not line:
            raise ConnectionError(f"slot host {self.address} closed the connection during {op}")
        answer = json.loads(line)
        if "error" in answer:
            raise RemoteError(f"slot host {self.address}, {op}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._file.close()
                self._sock.close()
            self._sock = None


@dataclass
class RemoteChild:
    """A process on the slot host, as the kill-and-rejoin scenario (helpers/failover.py) handles a child."""

    remote: Remote
    name: str
    address: str

    def kill(self) -> None:
        self.remote.call("kill", name=self.name)

    def wait(self, timeout: float | None = None) -> int:
        return int(self.remote.call("wait", name=self.name, timeout=10.0 if timeout is None else timeout)["returncode"])

    def stop(self) -> int:
        return int(self.remote.call("stop", name=self.name)["returncode"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--listen", required=True)
    s.add_argument("--netdev", required=True)
    s.add_argument("--device", default="rxe0")
    s.add_argument("--lifetime", type=float, default=3000.0)
    c = sub.add_parser("call")
    c.add_argument("address")
    c.add_argument("op")
    c.add_argument("args", nargs="?", default="{}", help="the operation's arguments, a JSON object")
    c.add_argument("--patience", type=float, default=0.0, help="seconds to keep trying to reach the host")
    args = parser.parse_args()
    if args.command == "serve":
        sys.exit(serve(args.listen, SlotHost(args.netdev, args.device), args.lifetime))
    remote = Remote.reach(args.address, args.patience) if args.patience else Remote(args.address)
    try:
        print(json.dumps(remote.call(args.op, **json.loads(args.args))))
    finally:
        remote.close()


if __name__ == "__main__":
    main()
