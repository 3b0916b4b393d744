"""benchmarks/sampler.py: its table times every case with and without the kernels' race."""

from __future__ import annotations

import subprocess
import sys

from tests.benchmarks.conftest import BENCHMARKS


def test_the_table_has_every_case_for_the_engines_sampler_and_torchs() -> None:
    out = subprocess.run([sys.executable, str(BENCHMARKS / "sampler.py"), "--vocab", "600", "--rows", "1,3", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout  # fmt: skip
    lines = out.splitlines()
    assert lines[1] == "| case | 1 rows, engine | 1 rows, torch | 3 rows, engine | 3 rows, torch |"
    rows = [line for line in lines[3:] if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["greedy", "temperature 1", "temperature 1, top-k 50",
                                                    "temperature 1, logprobs 5", "temperature 0.8, seeded",
                                                    "top-p 0.9, flat logits",
                                                    "top-p 0.9, peaked logits"]  # fmt: skip
    assert all(len(r.strip("| ").split(" | ")) == 5 and float(r.split(" | ")[-1].strip(" |")) >= 0 for r in rows)
