"""Slot floors over the data path: two agents on one slot server, one filling every slot for a tenant without a
floor, the other serving a tenant with a floor -- which takes its slots back (the reclaim word, the slot server's
hand-over) while the borrower's stream moves to a free slot or ends RECLAIMED.  Every request ends once, every
slot returns to FREE.  Over the chosen transport, with a handler whose answer is a function of its prompt
(helpers/counting.py), so a moved stream can be checked token for token."""

from __future__ import annotations

import time

import pytest
from helpers.counting import Counting
from helpers.datapath import wait_free
from helpers.waiting import eventually

from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.dpu.port import Delivery, SlotLimits
from edgepath.native.abi import State, Status

pytestmark = pytest.mark.transport

QUIET = 1  # the floor id of the tenant with a floor
MAX_NEW = 40  # tokens per answer: 40 x 50 ms, long enough that the noisy streams hold their slots


def submit(agent: Agent, prompt: list[int], tenant: int = 0, floor: int = 0) -> tuple[int, Status | None]:
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, prompt, request_id=index + 1, max_new_tokens=MAX_NEW, flags=wire.FLAG_STREAM)
    agent.frames.request_headers[index].floored(tenant, floor)
    return index, agent.submit(index)


def answer(prompt: list[int], count: int) -> list[int]:
    """What the counting handler answers to ``prompt``: the next ``count`` numbers."""
    return list(range(prompt[-1] + 1, prompt[-1] + 1 + count))


def until_final(agents: list[Agent], indexes: dict[tuple[int, int], None], timeout: float = 20.0) -> dict:
    """Poll every agent until each (agent number, frame) in ``indexes`` has its final delivery."""
    finals: dict[tuple[int, int], Delivery] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(finals) < len(indexes):
        for number, agent in enumerate(agents):
            for d in agent.poll(timeout=0.02):
                if d.final:
                    finals[(number, d.index)] = d
            agent.check_links()
    assert set(finals) == set(indexes), f"no final answer for {set(indexes) - set(finals)}"
    return finals


def test_a_tenant_under_its_floor_takes_its_slots_back_from_one_that_filled_the_pool(new_agent, serve) -> None:
    server = serve(Counting(0.05), slots=4)
    noisy, quiet = new_agent(), new_agent()
    noisy.attach(server.address)
    quiet.attach(server.address)
    quiet.set_limits({QUIET: SlotLimits(2)})
    borrowed = []
    for k in range(4):
        index, refused = submit(noisy, [10 * (k + 1)])
        assert refused is None
        borrowed.append(index)
    assert eventually(lambda: server.pool.count(State.RUNNING) == 4, 5.0)
    index, refused = submit(noisy, [99])
    assert refused == Status.NO_SLOT  # a tenant without a floor finds no free slot: 429 as always
    noisy.release(index)

    first, refused = submit(quiet, [500], QUIET, 2)
    assert refused is None  # never refused under its floor: a slot is being taken back
    second, refused = submit(quiet, [600], QUIET, 2)
    assert refused is None
    third, refused = submit(quiet, [700], QUIET, 2)
    assert refused == Status.NO_SLOT  # at its floor (its reclaims under way count): it borrows like anyone
    quiet.release(third)

    finals = until_final([noisy, quiet], {(1, first): None, (1, second): None, **{(0, i): None for i in borrowed}})
    for frame, prompt in ((first, [500]), (second, [600])):
        assert quiet.frames.result_headers[frame].status == Status.LENGTH
        assert quiet.frames.outputs[frame, :MAX_NEW].tolist() == answer(prompt, MAX_NEW)
    cut = [i for i in borrowed if noisy.frames.result_headers[i].status == Status.RECLAIMED]
    assert len(cut) == 2  # no free slot to move to: two borrowed streams end RECLAIMED, cut short
    for k, frame in enumerate(borrowed):
        result = noisy.frames.result_headers[frame]
        count = finals[(0, frame)].count
        assert count == result.output_count
        assert noisy.frames.outputs[frame, :count].tolist() == answer([10 * (k + 1)], count)  # valid so far
        assert (result.status, count < MAX_NEW) in ((Status.RECLAIMED, True), (Status.LENGTH, False))
    assert server.stats.reclaimed == 2
    assert sum(link.stats.handovers for link in quiet.links) == 2
    for agent in (noisy, quiet):
        stats = agent.delivery_stats
        assert (stats.duplicates, stats.unknown) == (0, 0)
    assert wait_free(server)
    assert all(wire.word_tenant(int(w)) == 0 for w in server.pool.states)  # a FREE word holds no tenant


def test_the_borrowers_stream_moves_to_a_free_slot_and_goes_on_as_one_stream(new_agent, serve) -> None:
    full, spare = serve(Counting(0.05), slots=2), serve(Counting(0.05), slots=2)
    noisy, quiet = new_agent(), new_agent()
    noisy.attach(full.address)
    borrowed = [submit(noisy, [10 * (k + 1)])[0] for k in range(2)]
    assert eventually(lambda: full.pool.count(State.RUNNING) == 2, 5.0)
    noisy.attach(spare.address)  # the noisy tenant's agent sees a server with free slots now
    quiet.attach(full.address)  # the quiet tenant's sees only the full one
    quiet.set_limits({QUIET: SlotLimits(1)})
    mine, refused = submit(quiet, [500], QUIET, 1)
    assert refused is None
    finals = until_final([noisy, quiet], {(1, mine): None, **{(0, i): None for i in borrowed}})
    assert quiet.frames.outputs[mine, :MAX_NEW].tolist() == answer([500], MAX_NEW)
    assert noisy.delivery_stats.migrated == 1 and full.stats.reclaimed == 1
    for k, frame in enumerate(borrowed):  # the moved one as the other: the whole answer, nothing repeated
        assert noisy.frames.result_headers[frame].status == Status.LENGTH
        assert finals[(0, frame)].count == MAX_NEW
        assert noisy.frames.outputs[frame, :MAX_NEW].tolist() == answer([10 * (k + 1)], MAX_NEW)
    assert (noisy.delivery_stats.duplicates, noisy.delivery_stats.unknown) == (0, 0)
    assert wait_free(full) and wait_free(spare)


