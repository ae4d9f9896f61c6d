"""A paced handler whose answer is a function of its prompt alone: each output token is the previous token
(prompt, then output) plus one.  An answer continued from "prompt + answer so far" is therefore the same
tokens as one never interrupted -- what a greedy model does -- so a migrated stream can be checked exactly."""

from __future__ import annotations

from edgepath.native.abi import Status
from edgepath.slots.handlers import Emit, SlotRequest


class Counting:
    """One token per slot every ``token_delay`` seconds (the first at once), up to the slot's output area."""

    def __init__(self, token_delay: float = 0.01) -> None:
        self.token_delay = token_delay
        self._running: dict[int, tuple[SlotRequest, int, float]] = {}  # slot -> (request, count, next due)

    def add(self, request: SlotRequest, now: float) -> list[Emit]:
        if len(request.output) == 0:
            return [Emit(request.slot, 0, Status.LENGTH)]
        self._running[request.slot] = (request, 0, now)
        return []

    def step(self, now: float) -> list[Emit]:
        out = []
        for slot, (request, count, due) in list(self._running.items()):
            if now < due:
                continue
            last = request.output[count - 1] if count else request.tokens[-1]
            request.output[count] = last + 1
            count += 1
            if count == len(request.output):
                del self._running[slot]
                out.append(Emit(slot, count, Status.LENGTH))
            else:
                self._running[slot] = (request, count, due + self.token_delay)
                out.append(Emit(slot, count))
        return out

    def cancel(self, slot: int) -> bool:
        self._running.pop(slot, None)
        return True

    def wake_in(self, now: float) -> float | None:
        if not self._running:
            return None
        return max(0.0, min(due for _, _, due in self._running.values()) - now)

    def close(self) -> None:
        self._running.clear()
