"""The fixes to kmock's emulator that Kopf and kubectl rely on, checked over HTTP."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from .conftest import Cluster, install_inference_pool, install_lws

CM = "/api/v1/namespaces/emu/configmaps"


def call(c: Cluster, method: str, path: str, body: Any = None, content_type: str = "application/json") -> tuple[int, Any]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    req = urllib.request.Request(c.server.url + path, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def watch(c: Cluster, path: str) -> list[dict[str, Any]]:
    """The events a short watch (timeoutSeconds=1) streams, one JSON object per line."""
    with urllib.request.urlopen(c.server.url + path, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        return [json.loads(line) for line in resp.read().splitlines() if line.strip()]


def test_discovery_names_the_core_group_version_v1(cluster: Cluster) -> None:
    assert cluster.api("/api/v1")["groupVersion"] == "v1"  # type: ignore[index]
    assert cluster.api("/api")["versions"] == ["v1"]  # type: ignore[index]
    assert cluster.api("/apis/autoscaling")["preferredVersion"]["version"] == "v2"  # type: ignore[index]
    assert cluster.api("/version")["gitVersion"] == "v1.34.0"  # type: ignore[index]
    names = {n["metadata"]["name"] for n in cluster.api("/api/v1/namespaces")["items"]}  # type: ignore[index]
    assert {"default", "kube-system"} <= names


def test_objects_get_metadata_and_lists_get_kind(cluster: Cluster) -> None:
    status, created = call(cluster, "POST", CM, {"metadata": {"generateName": "cfg-"}, "data": {"a": "1"}})
    assert status == 201
    meta = created["metadata"]
    assert meta["name"].startswith("cfg-") and len(meta["name"]) == 9
    assert meta["namespace"] == "emu" and meta["uid"] and meta["generation"] == 1
    assert int(meta["resourceVersion"]) > 0 and meta["creationTimestamp"].endswith("Z")
    listing = cluster.api(CM)
    assert listing["kind"] == "ConfigMapList" and listing["apiVersion"] == "v1"  # type: ignore[index]
    assert int(listing["metadata"]["resourceVersion"]) >= int(meta["resourceVersion"])  # type: ignore[index]
    assert call(cluster, "POST", CM, {"metadata": {"name": meta["name"]}})[0] == 409


def test_generation_follows_spec_and_status_is_a_subresource(cluster: Cluster) -> None:
    path = "/apis/apps/v1/namespaces/emu/deployments"
    call(cluster, "POST", path, {"metadata": {"name": "d"}, "spec": {"replicas": 1}, "status": {"replicas": 9}})
    d = cluster.api(path + "/d")
    assert d["metadata"]["generation"] == 1 and "status" not in d  # type: ignore[index]
    _, d = call(cluster, "PATCH", path + "/d", {"metadata": {"labels": {"x": "y"}}, "status": {"replicas": 5}},
                "application/merge-patch+json")
    assert d["metadata"]["generation"] == 1 and "status" not in d
    _, d = call(cluster, "PATCH", path + "/d/status", {"spec": {"replicas": 7}, "status": {"replicas": 5}},
                "application/merge-patch+json")
    assert d["status"] == {"replicas": 5} and d["spec"]["replicas"] == 1 and d["metadata"]["generation"] == 1
    _, d = call(cluster, "PATCH", path + "/d", {"spec": {"replicas": 2}}, "application/merge-patch+json")
    assert d["metadata"]["generation"] == 2
    rv = d["metadata"]["resourceVersion"]
    _, same = call(cluster, "PATCH", path + "/d", {"spec": {"replicas": 2}}, "application/merge-patch+json")
    assert same["metadata"]["resourceVersion"] == rv  # a no-op write is not a change
    _, scale = call(cluster, "GET", path + "/d/scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 2


def test_patch_errors_are_kubernetes_statuses(cluster: Cluster) -> None:
    call(cluster, "POST", CM, {"metadata": {"name": "p"}, "data": {"a": "1"}})
    status, body = call(cluster, "PATCH", CM + "/p", [{"op": "test", "path": "/data/a", "value": "2"}],
                        "application/json-patch+json")
    assert status == 422 and body["kind"] == "Status" and body["reason"] == "Invalid"
    status, body = call(cluster, "PATCH", CM + "/p", {"metadata": {"resourceVersion": "1"}, "data": {"a": "3"}},
                        "application/merge-patch+json")
    assert status == 409 and body["reason"] == "Conflict"
    assert call(cluster, "GET", CM + "/missing")[0] == 404


def test_server_side_apply_creates_then_updates_from_yaml(cluster: Cluster) -> None:
    body = b"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ssa\ndata:\n  k: v1\n"
    path = CM + "/ssa?fieldManager=test&force=true"
    status, created = call(cluster, "PATCH", path, body, "application/apply-patch+yaml")
    assert status == 201 and created["data"] == {"k": "v1"} and created["metadata"]["uid"]  # created: 201
    _, updated = call(cluster, "PATCH", path, body.replace(b"v1\n", b"v2\n"), "application/apply-patch+yaml")
    assert updated["data"] == {"k": "v2"} and updated["metadata"]["uid"] == created["metadata"]["uid"]


def test_watch_resumes_after_a_resource_version(cluster: Cluster) -> None:
    _, first = call(cluster, "POST", CM, {"metadata": {"name": "w1"}})
    _, second = call(cluster, "POST", CM, {"metadata": {"name": "w2"}})
    call(cluster, "DELETE", CM + "/w1")
    events = watch(cluster, f"{CM}?watch=true&timeoutSeconds=1&resourceVersion={first['metadata']['resourceVersion']}")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "w2"), ("DELETED", "w1")]
    assert second["metadata"]["name"] == "w2"
    fresh = watch(cluster, f"{CM}?watch=true&timeoutSeconds=1&fieldSelector=metadata.name%3Dw2")
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in fresh] == [("ADDED", "w2")]


def test_finalizers_delay_deletion(cluster: Cluster) -> None:
    call(cluster, "POST", CM, {"metadata": {"name": "f", "finalizers": ["test/hold"]}})
    _, marked = call(cluster, "DELETE", CM + "/f")
    assert marked["metadata"]["deletionTimestamp"]
    assert cluster.api(CM + "/f") is not None
    call(cluster, "PATCH", CM + "/f", {"metadata": {"finalizers": None}}, "application/merge-patch+json")
    assert cluster.api(CM + "/f") is None


@pytest.mark.parametrize("selector, names", [("tier=web", ["l1"]), ("tier!=web", ["l2"]), ("tier in (web,db)", ["l1", "l2"])])
def test_label_selectors(cluster: Cluster, selector: str, names: list[str]) -> None:
    path = "/api/v1/namespaces/labels/configmaps"
    for name, tier in (("l1", "web"), ("l2", "db")):
        if cluster.api(f"{path}/{name}") is None:
            call(cluster, "POST", path, {"metadata": {"name": name, "labels": {"tier": tier}}})
    found = cluster.api(path + "?labelSelector=" + urllib.request.quote(selector))
    assert sorted(o["metadata"]["name"] for o in found["items"]) == names  # type: ignore[index]


def test_a_leaderworkerset_is_judged_by_its_published_schema(cluster: Cluster) -> None:
    """LeaderWorkerSet's own CRD (fixtures/): its objects are defaulted, pruned and validated by its
    openAPIV3Schema, list types included, as an API server with LWS installed would."""
    install_lws(cluster)
    path = "/apis/leaderworkerset.x-k8s.io/v1/namespaces/emu/leaderworkersets"
    pod = {"spec": {"containers": [{"name": "c", "image": "i", "madeUp": 1}]}}
    status, created = call(cluster, "POST", path, {"metadata": {"name": "g"}, "spec": {
        "leaderWorkerTemplate": {"size": 2, "workerTemplate": pod, "extra": True}}})
    assert status == 201, created
    lwt = created["spec"]["leaderWorkerTemplate"]
    assert "extra" not in lwt and "madeUp" not in lwt["workerTemplate"]["spec"]["containers"][0]  # pruned
    assert lwt["restartPolicy"] == "RecreateGroupOnPodRestart" and created["spec"]["replicas"] == 1  # defaults
    assert created["spec"]["startupPolicy"] == "LeaderCreated"
    status, refused = call(cluster, "POST", path, {"metadata": {"name": "h"}, "spec": {
        "leaderWorkerTemplate": {"size": "two", "workerTemplate": pod}}})
    assert status == 422 and "spec.leaderWorkerTemplate.size: 'two' is not of type 'integer'" in refused["message"]
    twins = {"spec": {"containers": [{"name": "c", "image": "i"}, {"name": "c", "image": "j"}]}}
    status, refused = call(cluster, "POST", path, {"metadata": {"name": "h"}, "spec": {
        "leaderWorkerTemplate": {"workerTemplate": twins}}})
    assert status == 422, refused
    assert 'spec.leaderWorkerTemplate.workerTemplate.spec.containers[1]: Duplicate value: {"name": "c"}' in refused["message"]
    status, refused = call(cluster, "POST", path, {"metadata": {"name": "h"}, "spec": {}})
    assert status == 422 and "'leaderWorkerTemplate' is a required property" in refused["message"]
    scale = cluster.api(path + "/g/scale")  # LWS declares the scale subresource
    assert scale["spec"]["replicas"] == 1  # type: ignore[index]


def test_an_inference_pool_is_judged_by_its_published_schema(cluster: Cluster) -> None:
    """The inference extension's own InferencePool CRD (fixtures/): defaults, pruning, and its CEL rules."""
    install_inference_pool(cluster)
    path = "/apis/inference.networking.k8s.io/v1/namespaces/emu/inferencepools"
    good = {"selector": {"matchLabels": {"app": "m"}}, "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
    status, created = call(cluster, "POST", path, {"metadata": {"name": "p"}, "spec": {**good, "extra": 1}})
    assert status == 201, created
    assert "extra" not in created["spec"]  # pruned
    assert created["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"  # defaulted
    no_port = {**good, "endpointPickerRef": {"name": "epp"}}  # a Service needs a port (a CEL rule)
    status, refused = call(cluster, "POST", path, {"metadata": {"name": "q"}, "spec": no_port})
    assert status == 422 and "port is required when kind is 'Service' or unspecified" in refused["message"], refused
    twice = {**good, "targetPorts": [{"number": 8000}, {"number": 8000}]}  # another CEL rule
    status, refused = call(cluster, "POST", path, {"metadata": {"name": "q"}, "spec": twice})
    assert status == 422, refused
    status, refused = call(cluster, "POST", path, {"metadata": {"name": "q"}, "spec": {**good, "targetPorts": []}})
    assert status == 422, refused


def test_lists_come_in_pages_and_watches_filter_by_label(cluster: Cluster) -> None:
    for i in range(5):
        call(cluster, "POST", "/api/v1/namespaces/pages/configmaps",
             {"metadata": {"name": f"p{i}", "labels": {"mine": "yes" if i % 2 else "no"}}})
    status, first = call(cluster, "GET", "/api/v1/namespaces/pages/configmaps?limit=2")
    assert status == 200 and [o["metadata"]["name"] for o in first["items"]] == ["p0", "p1"]
    assert first["metadata"]["remainingItemCount"] == 3
    names, page = [], first
    while page["metadata"].get("continue"):
        names += [o["metadata"]["name"] for o in page["items"]]
        status, page = call(cluster, "GET", f"/api/v1/namespaces/pages/configmaps?limit=2&continue={page['metadata']['continue']}")
        assert page["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert names + [o["metadata"]["name"] for o in page["items"]] == ["p0", "p1", "p2", "p3", "p4"]
    assert call(cluster, "GET", "/api/v1/namespaces/pages/configmaps?limit=2&continue=nonsense")[0] == 400
    # kubectl pages by 500 by default; --chunk-size pages smaller
    out = cluster.kubectl("get", "configmaps", "-n", "pages", "--chunk-size=2", "-o", "name").stdout.split()
    assert out == [f"configmap/p{i}" for i in range(5)]
    rv = first["metadata"]["resourceVersion"]
    call(cluster, "PATCH", "/api/v1/namespaces/pages/configmaps/p0", {"data": {"a": "1"}}, "application/merge-patch+json")
    call(cluster, "PATCH", "/api/v1/namespaces/pages/configmaps/p1", {"data": {"a": "1"}}, "application/merge-patch+json")
    events = watch(cluster, f"/api/v1/namespaces/pages/configmaps?watch=true&labelSelector=mine%3Dyes"
                            f"&resourceVersion={rv}&timeoutSeconds=1")
    assert [e["object"]["metadata"]["name"] for e in events] == ["p1"]


def test_a_crd_whose_rule_cost_is_unbounded_is_refused(cluster: Cluster) -> None:
    """The API server estimates each CEL rule's cost at CRD create and update: a macro over a list
    without maxItems, reading strings without maxLength, is over the per-rule budget."""
    def crd(bounded: bool) -> dict[str, Any]:
        items: dict[str, Any] = {"type": "object", "properties": {"name": {"type": "string"}}}
        volumes: dict[str, Any] = {"type": "array", "items": items,
                                   "x-kubernetes-validations": [{"rule": "self.all(v, v.name != 'config')"}]}
        if bounded:
            volumes["maxItems"], items["properties"]["name"]["maxLength"] = 64, 63
        return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                "metadata": {"name": "costs.example.com"},
                "spec": {"group": "example.com", "scope": "Namespaced",
                         "names": {"plural": "costs", "singular": "cost", "kind": "Cost"},
                         "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                             "type": "object", "properties": {"spec": {"type": "object", "properties": {
                                 "volumes": volumes}}}}}}]}}  # fmt: skip
    status, body = call(cluster, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd(False))
    assert status == 422 and "estimated rule cost exceeds budget" in body["message"], body
    assert "properties[spec].properties[volumes].x-kubernetes-validations[0].rule" in body["message"]
    assert call(cluster, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd(True))[0] == 201


