"""Packaging the Python way: a wheel built by the build backend (not by ``make``) carries the cffi
extensions and gives a working ``edgepath`` command once installed, away from the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from edgepath.native.build import verbs_headers_missing

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _fresh_checkout(dest: Path) -> Path:
    """The repository's files as a fresh clone has them: no extension built in place, no build/."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def test_a_built_wheel_installs_a_working_edgepath_outside_the_source_tree(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    source = _fresh_checkout(tmp_path / "source")
    assert not list(source.glob("native/*.so"))
    wheels = tmp_path / "wheels"
    # The backend builds the wheel in its own isolated environment (pyproject's build-system.requires).
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), str(source)], tmp_path, env)
    (wheel,) = wheels.glob("edgepath-*.whl")

    target = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(target)
    python = target / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", str(wheel)], tmp_path, env)
    # The runtime dependencies are this environment's (installed from the index by `make`): the new
    # venv sees them through a .pth line, which adds the folder without running its .pth files, so
    # this environment's editable edgepath stays invisible there.
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env)
    Path(purelib.stdout.strip(), "edgepath-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    probe = (
        "import importlib.util, edgepath, edgepath.native.abi as abi\n"
        "print(edgepath.__file__)\n"
        "print(abi.lib.EP_OK)\n"
        "print(importlib.util.find_spec('edgepath.native._verbs') is not None)\n"
    )
    where, ok, has_verbs = _run([str(python), "-c", probe], outside, env).stdout.split()
    assert Path(where).is_relative_to(target), f"imported {where}, not the installed wheel"
    assert ok == "0"
    assert has_verbs == str(not verbs_headers_missing())  # built wherever rdma-core's headers are

    helped = _run([str(target / "bin" / "edgepath"), "--help"], outside, env)
    assert "usage: edgepath" in helped.stdout and "serve" in helped.stdout
