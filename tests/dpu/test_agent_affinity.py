"""Prefix-affine admission: with several slot servers the agent claims first on the one whose prefix table
holds the longest prefix of the request (while it has a free slot), then by free slots -- against real slot
servers over the chosen transport, with a handler that holds what it answered (a stand-in for a model's prefix
cache: the unit here is the data path's table and the agent's order, not the model)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.datapath import send, serve_once
from helpers.prefix import prefix_match

from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.native.abi import State, Status
from edgepath.slots.handlers import Emit, HoldsPrefixes, SlotRequest, echo

pytestmark = pytest.mark.transport

BLOCK = wire.PREFIX_BLOCK
CAP = 4 * BLOCK


class Remembers:
    """Echoes a request's first token and holds every prompt it answered, as a prefix cache would."""

    def __init__(self, held: list[np.ndarray] | None = None) -> None:
        self.held = [(0, tokens) for tokens in held or []]
        self.version = 0

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        request.output[:1] = request.tokens[:1]
        self.held.insert(0, (request.salt, request.tokens.copy()))
        self.version += 1
        return [Emit(request.slot, 1, Status.OK)]

    def step(self, now: float) -> list[Emit]:
        return []

    def cancel(self, slot: int) -> bool:
        return True

    def wake_in(self, now: float) -> float | None:
        return None

    def close(self) -> None:
        pass

    def prefixes_version(self) -> int:
        return self.version

    def prefixes(self) -> list[tuple[int, np.ndarray]]:
        return self.held


def ids(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 49152, n).tolist()


SYSTEM = ids(2 * BLOCK + 9, seed=1)  # a system prompt: two whole blocks and a bit


def claimed_on(server) -> int:
    return server.pool.count(State.CLAIMED)


def test_the_claim_goes_where_the_prefix_is_while_it_has_a_free_slot(make_server, new_agent) -> None:
    assert isinstance(Remembers(), HoldsPrefixes)
    warm = make_server(Remembers([np.array(SYSTEM, dtype=np.int32)]), slots=1, cap=CAP)
    cold = make_server(echo, slots=3, cap=CAP)  # publishes no table
    assert len(warm.pool.prefixes) == wire.PREFIX_ENTRIES and len(cold.pool.prefixes) == 0
    assert prefix_match(warm.pool.prefixes, np.array(SYSTEM)) == 2  # published at start
    agent: Agent = new_agent(cap=CAP)
    warm_link, cold_link = agent.attach(warm.address), agent.attach(cold.address)
    # Another prompt goes by free slots (today's rule): the server with three.
    send(agent, ids(3 * BLOCK, seed=2))
    assert (claimed_on(warm), claimed_on(cold)) == (0, 1)
    # A chat with the system prompt goes to the server that holds it, though the other has more free slots.
    send(agent, SYSTEM + ids(BLOCK, seed=3))
    assert (claimed_on(warm), claimed_on(cold)) == (1, 1)
    assert (warm_link.stats.affine, cold_link.stats.affine) == (1, 0)
    # That server is full now: the next one sharing the prefix is admitted on the other, not refused.
    send(agent, SYSTEM + ids(BLOCK, seed=4))
    assert (claimed_on(warm), claimed_on(cold)) == (1, 2)
    assert warm_link.stats.affine == 1 and warm_link.stats.cas_attempts == 1  # no CAS tried on the full one


def test_what_a_server_answered_is_published_and_draws_the_follow_up(make_server, new_agent) -> None:
    a, b = make_server(Remembers(), slots=2, cap=CAP), make_server(Remembers(), slots=2, cap=CAP)
    agent: Agent = new_agent(cap=CAP)
    link_a, link_b = agent.attach(a.address), agent.attach(b.address)
    first = SYSTEM + ids(BLOCK, seed=5)
    index = send(agent, first)  # both hold nothing and have two free slots: the first listed
    assert serve_once(a) == 1
    assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [index]
    agent.release(index)
    assert prefix_match(a.pool.prefixes, np.array(first)) == 3  # the slot server published it
    # The agent learns it with its next READ of the state words (an agent process does one every 100 ms).
    assert prefix_match(link_a.prefixes, np.array(first)) == 0
    agent.free_slots()
    assert prefix_match(link_a.prefixes, np.array(first)) == 3
    send(agent, ids(3 * BLOCK, seed=6))  # another prompt: a tie, the first listed -- a has one free slot left
    assert (claimed_on(a), claimed_on(b)) == (1, 0)
    # By free slots b would come first; the follow-up turn goes to a, which holds its first three blocks.
    send(agent, first + ids(BLOCK // 2, seed=7))
    assert (claimed_on(a), claimed_on(b)) == (2, 0)
    assert (link_a.stats.affine, link_b.stats.affine) == (1, 0)


def test_a_prefix_draws_only_requests_of_the_salt_it_was_written_under(make_server, new_agent) -> None:
    """Placement reveals nothing across tenants: another salt's request holding the same prompt is placed by free
    slots, as if nothing were held; the writer's own follow-up still goes where its prefix is."""
    a, b = make_server(Remembers(), slots=2, cap=CAP), make_server(Remembers(), slots=2, cap=CAP)
    agent: Agent = new_agent(cap=CAP)
    link_a, link_b = agent.attach(a.address), agent.attach(b.address)
    tenant_a, tenant_b = wire.cache_salt(b"key-a"), wire.cache_salt(b"key-b")
    first = SYSTEM + ids(BLOCK, seed=5)

    def send_salted(tokens: list[int], salt: int) -> int:
        index = agent.acquire()
        assert index is not None
        write_request(agent.frames, index, tokens, request_id=index + 1, max_new_tokens=CAP, flags=wire.FLAG_STREAM)
        agent.frames.request_headers[index].salted(salt)
        assert agent.submit(index) is None
        return index

    index = send_salted(first, tenant_a)  # a tie: the first listed
    assert serve_once(a) == 1
    assert [d.index for d in agent.poll(timeout=5.0) if d.final] == [index]
    agent.release(index)
    agent.free_slots()
    send_salted(ids(3 * BLOCK, seed=6), 0)  # another prompt: a tie, a -- which has one free slot left
    assert (claimed_on(a), claimed_on(b)) == (1, 0)
    send_salted(first, tenant_b)  # B sends A's prompt: b has more free slots and a holds nothing of B's
    assert (claimed_on(a), claimed_on(b)) == (1, 1)
    send_salted(first, tenant_a)  # A's own repeat: a ties b on free slots, and holds A's prefix
    assert (claimed_on(a), claimed_on(b)) == (2, 1)
    assert (link_a.stats.affine, link_b.stats.affine) == (1, 0)
