"""``edgepath bench model``'s report: the issue's targets judged, the performance page's block, the plot.

Every ratio is edgepath / llama-server in the same thread setting, from the same phase.  TTFT and ITL
are over answered requests only, so each target row says how many of each system's requests were
answered and how many refused; goodput counts refused and failed requests as missing the SLO.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgepath.bench.model_compare import (
    CLIENT_BOUND_CPU,
    CLIENT_BOUND_LAG,
    EDGEPATH,
    EDGEPATH_NO_BOUND,
    LLAMA_SERVER,
    PREDICTION_BAND,
)
from edgepath.bench.readme import place_plot, rewrite_block

PHASES = {
    "lone": "one request at a time",
    "concurrent": "concurrency = slots (closed loop)",
    "saturation": "saturation: slots streams in a closed loop, one prompt length, answers of max_tokens",
    "prefix-seq-cold": "shared prefix: first chat (cold)",
    "prefix-seq-warm": "shared prefix: next chats, one at a time (warm)",
    "prefix-burst-cold": "shared prefix: slots chats at once (cold)",
    "prefix-conc-warm": "shared prefix: concurrency = slots (warm)",
    "burst": "2 x slots requests at once",
}


def phase_label(phase: str) -> str:
    if phase.startswith("poisson-"):
        return f"Poisson, {phase.removeprefix('poisson-')}% of capacity"
    if phase.startswith("retry-"):
        load, retries = phase.removeprefix("retry-").split("-r")
        return f"Poisson, {load}% of capacity, openai SDK retries (max_retries {retries})"
    return PHASES.get(phase, phase)


def find(report: dict[str, Any], system: str, threads: str, phase: str) -> dict[str, Any] | None:
    for result in report["results"]:
        if result["system"] == system and result["threads"] == threads:
            return next((row for row in result["phases"] if row["phase"] == phase), None)
    return None


def _answered(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    return f"{row['ok']}/{row['requests']}" + (f" ({row['refused_429']} refused)" if row["refused_429"] else "")


def _judge(
    ours: float | None, theirs: float | None, goal: str, why_not: str, *rows: dict[str, Any] | None
) -> tuple[float | None, str]:
    """``ours / theirs`` against ``goal`` (``>=X`` or ``<=X``): the ratio and the verdict, or why there is none."""
    if ours is None or theirs is None:
        return None, f"not measured: {why_not}"
    at_least = goal.startswith(">=")
    if theirs == 0:
        if ours == 0:
            return None, "no ratio: both are 0"
        return None, ("met" if at_least else "missed") + " (the other is 0)"
    value = ours / theirs
    met = value >= float(goal[2:]) if at_least else value <= float(goal[2:])
    client = any(row is not None and row["client_bound"] for row in rows)
    return value, ("met" if met else "missed") + (" (client-bound phase)" if client else "")


def _figure(row: dict[str, Any] | None, key: str) -> float | None:
    return None if row is None else row[key]


#: (name, phase, figure, goal): edgepath's figure over llama-server's, from the issue's targets.
VERSUS = (
    ("output tokens/s at concurrency = slots", "concurrent", "output_tok_s", ">=1.0"),
    ("ITL p50 at concurrency = slots", "concurrent", "itl_p50_ms", "<=1.1"),
    ("output tokens/s at saturation (guidellm's closed loop)", "saturation", "output_tok_s", ">=1.0"),
    ("ITL p50 at saturation, each request's mean gap (guidellm's)", "saturation", "itl_mean_p50_ms", "<=1.1"),
    ("TTFT p50 at saturation", "saturation", "ttft_p50_ms", "<=1.0"),
    ("TTFT p50 of a lone request", "lone", "ttft_p50_ms", "<=1.0"),
    ("shared prefix: warm TTFT p50 (one at a time)", "prefix-seq-warm", "ttft_p50_ms", "<=2.0"),
    ("goodput at 200% of capacity", "poisson-200", "goodput_rps", ">=2.0"),
    ("completed requests/s at 120% with clients retrying (max_retries 8)", "retry-120-r8", "answered_rps", ">=0.95"),
    ("completed requests/s at 200% with clients retrying (max_retries 8)", "retry-200-r8", "answered_rps", ">=0.95"),
    (
        "first tokens within 5 s of the call per second at 120% (max_retries 2)",
        "retry-120-r2",
        "first_token_5s_rps",
        ">=1.5",
    ),
    (
        "first tokens within 5 s of the call per second at 120% (max_retries 8)",
        "retry-120-r8",
        "first_token_5s_rps",
        ">=1.5",
    ),
    (
        "first tokens within 5 s of the call per second at 200% (max_retries 2)",
        "retry-200-r2",
        "first_token_5s_rps",
        ">=2.0",
    ),
    (
        "first tokens within 5 s of the call per second at 200% (max_retries 8)",
        "retry-200-r8",
        "first_token_5s_rps",
        ">=2.0",
    ),
)
#: Phases whose refused clients came back when advised: the share of those retries admitted (edgepath alone)
ADVISED = ("retry-100-r2", "retry-100-r8", "retry-120-r2", "retry-120-r8", "retry-200-r2", "retry-200-r8")
#: Loads at which admitted requests' wait and TTFT are held to the bound (the admission issue's targets)
OVERLOADS = ("poisson-200", "poisson-400")
#: Phases whose requests' prediction error is judged
PREDICTED = ("poisson-100", "poisson-200", "poisson-400", "burst")


def _target(
    threads: str, name: str, goal: str, why: str, pair: tuple[float | None, float | None], *rows: dict[str, Any] | None
) -> dict[str, Any]:
    """One judged row: ``pair`` is (ours, theirs), ``rows`` the phases they come from (for the answered counts)."""
    value, verdict = _judge(*pair, goal, why, *rows)
    answered = " vs ".join(_answered(row) for row in rows) if rows else "-"
    return {
        "threads": threads, "name": name, "goal": goal, "value": value, "ours": pair[0], "theirs": pair[1],
        "answered": answered, "verdict": verdict,
    }  # fmt: skip


def admission_targets(report: dict[str, Any], threads: str) -> list[dict[str, Any]]:
    """The admission issue's: edgepath's wait and TTFT under overload, its bound's cost, its prediction, an
    idle server that never refuses."""
    bound_ms = report["slo"]["wait_s"] * 1e3
    rows = []
    lone = find(report, EDGEPATH, threads, "lone")
    for phase in OVERLOADS:
        row = find(report, EDGEPATH, threads, phase)
        why = f"needs {EDGEPATH}'s {phase} phase"
        rows.append(_target(
            threads, f"{phase}: {EDGEPATH} wait p99 / the bound", "<=1.1", why,
            (_figure(row, "wait_p99_ms"), bound_ms if row else None), row,
        ))  # fmt: skip
        rows.append(_target(
            threads, f"{phase}: {EDGEPATH} TTFT p99 / its lone TTFT p99", "<=2.0", f"{why} and its lone phase",
            (_figure(row, "ttft_p99_ms"), _figure(lone, "ttft_p99_ms")), row, lone,
        ))  # fmt: skip
    ours, free = find(report, EDGEPATH, threads, "poisson-100"), find(report, EDGEPATH_NO_BOUND, threads, "poisson-100")
    rows.append(_target(
        threads, f"output tokens/s at 100% of capacity, {EDGEPATH} / {EDGEPATH_NO_BOUND}", ">=0.95",
        f"needs a poisson-100 phase of {EDGEPATH} and {EDGEPATH_NO_BOUND}",
        (_figure(ours, "output_tok_s"), _figure(free, "output_tok_s")), ours, free,
    ))  # fmt: skip
    low, high = PREDICTION_BAND
    for phase in PREDICTED:
        row = find(report, EDGEPATH, threads, phase)
        share = _figure(row, "prediction_in_band")
        rows.append(_target(
            threads, f"{phase}: share of {EDGEPATH}'s TTFT within {low:g}-{high:g} x its prediction", ">=0.95",
            f"needs {EDGEPATH}'s {phase} phase with predictions", (share, 1.0 if share is not None else None), row,
        ))  # fmt: skip
    for phase in ADVISED:
        row = find(report, EDGEPATH, threads, phase)
        share = _figure(row, "advised_admitted_share")
        if row is None:
            continue
        rows.append(_target(
            threads, f"{phase}: share of {EDGEPATH}'s advised retries admitted", ">=0.8",
            f"no retry followed {EDGEPATH}'s advice in {phase}", (share, 1.0 if share is not None else None), row,
        ))  # fmt: skip
    rows.append(_target(
        threads, f"{EDGEPATH} refusals with nothing else running (lone phase), share", "<=0.0",
        f"needs {EDGEPATH}'s lone phase", (_figure(lone, "refused_429"), _figure(lone, "requests")), lone,
    ))  # fmt: skip
    return rows


def targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets per thread setting, each judged or said why not (a missing system or phase)."""
    rows = []
    for threads in report["threads"]:
        for name, phase, figure, goal in VERSUS:
            ours, theirs = find(report, EDGEPATH, threads, phase), find(report, LLAMA_SERVER, threads, phase)
            value, verdict = _judge(
                _figure(ours, figure), _figure(theirs, figure), goal, f"needs a {phase} phase of both", ours, theirs
            )
            rows.append(
                {
                    "threads": threads,
                    "name": f"{name}, {EDGEPATH} / {LLAMA_SERVER}",
                    "goal": goal,
                    "value": value,
                    "ours": _figure(ours, figure),
                    "theirs": _figure(theirs, figure),
                    "answered": f"{_answered(ours)} vs {_answered(theirs)}",
                    "verdict": verdict,
                }
            )
        warm = find(report, EDGEPATH, threads, "prefix-seq-warm")
        cold = find(report, EDGEPATH, threads, "prefix-seq-cold")
        why = f"needs the shared-prefix phases of {EDGEPATH}"
        value, verdict = _judge(_figure(warm, "ttft_p50_ms"), _figure(cold, "ttft_p50_ms"), "<=0.1", why, warm, cold)
        rows.append(
            {
                "threads": threads,
                "name": f"shared prefix: {EDGEPATH} warm TTFT p50 / its cold TTFT",
                "goal": "<=0.1",
                "value": value,
                "ours": _figure(warm, "ttft_p50_ms"),
                "theirs": _figure(cold, "ttft_p50_ms"),
                "answered": f"{_answered(warm)} vs {_answered(cold)}",
                "verdict": verdict,
            }
        )
        rows += admission_targets(report, threads)
    for batch in report.get("batching", []):
        ours, theirs = batch.get("edgepath", {}), batch.get("llama-batched-bench", {})
        why = ours.get("error") or theirs.get("error") or "no figures"
        value, verdict = _judge(ours.get("many"), theirs.get("many"), ">=0.95", why)
        rows.append(
            {
                "threads": str(batch["threads"]),
                "name": f"decode tokens/s at {batch['slots']} sequences, {EDGEPATH}'s handler / llama-batched-bench",
                "goal": ">=0.95",
                "value": value,
                "ours": ours.get("many"),
                "theirs": theirs.get("many"),
                "answered": "-",
                "verdict": verdict,
            }
        )
    return rows


