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
#: llama.cpp's CMake flags for edgepath's llama-cpp-python (the Makefile's LLAMA_CMAKE_ARGS): llamafile's batched
#: kernels on, as llama.cpp's own cmake defaults build llama-server (llama-cpp-python's build turns them off unless
#: asked); and those of the deterministic=on build (DETERMINISTIC_CMAKE_ARGS: without llamafile's batched kernels,
#: a logit does not depend on how its step was batched)
LLAMA_CMAKE_ARGS = "-DGGML_LLAMAFILE=ON"
DETERMINISTIC_CMAKE_ARGS = "-DGGML_LLAMAFILE=OFF"
#: what a logit may differ by with how its step was batched on the default build with flash attention off (llamafile's
#: batched kernels against ggml's single-row ones, a prompt's last token computed alone or with the rest; by more the
#: more positions it attends: largest seen 0.010 at 29 positions, 0.050 at 506, SmolLM2 F16 on an AMD EPYC with
#: AVX-512; twice that); 0 with deterministic=on (docs/MODEL.md, "Exactness")
BATCH_TOLERANCE = 0.1
#: the same with llama.cpp's CPU flash attention on (flash_attn=auto, the default, as llama-server runs it): its kernel
#: accumulates a micro-batch of one query row and a tiled one differently, by more the more positions a token
#: attends (largest seen 0.034 at 60 positions, 0.11 at 430, 0.20 at 830: SmolLM2 F16 on the same machine,
#: 2026-12-06; twice that)
FLASH_TOLERANCE = 0.4


def batch_tolerance(flash_attn: str) -> float:
    """What a logit may differ by with how its step was batched, on the default build with ``flash_attn``."""
    return BATCH_TOLERANCE if flash_attn == "off" else FLASH_TOLERANCE


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


def batch_invariant(system_info: str) -> bool:
    """Whether llama.cpp's build (``llama_print_system_info()``) gives a token the same logits however its step
    was batched: not with llamafile's batched kernels, which round differently from the single-row ones (a
    prompt split over steps, a reused prefix or a migrated stream then differ in the last bits: docs/MODEL.md)."""
    return "LLAMAFILE = 1" not in system_info


def main() -> int:
    """Print the CPU and llama.cpp's build (CI's first lines), and whether its logits depend on batching."""
    from edgepath.model.gguf import llama_cpp

    lib = llama_cpp()
    info = lib.llama_print_system_info().decode().strip()
    print(f"CPU: {cpu_name()}")
    print(f"llama-cpp-python {getattr(lib, '__version__', '?')}, llama.cpp system info: {info}")
    if batch_invariant(info):
        print("logits: the same however a step is batched (no llamafile: the deterministic=on build)")
    else:
        print("logits: a token's may differ in the last bits with how its step is batched (llamafile's kernels)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
