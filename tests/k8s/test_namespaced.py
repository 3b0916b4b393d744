"""The operator watching named namespaces: the chart's Roles there and its small ClusterRole cover
every request it makes, and it leaves other namespaces alone (own emulator, own operator)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from .conftest import CRD_FILE, REPO, Cluster, operator_running, wait_for
from .test_operator import _rbac_request, example


def make_namespace(cluster: Cluster, name: str) -> None:
    cluster.kubectl("apply", "--validate=false", "-f", "-",
                    input=yaml.safe_dump({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))


@pytest.fixture(scope="module")
def watched(cluster: Cluster) -> Iterator[Cluster]:
    cluster.kubectl("apply", "--server-side", "--validate=false", "-f", str(CRD_FILE))
    make_namespace(cluster, "ml")  # Kopf starts watching a namespace once it exists
    with operator_running(cluster, "--namespace=ml") as (runner, _port):
        yield cluster
    assert runner.exception is None, runner.output


def _grants(tools: Any) -> tuple[set[tuple[str, str, str]], dict[str, set[tuple[str, str, str]]]]:
    rendered = subprocess.run([str(tools.helm), "template", "t", str(REPO / "charts" / "cbserve"),
                               "--set", "operator.watchNamespaces={ml}", "--set", "rbac.aggregate=false"],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    docs = [d for d in yaml.safe_load_all(rendered) if d]

    def allowed(role: dict[str, Any]) -> set[tuple[str, str, str]]:
        return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
                for v in rule["verbs"]}  # fmt: skip

    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    roles = {d["metadata"]["namespace"]: allowed(d) for d in docs if d["kind"] == "Role"}
    return allowed(cluster_role), roles


def test_roles_in_watched_namespaces_cover_every_request(watched: Cluster, tools: Any) -> None:
    c = watched
    make_namespace(c, "other")
    c.kubectl("apply", "--validate=false", "-n", "ml", "-f", "-", input=yaml.safe_dump(example()))
    c.kubectl("apply", "--validate=false", "-n", "other", "-f", "-", input=yaml.safe_dump(example()))
    reconciled = wait_for(lambda: (c.get("cbserve.io/v1alpha1", "cbdeployments", "ml", "smollm2") or {})
                          .get("status", {}).get("observedGeneration"), what="the ml CBDeployment reconciled")  # fmt: skip
    assert reconciled and c.get("apps/v1", "deployments", "ml", "smollm2") is not None
    cluster_wide, roles = _grants(tools)
    assert set(roles) == {"ml"} and cluster_wide == {(g, r, v) for g, r in (("apiextensions.k8s.io",
                                                     "customresourcedefinitions"), ("", "namespaces"))
                                                     for v in ("list", "watch")}  # fmt: skip
    assert c.server.emulator is not None
    for method, path, agent in c.server.emulator.journal:
        if not agent.startswith(("kopf/", "cbserve-operator")):
            continue
        namespace = path.split("/namespaces/")[1].split("/")[0] if "/namespaces/" in path else None
        for need in _rbac_request(method, path):
            granted = roles.get(namespace, set()) if namespace else cluster_wide
            assert need in granted, (method, path, need)
    # the other namespace is not the operator's: nothing there was touched
    assert c.get("apps/v1", "deployments", "other", "smollm2") is None
    assert not (c.get("cbserve.io/v1alpha1", "cbdeployments", "other", "smollm2") or {}).get("status")
