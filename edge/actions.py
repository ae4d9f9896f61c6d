"""What the edge's sans-I/O cores tell their I/O adapters to send for a request, keyed by its ``rid``: one whole
answer, or a stream's start, chunks and end.  Its own module so that the lifecycle and the ``n``-choices group
(:mod:`edgepath.edge.choices`) speak the same actions."""

from __future__ import annotations

from dataclasses import dataclass

from edgepath.edge.http import Headers, Response


@dataclass(frozen=True, slots=True)
class Respond:
    """Send ``response`` as the one, complete answer to request ``rid``."""

    rid: int
    response: Response


@dataclass(frozen=True, slots=True)
class StartStream:
    """Send the status and headers of a streamed answer (body chunks follow)."""

    rid: int
    status: int
    headers: Headers


@dataclass(frozen=True, slots=True)
class SendChunk:
    """Send one body chunk of a started stream."""

    rid: int
    data: bytes


@dataclass(frozen=True, slots=True)
class EndStream:
    """Send the last chunk (maybe empty) and end the stream: the request's answer is complete."""

    rid: int
    data: bytes = b""


#: what is sent to a client
Answer = Respond | StartStream | SendChunk | EndStream
