"""A stream migrated mid-answer on the real model: two slot servers running SmolLM2 (in process, over the chosen
data path), the one answering is stopped after some tokens, the agent claims the request again on the other
with its prompt and the answer so far -- and at temperature 0 the whole answer is token for token the one an
uninterrupted run gives (with llamafile off, a prompt decoded in one step and token by token give the same
logits bit for bit: docs/MODEL.md)."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")

from helpers.datapath import collect, send

from edgepath.dpu.agent import Agent
from edgepath.edge.text.tokenizer import GGUFTokenizer
from edgepath.model.gguf import default_model_path
from edgepath.model.llama import LlamaHandler
from edgepath.native.abi import Status
from edgepath.slots.handlers import HandlerConfig

CAP = 256
MAX_NEW = 40
OPTIONS = {"threads": "1", "ctx_per_slot": "320", "prefix_cache": "off"}


def handler() -> LlamaHandler:
    return LlamaHandler.from_config(HandlerConfig(1, CAP, CAP, dict(OPTIONS)))


def prompt() -> list[int]:
    tok = GGUFTokenizer(default_model_path())
    frame = np.zeros(CAP, dtype=np.int32)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Describe a walk along a river in spring, in three sentences."},
    ]
    return frame[: tok.encode_chat_into(messages, frame)].tolist()


@pytest.mark.slow
def test_a_greedy_answer_migrated_mid_stream_is_the_uninterrupted_one(new_agent, serve) -> None:
    ids = prompt()
    alone = serve(handler(), slots=1, cap=CAP)
    agent: Agent = new_agent(cap=CAP, max_servers=1)
    agent.attach(alone.address)
    index = send(agent, ids, max_new=MAX_NEW)
    got = collect(agent, index, timeout=120)
    assert got[-1].final
    reference = agent.frames.outputs[index, : got[-1].count].tolist()
    assert len(reference) >= 16, "the reference answer is long enough to be cut in the middle"

    servers = [serve(handler(), slots=1, cap=CAP) for _ in range(2)]
    moving: Agent = new_agent(cap=CAP)
    links = [moving.attach(server.address) for server in servers]
    index = send(moving, ids, max_new=MAX_NEW)
    on = moving.inflight[index].link  # both idle: where its predicted time to first token was lower
    answering = next(server for server, link in zip(servers, links, strict=True) if link is on)
    deadline = time.monotonic() + 120
    arrivals = []  # (monotonic seconds, tokens so far): the stream as the caller sees it
    while moving.inflight[index].count < 8 and time.monotonic() < deadline:
        arrivals += [(time.monotonic(), d.count) for d in moving.poll(timeout=0.2) if d.index == index]
    cut = moving.inflight[index].count
    assert 8 <= cut < len(reference)
    killed = time.monotonic()
    answering.stop()
    answering.close()
    while moving.inflight[index].link is on and time.monotonic() < deadline:
        moving.check_links()
        time.sleep(0.01)
    moved = time.monotonic()
    assert moving.delivery_stats.migrated == 1
    after = []
    while time.monotonic() < deadline and not (after and after[-1].final):
        got = [d for d in moving.poll(timeout=0.5) if d.index == index]
        arrivals += [(time.monotonic(), d.count) for d in got]
        after += got
    assert after[-1].final
    result = moving.frames.result_headers[index]
    assert result.status in (Status.STOP, Status.LENGTH)
    assert moving.frames.outputs[index, : after[-1].count].tolist() == reference  # token for token
    stats = moving.delivery_stats
    assert (stats.duplicates, stats.unknown) == (0, 0)
    resumed = next(t for t, count in arrivals if t > killed and count > cut)
    gap = max(b[0] - a[0] for a, b in itertools.pairwise(arrivals))
    print(
        f"migration: cut after {cut} tokens; detected and claimed again {1e3 * (moved - killed):.0f} ms after the "
        f"kill, next token {1e3 * (resumed - killed):.0f} ms after it (re-prefill of {len(ids) + cut} tokens); "
        f"longest gap between deliveries {1e3 * gap:.0f} ms"
    )
