"""``edgepath bench lockout`` for real, short: a flood that never backs off on 429 (a share of its clients going
away before their first token), then chats one at a time that must every one be admitted -- issue 34's outage,
through ``edgepath serve`` and the real SmolLM2 GGUF.  The figures are not checked (a shared machine); what the
server answered is."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from edgepath.bench.lockout import add_arguments, main

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")


def test_after_a_flood_that_never_backs_off_every_sequential_request_is_admitted(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--seconds", "8", "--sweep", "6", "--sweep-tokens", "16-600", "--out", str(tmp_path)])
    code = main(args)
    report = json.loads((tmp_path / "lockout.json").read_text())
    flood, sweep = report["flood"], report["sweep"]
    assert flood["requests"] > 0 and set(flood["statuses"]) <= {"200", "429", "went away"}, flood
    assert report["health_after_flood"]["status"] == 200
    assert sweep["statuses"] == {"200": 6}, sweep["rows"]
    assert code == 0