def test_quota_and_terminating_namespaces_are_403s(cluster: Cluster) -> None:
    call(cluster, "POST", "/api/v1/namespaces/q/resourcequotas",
         {"metadata": {"name": "small"}, "spec": {"hard": {"count/deployments.apps": "1", "configmaps": "0"}}})
    status, body = call(cluster, "POST", "/api/v1/namespaces/q/configmaps", {"metadata": {"name": "a"}})
    assert status == 403 and body["reason"] == "Forbidden"
    assert body["message"] == ('configmaps "a" is forbidden: exceeded quota: small, requested: configmaps=1, '
                               "used: configmaps=0, limited: configmaps=0")
    dep = {"metadata": {"name": "d"}, "spec": {"selector": {"matchLabels": {"a": "b"}},
                                               "template": {"metadata": {"labels": {"a": "b"}}}}}
    assert call(cluster, "POST", "/apis/apps/v1/namespaces/q/deployments", dep)[0] == 201
    assert call(cluster, "POST", "/apis/apps/v1/namespaces/q/deployments", {**dep, "metadata": {"name": "e"}})[0] == 403
    assert call(cluster, "POST", "/api/v1/namespaces/q/services", {"metadata": {"name": "s"}})[0] == 201  # no limit

    # deleted, held by a finalizer while its content goes: terminating
    call(cluster, "POST", "/api/v1/namespaces", {"metadata": {"name": "leaving", "finalizers": ["kubernetes"]}})
    assert call(cluster, "DELETE", "/api/v1/namespaces/leaving")[0] == 200
    status, body = call(cluster, "POST", "/api/v1/namespaces/leaving/configmaps", {"metadata": {"name": "a"}})
    assert status == 403 and "because it is being terminated" in body["message"]


