"""Prefix-affine admission end to end: two slot servers running the real llama handler on the SmolLM2 GGUF, one
agent attached to both.  A second chat sharing a ~430-token system prompt (with the chat template) is claimed on
the server that computed the first one -- though the other has more free slots -- and is answered with
``cached_tokens`` = the shared prefix."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.datapath import collect
from helpers.prefix import prefix_match

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

from edgepath.contract import wire
from edgepath.dpu.agent import Agent
from edgepath.dpu.frame import write_request
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.model.gguf import default_model_path
from edgepath.model.llama import LlamaHandler
from edgepath.native.abi import Status
from edgepath.slots.handlers import HandlerConfig

IN_CAP = 640
OUT_CAP = 8  # tokens of each answer
RULES = (
    "Day tickets are valid until the last train of the day and cannot be refunded once used.",
    "Children under six travel free with an adult; children from six to fifteen pay half the adult fare.",
    "Dogs travel on a child ticket; small pets in a closed basket travel free.",
    "Bicycles need a bicycle pass and are carried only outside the morning and evening rush hours.",
    "Luggage up to two suitcases per traveller is free; skis and snowboards count as one suitcase.",
    "Wheelchair users should call the ticket office a day ahead so that staff can help at both ends of the trip.",
    "Groups of ten or more get a fifth off the fare when they book at least three days ahead.",
    "Refunds for unused tickets are paid within ten working days, less a small handling fee.",
    "In winter the first train leaves the valley station at half past seven and the last one returns at six.",
    "In summer trains run every half hour from seven in the morning until eight in the evening.",
    "When a train is cancelled because of the weather, every ticket for that day is refunded in full.",
    "The summit restaurant opens at nine and closes one hour before the last train down.",
    "Lost property is kept at the valley station for three months; call the ticket office to ask for it.",
    "Season passes are personal, carry a photo and must be shown together with an identity card on request.",
    "Smoking is not allowed on trains, on platforms or in the stations, and that includes electronic cigarettes.",
    "Tickets bought on the train cost a little more than tickets bought at the station or online.",
    "The panorama carriage can be reserved for weddings and birthdays; ask the ticket office for a quote.",
    "Hikers who walk up may buy a single ticket down at the summit station at the same price as one up.",
    "When you are not sure of an answer, say so plainly and point the traveller to the ticket office.",
)
SYSTEM = (
    "You are the help desk of a small mountain railway. You answer questions about routes, timetables, tickets, "
    "luggage, bicycles, pets, accessibility, group travel and refunds, politely, briefly and in plain words. "
    + " ".join(RULES)
)


@pytest.fixture(scope="module")
def tok() -> GGUFTokenizer:
    return GGUFTokenizer(default_model_path())


def chat(tok: GGUFTokenizer, question: str) -> list[int]:
    frame = np.zeros(IN_CAP, dtype=np.int32)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return frame[: tok.encode_chat_into(messages, frame)].tolist()


def llama(slots: int) -> LlamaHandler:
    """The llama handler for a slot server of ``slots`` (1 thread; a sequence holds a prompt and its answer)."""
    options = {"threads": "1", "ctx_per_slot": str(IN_CAP + OUT_CAP)}
    return LlamaHandler.from_config(HandlerConfig(slots, IN_CAP, IN_CAP, options))


def ask(agent: Agent, tokens: list[int]) -> int:
    """One chat through the agent (greedy, not streamed); the cached_tokens of its answer."""
    index = agent.acquire()
    assert index is not None
    write_request(agent.frames, index, tokens, request_id=index + 1, max_new_tokens=OUT_CAP)
    assert agent.submit(index) is None
    deliveries = collect(agent, index, timeout=240.0)
    assert deliveries and deliveries[-1].final, "no answer within 240 s"
    result = agent.frames.result_headers[index]
    assert result.status in (Status.OK, Status.LENGTH, Status.STOP)
    cached = result.cached_tokens
    agent.release(index)
    return cached


def test_the_second_chat_is_claimed_where_its_system_prompt_is_and_reuses_it(
    tok: GGUFTokenizer, serve, new_agent
) -> None:
    first, second = chat(tok, "Can I bring my dog?"), chat(tok, "Is there a restaurant at the top?")
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared >= 400  # the system prompt and the chat template before the question
    warm, cold = serve(llama(1), slots=1, cap=IN_CAP), serve(llama(2), slots=2, cap=IN_CAP)
    agent = new_agent(frames=4, cap=IN_CAP)
    # The first chat is computed on `warm` (another agent's traffic, say: this agent is attached to it alone).
    warm_link = agent.attach(warm.address)
    assert ask(agent, first) == 0
    cold_link = agent.attach(cold.address)
    agent.free_slots()  # the READ of the state words that an agent process repeats every 100 ms
    assert prefix_match(warm_link.prefixes, np.array(second, dtype=np.int32)) == shared // wire.PREFIX_BLOCK
    assert (warm_link.free_hint, cold_link.free_hint) == (1, 2)  # by free slots alone, `cold` would be first
    cached = ask(agent, second)
    assert (warm_link.stats.claims, cold_link.stats.claims) == (2, 0)
    assert warm_link.stats.affine == 1
    assert cached == shared  # the system prompt's KV was reused, not computed again
