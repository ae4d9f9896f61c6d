"""The prepared GPU check: one command on a machine with a CUDA GPU, a JSON report, under 5 minutes.

    python3 bench/gpu_check.py [--wheels .whl] [--out gpu_report.json]

Steps (each recorded in the report; the first failure stops the run with a non-zero exit):
  setup    (skipped with --no-setup) install the carried wheels (``--prepare`` fetches them, and can build
           the cffi extension for the GPU image's Python, on a machine with PyPI), build that extension
           unless carried, install edgepath editable; nothing from the network
  device   a CUDA device through cupy; without one: exit 3 and "no GPU", nothing measured
  compile  nvcc builds the poller fatbin for this device; cupy loads it eagerly
  tests    pytest -m gpu (the GPU test subset)
  (a)      host writes a 128-token request into a slot and rings its doorbell -> the kernel's hand-off is
           seen by the host, >= 10k iterations: p50/p99 of doorbell->seen and write+doorbell->seen
  (b)      end-to-end echo through a slot server with ``--slots gpu`` and an agent over loopback

The figure (a) is a round trip (host store -> kernel poll -> ring entry -> host load), so it bounds the
one-way "kernel observes READY" time from above; the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGETS = {"doorbell_to_ready_p50_us": 5.0, "doorbell_to_ready_p99_us": 20.0}
WHEELS = ("cffi", "pycparser")
EXIT_FAILED, EXIT_NO_GPU = 1, 3
_SETUP_ENV = "EDGEPATH_GPU_CHECK_SETUP"


class CheckFailed(RuntimeError):
    pass


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    import numpy as np

    us = np.asarray(samples_ns, dtype=np.float64) / 1000.0
    return {
        "n": len(us),
        "p50_us": round(float(np.percentile(us, 50)), 3),
        "p90_us": round(float(np.percentile(us, 90)), 3),
        "p99_us": round(float(np.percentile(us, 99)), 3),
        "p999_us": round(float(np.percentile(us, 99.9)), 3),
        "max_us": round(float(us.max()), 3),
    }


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
        from edgepath.dma.wire import claim_word
        from edgepath.native.abi import lib

        cur = self.pool.word(slot)
        new = claim_word(cur, self.claimant)
        if lib.ep_cas64(self._states + slot, cur, new) != cur:
            raise CheckFailed(f"slot {slot} changed under the claim")
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
        from edgepath.dma.wire import doorbell_word
        from edgepath.native.abi import lib

        lib.ep_store64(self._doorbells + slot, doorbell_word(slot, generation) if value is None else value)

    def finish(self, slot: int, generation: int) -> None:
        """RUNNING -> DONE -> FREE, as the model side does after the handler."""
        from edgepath.native.abi import Event, ffi, lib

        for event in (Event.COMPLETE, Event.RELEASE):
            if lib.ep_apply(self._states + slot, event, generation, 0, ffi.NULL) != lib.EP_OK:
                raise CheckFailed(f"slot {slot}: {event.name} refused on {self.pool.word(slot):#x}")


def wait_handoff(poller: Any, timeout: float = 1.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        got = poller.poll(1)
        if got:
            return got[0]
        if time.monotonic() > deadline:
            raise CheckFailed(f"no hand-off from the GPU poller within {timeout} s (counters {poller.counters()})")


def measure_doorbell(iterations: int, slots: int = 64, tokens: int = 128) -> dict[str, Any]:
    """(a): write a ``tokens``-token request, ring, time until the host sees the kernel's hand-off."""
    import numpy as np

    from edgepath.dma.gpu import start_mapped_poller
    from edgepath.dma.loopback import LoopbackTransport
    from edgepath.dma.pool import SlotPool
    from edgepath.dma.transport import Access
    from edgepath.native.abi import State, lib

    transport = LoopbackTransport()
    try:
        dims = SlotPool.layout_for(slots, tokens, tokens)
        region = transport.register("pool", int(dims["total_size"]), Access.REMOTE_WRITE | Access.REMOTE_ATOMIC)
        pool = SlotPool.create(region.buf, slots, tokens, tokens, 10**9, 1)
        poller = start_mapped_poller(region.buf, slots)
        try:
            writer = LocalWriter(pool)
            payload = np.random.default_rng(5).integers(0, 131072, size=(slots, tokens), dtype=np.int32)
            ring_ns, write_ns = [], []
            for i in range(iterations + 200):  # the first 200 warm up
                slot = i % slots
                gen = writer.claim(slot)
                t0 = lib.ep_now_ns()
                writer.write(slot, gen, payload[slot], i)
                t1 = lib.ep_now_ns()
                writer.ring(slot, gen)
                got = wait_handoff(poller)
                t2 = lib.ep_now_ns()
                if got != (slot, gen) or pool.word(slot) & 0xFF != State.RUNNING:
                    raise CheckFailed(f"hand-off {got} for slot {slot} gen {gen}, word {pool.word(slot):#x}")
                writer.finish(slot, gen)
                if i >= 200:
                    ring_ns.append(t2 - t1)
                    write_ns.append(t2 - t0)
            counters = poller.counters()
        finally:
            poller.close()
    finally:
        transport.close()
    return {
        "what": "host stores a doorbell -> kernel sees it, CLAIMED->READY->RUNNING, ring entry -> host sees it "
        "(a round trip: an upper bound of doorbell -> kernel observes READY)",
        "placement": "mapped (loopback memfd, cudaHostRegister)",
        "tokens": tokens,
        "doorbell_to_handoff": percentiles(ring_ns),
        "write_and_doorbell_to_handoff": percentiles(write_ns),
        "kernel_counters": counters,
    }


