"""A real `cbserve serve` process on 127.0.0.1 with a small test model."""

from __future__ import annotations

import gc
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from engine.testing import save_test_model


def free_port(fixed: bool = False) -> int:
    """A port free on 127.0.0.1 now. `fixed`: one below the kernel's range of automatic ports, as a real
    rendezvous port (29500) is, for a port that a client retries connecting to before its server binds
    it: in that range another socket's automatic port, or the retrying client's own (a TCP connect to a
    port nobody listens at can connect to itself), may take it first."""
    if not fixed:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(20000, max(20001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in 20000-{low - 1}")


class Server:
    def __init__(self, model: Path, tmp: Path, engine: dict, extra_args: list[str] = (), env: dict | None = None,
                 own_group: bool = False):  # fmt: skip
        """`own_group`: the server leads a process group of its own, as a terminal's foreground job does."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / f"engine-{self.port}.yaml"
        # float32 unless a test says otherwise: --dtype auto is bfloat16 on CPUs with bfloat16 dot products
        config.write_text(yaml.safe_dump({"dtype": "float32", **engine}))
        self.log = tmp / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "engine.cli", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(self.port), "--config", str(config), "--log-level", "warning", *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})}, start_new_session=own_group)
        self.wait_ready()

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling a readiness probe, with a deadline
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics").text):
            for sample in family.samples:
                key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                                    if k != "model_name") + "}" if len(sample.labels) > 1 else "")
                values[key] = sample.value
        return values

    def wait_for(self, predicate, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not met within {timeout}s: {m}")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return save_test_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = Server(model_dir, tmp_path_factory.mktemp("server"), {"block_size": 16, "num_blocks": 512})
    yield srv
    assert srv.stop() == 0


@pytest.fixture
def quiet_collector():
    """For tests that time a server from this process, which has run the rest of the suite: a full
    pass of its own collector over that heap would count against the server. Freeze the heap and
    pause the collector."""
    gc.collect()
    gc.freeze()
    gc.disable()
    yield
    gc.enable()
    gc.unfreeze()
