"""scripts/gpu_check.py: its CPU smoke run end to end (every check's code, with the CPU stand-ins),
the JSON and markdown it writes, the two-GPU line on two CPU ranks, and how rows are made."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


def test_help_runs_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as done:
        load().main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--device", "--out", "--only", "--skip", "--quick", "--small", "--vllm", "--min-exact", "--two-ranks"):
        assert flag in out


def test_smoke_run_on_cpu_writes_every_row(tmp_path, capsys):
    """Every check runs on the CPU; the sync check and the vLLM line say why they cannot; the
    tensor-parallel line runs on two CPU ranks."""
    gpu_check = load()
    code = gpu_check.main(["--device", "cpu", "--quick", "--archs", "llama", "--two-ranks", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["check"]: row for row in result["checks"]}
    assert list(rows) == [m.NAME for m in gpu_check.CHECKS.values()]
    skipped = {"no host sync inside decode steps": "needs CUDA", "throughput against vLLM": "CUDA only"}
    for name, row in rows.items():
        if name in skipped:
            assert row["status"] == "skipped" and skipped[name] in row["reason"], row
        else:
            assert row["status"] == "pass", row
        assert row["seconds"] >= 0
    assert result["passed"] and result["environment"]["torch"]
    assert rows["greedy equality with model.generate"]["figures"]["exact"] == 6
    graphs = rows["CUDA graphs captured, replayed, equal to eager"]["figures"]
    assert graphs["captured"] == graphs["expected"] == graphs["captured after serving"] > 0
    assert graphs["decode replays"] > 0 and graphs["varlen replays"] > 0
    assert rows["no host sync inside decode steps"]["figures"]["greedy steps"] == 4  # the steps ran
    assert rows["cbserve serve on the device, streamed chat"]["figures"]["device"] == "cpu"
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| check | status | seconds | figures |" in markdown and "| flash-attn |" in markdown
    assert "| flash-attn kernels | pass |" in markdown and markdown in out + "\n"
    assert "### Tensor parallel on two CPU ranks (gloo), float32" in out
    assert "| greedy tokens, 2 ranks against 1 (test Llama) | 2/2 exact | mean common prefix 4.0/4 |" in out


def test_left_out_checks_are_rows_that_say_so(capsys):
    gpu_check = load()
    assert gpu_check.main(["--device", "cpu", "--only", "tensor-parallel"]) == 0
    out = capsys.readouterr().out
    assert "| flash-attn kernels | skipped: left out (--only/--skip) |" in out
    assert "| tensor parallel, 2 ranks against 1 | skipped: two CPU ranks only with --two-ranks |" in out
    with pytest.raises(SystemExit, match="unknown check"):
        gpu_check.main(["--device", "cpu", "--only", "nothing"])


def test_cuda_device_without_cuda_is_the_clear_error():
    gpu_check = load()
    if gpu_check.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        gpu_check.main(["--only", "kernels"])


def test_a_row_is_pass_fail_or_skipped_with_its_reason():
    load()
    from scripts.gpu_checks.report import CheckFailed, Skipped, run_check

    assert run_check("a", lambda: {"x": 1}).status == "pass"

    def skipped():
        raise Skipped("no GPU", {"y": 2})

    def failed():
        raise CheckFailed("3 < 4", {"z": 3})

    def crashed():
        raise KeyError("k")

    assert (run_check("b", skipped).status, run_check("b", skipped).reason) == ("skipped", "no GPU")
    row = run_check("c", failed)
    assert (row.status, row.reason, row.figures) == ("fail", "3 < 4", {"z": 3})
    row = run_check("d", crashed)
    assert row.status == "fail" and row.reason.startswith("KeyError: 'k' (test_gpu_check.py:")


def test_the_serve_check_starts_the_server_as_the_operator_s_pod_does():
    load()
    from cbserve_operator.spec import parse_spec
    from cbserve_operator.workload import server_command

    from scripts.gpu_checks.serve import command

    pod = server_command(parse_spec("m", {"model": {"uri": "hf://org/m"}, "resources": {"gpu": 1}}))
    ours = command(Path("/models/m"), Path("/etc/engine.yaml"), 8000, "cuda")
    flags = lambda cmd: [a for a in cmd if a.startswith("--")]  # noqa: E731
    assert Path(ours[0]).name in ("cbserve", "python", Path(sys.executable).name) and "serve" in ours[:4]
    assert flags(ours) == flags(pod) + ["--host"]
    assert ours[ours.index("--device") + 1] == pod[pod.index("--device") + 1] == "cuda"


def test_prefix_and_table_helpers():
    load()
    from scripts.gpu_checks.common import common_prefix, matches
    from scripts.gpu_checks.report import table

    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert matches([[1, 2], [3]], [[1, 2], [4]]) == {"exact": 1, "total": 2, "mean_prefix": 1.0}
    assert table(["a", "b"], [["1", "2"]]) == "| a | b |\n|---|---|\n| 1 | 2 |"
