"""scripts/gpu_check.py: rows in processes of their own (a hang or a crash ends its row alone, the
budget is kept), the two-GPU line on two CPU ranks, teacher-forced token comparison, how rows are made.
The whole CPU smoke run, in a venv built like the GPU machine's image, is tests/gpu/test_gpu_image.py."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
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
    for flag in ("--device", "--out", "--only", "--skip", "--quick", "--small", "--vllm", "--min-exact", "--two-ranks",
                 "--budget"):
        assert flag in out


def test_the_tensor_parallel_line_on_two_cpu_ranks_writes_its_row(tmp_path, capsys):
    gpu_check = load()
    code = gpu_check.main(["--device", "cpu", "--quick", "--only", "tensor-parallel", "--two-ranks", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["check"]: row for row in result["checks"]}
    assert list(rows) == [m.NAME for m in gpu_check.CHECKS.values()]
    assert rows["tensor parallel, 2 ranks against 1"]["status"] == "pass"
    assert result["passed"] and result["environment"]["torch"] and result["environment"]["transformers"]
    assert (tmp_path / "logs" / "tensor-parallel.log").exists()
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert markdown in out + "\n"
    assert "### Tensor parallel on two CPU ranks (gloo), float32" in out
    assert "| greedy tokens, 2 ranks against 1 (test Llama) | 2/2 exact | mean common prefix 4.0/4 |" in out


def test_a_row_past_its_limit_is_killed_with_what_it_started(tmp_path):
    gpu_check = load()
    marker = tmp_path / "grandchild.pid"
    script = (f"import subprocess; p = subprocess.Popen(['sleep', '300']); open({str(marker)!r}, 'w').write(str(p.pid)); "
              "p.wait()")
    code, seconds = gpu_check.run_process([sys.executable, "-c", script], 3, tmp_path / "log")
    assert code is None and seconds < 60
    pid = int(marker.read_text())
    deadline = time.monotonic() + 10  # SIGKILL was sent to the group; its delivery is asynchronous
    while running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(pid)  # the grandchild went with it


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("fork", ["1", "0"])  # forked from the preloaded server (the default), or a fresh interpreter
def test_a_row_whose_process_dies_or_overruns_is_a_failure_with_its_last_line(tmp_path, monkeypatch, fork):
    monkeypatch.setenv("GPU_CHECK_FORK", fork)
    gpu_check = load()
    (tmp_path / "rows").mkdir()
    row = gpu_check.run_row("kernels", ["--dtype", "int8"], tmp_path, tmp_path, 120, "its limit 120 s")  # argparse exits 2
    assert row.status == "fail" and row.reason.startswith("its process exited with 2; last line: ")
    assert "invalid choice: 'int8'" in row.reason
    row = gpu_check.run_row("kernels", ["--device", "cpu"], tmp_path, tmp_path, 0.5, "its limit 0.5 s")
    assert row.status == "fail" and row.reason.startswith("timed out after ") and "(its limit 0.5 s)" in row.reason
    row = gpu_check.run_row("memory", ["--device", "cpu", "--quick"], tmp_path, tmp_path, 120, "its limit 120 s")
    assert row.status == "pass", row  # a whole row, its result read back from its process


def test_no_check_starts_once_the_budget_is_spent(capsys):
    gpu_check = load()
    assert gpu_check.main(["--device", "cpu", "--budget", "0", "--skip", "serve"]) == 0
    out = capsys.readouterr().out
    assert "| attention kernels against the reference | skipped: not started: " in out
    assert "| cbserve serve on the device, streamed chat | skipped: left out (--only/--skip) |" in out
    assert "| tensor parallel, 2 ranks against 1 | skipped: two CPU ranks only with --two-ranks |" in out


def test_teacher_forcing_accepts_the_model_s_tokens_and_near_ties_only():
    load()
    import torch

    from engine.testing import build_test_model
    from scripts.gpu_checks.common import reference_tokens, teacher_forced

    model = build_test_model("llama", vocab_size=64)
    prompt = [5, 9, 13, 2, 40]
    tokens = reference_tokens(model, [prompt], 8)[0]
    assert teacher_forced(model, prompt, tokens, 1e-4) == {"positions": 8, "argmax": 8, "near_ties": 0, "diverged": 0,
                                                           "largest_gap": 0.0, "diverged_at": []}  # fmt: skip
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:2]])).logits[0, -1]
    top = logits.topk(2)
    gap = float((top.values[0] - top.values[1]) / logits.abs().max())
    second = tokens[:2] + [int(top.indices[1])]  # the third token swapped for the model's second choice there
    assert teacher_forced(model, prompt, second, gap * 1.01)["near_ties"] == 1
    assert teacher_forced(model, prompt, second, gap * 0.99)["diverged"] == 1
    third = tokens[:2] + [int(logits.argsort()[-3])]  # its third choice: a near-tie only within the tolerance too
    gap3 = float((top.values[0] - logits.sort().values[-3]) / logits.abs().max())
    assert teacher_forced(model, prompt, third, gap3 * 1.01)["near_ties"] == 1
    far = teacher_forced(model, prompt, third, gap3 * 0.99)
    assert far["diverged"] == 1 and far["diverged_at"] == [f"rank 3, gap {gap3:.3g}"]


def test_left_out_checks_are_rows_that_say_so(capsys):
    gpu_check = load()
    assert gpu_check.main(["--device", "cpu", "--only", "tensor-parallel"]) == 0
    out = capsys.readouterr().out
    assert "| attention kernels against the reference | skipped: left out (--only/--skip) |" in out
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


def test_a_long_error_is_one_line_in_the_table_and_whole_below_it():
    """An inductor error on the H200 ran to 60 lines and broke the table: the cell is one line now."""
    load()
    from scripts.gpu_checks.report import CELL_CHARS, markdown, run_check

    def crashed():
        raise RuntimeError("InductorError: LoweringException\n" + "args[0]: TensorBox(...)\n" * 60)

    row = run_check("kernels", crashed)
    (cell,) = [line for line in markdown([], [row], "t").splitlines() if line.startswith("| kernels |")]
    assert "\n" not in cell and len(cell) < CELL_CHARS + 100 and cell.split(" | ")[1].endswith("...")
    assert row.detail.startswith("### kernels: the error") and row.detail.count("args[0]") == 60


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


def test_rows_with_graphs_skip_on_a_backend_that_graphs_cannot_capture():
    """On CUDA the graph rows follow the attention backend's `supports_graphs`, not flash-attn: here the
    backend an engine would get is forced to the SDPA fallback's answer."""
    load()
    import torch

    from scripts.gpu_checks import graphs
    from scripts.gpu_checks.common import Context
    from scripts.gpu_checks.report import run_check

    ctx = Context(torch.device("cuda:0"), torch.bfloat16, 256, 0.9, ["llama"])
    ctx.shared["attention"] = ("cuda-sdpa", False)
    assert not ctx.graphs
    row = run_check(graphs.NAME, lambda: graphs.run(ctx))
    assert (row.status, row.reason) == ("skipped", "the CUDA attention backend 'cuda-sdpa' cannot be captured in CUDA graphs")


