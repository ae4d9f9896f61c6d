"""A handler for the hang tests, loaded by an ``edgepath slot-server`` child (``--handler
helpers.hang:echo_unless_13`` with ``tests`` on its PYTHONPATH)."""

from __future__ import annotations

import threading

from edgepath.slots.handlers import SlotRequest

#: ``max_tokens`` that makes the handler block for good: a model call that never returns
HANG_ON = 13


def echo_unless_13(request: SlotRequest) -> object:
    """Echo the prompt, except that a request for exactly :data:`HANG_ON` tokens blocks the slot server's
    loop forever (one-shot handlers run inline in it)."""
    if request.max_new_tokens == HANG_ON:
        threading.Event().wait()
    return request.tokens
