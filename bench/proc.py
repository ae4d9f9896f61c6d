"""Processes' CPU time as /proc counts it: how the benchmarks charge a server (or the client) for its work."""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str = "self") -> float:
    """utime + stime of ``pid`` so far (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children of each of its threads, recursively)."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *descendants(int(child))]
    return out


def tree_cpu_seconds(pid: int) -> float:
    """CPU of ``pid`` and every live descendant: a server that runs as several processes, as one figure."""
    total = 0.0
    for member in (pid, *descendants(pid)):
        try:
            total += cpu_seconds(member)
        except FileNotFoundError:  # exited between the listing and the read
            continue
    return total