def _f(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _threads_line(report: dict[str, Any]) -> str:
    """What each thread setting meant for each system: the count asked for, or its default and what it reported."""
    parts = []
    for result in report["results"]:
        if result["threads"] != "default":
            continue
        reported = result.get("threads_reported")
        said = f"{reported} reported" if reported is not None else "count not reported"
        parts.append(f"{result['system']} {said} ({result.get('threads_default') or 'its default'})")
    return ("Defaults: " + "; ".join(parts) + ".") if parts else ""


def _rates_line(report: dict[str, Any]) -> str:
    parts = []
    for result in report["results"]:
        if result.get("capacity_rps") is None:
            continue
        basis = result.get("rate_basis_rps")
        ref = " (reference)" if result.get("reference") else ""
        parts.append(
            f"{result['system']} at threads {result['threads']}{ref}: capacity {_f(result['capacity_rps'], 3)}/s, "
            f"Poisson rates fractions of {_f(basis, 3)}/s"
        )
    return "; ".join(parts)


def table(report: dict[str, Any]) -> str:
    """The performance page's block: how it was measured, a table per thread setting, the targets, the columns."""
    setup, prompts, slo = report["setup"], report["prompts"], report["slo"]
    peer = ""
    if LLAMA_SERVER in report["systems"]:
        build = report.get("llama_server") or {}
        built = build.get("built_from") or f"not available: {build.get('error', 'not built')}"
        peer = f" llama-server (`-np {setup['slots']} -c {setup['slots'] * setup['ctx_per_slot']}`): {built}."
    head = (
        f"Measured {report['measured_at']} on {report['machine']}, load average {report['loadavg_at_start']:.2f} "
        f"at start (`{report['command']}`, {report.get('run_seconds', '?')} s): {Path(setup['model']).name}, "
        f"{setup['slots']} slots, {setup['ctx_per_slot']} positions per slot, max_tokens {setup['max_tokens']}, "
        f"temperature 0, streamed over HTTP/1.1. Prompts {prompts['tokens']} tokens (log-uniform, seed "
        f"{prompts['seed']}), different in every phase; shared prefix: a {prompts['prefix_tokens']}-token system "
        f"prompt.{peer}"
        + (f" Handler options: {', '.join(setup['handler_options'])}." if setup["handler_options"] else "")
    )
    settings = [
        f"Thread settings: {', '.join(report['threads'])}.",
        _threads_line(report),
        f"Rates: {_rates_line(report)}.",
    ]
    if report["quick"]:
        settings.append("**Smoke test (--quick): too few requests for the figures to mean anything.**")
    lines = [head, "", " ".join(part for part in settings if part)]
    for threads in report["threads"]:
        lines += [
            "",
            f"**threads: {threads}**",
            "",
            "| phase | system | answered/sent | TTFT p50 / p99 ms | wait p50 / p99 ms | ITL p50 / p99 ms "
            "| output tok/s | goodput/s | server CPU ms/request | notes |",
            "|" + "---|" * 10,
        ]
        for result in (r for r in report["results"] if r["threads"] == threads and "error" in r):
            lines.append(f"| - | {result['system']} | did not finish: {result['error']} | | | | | | | |")
        phases = list(
            dict.fromkeys(row["phase"] for r in report["results"] if r["threads"] == threads for row in r["phases"])
        )
        for phase in phases:
            for result in (r for r in report["results"] if r["threads"] == threads):
                row = next((x for x in result["phases"] if x["phase"] == phase), None)
                if row is not None:
                    lines.append(_row(result["system"], row))
    lines += ["", "| threads | target | edgepath | other | ratio | goal | verdict | answered (edgepath vs other) |"]
    lines.append("|" + "---|" * 8)
    for t in report["targets"]:
        lines.append(
            f"| {t['threads']} | {t['name']} | {_f(t['ours'], 1)} | {_f(t['theirs'], 1)} | {_f(t['value'], 2)} "
            f"| {t['goal'].replace('<=', '≤ ').replace('>=', '≥ ')} | {t['verdict']} | {t['answered']} |"
        )
    lines += [
        "",
        "TTFT, wait and ITL are over answered requests only (answered/sent; refused = 429 at once). Wait: TTFT "
        "less what the request's uncached prompt took the same system in its lone phase (a least-squares line "
        "of TTFT over uncached prompt tokens), the same measure for every system; edgepath's own measure of it "
        "(X-Queue-Time: TTFT less its cost model's prefill time) is in the notes as `measured wait`. Goodput: "
        f"requests/s that waited at most {slo['wait_s']:g} s (edgepath's default bound) and whose median "
        f"inter-token gap was within {slo['itl_p50_s'] * 1e3:g} ms; refused and failed requests count as missing "
        "it. Prediction: edgepath's own time to first token over the agent's prediction at claim time "
        f"(Server-Timing), p10/p50/p90 and the share within {PREDICTION_BAND[0]:g}-{PREDICTION_BAND[1]:g}. ITL "
        "is the gap between streamed content chunks. Server CPU: utime + stime of every server process over the "
        "phase, per answered request. Edge stages: edgepath's own Server-Timing, request in to the slot server's "
        "doorbell. Retrying phases: each user calls as the openai SDK does (429 retried up to max_retries times, "
        "after retry-after-ms, else Retry-After, when within 60 s, else 0.5 s x 2^n), TTFT is from the user's first "
        "call, and goodput there is a first token within 5 s of it. "
        f"client-bound: the load generator sent > {CLIENT_BOUND_LAG * 1e3:g} ms late (p99) or used > "
        f"{CLIENT_BOUND_CPU:.0%} of a core.",
    ]
    return "\n".join(lines)


def _row(system: str, row: dict[str, Any]) -> str:
    notes = []
    if row["rate_rps"]:
        notes.append(f"{row['rate_rps']:.3f}/s offered")
    if row["not_finished"]:
        notes.append(f"{row['not_finished']} did not finish ({'; '.join(row['errors'])})")
    if row["cached_tokens_mean"] is not None and row["cached_tokens_mean"] > 0:
        notes.append(f"{row['cached_tokens_mean']:.0f} prompt tokens cached per request")
    if row["tokens_per_chunk"] is not None and row["tokens_per_chunk"] > 1.05:
        notes.append(f"{row['tokens_per_chunk']:.2f} tokens per chunk")
    if row["server_wait_p50_ms"] is not None:
        notes.append(f"measured wait {row['server_wait_p50_ms']:,.0f} / {row['server_wait_p99_ms']:,.0f} ms")
    if row["prediction_p50"] is not None:
        notes.append(
            f"actual/predicted TTFT {row['prediction_p10']:.2f} / {row['prediction_p50']:.2f} / "
            f"{row['prediction_p90']:.2f} (p10/p50/p90), {row['prediction_in_band']:.0%} in band"
        )
    if row["edge_ms_p50"] is not None:
        notes.append(f"edge stages {row['edge_ms_p50']:.1f} ms p50")
    if row["phase"] == "saturation" and row.get("itl_mean_p50_ms") is not None:
        notes.append(f"each request's mean inter-token gap {row['itl_mean_p50_ms']:.1f} ms p50 (guidellm's ITL)")
    if row.get("attempts_mean") is not None and row["phase"].startswith("retry-"):
        notes.append(
            f"{row['attempts_mean']:.2f} attempts per request, first token within 5 s of the call "
            f"{_f(row['first_token_5s_rps'], 3)}/s, {row['answered_rps'] or 0:.3f} completed/s"
        )
        if row["advised_admitted_share"] is not None:
            notes.append(f"{row['advised_admitted_share']:.0%} of {row['advised_retries']} advised retries admitted")
    if row["client_bound"]:
        notes.append("client-bound")
    answered = f"{row['ok']}/{row['requests']}" + (f" ({row['refused_share']:.0%} 429)" if row["refused_429"] else "")
    return (
        f"| {phase_label(row['phase'])} | {system} | {answered} | {_f(row['ttft_p50_ms'])} / {_f(row['ttft_p99_ms'])} "
        f"| {_f(row['wait_p50_ms'])} / {_f(row['wait_p99_ms'])} "
        f"| {_f(row['itl_p50_ms'], 1)} / {_f(row['itl_p99_ms'], 1)} | {_f(row['output_tok_s'], 1)} "
        f"| {_f(row['goodput_rps'], 3)} | {_f(row['server_cpu_ms_per_request'])} | {', '.join(notes)} |"
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """Per thread setting: TTFT p50 (bars) and p99 (markers) per phase, and output tokens/s, one bar per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = report["threads"]
    fig, axes = plt.subplots(2, len(settings), figsize=(6.5 * len(settings), 8), squeeze=False, sharey="row")
    for col, threads in enumerate(settings):
        results = [r for r in report["results"] if r["threads"] == threads and r["phases"]]
        phases = list(dict.fromkeys(row["phase"] for r in results for row in r["phases"]))
        width = 0.8 / max(1, len(results))
        ttft_ax, tok_ax = axes[0][col], axes[1][col]
        for k, result in enumerate(results):
            by_phase = {row["phase"]: row for row in result["phases"]}
            xs = [i + (k - (len(results) - 1) / 2) * width for i, p in enumerate(phases) if p in by_phase]
            rows = [by_phase[p] for p in phases if p in by_phase]
            p50 = [row["ttft_p50_ms"] or float("nan") for row in rows]
            bars = ttft_ax.bar(xs, p50, width * 0.9, label=result["system"])
            color = bars.patches[0].get_facecolor() if bars.patches else None
            ttft_ax.scatter(xs, [row["ttft_p99_ms"] or float("nan") for row in rows], marker="v", color=color, zorder=3)
            tok_ax.bar(xs, [row["output_tok_s"] or float("nan") for row in rows], width * 0.9, color=color)
        for ax in (ttft_ax, tok_ax):
            ax.set_xticks(range(len(phases)), phases, rotation=35, ha="right", fontsize="small")
            ax.grid(True, axis="y", which="both", alpha=0.3)
        ttft_ax.set_yscale("log")
        ttft_ax.set_ylabel("time to first token, ms (bar p50, ▼ p99)")
        ttft_ax.set_title(f"threads: {threads}")
        ttft_ax.legend(fontsize="small")
        tok_ax.set_ylabel("output tokens/s")
    fig.suptitle(f"streamed chat completions, {Path(report['setup']['model']).name}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MODEL_BEGIN, MODEL_END = "<!-- bench:model:begin -->", "<!-- bench:model:end -->"


def rewrite_doc(doc: Path, text: str, png: Path) -> None:
    """Replace the page's model block with ``text`` and the plot (copied next to the page)."""
    if MODEL_BEGIN not in doc.read_text():  # before the plot is copied
        raise SystemExit(f"{doc}: no {MODEL_BEGIN} ... {MODEL_END} block to rewrite")
    link = place_plot(doc, png, "model.png")
    rewrite_block(doc, "model", f"{text}\n\n![time to first token and throughput per phase]({link})")
