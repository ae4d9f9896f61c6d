"""Slot floors at claim time, with no queue: which slot a tenant under its floor takes back when none is free.

A tenant's **slot floor** is the number of slots it can always have (docs/TENANTS.md).  Claims stay
work-conserving: any tenant claims any FREE slot, so a floor nobody uses is lent out.  Every claim writes the
claimer's tenant into the slot's state word (ABI 10: its floor id, 0 for a tenant without a floor), and the
word keeps it until the slot is FREE again, so every agent that reads a pool's state words -- any edge, any
``--workers`` process, any host on that slot server -- sees how many slots each tenant holds, from what it
reads anyway.  When a tenant under its floor (:func:`~edgepath.contract.plan.under_floor`) finds no FREE
slot, a slot of a tenant *above* its floor (one without a floor is always above it) is taken back: the agent
asks the slot server to hand it that slot (:class:`~edgepath.dpu.floor_book.FloorBook`).  If the floors of all
tenants fit in the slots (the sum of the floors at most the slots), such a slot always exists: the other tenants
hold more than their floors add up to.

This module only decides, from state words and floors (sans I/O): how many slots each tenant holds, how many of
them are above its floor, and which slots a tenant under its floor may take back, best first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgepath.contract import wire
from edgepath.native.abi import State


@dataclass(frozen=True, slots=True)
class Victim:
    """A slot a tenant under its floor may take back: which server (an index into the words given),
    which slot, in which generation, and whose it is (the tenant's floor id)."""

    server: int
    slot: int
    generation: int
    tenant: int


def held(words: Sequence[np.ndarray]) -> Counter[int]:
    """Slots each tenant holds (by floor id) over the pools whose state words are given: every word that is not
    FREE (claimed, running or finishing), its tenant field."""
    counts: Counter[int] = Counter()
    for pool in words:
        taken = ~wire.in_state(pool, State.FREE)
        if taken.any():
            ids, n = np.unique(wire.words_tenants(pool[taken]), return_counts=True)
            counts.update({int(i): int(c) for i, c in zip(ids, n, strict=True)})
    return counts


def moving(holdings: Counter[int], reclaims: Sequence[tuple[int, int]]) -> Counter[int]:
    """``holdings`` with reclaims under way counted as done: each (from, to) pair -- the tenant whose slot is being
    taken back, the tenant taking it -- moves one slot.  What an agent knows of its own reclaims before the state
    words show them, so that it never asks for more than its tenants' floors."""
    out = Counter(holdings)
    for victim, owner in reclaims:
        out[victim] -= 1
        out[owner] += 1
    return out


def above_floor(tenant: int, floors: Mapping[int, int], holdings: Mapping[int, int]) -> int:
    """How many of ``tenant``'s slots are above its floor (borrowed: it may lose them to a tenant under its own): all
    of a tenant without a floor, none of one whose floor is not known here (never taken from a tenant that might be
    within its floor)."""
    if tenant == 0:
        return holdings.get(0, 0)
    floor = floors.get(tenant)
    if floor is None:
        return 0
    return max(0, holdings.get(tenant, 0) - floor)


def victims(
    tenant: int,
    words: Sequence[np.ndarray],
    floors: Mapping[int, int],
    holdings: Mapping[int, int],
    skip: frozenset[tuple[int, int]] = frozenset(),
    start: int = 0,
    since: Sequence[np.ndarray] | None = None,
) -> list[Victim]:
    """The slots ``tenant`` may take back, best first: slots of other tenants above their floors (the tenant with
    the most slots lent first, so a floor is taken from whoever borrowed most), of those the stream that has run
    least first (``since``, per pool: when each slot's claim was first seen, the latest first -- its cut throws away
    least: a floor that takes slots back often takes back the slot a borrower has just refilled, not a long answer
    near its end), servers in the order given (the caller's admission order), each pool's slots from ``start`` on (a
    rotating cursor, so that several agents do not all pick the same slot).  ``skip``: (server, slot) pairs not to
    offer (reclaims under way).  RUNNING slots come first: the slot server ends those at once.  Then slots claimed
    or rung but not started yet: the server cannot end those yet and says so, and the reclaimer asks again
    (:data:`~edgepath.dpu.floor_book.RECLAIM_TRIES` times) -- without them, a tenant under its floor that arrived
    while every lent slot had just changed hands was refused (a noisy closed loop re-claims a slot the moment it
    frees: ``tests/system/test_serve_floors.py`` saw it)."""
    out: list[tuple[int, int, float, int, Victim]] = []
    for server, pool in enumerate(words):
        n = len(pool)
        seen = None if since is None else since[server]
        for rank, state in enumerate(_VICTIM_STATES):
            for slot in sorted(
                (int(s) for s in np.flatnonzero(wire.in_state(pool, state))), key=lambda s: (s - start) % n
            ):
                word = int(pool[slot])
                owner = wire.word_tenant(word)
                spare = above_floor(owner, floors, holdings)
                if owner == tenant or spare <= 0 or (server, slot) in skip:
                    continue
                young = 0.0 if seen is None else -float(seen[slot])
                out.append((rank, -spare, young, len(out), Victim(server, slot, wire.word_generation(word), owner)))
    out.sort(key=lambda entry: entry[:4])
    return [victim for *_, victim in out]


#: The states a slot may be taken back in, in the order they are offered (see :func:`victims`).
_VICTIM_STATES = (State.RUNNING, State.READY, State.CLAIMED)
