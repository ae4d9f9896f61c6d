"""Options declared once, on the fields of the configuration they fill: the one way edgepath declares an option.

A configuration is a dataclass whose fields are declared with :func:`option`: the default, the help, the parser
of the text (:class:`Flag`).  The same declaration serves the two ways an option is given:

* **a command-line flag** (:class:`~edgepath.config.ServeOptions`, :class:`~edgepath.config.SlotServerSettings`,
  ...): :func:`add_options` builds the argparse arguments (defaults taken from the fields), :func:`from_args`
  makes the configuration from what was parsed, and :func:`to_argv` writes the command line that makes the same
  configuration again -- how ``serve`` starts its slot server and its edge workers.  A field holding another
  configuration (:func:`section`: the data path, an agent, a handler) brings that one's options along, with the
  defaults the enclosing command gives them; :func:`like` fills a field of one configuration with an option
  another declares (``serve``'s ``--slot-spin-us`` is the slot server's ``--spin-us``), so no option is declared
  twice.  Every option is given at most once: a repeated single-valued option is an error (argparse would keep
  the last one silently), and only an option declared ``repeat`` collects several values.
* **a handler's ``KEY=VALUE``** (``--handler-option``; the llama handler's
  :class:`~edgepath.model.llama_options.LlamaOptions`, the echo handlers' options): :func:`read_pairs` reads them, each
  by its field's parser, and an unknown key or a wrong value is an :class:`OptionError` that names the option,
  what is allowed and its default.

:func:`rows` gives every option's name, default and help as ``--help`` says them, from which the docs' option
tables are written (``scripts/option-tables``).  This package sits below every layer (it knows no other part of
edgepath), so the app layer, the slot server and the model side declare their options the same way.

The value parsers below check an option's text and say what is allowed; they are argparse ``type`` functions,
so a mistake is one line naming the option and the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_OPTION = "edgepath.option"
_SECTION = "edgepath.section"
_GIVEN = "_edgepath_given"  # the namespace attribute that records which single-valued options were given


@dataclass(frozen=True)
class Flag:
    """How one configuration field appears on the command line."""

    help: str
    name: str | None = None  # default: --<field-name>
    type: Callable[[str], Any] | None = None  # parses and checks the text (an argparse type)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    switch: bool = False  # present or not (a bool field)
    repeat: bool = False  # given once per value; the field holds a tuple
    spread: tuple[str, ...] = ()  # one flag filling several fields: its value is a tuple, in this order
    text: Callable[[Any], str] = str  # one value as the command line writes it
    worker: bool = True  # serve: carried to each edge worker's command line
    default_text: str | None = None  # how the default reads in --help when it is no value ("the handler's")
    positional: bool = False  # an argument without a flag (``edgepath request PROMPT``)

    def flag(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


def option(default: Any = MISSING, *, factory: Callable[[], Any] | None = None, help: str, **flag: Any) -> Any:
    """A configuration field that is also a command-line option (``flag``: the :class:`Flag` fields)."""
    return _field(Flag(help, **flag), default, factory)


def _field(flag: Flag, default: Any, factory: Callable[[], Any] | None) -> Any:
    metadata = {_OPTION: flag}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(cls: type[Any], **defaults: Any) -> Any:
    """A field holding configuration ``cls``, whose options come along; ``defaults``: the defaults this
    command gives some of them (``serve``'s agent holds 256 frames, an ``edgepath agent`` 1024)."""

    def made() -> Any:
        return cls(**defaults)

    return dataclasses.field(default_factory=made, metadata={_SECTION: cls})


def like(cls: type[Any], field_name: str, /, *, default: Any = MISSING, **changes: Any) -> Any:
    """A field filled by the option ``cls.field_name`` declares: its parser and help, under the same flag and
    default unless ``default`` or ``changes`` (:class:`Flag` fields: another flag ``name``, ``worker=False``)
    say otherwise."""
    declared = next(f for f in dataclasses.fields(cls) if f.name == field_name)
    flag = dataclasses.replace(declared.metadata[_OPTION], **changes)
    if default is not MISSING:
        return _field(flag, default, None)
    factory = declared.default_factory
    if callable(factory):  # not MISSING
        return _field(flag, MISSING, factory)
    return _field(flag, declared.default, None)


@dataclass(frozen=True)
class _Declared:
    """An option of a configuration class, or (``flag`` None) a section whose class has more; ``default``:
    the option's default, or the section's default instance (whose values are its options' defaults)."""

    field: str
    flag: Flag | None
    default: Any = None
    group: type[Any] | None = None


def _declared(cls: type[Any], defaults: Any = None) -> Iterator[_Declared]:
    """The options of ``cls``, with their defaults (those of ``defaults``, an instance, when given); every
    field must be one (or be filled by one), else it could never be set from the command line, nor reach a
    child's: such a class is refused here, when a parser is built."""
    fields = dataclasses.fields(cls)
    spread = {name for f in fields if _OPTION in f.metadata for name in f.metadata[_OPTION].spread}

    def default_of(f: dataclasses.Field[Any]) -> Any:
        return getattr(defaults, f.name) if defaults is not None else _default(f)

    for f in fields:
        if _SECTION in f.metadata:
            yield _Declared(f.name, None, default_of(f), group=f.metadata[_SECTION])
        elif _OPTION in f.metadata:
            flag = f.metadata[_OPTION]
            if flag.spread:
                by_name = {g.name: default_of(g) for g in fields if g.name in flag.spread}
                default: Any = tuple(by_name[name] for name in flag.spread)
            else:
                default = default_of(f)
            yield _Declared(f.name, flag, default)
        elif f.name not in spread:
            raise TypeError(f"{cls.__name__}.{f.name} is not a command-line option: declare it with option()")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not MISSING:
        return f.default_factory()
    return None if f.default is MISSING else f.default


def add_options(parser: argparse.ArgumentParser, cls: type[Any], defaults: Any = None) -> None:
    """The options of configuration ``cls`` (and of its sections), in field order, defaults from the fields
    (or from ``defaults``, an instance of ``cls``)."""
    for item in _declared(cls, defaults):
        if item.flag is None:
            assert item.group is not None
            add_options(parser, item.group, item.default)
            continue
        flag = item.flag
        help = flag.help if flag.default_text is None else flag.help.replace("%(default)s", flag.default_text)
        kwargs: dict[str, Any] = {"help": help}
        if flag.switch:
            if item.default is not False:
                raise TypeError(f"{cls.__name__}.{item.field}: a switch is off unless given (default False)")
            kwargs["action"] = "store_true"
        else:
            kwargs.update(type=flag.type, choices=flag.choices, metavar=flag.metavar)
            if flag.repeat:
                kwargs["action"] = "append"
                kwargs["default"] = None  # argparse appends to a default list: the field's default applies instead
            elif not flag.positional:
                kwargs["default"] = item.default
        parser.add_argument(item.field if flag.positional else flag.flag(item.field), **kwargs)


def _dest(flag: Flag, field_name: str) -> str:
    return field_name if flag.positional else flag.flag(field_name).lstrip("-").replace("-", "_")


def from_args(cls: type[T], args: argparse.Namespace, defaults: Any = None) -> T:
    """The configuration ``cls`` from parsed flags (built by :func:`add_options`); what no flag filled keeps
    its default (that of ``defaults``, the section's default instance, when given)."""
    values: dict[str, Any] = {}
    for item in _declared(cls, defaults):
        flag = item.flag
        if flag is None:
            assert item.group is not None
            values[item.field] = from_args(item.group, args, item.default)
            continue
        value = getattr(args, _dest(flag, item.field))
        if flag.repeat:
            if value is not None:
                values[item.field] = tuple(value)
        elif flag.spread:
            values.update((name, v) for name, v in zip(flag.spread, value, strict=True) if v is not None)
        else:
            values[item.field] = value
    return cls(**values) if defaults is None else dataclasses.replace(defaults, **values)


def to_argv(config: Any, keep: Callable[[Flag], bool] = lambda flag: True) -> list[str]:
    """The flags that make ``config`` again (those ``keep`` accepts); unset (None) and false values are left out."""
    argv: list[str] = []
    for item in _declared(type(config)):
        value = getattr(config, item.field)
        flag = item.flag
        if flag is None:
            argv += to_argv(value, keep)
            continue
        if not keep(flag):
            continue
        name = flag.flag(item.field)
        if flag.spread:
            value = tuple(getattr(config, field_name) for field_name in flag.spread)
        if flag.switch:
            argv += [name] if value else []
        elif flag.repeat:
            argv += [arg for v in value for arg in (name, flag.text(v))]
        elif flag.positional:
            argv.append(flag.text(value))
        elif value is not None:
            argv += [name, flag.text(value)]
    return argv


# -- KEY=VALUE options (a handler's) ----------------------------------------------------------------------


class OptionError(ValueError):
    """A ``KEY=VALUE`` option that is not declared, or whose value its parser refuses; the message names the
    option, what is allowed and its default."""


def read_pairs(cls: type[Any], pairs: Mapping[str, str]) -> dict[str, Any]:
    """The values of the ``KEY=VALUE`` options given (``pairs``; a key is a field's name), each read by its field's
    parser and checked against its choices; an option not given is left out (the caller's default applies)."""
    declared = {item.field: item.flag for item in _declared(cls) if item.flag is not None}
    unknown = sorted(set(pairs) - set(declared))
    if unknown:
        allowed = "; ".join(f"{key}={what}" for key, what in describe(cls).items())
        raise OptionError(f"unknown option(s) {unknown}; allowed: {allowed}")
    values: dict[str, Any] = {}
    for key, raw in pairs.items():
        flag = declared[key]
        try:
            if flag.choices is not None and raw not in flag.choices:
                raise argparse.ArgumentTypeError(f"expected one of {', '.join(flag.choices)}, got {raw!r}")
            values[key] = flag.type(raw) if flag.type is not None else raw
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise OptionError(f"{key}: {exc} ({describe(cls)[key]})") from None
    return values


def describe(cls: type[Any]) -> dict[str, str]:
    """Each ``KEY=VALUE`` option of ``cls`` as messages and ``--help`` say it: ``key -> "help (default: X)"``."""
    return {row.name: f"{row.help} (default: {row.default})" for row in rows(cls, pairs=True)}


# -- the options as their documentation says them ---------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One option as the docs' tables say it: its flag (or key), its default, and what it is."""

    name: str
    default: str
    help: str


def rows(cls: type[Any], defaults: Any = None, *, pairs: bool = False) -> list[Row]:
    """Every option of ``cls`` (and of its sections) in field order, as ``--help`` says it: the flag with its
    metavar (with ``pairs``, the ``KEY``), the default as the command line writes it (or the words that say what
    decides it), and the help without its own mention of the default, which has a column of its own.  Hidden
    options (help ``argparse.SUPPRESS``) are left out."""
    out: list[Row] = []
    for item in _declared(cls, defaults):
        if item.flag is None:
            assert item.group is not None
            out += rows(item.group, item.default, pairs=pairs)
            continue
        flag = item.flag
        if flag.help == argparse.SUPPRESS:
            continue
        default = default_text(flag, item.default)
        if pairs or flag.positional:
            name = item.field
        else:
            name = flag.flag(item.field) + (f" {flag.metavar}" if flag.metavar else "")
        help = re.sub(r"\s*\(default:? %\(default\)s\)|[;,]\s*default:? %\(default\)s", "", flag.help)
        out.append(Row(name, default, help.replace("%(default)s", default).replace("%%", "%")))
    return out


def default_text(flag: Flag, default: Any) -> str:
    """An option's default as its documentation says it: the words of ``default_text``, else the value as the
    command line writes it (numbers shortest), ``off`` for a switch, ``-`` for none."""
    if flag.default_text is not None:
        return flag.default_text
    if flag.switch:
        return "off"
    if default is None or default == ():
        return "-"
    if flag.repeat:
        return ", ".join(flag.text(value) for value in default)
    if isinstance(default, float) and flag.text is str:
        return f"{default:g}"
    return flag.text(default)


# -- once only ------------------------------------------------------------------------------------------


def _once(action: argparse.Action, parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
    given = namespace.__dict__.setdefault(_GIVEN, set())
    if action.dest in given:
        name = "/".join(action.option_strings)
        what = "it is a switch" if action.nargs == 0 else "it takes one value"
        parser.error(f"{name} is given more than once: {what} (give it once)")
    given.add(action.dest)


class _Once(argparse.Action):
    """Refuses a second occurrence of its option instead of keeping the last one silently."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        _once(self, parser, namespace)
        super().__call__(parser, namespace, values, option)


class StoreOnce(_Once, argparse._StoreAction):
    """argparse's ``store``, given at most once."""


class StoreTrueOnce(_Once, argparse._StoreTrueAction):
    """argparse's ``store_true``, given at most once."""


class StoreFalseOnce(_Once, argparse._StoreFalseAction):
    """argparse's ``store_false``, given at most once."""


class BooleanOptionalOnce(_Once, argparse.BooleanOptionalAction):
    """argparse's ``--x/--no-x`` pair, given at most once (either spelling)."""


def once_only(parser: argparse.ArgumentParser) -> None:
    """Make ``store``, ``store_true``, ``store_false`` and ``--x/--no-x`` options of ``parser`` (and of the parsers
    it adds) refuse repeats (argparse looks an ``action`` up in this registry, a class as well as a name)."""
    parser.register("action", None, StoreOnce)
    parser.register("action", "store", StoreOnce)
    parser.register("action", "store_true", StoreTrueOnce)
    parser.register("action", "store_false", StoreFalseOnce)
    parser.register("action", argparse.BooleanOptionalAction, BooleanOptionalOnce)


# -- value parsers --------------------------------------------------------------------------------------


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def at_least(low: int) -> Callable[[str], int]:
    """An integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _number(text: str, zero_allowed: bool) -> float:
    """A finite number > 0 (or >= 0): NaN, infinities and words are refused with what is allowed."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 if zero_allowed else value > 0) or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number {'>=' if zero_allowed else '>'} 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    return _number(text, zero_allowed=True)


def positive_float(text: str) -> float:
    return _number(text, zero_allowed=False)


def share(text: str) -> float:
    """A share of a whole, in (0, 1]."""
    value = _number(text, zero_allowed=False)
    if value > 1:
        raise argparse.ArgumentTypeError(f"expected a share in (0, 1], got {text!r}")
    return value


def port_number(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}")
    return int(text)


def host_port(text: str) -> str:
    """``HOST:PORT`` (an address to listen on: ``0.0.0.0:9090``, ``[::1]:9090``), kept as given."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port 1-65535 (e.g. 0.0.0.0:9090), got {text!r}")
    return text


def split_host_port(text: str) -> tuple[str, int]:
    """A :func:`host_port` text as (host, port), an IPv6 host without its brackets."""
    host, _, port = text.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), int(port)


def readable_file(text: str) -> str:
    path = Path(text)
    try:
        is_file = path.is_file()
        exists = is_file or path.exists()
    except PermissionError:  # a directory on the way may not be searched: the file cannot be read either
        raise argparse.ArgumentTypeError(
            f"expected a readable file, got {text!r} (no permission to reach it: a directory on its path is closed)"
        ) from None
    if not is_file:
        why = "is not a file" if exists else "does not exist"
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} (it {why})")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"expected a readable file, got {text!r} (no permission to read it)")
    return text


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def key_value_text(pair: tuple[str, str]) -> str:
    return f"{pair[0]}={pair[1]}"


def choice(**values: Any) -> dict[str, Any]:
    """The :class:`Flag` fields of an option whose text is one of ``values``' names (in this order in messages),
    each meaning its value: ``option(True, **choice(on=True, off=False), help=...)``."""

    def parse(text: str) -> Any:
        if text not in values:
            raise argparse.ArgumentTypeError(f"expected one of {', '.join(values)}, got {text!r}")
        return values[text]

    def write(value: Any) -> str:
        return next(name for name, meant in values.items() if meant == value)

    return {"type": parse, "text": write, "metavar": "|".join(values)}


def seconds_in(per_second: float) -> tuple[Callable[[str], float], Callable[[float], str]]:
    """A duration the command line gives in 1/``per_second`` seconds (``--spin-us``: 1e6) and the configuration
    holds in seconds: the parser (>= 0) and the writer of such a flag."""

    def parse(text: str) -> float:
        return non_negative_float(text) / per_second

    def write(seconds: float) -> str:
        return f"{seconds * per_second:.12g}"

    return parse, write


def slots_spec(memory: Sequence[str]) -> Callable[[str], tuple[str, int | None]]:
    """``--slots``: a count (``64``), a memory kind (one of ``memory``) or both (``gpu:64``)."""

    def parse(text: str) -> tuple[str, int | None]:
        kind, sep, count = text.partition(":")
        if not sep and kind.isdigit():
            kind, count = "host", text
        if kind not in memory or (sep and not count.isdigit()) or (count and int(count) <= 0):
            raise argparse.ArgumentTypeError(
                f"expected N, KIND or KIND:N (e.g. gpu:N) with KIND one of {', '.join(memory)} and N > 0, got {text!r}"
            )
        return kind, int(count) if count else None

    return parse
