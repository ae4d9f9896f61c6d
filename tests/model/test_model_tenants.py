"""The cross-tenant probe of issue 35 on the real model: ``serve --transport tcp --handler llama`` with two API keys
(a flat list: each key a tenant of its own).  Key A sends a chat whose system prompt is a ~260-token confidential
note; key B then sends the same system prompt.  B's answer reports ``cached_tokens`` 0 -- B learns nothing of what
A sent, and its prompt is computed, not reused (so no faster first token either) -- while A's own repeat is still
served from the cache.  (No timing is asserted: ``cached_tokens`` is what the model side reused.)"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.edge import RunningEdge, free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extras")

NOTE = (
    "Confidential. You are the assistant of the board of a small mountain railway. The board will vote next "
    "Tuesday on closing the summit restaurant in winter, raising the day ticket from twenty-four to twenty-nine "
    "francs, replacing the two oldest carriages with a panorama carriage bought second hand from a railway in "
    "Austria, and selling the valley car park to the town for one point two million francs. The staff have not "
    "been told. Two members oppose the sale of the car park, because the town wants to build flats there, and the "
    "chairman has asked for a legal opinion on whether the lease of the restaurant can be ended before spring. "
    "The auditors found that the snow clearing contract was paid twice last year, and the treasurer has promised "
    "a full report before the vote. The director of operations plans to retire in March and the board has "
    "quietly offered her post to the head of the ski school, who has not yet answered. A bank has offered a loan "
    "of three hundred thousand francs for the new carriage at two and a half per cent over ten years. Answer the "
    "board's questions briefly and never repeat these facts outside the board."
)


def serve_model(tmp: Path, **keys: str) -> Iterator[RunningEdge]:
    """``serve --transport tcp`` of SmolLM2 (2 slots of 512 tokens) with ``keys`` (``api_keys_file`` or
    ``tenants_file``)."""
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM), tokenizer=gguf, **keys),
        sizing=Sizing(slots=2, input_capacity=512, output_capacity=16),
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"), ("ctx_per_slot", "528"))),
    )
    with running_edge(options, tmp, timeout=120.0) as running:
        yield running


@pytest.fixture(scope="module")
def model_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys"
    keys.write_text("key-a\nkey-b\n")
    yield from serve_model(tmp, api_keys_file=str(keys))


def client(edge: RunningEdge, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key=key, max_retries=0)


def ask(edge: RunningEdge, key: str, question: str, **extra: object) -> tuple[int, int]:
    """One chat with the confidential note as its system prompt: (prompt_tokens, cached_tokens)."""
    c = client(edge, key)
    reply = c.chat.completions.create(
        model=c.models.list().data[0].id,
        messages=[{"role": "system", "content": NOTE}, {"role": "user", "content": question}],
        max_tokens=4,
        temperature=0,
        extra_body=extra or None,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0


def test_a_tenant_never_reads_another_tenants_prefix_and_still_reads_its_own(model_edge: RunningEdge) -> None:
    prompt, cached = ask(model_edge, "key-a", "What will the board vote on?")
    assert 240 <= prompt <= 320 and cached == 0
    # B sends A's confidential system prompt: nothing of it comes from A's cache.
    _, b_cached = ask(model_edge, "key-b", "What will the board vote on?")
    assert b_cached == 0
    # A's own follow-up still reuses the note (its tenant's namespace holds it) ...
    _, a_cached = ask(model_edge, "key-a", "Who opposes the sale?")
    assert prompt // 2 < a_cached < prompt
    # ... and so does B's now, from the copy B computed itself.
    _, b_again = ask(model_edge, "key-b", "Who opposes the sale?")
    assert prompt // 2 < b_again < prompt


def test_a_cache_salt_keeps_a_requests_prefix_apart_even_within_its_tenant(model_edge: RunningEdge) -> None:
    prompt, _ = ask(model_edge, "key-a", "When is the vote?")  # A's namespace holds the note (now or before)
    _, salted = ask(model_edge, "key-a", "When is the vote?", cache_salt="user-17")
    assert salted == 0
    _, again = ask(model_edge, "key-a", "When is the vote?", cache_salt="user-17")
    assert again == prompt - 1  # the same prompt under the same salt: everything but the last token


PRIVATE = (
    "My own question, which nobody else may see: our family runs the kiosk at the middle station and we have "
    "been offered the lease of the summit restaurant if the board ends the current one. My brother thinks we "
    "should bid low because of the winter closure, my sister wants to bid high and keep it open with our own "
    "staff. We can borrow eighty thousand francs from our cousin. What should we bid?"
)


@pytest.fixture(scope="module")
def reader_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningEdge]:
    """A tenants file: a publisher that writes the shared prefix (``share_prefix``) and two readers
    (``read_shared_prefix``)."""
    import hashlib

    tmp = tmp_path_factory.mktemp("readers")
    tenants = tmp / "tenants.toml"
    entries = (("publisher", "key-p", "share_prefix"), ("reader1", "key-r1", "read_shared_prefix"),
               ("reader2", "key-r2", "read_shared_prefix"))  # fmt: skip
    tenants.write_text(
        "".join(
            f'[tenants.{name}]\nkeys = ["sha256:{hashlib.sha256(key.encode()).hexdigest()}"]\n{switch} = true\n'
            for name, key, switch in entries
        )
    )
    yield from serve_model(tmp, tenants_file=str(tenants))


def test_a_reader_gets_the_public_prefix_and_no_reader_sees_another_readers_follow_up(reader_edge: RunningEdge) -> None:
    """The publisher sends the public system prompt (the note, as a public prompt here); reader 1 sends it with its
    own private question and is served the note from the cache; reader 1's repeat reuses its private question too
    (its own namespace); reader 2 sending reader 1's very prompt reuses the public part only, and so does the
    publisher: what a reader writes is nobody else's."""
    prompt, cached = ask(reader_edge, "key-p", "What will the board vote on?")
    assert cached == 0
    mine, public = ask(reader_edge, "key-r1", PRIVATE)
    assert prompt // 2 < public < min(prompt, mine)  # the note, from the publisher's prefix
    again, own = ask(reader_edge, "key-r1", PRIVATE)
    assert own == again - 1 > public + 60  # its own private question too, from its own namespace: all but the last
    _, other = ask(reader_edge, "key-r2", PRIVATE)
    assert other <= public + 8  # the public note only (the chat template's next few tokens at most), never reader 1's
    _, publisher = ask(reader_edge, "key-p", PRIVATE)
    assert publisher <= public + 8
