"""The GPU check: one command on a GPU machine, a report that always comes back.

    python3 bench/gpu_check.py [--out DIR] [--dry-run]

Each step runs in its own process with its own timeout (a sticky CUDA error or a kernel that never
stops takes only its step), no step stops the run, and ``report.json`` is rewritten in ``--out``
(default ``$OUT``, else the working directory) after every step.  The steps (bench/gpu_steps.py):

  build        the C host side (bench/gpu_host.c) and the poller fatbin: carried ones if present
  probe        driver, clocks, PCIe link, device attributes (host-native atomics, dma-buf, GPUDirect RDMA)
  smoke        cudaHostRegister of a memfd; exact system-scope atomic counts; GPU CAS next to CPU adds
  baseline     bare ping-pong: a GPU thread echoes a pinned word, host loop in C (round trip)
  poller_rtt   the poller's round trip timed in C, back-off 0 and 32 ns; in-kernel clock64 (one-way)
  device_pool  the pool in device memory: claims, requests, doorbells in HBM, ids checked in place
  gpu_tests    pytest -m gpu tests/dma/test_gpu_poller.py (named: nothing else is collected)
  echo         2,000 echo requests through a --slots gpu slot server and an agent, concurrency 1 and 8

Needs on the GPU machine only Python 3.12, numpy, cupy-cuda13x, cuda-bindings, pytest; nvcc and gcc
only if nothing was carried.  Installs nothing: ``--prepare`` (here, on a machine with PyPI) puts in
``.gpu-carry/`` what the other machine lacks, and the steps find it there (docs/GPU.md lists it).
``--dry-run`` runs every step's plumbing here, with a CPU thread in place of the GPU: GPU steps are
marked "not run: no GPU", and no figure in a dry-run report is a GPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_steps  # noqa: E402  (a sibling script, not the edgepath package)

ROOT = gpu_steps.ROOT
CARRY = gpu_steps.CARRY
ARCHES = ("90",)
PACKAGES = {"edgepath": "edgepath", "edge": "edge", "dpu": "dpu", "dma": "dma", "native": "native", "bench": "bench"}
# (step, timeout in seconds, needs the edgepath package): the timeouts add up to under 10 minutes.
PLAN = (
    ("probe", 45, False),
    ("smoke", 45, False),
    ("baseline", 45, False),
    ("poller_rtt", 75, False),
    ("device_pool", 45, False),
    ("gpu_tests", 150, True),
    ("echo", 120, True),
)


def write_report(report: dict[str, Any], out: Path) -> None:
    """Atomically: a reader (or a killed run) sees the previous report or this one, never half of one."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, out / "report.json")


def build(work: Path) -> dict[str, Any]:
    """The host library and the fatbin: carried (``.gpu-carry/``) or built here."""
    done: dict[str, Any] = {}
    carried = CARRY / gpu_steps.host_lib_name()
    if carried.is_file():
        done["host_lib"] = f"carried {carried.relative_to(ROOT)}"
        os.environ[gpu_steps.HOST_LIB_ENV] = str(carried)
    else:
        stale = sorted(p.name for p in CARRY.glob("libgpucheck-*.so"))
        built = gpu_steps.host_lib_build(work / carried.name)
        done["host_lib"] = "built with gcc" + (f" (carried {stale} do not match these sources)" if stale else "")
        os.environ[gpu_steps.HOST_LIB_ENV] = str(built)
    cb = gpu_steps.cuda_build()
    fatbin = CARRY / cb.fatbin_name(ARCHES)
    if fatbin.is_file():
        os.environ[cb.FATBIN_ENV] = str(fatbin)
        done["fatbin"] = f"carried {fatbin.relative_to(ROOT)} (sm_{ARCHES[0]}, nvcc not needed)"
    else:
        done["fatbin"] = f"not carried ({fatbin.name}): the steps build it with nvcc for the device found"
    return done


def package_view(work: Path) -> Path:
    """A folder where ``import edgepath.dma`` works without installing: symlinks to the repository's
    folders under the package names pyproject.toml maps them to."""
    view = work / "view" / "edgepath"
    view.mkdir(parents=True)
    for name in os.listdir(ROOT / "edgepath"):
        (view / name).symlink_to(ROOT / "edgepath" / name)
    for sub, folder in PACKAGES.items():
        if sub != "edgepath":
            (view / sub).symlink_to(ROOT / folder)
    return view.parent


