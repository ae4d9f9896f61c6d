"""``edgepath bench structured`` for real, short: a few Pydantic models asked through the openai SDK's
``chat.completions.parse`` over HTTP/1.1 and through libcurl's HTTP/3, each answer read back with its model, and
one round of the decode-speed comparison -- through ``edgepath serve`` and the real SmolLM2 GGUF.  The figures are
not checked (a shared machine); what the servers answered is."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from edgepath.bench.cli import add_structured_arguments

pytestmark = pytest.mark.slow
pytest.importorskip("llama_cpp", reason="the model extra is not installed (pip install -e '.[model]')")
pytest.importorskip("openai", reason="the openai client is in the test extras")
pytest.importorskip("curl_cffi", reason="libcurl's HTTP/3 client (curl_cffi) is a bench dependency")


def test_pydantic_models_parse_over_http1_and_http3(tmp_path: Path) -> None:
    from edgepath.bench.structured import main

    parser = argparse.ArgumentParser()
    add_structured_arguments(parser)
    args = parser.parse_args(
        ["--requests", "6", "--decode-rounds", "1", "--decode-tokens", "48", "--max-tokens", "200", "--out",
         str(tmp_path)]
    )  # fmt: skip
    code = main(args)
    report = json.loads((tmp_path / "structured.json").read_text())
    for transport in ("http/1.1", "http/3"):
        half = report[transport]
        assert half["requests"] == 3 and half["statuses"] == {"200": 3}, half
        assert half["failures"] == [], half["failures"]
        assert half["parsed"] + half["finish_reasons"].get("length", 0) == 3, half
    assert len(report["http/1.1"]["per_model"]) == 3  # three different models on each transport
    decode = report["decode"]
    assert decode["constrained_tokens"][0] > 1 and decode["unconstrained_tokens"][0] > 1
    assert code == 0
