"""The real llama handler's step line is what bench/step_profile.py reads: a profile of a closed loop rests on it."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edgepath.bench.step_profile import parse_steps
from edgepath.contract.wire import Sampling
from edgepath.model.llama import LlamaHandler
from edgepath.slots.handlers import HandlerConfig, SlotRequest


def test_every_step_the_handler_logs_is_parsed_with_its_shape(caplog: pytest.LogCaptureFixture) -> None:
    handler = LlamaHandler.from_config(HandlerConfig(2, 64, 8, {"threads": "1", "prefix_cache": "off"}))
    try:
        inputs = np.arange(100, 140, dtype=np.int32).reshape(2, 20)
        outputs = np.zeros((2, 4), dtype=np.int32)
        for slot in range(2):
            handler.add(SlotRequest(slot, slot, 4, 0, inputs[slot], outputs[slot], Sampling()), 0.0)
        before = (handler.stats.steps, handler.stats.prompt_tokens, handler.stats.decode_tokens)
        with caplog.at_level(logging.DEBUG, logger="edgepath.model.llama"):
            while handler.wake_in(0.0) is not None:
                handler.step(0.0)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
        steps = parse_steps(lines)
        assert steps and len(steps) == len(lines) == handler.stats.steps - before[0]  # every line read
        assert sum(s.prompt for s in steps) == handler.stats.prompt_tokens - before[1] == 40
        assert sum(s.decode for s in steps) == handler.stats.decode_tokens - before[2] > 0
        assert all(s.threads == 1 and s.ubatches >= 1 and s.between_ms >= 0 for s in steps)
    finally:
        handler.close()
