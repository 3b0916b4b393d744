"""The operator on a busy cluster: 20,000 ConfigMaps and 20,000 Deployments of other apps.

Its watches of children carry the managed-by label selector to the API server and its first lists
come in pages, so what it receives, the requests it makes and its memory do not grow with the
cluster. The operator runs as its own process (`python -m cbserve_operator`), so its peak RSS is its own.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from urllib.parse import parse_qs, urlsplit

from kmock import resource

from cbserve_operator.settings import LIST_CHUNK_SIZE, MANAGED_SELECTOR, WATCHED_CHILDREN

from .conftest import Cluster, _healthy, free_port, wait_for
from .emulator import Emulator
from .test_operator import EXAMPLE, apply, cbd, reconciled

FOREIGN = 20_000  # of each kind
NAMESPACES = 40
OPERATOR_AGENTS = ("kopf/", "cbserve-operator")
# The operator's peak resident memory on this cluster, in MiB (67 measured; the chart's limit is 256).
PEAK_RSS_MIB = 150


def _fill(emulator: Emulator) -> None:
    """Other teams' objects, stored as they would be before the operator starts."""
    for n in range(NAMESPACES):
        emulator._store_new(resource("", "v1", "namespaces"), None,
                            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": f"team-{n}"}})
    for i in range(FOREIGN):
        ns, labels = f"team-{i % NAMESPACES}", {"app": f"app-{i}"}
        emulator._store_new(resource("", "v1", "configmaps"), ns, {
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"settings-{i}", "labels": labels},
            "data": {"settings.json": json.dumps({"feature": i, "padding": "x" * 1000})}})
        emulator._store_new(resource("apps", "v1", "deployments"), ns, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"app-{i}", "labels": labels},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "app", "image": "registry.example.com/app:1.0",
                                         "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}}]}}},
            "status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 1}})


def _peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read())[1]) / 1024  # type: ignore[index]


def _patch_status(c: Cluster, path: str, status: dict[str, object]) -> None:
    req = urllib.request.Request(c.server.url + path + "/status", method="PATCH", data=json.dumps(
        {"status": status}).encode(), headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    urllib.request.urlopen(req, timeout=10).close()


def test_the_operator_takes_in_only_its_own_objects_on_a_busy_cluster(crd_cluster: Cluster) -> None:
    c = crd_cluster
    c.server.call(_fill)
    emulator = c.server.emulator
    assert emulator is not None
    mark = c.server.mark()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cbserve_operator", "--liveness", f"http://127.0.0.1:{port}/healthz"],
                            env=c.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(port), timeout=60, what="the operator to come up")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        apply(c, "team-0", EXAMPLE)
        reconciled(c, "team-0")

        # Other apps' churn (an HPA's status, a rollout's) reaches the operator no more.
        received = sum(n for agent, n in emulator.items_sent.items() if agent.startswith(OPERATOR_AGENTS))
        for i in range(0, 200, 2):
            _patch_status(c, f"/apis/apps/v1/namespaces/team-{i % NAMESPACES}/deployments/app-{i}", {"readyReplicas": 1})
        # ... while its own Deployment's does, at once.
        generation = c.get("apps/v1", "deployments", "team-0", "smollm2")["metadata"]["generation"]  # type: ignore[index]
        _patch_status(c, "/apis/apps/v1/namespaces/team-0/deployments/smollm2", {
            "observedGeneration": generation, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1})
        wait_for(lambda: cbd(c, "team-0")["status"].get("phase") == "Ready", what="phase Ready")
        peak = _peak_rss_mib(proc.pid)
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output

    requests = [(m, p) for m, p, agent in emulator.journal[mark:] if agent.startswith(OPERATOR_AGENTS)]
    sent = sum(n for agent, n in emulator.items_sent.items() if agent.startswith(OPERATOR_AGENTS))
    print(f"\nbusy cluster: {FOREIGN} ConfigMaps and {FOREIGN} Deployments of others; operator: peak RSS "
          f"{peak:.0f} MiB, {len(requests)} requests, {sent} objects received")
    assert sent - received <= 10, "only the operator's own Deployment's events after the foreign churn"
    assert sent < 100
    assert len(requests) < 150
    assert not [p for _, p in requests if re.search(r"/(settings|app)-\d+\b", p)]
    plurals = {plural for _, _, plural in WATCHED_CHILDREN}
    for method, path in requests:
        url = urlsplit(path)
        query = parse_qs(url.query)
        parts = url.path.rstrip("/").split("/")
        if method != "GET" or parts[-1] not in plurals:
            continue  # one object, by name
        assert MANAGED_SELECTOR in query.get("labelSelector", [""])[0], path
        if "watch" not in query and "/namespaces/" not in url.path:
            assert query.get("limit") == [str(LIST_CHUNK_SIZE)], path  # Kopf's cluster-wide initial list
    assert peak < PEAK_RSS_MIB, f"peak RSS {peak:.0f} MiB"


def test_every_watched_child_kind_has_the_server_side_selector() -> None:
    """A handler on a new child kind without its selector would take in the whole cluster again."""
    import kopf

    import cbserve_operator.handlers  # noqa: F401 - registers the handlers

    watched = {(h.selector.group, h.selector.version, h.selector.any_name)
               for h in kopf.get_default_registry()._watching.get_all_handlers()}  # fmt: skip
    assert watched == set(WATCHED_CHILDREN)
