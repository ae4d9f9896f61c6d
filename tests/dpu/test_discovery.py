"""Following a source of slot servers, sans I/O: what each resolution changes, what a source may be, and the
resolvers' answers -- with a fake ``getaddrinfo`` (names the test controls, no DNS server), a real directory of
sockets and a clock the test moves."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers.waiting import wait_for

from edgepath.dpu.discovery import Changes, Membership, Source, checked_source, parse_source
from edgepath.dpu.resolvers import Follower, resolve


def test_a_source_is_dns_name_port_or_a_directory() -> None:
    assert parse_source("dns:slots.edgepath.svc.cluster.local:7471") == Source(
        "dns", "slots.edgepath.svc.cluster.local", 7471
    )
    assert parse_source("dir:/run/edgepath/slots") == Source("dir", "/run/edgepath/slots")
    assert str(parse_source("dns:slots:7471")) == "dns:slots:7471"
    assert checked_source("dir:/x") == "dir:/x"


@pytest.mark.parametrize("text", ["slots:7471", "dns:slots", "dns:slots:0", "dns::7471", "dns:slots:http", "dir:", ""])
def test_a_wrong_source_says_what_is_allowed(text: str) -> None:
    with pytest.raises(ValueError, match="dns:NAME:PORT") as info:
        parse_source(text)
    assert repr(text) in str(info.value)


def test_each_resolution_attaches_the_new_and_drains_the_gone() -> None:
    members = Membership(interval=2.0)
    assert members.due(0.0)
    assert members.resolved({"10.0.0.1:7471", "10.0.0.2:7471"}, 0.0) == Changes(("10.0.0.1:7471", "10.0.0.2:7471"))
    assert not members.due(1.9) and members.due(2.0)
    assert members.resolved({"10.0.0.2:7471", "10.0.0.3:7471"}, 2.0) == Changes(("10.0.0.3:7471",), ("10.0.0.1:7471",))
    assert not members.resolved({"10.0.0.2:7471", "10.0.0.3:7471"}, 4.0)  # the same set: nothing to do
    assert members.resolved(set(), 6.0) == Changes((), ("10.0.0.2:7471", "10.0.0.3:7471"))  # every one gone
    assert members.resolutions == 4 and members.failures == 0


def test_a_failed_resolution_keeps_the_set() -> None:
    members = Membership(interval=1.0)
    members.resolved({"a"}, 0.0)
    assert members.resolved(None, 1.0) == Changes() and members.members == {"a"}
    assert not members.due(1.5)  # tried again an interval later, not at every tick
    assert members.resolved({"a"}, 2.0) == Changes() and members.failures == 1


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Membership(interval=0.0)


def _addrinfo(table: dict[str, list[str]]):
    """A ``getaddrinfo`` answering from ``table``; a name not there has no records (EAI_NONAME)."""

    def getaddrinfo(host: str, port: int, type: int = 0) -> list[tuple]:
        if host == "broken":
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if host == "empty":  # the name exists, with no address record (NOERROR, no answer)
            raise socket.gaierror(socket.EAI_NODATA, "No address associated with hostname")
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        family = {True: socket.AF_INET6, False: socket.AF_INET}
        return [(family[":" in ip], type, 6, "", (ip, port)) for ip in table[host]]

    return getaddrinfo


def test_dns_answers_every_address_of_the_name_with_the_port() -> None:
    lookup = _addrinfo({"slots": ["10.1.0.4", "10.1.0.5", "fd00::7"]})
    assert resolve(Source("dns", "slots", 7471), lookup) == {"10.1.0.4:7471", "10.1.0.5:7471", "fd00::7:7471"}


def test_a_name_without_records_is_an_empty_set_and_a_dns_failure_is_no_answer() -> None:
    lookup = _addrinfo({})
    assert resolve(Source("dns", "slots", 7471), lookup) == set()  # no ready pod behind the headless Service
    assert resolve(Source("dns", "empty", 7471), lookup) == set()  # NXDOMAIN or no record: both say none
    assert resolve(Source("dns", "broken", 7471), lookup) is None  # the set is kept


def test_a_directory_answers_its_sockets(tmp_path: Path) -> None:
    listening = []
    for name in ("a.sock", "b.sock"):
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(tmp_path / name))
        listening.append(sock)
    (tmp_path / "c.sock").write_text("not a socket")
    (tmp_path / "notes.txt").write_text("")
    try:
        assert resolve(Source("dir", str(tmp_path))) == {str(tmp_path / "a.sock"), str(tmp_path / "b.sock")}
        assert resolve(Source("dir", str(tmp_path / "missing"))) == set()  # nothing there (yet)
    finally:
        for sock in listening:
            sock.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_follower_resolves_off_the_callers_thread_every_interval() -> None:
    clock = Clock()
    names = {"a"}
    asked: list[Source] = []

    def resolver(source: Source) -> set[str]:
        asked.append(source)
        return set(names)

    source = Source("dir", "/slots")
    follower = Follower(source, Membership(interval=2.0), resolver, clock)
    assert follower.first() == Changes(("a",)) and asked == [source]
    assert follower.poll() == Changes()  # not due: nothing started
    names.add("b")
    clock.now += 2.0
    assert follower.poll() == Changes()  # due: started on a thread; its answer is taken by a later poll
    changes: list[Changes] = []
    wait_for(lambda: bool(changes.append(follower.poll()) or changes[-1]), 5.0, "the resolution's answer")
    assert changes[-1] == Changes(("b",)) and len(asked) == 2


def test_a_resolver_that_raises_is_a_failed_resolution() -> None:
    def resolver(source: Source) -> set[str]:
        raise RuntimeError("boom")

    follower = Follower(Source("dir", "/slots"), Membership(), resolver, Clock())
    assert follower.first() == Changes() and follower.membership.failures == 1
