"""The GPU check: one command on a GPU machine, a report that always comes back.

    python3 bench/gpu_check.py [--out DIR] [--dry-run]

Each step runs in its own process with its own timeout (a sticky CUDA error or a kernel that never
stops takes only its step), no step stops the run, and ``report.json`` is rewritten in ``--out``
(default ``$OUT``, else the working directory) after every step.  The steps (bench/gpu_steps.py):

  build        the C host side (bench/gpu_host.c) and the poller fatbin: carried ones if present
  probe        driver, clocks, PCIe link, device attributes, the host link's native atomics
  smoke        cudaHostRegister of a memfd; exact system-scope atomic counts; GPU CAS next to CPU adds
  baseline     the GPU timer's resolution and the SM clock; bare ping-pong (round trip, timer calibration)
  poller_rtt   the real poller: one way (doorbell -> the kernel sees it, %globaltimer), round trips, in-kernel
  device_pool  the pool in device memory: claims, requests, doorbells in HBM, ids checked in place
  gpu_tests    pytest -m gpu tests/slots/test_gpu_poller.py (named: nothing else is collected)
  echo         echo requests through a --slots gpu slot server and an agent, concurrency 1 and 8

Needs on the GPU machine only Python 3.12, numpy, cupy-cuda13x and pytest; nvcc and gcc only if nothing
was carried.  Installs nothing: ``--prepare`` (here, on a machine with PyPI) puts in ``.gpu-carry/``
what the other machine lacks, and the steps find it there (docs/GPU.md lists it); a step that needs a
carry that is not there is reported ``not run: no carry``.  ``--dry-run`` runs every step's plumbing
here, with CPU threads in place of the GPU: the report says ``dry-run (CPU twin)`` at the top and on
every figure, and no figure in it is a GPU figure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_steps  # noqa: E402  (a sibling script, not the edgepath package)

ROOT = gpu_steps.ROOT
CARRY = gpu_steps.CARRY
ARCHES = ("90",)
DRY = gpu_steps.DRY
# (step, timeout in seconds, needs the edgepath package).  With BUILD_BUDGET the timeouts are the
# whole check's worst case: 6 minutes, so that a rerun fits in one lease of device time (docs/GPU.md).
BUILD_BUDGET = 45
PLAN = (
    ("probe", 30, False),
    ("smoke", 30, False),
    ("baseline", 30, False),
    ("poller_rtt", 60, False),
    ("device_pool", 30, False),
    ("gpu_tests", 90, True),
    ("echo", 45, True),
)
WORST_CASE_S = BUILD_BUDGET + sum(timeout for _, timeout, _ in PLAN)
#: what a step that imports edgepath needs, and --prepare carries: cffi (with its compiled backend) and
#: pycparser unpacked, and edgepath's cffi extension built for the GPU machine's Python
CARRY_PACKAGES = ("cffi", "pycparser")


def write_report(report: dict[str, Any], out: Path) -> None:
    """Atomically: a reader (or a killed run) sees the previous report or this one, never half of one."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, out / "report.json")


def build(work: Path) -> dict[str, Any]:
    """The host library and the fatbin: carried (``.gpu-carry/``) or built here, within BUILD_BUDGET."""
    done: dict[str, Any] = {}
    deadline = time.monotonic() + BUILD_BUDGET
    carried = CARRY / gpu_steps.host_lib_name()
    if carried.is_file():
        done["host_lib"] = f"carried {carried.relative_to(ROOT)}"
        os.environ[gpu_steps.HOST_LIB_ENV] = str(carried)
    else:
        stale = sorted(p.name for p in CARRY.glob("libgpucheck-*.so"))
        built = gpu_steps.host_lib_build(work / carried.name, timeout=BUILD_BUDGET / 3)
        done["host_lib"] = "built with gcc" + (f" (carried {stale} do not match these sources)" if stale else "")
        os.environ[gpu_steps.HOST_LIB_ENV] = str(built)
    cb = gpu_steps.cuda_build()
    fatbin = CARRY / cb.fatbin_name(ARCHES)
    if fatbin.is_file():
        os.environ[cb.FATBIN_ENV] = str(fatbin)
        done["fatbin"] = f"carried {fatbin.relative_to(ROOT)} (sm_{ARCHES[0]}, nvcc not needed)"
    elif cb.find_nvcc() is None:
        done["fatbin"] = f"not carried ({fatbin.name}) and no nvcc: every GPU step will fail to load the poller"
    else:  # built once now, bounded, into the cache the steps read
        left = max(5.0, deadline - time.monotonic())
        path = cb.build_poller(ARCHES, work / "fatbin", timeout=left)
        os.environ[cb.FATBIN_ENV] = str(path)
        done["fatbin"] = f"not carried ({fatbin.name}): built with nvcc for sm_{ARCHES[0]}"
    return done


