"""`python -m cbserve_operator`, the operator image's entrypoint, as a real process: serves, then stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys

from .conftest import Cluster, free_port, wait_for, _healthy
from .test_operator import EXAMPLE, apply, reconciled


def test_python_m_cbserve_operator_reconciles_and_stops_on_sigterm(crd_cluster: Cluster) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cbserve_operator", "--liveness", f"http://127.0.0.1:{port}/healthz"],
        env=crd_cluster.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(port), timeout=60, what="the operator to come up")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        apply(crd_cluster, "entry", EXAMPLE)
        assert reconciled(crd_cluster, "entry")["status"]["phase"] == "Pending"
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, output
    assert "Handler 'reconcile' succeeded" in output
    assert "Stop-flag is raised. Operator is stopping." in output or "Operator is stopping" in output