def measure_echo(requests: int, tokens: int = 128) -> dict[str, Any]:
    """(b): echo through a slot server polled by the GPU, an agent over loopback, one request at a time."""
    from edgepath.dpu.demo import run_demo

    out = {}
    for concurrency in (1, 8):
        report = run_demo(requests=requests, slots=8, concurrency=concurrency, tokens=tokens, memory="gpu")
        out[f"concurrency_{concurrency}"] = {
            "requests": report.requests,
            "ok": report.ok,
            "errors": report.errors,
            "wrong_tokens": report.mismatches,
            "slots_free_after": f"{report.slots_free_after}/{report.slots}",
            "requests_per_s": round(report.requests / report.seconds, 1),
            "stage_us": {k: dict(zip(("p50", "p99", "max"), v, strict=True)) for k, v in report.stage_us.items()},
        }
        if report.ok != requests or report.mismatches or report.slots_free_after != report.slots:
            raise CheckFailed(f"echo through the GPU pool failed: {out[f'concurrency_{concurrency}']}")
    return out


def setup(wheels: Path | None) -> dict[str, Any]:
    """Carried wheels, the native extension, edgepath editable: all offline."""
    py = sys.executable
    done: dict[str, Any] = {}
    if wheels is not None:
        files = sorted(str(p) for p in wheels.glob("*.whl"))
        if not files:
            raise CheckFailed(f"no wheels in {wheels}")
        _run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", *files])
        done["wheels"] = [Path(f).name for f in files]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if (ROOT / "native" / f"_core{suffix}").exists():
        done["native"] = f"carried _core{suffix}"
    else:
        _run([py, str(ROOT / "native" / "build.py")])
        done["native"] = f"built _core{suffix}"
    _run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-build-isolation", "-e", str(ROOT)])
    return done


