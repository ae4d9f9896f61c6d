"""One declaration, both ways an option is given: as a command-line flag and as a handler's ``KEY=VALUE``, and the
rows the docs' option tables are written from (edgepath.options)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from edgepath.options import OptionError, add_options, at_least, choice, describe, from_args, option, read_pairs, rows


@dataclass(frozen=True)
class Knobs:
    """A configuration declared the one way."""

    count: int = option(4, type=at_least(2), help="N >= 2 things (default %(default)s)")
    mode: bool = option(True, **choice(on=True, off=False), help="on|off: whether it is on")
    colour: str = option("red", choices=("red", "blue"), help="red or blue")
    wait: float = option(0.5, type=float, help="seconds to wait (a half by default; default: %(default)s)")
    hidden: bool = option(False, switch=True, help=argparse.SUPPRESS)


def test_a_handler_s_pairs_are_read_by_the_fields_parsers() -> None:
    assert read_pairs(Knobs, {"count": "7", "mode": "off", "colour": "blue"}) == {
        "count": 7,
        "mode": False,
        "colour": "blue",
    }
    assert read_pairs(Knobs, {}) == {}  # what is not given is the caller's default


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        ({"count": "1"}, "count: expected an integer >= 2, got '1' (N >= 2 things (default: 4))"),
        ({"count": "many"}, "count: expected an integer >= 2, got 'many'"),
        ({"mode": "yes"}, "mode: expected one of on, off, got 'yes' (on|off: whether it is on (default: on))"),
        ({"colour": "green"}, "colour: expected one of red, blue, got 'green'"),
        ({"wait": "soon"}, "wait: could not convert string to float: 'soon'"),
        ({"size": "3"}, "unknown option(s) ['size']; allowed: count=N >= 2 things (default: 4); mode="),
    ],
)
def test_a_wrong_pair_names_the_option_and_what_is_allowed(pairs: dict[str, str], message: str) -> None:
    with pytest.raises(OptionError) as err:
        read_pairs(Knobs, pairs)
    assert message in str(err.value)


def test_the_same_declaration_makes_the_flags() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, Knobs)
    knobs = from_args(Knobs, parser.parse_args(["--count", "3", "--mode", "off"]))
    assert knobs == Knobs(count=3, mode=False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--count", "1"])


def test_rows_say_each_option_once_with_its_default_in_a_column_of_its_own() -> None:
    """The help's own mention of the default is left out (the default has its column); hidden options are not
    shown; a float default reads as the shortest number."""
    assert [(r.name, r.default, r.help) for r in rows(Knobs)] == [
        ("--count", "4", "N >= 2 things"),
        ("--mode on|off", "on", "on|off: whether it is on"),
        ("--colour", "red", "red or blue"),
        ("--wait", "0.5", "seconds to wait (a half by default)"),
    ]
    assert [r.name for r in rows(Knobs, pairs=True)] == ["count", "mode", "colour", "wait"]
    assert describe(Knobs)["colour"] == "red or blue (default: red)"
