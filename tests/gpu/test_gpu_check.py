"""scripts/gpu_check.py imports, shows --help, and its checks run end to end on the CPU (smoke mode)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as done:
        load().main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--skip-throughput", "--w1-prompts", "--min-exact"):
        assert flag in out


def test_smoke_run_on_cpu_prints_the_tables(capsys):
    gpu_check = load()
    code = gpu_check.main(["--device", "cpu", "--dtype", "float32", "--archs", "llama", "--prompts", "2",
                           "--max-new-tokens", "4", "--skip-throughput"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "| flash-attn |" in out and "| torch |" in out
    assert "| llama | off | 2/2 | 4.0/4 |" in out


def test_cuda_device_without_cuda_is_the_clear_error():
    gpu_check = load()
    if gpu_check.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        gpu_check.main(["--skip-throughput"])


def test_table_and_prefix_helpers():
    gpu_check = load()
    assert gpu_check.common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert gpu_check.table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"


def test_the_two_gpu_line_runs_on_two_cpu_ranks(capsys):
    gpu_check = load()
    code = gpu_check.main(["--device", "cpu", "--dtype", "float32", "--archs", "llama", "--prompts", "2",
                           "--max-new-tokens", "4", "--skip-throughput", "--skip-equality", "--two-ranks"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "### Tensor parallel on two CPU ranks (gloo), float32" in out
    assert "| greedy tokens, 2 ranks against 1 (test Llama) | 2/2 exact | mean common prefix 4.0/4 |" in out
