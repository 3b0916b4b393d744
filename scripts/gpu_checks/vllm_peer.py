"""The throughput check's workload on vLLM, when the package registry has a build that runs here.

`pip install vllm` into a venv of its own (`--vllm-venv`, default ~/.cache/cbserve/vllm-cuda-venv;
never the project's), then a probe in it: vLLM imports and its torch sees this GPU (a wheel built for
a newer CUDA than the driver runs fails here). Any failure is the row's skip reason. The throughput
model is saved to a folder, freed from this process, and served by benchmarks/vllm_peer.py's
`VLLMPeer` (`LLM(model=folder, skip_tokenizer_init=True, dtype=...)`, warmed, then `generate` over
the same prompts, greedy, EOS ignored), median of the same number of runs. Runs after throughput.py.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

from scripts.gpu_checks import throughput
from scripts.gpu_checks.common import Context
from scripts.gpu_checks.report import Skipped

NAME = "throughput against vLLM"
INSTALL_TIMEOUT_S = 600
PROBE = "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA'; print(vllm.__version__, torch.version.cuda)"


def venv_python(ctx: Context) -> Path:
    """The peer venv's interpreter, made (pip install vllm) when missing; Skipped with pip's reason."""
    venv = Path(ctx.vllm) if ctx.vllm not in ("auto", "off") else Path.home() / ".cache" / "cbserve" / "vllm-cuda-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, text=True)
            subprocess.run([str(python), "-m", "pip", "install", "-q", "vllm"], check=True, capture_output=True,
                           text=True, timeout=INSTALL_TIMEOUT_S)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise Skipped(f"pip install vllm took over {INSTALL_TIMEOUT_S} s") from None
        except subprocess.CalledProcessError as exc:
            tail = (exc.stderr or exc.stdout or "").strip().splitlines()[-1:] or ["no output"]
            raise Skipped(f"pip install vllm failed: {tail[0][:200]}") from None
    probe = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=300)
    if probe.returncode:
        tail = (probe.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise Skipped(f"the registry's vLLM does not run here: {tail[0][:200]}")
    return python


def run(ctx: Context) -> dict:
    if ctx.vllm == "off":
        raise Skipped("--vllm off")
    if not ctx.cuda:
        raise Skipped("vLLM's peer line runs on CUDA only (the CPU peer is benchmarks/vllm_peer.py)")
    if "workload" not in ctx.shared:
        raise Skipped("the throughput check did not run")
    python = venv_python(ctx)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from vllm_peer import VLLMPeer

    w = ctx.shared["workload"]
    folder = ctx.work / "throughput-model"
    throughput.model(ctx).save_pretrained(folder)
    ctx.release("big_model")  # vLLM takes 90% of the GPU for itself
    prompts_file = folder / "prompts.json"
    prompts_file.write_text(json.dumps(w["prompts"]))
    peer = VLLMPeer(python, str(folder), str(prompts_file), w["new"], str(ctx.dtype).removeprefix("torch."), False)
    try:
        times = [peer.run()["elapsed"] for _ in range(w["runs"])]
    finally:
        peer.close()
    tok_s = len(w["prompts"]) * w["new"] / statistics.median(times)
    ours = ctx.shared.get("cbserve_tok_s")
    return {"vLLM output tok/s": tok_s, "cbserve output tok/s": ours, "cbserve / vLLM": (ours or 0) / tok_s,
            "median of": w["runs"]}  # fmt: skip
