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
_CDEF = re.compile(r"/\* CDEF-BEGIN \*/(.*?)/\* CDEF-END \*/", re.S)


def cdef_text() -> str:
    """The cffi declarations: the CDEF regions of the headers, in order."""
    parts = []
    for name in HEADERS:
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


def build() -> Path:
    """Compile and place the extension next to this file (where the package imports it)."""
    ffi = make_ffi()
    with tempfile.TemporaryDirectory(prefix="edgepath-build-") as tmp:
        built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        target = HERE / built.name
        shutil.copy2(built, target)
    return target


if __name__ == "__main__":
    print(f"built {build()}", file=sys.stderr)