def step_env(view: Path) -> dict[str, str]:
    """PYTHONPATH for the steps that import edgepath: the package view and the carried cffi/pycparser."""
    paths = [str(view)]
    if (CARRY / "site").is_dir():
        paths.append(str(CARRY / "site"))
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def run_step(name: str, timeout: int, env: dict[str, str], args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One step in its own process group, killed whole at its timeout; its JSON or what went wrong."""
    result_path = work / f"{name}.json"
    cmd = [sys.executable, str(HERE / "gpu_steps.py"), name, "--json", str(result_path)]
    cmd += ["--iterations", str(args.iterations), "--requests", str(args.requests), "--timeout", str(timeout - 15)]
    if args.dry_run:
        cmd.append("--dry-run")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    seconds = round(time.monotonic() - t0, 2)
    if timed_out:
        return {"status": "timeout", "seconds": seconds, "error": f"killed after {timeout} s", "log": output[-3000:]}
    if not result_path.is_file():
        return {
            "status": "failed",
            "seconds": seconds,
            "error": f"exit {proc.returncode}, no result",
            "log": output[-3000:],
        }
    result = {**json.loads(result_path.read_text()), "seconds": seconds}
    if output.strip():
        result["log"] = output[-2000:]
    return result


def prepare(python: str) -> None:
    """Here, with PyPI: what the GPU machine lacks, into .gpu-carry/ (and native/_core for ``python``)."""
    CARRY.mkdir(exist_ok=True)
    gpu_steps.host_lib_build(CARRY / gpu_steps.host_lib_name())
    cb = gpu_steps.cuda_build()
    cb.build_poller(ARCHES, CARRY)
    version = subprocess.check_output([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], text=True)
    with tempfile.TemporaryDirectory(prefix="edgepath-prep-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp]
        cmd += ["--python-version", version.strip(), "--implementation", "cp", "--platform", "manylinux2014_x86_64"]
        subprocess.run([*cmd, "cffi", "pycparser"], check=True)
        for wheel in Path(tmp).glob("*.whl"):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(CARRY / "site")
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        vpy = str(venv / "bin" / "python")
        subprocess.run([vpy, "-m", "pip", "install", "-q", "--no-deps", "setuptools", "numpy"], check=True)
        env = {**os.environ, "PYTHONPATH": str(CARRY / "site")}
        subprocess.run([vpy, str(ROOT / "native" / "build.py")], check=True, cwd=ROOT, env=env)
    print(f"gpu_check: prepared {CARRY} and native/_core for Python {version.strip()}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="default: $OUT, else .")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: every step's plumbing, a CPU thread as GPU")
    parser.add_argument("--iterations", type=int, default=None, help="timed iterations (default 10000; dry run 500)")
    parser.add_argument("--requests", type=int, default=None, help="echo requests (default 2000; dry run 200)")
    parser.add_argument("--only", action="append", choices=[p[0] for p in PLAN], help="run only these steps")
    parser.add_argument("--prepare", metavar="PYTHON", help="here: build .gpu-carry/ for that interpreter, and exit")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    args.iterations = args.iterations or (500 if args.dry_run else 10_000)
    args.requests = args.requests or (200 if args.dry_run else 2_000)
    if args.iterations < 1 or args.requests < 1:
        parser.error("--iterations and --requests must be at least 1")
    report: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "dry_run": args.dry_run,
        "steps": {},
    }
    begin = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgepath-gpu-check-") as tmp:
        work = Path(tmp)
        try:
            report["steps"]["build"] = {"status": "ok", **build(work)}
        except Exception as exc:
            report["steps"]["build"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        write_report(report, args.out)
        plain = dict(os.environ)
        with_package = step_env(package_view(work))
        for name, timeout, needs_package in PLAN:
            if args.only and name not in args.only:
                continue
            result = run_step(name, timeout, with_package if needs_package else plain, args, work)
            report["steps"][name] = result
            report["seconds"] = round(time.monotonic() - begin, 1)
            write_report(report, args.out)
            print(f"gpu_check: {name}: {result['status']} ({result['seconds']} s)", file=sys.stderr)
    statuses = [s["status"] for s in report["steps"].values()]
    report["result"] = "ok" if all(s == "ok" for s in statuses) else "failed"
    report["seconds"] = round(time.monotonic() - begin, 1)
    write_report(report, args.out)
    print(f"gpu_check: {report['result']}; report in {args.out / 'report.json'}", file=sys.stderr)
    return 0 if report["result"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
