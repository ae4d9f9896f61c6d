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
what the other machine lacks -- among it the wheels of every third-party module the product imports but
numpy and h11, which the check unpacks into its own folder --, and the steps find it there (docs/GPU.md
lists it); a step that needs a carry that is not there is reported ``not run: no carry``, naming what is
missing.  ``--dry-run`` runs every step's plumbing here, with CPU threads in place of the GPU: the report
says ``dry-run (CPU twin)`` at the top and on every figure, and no figure in it is a GPU figure.
``--prove PYTHON`` (here) does what the GPU machine will: a copy of the tree as the device tool sends it,
the carry, a clean venv of that Python with only the device image's packages, every product module
imported, then the dry run.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Iterator
from importlib import metadata
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
#: the device image's packages that the product or the check needs (docs/GPU.md; the rest of its packages are
#: not relied on): --prepare carries every other distribution the product imports, --prove's venv holds only these
DEVICE_IMAGE = ("numpy", "pytest", "hypothesis", "h11")
#: the device tool's limit on what travels: the working tree and the carried paths together
TRAVEL_LIMIT = 64 * 2**20
#: wheels for the GPU machine's x86-64 Linux (its glibc is newer than 2.28), as the device tool's notes fetch them
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


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


def package_dirs() -> dict[str, str]:
    """The product's import packages and their folders, as pyproject.toml maps them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return dict(setuptools["package-dir"])


def package_view(work: Path) -> Path:
    """A folder where ``import edgepath.slots`` works without installing: symlinks to the repository's
    folders under the package names pyproject.toml maps them to, and in ``native`` the cffi extension
    carried for this Python (``.gpu-carry/native/``) beside the repository's own files."""
    root = work / "view"
    for package, folder in package_dirs().items():
        target = root.joinpath(*package.split("."))
        target.parent.mkdir(parents=True, exist_ok=True)
        if package == "edgepath":
            target.mkdir(exist_ok=True)
            for entry in os.listdir(ROOT / folder):
                if not (target / entry).exists():
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


def product_modules() -> Iterator[tuple[str, Path]]:
    """(module name, file) of every module of the product: the packages pyproject.toml maps, sub-folders too."""
    for package, folder in package_dirs().items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if any(part != "__init__" and not part.isidentifier() for part in parts):
                continue
            yield ".".join([package, *(p for p in parts if p != "__init__")]), path


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when a module is imported: its body, and what its top-level ``try`` and ``if``
    blocks hold (``if TYPE_CHECKING:`` blocks never run)."""
    for node in body:
        yield node
        if isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level(block)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _module_level(node.body)
            yield from _module_level(node.orelse)


def product_imports() -> list[str]:
    """The third-party top-level modules that importing the product's modules imports (what a step that imports
    edgepath needs on the GPU machine).  An import inside a function is a feature's, made when it is used
    (llama_cpp, cupy, pyverbs, the tokenizers): the steps use none of them, and none is carried."""
    found: set[str] = set()
    for _, path in product_modules():
        for node in _module_level(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return sorted(name for name in found if name not in sys.stdlib_module_names and name != "edgepath")


def carried_extensions() -> list[str]:
    return sorted(p.name for p in (CARRY / "native").glob("*.so")) if (CARRY / "native").is_dir() else []


def sources_digest() -> str:
    """Of the C sources edgepath's cffi extension is built from: a carried extension must match them."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "native").glob("*.[ch]")):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def unpack_wheels(site: Path) -> dict[str, Any]:
    """The carried wheels (``.gpu-carry/wheels/``) unpacked into ``site``, a folder for PYTHONPATH: their code, as
    ``pip install --target`` lays it out (a wheel's ``*.data/purelib`` and ``platlib`` at the top; its scripts,
    headers and data files are not code and are left out).  Nothing is installed.  Only for the Python they were
    prepared for: on another, ahead of its own packages, they would shadow them with extensions it cannot load."""
    wheels = sorted((CARRY / "wheels").glob("*.whl"))
    manifest = CARRY / "manifest.json"
    prepared_for = json.loads(manifest.read_text()).get("python") if manifest.is_file() else None
    running = "{}.{}".format(*sys.version_info[:2])
    if wheels and prepared_for != running:
        return {"wheels_not_used": f"{len(wheels)} carried for Python {prepared_for}, this is {running}"}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                if info.is_dir() or ".." in parts or info.filename.startswith("/"):
                    continue
                target = site.joinpath(*parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst)
    return {"wheels": [w.name for w in wheels]}


def missing_carry(site: Path) -> list[str]:
    """What a step that imports edgepath lacks on this interpreter with ``site`` on its path (empty: it can run)."""
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
    missing += [f"{name} (not installed, not carried)" for name in unimportable(product_imports(), site)]
    return missing


def unimportable(names: list[str], site: Path) -> list[str]:
    """Those of ``names`` this interpreter cannot find with ``site`` on its path (found, not imported)."""
    script = "import importlib.util as u, sys; print(' '.join(n for n in sys.argv[1:] if u.find_spec(n) is None))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, env=env, check=True)
    return done.stdout.split()