def test_the_kernels_row_holds_the_sdpa_fallback_to_the_reference():
    """The kernels row compares whatever backend an engine gets on CUDA; the SDPA fallback, run here on
    the CPU, is within the row's bfloat16 tolerance of flash-attn's reference, alone and with a sliding
    window. (With a softcap it rounds the capped scores to bfloat16 and can exceed it: the row says so.)"""
    load()
    import torch

    from engine.backends.cuda import SDPACudaBackend
    from scripts.gpu_checks import kernels
    from scripts.gpu_checks.common import Context

    ctx = Context(torch.device("cpu"), torch.float32, 256, 0.9, ["llama"], quick=True)
    _, reference = kernels.backends(ctx)
    variants = [v for v in kernels.VARIANTS.values() if "softcap" not in v]
    for seed, (seqs, variant) in enumerate((s, v) for s in kernels.STEPS.values() for v in variants):
        err = kernels.one_case(ctx, SDPACudaBackend(), reference, seqs, 64, torch.bfloat16, variant, seed=seed)
        assert err <= kernels.TOLERANCE[torch.bfloat16], (seqs, variant, err)


def test_the_sync_check_counts_c10s_sync_warning_and_not_torchs_notice_about_the_mode():
    """On the H200 the notice set_sync_debug_mode gives once per process was counted as a sync."""
    load()
    from scripts.gpu_checks.sync import is_sync

    assert is_sync(UserWarning("called a synchronizing CUDA operation"))
    assert not is_sync(UserWarning("Synchronization debug mode is a prototype feature and does not yet detect all "
                                   "synchronizing operations"))
