"""The benchmark scripts imported as they run: with their folder, benchmarks/, on sys.path."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def bench_script(monkeypatch) -> Callable[[str], ModuleType]:
    """`bench_script("cpu_paths")` is benchmarks/cpu_paths.py as a module."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module
