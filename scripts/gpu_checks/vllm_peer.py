"""The throughput check's workload on vLLM, when a Python with vLLM is at hand: nothing is installed.

`--vllm auto` (the default) uses this Python when it imports vllm, `--vllm PATH` the Python (or the
venv folder) given, `--vllm off` skips. A probe runs in it first: vLLM imports and its torch sees
this GPU. Without vLLM, or when the probe fails, the row is skipped with the reason. The throughput
model (same shape, seed and dtype) is saved to a folder, freed from this process, and served by
benchmarks/vllm_peer.py's `VLLMPeer` (`LLM(model=folder, skip_tokenizer_init=True, dtype=...)`,
warmed, then `generate` over the same prompts, greedy, EOS ignored), median of the same number of
runs, beside throughput.py's row of this run.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

from scripts.gpu_checks import throughput
from scripts.gpu_checks.common import Context
from scripts.gpu_checks.report import Skipped

NAME = "throughput against vLLM"
TIMEOUT_S = 300
PROBE = "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA'; print(vllm.__version__, torch.version.cuda)"


def requirement(ctx: Context) -> str | None:
    """Why the row cannot run here (scripts/gpu_check.py asks before starting its process), or None."""
    if ctx.vllm == "off":
        return "--vllm off"
    if not ctx.cuda:
        return "vLLM's peer line runs on CUDA only (the CPU peer is benchmarks/vllm_peer.py)"
    if ctx.vllm == "auto" and importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed in this Python (nothing is installed here: --vllm PATH names one)"
    return None


def peer_python(ctx: Context) -> Path:
    """The Python that runs vLLM; Skipped with the reason when there is none that works."""
    if ctx.vllm == "auto":
        python = Path(sys.executable)
    else:
        given = Path(ctx.vllm)
        python = given / "bin" / "python" if given.is_dir() else given
        if not python.exists():
            raise Skipped(f"--vllm {ctx.vllm}: no Python there")
    probe = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=120)
    if probe.returncode:
        tail = (probe.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise Skipped(f"vLLM does not run here: {tail[0][:200]}")
    return python


def run(ctx: Context) -> dict:
    absent = requirement(ctx)
    if absent:
        raise Skipped(absent)
    python = peer_python(ctx)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from vllm_peer import VLLMPeer

    w = throughput.workload(ctx)
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
    earlier = ctx.earlier("throughput")
    ours = earlier["figures"].get("output tok/s") if earlier and earlier.get("status") == "pass" else None
    return {"vLLM output tok/s": tok_s, "cbserve output tok/s": ours, "cbserve / vLLM": (ours or 0) / tok_s,
            "median of": w["runs"]}  # fmt: skip
