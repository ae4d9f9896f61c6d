"""Build the cffi extensions ``edgepath.native._core`` (and ``_verbs``) from the C sources here.

The cdef is cut out of the headers themselves (between the CDEF markers), so the
Python view of the slot ABI cannot drift from the C one: cffi's API mode checks
every declared struct field against the compiler's layout at build time.

Two ways in, one definition: the build backend (setuptools, through ``setup.py``'s
``cffi_modules``, see :func:`cffi_modules`) compiles them into every wheel and
``pip install``; ``python -m edgepath.native.build`` (the Makefile runs it) rebuilds
them in place, under the same file names, after a C file changes.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
HEADERS = ("edgepath_slot.h", "edgepath_core.h")
SOURCES = ("edgepath_core.c",)
MODULE = "edgepath.native._core"
# The verbs data plane: a second extension, linked with libibverbs and librdmacm, built where
# their headers are installed (Debian: libibverbs-dev librdmacm-dev).
VERBS_HEADERS = ("edgepath_verbs.h",)
VERBS_SOURCES = ("edgepath_verbs.c",)
VERBS_MODULE = "edgepath.native._verbs"
VERBS_NEEDS = ("/usr/include/infiniband/verbs.h", "/usr/include/rdma/rdma_cma.h")
# Both ways of building give the extension the interpreter-specific name (_core.cpython-311-...so),
# so the in-place rebuild replaces the one the editable install made instead of being shadowed by it.
_COMMON = {"extra_compile_args": ["-O2", "-std=gnu11", "-Wall", "-Wextra"], "py_limited_api": False}
_CDEF = re.compile(r"/\* CDEF-BEGIN \*/(.*?)/\* CDEF-END \*/", re.S)
# setuptools insists on source paths relative to setup.py's folder (cffi runs this file there, as
# module __cffi__); the in-place build compiles in a temporary folder, so it needs absolute ones.
_FOR_SETUPTOOLS = __name__ == "__cffi__"


def _sources(names: tuple[str, ...]) -> list[str]:
    return [f"{HERE.name}/{s}" if _FOR_SETUPTOOLS else str(HERE / s) for s in names]


def cdef_text(headers: tuple[str, ...] = HEADERS) -> str:
    """The cffi declarations: the CDEF regions of the headers, in order."""
    parts = []
    for name in headers:
        found = _CDEF.findall((HERE / name).read_text())
        if not found:
            raise RuntimeError(f"{name}: no CDEF-BEGIN/CDEF-END region")
        parts.extend(found)
    return "\n".join(parts)


def make_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_text())
    ffi.set_source(
        MODULE,
        '#include "edgepath_core.h"\n',
        sources=_sources(SOURCES),
        include_dirs=[str(HERE)],
        **_COMMON,
    )
    return ffi


def make_verbs_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_text(VERBS_HEADERS))
    ffi.set_source(
        VERBS_MODULE,
        '#include "edgepath_verbs.h"\n',
        sources=_sources(VERBS_SOURCES),
        include_dirs=[str(HERE)],
        libraries=["ibverbs", "rdmacm"],
        **_COMMON,
    )
    return ffi


def verbs_headers_missing() -> list[str]:
    """The rdma-core headers the verbs extension needs that this machine lacks."""
    return [h for h in VERBS_NEEDS if not Path(h).exists()]


def _skip_verbs_notice(missing: list[str]) -> str:
    return (
        f"not building {VERBS_MODULE}: {', '.join(missing)} missing "
        "(apt-get install libibverbs-dev librdmacm-dev); --data-path verbs will refuse to start"
    )


def cffi_modules(build_file: str) -> list[str]:
    """setuptools' ``cffi_modules`` for ``build_file`` (this file, relative to setup.py): the core
    extension always, the verbs one where rdma-core's headers exist (said out loud where not)."""
    modules = [f"{build_file}:make_ffi"]
    missing = verbs_headers_missing()
    if missing:
        print(_skip_verbs_notice(missing), file=sys.stderr)
    else:
        modules.append(f"{build_file}:make_verbs_ffi")
    return modules


def _compile(ffi: cffi.FFI) -> Path:
    with tempfile.TemporaryDirectory(prefix="edgepath-build-") as tmp:
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        target = HERE / built.name
        shutil.copy2(built, target)
    return target


def build() -> Path:
    """Compile and place the extension next to this file (where the package imports it)."""
    return _compile(make_ffi())


def build_verbs() -> Path | None:
    """The verbs extension, or None (said out loud) where the rdma-core headers are missing."""
    missing = verbs_headers_missing()
    if missing:
        print(_skip_verbs_notice(missing), file=sys.stderr)
        return None
    return _compile(make_verbs_ffi())


if __name__ == "__main__":
    print(f"built {build()}", file=sys.stderr)
    verbs = build_verbs()
    if verbs is not None:
        print(f"built {verbs}", file=sys.stderr)
