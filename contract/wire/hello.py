"""Connection private data: what each side tells the other when a connection is set up (an agent to a slot
server, an agent process to an edge and back, a ledger home to an edge), and its checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: keys both hops send: token capacities of a frame
INPUT_CAPACITY, OUTPUT_CAPACITY = "input_capacity", "output_capacity"
#: keys an agent sends a slot server: how many reply entries it exports, and where the first one starts
FRAMES, REPLIES_OFFSET = "frames", "replies_offset"
#: keys an agent process sends an edge on accept: the edge's own range of frames
FRAME_BASE, FRAME_COUNT = "frame_base", "frame_count"
#: the key an agent process sends every edge: its slot servers' addresses (the status region's links, in order)
SLOT_SERVERS = "slot_servers"
#: the key an edge sends an agent process, and its value: who is connecting
ROLE, ROLE_EDGE = "role", "edge"


class InfoInvalid(ValueError):
    """Connection private data that lacks a key or carries a value of the wrong kind."""


def info_ints(info: Mapping[str, Any], *keys: str) -> list[int]:
    try:
        return [int(info[key]) for key in keys]
    except KeyError as exc:
        raise InfoInvalid(f"missing {exc.args[0]!r} (has {sorted(info)})") from None
    except (TypeError, ValueError) as exc:
        raise InfoInvalid(f"not an integer: {exc}") from None


@dataclass(frozen=True, slots=True)
class AgentHello:
    """What an agent tells a slot server: its ``replies`` region holds ``frames`` entries of
    ``[result header][output]`` from byte ``replies_offset``, for frames of these capacities."""

    frames: int
    input_capacity: int
    output_capacity: int
    replies_offset: int = 0

    def info(self) -> dict[str, int]:
        return {
            FRAMES: self.frames,
            INPUT_CAPACITY: self.input_capacity,
            OUTPUT_CAPACITY: self.output_capacity,
            REPLIES_OFFSET: self.replies_offset,
        }

    @classmethod
    def parse(cls, info: Mapping[str, Any]) -> AgentHello:
        frames, inputs, outputs = info_ints(info, FRAMES, INPUT_CAPACITY, OUTPUT_CAPACITY)
        (offset,) = info_ints({REPLIES_OFFSET: 0, **info}, REPLIES_OFFSET)
        return cls(frames, inputs, outputs, offset)


def edge_hello() -> dict[str, str]:
    """What an edge tells an agent process."""
    return {ROLE: ROLE_EDGE}


def is_edge_hello(info: Mapping[str, Any]) -> bool:
    return info.get(ROLE) == ROLE_EDGE


@dataclass(frozen=True, slots=True)
class EdgeGrant:
    """What an agent process tells an edge: frame capacities and its slot servers' addresses, in the order
    of the status region's links (for every edge, at listen), and the edge's own range of frames
    ``[frame_base, frame_base + frame_count)`` (at accept)."""

    input_capacity: int
    output_capacity: int
    frame_base: int
    frame_count: int
    slot_servers: tuple[str, ...] = ()

    @staticmethod
    def capacities(input_capacity: int, output_capacity: int, slot_servers: Sequence[str] = ()) -> dict[str, Any]:
        return {INPUT_CAPACITY: input_capacity, OUTPUT_CAPACITY: output_capacity, SLOT_SERVERS: list(slot_servers)}

    @staticmethod
    def frames(base: int, count: int) -> dict[str, int]:
        return {FRAME_BASE: base, FRAME_COUNT: count}

    @classmethod
    def parse(cls, info: Mapping[str, Any]) -> EdgeGrant:
        servers = info.get(SLOT_SERVERS, [])
        if not isinstance(servers, list) or not all(isinstance(a, str) for a in servers):
            raise InfoInvalid(f"{SLOT_SERVERS!r} must be a list of addresses, got {servers!r}")
        inputs, outputs, base, count = info_ints(info, INPUT_CAPACITY, OUTPUT_CAPACITY, FRAME_BASE, FRAME_COUNT)
        return cls(inputs, outputs, base, count, tuple(servers))