def step_env(view: Path, site: Path) -> dict[str, str]:
    """PYTHONPATH for the steps that import edgepath: the package view and the carried third-party modules."""
    paths = [str(view), str(site)]
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


def canonical(name: str) -> str:
    """A distribution's name as pip compares names (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def carried_distributions() -> list[str]:
    """``name==version`` of the distributions installed here that provide the product's third-party imports
    (:func:`product_imports`), but the device image's: what --prepare carries, at the versions tested here."""
    provides = metadata.packages_distributions()
    unknown = [module for module in product_imports() if module not in provides]
    if unknown:
        raise SystemExit(
            f"gpu_check: the product imports {unknown}, which no distribution installed here provides: run --prepare "
            "with the Python of edgepath's venv (make build installs its dependencies)"
        )
    names = {name for module in product_imports() for name in provides[module]}
    return sorted(f"{name}=={metadata.version(name)}" for name in names if canonical(name) not in DEVICE_IMAGE)


def travelling_files(root: Path = ROOT) -> list[str]:
    """What the device tool sends of the checkout: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout  # fmt: skip
    return sorted({name for name in listed.decode().split("\0") if name and (root / name).is_file()})


def tree_bytes(root: Path = ROOT) -> int:
    return sum((root / name).stat().st_size for name in travelling_files(root))


def prepare(python: str, carry: Path = CARRY) -> None:
    """Here, with PyPI, gcc and nvcc: what the GPU machine lacks, into ``carry`` (``.gpu-carry/``, git-ignored), for
    ``python``: the host library, the fatbin, edgepath's cffi extension built for that Python, and the wheels of
    every distribution the product imports (:func:`carried_distributions`) with what they need, but the device
    image's (those wheels are left out even where a carried one asks for them: the device has its own)."""
    if carry.exists():
        shutil.rmtree(carry)
    (carry / "native").mkdir(parents=True)
    gpu_steps.host_lib_build(carry / gpu_steps.host_lib_name())
    cb = gpu_steps.cuda_build()
    cb.build_poller(ARCHES, carry)
    version = subprocess.check_output([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], text=True)
    version = version.strip()
    wanted = carried_distributions()
    wheels = carry / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", str(wheels)]
    cmd += ["--python-version", version, "--implementation", "cp", *(f"--platform={p}" for p in PLATFORMS)]
    subprocess.run([*cmd, *wanted], check=True)
    for wheel in wheels.glob("*.whl"):
        if canonical(wheel.name.split("-")[0]) in DEVICE_IMAGE:
            wheel.unlink()
    with tempfile.TemporaryDirectory(prefix="edgepath-prep-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        vpy = str(venv / "bin" / "python")
        cffi = f"cffi=={metadata.version('cffi')}"
        subprocess.run([vpy, "-m", "pip", "install", "-q", "setuptools", cffi], check=True)
        script = (
            "import runpy, shutil, sys; from pathlib import Path;"
            "built = runpy.run_path('native/build.py')['make_ffi']().compile(tmpdir=sys.argv[1]);"
            "shutil.copy2(built, sys.argv[2]); print(Path(built).name)"
        )
        name = subprocess.check_output([vpy, "-c", script, str(Path(tmp) / "build"), str(carry / "native")], cwd=ROOT)
    manifest = {
        "python": version,
        "extension": name.decode().strip(),
        "sources_digest": sources_digest(),
        "host_lib": gpu_steps.host_lib_name(),
        "fatbin": cb.fatbin_name(ARCHES),
        "imports": product_imports(),
        "distributions": wanted,
        "wheels": sorted(w.name for w in wheels.glob("*.whl")),
    }
    (carry / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in carry.rglob("*") if p.is_file())
    travels = size + tree_bytes()
    mib = f"{size / 2**20:.1f} MiB, with the tree {travels / 2**20:.1f} MiB of the device tool's {TRAVEL_LIMIT >> 20}"
    print(f"gpu_check: prepared {carry} for Python {version}: {mib}", file=sys.stderr)
    if travels > TRAVEL_LIMIT:
        raise SystemExit(f"gpu_check: the carry is {mib}: over the limit")


#: what a product module may fail to import on the GPU machine, and why: an extension the carry does not bring
NOT_CARRIED = {
    "edgepath.native._verbs": "the verbs data plane, built against rdma-core's libraries, which the GPU machine "
    "lacks; no step uses it",
}


def check_imports() -> int:
    """Every product module imported in a fresh interpreter, with the package view and the carried wheels as the
    steps that import edgepath have them: 0, else 1 and each failure.  A module that fails only for want of
    an extension named in NOT_CARRIED is listed, not failed."""
    script = """
import importlib, json, sys
failed, without = {}, {}
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        cause = exc
        while cause is not None and not (isinstance(cause, ImportError) and cause.name in json.loads(sys.argv[1])):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            failed[name] = f"{type(exc).__name__}: {exc}"
        else:
            without[name] = cause.name
print(json.dumps({"failed": failed, "without": without}))
"""
    with tempfile.TemporaryDirectory(prefix="edgepath-imports-") as tmp:
        work = Path(tmp)
        unpack_wheels(work / "site")
        env = step_env(package_view(work), work / "site")
        modules = [name for name, _ in product_modules() if not name.endswith(".__main__")]
        cmd = [sys.executable, "-P", "-c", script, json.dumps(list(NOT_CARRIED)), *modules]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=work, env=env, check=False)
    if done.returncode != 0:
        print(f"gpu_check: importing the product crashed:\n{done.stdout}{done.stderr}", file=sys.stderr)
        return 1
    found = json.loads(done.stdout.splitlines()[-1])
    for name, extension in sorted(found["without"].items()):
        print(f"gpu_check: {name} not imported: it needs {extension} ({NOT_CARRIED[extension]})", file=sys.stderr)
    for name, error in sorted(found["failed"].items()):
        print(f"gpu_check: {name} does not import: {error}", file=sys.stderr)
    imported = len(modules) - len(found["failed"]) - len(found["without"])
    print(f"gpu_check: of {len(modules)} product modules {imported} import here, {len(found['without'])} need an "
          f"extension not carried, {len(found['failed'])} fail", file=sys.stderr)  # fmt: skip
    return 1 if found["failed"] else 0


