"""llama.cpp's own ``llama-server`` and ``llama-batched-bench``, built from the llama.cpp that edgepath runs.

The peer ``edgepath bench model`` compares against must run the same kernels as edgepath's model
handler, so it is built from the llama.cpp source that ships inside the sdist of the *installed*
llama-cpp-python (``vendor/llama.cpp``), never from another checkout: ``pip download --no-deps
--no-binary :all: llama-cpp-python==<installed>``, then CMake (Release, ``-DLLAMA_CURL=OFF
-DLLAMA_OPENSSL=OFF``, static, and otherwise cmake's defaults -- native CPU flags, llamafile's kernels -- as its
users build it, and as edgepath's own llama-cpp-python is built: docs/MODEL.md),
targets ``llama-server`` and ``llama-batched-bench`` (about 6 minutes on 2 cores).  Nothing of
llama.cpp lands in the repository: the two binaries, the build log and ``build.json`` are kept in
``$XDG_CACHE_HOME/edgepath/llama.cpp-<version>-<flags>/`` (``~/.cache`` without it) and reused while the
installed version and the flags are the same.

    python -m edgepath.bench.llama_server [--build | --rebuild] [--jobs N]

With no flag it prints where the binaries are, or how to build them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import IO

PACKAGE = "llama-cpp-python"
TARGETS = ("llama-server", "llama-batched-bench")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # standalone binaries: the cache holds two files, not a tree of .so
    "-DLLAMA_BUILD_TESTS=OFF",
    # as its users build it: llama.cpp's own defaults, llamafile on -- the kernels edgepath's handler runs by default
)
BUILD_COMMAND = "python -m edgepath.bench.llama_server --build"


class BuildError(RuntimeError):
    """llama-server cannot be had: the message says what failed and what to do."""


@dataclass(frozen=True)
class Binaries:
    """A finished build: where its programs are and what they were built from."""

    root: Path
    version: str

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def batched_bench(self) -> Path:
        return self.root / "bin" / "llama-batched-bench"

    def describe(self) -> str:
        """``llama.cpp <commit> from llama-cpp-python <version>`` (build.json), for reports."""
        try:
            info = json.loads((self.root / "build.json").read_text())
        except (OSError, ValueError):
            return f"llama.cpp from {PACKAGE} {self.version}"
        return f"llama.cpp {info.get('llama_cpp', '?')} from {PACKAGE} {self.version}"


def installed_version() -> str:
    """The installed llama-cpp-python's version: the llama.cpp source to build is the one it ships."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        raise BuildError(
            f"{PACKAGE} is not installed, so there is no llama.cpp version to match: pip install -e '.[model]'"
        ) from None


