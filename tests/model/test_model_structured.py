"""Structured outputs with SmolLM2 through the data path: ``response_format`` becomes a grammar that travels to
the slot after the prompt, and llama.cpp's grammar sampler holds the answer to it -- every answer parses against
its schema, through the ``openai`` client's ``create`` and ``parse`` (Pydantic models)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from helpers.edge import free_port, running_edge

from edgepath.config import AgentSettings, EdgeSettings, HandlerSettings, ServeOptions, Sizing

pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
openai = pytest.importorskip("openai", reason="the openai client is in the test extras")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.slow  # a served model


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from edgepath.model.gguf import default_model_path

    gguf = str(default_model_path())
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM), tokenizer=gguf),
        sizing=Sizing(slots=2, input_capacity=2048, output_capacity=160),  # a grammar takes words after the prompt
        agent=AgentSettings(frames=8),
        handler=HandlerSettings("llama", (("model", gguf), ("threads", "1"))),
    )
    with running_edge(options, tmp_path_factory.mktemp("structured"), timeout=120.0) as edge:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{edge.port}/v1", api_key="unused", max_retries=0)


SCHEMAS = [
    {  # nested object, enum, integer
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                        "continent": {"enum": ["Europe", "Asia", "Africa", "America", "Oceania"]}},
                        "required": ["name", "continent"]},
            "population_millions": {"type": "integer"},
        },
        "required": ["city", "country", "population_millions"],
    },
    {  # array of objects with bounds, optional field
        "type": "object",
        "properties": {
            "colours": {"type": "array", "minItems": 2, "maxItems": 3,
                        "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                  "warm": {"type": "boolean"}}, "required": ["name", "warm"]}},
            "note": {"type": "string", "maxLength": 20},
        },
        "required": ["colours"],
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 5},  # a top-level array
    {"enum": ["yes", "no", "maybe"]},  # a bare enum
    {  # a union with null, a date
        "type": "object",
        "properties": {"event": {"type": "string", "maxLength": 20}, "date": {"type": "string", "format": "date"},
                       "place": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]}},
        "required": ["event", "date", "place"],
    },
]  # fmt: skip
QUESTIONS = ["Tell me about Paris.", "Name some colours.", "Give me a few numbers.", "Is the sky blue?",
             "When did the Berlin wall fall?"]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_every_answer_parses_against_its_schema(client: Any, temperature: float) -> None:
    model = client.models.list().data[0].id
    for i, (schema, question) in enumerate(zip(SCHEMAS, QUESTIONS, strict=True)):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": question}], max_tokens=150, temperature=temperature,
            seed=i, response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}},
        )  # fmt: skip
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_is_an_object(client: Any) -> None:
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": 'Answer in JSON: {"name": ..., "age": ...} of a cat.'}],
        max_tokens=150, temperature=0, response_format={"type": "json_object"},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    kind: Literal["cat", "dog", "bird"]
    age: int
    toys: list[Annotated[str, pydantic.StringConstraints(max_length=12)]] = pydantic.Field(max_length=2)


def test_the_sdks_parse_with_a_pydantic_model(client: Any) -> None:
    """``chat.completions.parse`` sends the model's strict JSON schema (``$defs``, ``additionalProperties``,
    ``title``) and reads the answer back into it."""
    model = client.models.list().data[0].id
    done = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Describe a pet."}], max_tokens=150, temperature=0,
        response_format=Pet,
    )  # fmt: skip
    assert isinstance(done.choices[0].message.parsed, Pet)


def test_a_schema_the_model_cannot_finish_in_max_tokens_ends_with_length(client: Any) -> None:
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=5, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}},
    )  # fmt: skip
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


def test_a_keyword_it_cannot_enforce_is_a_400_and_the_server_serves_on(client: Any) -> None:
    model = client.models.list().data[0].id
    bad = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "integer", "minimum": 1}}}
    with pytest.raises(openai.BadRequestError, match="'minimum' cannot be enforced"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], response_format=bad)
    ok = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
