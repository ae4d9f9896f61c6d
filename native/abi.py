"""The Python view of the slot ABI, generated from ``native/edgepath_slot.h``.

Constants come from the compiled header through cffi; the numpy structured dtypes
are built from cffi's field table (names, C types, offsets) of the same header,
so there is nothing here to keep in sync by hand.  ``tests/test_abi.py`` checks
the dtypes against an independent gcc-compiled ``offsetof`` dump.
"""

from __future__ import annotations

import enum

import numpy as np

try:
    from edgepath.native._core import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "edgepath's native extension is not built: run `python -m edgepath.native.build` "
        "(the Makefile's `make build` does this)"
    ) from exc

__all__ = [
    "POOL_HEADER",
    "REQUEST_HEADER",
    "RESULT_HEADER",
    "Event",
    "State",
    "Status",
    "StepError",
    "ffi",
    "field_offset",
    "lib",
    "struct_dtype",
]

_NUMPY_OF_C = {
    "uint64_t": np.uint64,
    "int64_t": np.int64,
    "uint32_t": np.uint32,
    "int32_t": np.int32,
    "uint16_t": np.uint16,
    "uint8_t": np.uint8,
    "float": np.float32,
}


def struct_dtype(name: str) -> np.dtype:
    """A numpy dtype with the exact field names, types, offsets and size of C ``struct name``."""
    ctype = ffi.typeof(f"struct {name}")
    names, formats, offsets = [], [], []
    for field_name, field in ctype.fields:
        ftype = field.type
        if ftype.kind == "array":
            fmt: object = (_NUMPY_OF_C[ftype.item.cname], ftype.length)
        else:
            fmt = _NUMPY_OF_C[ftype.cname]
        names.append(field_name)
        formats.append(fmt)
        offsets.append(field.offset)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": ffi.sizeof(ctype)})


def field_offset(dtype: np.dtype, name: str) -> int:
    """Byte offset of field ``name`` in a struct dtype built by :func:`struct_dtype`."""
    fields = dtype.fields
    if fields is None or name not in fields:
        raise KeyError(f"{dtype} has no field {name!r}")
    return int(fields[name][1])


POOL_HEADER = struct_dtype("ep_pool_header")
REQUEST_HEADER = struct_dtype("ep_request_header")
RESULT_HEADER = struct_dtype("ep_result_header")

MAGIC: int = lib.EP_POOL_MAGIC
ABI_VERSION: int = lib.EP_ABI_VERSION
CLAIMANT_MAX: int = lib.EP_CLAIMANT_MAX
SLOT_MAX: int = lib.EP_SLOT_MAX


class State(enum.IntEnum):
    FREE = lib.EP_FREE
    CLAIMED = lib.EP_CLAIMED
    READY = lib.EP_READY
    RUNNING = lib.EP_RUNNING
    DONE = lib.EP_DONE


class Event(enum.IntEnum):
    CLAIM = lib.EP_EV_CLAIM
    DOORBELL = lib.EP_EV_DOORBELL
    START = lib.EP_EV_START
    COMPLETE = lib.EP_EV_COMPLETE
    RELEASE = lib.EP_EV_RELEASE
    EXPIRE = lib.EP_EV_EXPIRE
    HANDOVER = lib.EP_EV_HANDOVER


class StepError(enum.IntEnum):
    """Why ``ep_step`` refused a transition."""

    STATE = lib.EP_E_STATE
    STALE = lib.EP_E_STALE
    EVENT = lib.EP_E_EVENT


class Status(enum.IntEnum):
    """Outcome of one request, as carried in ``ep_result_header.status``."""

    OK = lib.EP_STATUS_OK
    HANDLER_ERROR = lib.EP_STATUS_HANDLER_ERROR
    BAD_REQUEST = lib.EP_STATUS_BAD_REQUEST
    NO_SLOT = lib.EP_STATUS_NO_SLOT
    UNAVAILABLE = lib.EP_STATUS_UNAVAILABLE
    LENGTH = lib.EP_STATUS_LENGTH
    STOP = lib.EP_STATUS_STOP
    CANCELLED = lib.EP_STATUS_CANCELLED
    OVER_BOUND = lib.EP_STATUS_OVER_BOUND
    RECLAIMED = lib.EP_STATUS_RECLAIMED
    SLOT_CAP = lib.EP_STATUS_SLOT_CAP
