"""A batch handler that reports whatever load a test gives it: a stand-in for a model in admission tests."""

from __future__ import annotations

from edgepath.contract.wire import Load
from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, SlotRequest


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
