"""The ``system_fingerprint`` of the OpenAI routes' answers: which model and build answered.

A seed gives the same answer again only from the same weights computed the same way, so the fingerprint is a
digest of what decides that: the model file's SHA-256, llama.cpp's build (llama-cpp-python's version and
``llama_print_system_info``: the CPU features and kernels it was compiled with), the handler's options (threads,
flash attention, deterministic=on, ... -- the model file's path left out: its digest stands for it) and edgepath's
version.  It is the same across restarts of one build serving one file, and differs when any of them changes --
what OpenAI's field promises: a client that sees it change knows a seeded answer may too.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from edgepath.model.convert import sha256
from edgepath.model.gguf import llama_cpp


def system_fingerprint(model: Path, options: Iterable[tuple[str, str]]) -> str:
    """``fp_`` and 12 hex digits of the digest of ``model``'s SHA-256, the llama.cpp build this process loads, the
    handler ``options`` and edgepath's version (reads the whole model file once: about a second per GB)."""
    parts = [
        f"edgepath {_version('edgepath')}",
        f"llama-cpp-python {_version('llama-cpp-python')}",
        llama_cpp().llama_print_system_info().decode(errors="replace").strip(),
        f"model {sha256(model)}",
        *sorted(f"{key}={value}" for key, value in options if key != "model"),
    ]
    return "fp_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"
