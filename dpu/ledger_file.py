"""A quota ledger's words kept in a file, so that a ledger process started again (a pod restarted, on the volume
it had) goes on from what was spent instead of from every bucket full.

The words live in registered memory that edges CAS directly (shared memory, or through the NIC), so the home never
sees a request; what can be kept is a copy of the region.  :class:`LedgerFile` reads and writes that copy (a header
naming what it is, how many entries and a CRC of the words; written to a temporary file, flushed, then renamed over
the old one: a crash while saving leaves the old copy whole); :class:`Saver` saves the region every ``interval``
seconds when it changed, and once more when the ledger stops (after its edges were let go: the last word an edge
CASed is in it).

What a restart keeps, stated (docs/TENANTS.md): after a stop (SIGTERM, SIGINT) everything; after a kill
(SIGKILL, a crash, the node lost with its volume kept) what was spent up to the last save, so at most what the
tenants spent in the last ``interval`` is forgiven; with the file lost too, every bucket starts full.  A file that is
there but cannot be read as a ledger of this size is refused, naming it, never taken for an empty one.  The bucket
words count against absolute time (:func:`edgepath.contract.wire.bucket_clock`), so an old copy is simply read
later: what refilled meanwhile has refilled.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("edgepath.ledger")

#: the file's header: magic, format version, entries, CRC-32 of the words that follow (16 bytes per entry)
_HEADER = struct.Struct("<8sIII")
MAGIC, VERSION = b"EPLEDGER", 1
#: seconds between saves by default (``edgepath ledger --save-interval``): what a kill may forgive
DEFAULT_SAVE_INTERVAL = 1.0


class LedgerFileError(ValueError):
    """A ledger file that is there but is not a ledger of the expected size (the message says which and why)."""


class LedgerFile:
    """The copy of a ledger of ``entries`` entries at ``path``."""

    def __init__(self, path: str | os.PathLike[str], entries: int) -> None:
        self.path = Path(path)
        self.entries = entries

    @property
    def size(self) -> int:
        """Bytes of the words: 16 per entry."""
        return 16 * self.entries

    def load(self) -> bytes | None:
        """The words the file holds; None when there is no file (a first start: every bucket full)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise LedgerFileError(f"ledger file {self.path}: cannot read it: {exc.strerror}") from None
        fix = "; move it away to start with every bucket full (what was spent is then forgiven)"
        if len(data) < _HEADER.size:
            raise LedgerFileError(f"ledger file {self.path}: {len(data)} bytes, shorter than its header{fix}")
        magic, version, entries, crc = _HEADER.unpack_from(data)
        words = data[_HEADER.size :]
        if magic != MAGIC or version != VERSION:
            raise LedgerFileError(f"ledger file {self.path}: not an edgepath ledger file of version {VERSION}{fix}")
        if entries != self.entries or len(words) != self.size:
            raise LedgerFileError(
                f"ledger file {self.path}: a ledger of {entries} entries ({len(words)} bytes of words), not "
                f"{self.entries}{fix}"
            )
        if zlib.crc32(words) != crc:
            raise LedgerFileError(f"ledger file {self.path}: its words do not match their checksum{fix}")
        return words

    def save(self, words: bytes) -> None:
        """Write ``words`` whole or not at all: a temporary file beside it, flushed to the disk, renamed over the
        old copy, the directory flushed."""
        if len(words) != self.size:
            raise ValueError(f"a ledger of {self.entries} entries has {self.size} bytes of words, not {len(words)}")
        temporary = self.path.with_name(self.path.name + ".new")
        with open(temporary, "wb") as out:
            out.write(_HEADER.pack(MAGIC, VERSION, self.entries, zlib.crc32(words)))
            out.write(words)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, self.path)
        directory = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


class Saver:
    """Saves ``read()`` (a copy of the region's words) to ``file`` every ``interval`` seconds when it changed, on a
    thread of its own; :meth:`stop` saves a last time.  A save that fails is logged and tried again at the next
    interval (the ledger goes on serving: the edges never wait for the disk)."""

    def __init__(self, file: LedgerFile, read: Callable[[], bytes], interval: float, saved: bytes | None) -> None:
        self.file, self._read, self.interval = file, read, interval
        self._last = saved if saved is not None else bytes(file.size)  # what the file holds (all 0: none)
        self.saves = self.failures = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ledger-saver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.save()

    def save(self) -> bool:
        """Save now if the words changed since the last save; whether the file holds them now."""
        with self._lock:
            words = self._read()
            if words == self._last:
                return True
            try:
                self.file.save(words)
            except OSError as exc:
                self.failures += 1
                log.error(
                    "quota ledger: cannot save its words to %s: %s; trying again in %.1f s (a restart now "
                    "would forgive what was spent since the last save)",
                    self.file.path,
                    exc,
                    self.interval,
                )
                return False
            self._last = words
            self.saves += 1
            return True

    def stop(self) -> bool:
        """Stop saving on the thread and save the words as they are now; whether that last save was made."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.save()