def _apply(cluster: Cluster, path: str, body: dict[str, Any], manager: str, force: bool = False) -> tuple[int, Any]:
    query = f"?fieldManager={manager}" + ("&force=true" if force else "")
    return call(cluster, "PATCH", path + query, body, "application/apply-patch+yaml")


def test_server_side_apply_keeps_field_ownership(cluster: Cluster) -> None:
    path = "/api/v1/namespaces/ssa/configmaps/owned"
    assert _apply(cluster, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owned"},
                                  "data": {"a": "1", "b": "2", "old": "x"}}, "one")[0] == 201
    # another manager updates b and adds c: those fields are its own now
    call(cluster, "PATCH", path + "?fieldManager=two", {"data": {"b": "3", "c": "4"}}, "application/merge-patch+json")
    status, body = _apply(cluster, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owned"},
                                          "data": {"a": "1", "b": "2"}}, "one")  # fmt: skip
    assert status == 409 and body["message"] == 'Apply failed with 1 conflict:\n- conflict with "two": .data.b'
    # forced, b changes hands; "old", applied before by "one" and left out now, goes; c, two's, stays
    status, body = _apply(cluster, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owned"},
                                          "data": {"a": "1", "b": "2"}}, "one", force=True)  # fmt: skip
    assert status == 200 and body["data"] == {"a": "1", "b": "2", "c": "4"}
    # the same apply again changes nothing; leaving b out now removes it (one owns it alone)
    rv = body["metadata"]["resourceVersion"]
    assert _apply(cluster, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owned"},
                                  "data": {"a": "1", "b": "2"}}, "one")[1]["metadata"]["resourceVersion"] == rv
    status, body = _apply(cluster, path, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owned"},
                                          "data": {"a": "1"}}, "one")  # fmt: skip
    assert body["data"] == {"a": "1", "c": "4"}
    assert _apply(cluster, path, {"data": {}}, "")[0] == 422  # apply needs a field manager


