"""scripts/gpu_check.sh as the GPU machine runs it, in CPU smoke mode: in a venv built the way that
machine's image is (`make gpu-image`: its transformers, the oldest torch this machine can install, its
other packages, none of cbserve's own dependencies), cbserve not installed, the bundle installed offline.

Every row's code runs (with the CPU stand-ins) in a process of its own; the rows whose requirement is
absent on a CPU are skipped with their reason, every other row passes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IMAGE_PY = ROOT / ".gpu-image-venv" / "bin" / "python"
BUNDLE = ROOT / ".gpu-image-venv" / "bundle"


@pytest.fixture(scope="module")
def image_python() -> Path:
    """The image-like venv and its bundle: built by `make test`'s prerequisite, or here on first use."""
    subprocess.run(["make", "-s", "gpu-image"], cwd=ROOT, check=True, timeout=900)
    return IMAGE_PY


def test_the_image_lacks_what_the_bundle_brings(image_python):
    wanted = ("psutil", "xxhash", "starlette", "uvicorn", "engine")
    probe = f"import importlib.util as u; print([m for m in {wanted!r} if u.find_spec(m)])"
    out = subprocess.run([str(image_python), "-c", probe], capture_output=True, text=True, check=True, cwd="/",
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})  # fmt: skip
    assert out.stdout.strip() == "[]"


@pytest.mark.timeout(620)
def test_gpu_check_sh_runs_offline_in_the_image_venv(image_python, tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "CBSERVE_"))}
    env.update(PYTHON=str(image_python), OUT=str(out), GPU_BUNDLE=str(BUNDLE), TMPDIR=str(tmp_path),
               PIP_NO_INDEX="1", PIP_FIND_LINKS="", PIP_CONFIG_FILE=os.devnull,  # no registry, no local wheels
               CBSERVE_CPU_KERNELS="0", CBSERVE_CACHE_DIR=str(tmp_path / "cache"),
               GPU_CHECK_BUDGET="560")  # a shared CPU may be slow: the GPU's 450 s is the default  # fmt: skip
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--device", "cpu", "--quick", "--archs", "llama"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=590)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    bundle_log = (out / "bundle.log").read_text()
    assert "installed into" in bundle_log and "psutil" in bundle_log and "starlette" in bundle_log
    assert "already here:" in bundle_log and "pyyaml" in bundle_log.split("already here:")[1]  # not shadowed
    result = json.loads((out / "gpu_check.json").read_text())
    env_rows = result["environment"]
    assert env_rows["transformers"] == "5.17.0" and env_rows["torch"].startswith("2.13")
    rows = {row["check"]: row for row in result["checks"]}
    skipped = {"no host sync inside decode steps": "needs CUDA", "throughput against vLLM": "CUDA only",
               "tensor parallel, 2 ranks against 1": "--two-ranks"}  # fmt: skip
    for name, row in rows.items():
        if name in skipped:
            assert row["status"] == "skipped" and skipped[name] in row["reason"], row
        else:
            assert row["status"] == "pass", row
    assert len(rows) == 12 and result["passed"]
    equality = rows["greedy equality with the model (teacher-forced)"]["figures"]
    assert equality["diverged"] == 0 and equality["argmax"] == equality["tokens"] > 0 and equality["equal to generate"] == 6
    graphs = rows["CUDA graphs captured, replayed, equal to eager"]["figures"]
    assert graphs["captured"] == graphs["expected"] == graphs["captured after serving"] > 0
    assert rows["cbserve serve on the device, streamed chat"]["figures"]["device"] == "cpu"
    assert rows["throughput against transformers' generate_batch"]["figures"]["requests"] == "4/4"
    ahead = rows["async batching against one step at a time"]["figures"]
    assert ahead["steps run ahead"] > 0 and ahead["sequences the same"] == "5/5"
    markdown = (out / "gpu_check.md").read_text()
    assert markdown.startswith("## cbserve GPU check, ") and ", attention cpu" in markdown.splitlines()[0]
    assert "| check | status | seconds | figures |" in markdown and "| transformers | 5.17.0 |" in markdown
    assert markdown in proc.stdout + "\n"
    assert sorted(p.name for p in (out / "logs").iterdir()) == sorted(
        ["environment.log", "kernels.log", "equality.log", "graphs.log", "sampling.log", "sync.log", "async.log",
         "serve.log", "memory.log", "throughput.log", "transformers.log"])  # fmt: skip


def test_without_pip_the_wheels_are_unpacked_into_the_target(image_python, tmp_path):
    """A Python without pip still gets the bundle: a wheel is a zip of what a target folder holds."""
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_bundle
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    for wheel in BUNDLE.glob("*.whl"):
        if gpu_bundle.wheel_name(wheel) in ("xxhash", "psutil", "starlette", "uvicorn"):
            gpu_bundle.unpack(wheel, tmp_path / "site")
    code = "import xxhash, psutil, starlette, uvicorn; print(xxhash.xxh64(b'a').hexdigest())"
    out = subprocess.run([str(image_python), "-c", code], capture_output=True, text=True, check=True, cwd="/",
                         env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                              "PYTHONPATH": str(tmp_path / "site")})  # fmt: skip
    assert out.stdout.strip() == "d24ec4f1a98c6e5b"