def package_view(work: Path) -> Path:
    """A folder where ``import edgepath.slots`` works without installing: symlinks to the repository's
    folders under the package names pyproject.toml maps them to, and in ``native`` the cffi extension
    carried for this Python (``.gpu-carry/native/``) beside the repository's own files."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    root = work / "view"
    for package, folder in package_dir.items():
        target = root.joinpath(*package.split("."))
        target.parent.mkdir(parents=True, exist_ok=True)
        if package == "edgepath":
            target.mkdir()
            for entry in os.listdir(ROOT / folder):
                (target / entry).symlink_to(ROOT / folder / entry)
        elif package == "edgepath.native":
            target.mkdir()
            for entry in [*os.listdir(ROOT / folder), *carried_extensions()]:
                source = ROOT / folder / entry if (ROOT / folder / entry).exists() else CARRY / "native" / entry
                if not (target / entry).exists():
                    (target / entry).symlink_to(source)
        elif not target.exists():
            target.symlink_to(ROOT / folder)
    return root


def carried_extensions() -> list[str]:
    return sorted(p.name for p in (CARRY / "native").glob("*.so")) if (CARRY / "native").is_dir() else []


def sources_digest() -> str:
    """Of the C sources edgepath's cffi extension is built from: a carried extension must match them."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "native").glob("*.[ch]")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def missing_carry() -> list[str]:
    """What a step that imports edgepath lacks on this interpreter (empty: it can run)."""
    missing = []
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    core = f"_core{suffix}"
    if (ROOT / "native" / core).is_file():
        pass
    elif (CARRY / "native" / core).is_file():
        manifest = CARRY / "manifest.json"
        made_from = json.loads(manifest.read_text()).get("sources_digest") if manifest.is_file() else None
        if made_from != sources_digest():
            missing.append(f".gpu-carry/native/{core} was built from other sources than these (rerun --prepare)")
    else:
        missing.append(f"edgepath's cffi extension for this Python ({core})")
    for name in CARRY_PACKAGES:
        if not (CARRY / "site" / name).is_dir() and not importable(name):
            missing.append(f"{name} (not installed, not in .gpu-carry/site)")
    return missing


def importable(name: str) -> bool:
    done = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, check=False)
    return done.returncode == 0


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
    cmd += ["--iterations", str(args.iterations), "--requests", str(args.requests), "--timeout", str(timeout - 10)]
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
    if args.dry_run and result["status"] == "ok":
        result["status"] = f"ok, {DRY}"
    if output.strip():
        result["log"] = output[-2000:]
    return result