def test_an_autoscalers_replicas_conflict_with_a_server_side_apply_that_sets_them(crd_cluster: Cluster) -> None:
    """The HPA writes spec.replicas through the scale subresource (its manager, from its User-Agent,
    owns the field); a `kubectl apply --server-side` of a manifest that sets replicas then conflicts,
    one that leaves replicas out keeps the autoscaler's (docs/kubernetes.md: leave replicas out)."""
    c, ns = crd_cluster, "ssa-hpa"
    manifest = {"apiVersion": "cbserve.io/v1alpha1", "kind": "CBDeployment", "metadata": {"name": "m", "namespace": ns},
                "spec": {"model": {"uri": "/models/m"}, "replicas": 1}}  # fmt: skip
    c.kubectl("apply", "--server-side", "--validate=false", "-f", "-", input=json.dumps(manifest))
    req = urllib.request.Request(f"{c.server.url}/apis/cbserve.io/v1alpha1/namespaces/{ns}/cbdeployments/m/scale",
                                 data=json.dumps({"spec": {"replicas": 3}}).encode(), method="PATCH", headers={
                                     "Content-Type": "application/merge-patch+json",
                                     "User-Agent": "kube-controller-manager/v1.34.0 (linux/amd64) kubernetes/abc"})
    urllib.request.urlopen(req, timeout=10).close()
    again = c.kubectl("apply", "--server-side", "--validate=false", "-f", "-", input=json.dumps(manifest), check=False)
    assert again.returncode != 0 and 'conflict with "kube-controller-manager"' in again.stderr
    assert ".spec.replicas" in again.stderr
    del manifest["spec"]["replicas"]
    c.kubectl("apply", "--server-side", "--validate=false", "-f", "-", input=json.dumps(manifest))
    assert c.get("cbserve.io/v1alpha1", "cbdeployments", ns, "m")["spec"]["replicas"] == 3  # type: ignore[index]
