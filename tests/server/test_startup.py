"""Start-up as probes see it: the port answers while the model loads (real uvicorn, in process)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import httpx
import pytest
import uvicorn

from engine import ContinuousBatchingConfig, ContinuousBatchingManager
from engine.server.app import build_state, create_app
from engine.server.startup import DrainingServer, Startup
from engine.testing import build_test_model, build_test_tokenizer
from tests.server.conftest import free_port


def serve_in_thread(build) -> tuple[DrainingServer, Startup, str, threading.Thread]:
    """A real uvicorn on a socket bound and listening before it starts: a request sent at once
    waits in the backlog instead of being refused."""
    startup = Startup(build)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = DrainingServer(uvicorn.Config(startup, log_level="warning"), startup, 5.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, startup, f"http://127.0.0.1:{sock.getsockname()[1]}", thread


def test_probes_answer_while_the_model_loads_then_ready() -> None:
    release = threading.Event()

    def build():
        release.wait(60)  # the model "loads" until the test has probed
        manager = ContinuousBatchingManager(build_test_model("llama"), continuous_batching_config=
                                            ContinuousBatchingConfig(block_size=16, num_blocks=64))  # fmt: skip
        return create_app(build_state(manager, build_test_tokenizer(), "tiny", 1024))

    server, startup, url, thread = serve_in_thread(build)
    with httpx.Client(timeout=10) as c:
        assert c.get(url + "/health").json() == {"status": "loading"}
        ready = c.get(url + "/ready")
        assert ready.status_code == 503 and ready.json() == {"status": "loading"}
        busy = c.post(url + "/v1/completions", json={"prompt": "hi"})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "10"
        assert busy.json()["error"]["type"] == "service_unavailable"
        release.set()
        while c.get(url + "/ready").status_code == 503:  # the warm-up runs through the app's lifespan
            assert thread.is_alive()
        assert c.get(url + "/ready").json() == {"status": "ready"}
        out = c.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive() and not startup.app.state.cbserve.manager.is_running()  # lifespan shut it down


def test_a_load_that_fails_stops_the_server() -> None:
    def build():
        raise FileNotFoundError("no checkpoint at /nowhere")

    server, startup, url, thread = serve_in_thread(build)
    thread.join(30)
    assert not thread.is_alive() and isinstance(startup.error, FileNotFoundError)


def test_cbserve_serve_with_a_missing_model_exits_2_with_one_line(tmp_path) -> None:
    proc = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", str(tmp_path / "nowhere"),
                           "--host", "127.0.0.1", "--port", str(free_port())], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("cbserve: error:")
