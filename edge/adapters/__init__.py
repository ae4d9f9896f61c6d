"""The transports a client speaks to the edge: QUIC (HTTP/3, on aioquic or qh3), HTTP/1.1, and TLS material; both
HTTP adapters apply the body limits of :mod:`edgepath.edge.body`.  Thin adapters: bytes in,
:class:`~edgepath.edge.http.Request` out to the driver (:class:`~edgepath.edge.service.Intake`), its answers back out.
"""
