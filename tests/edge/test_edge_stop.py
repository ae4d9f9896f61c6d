"""Stop strings at the edge: held-back prefixes, matches across deltas, trimming, several strings."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edgepath.edge.text.stop import StopMatcher, StopResult


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    """Feed ``deltas`` until a stop; returns the texts released (flush included when no stop) and stopped."""
    m = StopMatcher(stops)
    out: list[str] = []
    for d in deltas:
        r = m.feed(d)
        out.append(r.text)
        if r.stopped:
            return out, True
    out.append(m.flush())
    return out, False


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    """Check after every character, as a model emitting one character at a time would be checked."""
    for end in range(1, len(text) + 1):
        starts = [end - len(s) for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if starts:
            return text[: min(starts)], True
    return text, False


def test_no_stops_passes_everything_through_at_once() -> None:
    m = StopMatcher([])
    assert m.feed("hello") == StopResult("hello", False)
    assert m.feed(" world") == StopResult(" world", False)
    assert m.flush() == ""


def test_match_inside_one_delta_trims_before_the_stop() -> None:
    m = StopMatcher(["###"])
    assert m.feed("answer: 42### and more") == StopResult("answer: 42", True)
    assert m.done


def test_stop_spanning_many_deltas_is_held_then_trimmed() -> None:
    stops = ["\n\nUser:"]
    m = StopMatcher(stops)
    assert m.feed("Sure.") == StopResult("Sure.", False)
    assert m.feed("\n") == StopResult("", False)
    assert m.held == "\n"
    assert m.feed("\n") == StopResult("", False)
    assert m.feed("Us") == StopResult("", False)
    assert m.feed("er") == StopResult("", False)
    assert m.held == "\n\nUser"
    assert m.feed(": next") == StopResult("", True)


def test_held_prefix_released_when_the_text_diverges() -> None:
    m = StopMatcher(["\n\nUser:"])
    assert m.feed("a\n\nUs") == StopResult("a", False)
    assert m.feed("ually") == StopResult("\n\nUsually", False)
    assert m.held == ""


def test_held_text_released_by_flush_at_the_end() -> None:
    m = StopMatcher(["END"])
    assert m.feed("the EN") == StopResult("the ", False)
    assert m.flush() == "EN"
    assert m.done


def test_overlapping_prefix_restarts_inside_held_text() -> None:
    # "aab": after "aa" the tail "a" may still start "aab" even though "aa" + "a" does not match.
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == StopResult("x", False)
    assert m.feed("a") == StopResult("a", False)
    assert m.held == "aa"
    assert m.feed("b") == StopResult("", True)


def test_several_stops_the_one_completing_first_wins() -> None:
    # "b" completes at index 2, before "abc" completes: the answer ends before "b".
    assert run(["abc", "b"], ["a", "bc"]) == (["", "a"], True)
    assert run(["abc", "b"], ["abc"]) == (["a"], True)
    # Both complete at the same character: the earlier start wins, so nothing of either leaks.
    assert run(["bc", "abc"], ["xab", "c"]) == (["x", ""], True)


def test_stop_at_the_very_start_gives_empty_text() -> None:
    assert run(["Hello"], ["Hel", "lo there"]) == (["", ""], True)


def test_unicode_stop_strings() -> None:
    assert run(["東京"], ["今日は東", "京です"]) == (["今日は", ""], True)
    assert run(["🚀!"], ["go 🚀", "?"]) == (["go ", "🚀?", ""], False)


def test_feed_after_stop_is_an_error() -> None:
    m = StopMatcher(["x"])
    assert m.feed("ax").stopped
    with pytest.raises(RuntimeError, match="after the stream ended"):
        m.feed("more")
    with pytest.raises(RuntimeError, match="after the stream ended"):
        m.flush()


@pytest.mark.parametrize("bad", [[""], ["ok", ""], [None], [3]])
def test_bad_stop_strings_are_refused(bad: list[object]) -> None:
    with pytest.raises(ValueError, match="non-empty str"):
        StopMatcher(bad)  # type: ignore[arg-type]


def test_a_bare_string_is_refused() -> None:
    with pytest.raises(TypeError, match="not one string"):
        StopMatcher("stop")


def test_duplicate_stops_are_collapsed() -> None:
    assert StopMatcher(["a", "b", "a"]).stops == ("a", "b")


ALPHABET = "ab\n東🚀"
stop_lists = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=0, max_size=4)


@given(stops=stop_lists, text=st.text(alphabet=ALPHABET, max_size=40), data=st.data())
def test_any_chunking_gives_the_per_character_answer(stops: list[str], text: str, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    out, stopped = run(stops, deltas)
    assert ("".join(out), stopped) == reference(stops, text)


@given(stops=stop_lists, text=st.text(alphabet=ALPHABET, max_size=40))
def test_released_text_never_contains_a_stop_and_hold_is_bounded(stops: list[str], text: str) -> None:
    m = StopMatcher(stops)
    released = ""
    for ch in text:
        r = m.feed(ch)
        released += r.text
        assert not any(s in released for s in stops)
        assert len(m.held) <= max((len(s) - 1 for s in stops), default=0)
        if r.stopped:
            break