def prove(python: str, carry: Path, out: Path) -> dict[str, Any]:
    """Here, what the GPU machine will do: the tree as the device tool sends it (:func:`travelling_files`) with
    ``carry`` as ``.gpu-carry``, a fresh venv of ``python`` with only the device image's packages (DEVICE_IMAGE,
    from PyPI or pip's cache), every product module imported there (:func:`check_imports`), then the whole dry
    run, its report in ``out``.  Its report; SystemExit saying what failed."""
    out = out.resolve()  # the dry run runs in the copy
    with tempfile.TemporaryDirectory(prefix="edgepath-carry-proof-") as tmp:
        tree = Path(tmp) / "tree"
        for name in travelling_files():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name, follow_symlinks=False)
        shutil.copytree(carry, tree / ".gpu-carry")
        travels = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
        if travels > TRAVEL_LIMIT:
            raise SystemExit(f"gpu_check: the tree and the carry are {travels / 2**20:.1f} MiB, over 64 MiB")
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        vpy = str(venv / "bin" / "python")
        subprocess.run([vpy, "-m", "pip", "install", "-q", *DEVICE_IMAGE], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        check = [vpy, str(tree / "bench" / "gpu_check.py")]
        if subprocess.run([*check, "--check-imports"], cwd=tree, env=env, check=False).returncode != 0:
            raise SystemExit("gpu_check: with the carry, not every product module imports in a clean venv (above)")
        subprocess.run([*check, "--dry-run", "--out", str(out)], cwd=tree, env=env, check=False)
    if not (out / "report.json").is_file():
        raise SystemExit(f"gpu_check: the clean dry run wrote no report in {out} (its output is above)")
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    report["travels_mib"] = round(travels / 2**20, 1)
    if report.get("result") != f"ok, {DRY}":
        raise SystemExit(f"gpu_check: the clean dry run's result is {report.get('result')!r}; its report: {out}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="default: $OUT, else .")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: every step's plumbing, CPU threads as GPU")
    parser.add_argument("--iterations", type=int, default=None, help="timed iterations (default 10000; dry run 500)")
    parser.add_argument("--requests", type=int, default=None, help="echo requests (default 500; dry run 100)")
    parser.add_argument("--only", action="append", choices=[p[0] for p in PLAN], help="run only these steps")
    parser.add_argument("--prepare", metavar="PYTHON", help="here: build .gpu-carry/ for that interpreter, and exit")
    parser.add_argument(
        "--prove", metavar="PYTHON", help="here: the dry run in a clean venv of that interpreter, with .gpu-carry/"
    )
    parser.add_argument("--check-imports", action="store_true", help="import every product module with the carry")
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    if args.prove:
        prove(args.prove, CARRY, args.out)
        print(f"gpu_check: {CARRY.name} passed a dry run in a clean venv of {args.prove}", file=sys.stderr)
        return 0
    if args.check_imports:
        return check_imports()
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
        site = work / "site"
        try:
            report["steps"]["build"] = {"status": "ok", **build(work), **unpack_wheels(site)}
        except Exception as exc:
            report["steps"]["build"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
        write_report(report, args.out)
        plain = dict(os.environ)
        with_package = step_env(package_view(work), site)
        lacking = missing_carry(site)
        for name, timeout, needs_package in PLAN:
            if args.only and name not in args.only:
                continue
            if needs_package and lacking:
                result: dict[str, Any] = {"status": "not run: no carry", "missing": lacking}
                result["how"] = "here, with PyPI: scripts/prepare-gpu-carry (gpu_check.py --prepare <python3.12>)"
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