def _run(cmd: list[str], timeout: float = 180) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise CheckFailed(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return proc.stdout


def prepare(dest: Path, python: str | None) -> None:
    """On a machine with PyPI (no GPU needed): the wheels the GPU image lacks, for its Python, and, with
    ``python`` (an interpreter of that version), the cffi extension built for it into native/."""
    version = "3.12"
    if python:
        version = _run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).strip()
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 27, 28)] + ["manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    cmd += ["--python-version", version, "--implementation", "cp"]
    for p in platforms:
        cmd += ["--platform", p]
    _run([*cmd, *WHEELS])
    if python:
        with tempfile.TemporaryDirectory(prefix="edgepath-prep-") as tmp:
            _run([python, "-m", "venv", tmp])
            vpy = str(Path(tmp) / "bin" / "python")
            _run([vpy, "-m", "pip", "install", "-q", "--no-deps", "setuptools", *map(str, dest.glob("*.whl"))])
            _run([vpy, str(ROOT / "native" / "build.py")])
    print(f"gpu_check: prepared for Python {version}: wheels in {dest}", file=sys.stderr)


def run_tests() -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", "tests"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        check=False,
    )
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    result = {"exit": proc.returncode, "summary": summary, "tail": proc.stdout[-3000:] + proc.stderr[-1000:]}
    if proc.returncode != 0:
        raise CheckFailed(f"GPU tests failed: {summary}\n{result['tail']}")
    if " skipped" in summary and " passed" not in summary:
        raise CheckFailed(f"GPU tests were all skipped on a GPU machine: {result['tail']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu_report.json"))
    parser.add_argument("--wheels", type=Path, default=None, help="folder of wheels to install first (offline)")
    parser.add_argument("--no-setup", action="store_true", help="edgepath is already installed and built here")
    parser.add_argument("--iterations", type=int, default=10_000, help="(a) iterations, at least 10000")
    parser.add_argument("--echo-requests", type=int, default=10_000)
    parser.add_argument(
        "--prepare", type=Path, default=None, help="on a machine with PyPI: put the GPU image's missing wheels here"
    )
    parser.add_argument("--python", default=None, help="with --prepare: that Python's version; build native/ for it")
    args = parser.parse_args(argv)
    if args.prepare is not None:
        try:
            prepare(args.prepare, args.python)
        except CheckFailed as exc:
            print(f"gpu_check: prepare failed: {exc}", file=sys.stderr)
            return EXIT_FAILED
        return 0
    if args.iterations < 10_000:
        parser.error("--iterations must be at least 10000")

    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "targets": TARGETS,
        "steps": {},
    }
    begin = time.monotonic()
    if not args.no_setup:
        try:
            done = {**setup(args.wheels), "seconds": round(time.monotonic() - begin, 2)}
        except CheckFailed as exc:
            report["steps"]["setup"] = {"error": str(exc)}
            report["result"] = "failed"
            args.out.write_text(json.dumps(report, indent=2) + "\n")
            print(f"gpu_check: setup: FAILED; report in {args.out}", file=sys.stderr)
            return EXIT_FAILED
        print("gpu_check: setup: ok", file=sys.stderr)
        # A fresh interpreter sees the editable install (its .pth is read at start-up only).
        os.environ[_SETUP_ENV] = json.dumps(done)
        again = ["--no-setup", "--out", str(args.out), "--iterations", str(args.iterations)]
        os.execv(sys.executable, [sys.executable, __file__, *again, "--echo-requests", str(args.echo_requests)])
    if _SETUP_ENV in os.environ:
        report["steps"]["setup"] = json.loads(os.environ.pop(_SETUP_ENV))
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("device", _device),
        ("compile", _compile),
        ("tests", run_tests),
        ("a_doorbell", lambda: measure_doorbell(args.iterations)),
        ("b_echo", lambda: measure_echo(args.echo_requests)),
    ]
    code = 0
    for name, step in steps:
        t = time.monotonic()
        try:
            report["steps"][name] = step()
        except CheckFailed as exc:
            report["steps"][name] = {"error": str(exc)}
            code = EXIT_FAILED
        except Exception as exc:
            report["steps"][name] = {"error": f"{type(exc).__name__}: {exc}"}
            code = EXIT_NO_GPU if name == "device" and "GpuUnavailable" in type(exc).__name__ else EXIT_FAILED
        report["steps"][name] = {"seconds": round(time.monotonic() - t, 2), **_as_dict(report["steps"][name])}
        print(f"gpu_check: {name}: {'ok' if 'error' not in report['steps'][name] else 'FAILED'}", file=sys.stderr)
        if code:
            break
    if code == 0:
        a = report["steps"]["a_doorbell"]["doorbell_to_handoff"]
        report["targets_met"] = {
            "doorbell_to_ready_p50_us": a["p50_us"] <= TARGETS["doorbell_to_ready_p50_us"],
            "doorbell_to_ready_p99_us": a["p99_us"] <= TARGETS["doorbell_to_ready_p99_us"],
        }
    report["seconds"] = round(time.monotonic() - begin, 1)
    report["result"] = "ok" if code == 0 else ("no GPU" if code == EXIT_NO_GPU else "failed")
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if code == EXIT_NO_GPU:
        print(f"gpu_check: no GPU: {report['steps']['device']['error']}", file=sys.stderr)
    print(f"gpu_check: {report['result']}; report in {args.out}", file=sys.stderr)
    return code


def _as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {"value": value}


def _device() -> dict[str, Any]:
    from edgepath.dma.gpu import require_device

    info = require_device()
    return {
        "name": info.name,
        "compute_capability": info.compute_capability,
        "host_native_atomics": info.host_native_atomics,
        "gpudirect_rdma": info.gpudirect_rdma,
        "rdma_writes_ordering": info.rdma_writes_ordering,
        "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING"),
    }


def _compile() -> dict[str, Any]:
    from edgepath.dma.gpu import load_cupy, require_device
    from edgepath.native.cuda_build import build_poller

    info = require_device()
    t = time.monotonic()
    fatbin = build_poller((info.compute_capability,))
    cp = load_cupy()
    module = cp.RawModule(path=str(fatbin))
    module.get_function("ep_gpu_poller")
    return {"fatbin": str(fatbin), "build_and_load_s": round(time.monotonic() - t, 2)}


if __name__ == "__main__":
    sys.exit(main())
