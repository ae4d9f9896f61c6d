"""Imports run one way: options <- native <- transports <- contract <- {dpu, slots <- model} <- edge <- the app layer
<- bench.

Read from the source (every ``import`` statement, at module level or inside a function, ``TYPE_CHECKING``
included: a lazy import is still a dependency).  The transports move bytes and know no slot; the contract
(the slot ABI's words and headers, the pool views) is written in the transports' terms (regions and their
access); the agent side (``dpu``) and the slot server (``slots``) each build on the contract and never on
each other.  ``model`` is the slot server's handler side: it implements the handler API of ``slots`` and
imports nothing above it.  ``options`` (how every option is declared, on the field it fills: a command line's
flags, a handler's ``KEY=VALUE``) is below them all and imports none of them, so each layer declares its options
the one way.  The app layer (``edgepath/``: cli, config, builder, serve, demo, supervision,
registries) is the only place that wires components.  ``bench/`` holds the benchmarks, a distribution of
their own (``edgepath-bench``, which adds ``edgepath bench`` through an entry point): it may use the whole
product, and the product never imports it, nor does its wheel carry it.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: folder -> the import package it is (pyproject's package-dir) and the layer it belongs to
PACKAGES = {
    "options": ("edgepath.options", "options"),
    "native": ("edgepath.native", "native"),
    "transports": ("edgepath.transports", "transports"),
    "contract": ("edgepath.contract", "contract"),
    "slots": ("edgepath.slots", "slots"),
    "dpu": ("edgepath.dpu", "dpu"),
    "model": ("edgepath.model", "model"),
    "edge": ("edgepath.edge", "edge"),
    "edgepath": ("edgepath", "app"),
    "bench": ("edgepath.bench", "bench"),
}
#: the layers the product's wheel is made of: every one but the benchmarks
PRODUCT = {"options", "native", "transports", "contract", "slots", "dpu", "model", "edge", "app"}

#: layer -> the layers it may import (its own always)
ALLOWED = {
    "options": set(),
    "native": {"options"},
    "transports": {"native", "options"},
    "contract": {"transports", "native", "options"},
    "slots": {"contract", "transports", "native", "options"},
    "dpu": {"contract", "transports", "native", "options"},
    "model": {"slots", "contract", "transports", "native", "options"},
    "edge": {
        "dpu",
        "model",
        "contract",
        "native",
        "options",
    },  # model: the GGUF reader behind the model's own tokenizer
    "app": {"edge", "dpu", "model", "slots", "contract", "transports", "native", "options"},
    "bench": {"app", "edge", "dpu", "model", "slots", "contract", "transports", "native", "options"},
}


#: the rooms of ``edge/`` and the rooms each may import (its own always).  The text a model reads and writes
#: (``text/``: tokenizers, chat templates, detokenizing, stop strings) and who a request is (``tenancy/``: keys,
#: tenants, quotas, usage, the tenant gate) stand on nothing else of the edge; the HTTP vocabulary (``core``:
#: requests, responses, work, errors, refusals, body limits) knows tenants; the API shapes (``apis/``) build on
#: those; the engine (router, lifecycle, driver, n choices, ops pages, measurements, metrics) runs the shapes; the
#: adapters (``adapters/``: QUIC, HTTP/1.1, TLS) feed the engine's driver and know no shape; the client
#: (``edgepath request``, the load generators) stands alone.
EDGE_ROOMS = {
    "text": set(),
    "tenancy": set(),
    "core": {"tenancy"},
    "apis": {"core", "tenancy", "text"},
    "engine": {"core", "apis", "tenancy", "text"},
    "adapters": {"core", "engine"},
    "client": set(),
}
#: the rooms that are folders; the modules at edge/'s top are the core's, the client's or the engine's
EDGE_FOLDERS = ("adapters", "apis", "tenancy", "text")
EDGE_TOP = {
    "http": "core",
    "actions": "core",
    "refusals": "core",
    "body": "core",
    "client": "client",
    "retry": "client",
}


def _room_of(module: str) -> str | None:
    """The room of ``edge/`` a module belongs to (None: outside edge/, or edge/'s own package)."""
    if not module.startswith("edgepath.edge."):
        return None
    first = module.split(".")[2]
    return first if first in EDGE_FOLDERS else EDGE_TOP.get(first, "engine")


def _layer_of(module: str) -> str | None:
    """The layer of an absolute module name inside edgepath (None: outside edgepath)."""
    if module != "edgepath" and not module.startswith("edgepath."):
        return None
    best = max((pkg for pkg, _ in PACKAGES.values() if module == pkg or module.startswith(pkg + ".")), key=len)
    return next(layer for pkg, layer in PACKAGES.values() if pkg == best)


def _imports(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved against ``package``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.append((node.lineno, module))
    return out


def _cross_layer_imports() -> dict[tuple[str, str], list[str]]:
    """(from layer, to layer) -> 'file:line module' for every import between two layers."""
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for folder, (package, layer) in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            subpackage = ".".join([package, *rel.parts[1:-1]])
            for line, module in _imports(path, subpackage):
                target = _layer_of(module)
                if target is not None and target != layer:
                    found[(layer, target)].append(f"{rel}:{line} {module}")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's first appearance in a depth-first walk (enough to say there is one)."""
    cycles, stack, done = [], [], set()

    def visit(node: str) -> None:
        if node in stack:
            cycles.append([*stack[stack.index(node) :], node])
            return
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    return cycles


def test_no_package_level_import_cycle() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for src, dst in _cross_layer_imports():
        graph[src].add(dst)
    assert _cycles(graph) == [], f"package-level import cycles: {_cycles(graph)}"


def test_every_import_runs_down_the_layers() -> None:
    wrong = [
        where
        for (src, dst), found in sorted(_cross_layer_imports().items())
        if dst not in ALLOWED[src]
        for where in found
    ]
    assert wrong == [], "imports against the layering (" + ", ".join(f"{k}<-{v}" for k, v in ALLOWED.items()) + ")"


def test_edge_rooms_import_only_the_rooms_below_them() -> None:
    """Every room of edge/ is a folder or named in EDGE_TOP, and its imports within edge/ follow EDGE_ROOMS."""
    wrong, unplaced = [], []
    for path in sorted((ROOT / "edge").rglob("*.py")):
        rel = path.relative_to(ROOT)
        if len(rel.parts) > 2 and rel.parts[1] not in EDGE_FOLDERS:
            unplaced.append(str(rel))
        module = ".".join(["edgepath", *rel.with_suffix("").parts])
        room = _room_of(module)
        if room is None:
            continue
        package = ".".join(["edgepath", *rel.parts[:-1]])
        for line, target in _imports(path, package):
            other = _room_of(target)
            if other is not None and other != room and other not in EDGE_ROOMS[room]:
                wrong.append(f"{rel}:{line} ({room}) imports {target} ({other})")
    assert unplaced == [], f"folders of edge/ not in EDGE_FOLDERS: {unplaced}"
    assert wrong == [], "imports against edge/'s rooms: " + "; ".join(wrong)


def test_nothing_below_the_app_layer_imports_it() -> None:
    upward = [
        where
        for (src, dst), found in _cross_layer_imports().items()
        if dst == "app" and src not in ("app", "bench")
        for where in found
    ]
    assert upward == []


def test_the_product_never_imports_the_benchmarks() -> None:
    into_bench = [
        where
        for (src, dst), found in _cross_layer_imports().items()
        if dst == "bench" and src in PRODUCT
        for where in found
    ]
    assert into_bench == []


def test_the_product_wheel_does_not_carry_the_benchmarks() -> None:
    """The product's packages are every folder but bench/, which is packaged on its own and adds its command
    through the entry point the command line reads."""
    product = tomllib.loads((ROOT / "pyproject.toml").read_text())
    bench = tomllib.loads((ROOT / "bench" / "pyproject.toml").read_text())
    packages = {PACKAGES[f][0] for f in PACKAGES if f != "bench"} | {
        ".".join((PACKAGES[f][0], *init.parent.relative_to(ROOT / f).parts))
        for f in PACKAGES
        if f != "bench"
        for init in (ROOT / f).rglob("__init__.py")
        if init.parent != ROOT / f
    }  # and each sub-package: the edge's rooms, the wire contract's package
    assert set(product["tool"]["setuptools"]["packages"]) == packages
    assert "bench" not in product["tool"]["setuptools"]["package-dir"].values()
    assert product["project"]["optional-dependencies"].keys().isdisjoint({"bench"})
    assert bench["tool"]["setuptools"]["packages"] == ["edgepath.bench"]
    assert bench["project"]["entry-points"]["edgepath.commands"] == {"bench": "edgepath.bench.cli:add_command"}


def test_the_scan_sees_imports_of_every_kind(tmp_path: Path) -> None:
    """The scan itself: module-level, lazy, TYPE_CHECKING and relative imports are all found."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import edgepath.contract.wire\n"
        "from .tokenizer import Tokenizer\n"
        "from ..config import DataPath\n"
        "if TYPE_CHECKING:\n    from edgepath.dpu.agent import Agent\n"
        "def f():\n    from edgepath.builder import build_agent\n"
    )
    found = [module for _, module in _imports(source, "edgepath.edge")]
    assert found == [
        "typing",
        "edgepath.contract.wire",
        "edgepath.edge.tokenizer",
        "edgepath.config",
        "edgepath.dpu.agent",
        "edgepath.builder",
    ]
    assert [_layer_of(m) for m in found] == [None, "contract", "edge", "app", "dpu", "app"]
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]
