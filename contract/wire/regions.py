"""The regions edgepath processes export to each other, the access each grants, and the words a slot server's
pool header publishes for its agents: the heartbeat, the draining word and the load region (the step policy's
costs, knobs and work, :class:`~edgepath.contract.plan.Load`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgepath.contract.plan import Costs, Load, PolicyOptions, Prompt
from edgepath.native.abi import POOL_HEADER, field_offset, lib, struct_dtype
from edgepath.transports.base import Access

#: A slot server's pool is exported as three regions over the one memory, each granting an agent only what it
#: needs (docs/DATAPATH.md, "Who may touch what"): ``pool`` -- the header, the load region, the state words and the
#: prefix table, what admission reads (READ); ``states`` -- the state words, what a claim swaps (ATOMIC); ``inbox``
#: -- the doorbell, cancel and reclaim words and the slots, what claiming and submitting write (WRITE).  No agent
#: can READ a slot: another's prompt or answer.
POOL_REGION = "pool"
POOL_ACCESS = Access.REMOTE_READ
STATES_REGION = "states"
STATES_ACCESS = Access.REMOTE_ATOMIC
INBOX_REGION = "inbox"
INBOX_ACCESS = Access.REMOTE_WRITE


@dataclass(frozen=True)
class Export:
    """A region a slot server exports: ``length`` bytes of its pool from byte ``start``, granting ``access``."""

    name: str
    start: int
    length: int
    access: Access


def pool_exports(states_offset: int, slot_count: int, doorbells_offset: int, total_size: int) -> list[Export]:
    """The regions a pool of this layout (its header's fields) is exported as: what the slot server registers and
    what an agent checks it was given."""
    return [
        Export(POOL_REGION, 0, doorbells_offset, POOL_ACCESS),
        Export(STATES_REGION, states_offset, 8 * slot_count, STATES_ACCESS),
        Export(INBOX_REGION, doorbells_offset, total_size - doorbells_offset, INBOX_ACCESS),
    ]


#: an agent's request entries ``[request header][tokens]``: edges fill them, the agent sends from them
REQUESTS_REGION = "requests"
#: an agent's reply entries ``[result header][output]``: the one region a slot server may write
REPLIES_REGION = "replies"
REPLIES_ACCESS = Access.REMOTE_WRITE
#: an agent process's published status (free slots, total slots, slot servers alive), read by edges
STATUS_REGION = "status"
#: an edge's 8-byte landing spot for its agent's zero-length WRITE_WITH_IMM answers
COMPLETIONS_REGION = "completions"

#: byte offset of the pool header's heartbeat word: the slot server advances it at every turn of its loop (and from
#: inside long steps) to its CLOCK_MONOTONIC in ns; readers compare its values for liveness, and subtract the load
#: region's version from it (:func:`under_way_ms`) -- an agent reads ``[heartbeat .. state[n-1]]`` in one READ
HEARTBEAT_OFFSET = field_offset(POOL_HEADER, "heartbeat")
#: byte offset of the pool header's draining word (in the same READ): nonzero once the slot server is stopping
DRAINING_OFFSET = field_offset(POOL_HEADER, "draining")
#: the load region (``struct ep_load``; micro-batch costs since ABI 9): right after the pool header, before the
#: state words, so the READ from the heartbeat on carries it; the step policy's costs, knobs and work
#: (:class:`~edgepath.contract.plan.Load`)
LOAD_REGION = struct_dtype("ep_load")
LOAD_OFFSET = POOL_HEADER.itemsize
#: prompts in prefill the region lists one by one (more are summed into the last entry)
LOAD_PROMPTS = int(lib.EP_LOAD_PROMPTS)


def load_record(load: Load) -> np.ndarray:
    """The load region's fields for ``load`` (its sequence-lock words left 0: ``ep_load_publish`` sets them)."""
    record = np.zeros(1, dtype=LOAD_REGION)
    if not load.published:
        return record
    r = record[0]
    costs, options = load.costs, load.options
    assert options is not None
    r["overhead_ms"], r["prompt_ms"], r["decode_ms"] = costs.overhead_ms, costs.prompt_ms, costs.decode_ms
    r["context_ms"], r["decode_context_ms"] = costs.context_ms, costs.decode_context_ms
    r["stall_ms"], r["min_prefill"], r["batch"] = options.stall_ms, options.min_prefill, options.batch
    r["decoding"], r["runs"], r["longest"], r["prefilling"] = load.decoding, load.runs, load.longest, len(load.waiting)
    waiting = load.waiting
    if len(waiting) > LOAD_PROMPTS:  # the rest summed into the last entry: they follow it, oldest first
        rest = waiting[LOAD_PROMPTS - 1 :]
        waiting = (*waiting[: LOAD_PROMPTS - 1], Prompt(rest[0].done, sum(p.remaining for p in rest)))
    r["listed"] = len(waiting)
    r["floors"] = min(load.floors, len(waiting) - (len(load.waiting) > LOAD_PROMPTS))  # never the summed entry
    r["lent_ms"] = load.lent_ms
    pairs = r["prompts"]
    for i, prompt in enumerate(waiting):
        pairs[2 * i], pairs[2 * i + 1] = min(prompt.done, 0xFFFFFFFF), min(prompt.remaining, 0xFFFFFFFF)
    return record


def under_way_ms(beat: int, version: int) -> float | None:
    """How long the step planned from a load region of ``version`` had run when the heartbeat word read ``beat``:
    both are the server's CLOCK_MONOTONIC in ns when stored (ABI 11), and the server publishes its load after each
    step, so the next starts then.  0 when the heartbeat was stored before the load (the step had just begun);
    None when either word was never stored (no load published, no heartbeat yet): nothing is known."""
    if not beat or not version:
        return None
    return max(0, beat - version) / 1e6


def read_load(region: np.void) -> Load | None:
    """The :class:`~edgepath.contract.plan.Load` in a copy of a load region; None when the copy is torn (read
    while the server rewrote it: keep the previous one).  All zero: the server publishes no load."""
    if int(region["end"]) != int(region["begin"]):
        return None
    batch = int(region["batch"])
    if not batch:
        return Load()
    costs = Costs(
        float(region["overhead_ms"]),
        float(region["prompt_ms"]),
        float(region["decode_ms"]),
        float(region["context_ms"]),
        float(region["decode_context_ms"]),
    )
    options = PolicyOptions(float(region["stall_ms"]), int(region["min_prefill"]), batch)
    pairs = region["prompts"]
    listed = min(int(region["listed"]), LOAD_PROMPTS)
    waiting = tuple(Prompt(int(pairs[2 * i]), int(pairs[2 * i + 1])) for i in range(listed) if pairs[2 * i + 1])
    floors = min(int(region["floors"]), len(waiting))
    decoding, longest, runs = int(region["decoding"]), int(region["longest"]), int(region["runs"])
    return Load(costs, options, decoding, longest, waiting, runs, floors, float(region["lent_ms"]))
