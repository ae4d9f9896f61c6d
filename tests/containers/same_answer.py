"""Whether streamed answers are the reference answer of their prompt, within what docs/MODEL.md ("Exactness")
promises: at temperature 0 an answer that was migrated, batched or served from the prefix cache equals the answer
of the same prompt computed otherwise, token for token -- except at a position where the two likeliest tokens are
within twice ``FLASH_TOLERANCE`` (the serving default: flash attention on) of each other in log probability: there
the runner-up may be taken, and the answer goes its own way from there. So a token repeated or lost by a migration
fails, unless it falls after such a near tie (where nothing is promised: the verdict says so).

    python tests/containers/same_answer.py REFERENCE.json ANSWER.txt...

``REFERENCE.json``: the chat completion of the prompt (temperature 0, ``logprobs``, ``top_logprobs`` 2 or more);
each ``ANSWER.txt``: a streamed answer's text as ``edgepath chat`` prints it. Prints a verdict per answer; exits 1
when one is not the reference's answer as promised.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from edgepath.model.known_answer import FLASH_TOLERANCE

#: how far apart the best two tokens' log probabilities may be for either to be taken, as the container serves
#: (flash attention on, its default: docs/MODEL.md)
NEAR_TIE = 2 * FLASH_TOLERANCE


class Differs(Exception):
    """An answer that is not the reference's as promised: a token repeated, lost or changed at no near tie."""


def reference_tokens(reference: dict[str, Any]) -> list[dict[str, Any]]:
    """The reference answer's tokens (``logprobs.content``), checked to spell its text -- a token that is part of a
    character shows as U+FFFD alone and spells nothing: a prompt whose answer has one cannot be checked so."""
    choice = reference["choices"][0]
    entries: list[dict[str, Any]] = choice["logprobs"]["content"]
    if "".join(e["token"] for e in entries) != choice["message"]["content"]:
        raise ValueError("the reference's tokens do not spell its answer (a token that is part of a character?)")
    if any(len(e["top_logprobs"]) < 2 for e in entries):
        raise ValueError("the reference was asked without top_logprobs >= 2: its runners-up are not known")
    return entries


def verdict(reference: dict[str, Any], text: str) -> str:
    """What ``text`` is against ``reference``'s answer (see the module); :class:`Differs` when it breaks the
    promise."""
    entries = reference_tokens(reference)
    answer = "".join(e["token"] for e in entries)
    if text == answer:
        return f"the reference's answer, all {len(entries)} tokens"
    parted = next(
        (i for i, (a, b) in enumerate(zip(text, answer, strict=False)) if a != b), min(len(text), len(answer))
    )
    start = 0
    for k, entry in enumerate(entries):
        if start > parted:
            break
        best, *others = entry["top_logprobs"]  # at temperature 0 the token taken is the first alternative
        for runner_up in others:
            token = runner_up["token"]
            margin = best["logprob"] - runner_up["logprob"]
            taken = text.startswith(token, start) and not answer.startswith(token, start)
            if taken and margin <= NEAR_TIE:
                return (
                    f"the reference's answer for {k} tokens, then its runner-up {token!r} at a near tie ({margin:.3f} "
                    f"behind, within {NEAR_TIE}: docs/MODEL.md, 'Exactness'); not comparable from there"
                )
        start += len(entry["token"])
    raise Differs(
        f"parts from the reference's answer at character {parted} of {len(answer)}, at no near tie: "
        f"{text[max(0, parted - 30) : parted + 30]!r} where the reference has "
        f"{answer[max(0, parted - 30) : parted + 30]!r}"
    )


def main(argv: list[str]) -> int:
    reference_path, *answers = argv
    with open(reference_path) as f:
        reference = json.load(f)
    failed = 0
    for path in answers:
        with open(path) as f:
            text = f.read().removesuffix("\n")  # edgepath chat ends the answer with a newline
        try:
            print(f"{path}: {verdict(reference, text)}")
        except Differs as exc:
            print(f"{path}: {exc}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
