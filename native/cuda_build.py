"""Compile the CUDA poller (``edgepath_poller.cu``) into a fatbin with nvcc.

The fatbin holds machine code for each named architecture plus PTX of the newest,
so a newer GPU can still JIT it; cupy loads it with ``RawModule(path=...)``.  The
build is cached by a hash of the sources and the command, so a slot server start
costs one nvcc run the first time only.  ``python -m edgepath.native.cuda_build``
builds it (and is the compile check CI runs through tests/test_gpu_compile.py);
``python -m edgepath.native.cuda_build --out DIR 90`` writes it into DIR under its
digest name, to carry to a machine without nvcc, where ``$EDGEPATH_POLLER_FATBIN``
names it (a fatbin whose name does not match these sources is refused).

Imports nothing but the standard library, so bench/gpu_check.py's steps load it by path
on a GPU machine that has none of edgepath's dependencies.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "edgepath_poller.cu"
HEADERS = ("edgepath_slot.h", "edgepath_step.h", "edgepath_poll.h", "edgepath_poller.h", "edgepath_poller_checks.h")
DEFAULT_ARCHES = ("80", "90")
FATBIN_ENV = "EDGEPATH_POLLER_FATBIN"
_NVCC_FALLBACKS = ("/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc")


class CudaBuildError(RuntimeError):
    """nvcc is missing or rejected the poller source."""


def find_nvcc() -> str | None:
    """``$EDGEPATH_NVCC``, else ``nvcc`` on PATH, else the usual install places."""
    explicit = os.environ.get("EDGEPATH_NVCC")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    found = shutil.which("nvcc")
    if found:
        return found
    return next((p for p in _NVCC_FALLBACKS if os.access(p, os.X_OK)), None)


def nvcc_command(nvcc: str, out: Path, arches: tuple[str, ...]) -> list[str]:
    """The nvcc line: warnings are errors, SASS per arch, PTX of the newest for JIT on later GPUs."""
    cmd = [nvcc, "-std=c++17", "-O3", "-fatbin", "-Werror", "all-warnings", f"-I{HERE}"]
    for arch in arches:
        cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    newest = max(arches, key=int)
    cmd += ["-gencode", f"arch=compute_{newest},code=compute_{newest}", str(SOURCE), "-o", str(out)]
    return cmd


def _digest(cmd_tail: list[str]) -> str:
    """Of the sources and the command, with this checkout's path taken out: a fatbin built in one
    checkout keeps its name in another (the carried one must match on the GPU machine)."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for name in HEADERS:
        h.update((HERE / name).read_bytes())
    h.update(" ".join(cmd_tail).replace(str(HERE), "native").encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgepath" / "cuda"


def fatbin_name(arches: tuple[str, ...]) -> str:
    """The file name of the fatbin these sources and ``arches`` build: a carried one must match it."""
    return f"edgepath_poller-{_digest(nvcc_command('nvcc', Path('OUT'), arches)[1:])}.fatbin"


def prebuilt_fatbin(arches: tuple[str, ...]) -> Path | None:
    """``$EDGEPATH_POLLER_FATBIN`` if set (checked against the sources), else None."""
    explicit = os.environ.get(FATBIN_ENV)
    if not explicit:
        return None
    path = Path(explicit)
    if not path.is_file():
        raise CudaBuildError(f"${FATBIN_ENV}={explicit}: no such file")
    expected = fatbin_name(arches)
    if path.name != expected:
        raise CudaBuildError(
            f"${FATBIN_ENV}={explicit} was not built from these sources for sm_{'/'.join(arches)}: "
            f"expected a file named {expected} (python -m edgepath.native.cuda_build --out DIR {' '.join(arches)})"
        )
    return path


def build_poller(arches: tuple[str, ...] = DEFAULT_ARCHES, out_dir: Path | None = None, timeout: float = 300) -> Path:
    """The poller fatbin for ``arches`` (compute capabilities as "90"): the carried one named by
    ``$EDGEPATH_POLLER_FATBIN``, else built by nvcc or taken from the cache."""
    carried = prebuilt_fatbin(arches)
    if carried is not None:
        return carried
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaBuildError(
            f"nvcc not found (set EDGEPATH_NVCC or put nvcc on PATH, or carry a prebuilt fatbin in ${FATBIN_ENV}): "
            "cannot build the CUDA poller"
        )
    out_dir = out_dir or cache_dir()
    target = out_dir / fatbin_name(arches)
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="edgepath-nvcc-") as tmp:
        built = Path(tmp) / "poller.fatbin"
        try:
            done = subprocess.run(
                nvcc_command(nvcc, built, arches), capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise CudaBuildError(f"nvcc took longer than {timeout:.0f} s on {SOURCE.name}") from exc
        if done.returncode != 0:
            raise CudaBuildError(f"nvcc failed on {SOURCE.name} (exit {done.returncode}):\n{done.stderr.strip()}")
        staged = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        shutil.copy2(built, staged)
        os.replace(staged, target)  # atomic: a concurrent start sees the whole file or none
    return target


def header_words(prefix: str, header: Path = HERE / "edgepath_poller.h") -> dict[str, int]:
    """The ``EP_<prefix>_*`` numbers of ``header`` (the one the kernel includes: one source of truth),
    e.g. ``header_words("CTRL") == {"STOP": 0, "RUNNING": 8, ...}``."""
    found = re.findall(rf"^#define EP_{prefix}_(\w+)\s+(\d+)", header.read_text(), re.MULTILINE)
    if not found:
        raise CudaBuildError(f"no EP_{prefix}_* definitions in {header}")
    return {name: int(value) for name, value in found}


def ctrl_words() -> dict[str, int]:
    """The ``EP_CTRL_*`` word indices of the poller's control block (one 64-byte line per writer)."""
    return header_words("CTRL")


def ring_words() -> dict[str, int]:
    """The ``EP_RING_*`` layout of a hand-off ring entry: ``WORDS`` per entry and each word's index."""
    return header_words("RING")


def main(argv: list[str]) -> None:
    out_dir = None
    if argv[:1] == ["--out"]:
        out_dir, argv = Path(argv[1]), argv[2:]
    print(f"built {build_poller(tuple(argv) or DEFAULT_ARCHES, out_dir)}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