def prepare(python: str) -> None:
    """Here, with PyPI: what the GPU machine lacks, into .gpu-carry/ (git-ignored), for ``python``."""
    if CARRY.exists():
        shutil.rmtree(CARRY)
    (CARRY / "native").mkdir(parents=True)
    gpu_steps.host_lib_build(CARRY / gpu_steps.host_lib_name())
    cb = gpu_steps.cuda_build()
    cb.build_poller(ARCHES, CARRY)
    version = subprocess.check_output([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], text=True)
    version = version.strip()
    with tempfile.TemporaryDirectory(prefix="edgepath-prep-") as tmp:
        wheels = Path(tmp) / "wheels"
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(wheels)]
        cmd += ["--python-version", version, "--implementation", "cp", "--platform", "manylinux2014_x86_64"]
        subprocess.run([*cmd, *CARRY_PACKAGES], check=True)
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(CARRY / "site")
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        vpy = str(venv / "bin" / "python")
        subprocess.run([vpy, "-m", "pip", "install", "-q", "setuptools", *CARRY_PACKAGES], check=True)
        script = (
            "import runpy, shutil, sys; from pathlib import Path;"
            "built = runpy.run_path('native/build.py')['make_ffi']().compile(tmpdir=sys.argv[1]);"
            "shutil.copy2(built, sys.argv[2]); print(Path(built).name)"
        )
        name = subprocess.check_output([vpy, "-c", script, str(Path(tmp) / "build"), str(CARRY / "native")], cwd=ROOT)
    manifest = {
        "python": version,
        "extension": name.decode().strip(),
        "sources_digest": sources_digest(),
        "host_lib": gpu_steps.host_lib_name(),
        "fatbin": cb.fatbin_name(ARCHES),
        "site": sorted(os.listdir(CARRY / "site")),
    }
    (CARRY / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    print(
        f"gpu_check: prepared {CARRY.relative_to(ROOT)} for Python {version}: {size / 2**20:.1f} MiB", file=sys.stderr
    )
    if size > 64 * 2**20:
        raise SystemExit(f"gpu_check: the carry is {size / 2**20:.1f} MiB, over the device tool's 64 MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="default: $OUT, else .")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: every step's plumbing, CPU threads as GPU")
    parser.add_argument("--iterations", type=int, default=None, help="timed iterations (default 10000; dry run 500)")
    parser.add_argument("--requests", type=int, default=None, help="echo requests (default 500; dry run 100)")
    parser.add_argument("--only", action="append", choices=[p[0] for p in PLAN], help="run only these steps")
    parser.add_argument("--prepare", metavar="PYTHON", help="here: build .gpu-carry/ for that interpreter, and exit")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    args.iterations = args.iterations or (500 if args.dry_run else 10_000)
    args.requests = args.requests or (100 if args.dry_run else 500)
    if args.iterations < 1 or args.requests < 1:
        parser.error("--iterations and --requests must be at least 1")
    report: dict[str, Any] = {
        "mode": f"{DRY}: no GPU was used; every figure is a CPU thread's on this machine"
        if args.dry_run
        else "GPU run",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
        "dry_run": args.dry_run,
        "worst_case_s": WORST_CASE_S,
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
        lacking = missing_carry()
        for name, timeout, needs_package in PLAN:
            if args.only and name not in args.only:
                continue
            if needs_package and lacking:
                result: dict[str, Any] = {"status": "not run: no carry", "missing": lacking}
                result["how"] = "here, with PyPI: python bench/gpu_check.py --prepare <python3.12>; carry .gpu-carry"
            else:
                result = run_step(name, timeout, with_package if needs_package else plain, args, work)
            report["steps"][name] = result
            report["seconds"] = round(time.monotonic() - begin, 1)
            write_report(report, args.out)
            print(f"gpu_check: {name}: {result['status']} ({result.get('seconds', 0)} s)", file=sys.stderr)
    report["result"] = summary(report["steps"], args.dry_run)
    report["seconds"] = round(time.monotonic() - begin, 1)
    write_report(report, args.out)
    print(f"gpu_check: {report['result']}; report in {args.out / 'report.json'}", file=sys.stderr)
    return 0 if report["result"] in ("ok", f"ok, {DRY}") else 1


def summary(steps: dict[str, dict[str, Any]], dry_run: bool) -> str:
    """ok (every step passed), failed (naming the steps), or incomplete (steps not run, none failed)."""
    failed = [n for n, s in steps.items() if s["status"] in ("failed", "timeout")]
    not_run = [n for n, s in steps.items() if str(s["status"]).startswith("not run")]
    if failed:
        return f"failed: {', '.join(failed)}" + (f" ({DRY})" if dry_run else "")
    if not_run:
        return f"incomplete: {', '.join(not_run)} not run" + (f" ({DRY})" if dry_run else "")
    return f"ok, {DRY}" if dry_run else "ok"


if __name__ == "__main__":
    sys.exit(main())
