"""The command lines ``serve`` builds for its children parse back into the configuration they came from."""

from __future__ import annotations

import argparse
import socket
from collections.abc import Iterator
from dataclasses import dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from edgepath.builder import (
    plan_serve,
    slot_server_argv,
    started_slot_server,
    transport_options,
    worker_argv,
)
from edgepath.children import free_port
from edgepath.cli import build_parser
from edgepath.config import (
    AgentServiceSettings,
    AgentSettings,
    Capacity,
    DataPath,
    EdgeSettings,
    HandlerSettings,
    ServeOptions,
    Sizing,
    SlotServerSettings,
    StartedSlotServer,
    Supervision,
)
from edgepath.dpu.discovery import checked_source
from edgepath.handlers import handler_spec
from edgepath.options import (
    add_options,
    describe,
    from_args,
    host_port,
    key_value,
    option,
    port_number,
    readable_file,
    rows,
)
from edgepath.slots.handlers import HandlerError


def test_a_slot_server_command_line_carries_every_setting() -> None:
    settings = SlotServerSettings(
        listen="/tmp/x.sock",
        slots=7,
        memory="host",
        capacity=Capacity(input_capacity=300, output_capacity=200),
        lease=0.25,
        spin=12.5e-6,
        handler=HandlerSettings("paced-echo", (("token_delay", "0.01"), ("note", "a=b"))),
        handler_deadline=1.5,
        stream_window=0.5e-3,
        data_path=DataPath("verbs", "rxe0", 1),
    )
    args = build_parser().parse_args(slot_server_argv(settings))
    assert from_args(SlotServerSettings, args) == settings
    assert args.func.__name__ == "cmd_slot_server"
    assert (args.listen, args.slots) == ("/tmp/x.sock", ("host", 7))
    assert (args.input_capacity, args.output_capacity) == (300, 200)
    # --spin-us and --stream-window-ms are given in their units and held in seconds, as the slot server takes them
    assert (
        "--spin-us" in slot_server_argv(settings)
        and slot_server_argv(settings)[slot_server_argv(settings).index("--spin-us") + 1] == "12.5"
    )
    assert (args.lease, args.spin_us, args.handler_deadline, args.stream_window_ms) == (0.25, 12.5e-6, 1.5, 0.5e-3)
    assert args.handler == "paced-echo" and args.handler_option == [("token_delay", "0.01"), ("note", "a=b")]
    assert (args.data_path, args.device, args.gid_index) == ("verbs", "rxe0", 1)


