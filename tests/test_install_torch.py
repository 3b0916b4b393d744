"""scripts/install_torch.py: the torch build `make` installs follows the machine (a GPU: PyPI's CUDA build; none:
the PyTorch CPU index when it answers, else what pip finds for the pin), and it says which."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import install_torch  # noqa: E402


class _TorchPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/simple/torch/" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering_index() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _TorchPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()


def test_a_cpu_machine_takes_the_cpu_index_when_it_answers(answering_index: str) -> None:
    words, extra = install_torch.plan("cpu", answering_index)
    assert extra == ["--index-url", answering_index] and "CPU build" in words


def test_a_gpu_machine_takes_pypis_cuda_build() -> None:
    words, extra = install_torch.plan("cuda", "http://127.0.0.1:9/simple")
    assert extra == [] and "CUDA build" in words


def test_without_the_cpu_index_it_falls_back_to_the_pin_and_says_so() -> None:
    """The whole script, resolving only: the index on a closed port, so pip takes what it finds for the pin."""
    env = {**os.environ, "CBSERVE_TORCH": "cpu", "CBSERVE_TORCH_CPU_INDEX": "http://127.0.0.1:9/simple"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "install_torch.py"), sys.executable, "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().splitlines()
    assert "did not answer" in first
    assert second.startswith("install_torch: would install torch 2.13.0")


def test_a_bad_override_is_one_line_and_exit_2() -> None:
    env = {**os.environ, "CBSERVE_TORCH": "rocm"}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "install_torch.py"), sys.executable, "--dry-run"],
                          capture_output=True, text=True, env=env)  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip() == "install_torch: CBSERVE_TORCH must be cpu or cuda, got 'rocm'"
