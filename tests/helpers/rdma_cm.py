"""A bare rdma_cm connection request (pyverbs alone, no edgepath transport): what a peer that does not speak the
peer-secret handshake sends a verbs listener, and what comes back."""

from __future__ import annotations

from edgepath.transports.verbs_setup import _event, split_address
from edgepath.transports.verbs_shim import cm_channel_fd


def raw_connect(address: str, private: bytes, timeout: float = 20.0) -> tuple[str, bytes]:
    """Send a connect request carrying ``private`` (no QP behind it: it is never meant to be accepted); the name of
    the rdma_cm event that answered it and that event's private data."""
    from pyverbs import cm_enums as ce
    from pyverbs.cmid import CMID, AddrInfo, CMEventChannel, ConnParam

    host, port = split_address(address)
    channel = CMEventChannel()
    fd = cm_channel_fd(channel)
    cmid = CMID(creator=channel, port_space=ce.RDMA_PS_TCP)
    try:
        for step, wanted in (("addr", ce.RDMA_CM_EVENT_ADDR_RESOLVED), ("route", ce.RDMA_CM_EVENT_ROUTE_RESOLVED)):
            if step == "addr":
                cmid.resolve_addr(AddrInfo(dst=host, dst_service=str(port), port_space=ce.RDMA_PS_TCP), 5000)
            else:
                cmid.resolve_route(5000)
            ev = _event(channel, fd, timeout)
            assert ev is not None and ev.event_type == wanted, f"rdma_cm: {step} not resolved"
            ev.ack_cm_event()
        param = ConnParam(resources=1, depth=1, retry=6, rnr_retry=7, qp_num=0xABCD, data_len=len(private))
        param.set_private_data(private)
        cmid.connect(param)
        ev = _event(channel, fd, timeout)
        assert ev is not None, "no answer to the connection request"
        name, reply = ev.event_str(), bytes(ev.private_data or b"")
        ev.ack_cm_event()
        return name, reply
    finally:
        cmid.close()
        channel.close()
