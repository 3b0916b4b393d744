"""The periodic resync (CBSERVE_RESYNC_SECONDS): a repair that failed is not forgotten."""

from __future__ import annotations

import pytest

from .conftest import Cluster, operator_running, wait_for
from .test_operator import EXAMPLE, apply, reconciled


def test_a_failed_repair_is_made_at_the_next_resync(crd_cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    c, ns = crd_cluster, "resync"
    monkeypatch.setenv("CBSERVE_RESYNC_SECONDS", "1")
    with operator_running(c):
        apply(c, ns, EXAMPLE)
        reconciled(c, ns)
        # The Service is deleted; the repair on its DELETED event meets a 409 (a conflict the API server
        # answers now and then), and no further event comes for an object that is gone.
        gate = c.server.hold("PATCH", rf"/namespaces/{ns}/services/smollm2\?")
        c.kubectl("delete", "service", "smollm2", "-n", ns)
        assert gate.arrived.wait(30), "the repair never came"
        gate.release(fail_status=409)
        wait_for(lambda: c.get("v1", "services", ns, "smollm2"), what="the Service, from the resync")
        # a resync of a CBDeployment in sync writes nothing
        mark = c.server.mark()
        wait_for(lambda: len(c.server.requests_since(mark, "GET", rf"/namespaces/{ns}/cbdeployments/smollm2$")) >= 4,
                 what="two more resync rounds")  # fmt: skip
        assert not [p for p in c.server.requests_since(mark, "PATCH", rf"/namespaces/{ns}/")
                    if "/status" in p]  # fmt: skip