def test_a_worker_command_line_is_the_edge_on_a_shared_port_and_slot_server(tmp_path: Path) -> None:
    files = {name: str(tmp_path / name) for name in ("c.pem", "k.pem", "keys")}
    for path in files.values():
        Path(path).write_text("checked for existence only\n")
    edge = EdgeSettings(
        transport="tcp",
        port_asked=9000,
        max_body=4096,
        request_timeout=2.5,
        certificate=files["c.pem"],
        private_key=files["k.pem"],
        protect_ops=True,
        api_keys_file=files["keys"],
    )
    options = ServeOptions(edge=edge, agent=AgentSettings(frames=33), supervision=Supervision(workers=3))
    args = build_parser().parse_args(worker_argv(options, ("/tmp/slots.sock", "/tmp/other.sock")))
    # the same edge, on the shared slot servers and port; what only the supervising process uses is not given
    supervisor_only = {"supervision": Supervision(workers=1)}
    assert from_args(ServeOptions, args) == replace(
        options,
        slot_servers=("/tmp/slots.sock", "/tmp/other.sock"),
        edge=replace(edge, reuse_port=True),
        **supervisor_only,
    )
    assert args.func.__name__ == "cmd_serve"
    assert (args.transport, args.port, args.slot_server, args.reuse_port, args.workers) == (
        "tcp",
        9000,
        ["/tmp/slots.sock", "/tmp/other.sock"],
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
        ServeOptions(supervision=Supervision(workers=2), agent_process="/tmp/agent.sock")


def test_flags_of_a_data_path() -> None:
    assert DataPath().flags() == ["--data-path", "loopback"] and transport_options(DataPath()) == {}
    assert DataPath("verbs", gid_index=0).flags() == ["--data-path", "verbs", "--gid-index", "0"]
    assert transport_options(DataPath("verbs", "rxe0")) == {"device": "rxe0"}


def _leaves(config: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) of every option of ``config``, through its sections."""
    for f in fields(config):
        value = getattr(config, f.name)
        if is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


def test_a_worker_gets_every_edge_option_and_none_of_the_supervisors(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_text("checked for existence only\n")
    options = ServeOptions(
        edge=EdgeSettings(
            transport="tcp",
            port_asked=9001,
            quic_engine="qh3",
            served_model_name="m",
            tokenizer=str(model),
            request_timeout=9.0,
            body_timeout=0.5,
            quic_retry=True,
        ),
        sizing=Sizing(slots=3, input_capacity=70, output_capacity=30),
        agent=AgentSettings(frames=5),
        model=str(model),
        handler=HandlerSettings("llama", (("threads", "1"), ("model", str(model)))),
        data_path=DataPath("verbs", "rxe0", 2),
        started=StartedSlotServer(spin=7e-6, listen="10.0.0.1:7000", handler_deadline=3.0),
        supervision=Supervision(max_restarts=2, restart_window=10.0, start_timeout=300.0, workers=2),
    )
    worker = from_args(ServeOptions, build_parser().parse_args(worker_argv(options, ("10.0.0.1:7000",))))
    edge_only = ("sizing.slots", "started.spin", "started.listen", "started.alongside", "agent_process",
                 "started.handler_deadline", "supervision.max_restarts", "supervision.restart_window",
                 "supervision.start_timeout", "supervision.workers")  # fmt: skip
    defaults = dict(_leaves(ServeOptions(handler=HandlerSettings("llama"))))
    given = dict(_leaves(options))
    for name, value in _leaves(worker):
        if name in edge_only:
            assert value == defaults[name], name
        elif name not in ("slot_servers", "edge.reuse_port"):
            assert value == given[name], name
    assert (worker.slot_servers, worker.edge.reuse_port) == (("10.0.0.1:7000",), True)


def test_an_agent_command_line_parses_into_its_settings() -> None:
    settings = AgentServiceSettings(
        listen="/tmp/agent.sock",
        slot_servers=("/tmp/a.sock", "/tmp/b.sock"),
        agent=AgentSettings(frames=12),
        capacity=Capacity(input_capacity=64),
        frames_per_edge=6,
        spin=1.5e-6,
    )
    argv = ["agent", "--listen", "/tmp/agent.sock", "--slot-server", "/tmp/a.sock", "--slot-server", "/tmp/b.sock"]
    argv += ["--frames", "12", "--input-capacity", "64", "--frames-per-edge", "6", "--spin-us", "1.5"]
    assert from_args(AgentServiceSettings, build_parser().parse_args(argv)) == settings
    default = from_args(AgentServiceSettings, build_parser().parse_args(["agent"]))
    assert default.slot_servers == AgentServiceSettings().slot_servers and len(default.slot_servers) == 1


def test_serve_fills_what_is_left_unset_from_one_place() -> None:
    model = ServeOptions()
    echo = ServeOptions(handler=HandlerSettings("echo"), edge=EdgeSettings(transport="tcp"))
    assert (model.handler.name, model.edge.port, model.sizes.slots, *_capacity(model)) == ("llama", 4433, 8, 1024, 512)
    assert (echo.edge.port, echo.sizes.slots, *_capacity(echo)) == (8080, 64, 4096, 4096)
    assert from_args(ServeOptions, build_parser().parse_args(["serve"])) == model
    assert ServeOptions(handler=HandlerSettings("echo"), sizing=Sizing(slots=3)).sizes.slots == 3
    with pytest.raises(ValueError, match="--certificate and --private-key go together"):
        ServeOptions(edge=EdgeSettings(certificate="c.pem"))
    with pytest.raises(ValueError, match="--model goes with the llama handler"):
        ServeOptions(handler=HandlerSettings("echo"), model="m.gguf")


def _capacity(options: ServeOptions) -> tuple[int, int]:
    capacity = options.sizes.capacity
    return capacity.input_capacity, capacity.output_capacity


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "9000", "--port", "9001"],
        ["serve", "--quic-retry", "--quic-retry"],
        ["slot-server", "--slots", "4", "--slots", "8"],
        ["agent", "--listen", "/tmp/a", "--listen", "/tmp/b"],
        ["demo", "--requests", "5", "--requests", "6"],
        ["bench", "edge-cpu", "--runs", "1", "--runs", "2"],
    ],
)
def test_an_option_that_takes_one_value_given_twice_is_an_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2
    flag = argv[-2]
    assert f"{flag} is given more than once" in capsys.readouterr().err


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every (sub)command of ``parser``, as (the words that name it, its parser)."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*prefix, name))


def _single_valued(parser: argparse.ArgumentParser, readable: str) -> Iterator[tuple[str, list[str]]]:
    """(flag, one valid occurrence) of every option of ``parser`` that takes one value or is a switch."""
    samples = {
        readable_file: readable,
        key_value: "k=v",
        handler_spec: "echo",
        port_number: "4000",
        checked_source: "dir:/run/edgepath/slots",
        host_port: "127.0.0.1:9090",
    }
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._AppendAction | argparse._HelpAction):
            continue
        if action.nargs == "?":  # a renamed option: refused whatever is given (tests/system/test_cli_errors.py)
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:
            yield flag, [flag]
        else:
            value = action.choices[0] if action.choices else samples.get(action.type, "1")  # type: ignore[index]
            yield flag, [flag, str(value)]


def test_every_single_valued_option_of_every_command_refuses_a_repeat(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a list of examples: each command's every option that takes one value (or is a switch), given twice."""
    readable = tmp_path / "file"
    readable.write_text("x\n")
    checked = 0
    for words, parser in _commands(build_parser()):
        for flag, once in _single_valued(parser, str(readable)):
            with pytest.raises(SystemExit) as info:
                build_parser().parse_args([*words, *once, *once])
            err = capsys.readouterr().err
            assert info.value.code == 2 and f"{flag} is given more than once" in err, (words, flag, err)
            checked += 1
    assert checked > 100  # serve, slot-server, agent, demo, request and the benchmarks were all walked


def test_the_slot_server_option_of_serve_collects_addresses_each_given_once() -> None:
    args = build_parser().parse_args(["serve", "--slot-server", "/tmp/a.sock", "--slot-server", "10.0.0.2:7471"])
    options = from_args(ServeOptions, args)
    assert options.slot_servers == ("/tmp/a.sock", "10.0.0.2:7471") and not options.starts_slot_server
    assert from_args(ServeOptions, build_parser().parse_args(["serve"])).starts_slot_server
    both = from_args(ServeOptions, build_parser().parse_args(["serve", "--slot-server", "/a", "--local-slot-server"]))
    assert both.starts_slot_server and both.slot_servers == ("/a",)
    with pytest.raises(ValueError, match=r"--slot-server /a is given twice"):
        ServeOptions(slot_servers=("/a", "/b", "/a"))
    with pytest.raises(ValueError, match=r"--slot-server-listen is where the started slot server listens"):
        ServeOptions(slot_servers=("/a",), started=StartedSlotServer(listen="/b"))
    with pytest.raises(ValueError, match=r"--slot-server-listen /a is also a --slot-server"):
        ServeOptions(slot_servers=("/a",), started=StartedSlotServer(listen="/a", alongside=True))
    with pytest.raises(ValueError, match=r"--agent uses a running agent process"):
        ServeOptions(agent_process="/agent.sock", slot_servers=("/a",))


def test_a_repeatable_option_collects_every_value() -> None:
    args = build_parser().parse_args(["serve", "--handler-option", "a=1", "--handler-option", "b=x=y"])
    assert from_args(ServeOptions, args).handler.options == (("a", "1"), ("b", "x=y"))


def test_a_configuration_field_without_an_option_is_refused_when_the_parser_is_built() -> None:
    """Such a field could never be set from the command line, nor reach a child's command line."""

    @dataclass(frozen=True)
    class Half:
        declared: int = option(1, help="an option")
        forgotten: int = 2

    with pytest.raises(TypeError, match=r"Half.forgotten is not a command-line option"):
        add_options(argparse.ArgumentParser(), Half)


def test_serve_gives_its_slot_server_and_agent_their_parts(tmp_path: Path) -> None:
    options = ServeOptions(
        sizing=Sizing(slots=3, input_capacity=70, output_capacity=30),
        agent=AgentSettings(frames=9),
        handler=HandlerSettings("paced-echo", (("token_delay", "0.1"),)),
        started=StartedSlotServer(handler_deadline=2.0, spin=4e-6),
        data_path=DataPath("verbs", "rxe0"),
    )
    assert started_slot_server(options, "10.0.0.1:1") == SlotServerSettings(
        listen="10.0.0.1:1",
        slots=3,
        capacity=Capacity(input_capacity=70, output_capacity=30),
        spin=4e-6,
        handler=HandlerSettings("paced-echo", (("token_delay", "0.1"),)),
        handler_deadline=2.0,
        data_path=DataPath("verbs", "rxe0"),
    )
    # the agent: its own section, the sizes and the data path it shares with the slot server
    assert (options.agent, options.sizes.capacity, options.data_path) == (
        AgentSettings(frames=9),
        Capacity(input_capacity=70, output_capacity=30),
        DataPath("verbs", "rxe0"),
    )


def test_the_configured_hang_timeout_reaches_the_slot_server_and_the_verbs_wait() -> None:
    """One ``--hang-timeout``: the agents judge by it, serve's slot server reports model steps over half of it,
    and a verbs operation waits 0.8 of it at most, on either side."""
    from edgepath.transports.verbs_datapath import op_timeout_ns

    options = from_args(
        ServeOptions, build_parser().parse_args(["serve", "--hang-timeout", "2", "--data-path", "verbs"])
    )
    assert options.agent.hang_timeout == 2.0
    child = from_args(
        SlotServerSettings, build_parser().parse_args(slot_server_argv(started_slot_server(options, "10.0.0.1:1")))
    )
    assert (child.hang_timeout, child.model_step_budget) == (2.0, 1.0)
    assert transport_options(options.data_path, options.agent.hang_timeout) == {"hang_timeout": 2.0}
    assert op_timeout_ns(options.agent.hang_timeout) == 1_600_000_000
    assert SlotServerSettings(listen="x", step_budget=0.5).model_step_budget == 0.5


def test_serve_refuses_a_wrong_handler_option_before_its_slot_server_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The handler's options are read into its typed ones in serve's own process (the child would refuse the
    same way, later, from its own command line)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    options = ServeOptions(
        edge=EdgeSettings(transport="tcp", port_asked=free_port(kind=socket.SOCK_STREAM)),
        handler=HandlerSettings("paced-echo", (("token_delay", "soon"),)),
    )
    with pytest.raises(HandlerError, match=r"paced-echo: token_delay: expected a number >= 0, got 'soon'"):
        plan_serve(options)
    fine = plan_serve(replace(options, handler=HandlerSettings("paced-echo", (("token_delay", "0.01"),))))
    assert fine.slot_server is not None and fine.slot_server.handler.options == (("token_delay", "0.01"),)


def test_the_llama_handler_options_are_declared_once_with_their_defaults() -> None:
    """What ``--help`` and the benchmarks say of a default is read off the declaration that sets it."""
    from edgepath.model.llama_options import LlamaOptions

    said = {row.name: row.default for row in rows(LlamaOptions, pairs=True)}
    assert said["cache_mb"] == "1024" and describe(LlamaOptions)["cache_mb"].endswith("(default: 1024)")
    assert said["prefix_cache"] == "on" and said["kv_unified"] == "off"
    assert said["threads"] == "every CPU this process may use"
    parsed = LlamaOptions.parse({"model": "m.gguf", "cache_mb": "2", "prefix_cache": "off"}, 300)
    assert (parsed.cache_mb, parsed.prefix_cache, parsed.ctx_per_slot, parsed.stall_ms) == (2.0, False, 300, 1500.0)


def test_a_registered_command_that_cannot_be_loaded_leaves_the_others_working(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The product wheel beside the metadata of a benchmarks install it cannot import (the entry point is there,
    the package is not): every product command still parses, and ``edgepath bench`` says what is wrong."""
    from importlib.metadata import EntryPoint

    from edgepath import cli

    broken = EntryPoint("bench", "edgepath.no_such_bench.cli:add_command", cli.COMMANDS)
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken] if group == cli.COMMANDS else [])
    assert build_parser().parse_args(["serve", "--port", "9000"]).port == 9000
    assert cli.main(["bench", "edge-cpu", "--runs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgepath bench: error: edgepath.no_such_bench.cli:add_command cannot be loaded"), err


def test_the_product_s_own_commands_parse_without_loading_the_added_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child ``serve`` starts (``slot-server``, an edge worker) does not load other distributions' commands,
    which are a third of its start-up; the names it skips them for are exactly the commands defined here."""
    from edgepath import cli

    def no_loading(group: str) -> list:
        raise AssertionError(f"entry points of {group} loaded for a built-in command")

    sub = next(a for a in build_parser(added=False)._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(cli.BUILT_IN)
    monkeypatch.setattr(cli, "entry_points", no_loading)
    with pytest.raises(SystemExit) as exited:
        cli.main(["-v", "slot-server", "--help"])
    assert exited.value.code == 0
    with pytest.raises(AssertionError, match=r"entry points of edgepath\.commands loaded"):
        cli.main(["bench", "edge-cpu"])
