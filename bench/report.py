"""Turn pytest-benchmark JSON into the data-path table of docs/PERFORMANCE.md (never typed by hand).

``python -m edgepath.bench.report out/bench.json --doc docs/PERFORMANCE.md`` rewrites the block between
``<!-- bench:datapath:begin -->`` and ``<!-- bench:datapath:end -->`` (``--readme`` is the option's old name).
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import numpy as np

from edgepath.bench.readme import rewrite_block

TARGETS = {
    "test_parse": "—",
    "test_tokenize": "—",
    "test_frame": "—",
    "test_claim": "p50 ≤ 5",
    "test_write_doorbell": "p50 ≤ 5",
    "test_roundtrip[spin]": "p50 ≤ 50, p99 ≤ 200",
    "test_roundtrip[sleep]": "—",
    "test_first_token": "—",
    "test_cancel": "—",
}
LABELS = {
    "test_parse": "HTTP request parse + validate (sans-I/O core)",
    "test_tokenize": "tokenize 128 tokens into the registered frame (Tekken)",
    "test_frame": "frame 128 token ids into the registered buffer",
    "test_claim": "claim (remote CAS FREE→CLAIMED)",
    "test_write_doorbell": "write 128 tokens + doorbell",
    "test_roundtrip[spin]": "agent round trip, echo, spinning poller",
    "test_roundtrip[sleep]": "agent round trip, echo, sleeping poller (eventfd)",
    "test_first_token": "streamed request to its first token at the agent, sleeping poller",
    "test_cancel": "cancel with a request streaming → CANCELLED at the agent",
}
#: one-way legs a benchmark records in extra_info: key prefix -> (label, target)
LEGS = {
    "doorbell_to_ready": ("doorbell → poller sees READY", None),
    "token_to_agent": ("token produced → streamed to the agent", "—"),
    "cancel_to_handler": ("cancel posted → handler told to stop (one way)", "p50 ≤ 1000"),
}


def table(report: dict) -> str:
    info = report.get("machine_info", {})
    cpu = info.get("cpu", {}).get("brand_raw", platform.processor() or "unknown CPU")
    lines = [
        f"Measured {report.get('datetime', '?')[:19]} on {cpu}, {info.get('cpu', {}).get('count', '?')} cores, "
        f"Python {info.get('python_version', '?')} (`make bench`).",
        "",
        "| stage (µs) | p50 | p99 | max | rounds | target |",
        "|---|---:|---:|---:|---:|---|",
    ]
    extra: list[str] = []
    order = list(LABELS)
    benches = sorted(report["benchmarks"], key=lambda b: order.index(b["name"]) if b["name"] in order else len(order))
    for bench in benches:
        data = np.array(bench["stats"]["data"]) * 1e6
        p50, p99 = np.percentile(data, [50, 99])
        name = bench["name"]
        lines.append(
            f"| {LABELS.get(name, name)} | {p50:.1f} | {p99:.1f} | {data.max():.1f} | {len(data)} | "
            f"{TARGETS.get(name, '')} |"
        )
        e = bench.get("extra_info", {})
        for key, (label, target) in LEGS.items():
            if f"{key}_us_p50" not in e:
                continue
            if target is None:  # the doorbell leg: per poller kind, with a target for the spinning one
                label = f"{label} ({LABELS.get(name, name).split(', ', 1)[-1]})"
                target = "p50 ≤ 10" if "spin" in name else "—"
            extra.append(f"| {label} | {e[f'{key}_us_p50']:.1f} | {e[f'{key}_us_p99']:.1f} | | | {target} |")
    return "\n".join(lines + extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("json", type=Path)
    parser.add_argument("--doc", "--readme", dest="doc", type=Path, help="the page to rewrite the block in")
    args = parser.parse_args()
    block = table(json.loads(args.json.read_text()))
    print(block)
    if args.doc:
        rewrite_block(args.doc, "datapath", block)


if __name__ == "__main__":
    main()
