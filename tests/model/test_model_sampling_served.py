"""Sampling as a client sees it, through ``serve`` with SmolLM2 and the ``openai`` client: a request that names no
seed is sampled afresh (the issue's target: 10 identical requests at temperature 1, at least 9 answers), one that
names a seed gets its answer again, every answer names the model and build (``system_fingerprint``), the new fields
are applied -- a token id from llama-server's ``/tokenize`` forced by ``logit_bias`` -- and an unknown field is a
400 naming it."""

from __future__ import annotations

import json
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.edge import free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extras")
pytestmark = pytest.mark.slow  # a served model

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """The openai client of a served SmolLM2, and the server's base URL."""
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM), tokenizer=gguf),
        sizing=Sizing(slots=2, input_capacity=512, output_capacity=64),
        agent=AgentSettings(frames=4),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"))),
    )
    with running_edge(options, tmp_path_factory.mktemp("sampling"), timeout=120.0) as edge:
        base = f"http://127.0.0.1:{edge.port}"
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0), base


def post(base: str, path: str, doc: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"{base}{path}", json.dumps(doc).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def ask(client: Any, **fields: Any) -> Any:
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=QUESTION, **{"max_tokens": 16, **fields})


def test_no_seed_samples_afresh_a_seed_repeats_and_every_answer_names_the_build(served: tuple[Any, str]) -> None:
    client, _ = served
    fresh = [ask(client, temperature=1.0) for _ in range(10)]  # one at a time: each alone in its step
    seeded = [ask(client, temperature=1.0, seed=7) for _ in range(10)]
    assert len({r.choices[0].message.content for r in fresh}) >= 9
    assert len({r.choices[0].message.content for r in seeded}) == 1
    fingerprints = {r.system_fingerprint for r in fresh + seeded}
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_")


def test_a_token_id_from_tokenize_forced_by_logit_bias(served: tuple[Any, str]) -> None:
    client, base = served
    (paris,) = post(base, "/tokenize", {"content": " Paris"})["tokens"]
    assert post(base, "/detokenize", {"tokens": [paris, paris]}) == {"content": " Paris Paris"}
    assert post(base, "/tokenize", {"content": " Paris", "with_pieces": True}) == {
        "tokens": [{"id": paris, "piece": " Paris"}]
    }
    reply = ask(client, temperature=1.0, max_tokens=4, logit_bias={str(paris): 100})
    assert reply.choices[0].message.content == " Paris Paris Paris Paris"


def test_the_extensions_are_applied_and_an_unknown_field_is_refused_by_name(served: tuple[Any, str]) -> None:
    client, _ = served
    greedy = ask(client, temperature=0).choices[0].message.content
    assert "Paris" in greedy
    for extra in ({"min_p": 1.0}, {"top_k": 1}):  # nothing left to draw from but the likeliest
        reply = ask(client, temperature=2.0, seed=3, extra_body=extra)
        assert reply.choices[0].message.content == greedy
    assert ask(client, temperature=0, extra_body={"repeat_penalty": 1.3, "presence_penalty": 0.5}).choices
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, extra_body={"mirostat": 2})
    assert info.value.body["param"] == "mirostat" and info.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, extra_body={"frobnicate": True})
    assert info.value.body["param"] == "frobnicate" and info.value.body["code"] == "unknown_parameter"
