"""Looking inside the llama.cpp handler, for the model tests (nothing here is product code)."""

from __future__ import annotations

from edgepath.model.llama import LlamaHandler
from edgepath.model.llama_options import LlamaOptions
from edgepath.slots.handlers import HandlerConfig


def stream_of(handler: LlamaHandler, slot: int) -> int:
    """The llama.cpp sequence a running slot's request runs on (-1: it waits for its first prompt step,
    where it is placed)."""
    return handler.sequences.running[slot].stream


def max_prompt_tokens(config: HandlerConfig) -> int:
    """The longest prompt a slot accepts: its sequence's ``ctx_per_slot`` positions, and no more than the
    slot's input capacity."""
    options = LlamaOptions.parse(config.options, config.input_capacity + config.output_capacity)
    return min(options.ctx_per_slot, config.input_capacity)
