"""Install the pinned torch build that fits this machine, and say which one it chose.

A machine with an NVIDIA GPU gets PyPI's torch (the Linux wheel there is the CUDA build). A machine
without one gets the CPU build from the PyTorch CPU index when that index answers, and otherwise
whatever pip finds for the pin (a local CPU wheel where the machine carries one, else PyPI's, which
on Linux is the CUDA build: it runs on the CPU too, several GB larger); the last line says which.

    python scripts/install_torch.py .venv/bin/python            # what `make` runs
    python scripts/install_torch.py .venv/bin/python --dry-run  # resolve only, install nothing

`CBSERVE_TORCH=cpu|cuda` overrides the GPU probe; `CBSERVE_TORCH_CPU_INDEX` names another CPU index.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

TORCH = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def has_nvidia_gpu() -> bool:
    """A GPU the NVIDIA driver sees: its device nodes, or `nvidia-smi -L` listing one."""
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def index_answers(url: str, timeout: float = 5.0) -> bool:
    """Whether the index serves torch's project page (a quick GET; no answer in `timeout` is a no)."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def plan(kind: str, cpu_index: str) -> tuple[str, list[str]]:
    """(what was chosen, in words; pip's extra arguments) for `kind` "cuda" or "cpu"."""
    if kind == "cuda":
        return "the CUDA build from PyPI (an NVIDIA GPU is present)", []
    if index_answers(cpu_index):
        return f"the CPU build from {cpu_index}", ["--index-url", cpu_index]
    return (f"what pip finds for {TORCH} ({cpu_index} did not answer): a local CPU wheel where this machine "
            "has one, else PyPI's CUDA build, which also runs on the CPU"), []  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("python", help="the interpreter whose environment gets torch (e.g. .venv/bin/python)")
    parser.add_argument("--dry-run", action="store_true", help="resolve and report, install nothing")
    args = parser.parse_args(argv)
    kind = os.environ.get("CBSERVE_TORCH") or ("cuda" if has_nvidia_gpu() else "cpu")
    if kind not in ("cpu", "cuda"):
        print(f"install_torch: CBSERVE_TORCH must be cpu or cuda, got {kind!r}", file=sys.stderr)
        return 2
    words, extra = plan(kind, os.environ.get("CBSERVE_TORCH_CPU_INDEX") or CPU_INDEX)
    print(f"install_torch: {TORCH}, {words}", flush=True)
    cmd = [args.python, "-m", "pip", "install", "-q", *extra, TORCH]
    if args.dry_run:
        cmd[4:4] = ["--dry-run", "--ignore-installed", "--no-deps", "--report", "-"]
    done = subprocess.run(cmd, capture_output=args.dry_run, text=True)
    if done.returncode != 0:
        if args.dry_run:
            sys.stderr.write(done.stderr)
        return done.returncode
    if args.dry_run:
        import json

        (item,) = json.loads(done.stdout)["install"]
        print(f"install_torch: would install torch {item['metadata']['version']} from {item['download_info']['url']}")
        return 0
    probe = "import torch; print(torch.__version__, 'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU-only')"
    got = subprocess.run([args.python, "-c", probe], capture_output=True, text=True, check=True).stdout.strip()
    print(f"install_torch: installed torch {got}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
