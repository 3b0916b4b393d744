"""The built wheel carries everything the CPU kernels' build reads.

engine/backends/cpu_kernels.py compiles engine/csrc/ on first use from the installed package, so a
non-editable install (`pip install .`, the Docker image) needs every source and header in the wheel;
without one the build fails and the engine quietly keeps its slower torch paths.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from engine.backends import cpu_kernels

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(out: Path) -> Path:
    """pyproject's wheel, built offline from a copy of the packaged folders (the worktree stays clean)."""
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("engine", "loadtest", "operator/cbserve_operator"):
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
         "--wheel-dir", str(out / "dist"), str(src)],
        check=True, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    (wheel,) = (out / "dist").glob("cbserve-*.whl")
    return wheel


def test_the_wheel_holds_every_file_the_cpu_kernel_build_reads(tmp_path):
    needed = [p.relative_to(ROOT).as_posix() for p in cpu_kernels.SOURCES + cpu_kernels.HEADERS]
    assert "engine/csrc/vec.h" in needed and any(n.endswith(".cpp") for n in needed)
    names = set(zipfile.ZipFile(build_wheel(tmp_path)).namelist())
    missing = [n for n in needed if n not in names]
    assert not missing, f"the wheel lacks {missing}: add them to [tool.setuptools.package-data]"
    # and nothing in engine/csrc is left out that the kernel list does not know about
    csrc = {p.relative_to(ROOT).as_posix() for p in cpu_kernels.CSRC.iterdir() if p.is_file()}
    assert csrc == set(needed), "engine/csrc and cpu_kernels' SOURCES + HEADERS disagree"


def test_package_data_names_the_csrc_file_kinds():
    """The glob patterns in pyproject cover every suffix in engine/csrc (a new .hpp needs a pattern)."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["engine"]
    suffixes = {p.suffix for p in cpu_kernels.CSRC.iterdir() if p.is_file()}
    assert {f"csrc/*{s}" for s in suffixes} <= set(data), data
