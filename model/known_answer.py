"""The model's known answer: before a slot server serves, llama.cpp's logits are checked against numbers it
must give, so a build or a CPU that computes wrong numbers never answers a request.

Why: llama.cpp picks its CPU kernels by instruction set, and an answer that is right on one machine proves
nothing on another (docs/MODEL.md, "Right on every CPU").  Two checks, both sans I/O here (the handler runs
llama.cpp and hands the logits in):

* **A known reference** (``known_answers.json``, keyed by the GGUF's SHA-256): token ids, and at each checked
  position the exact forward pass's top tokens and logits (:mod:`edgepath.model.reference`, float64 numpy
  over the dequantized weights: no llama.cpp kernel involved).  llama.cpp must give each of those logits
  within the entry's tolerance, and the same best token wherever the reference's margin is wider than twice
  the tolerance.
* **Self-consistency**, for any other GGUF: a probe text decoded in one step and split over two steps must
  give the same best tokens and close logits, and a greedy continuation must not collapse into one token.
  Weaker (a kernel wrong the same way in every step passes it), and said so in the log.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

#: how llama-cpp-python (Makefile) and the benchmark's llama-server (edgepath.bench.llama_server) are built
LLAMA_CMAKE_ARGS = "-DGGML_LLAMAFILE=OFF"
#: the text the self-consistency check decodes (plain English any general model has seen)
PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Water boils at one hundred degrees Celsius at sea level, "
    "and the capital of France is"
)
#: greedy tokens generated after the probe text; fewer distinct ones than DEGENERATE_DISTINCT is a collapse
CONTINUATION = 24
DEGENERATE_DISTINCT = 3
#: one step vs two: how far apart the logits of the same position may be (llama.cpp's own batched kernels
#: round differently from its single-row ones: up to 1.25 measured on an AVX2 build with LLAMAFILE on)
SPLIT_TOLERANCE = 2.5
#: the share of positions whose best token one step and two must agree on
SPLIT_AGREEMENT = 0.9


@dataclass(frozen=True)
class KnownAnswer:
    """What one GGUF must compute: ``ids`` decoded from an empty context, and at ``positions[i]`` the
    reference logits ``logits[i]`` of tokens ``top[i]`` (best first)."""

    model: str
    sha256: str
    ids: tuple[int, ...]
    positions: tuple[int, ...]
    top: tuple[tuple[int, ...], ...]
    logits: tuple[tuple[float, ...], ...]
    tolerance: float
    source: str

    @classmethod
    def from_json(cls, entry: dict) -> KnownAnswer:
        return cls(
            model=entry["model"],
            sha256=entry["sha256"],
            ids=tuple(entry["ids"]),
            positions=tuple(entry["positions"]),
            top=tuple(tuple(row) for row in entry["top"]),
            logits=tuple(tuple(row) for row in entry["logits"]),
            tolerance=float(entry["tolerance"]),
            source=entry["source"],
        )

    def to_json(self) -> dict:
        return {
            "model": self.model,
            "sha256": self.sha256,
            "ids": list(self.ids),
            "positions": list(self.positions),
            "top": [list(row) for row in self.top],
            "logits": [list(row) for row in self.logits],
            "tolerance": self.tolerance,
            "source": self.source,
        }


def shipped() -> dict[str, KnownAnswer]:
    """The references in the package (``known_answers.json``), by the SHA-256 of their GGUF."""
    return parse(resources.files("edgepath.model").joinpath("known_answers.json").read_text())


def load(path: Path) -> dict[str, KnownAnswer]:
    """The references in a file ``python -m edgepath.model.reference --out`` wrote, by SHA-256."""
    return parse(path.read_text())


def parse(text: str) -> dict[str, KnownAnswer]:
    return {entry["sha256"]: KnownAnswer.from_json(entry) for entry in json.loads(text)}


def compare(reference: KnownAnswer, rows: np.ndarray) -> tuple[float, list[str]]:
    """The largest error of a checked logit in ``rows`` (llama.cpp's logits at ``reference.positions``, one row
    each), and what is wrong: nothing when every checked logit is within the tolerance and every clear best
    token is the reference's."""
    problems = []
    tol = reference.tolerance
    worst = (0.0, 0, 0)
    for row, position, top, expected in zip(rows, reference.positions, reference.top, reference.logits, strict=True):
        got = row[list(top)]
        error = np.abs(got - np.asarray(expected))
        at = int(error.argmax())
        if error[at] > worst[0]:
            worst = (float(error[at]), position, at)
        margin = expected[0] - expected[1]
        best = int(row.argmax())
        if margin > 2 * tol and best != top[0]:
            problems.append(
                f"at position {position} the best token is {best}, the reference's is {top[0]} "
                f"(by a margin of {margin:.2f})"
            )
    error, position, at = worst
    if error > tol:
        index = reference.positions.index(position)
        token = reference.top[index][at]
        got = float(rows[index][token])
        problems.insert(
            0,
            f"token {token}'s logit at position {position} is {got:.3f}, the reference's "
            f"{reference.logits[index][at]:.3f} (off by {error:.3f}, tolerance {tol:g})",
        )
    return error, problems


def consistent(one_step: np.ndarray, split: np.ndarray) -> list[str]:
    """The probe's logits decoded in one step vs over two steps (same positions, one row each)."""
    problems = []
    error = float(np.abs(one_step - split).max())
    if error > SPLIT_TOLERANCE:
        problems.append(f"the same positions decoded in one step and in two differ by {error:.2f} in a logit")
    agreement = float(np.mean(one_step.argmax(axis=1) == split.argmax(axis=1)))
    if agreement < SPLIT_AGREEMENT:
        problems.append(f"one step and two agree on the best token at {agreement:.0%} of the positions")
    return problems


def degenerate(tokens: list[int]) -> list[str]:
    """A greedy continuation that is one or two tokens over and over (a model computing noise or nothing)."""
    if len(tokens) >= CONTINUATION and len(set(tokens)) < DEGENERATE_DISTINCT:
        return [f"a greedy continuation of {len(tokens)} tokens uses only {sorted(set(tokens))}"]
    return []


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name, for the one line that says where a check failed."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def build_problems(system_info: str) -> list[str]:
    """What in llama.cpp's build (``llama_print_system_info()``) breaks edgepath's promises about numbers:
    llamafile's batched kernels round differently from the single-row ones, so a logit would depend on how
    many tokens its step carried -- a prompt split over steps, a reused prefix or a migrated stream would not
    give the same answer (docs/MODEL.md)."""
    if "LLAMAFILE = 1" in system_info:
        return [
            "llama.cpp was built with LLAMAFILE: its results depend on how steps are batched; rebuild "
            f"llama-cpp-python with CMAKE_ARGS='{LLAMA_CMAKE_ARGS}' (pip install --no-cache-dir --force-reinstall "
            "--no-deps llama-cpp-python==<version>)"
        ]
    return []


def main() -> int:
    """Print the CPU and llama.cpp's build (CI's first lines); exit 1 when the build breaks a promise."""
    from edgepath.model.gguf import llama_cpp

    lib = llama_cpp()
    info = lib.llama_print_system_info().decode().strip()
    print(f"CPU: {cpu_name()}")
    print(f"llama-cpp-python {getattr(lib, '__version__', '?')}, llama.cpp system info: {info}")
    problems = build_problems(info)
    for problem in problems:
        print(f"error: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
