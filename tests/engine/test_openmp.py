"""GOMP_SPINCOUNT for cbserve's processes (engine/openmp.py): set before torch loads libgomp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.openmp import SPIN_COUNT, SPIN_ENV, set_spin_default

ROOT = Path(__file__).resolve().parents[2]

# what a `cbserve` process sees: main() runs (here as far as --help), then torch is imported
PROBE = """
import os, sys
from engine.cli import main
try:
    main(["serve", "--help"])
except SystemExit:
    pass
loaded_before = "torch" in sys.modules
import torch  # libgomp reads GOMP_SPINCOUNT now
print(loaded_before, os.environ.get("GOMP_SPINCOUNT"))
"""


def _probe(env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if k != SPIN_ENV}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)  # fmt: skip
    return out.stdout.strip().splitlines()[-1]


def test_the_cbserve_entry_point_sets_the_spin_count_before_torch_loads() -> None:
    assert _probe({}) == f"False {SPIN_COUNT}"


def test_a_spin_count_in_the_environment_is_kept() -> None:
    assert _probe({SPIN_ENV: "300000"}) == "False 300000"


def test_once_torch_is_loaded_nothing_is_changed() -> None:
    environ: dict[str, str] = {}
    assert "torch" in sys.modules  # this test process imported it
    assert set_spin_default(environ) is None and environ == {}


def test_before_torch_the_default_goes_into_the_environment_given() -> None:
    out = subprocess.run([sys.executable, "-c", "import sys; from engine.openmp import set_spin_default; e = {}; "
                          "print(set_spin_default(e), e, 'torch' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert out.stdout.strip() == f"{SPIN_COUNT} {{'{SPIN_ENV}': '{SPIN_COUNT}'}} False"
