"""Restarting the operator in the middle of a reconcile: the next one finishes it, and nothing is duplicated."""

from __future__ import annotations

import json
from typing import Any

from .conftest import Cluster, operator_running, wait_for
from .test_operator import EXAMPLE, apply, conditions, reconciled


def _progress(c: Cluster, ns: str) -> dict[str, Any] | None:
    """Kopf's progress record of the reconcile handler, from the CBDeployment's annotations."""
    obj = c.get("cbserve.io/v1alpha1", "cbdeployments", ns, "smollm2") or {}
    for key, value in (obj.get("metadata", {}).get("annotations") or {}).items():
        if key.startswith("cbserve.io/reconcile"):
            record = json.loads(value)
            return record if record.get("retries") else None
    return None


def _snapshot(c: Cluster, ns: str) -> dict[str, list[tuple[str, str, int]]]:
    """(name, resourceVersion, owner count) of every child, by kind."""
    kinds = {"configmaps": "v1", "services": "v1", "deployments": "apps/v1"}
    return {
        plural: sorted((o["metadata"]["name"], o["metadata"]["resourceVersion"],
                        len(o["metadata"].get("ownerReferences", []))) for o in c.items(api, plural, ns))
        for plural, api in kinds.items()
    }


def test_restart_mid_reconcile_creates_no_duplicates(crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "restart"
    apply(c, ns, EXAMPLE)
    # The first operator gets as far as the Service (ConfigMap and Deployment are applied), then dies.
    gate = c.server.hold("PATCH", rf"/namespaces/{ns}/services/smollm2")
    with operator_running(c) as (first, _port):
        assert gate.arrived.wait(30), "the operator never reached the Service"
        assert c.get("apps/v1", "deployments", ns, "smollm2") is not None
        assert c.get("v1", "services", ns, "smollm2") is None
        gate.release(fail_status=503)  # the connection dies with the operator
        # Kopf records the unfinished handler (under our prefix) before it goes.
        progress = wait_for(lambda: _progress(c, ns), what="Kopf's progress annotation")
        assert progress["retries"] == 1 and "503" in progress["message"]
    assert c.get("v1", "services", ns, "smollm2") is None
    assert "Handler 'reconcile' failed temporarily" in first.output

    with operator_running(c):
        done = reconciled(c, ns)
        assert conditions(done)["ConfigValid"]["status"] == "True"
        after_second = wait_for(lambda: (s := _snapshot(c, ns))["services"] and s, what="the Service")
    assert [len(after_second[k]) for k in ("configmaps", "services", "deployments")] == [1, 1, 1]
    assert all(owners == 1 for kind in after_second.values() for (_, _, owners) in kind)
    deployment = c.get("apps/v1", "deployments", ns, "smollm2")
    assert deployment is not None and deployment["metadata"]["generation"] == 1  # applied again, unchanged

    # A third start on a finished object: resume re-applies everything and changes nothing.
    mark = c.server.mark()
    with operator_running(c):
        wait_for(lambda: c.server.requests_since(mark, "PATCH", rf"/namespaces/{ns}/services/smollm2\?"),
                 what="the resumed reconcile to apply the Service")
    assert _snapshot(c, ns) == after_second
