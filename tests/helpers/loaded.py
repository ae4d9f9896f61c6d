"""A batch handler that reports whatever load a test gives it: a stand-in for a model in admission tests."""

from __future__ import annotations

from edgepath.contract import wire
from edgepath.contract.plan import Costs, Load, PolicyOptions
from edgepath.contract.pool import SlotPool
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, SlotRequest

#: a model's pace for admission tests: 6 ms a step, 3 ms a token of either kind, a 1.5 s stall bound
PACE = {"costs": Costs(overhead_ms=6.0, prompt_ms=3.0, decode_ms=3.0), "options": PolicyOptions(1500.0, 16, 4096)}


def published(pool: SlotPool) -> Load | None:
    """The load a pool's load region holds now (None: torn)."""
    return wire.read_load(
        pool.buf[wire.LOAD_OFFSET : wire.LOAD_OFFSET + wire.LOAD_REGION.itemsize].view(wire.LOAD_REGION)[0]
    )


class Loaded:
    """Echoes the prompt's first token and reports whatever load the test gives it."""

    def __init__(self, load: Load) -> None:
        self.current = load

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        request.output[:1] = request.tokens[:1]
        return [Emit(request.slot, 1, Status.OK)]

    def step(self, now: float) -> list[Emit]:
        return []

    def cancel(self, slot: int) -> bool:
        return True

    def wake_in(self, now: float) -> float | None:
        return None

    def close(self) -> None:
        pass

    def load(self) -> Load:
        return self.current
