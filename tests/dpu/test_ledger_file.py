"""A quota ledger's words kept in a file (dpu/ledger_file.py): read back as written, refused -- naming the file and
why -- when it is not a ledger of the size asked for, replaced whole or not at all, saved only when they changed;
and a ledger's verbs address resolved afresh at each connect (dpu/ledger.py)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from edgepath.dpu.ledger import resolved
from edgepath.dpu.ledger_file import LedgerFile, LedgerFileError, Saver
from edgepath.transports.base import TransportError


def words(entries: int, seed: int = 1) -> bytes:
    return bytes((seed + i) % 256 for i in range(16 * entries))


def test_words_saved_are_the_words_loaded_and_no_file_is_a_first_start(tmp_path: Path) -> None:
    file = LedgerFile(tmp_path / "ledger.state", 8)
    assert file.load() is None  # nothing spent yet: every bucket full
    file.save(words(8))
    assert file.load() == words(8)
    file.save(words(8, seed=7))  # replaced
    assert file.load() == words(8, seed=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.state"]  # no temporary copy left behind


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (lambda data: data[:10], "shorter than its header"),
        (lambda data: b"NOTLEDGR" + data[8:], "not an edgepath ledger file"),
        (lambda data: data[:-16], "a ledger of 8 entries (112 bytes of words), not 8"),
        (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "do not match their checksum"),
    ],
)
def test_a_file_that_is_not_a_whole_ledger_of_this_size_is_refused_naming_it(
    tmp_path: Path, damage: Callable[[bytes], bytes], says: str
) -> None:
    path = tmp_path / "ledger.state"
    LedgerFile(path, 8).save(words(8))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(LedgerFileError, match=r"ledger\.state") as raised:
        LedgerFile(path, 8).load()
    assert says in str(raised.value) and "move it away" in str(raised.value)


def test_a_file_of_another_size_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.state"
    LedgerFile(path, 8).save(words(8))
    with pytest.raises(LedgerFileError, match=r"a ledger of 8 entries .* not 16"):
        LedgerFile(path, 16).load()


def test_a_save_that_fails_leaves_the_copy_before_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "ledger.state"
    file = LedgerFile(path, 8)
    file.save(words(8))
    (tmp_path / "ledger.state.new").mkdir()  # the temporary file cannot be made: the save fails before the rename
    with pytest.raises(OSError):
        file.save(words(8, seed=3))
    assert file.load() == words(8)


def test_the_saver_saves_what_changed_and_a_last_time_when_stopped(tmp_path: Path) -> None:
    file = LedgerFile(tmp_path / "ledger.state", 4)
    current = [words(4)]
    saver = Saver(file, lambda: current[0], interval=3600, saved=None)  # the thread never saves on its own here
    assert saver.save() and saver.saves == 1 and file.load() == words(4)
    before = os.stat(file.path).st_mtime_ns
    assert saver.save() and saver.saves == 1  # unchanged: not written again
    assert os.stat(file.path).st_mtime_ns == before
    current[0] = words(4, seed=9)
    assert saver.stop() and saver.saves == 2 and file.load() == words(4, seed=9)


def test_a_saver_that_cannot_write_counts_it_and_keeps_the_words_to_save(tmp_path: Path) -> None:
    directory = tmp_path / "gone"
    directory.mkdir()
    file = LedgerFile(directory / "ledger.state", 4)
    saver = Saver(file, lambda: words(4), interval=3600, saved=None)
    directory.rmdir()
    assert not saver.save() and saver.failures == 1
    directory.mkdir()
    assert saver.stop() and file.load() == words(4)  # saved once it could be


def test_a_verbs_address_by_name_is_resolved_at_each_connect_and_others_are_kept() -> None:
    answers = iter(["10.0.0.5", "10.0.0.9"])  # the ledger's pod restarted at another address

    def getaddrinfo(host: str, port: str, **_: object) -> list[tuple]:
        assert (host, port) == ("edgepath-ledger-0.edgepath-ledger.ns.svc.cluster.local", "7472")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), 7472))]

    name = "edgepath-ledger-0.edgepath-ledger.ns.svc.cluster.local:7472"
    assert resolved(name, getaddrinfo) == "10.0.0.5:7472"
    assert resolved(name, getaddrinfo) == "10.0.0.9:7472"
    assert resolved("10.1.2.3:7472", getaddrinfo) == "10.1.2.3:7472"  # an address: never asked
    assert resolved("/run/edgepath/ledger", getaddrinfo) == "/run/edgepath/ledger"

    def nxdomain(*_: object, **__: object) -> list[tuple]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(TransportError, match=r"cannot resolve nowhere\.example"):
        resolved("nowhere.example:7472", nxdomain)
