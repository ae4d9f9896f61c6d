"""``edgepath bench tenants`` for real, short: through ``edgepath serve`` and the real SmolLM2 GGUF, a quiet tenant with
a slot floor one request at a time while a noisy tenant's closed loop holds every slot, and one round of the
cross-tenant probe.  The figures are not checked (a shared machine); the report's shape and the promises are: the
quiet tenant is never refused, the noisy key reads nothing the quiet key's prompt left in the cache."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from edgepath.bench.tenants import add_arguments, main

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")


def test_a_quiet_tenant_under_its_floor_is_never_refused_while_a_noisy_one_holds_every_slot(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--quiet", "4", "--quiet-tokens", "32-160", "--quiet-max-tokens", "8", "--noisy-seconds", "4",
            "--noisy-prompt-tokens", "64", "--noisy-max-tokens", "24", "--slots", "4", "--floor", "2",
            "--rounds", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    code = main(args)
    report = json.loads((tmp_path / "tenants.json").read_text())
    a, b, verdict = report["A_quiet_alone"], report["B_noisy_alone"], report["verdict"]
    c, d = report["C_both"], report["D_noisy_within"]
    assert a["statuses"] == {"200": 4}, a["rows"]
    for phase in (c, d):  # never refused, never cut: within its floor nothing is taken from it
        assert phase["quiet"]["statuses"] == {"200": 4} and phase["quiet"]["not_whole"] == 0, phase["quiet"]["rows"]
    assert verdict["quiet_refused"] == verdict["quiet_cut"] == 0
    assert report["serve_log_errors"]["count"] == 0, report["serve_log_errors"]
    for phase in (b, c, d):
        assert phase["noisy"]["output_tok_s"] > 0 and set(phase["noisy"]["statuses"]) <= {"200", "429"}, phase
        assert not phase["noisy"]["errors"], phase["noisy"]["errors"]  # every answer ended
        assert phase["cpu"]["server_cpu_s"] > 0 and phase["idle"]["samples"] > 0
    assert b["noisy"]["refused_429"] > 0 and c["noisy"]["refused_429"] > 0  # the closed loop asked for more
    # the quiet tenant took its slots back (else the test did not test floors)
    assert c["reclaims"]["cut_reclaimed"] + c["reclaims"]["moved"] > 0
    for key in (
        "quiet_ttft_p99_ratio", "quiet_ttft_p99_ratio_within_floor", "noisy_output_ratio", "total_output_ratio",
        "total_computed_ratio", "offered_attempts_over_capacity",
    ):  # fmt: skip
        assert isinstance(verdict[key], float), (key, verdict)
    probe = report["probe"]
    assert probe["b_same"]["cached_tokens"] == [0]  # the noisy key learns nothing of the quiet key's note
    assert probe["a_follow_up"]["cached_tokens"][0] > 0  # while the quiet key's own follow-up reads it
    assert probe["b_same"]["prompt_tokens"] == probe["a_first"]["prompt_tokens"]
    assert code == 0
