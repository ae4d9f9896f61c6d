"""The app layer's registries: what ``--handler NAME`` and ``--data-path NAME`` mean."""

from __future__ import annotations

import pytest

from edgepath.handlers import BUILTIN, load_handler
from edgepath.peer_secret import peer_keys
from edgepath.slots.handlers import BatchHandler, HandlerConfig, HandlerError
from edgepath.transports.loopback import LoopbackTransport
from edgepath.transports.registry import TRANSPORTS, make_transport

CAP = 64


def test_unknown_handlers_are_clear_errors() -> None:
    config = HandlerConfig(2, CAP, CAP)
    assert isinstance(load_handler("echo", config), BatchHandler)
    with pytest.raises(HandlerError, match="use a built-in"):
        load_handler("nope", config)
    with pytest.raises(HandlerError, match="cannot import module 'no_such_module'"):
        load_handler("no_such_module:f", config)
    with pytest.raises(HandlerError, match="has no attribute 'nothing'"):
        load_handler("json:nothing", config)
    with pytest.raises(HandlerError, match="is not a handler"):
        load_handler("math:pi", config)
    with pytest.raises(HandlerError, match="token_delay"):
        load_handler("paced-echo", HandlerConfig(2, CAP, CAP, {"delay": "1"}))


def test_the_builtin_handlers_are_named_and_each_builds() -> None:
    assert set(BUILTIN) == {"echo", "paced-echo", "llama"}
    for name in ("echo", "paced-echo"):  # llama needs a model: tests/model
        handler = load_handler(name, HandlerConfig(2, CAP, CAP))
        assert isinstance(handler, BatchHandler)
        handler.close()


def test_transports_by_name_and_a_clear_error_for_any_other() -> None:
    assert TRANSPORTS == ("loopback", "verbs")
    transport = make_transport("loopback", peer_keys(None))
    try:
        assert isinstance(transport, LoopbackTransport)
    finally:
        transport.close()
    with pytest.raises(ValueError, match="unknown transport 'rdma': choose one of loopback, verbs"):
        make_transport("rdma", peer_keys(None))
