"""The bridge between pyverbs objects and the C data path: the native extension, and the raw C
handles (``ibv_context *``, ``ibv_cq *``, ``ibv_qp *``, ...) that pyverbs does not expose.

pyverbs (Cython) keeps each object's C handle in the first field after its base: object header,
``__weakref__``, logger, vtable.  This module is the only place that reads memory at that fixed
offset, and it checks every handle against values pyverbs does expose (the context's command fd,
a CQ's size, a QP's number, ...) before anything uses it, so a pyverbs with another layout is
refused with a clear message instead of being dereferenced.
"""

from __future__ import annotations

import ctypes

from edgepath.transports.base import TransportUnavailable

try:
    from edgepath.native._verbs import ffi, lib
except ImportError as _exc:  # no rdma-core headers at build time
    raise ImportError(
        "edgepath.native._verbs is not built (apt-get install libibverbs-dev librdmacm-dev, then make build)"
    ) from _exc

__all__ = [
    "cm_channel_fd",
    "cm_id_handle",
    "comp_channel_handle",
    "context_handle",
    "cq_handle",
    "ffi",
    "lib",
    "qp_handle",
    "raw_handle",
    "srq_handle",
]

# Cython layout of a pyverbs object: PyObject header (16), __weakref__, logger, vtable, then the handle.
_HANDLE_OFFSET = 40


def raw_handle(obj: object) -> int:
    """The C pointer a pyverbs object wraps, unchecked: only for the checked accessors below and for
    objects whose handle a C helper verifies itself."""
    return ctypes.c_void_p.from_address(id(obj) + _HANDLE_OFFSET).value or 0


def _checked(what: str, ok: bool) -> None:
    if not ok:
        raise TransportUnavailable(
            f"verbs transport: this pyverbs build lays out its {what} differently than expected; "
            "use Debian's python3-pyverbs (rdma-core 44) or --data-path loopback"
        )


def context_handle(ctx: object, cmd_fd: int) -> int:
    """``struct ibv_context *`` of a ``pyverbs.device.Context``."""
    ptr = raw_handle(ctx)
    _checked("Context", lib.ep_v_check_context(ptr, cmd_fd) == 0)
    return ptr


def cq_handle(cq: object, ctx_ptr: int, cqe: int) -> int:
    """``struct ibv_cq *`` of a ``pyverbs.cq.CQ`` created on ``ctx_ptr`` with ``cqe`` entries."""
    ptr = raw_handle(cq)
    _checked("CQ", lib.ep_v_check_cq(ptr, ctx_ptr, cqe) == 0)
    return ptr


def qp_handle(qp: object, ctx_ptr: int, qp_num: int) -> int:
    """``struct ibv_qp *`` of a ``pyverbs.qp.QP``."""
    ptr = raw_handle(qp)
    _checked("QP", lib.ep_v_check_qp(ptr, ctx_ptr, qp_num) == 0)
    return ptr


def srq_handle(srq: object, ctx_ptr: int) -> int:
    """``struct ibv_srq *`` of a ``pyverbs.srq.SRQ``."""
    ptr = raw_handle(srq)
    _checked("SRQ", lib.ep_v_check_srq(ptr, ctx_ptr) == 0)
    return ptr


def comp_channel_handle(channel: object, ctx_ptr: int) -> int:
    """``struct ibv_comp_channel *`` of a ``pyverbs.cq.CompChannel``."""
    ptr = raw_handle(channel)
    _checked("CompChannel", lib.ep_v_comp_channel_fd(ptr, ctx_ptr) >= 0)
    return ptr


def cm_channel_fd(channel: object) -> int:
    """The (non-blocking) descriptor of a ``pyverbs.cmid.CMEventChannel``."""
    fd = int(lib.ep_v_cm_channel_fd(raw_handle(channel)))
    _checked("CMEventChannel", fd >= 0)
    return fd


def cm_id_handle(cmid: object, channel: object) -> int:
    """``struct rdma_cm_id *`` of a ``pyverbs.cmid.CMID`` created on ``channel``."""
    ptr = raw_handle(cmid)
    _checked("rdma_cm id", lib.ep_v_cm_id_check(ptr, raw_handle(channel)) == 0)
    return ptr
