"""The ``edgepath`` command line.

Every command's options are declared in :mod:`edgepath.config`; other distributions add commands through
the ``edgepath.commands`` entry points (a function given the subcommands to add to): the benchmarks'
``edgepath-bench`` adds ``edgepath bench``, so the product never imports them."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn

from edgepath.children import watch_parent
from edgepath.client_config import ChatSettings, ProbeSettings, RequestSettings
from edgepath.config import (
    AgentServiceSettings,
    DemoSettings,
    LedgerSettings,
    ServeOptions,
    SlotServerSettings,
)
from edgepath.options import add_options, from_args, once_only
from edgepath.runtime import setup_logging
from edgepath.supervisor import GaveUp

log = logging.getLogger("edgepath")


class _Parser(argparse.ArgumentParser):
    """Mistakes on the command line are one line on stderr and exit status 2, never usage pages; an
    option that takes one value may be given once (see edgepath.options)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        once_only(self)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Renamed(argparse.Action):
    """An option that was renamed: one line naming the new one instead of a usage page."""

    def __init__(self, option_strings: Sequence[str], dest: str, new: str = "", **kwargs: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        parser.error(self.new)


def _add_renamed_transport(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--transport",
        action=_Renamed,
        new="--transport is now --data-path (loopback|verbs): the agent <-> slot-server link; "
        "--transport names the client-facing protocol of `edgepath serve` (quic|tcp)",
    )


def _run_until_signal(
    serve: Callable[[], None], stop: Callable[[], None], drain: Callable[[], None] | None = None
) -> None:
    """Run ``serve`` on this thread; SIGINT/SIGTERM call ``stop`` -- or, given ``drain``, a first SIGTERM calls
    that (a graceful stop: ``serve`` returns when it is done) and only a second one, or SIGINT, ``stop``."""
    terms: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        if drain is not None and signum == signal.SIGTERM and not terms:
            terms.append(signum)
            log.info("signal %d: draining (another SIGTERM, or SIGINT, stops at once)", signum)
            drain()
            return
        log.info("signal %d: stopping", signum)
        stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    serve()


def _serve_until_signal(server: Any, listen: str, report: Callable[[], str], graceful: bool = False) -> int:
    """Print the ready line, serve until SIGINT/SIGTERM (``graceful``: a first SIGTERM drains the server: see
    :func:`_run_until_signal`), close; ``report`` is logged at the end."""

    def serve() -> None:  # the ready line once the signal handlers are in place: a SIGTERM right after it is a stop
        print(f"ready {listen}", flush=True)
        server.serve()

    try:
        _run_until_signal(serve, server.stop, server.drain if graceful else None)
    finally:
        server.close()
        log.info("%s", report())
    return 0


def cmd_slot_server(args: argparse.Namespace) -> int:
    from edgepath.builder import build_slot_server

    settings = from_args(SlotServerSettings, args)
    server = build_slot_server(settings)
    return _serve_until_signal(server, settings.listen, lambda: f"stats: {server.stats}", graceful=True)


def cmd_agent(args: argparse.Namespace) -> int:
    from edgepath.builder import build_agent_service

    settings = from_args(AgentServiceSettings, args)
    service = build_agent_service(settings)
    return _serve_until_signal(
        service,
        settings.listen,
        lambda: f"agent: {service.agent.describe()}; peers refused: {dict(service.connections.refused)}",
    )


def cmd_ledger(args: argparse.Namespace) -> int:
    from edgepath.builder import build_ledger

    settings = from_args(LedgerSettings, args)
    service = build_ledger(settings)
    return _serve_until_signal(service, settings.listen, service.describe)


def cmd_demo(args: argparse.Namespace) -> int:
    from edgepath.demo import run_demo

    report = run_demo(from_args(DemoSettings, args))
    print("edgepath demo: edge frames -> agent (CAS claim, write, doorbell) -> slot server (echo) -> result")
    for line in report.lines():
        print(line)
    bad = report.errors or report.mismatches or report.slots_free_after != report.slots
    return 1 if bad else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from edgepath.serve import serve

    return serve(from_args(ServeOptions, args))


def cmd_request(args: argparse.Namespace) -> int:
    import asyncio

    from edgepath.request import request

    return asyncio.run(request(from_args(RequestSettings, args)))


def cmd_chat(args: argparse.Namespace) -> int:
    import asyncio

    from edgepath.request import chat

    return asyncio.run(chat(from_args(ChatSettings, args)))


def cmd_probe(args: argparse.Namespace) -> int:
    from edgepath.builder import data_path_transport
    from edgepath.dpu.probe import probe, probe_ledger

    settings = from_args(ProbeSettings, args)
    transport = data_path_transport(settings.data_path, settings.hang_timeout)
    if settings.ledger:
        verdict = probe_ledger(transport, settings.address, settings.hang_timeout)
    else:
        verdict = probe(transport, settings.address, settings.hang_timeout, ready=settings.ready)
    print(verdict.reason, file=sys.stdout if verdict.passed else sys.stderr)
    return 0 if verdict.passed else 1


#: the entry-point group through which other distributions add commands (``edgepath-bench``: ``edgepath bench``)
COMMANDS = "edgepath.commands"


#: the commands this package defines itself (the others come from :data:`COMMANDS` entry points)
BUILT_IN = ("slot-server", "agent", "ledger", "demo", "serve", "request", "chat", "probe")

#: what ``edgepath --help`` says: what the program is for and how to start, for its users
DESCRIPTION = """\
Serve a language model with an OpenAI-compatible API over HTTP/3 (or HTTP/1.1), and talk to it.

  edgepath serve                          serve SmolLM2 at https://127.0.0.1:4433 (HTTP/3); Ctrl-C stops it
  edgepath serve --transport tcp          the same over HTTP/1.1 at http://127.0.0.1:8080 (any OpenAI client)
  edgepath chat "What is the capital of France?"
                                          ask it as a chat; the answer is printed as it is written
  edgepath request "The sea is"           let it continue a text as it is, and see where the time went"""

EPILOG = "`edgepath COMMAND --help` lists a command's options; the API, every option and the clients: docs/API.md."


def build_parser(added: bool = True) -> argparse.ArgumentParser:
    """The whole command line; with ``added`` false, without the commands other distributions add (loading
    them is a third of a child's start-up: ``serve`` starts its slot server and workers by built-in commands)."""
    parser = _Parser(
        prog="edgepath", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log more: every process's debug messages")
    sub = parser.add_subparsers(dest="command", required=True)

    commands = (  # (name, help, description, settings, run)
        (
            "serve",
            "serve the model: the HTTP/3 (or HTTP/1.1) API, and the slot server running the model",
            "Serve a model with an OpenAI-compatible API (and edgepath's own routes): HTTP/3 on port 4433 by default, "
            "HTTP/1.1 on 8080 with --transport tcp. Prints `ready URL` when it accepts requests.",
            ServeOptions,
            cmd_serve,
        ),
        (
            "chat",
            "ask a running server one chat question over HTTP/3 and print the answer as it streams",
            "Send one user message (and, with --system, a system message) to a running edgepath server's OpenAI chat "
            "route over HTTP/3; the model's chat template renders it, and the answer's text is printed as it streams.",
            ChatSettings,
            cmd_chat,
        ),
        (
            "request",
            "send a running server one text to continue over HTTP/3; print the text and the server's timings",
            "Send one prompt to a running edgepath server's own route (POST /v1/generate) over HTTP/3: the model "
            "continues the text as it is, without a chat template. Prints the status, the text, the token counts and "
            "where the server's time went.",
            RequestSettings,
            cmd_request,
        ),
        (
            "probe",
            "check a slot server as its agents do, or a quota ledger as its edges do (a container's liveness or "
            "readiness probe); exit 0 if it passes",
            "Attach to a running slot server as an agent does (its pool verified), wait for its heartbeat to move (at "
            "most --hang-timeout seconds) and let go: exit 0 when it passes, 1 with the reason when not. With "
            "--ready, a draining slot server (SIGTERM) fails too. With --ledger, the address is a quota ledger's: "
            "connect as an edge does and read a word.",
            ProbeSettings,
            cmd_probe,
        ),
    )
    for verb, summary, description, section, cmd in commands:
        p = sub.add_parser(verb, help=summary, description=description)
        add_options(p, section)
        p.set_defaults(func=cmd)

    data_path_commands = (
        ("slot-server", "run a model side alone: a slot pool served by a handler", SlotServerSettings, cmd_slot_server),
        ("agent", "run an agent alone: it claims slots and writes requests for edges", AgentServiceSettings, cmd_agent),
        (
            "ledger",
            "keep the quota ledger every edge of a deployment counts the tenants' quotas in (serve --quota-home)",
            LedgerSettings,
            cmd_ledger,
        ),
        ("demo", "run the whole data path in one process, without a model, and report", DemoSettings, cmd_demo),
    )
    for name, help_text, settings, run in data_path_commands:
        p = sub.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        add_options(p, settings)
        _add_renamed_transport(p)
        p.set_defaults(func=run)

    for command in entry_points(group=COMMANDS) if added else ():
        try:
            add = command.load()
        except ImportError as exc:  # a broken install must not take the product's own commands with it
            _unloadable(sub, command.name, f"{command.value} cannot be loaded ({exc})")
        else:
            add(sub)
    return parser


def _unloadable(sub: Any, name: str, why: str) -> None:
    """Command ``name`` that another distribution registers but that cannot be loaded: it says so when used."""

    def fail(_: argparse.Namespace) -> int:
        raise RuntimeError(f"{why}; reinstall it (`pip install ./bench` for edgepath bench)")

    p = sub.add_parser(name, help=f"(not available: {why})")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=fail)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    named = next((arg for arg in argv if not arg.startswith("-")), None)
    args = build_parser(added=named not in BUILT_IN).parse_args(argv)
    setup_logging(args.verbose)
    watch_parent()  # started by a parent that may die without stopping it (SIGKILL): stop then
    try:
        return int(args.func(args) or 0)
    except GaveUp as exc:
        print(f"edgepath {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"edgepath {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