def test_a_reclaim_given_up_on_before_its_slot_is_handed_over_gives_the_slot_back(new_agent, serve) -> None:
    server = serve(Counting(0.05), slots=1)
    noisy, quiet = new_agent(), new_agent()
    noisy.attach(server.address)
    quiet.attach(server.address)
    borrowed, _ = submit(noisy, [10])
    assert eventually(lambda: server.pool.count(State.RUNNING) == 1, 5.0)
    mine, refused = submit(quiet, [500], QUIET, 1)
    assert refused is None
    quiet.abandon(mine)  # its client went away at once
    until_final([noisy], {(0, borrowed): None})
    assert noisy.frames.result_headers[borrowed].status == Status.RECLAIMED
    assert eventually(lambda: bool(quiet.poll(timeout=0.02)) or mine not in quiet.inflight, 5.0)
    assert mine not in quiet.inflight  # the frame is free again: nothing of it can land anywhere
    assert wait_free(server)  # the slot handed over to it was given back at once, not held for its lease
    assert quiet.delivery_stats.late == 1 and quiet.delivery_stats.unknown == 0


def test_an_early_refusal_rests_on_the_words_read_now_and_spares_a_tenant_under_its_floor(new_agent, serve) -> None:
    """What the edge asks before it tokenizes a prompt (docs/TENANTS.md): NO_SLOT only when the state words, read
    now, have no free slot for the request and its tenant is not under its floor."""
    server = serve(Counting(0.05), slots=4)
    noisy, other = new_agent(), new_agent()
    noisy.attach(server.address)
    other.attach(server.address)  # its cached words, read now, are all FREE
    borrowed = [submit(noisy, [10 * (k + 1)])[0] for k in range(4)]
    assert eventually(lambda: server.pool.count(State.RUNNING) == 4, 5.0)
    index = other.acquire()
    assert index is not None
    assert other.early_refusal(index, 0, 0) is None  # its cache (read at attach) says free: no READ, submit decides
    assert other.free_slots() == (0, 4)  # read: every slot claimed
    assert other.early_refusal(index, 0, 0) == Status.NO_SLOT
    assert other.early_refusal(index, QUIET, 2) is None  # under its floor: it takes a slot back at submit
    noisy.cancel(borrowed[0])
    assert eventually(lambda: server.pool.free_count() == 1, 5.0)
    assert other.early_refusal(index, 0, 0) is None  # its cache says none free; the words say one is
    assert other.early_refusal(index, 0, 0, slots=2) == Status.NO_SLOT  # two choices need two free slots
    other.release(index)
    for frame in borrowed[1:]:
        noisy.cancel(frame)
    until_final([noisy], {(0, i): None for i in borrowed})
    assert wait_free(server)


class Recording(Counting):
    """:class:`Counting` with a token every step, each step taking ``step_s`` and recording the first prompt token
    of every request it ran."""

    def __init__(self, step_s: float) -> None:
        super().__init__(0.0)
        self.step_s = step_s
        self.steps: list[set[int]] = []

    def step(self, now: float) -> list:
        time.sleep(self.step_s)
        self.steps.append({int(request.tokens[0]) for request, _, _ in self._running.values()})
        return super().step(now)


def test_the_step_after_a_hand_over_runs_the_reclaimers_request(new_agent, serve) -> None:
    """The borrower's stream ends between two steps and the reclaimer can only send its request after the hand-over:
    the next step waits for it (``handover_wait``, long here so that the test's polling cannot miss it), so the
    tenant under its floor starts one step after its reclaim was seen, not two."""
    handler = Recording(0.1)
    server = serve(handler, slots=2, handover_wait=5.0)
    noisy, quiet = new_agent(), new_agent()
    noisy.attach(server.address)
    quiet.attach(server.address)
    borrowed = [submit(noisy, [10 * (k + 1)])[0] for k in range(2)]
    assert eventually(lambda: server.pool.count(State.RUNNING) == 2, 5.0)
    mine, refused = submit(quiet, [500], QUIET, 1)
    assert refused is None
    until_final([noisy, quiet], {(1, mine): None, **{(0, i): None for i in borrowed}})
    (cut,) = [k for k, i in enumerate(borrowed) if noisy.frames.result_headers[i].status == Status.RECLAIMED]
    last = max(n for n, ran in enumerate(handler.steps) if 10 * (cut + 1) in ran)
    assert 500 in handler.steps[last + 1]  # not a step of the other stream alone in between
    assert quiet.frames.result_headers[mine].status == Status.LENGTH
    kept = borrowed[1 - cut]
    assert noisy.frames.result_headers[kept].status == Status.LENGTH  # the stream not taken lost nothing
    assert wait_free(server)
