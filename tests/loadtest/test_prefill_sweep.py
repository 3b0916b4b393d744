"""benchmarks/prefill_sweep.py: its values, the server command per value (a real `cbserve serve` command line,
parsed by the CLI), and the table it writes from a compare report (nothing served)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from engine.cli import build_parser
from loadtest.target import UsageError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_sweep.py"


@pytest.fixture
def sweep(monkeypatch):
    spec = importlib.util.spec_from_file_location("prefill_sweep", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "prefill_sweep", module)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ on it
    spec.loader.exec_module(module)
    return module


def test_values(sweep) -> None:
    assert sweep.parse_values("off,8,4,2,1.5") == [0.0, 8.0, 4.0, 2.0, 1.5]
    for bad in ("4,4", "-1", "fast", "off,0"):
        with pytest.raises(UsageError):
            sweep.parse_values(bad)


def test_each_value_is_a_cbserve_serve_with_that_setting(sweep) -> None:
    targets = sweep.targets([0.0, 1.5])
    assert [t.name for t in targets] == ["stall-off", "stall-1.5"]
    for target, value in zip(targets, (0.0, 1.5)):
        i = target.command.index("serve")
        args = build_parser().parse_args(target.command[i:])
        assert (args.max_decode_stall, args.dtype) == (value, "float32")
        assert target.url.endswith(f":{args.port}")


def test_the_table(sweep) -> None:
    row = {"rounds_output_throughput": [150.0, 160.0], "output_throughput": 155.0, "p50_itl_ms": 65.2,
           "p99_itl_ms": 1234.5, "p50_ttft_ms": 1900.0, "p99_ttft_ms": 4100.0, "completed": 300, "failed": 0}
    table = sweep.sweep_table({"targets": {"stall-off": row, "stall-4": {**row, "p99_itl_ms": 210.0}}})
    lines = table.splitlines()
    assert lines[2] == "| off | 155.0 | 150.0, 160.0 | 65 / 1,234 | 1,900 / 4,100 | 300 (0 failed) |"
    assert lines[3].startswith("| 4 | 155.0 |") and "65 / 210 |" in lines[3]
