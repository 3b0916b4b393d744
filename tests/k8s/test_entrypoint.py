"""The operator image's entrypoint as a real process, with the chart's exact command line."""

from __future__ import annotations

import signal
import subprocess
import sys

import yaml

from .conftest import CHART, Cluster, Tools, _healthy, free_port, wait_for
from .test_operator import EXAMPLE, apply, reconciled


def chart_command(tools: Tools, liveness_port: int) -> list[str]:
    """`command` + `args` of the operator container, as `helm template` renders them."""
    rendered = subprocess.run(
        [str(tools.helm), "template", "t", str(CHART), "--set", f"liveness.port={liveness_port}",
         "--set", "operator.logFormat=full"], capture_output=True, text=True, check=True).stdout
    (dep,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return [*container["command"], *container["args"]]


def test_python_m_cbserve_operator_with_the_charts_args(crd_cluster: Cluster, tools: Tools) -> None:
    port = free_port()
    command = chart_command(tools, port)
    assert command[:3] == ["python", "-m", "cbserve_operator"]
    proc = subprocess.Popen([sys.executable, *command[1:]], env=crd_cluster.env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(port), timeout=60, what="the operator to come up")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        apply(crd_cluster, "entry", EXAMPLE)
        assert reconciled(crd_cluster, "entry")["status"]["phase"] == "Pending"
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, output
    assert "Handler 'reconcile' succeeded" in output
    assert "Operator is stopping" in output
