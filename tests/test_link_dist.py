"""scripts/link_dist.py, as `make gpu-image` uses it: a distribution of this environment linked into a
fresh venv, where that venv's own Python imports it and runs its console script."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "link_dist.py"


def link(target: Path, requirement: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), sys.executable, str(target), requirement],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_a_distribution_is_linked_with_its_console_script_and_a_wrong_version_links_nothing(tmp_path):
    venv.create(tmp_path / "v", with_pip=False)
    target = tmp_path / "v" / "bin" / "python"
    version = importlib.metadata.version("tqdm")  # pure Python, a console script, no requirement on Linux
    wrong = link(target, "tqdm==0.0.1")
    assert wrong.returncode == 1 and "not linking" in wrong.stderr
    assert not list((tmp_path / "v").glob("lib/python*/site-packages/tqdm*"))
    done = link(target, f"tqdm=={version}")
    assert done.returncode == 0 and f"tqdm {version}" in done.stdout, done.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([str(target), "-c", "import tqdm; print(tqdm.__version__, tqdm.__file__)"],
                         capture_output=True, text=True, check=True, env=env, cwd="/")  # fmt: skip
    got_version, where = out.stdout.split()
    assert got_version == version and where.startswith(str(tmp_path / "v"))
    source = Path(importlib.metadata.distribution("tqdm").locate_file("tqdm/__init__.py"))
    assert os.path.samefile(where, source)  # a hard link, not a copy
    script = tmp_path / "v" / "bin" / "tqdm"
    assert script.read_text().splitlines()[0] == f"#!{target}"
    assert subprocess.run([str(script), "--version"], capture_output=True, text=True, env=env).stdout.strip() == version


def test_a_source_without_packaging_links_with_pip_s_own_copy(tmp_path):
    """make runs link_dist beside the pip install that brings `packaging` into .venv: its probe then
    reads requirements with pip's vendored copy, and the link still happens."""
    venv.create(tmp_path / "src", with_pip=True)
    source = tmp_path / "src" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_REQUIRE_VIRTUALENV")}
    probe = "import importlib.util as u, importlib.metadata as m; print(u.find_spec('packaging') is None, m.version('pip'))"
    lacks, pip_version = subprocess.run([str(source), "-c", probe], capture_output=True, text=True, check=True,
                                        env=env, cwd="/").stdout.split()  # fmt: skip
    assert lacks == "True"
    venv.create(tmp_path / "dst", with_pip=False)
    target = tmp_path / "dst" / "bin" / "python"
    done = subprocess.run([sys.executable, str(SCRIPT), str(source), str(target), f"pip=={pip_version}"],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0 and f"pip {pip_version}" in done.stdout, done.stderr
    assert list((tmp_path / "dst").glob(f"lib/python*/site-packages/pip-{pip_version}.dist-info"))
