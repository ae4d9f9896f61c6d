"""Build the cffi extension ``edgepath.native._core`` from the C sources in this folder.

The cdef is cut out of the headers themselves (between the CDEF markers), so the
Python view of the slot ABI cannot drift from the C one: cffi's API mode checks
every declared struct field against the compiler's layout at build time.

Run ``python -m edgepath.native.build`` (the Makefile does) after changing a C file.
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
_CDEF = re.compile(r"/\* CDEF-BEGIN \*/(.*?)/\* CDEF-END \*/", re.S)


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
        sources=[str(HERE / s) for s in SOURCES],
        include_dirs=[str(HERE)],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
    )
    return ffi


def make_verbs_ffi() -> cffi.FFI:
    ffi = cffi.FFI()
    ffi.cdef(cdef_text(VERBS_HEADERS))
    ffi.set_source(
        VERBS_MODULE,
        '#include "edgepath_verbs.h"\n',
        sources=[str(HERE / s) for s in VERBS_SOURCES],
        include_dirs=[str(HERE)],
        libraries=["ibverbs", "rdmacm"],
        extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra"],
    )
    return ffi


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
    missing = [h for h in VERBS_NEEDS if not Path(h).exists()]
    if missing:
        print(
            f"not building {VERBS_MODULE}: {', '.join(missing)} missing "
            "(apt-get install libibverbs-dev librdmacm-dev); --transport verbs will refuse to start",
            file=sys.stderr,
        )
        return None
    return _compile(make_verbs_ffi())


if __name__ == "__main__":
    print(f"built {build()}", file=sys.stderr)
    verbs = build_verbs()
    if verbs is not None:
        print(f"built {verbs}", file=sys.stderr)
