"""The command lines ``serve`` builds for its children parse back into the configuration they came from."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgepath.cli import build_parser
from edgepath.config import DataPath, ServeOptions, SlotServerSettings


def test_a_slot_server_command_line_carries_every_setting() -> None:
    settings = SlotServerSettings(
        listen="/tmp/x.sock",
        slots=7,
        memory="host",
        input_capacity=300,
        output_capacity=200,
        lease=0.25,
        spin=12.5e-6,
        handler="paced-echo",
        handler_options=(("token_delay", "0.01"), ("note", "a=b")),
        handler_deadline=1.5,
        stream_window=0.5e-3,
        data_path=DataPath("verbs", "rxe0", 1),
    )
    args = build_parser().parse_args(settings.argv())
    assert args.func.__name__ == "cmd_slot_server"
    assert (args.listen, args.slots) == ("/tmp/x.sock", ("host", 7))
    assert (args.input_capacity, args.output_capacity) == (300, 200)
    assert (args.lease, args.spin_us, args.handler_deadline, args.stream_window_ms) == (0.25, 12.5, 1.5, 0.5)
    assert args.handler == "paced-echo" and args.handler_option == [("token_delay", "0.01"), ("note", "a=b")]
    assert (args.data_path, args.device, args.gid_index) == ("verbs", "rxe0", 1)


def test_a_worker_command_line_is_the_edge_on_a_shared_port_and_slot_server(tmp_path: Path) -> None:
    files = {name: str(tmp_path / name) for name in ("c.pem", "k.pem", "keys")}
    for path in files.values():
        Path(path).write_text("checked for existence only\n")
    options = ServeOptions(
        transport="tcp",
        port=9000,
        frames=33,
        max_body=4096,
        request_timeout=2.5,
        certificate=files["c.pem"],
        private_key=files["k.pem"],
        protect_ops=True,
        api_keys_file=files["keys"],
        workers=3,
    )
    args = build_parser().parse_args(options.worker_argv("/tmp/slots.sock"))
    assert args.func.__name__ == "cmd_serve"
    assert (args.transport, args.port, args.slot_server, args.reuse_port, args.workers) == (
        "tcp",
        9000,
        "/tmp/slots.sock",
        True,
        1,
    )
    assert (args.frames, args.max_body, args.request_timeout) == (33, 4096, 2.5)
    assert (args.certificate, args.private_key, args.api_keys_file, args.protect_ops) == (
        files["c.pem"],
        files["k.pem"],
        files["keys"],
        True,
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "rdma"}, "data path must be one of loopback, verbs"),
        ({"kind": "loopback", "device": "rxe0"}, "--device and --gid-index are for --data-path verbs"),
    ],
)
def test_a_data_path_that_makes_no_sense_is_refused(kwargs: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataPath(**kwargs)  # type: ignore[arg-type]


def test_workers_with_an_agent_process_is_refused() -> None:
    with pytest.raises(ValueError, match="--workers N gives every worker its own in-process agent"):
        ServeOptions(workers=2, agent="/tmp/agent.sock")


def test_flags_of_a_data_path() -> None:
    assert DataPath().flags() == ["--data-path", "loopback"] and DataPath().options() == {}
    assert DataPath("verbs", gid_index=0).flags() == ["--data-path", "verbs", "--gid-index", "0"]
    assert DataPath("verbs", "rxe0").options() == {"device": "rxe0"}
