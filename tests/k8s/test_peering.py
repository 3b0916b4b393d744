"""Operator replicas (`operator.replicas > 1`): Kopf peering lets only the highest-priority live
operator work, and another takes over when it is gone (own emulator; two real operators)."""

from __future__ import annotations

import logging

import pytest
import yaml

from cbserve_operator.__main__ import kopf_args, peering_priority

from .conftest import CHART, CRD_FILE, Cluster, operator_running, wait_for
from .test_operator import _rbac_request, example


def deployment_applies(c: Cluster, ns: str, name: str) -> int:
    assert c.server.emulator is not None
    return len(c.server.requests_since(0, "PATCH", rf"/apis/apps/v1/namespaces/{ns}/deployments/{name}\?"))


def test_two_operators_never_both_reconcile_and_one_takes_over(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    c = cluster
    c.kubectl("apply", "--server-side", "--validate=false", "-f", str(CRD_FILE))
    c.kubectl("apply", "--server-side", "--validate=false", "-f", str(CHART / "crds" / "kopf-peerings.yaml"))
    c.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "cbserve"}}))
    caplog.set_level(logging.INFO)
    with operator_running(c, "--peering=cbserve", "--priority=10"):
        with operator_running(c, "--peering=cbserve", "--priority=20"):
            wait_for(lambda: "Pausing operations in favour of" in caplog.text, what="the priority-10 operator to pause")
            c.kubectl("apply", "--validate=false", "-n", "peers", "-f", "-", input=yaml.safe_dump(example()))
            wait_for(lambda: (c.get("cbserve.io/v1alpha1", "cbdeployments", "peers", "smollm2") or {})
                     .get("status", {}).get("observedGeneration"), what="the CBDeployment reconciled")  # fmt: skip
            assert deployment_applies(c, "peers", "smollm2") == 1  # one reconcile, not one per operator
        # the leader is gone: the other resumes and works
        wait_for(lambda: "Resuming operations after the pause" in caplog.text, what="the other operator to resume")
        second = example()
        second["metadata"]["name"] = "second"
        c.kubectl("apply", "--validate=false", "-n", "peers", "-f", "-", input=yaml.safe_dump(second))
        wait_for(lambda: (c.get("cbserve.io/v1alpha1", "cbdeployments", "peers", "second") or {})
                 .get("status", {}).get("observedGeneration"), what="the second CBDeployment reconciled")  # fmt: skip
        assert deployment_applies(c, "peers", "second") == 1
    # the chart's ClusterRole for replicas covers what peering asked of the API server
    import subprocess

    rendered = subprocess.run([str(c.tools.helm), "template", "t", str(CHART), "--set", "operator.replicas=2",
                               "--set", "rbac.aggregate=false"], capture_output=True, text=True, check=True).stdout
    (role,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ClusterRole"]
    allowed = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    assert c.server.emulator is not None
    peering = {need for method, path, agent in c.server.emulator.journal if agent.startswith("kopf/")
               and "kopf.dev" in path for need in _rbac_request(method, path)}  # fmt: skip
    assert peering and peering <= allowed, peering - allowed


def test_replicas_get_distinct_stable_priorities(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAME", "cbserve-operator-7d9f-abcde")
    args = kopf_args(["--peering=cbserve"])
    assert f"--priority={peering_priority('cbserve-operator-7d9f-abcde')}" in args and "--standalone" not in args
    assert peering_priority("cbserve-operator-7d9f-abcde") != peering_priority("cbserve-operator-7d9f-fghij")
    assert "--priority=5" in kopf_args(["--peering=cbserve", "--priority=5"]) and len(
        [a for a in kopf_args(["--peering=cbserve", "--priority=5"]) if a.startswith("--priority")]) == 1
