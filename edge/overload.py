"""Shedding before the memory limit (Envoy's overload manager): above a high-water mark of its memory limit the edge
answers new work 503 ``overloaded`` with ``Retry-After``, and says so in ``/metrics``, so that it is never killed for
memory -- which would end every tenant's streams and, in one pod with the quota ledger, forgive every spent quota.

:class:`MemoryGuard` is the decision, sans I/O: a reading of the memory used and the limit in, whether to shed out,
with a little hysteresis so that it does not flap at the mark.  :func:`read_memory` is the reading: the edge
process's resident memory (what a request's parsing, templating and answers grow; the page cache the kernel can
reclaim is not counted), against ``--memory-limit`` or else the memory limit of the process's cgroup (a container's
or a pod's); with neither, there is no limit to guard and nothing is shed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: the default of ``--memory-high-water``: shed new work above this share of the memory limit
DEFAULT_HIGH_WATER = 0.85
#: shedding stops below this share of the mark (so one freed buffer does not let a burst back in at once)
RESUME = 0.95


@dataclass(frozen=True, slots=True)
class MemoryReading:
    """Bytes the edge uses, and its limit (None: no limit known)."""

    used: int
    limit: int | None


class MemoryGuard:
    """Whether to shed new work, from readings of memory against a ``high_water`` share of the limit."""

    def __init__(self, high_water: float = DEFAULT_HIGH_WATER) -> None:
        if not 0 < high_water <= 1:
            raise ValueError(f"the memory high-water mark is a share of the limit in (0, 1], got {high_water}")
        self.high_water = high_water
        self.shedding = False
        self.reading = MemoryReading(0, None)

    def update(self, reading: MemoryReading) -> bool:
        """Take a reading; whether new work is shed from now on."""
        self.reading = reading
        if reading.limit is None:
            self.shedding = False
            return False
        mark = self.high_water * reading.limit
        self.shedding = reading.used >= (mark * RESUME if self.shedding else mark)
        return self.shedding


def read_memory(
    limit: int | None = None, proc: Path = Path("/proc/self"), cgroups: Path = Path("/sys/fs/cgroup")
) -> MemoryReading:
    """This process's resident memory, and ``limit`` or else its cgroup's memory limit (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``; None when unlimited or unknown)."""
    resident = int((proc / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return MemoryReading(resident, limit if limit is not None else cgroup_limit(proc, cgroups))


def cgroup_limit(proc: Path = Path("/proc/self"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The memory limit of the process's cgroup in bytes, None when it has none (or it cannot be read)."""
    try:
        lines = (proc / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy (under unified/ on a hybrid system)
            relative = path.lstrip("/")
            candidates = [cgroups / relative / "memory.max", cgroups / "unified" / relative / "memory.max"]
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            candidates = [cgroups / "memory" / path.lstrip("/") / "memory.limit_in_bytes"]
        else:
            continue
        for candidate in candidates:
            try:
                text = candidate.read_text().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 1 << 60:  # v1 writes "no limit" as a huge number, v2 as "max"
                return int(text)
    return None
