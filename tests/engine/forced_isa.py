"""Python code run in a child process whose CPU probe is forced (CBSERVE_CPU_ISA): how the tests
prove the AVX2 side of every probe on an AVX-512 host."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_with_isa(code: str, isa: str = "avx2", timeout: float = 900) -> str:
    """The child's stdout; its stderr's tail in the failure when it exits other than 0."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout, env={**os.environ, "CBSERVE_CPU_ISA": isa})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
