"""``edgepath serve --slot-servers-from dns:NAME:PORT`` against a real DNS server: a slot server whose address the
name starts to resolve to is attached and claimed, one whose record goes is drained and let go of, and a name left
with no record at all drains the last one -- under load, with no failed request.

What is real: the DNS server (dnslib, over UDP), the resolution (glibc's ``getaddrinfo``, through
``/etc/resolv.conf``: the edge runs in a mount namespace of its own where that file names the test's server), the
edge (``edgepath serve``), the slot servers (``edgepath slot-server --handler paced-echo``) and the loopback data
path between them. What is not: a name's ``IP:PORT`` addresses are for rdma_cm (the verbs data path, docs/DEPLOY.md),
and the loopback data path names a slot server by its socket path -- so each slot server here listens at a socket
file named as the address it stands for (``127.0.0.2:7471``) in the edge's working directory, where the edge's
loopback transport finds it by that name. Needs root (a mount namespace, port 53); skipped otherwise."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dnslib import QTYPE, RCODE, RR, A
from dnslib.server import BaseResolver, DNSLogger, DNSServer
from helpers.failover import claims, generated, listing
from helpers.supervised import Load, scrape, series
from helpers.tokenizers import byte_tokenizer
from helpers.waiting import wait_for

from edgepath.children import Child, edgepath_argv, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="needs root and unshare: the edge resolves through a resolv.conf of its own in a mount namespace, "
        "and the DNS server listens on port 53 (resolv.conf names no port)",
    ),
]

NAME = "slots.edgepath.test"  # .test: reserved, never a real name (RFC 2606)
PORT = 7471
SERVER = "127.53.0.1"  # a loopback address of the test's own: nothing else listens on its port 53
SLOTS = 4
PATIENCE = 60.0  # seconds each step may take on a loaded 2-core machine (the targets are printed, not asserted)
log = logging.getLogger(__name__)


class Records(BaseResolver):
    """Answers ``NAME``'s A records from ``addresses`` (changed by the test as a headless Service's records change
    with its ready pods), with TTL 0: NOERROR with no answer (NODATA) when there are none, NXDOMAIN for any other
    name."""

    def __init__(self) -> None:
        self.addresses: set[str] = set()
        self.asked = 0

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        if str(request.q.qname).rstrip(".") != NAME:
            reply.header.rcode = RCODE.NXDOMAIN
            return reply
        self.asked += 1
        if request.q.qtype == QTYPE.A:
            for address in sorted(self.addresses):
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=0))
        return reply


@pytest.fixture
def records() -> Iterator[Records]:
    resolver = Records()
    try:
        server = DNSServer(resolver, address=SERVER, port=53, logger=DNSLogger(logf=log.debug))
    except OSError as exc:
        pytest.fail(f"the test's DNS server cannot listen on {SERVER}:53: {exc}")
    server.start_thread()
    yield resolver
    server.stop()


def test_serve_follows_a_dns_name_attaching_a_new_slot_server_and_draining_a_removed_one(
    tmp_path: Path, records: Records, edgepath_process: Callable[..., Child]
) -> None:
    tokenizer = str(byte_tokenizer(tmp_path / "tokenizer.json"))
    slots = tmp_path / "slots"  # the edge's working directory: the loopback sockets, named as the addresses
    slots.mkdir()
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {SERVER}\noptions timeout:1 attempts:2\n")
    a, b = f"127.0.0.2:{PORT}", f"127.0.0.3:{PORT}"

    def slot_server(address: str) -> Child:
        return edgepath_process(
            "slot-server", "--listen", str(slots / address), "--slots", str(SLOTS), "--handler", "paced-echo",
            "--handler-option", "token_delay=0.002",
        )  # fmt: skip

    slot_server(a)
    records.addresses = {"127.0.0.2"}
    port = free_port(socket.SOCK_STREAM)
    serve = edgepath_argv(
        "serve", "--transport", "tcp", "--port", str(port), "--handler", "echo", "--tokenizer", tokenizer,
        "--frames", "64", "--slot-servers-from", f"dns:{NAME}:{PORT}",  # the default --resolve-interval, 2 s
    )  # fmt: skip
    namespace = f'mount --bind "{resolv}" /etc/resolv.conf && cd "{slots}" && exec "$@"'
    edge = Child.start(["serve"], argv=["unshare", "--mount", "sh", "-c", namespace, "sh", *serve])
    try:
        assert list(listing(port)) == [a]
        asked = records.asked
        with Load(port, threads=3, max_requests=4000, max_seconds=6 * PATIENCE) as load:
            wait_for(lambda: claims(port, a) >= 20, PATIENCE, "requests on the first slot server")
            slot_server(b)
            records.addresses = {"127.0.0.2", "127.0.0.3"}  # a pod became ready: its record appears
            appeared = time.monotonic()
            wait_for(lambda: listing(port).get(b, {}).get("state") == "up", PATIENCE, "the new slot server attached")
            attached_s = time.monotonic() - appeared
            wait_for(lambda: claims(port, b) >= 20, PATIENCE, "requests on the new slot server")
            records.addresses = {"127.0.0.3"}  # a's record goes; its process still runs and still holds requests
            left = time.monotonic()
            wait_for(lambda: a not in listing(port), PATIENCE, "the drained slot server let go of")
            drained_s = time.monotonic() - left
            after = claims(port, b)
            wait_for(lambda: claims(port, b) >= after + 20, PATIENCE, "requests on the remaining slot server")
        text = scrape(port)
        records.addresses = set()  # no ready pod: the name exists with no record (NOERROR, no answer)
        wait_for(lambda: not listing(port), PATIENCE, "the last slot server drained when the name has no record")
    finally:
        edge.stop()
    statuses = {x.status for x in load.answers}
    print(
        f"dns discovery: {len(load.answers)} requests, statuses {sorted(statuses)}, {records.asked - asked} "
        f"questions to the DNS server; attached {attached_s:.2f} s after its record appeared, drained and let go "
        f"of {drained_s:.2f} s after its record went"
    )
    assert statuses == {200}, [x for x in load.answers if x.status != 200][:5]
    assert generated(text) == len(load.answers)  # each answered once, as the edge counts it
    assert series(text, "edgepath_port_duplicates_total") == 0
    assert series(text, "edgepath_port_unknown_total") == 0
    assert records.asked > asked  # the edge asked the test's server: no other resolver answered for it
