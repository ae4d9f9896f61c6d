"""The README and docs/ hold together: every performance block a benchmark command rewrites is on the page the
commands are told to rewrite (so `make bench` and `--doc docs/PERFORMANCE.md` find it), none is left in the
README, the README stays short, and every relative link of the README and docs/ names a file that exists.

And the map keeps itself true: every product module is named in the README's layout table (or on the one page
its row points to), the ABI version the pages state is the header's, every repository path a page names exists,
and the option tables are written from the options' declarations."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
#: the blocks and who writes them: bench/ingress.py, bench/edge_cpu.py, bench/stream.py, bench/model_report.py,
#: bench/hostile.py, bench/refusals.py, bench/report.py (`make bench`)
BLOCKS = ("ingress", "edge-cpu", "stream", "model", "hostile", "refusals", "datapath")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("name", BLOCKS)
def test_every_performance_block_is_on_the_performance_page_once(name: str) -> None:
    text = PERFORMANCE.read_text()
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1 and text.index(begin) < text.index(end)
    assert "bench:" not in (ROOT / "README.md").read_text().replace("`edgepath bench", "")


def test_the_makefile_rewrites_the_performance_page() -> None:
    assert "--doc docs/PERFORMANCE.md" in (ROOT / "Makefile").read_text()


def test_the_readme_stays_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_name_files_that_exist(page: Path) -> None:
    missing = [
        target
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


# -- the map keeps itself true ------------------------------------------------------------------------------------
#: the product's folders (pyproject's package-dir), each a row of the README's layout table
PRODUCT_FOLDERS = ("options", "native", "transports", "contract", "slots", "dpu", "model", "edge", "edgepath")
TOP = r"(?:\.ci|bench|contract|deploy|docs|dpu|edge|edgepath|model|native|options|scripts|slots|tests|transports)"


def _layout_rows() -> dict[str, str]:
    """The README's layout table: folder (``native``, ...) -> its row's text."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") :]
    rows = {}
    for line in section.splitlines():
        found = re.match(r"\| `([\w.]+)/?` \|", line)
        if found:
            rows[found.group(1)] = line
    return rows


def _named(text: str) -> set[str]:
    """What a text names: anything in backticks (file names, paths, folders) and any ``*.py`` path (a code block's
    too)."""
    return set(re.findall(r"`([^`\s]+)`", text)) | set(re.findall(r"(?<![\w./-])([\w./-]+\.py)\b", text))


@pytest.mark.parametrize("folder", PRODUCT_FOLDERS)
def test_every_product_module_is_on_the_map(folder: str) -> None:
    """Each module of the package is named in its row of the README's layout table, or on the one docs page the row
    points to for it: as ``name.py`` (when no other module of the package has that name), ``sub/name.py`` or
    ``folder/sub/name.py``; a sub-package as ``sub/``.  And every ``name.py`` the row names is one of the
    package's modules (or a path from the repository's root)."""
    rows = _layout_rows()
    assert folder in rows, f"the README's layout table has no row for {folder}/"
    row = rows[folder]
    pages = sorted(set(re.findall(r"\]\((docs/[\w.-]+\.md)[^)]*\)", row)))
    assert len(pages) <= 1, f"the {folder}/ row points to several pages for its files: {pages}"
    named = _named(row) | (_named((ROOT / pages[0]).read_text()) if pages else set())
    modules = sorted(p.relative_to(ROOT / folder) for p in (ROOT / folder).rglob("*.py"))
    basenames = [m.name for m in modules]
    missing = []
    for module in modules:
        if module == Path("__init__.py"):
            continue
        if module.name == "__init__.py":
            forms = {f"{module.parent}/", f"{folder}/{module.parent}/"}
        else:
            forms = {str(module), f"{folder}/{module}"}
            if basenames.count(module.name) == 1:
                forms.add(module.name)
        if not forms & named:
            missing.append(f"{folder}/{module}")
    assert not missing, f"not on the map (README's layout row for {folder}/, or {pages or 'no page'}): {missing}"
    stale = sorted(
        n
        for n in _named(row)
        if n.endswith(".py") and not any(str(m).endswith(n) for m in modules) and not (ROOT / n).exists()
    )
    assert not stale, f"the README's {folder}/ row names modules that are not there: {stale}"


def test_the_abi_version_the_docs_state_is_the_header_s() -> None:
    """Wherever a page states the slot ABI's version (``edgepath_slot.h`` ... version N), it is EP_ABI_VERSION;
    and no page tags a feature with a later ABI than the header's."""
    header = (ROOT / "native" / "edgepath_slot.h").read_text()
    version = int(re.search(r"#define EP_ABI_VERSION (\d+)", header).group(1))  # type: ignore[union-attr]
    stated = {}
    for page in PAGES:
        text = page.read_text()
        for found in re.finditer(r"edgepath_slot\.h`?[^.]{0,80}?\bversion (\d+)", text, re.S):
            stated[f"{page.relative_to(ROOT)}: {found.group(0)!r}"] = int(found.group(1))
        for found in re.finditer(r"\bABI (?:version )?(\d+)\b", text):
            assert int(found.group(1)) <= version, f"{page.relative_to(ROOT)} tags ABI {found.group(1)} > {version}"
    assert any(where.startswith("README.md") for where in stated), "the README no longer states the ABI's version"
    wrong = {where: v for where, v in stated.items() if v != version}
    assert not wrong, f"pages state another ABI version than native/edgepath_slot.h's {version}: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_a_page_names_exists(page: Path) -> None:
    """A path from the repository's root (``edge/http.py``, ``tests/x.py::test_y``, ``deploy/``), in backticks or
    as a file name in the text, names something that is there (a glob or a build output is not such a path)."""
    text = page.read_text()
    files = re.findall(
        r"(?<![\w/.$~-])(" + TOP + r"/[\w./-]*\.(?:py|md|h|c|cu|toml|json|ya?ml|sh|txt|png))(?![\w/])", text
    )
    ticked = re.findall(r"`(" + TOP + r"/[\w./-]*)(?:::[\w\[\]-]+)?(?::\d+)?`", text)
    missing = sorted({path for path in [*files, *ticked] if not (ROOT / path).exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_option_tables_are_written_from_the_declarations() -> None:
    """docs/API.md's and docs/MODEL.md's option tables are what scripts/option-tables writes from the options'
    declarations (edgepath.options); a stale one names the command that rewrites it."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "option-tables"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
