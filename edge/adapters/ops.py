"""The ops listener (``serve --ops-listen HOST:PORT``): ``/metrics``, ``/health`` and the probes over HTTP/1.1 on an
address of their own, for the operator's scrapers and probes -- never the clients' listener, which then answers only
the probes of them (:class:`~edgepath.edge.routes.HttpCore`).

``/metrics`` names tenants and their usage and ``/health`` lists the slot servers' addresses and load: the
Kubernetes way is a port of the pod that no client Service exposes.  The same edge answers (the same service, the
same live state); what this listener adds is only the mark on each request that it came in here
(:attr:`~edgepath.edge.http.Request.ops`), which the router serves the ops routes to, without a key, and nothing else
(404).  It stays open while the edge drains, so probes and scrapes see the drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
from functools import partial

from edgepath.edge.adapters.tcp import EdgeHttp11Protocol
from edgepath.edge.body import BodyLimits
from edgepath.edge.body_budget import Dropping
from edgepath.edge.connections import ConnectionLimits
from edgepath.edge.http import HttpError, Request
from edgepath.edge.service import Intake, Reply, Ticket

#: connections the ops listener keeps open at once, in total and per client address (probes and scrapers are few)
OPS_CONNECTIONS, OPS_CONNECTIONS_PER_ADDRESS = 64, 16


class OpsIntake:
    """An :class:`~edgepath.edge.service.Intake` that marks every request as the ops listener's."""

    def __init__(self, service: Intake) -> None:
        self._service = service
        self.body: BodyLimits = service.body
        # connections of their own: a flood of the clients' listener never locks the probes and scrapers out
        self.connections = ConnectionLimits(
            OPS_CONNECTIONS, OPS_CONNECTIONS_PER_ADDRESS, service.connections.idle_timeout
        )

    def head(self, request: Request, length: int | None, reply: Reply) -> Dropping | None:
        return self._service.head(dataclasses.replace(request, ops=True), length, reply)

    def handle(self, request: Request, reply: Reply) -> Ticket:
        return self._service.handle(dataclasses.replace(request, ops=True), reply)

    def refuse(self, request: Request, error: HttpError, reply: Reply) -> None:
        self._service.refuse(dataclasses.replace(request, ops=True), error, reply)

    def reset_early(self) -> None:
        self._service.reset_early()


async def serve_ops(service: Intake, host: str, port: int, reuse_port: bool = False) -> asyncio.Server:
    """The ops listener at ``host:port`` for ``service`` (``reuse_port``: the edge workers of one serve share it)."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(partial(EdgeHttp11Protocol, OpsIntake(service)), host, port, reuse_port=reuse_port)
