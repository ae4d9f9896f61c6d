"""The known-answer check: llama.cpp's logits against the exact forward pass's, before a slot server serves.

The pure checks first (``compare``, ``consistent``, ``degenerate``: no model), then the real SmolLM2 GGUF:
the shipped reference is what the float64 numpy forward pass computes on this machine, the handler starts
when llama.cpp matches it, and refuses to -- one line naming the CPU and the build -- when the reference is
deliberately wrong, in process and as a ``slot-server`` command (exit status 2, never "ready").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
from pathlib import Path

import numpy as np
import pytest

from edgepath.model import known_answer
from edgepath.model.known_answer import KnownAnswer, compare, consistent, degenerate

VOCAB = 50


def reference(tolerance: float = 0.3) -> KnownAnswer:
    return KnownAnswer(
        model="m.gguf",
        sha256="0" * 64,
        ids=(1, 2, 3, 4),
        positions=(2, 3),
        top=((7, 8, 9), (10, 11, 12)),
        logits=((20.0, 15.0, 14.0), (9.0, 8.9, 3.0)),
        tolerance=tolerance,
        source="test",
    )


def rows_for(ref: KnownAnswer, shift: float = 0.0) -> np.ndarray:
    rows = np.zeros((len(ref.positions), VOCAB))
    for row, top, logits in zip(rows, ref.top, ref.logits, strict=True):
        row[list(top)] = np.asarray(logits) + shift
    return rows


def test_logits_within_the_tolerance_pass() -> None:
    ref = reference()
    worst, problems = compare(ref, rows_for(ref, shift=0.2))
    assert problems == [] and worst == pytest.approx(0.2)


def test_one_logit_off_by_more_than_the_tolerance_is_named() -> None:
    ref = reference()
    rows = rows_for(ref)
    rows[1, 11] += 0.5  # position 3, token 11 (now the best, but a near tie there: only its error counts)
    worst, problems = compare(ref, rows)
    assert worst == pytest.approx(0.5)
    assert problems[0].startswith("token 11's logit at position 3 is 9.400, the reference's 8.900 (off by 0.500")


def test_another_best_token_fails_only_where_the_reference_is_clear() -> None:
    ref = reference(tolerance=1.0)
    rows = rows_for(ref)
    rows[0, 30] = 25.0  # position 2: the reference's margin is 5 > 2 x tolerance
    rows[1, 31] = 9.5  # position 3: the reference's margin is 0.1, a near tie: not judged
    _, problems = compare(ref, rows)
    assert problems == ["at position 2 the best token is 30, the reference's is 7 (by a margin of 5.00)"]


def test_one_step_and_two_must_agree() -> None:
    rng = np.random.default_rng(0)
    one = rng.normal(size=(10, VOCAB))
    assert consistent(one, one + 0.01) == []
    far = one.copy()
    far[3, 0] += known_answer.SPLIT_TOLERANCE + 1
    assert "differ by" in consistent(one, far)[0]
    shuffled = rng.normal(size=(10, VOCAB))
    assert any("agree on the best token" in p for p in consistent(one, shuffled))


def test_a_collapsed_continuation_is_degenerate() -> None:
    n = known_answer.CONTINUATION
    assert degenerate([5] * n) and degenerate([5, 6] * (n // 2))
    assert degenerate(list(range(n))) == []
    assert degenerate([5] * (n - 1)) == []  # stopped early (an end-of-generation token): not judged


def test_only_a_build_without_llamafile_is_batch_invariant() -> None:
    assert not known_answer.batch_invariant("CPU : AVX2 = 1 | LLAMAFILE = 1 | OPENMP = 1 |")
    assert known_answer.batch_invariant("CPU : AVX2 = 1 | OPENMP = 1 | REPACK = 1 |")


def test_cpu_name_reads_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t: avx2\n")
    assert known_answer.cpu_name(info) == "AMD EPYC"
    assert known_answer.cpu_name(tmp_path / "missing") == "unknown CPU"


# -- the real model ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> Path:
    pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
    from edgepath.model.gguf import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def shipped(model: Path) -> KnownAnswer:
    from edgepath.model.convert import sha256

    return known_answer.shipped()[sha256(model)]


def handler(options: dict[str, str]):  # type: ignore[no-untyped-def]
    from edgepath.model.llama import LlamaHandler
    from edgepath.slots.handlers import HandlerConfig

    return LlamaHandler.from_config(HandlerConfig(1, 64, 16, {"threads": "1", "prefix_cache": "off", **options}))


def wrong(ref: KnownAnswer, tmp_path: Path) -> Path:
    """``ref`` with one logit moved by a whole unit: a reference no right build can meet."""
    logits = [list(row) for row in ref.logits]
    logits[0][0] += 1.0
    path = tmp_path / "wrong.json"
    path.write_text(json.dumps([dataclasses.replace(ref, logits=tuple(map(tuple, logits))).to_json()]))
    return path


@pytest.mark.slow
def test_the_shipped_reference_is_what_the_exact_forward_pass_computes_here(model: Path, shipped: KnownAnswer) -> None:
    """Recomputed on whatever machine runs this (float64 numpy: no llama.cpp kernel), to the 4 decimals kept."""
    pytest.importorskip("gguf", reason="the model extra is not installed")
    from edgepath.model.reference import Reference

    rows = Reference(model).logits(list(shipped.ids))
    for position, top, logits in zip(shipped.positions, shipped.top, shipped.logits, strict=True):
        assert np.argsort(-rows[position], kind="stable")[: len(top)].tolist() == list(top)
        assert np.abs(rows[position][list(top)] - np.asarray(logits)).max() < 1e-3


def test_the_default_model_answers_what_the_exact_model_answers(model: Path, shipped: KnownAnswer) -> None:
    """The reference's answer is the README's: llama.cpp decodes it token for token."""
    from edgepath.edge.text.tokenizer import GGUFTokenizer

    answer = GGUFTokenizer(model).decode(np.array(shipped.ids[shipped.positions[0] + 1 :], dtype=np.int32))
    assert answer == "The capital of France is Paris."


def test_the_handler_starts_when_its_known_answer_holds(model: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="edgepath.model.llama"):
        handler({}).close()
    assert any("its known answer holds (largest logit error" in r.getMessage() for r in caplog.records)


def test_a_wrong_reference_refuses_to_start_in_one_line(model: Path, shipped: KnownAnswer, tmp_path: Path) -> None:
    from edgepath.slots.handlers import HandlerError

    with pytest.raises(HandlerError) as raised:
        handler({"known_answer": str(wrong(shipped, tmp_path))})
    message = str(raised.value)
    assert "\n" not in message
    assert f"{model.name} computes wrong numbers on this machine: token {shipped.top[0][0]}'s logit" in message
    assert f"CPU {known_answer.cpu_name()}" in message and "llama.cpp CPU :" in message
    assert "known_answer=off serves anyway" in message
    handler({"known_answer": "off"}).close()  # the override


def test_a_references_file_without_this_model_or_unreadable_is_refused(model: Path, tmp_path: Path) -> None:
    from edgepath.slots.handlers import HandlerError

    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(HandlerError, match="holds no known answer for"):
        handler({"known_answer": str(empty)})
    with pytest.raises(HandlerError, match="not a references file"):
        handler({"known_answer": str(tmp_path / "missing.json")})


def test_a_model_without_a_reference_is_checked_for_self_consistency(
    model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("edgepath.model.answer_check.shipped", dict)
    with caplog.at_level(logging.INFO, logger="edgepath.model.llama"):
        handler({}).close()
    assert any("self-consistency only" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_slot_server_with_a_wrong_reference_exits_2_and_never_says_ready(
    model: Path, shipped: KnownAnswer, tmp_path: Path
) -> None:
    from edgepath.children import edgepath_argv, free_port

    argv = edgepath_argv(
        "slot-server", "--handler", "llama", "--slots", "1", "--input-capacity", "256", "--output-capacity", "64",
        "--listen", f"127.0.0.1:{free_port()}",
        "--handler-option", "threads=1", "--handler-option", f"known_answer={wrong(shipped, tmp_path)}",
    )  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "ready" not in done.stdout
    errors = [line for line in done.stderr.splitlines() if "computes wrong numbers" in line]
    assert len(errors) == 1 and "known_answer=off" in errors[0]
