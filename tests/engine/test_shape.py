"""The engine's reading order: the core asks no device anything, and no module lives only for its tests."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ["request", "scheduler", "block_manager", "llm_engine", "output_processor"]
PRODUCT = ["engine", "operator", "loadtest", "scripts", "benchmarks", "examples"]  # what is not a test


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_nothing_device_specific(name) -> None:
    found = imports(ROOT / "engine" / f"{name}.py")
    device = sorted(m for m in found if m.startswith("engine.backends.") and not m.startswith("engine.backends.executors"))
    assert device == [], f"engine/{name}.py reaches past the executor boundary: {device}"


@pytest.mark.parametrize("name", CORE)
def test_no_core_module_mentions_cuda(name) -> None:
    text = (ROOT / "engine" / f"{name}.py").read_text()
    assert not re.search("cuda", text, re.IGNORECASE), f"engine/{name}.py mentions CUDA"


def test_every_engine_module_is_used_by_the_product() -> None:
    used: set[str] = set()
    for top in PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            if ".venv" not in path.parts:
                used |= imports(path)
    scripts = (ROOT / "pyproject.toml").read_text()
    lonely = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name in ("__init__.py", "__main__.py") or module in scripts:
            continue
        if 'if __name__ == "__main__":' in path.read_text():  # a command of its own (python -m ...)
            continue
        if not any(u == module or u.startswith(module + ".") for u in used):
            lonely.append(module)
    assert lonely == [], f"imported only by tests (or by nothing): {lonely}"


def test_building_an_engine_on_the_cpu_loads_no_gpu_module() -> None:
    code = ("import sys; from engine import ContinuousBatchingConfig, LLMEngine; from engine.testing import build_test_model; "
            "LLMEngine(build_test_model('llama'), ContinuousBatchingConfig(block_size=16, num_blocks=8)); "
            "print(sorted(m for m in sys.modules if m.startswith('engine.backends.cuda') or m == 'flash_attn'))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