def cache_root(version: str) -> Path:
    """Where the build of ``version`` with :data:`CMAKE_FLAGS` is kept (another set of flags: another folder)."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    flags = hashlib.sha256(" ".join(CMAKE_FLAGS).encode()).hexdigest()[:8]
    return base / "edgepath" / f"llama.cpp-{version}-{flags}"


def find(version: str | None = None) -> Binaries | None:
    """The cached build for ``version`` (default: the installed one), or None when it is not there."""
    version = version or installed_version()
    found = Binaries(cache_root(version), version)
    ok = all(os.access(path, os.X_OK) for path in (found.server, found.batched_bench))
    return found if ok else None


def require(version: str | None = None) -> Binaries:
    """The cached build, or BuildError naming the command that makes it."""
    found = find(version)
    if found is None:
        version = version or installed_version()
        raise BuildError(
            f"llama-server for {PACKAGE} {version} is not built (looked in {cache_root(version)}): run "
            f"`{BUILD_COMMAND}` (about 6 minutes on 2 idle cores); `edgepath bench model` builds it unless --no-build"
        )
    return found


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One build at a time per version (a test and a benchmark may both ask)."""
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f"{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def build(version: str | None = None, jobs: int | None = None, force: bool = False, quiet: bool = False) -> Binaries:
    """Build (or, with ``force``, rebuild) the binaries into the cache; BuildError says why not."""
    version = version or installed_version()
    root = cache_root(version)
    with _locked(root):
        if not force and (found := find(version)) is not None:
            return found
        for tool, package in (("cmake", "cmake"), ("c++", "g++"), ("cc", "gcc")):
            if shutil.which(tool) is None:
                raise BuildError(f"building llama-server needs {tool!r}, not on PATH: apt-get install {package}")
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        log_path = root / "build.log"
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="edgepath-llama-build-") as tmp, log_path.open("w") as log:
            work = Path(tmp)
            say = (lambda _: None) if quiet else (lambda line: print(line, file=sys.stderr, flush=True))
            say(f"llama-server: fetching the {PACKAGE} {version} sdist (pip)")
            source = _source(version, work)
            say(f"llama-server: building {', '.join(TARGETS)} from {source} (log: {log_path})")
            configure = ["cmake", "-S", str(source), "-B", str(work / "build"), *CMAKE_FLAGS]
            _run(configure, log, log_path, "cmake configure")
            jobs = jobs or len(os.sched_getaffinity(0))
            command = ["cmake", "--build", str(work / "build"), "--target", *TARGETS, "-j", str(jobs)]
            _run(command, log, log_path, "cmake build")
            (root / "bin").mkdir()
            for target in TARGETS:
                shutil.copy2(work / "build" / "bin" / target, root / "bin" / target)
            info = {
                "package": PACKAGE,
                "version": version,
                "llama_cpp": _commit(source),
                "cmake_flags": list(CMAKE_FLAGS),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "build_seconds": round(time.monotonic() - started),
            }
            (root / "build.json").write_text(json.dumps(info, indent=2))
            say(f"llama-server: built in {info['build_seconds']} s into {root / 'bin'}")
        return Binaries(root, version)


def _source(version: str, work: Path) -> Path:
    """``vendor/llama.cpp`` of the sdist, unpacked under ``work``."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
        f"{PACKAGE}=={version}", "-d", str(work),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise BuildError(
            f"could not download the {PACKAGE} {version} sdist ({tail}): pip needs PyPI or its cache; "
            f"or download it elsewhere and put it in pip's cache, then run `{BUILD_COMMAND}`"
        )
    sdists = sorted(work.glob("*.tar.gz"))
    if not sdists:
        raise BuildError(f"pip download left no .tar.gz sdist of {PACKAGE} {version} in {work}")
    with tarfile.open(sdists[0]) as tar:
        tar.extractall(work / "src", members=_checked(tar, work / "src"))
    found = sorted((work / "src").glob("*/vendor/llama.cpp/CMakeLists.txt"))
    if not found:
        raise BuildError(f"the {PACKAGE} {version} sdist has no vendor/llama.cpp: it cannot give llama-server")
    return found[0].parent


def _checked(tar: tarfile.TarFile, into: Path) -> list[tarfile.TarInfo]:
    """Every member, once each is known to land inside ``into`` (Python 3.11.2 has no extraction filter)."""
    root = into.resolve()
    for member in tar.getmembers():
        target = (root / member.name).resolve()
        linked = (target.parent / member.linkname).resolve() if member.issym() else root
        if not (member.isfile() or member.isdir() or member.issym()) or not (
            target.is_relative_to(root) and linked.is_relative_to(root)
        ):
            raise BuildError(f"the sdist holds {member.name!r}, which would land outside {into}: refusing it")
    return tar.getmembers()


def _run(command: list[str], log: IO[str], log_path: Path, what: str) -> None:
    done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_path.read_text().strip().splitlines()[-5:]
        raise BuildError(f"{what} failed (exit {done.returncode}); the end of {log_path}:\n" + "\n".join(tail))


def _commit(source: Path) -> str:
    """llama.cpp's commit (the sdist carries its git metadata), else ``unknown commit``."""
    done = subprocess.run(["git", "-C", str(source), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown commit"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--build", action="store_true", help="build it unless the cache already has it")
    group.add_argument("--rebuild", action="store_true", help="build it again even when cached")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the usable CPUs)")
    args = parser.parse_args(argv)
    try:
        found = build(jobs=args.jobs, force=args.rebuild) if args.build or args.rebuild else require()
    except BuildError as exc:
        print(f"llama-server: {exc}", file=sys.stderr)
        return 1
    print(f"{found.server}\n{found.batched_bench}\n({found.describe()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
