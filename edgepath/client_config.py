"""The client commands' sections of the configuration tree (:mod:`edgepath.config`): ``edgepath request`` and
``edgepath chat`` (an edge's clients, over HTTP/3) and ``edgepath probe`` (a slot server's or a quota ledger's, as
its agents and edges reach it) -- each option declared once, on the field it fills, as every section's."""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.config import DEFAULT_PORTS, AgentSettings, DataPath
from edgepath.edge.retry import DEFAULT_RETRIES
from edgepath.options import (
    like,
    non_negative_float,
    non_negative_int,
    option,
    port_number,
    positive_float,
    positive_int,
    readable_file,
    section,
)

#: output tokens ``edgepath request`` and ``edgepath chat`` ask for unless told: an answer of a few sentences
#: (the server's own default is a slot's whole output capacity, 512 tokens with a model: seconds on a CPU)
CLIENT_MAX_TOKENS = 128


@dataclass(frozen=True)
class ServerAddress:
    """The server ``edgepath request`` and ``edgepath chat`` send to, and how they trust and authenticate to it."""

    host: str = option("127.0.0.1", help="the server to send to: its address or host name (default %(default)s)")
    port: int = option(DEFAULT_PORTS["quic"], type=port_number, help="the server's HTTP/3 port (default %(default)s)")
    cacert: str | None = option(
        None, type=readable_file, help="CA file to verify the server (default: the local self-signed one)"
    )
    insecure: bool = option(False, switch=True, help="do not verify the server's certificate")
    api_key: str | None = option(None, help="API key to send as x-api-key (default: $EDGEPATH_API_KEY)")
    timeout: float = option(30.0, type=positive_float, help="seconds to wait for the answer (default %(default)s)")


@dataclass(frozen=True)
class RequestSettings:
    """``edgepath request``: one request to edgepath's own route over HTTP/3, the text continued as it is."""

    prompt: str = option(
        positional=True, help="text for the model to continue as it is (no chat template: `edgepath chat` for that)"
    )
    max_tokens: int = option(CLIENT_MAX_TOKENS, type=positive_int, help="output tokens at most (default %(default)s)")
    ids: bool = option(False, switch=True, help="print the output's token ids too")
    stream: bool = option(
        False, switch=True, help="ask for a stream and print its events as they arrive (one per token id)"
    )
    tokenize: bool = option(False, switch=True, help="only tokenize the prompt (POST /v1/tokenize): print its ids")
    server: ServerAddress = section(ServerAddress)


@dataclass(frozen=True)
class ChatSettings:
    """``edgepath chat``: one user message to the OpenAI chat route over HTTP/3, the answer printed as it streams."""

    prompt: str = option(positional=True, help="what the user says (rendered with the model's chat template)")
    system: str | None = option(None, help="a system message to send before it (default: none)")
    model: str | None = option(None, help="the model to ask (default: the first the server lists at /v1/models)")
    max_tokens: int = like(RequestSettings, "max_tokens")
    temperature: float | None = option(
        None,
        type=non_negative_float,
        help="sampling temperature, 0 (always the likeliest token) to 2 (default: the server's, 1)",
    )
    seed: int | None = option(None, type=int, help="seed of the sampler's draws (default: the server's)")
    usage: bool = option(
        False, switch=True, help="after the answer, print its token counts and the server's timings on stderr"
    )
    retries: int = option(
        DEFAULT_RETRIES,
        type=non_negative_int,
        help="times to ask again after a 429, as the openai SDK does: after the server's retry-after-ms (else "
        "Retry-After) when within 60 s, else 0.5 s x 2^n; all within --timeout (default %(default)s, the SDK's)",
    )
    server: ServerAddress = section(ServerAddress)


@dataclass(frozen=True)
class ProbeSettings:
    """``edgepath probe``: a slot server checked as its agents judge it, for a container's liveness or readiness
    probe (slot servers serve no HTTP)."""

    address: str = option(
        positional=True,
        help="the slot server's address: its --listen (a socket path; IP:PORT with --data-path verbs)",
    )
    ready: bool = option(
        False,
        switch=True,
        help="a readiness probe: fail too while it drains (SIGTERM); without it, a liveness probe: its pool "
        "verified and its heartbeat moving",
    )
    ledger: bool = option(
        False,
        switch=True,
        help="the address is a quota ledger's (`edgepath ledger --listen`): pass when it answers as one",
    )
    hang_timeout: float = like(AgentSettings, "hang_timeout")
    data_path: DataPath = section(DataPath)

    def __post_init__(self) -> None:
        if self.ledger and self.ready:
            raise ValueError(
                "--ready is for a slot server (draining or not); a quota ledger is up or not: not with --ledger"
            )
