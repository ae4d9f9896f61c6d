"""The container lane's check of streamed answers against a reference answer (tests/containers/same_answer.py): a
token repeated or lost fails; the runner-up taken at a near tie (docs/MODEL.md, "Exactness") does not."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from containers.same_answer import NEAR_TIE, Differs, main, verdict


def reference(*positions: tuple[str, float, str, float]) -> dict[str, Any]:
    """A chat completion whose answer is each position's best token, with its runner-up and their log probs."""
    content = [
        {
            "token": best,
            "logprob": lp,
            "top_logprobs": [{"token": best, "logprob": lp}, {"token": second, "logprob": lp2}],
        }
        for best, lp, second, lp2 in positions
    ]
    text = "".join(best for best, *_ in positions)
    return {"choices": [{"message": {"content": text}, "logprobs": {"content": content}}]}


PARIS = reference(
    ("Paris", -0.1, "The", -3.0),
    (" is", -0.2, " was", -0.25),  # a near tie: 0.05 apart
    (" the", -0.1, " a", -2.0),
    (" capital", -0.1, " city", -2.5),
    (".", -0.1, "!", -4.0),
)


def test_the_same_answer_passes() -> None:
    assert verdict(PARIS, "Paris is the capital.") == "the reference's answer, all 5 tokens"


@pytest.mark.parametrize(
    "text",
    [
        "Paris is the the capital.",  # a token repeated
        "Paris is capital.",  # a token lost
        "Paris is the capital",  # the last one lost
        "Paris is the capital..",  # the last one repeated
        "Paris is the city.",  # another token where the best is far ahead of it
        "ParisParis is the capital.",  # repeated at the start
    ],
)
def test_a_token_repeated_lost_or_changed_where_there_is_no_near_tie_fails(text: str) -> None:
    with pytest.raises(Differs, match="at no near tie"):
        verdict(PARIS, text)


def test_the_runner_up_at_a_near_tie_passes_and_says_nothing_is_promised_after_it() -> None:
    said = verdict(PARIS, "Paris was a town.")
    assert "runner-up ' was' at a near tie (0.050 behind" in said and "not comparable from there" in said


def test_a_runner_up_further_behind_than_the_tolerance_fails() -> None:
    far = reference(("Paris", -0.1, "The", -3.0), (" is", -0.2, " was", -0.2 - NEAR_TIE - 0.01))
    with pytest.raises(Differs):
        verdict(far, "Paris was")


def test_a_reference_that_cannot_be_checked_is_refused() -> None:
    broken = reference(("caf", -0.1, "x", -1.0), ("\ufffd", -0.1, "y", -1.0))
    broken["choices"][0]["message"]["content"] = "café"  # a character cut over two tokens
    with pytest.raises(ValueError, match="do not spell its answer"):
        verdict(broken, "café")


def test_the_command_reads_the_files_and_fails_on_one_answer_that_differs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "reference.json").write_text(json.dumps(PARIS))
    (tmp_path / "good.txt").write_text("Paris is the capital.\n")
    (tmp_path / "bad.txt").write_text("Paris is the the capital.\n")
    files = [str(tmp_path / n) for n in ("reference.json", "good.txt")]
    assert main(files) == 0
    assert main([*files, str(tmp_path / "bad.txt")]) == 1
    assert "bad.txt: parts from the reference's answer at character 13" in capsys.readouterr().out
