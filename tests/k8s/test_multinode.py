"""Tensor parallel on Kubernetes: a pod's GPUs are its tensor-parallel size, and `resources.nodes` > 1
makes each replica a multi-node group, a LeaderWorkerSet (LWS's published CRD installed in the
emulator, which judges every LeaderWorkerSet by its schema). The operator runs for real; nothing runs
pods here, so a test writes the LeaderWorkerSet's status the way LWS's controller would."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kopf.testing import KopfRunner

from cbserve_operator import spec as spec_module
from cbserve_operator.children import render_children

from .conftest import Cluster, install_lws, operator_running, wait_for
from .test_operator import CBD, apply, cbd, cluster_role_grants, conditions, example, operator_requests, reconciled

LWS = "leaderworkerset.x-k8s.io/v1"
SERVE = ["cbserve", "serve", "--model", "/models/models/SmolLM2-135M-Instruct", "--served-model-name", "smollm2",
         "--port", "8000", "--config", "/etc/cbserve/engine.yaml", "--drain-timeout", "105", "--device", "cuda"]
LEADER_FLAGS = ["--tensor-parallel-size", "4", "--nnodes", "2", "--dist-addr", "$(LWS_LEADER_ADDRESS)",
                "--dist-port", "29500"]
WORKER = ["cbserve", "worker", "--model", "/models/models/SmolLM2-135M-Instruct", "--config",
          "/etc/cbserve/engine.yaml", "--device", "cuda", "--tensor-parallel-size", "4", "--nnodes", "2",
          "--node-rank", "$(LWS_WORKER_INDEX)", "--dist-addr", "$(LWS_LEADER_ADDRESS)", "--dist-port", "29500"]


@pytest.fixture(scope="module")
def lws_operator(crd_cluster: Cluster) -> Iterator[KopfRunner]:
    install_lws(crd_cluster)
    with operator_running(crd_cluster) as (runner, _port):
        yield runner
    assert runner.exception is None, runner.output


def two_nodes(**changes: Any) -> dict[str, Any]:
    """The example, as groups of two pods with two GPUs each (tensor-parallel size 4)."""
    return example(resources__gpu=2, resources__nodes=2, **changes)


def group_of(c: Cluster, ns: str) -> dict[str, Any] | None:
    return c.get(LWS, "leaderworkersets", ns, "smollm2-group")


def contains(sent: Any, stored: Any, path: str = "") -> list[str]:
    """Where `stored` lacks or changed what `sent` holds (the API server may add defaults, not drop)."""
    if isinstance(sent, dict):
        if not isinstance(stored, dict):
            return [path]
        return [p for k, v in sent.items() for p in contains(v, stored.get(k), f"{path}.{k}")]
    if isinstance(sent, list):
        if not isinstance(stored, list) or len(stored) != len(sent):
            return [path]
        return [p for i, (a, b) in enumerate(zip(sent, stored)) for p in contains(a, b, f"{path}[{i}]")]
    return [] if sent == stored else [path]


def test_one_pod_with_four_gpus_is_one_tensor_parallel_engine(lws_operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "tp"
    apply(c, ns, example(resources__gpu=4))
    reconciled(c, ns)
    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    assert dep is not None and group_of(c, ns) is None
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == [*SERVE, "--tensor-parallel-size", "4"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"


def test_two_nodes_of_two_gpus_are_a_leaderworkerset(lws_operator: KopfRunner, crd_cluster: Cluster) -> None:
    """The group as rendered: the leader serves (rank 0, probes, the Service's endpoint), the worker
    joins it through the headless Service; both mount the one engine ConfigMap; the API server kept
    every field (LWS's schema knows them all) and the CRD's printer columns show it."""
    c, ns = crd_cluster, "group"
    manifest = two_nodes(replicas=2, model__numKeyValueHeads=8, engine__extraArgs=["--seed", "7"])
    apply(c, ns, manifest)
    owner = reconciled(c, ns)
    assert c.get("apps/v1", "deployments", ns, "smollm2") is None
    lws = group_of(c, ns)
    assert lws is not None
    (ref,) = lws["metadata"]["ownerReferences"]
    assert ref["uid"] == owner["metadata"]["uid"] and ref["controller"] is True
    spec = lws["spec"]
    lwt = spec["leaderWorkerTemplate"]
    assert (spec["replicas"], lwt["size"], lwt["restartPolicy"]) == (2, 2, "RecreateGroupOnPodRestart")
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once the workers joined
    assert spec["rolloutStrategy"] == {"type": "RollingUpdate", "rollingUpdateConfiguration": {
        "maxSurge": 0, "maxUnavailable": 1, "partition": 0}}  # a GPU group at a time; partition: LWS's default

    leader, worker = (lwt[t]["spec"]["containers"][0] for t in ("leaderTemplate", "workerTemplate"))
    assert leader["command"] == [*SERVE, *LEADER_FLAGS, "--seed", "7"]
    assert worker["command"] == WORKER  # the engine settings come from the ConfigMap; extraArgs are serve's
    for container in (leader, worker):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert [p["name"] for p in leader["ports"]] == ["http", "dist"]
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready" and leader["startupProbe"]["failureThreshold"] == 180
    assert not {"ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"} & set(worker)
    volumes = [{v["name"]: v for v in lwt[t]["spec"]["volumes"]} for t in ("leaderTemplate", "workerTemplate")]
    config_map = volumes[0]["config"]["configMap"]["name"]
    assert volumes[1]["config"] == volumes[0]["config"] and c.get("v1", "configmaps", ns, config_map) is not None
    labels = [lwt[t]["metadata"]["labels"]["app.kubernetes.io/component"] for t in ("leaderTemplate", "workerTemplate")]
    assert labels == ["server", "worker"]
    parsed = spec_module.parse_spec("smollm2", manifest["spec"])
    (sent,) = [o for o in render_children(parsed, ns)[0] if o["kind"] == "LeaderWorkerSet"]
    assert contains(sent["spec"], spec) == []  # nothing pruned, nothing changed

    headless = c.get("v1", "services", ns, "smollm2-group")
    assert headless is not None and headless["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]
    assert headless["spec"] == {"clusterIP": "None", "publishNotReadyAddresses": True,
                                "selector": {"leaderworkerset.sigs.k8s.io/name": "smollm2-group"}}
    serving = c.get("v1", "services", ns, "smollm2")
    assert serving is not None and serving["spec"]["selector"] == {
        "app.kubernetes.io/name": "cbserve", "app.kubernetes.io/instance": "smollm2",
        "app.kubernetes.io/component": "server"}  # the leaders: workers serve no HTTP
    assert owner["status"]["selector"] == ("app.kubernetes.io/component=server,app.kubernetes.io/instance=smollm2,"
                                           "app.kubernetes.io/name=cbserve")  # what an HPA averages over  # fmt: skip
    assert conditions(owner)["Ready"]["message"] == "0/2 groups ready"
    table = c.kubectl("get", "leaderworkersets", "-n", ns).stdout.splitlines()
    assert table[0].split()[:3] == ["NAME", "READY", "DESIRED"] and table[1].split()[0] == "smollm2-group"


def _group_status(c: Cluster, ns: str, ready: int) -> None:
    """What LWS's controller writes (its status schema requires whole conditions)."""
    lws = group_of(c, ns)
    assert lws is not None
    condition = {"type": "Available", "status": "True" if ready else "False", "reason": "AllGroupsReady",
                 "message": "All replicas are ready", "lastTransitionTime": "2026-11-26T00:00:00Z"}
    status = {"observedGeneration": lws["metadata"]["generation"], "replicas": 2, "readyReplicas": ready,
              "updatedReplicas": 2, "hpaPodSelector": "leaderworkerset.sigs.k8s.io/name=smollm2-group,"
              "leaderworkerset.sigs.k8s.io/worker-index=0", "conditions": [condition]}  # fmt: skip
    c.kubectl("patch", "leaderworkerset", "smollm2-group", "-n", ns, "--subresource=status", "--type", "merge",
              "-p", json.dumps({"status": status}))  # fmt: skip


def test_the_groups_readiness_is_the_cbdeployments(lws_operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "group-ready"
    apply(c, ns, two_nodes(replicas=2))
    reconciled(c, ns)
    _group_status(c, ns, ready=1)
    half = wait_for(lambda: (o := cbd(c, ns))["status"].get("readyReplicas") == 1 and o, what="readyReplicas 1")
    assert half["status"]["phase"] == "Progressing" and conditions(half)["Ready"]["message"] == "1/2 groups ready"
    _group_status(c, ns, ready=2)
    ready = wait_for(lambda: (o := cbd(c, ns))["status"].get("phase") == "Ready" and o, what="phase Ready")
    assert ready["status"]["readyReplicas"] == 2 and ready["status"]["replicas"] == 2
    assert conditions(ready)["Ready"]["reason"] == "AllReplicasReady"
    assert conditions(ready)["Progressing"]["message"] == "every group runs the current spec"


def test_a_deleted_or_edited_group_comes_back(lws_operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "group-drift"
    apply(c, ns, two_nodes())
    reconciled(c, ns)
    old = group_of(c, ns)
    assert old is not None
    c.kubectl("delete", "leaderworkerset", "smollm2-group", "-n", ns)
    new = wait_for(lambda: (g := group_of(c, ns)) and g["metadata"]["uid"] != old["metadata"]["uid"] and g,
                   what="the LeaderWorkerSet to be recreated")
    assert new["spec"] == old["spec"]
    wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "LeaderWorkerSetRecreated"],
             what="a LeaderWorkerSetRecreated Event")
    c.kubectl("patch", "leaderworkerset", "smollm2-group", "-n", ns, "--type", "merge",
              "-p", '{"spec": {"leaderWorkerTemplate": {"size": 3}}}')  # fmt: skip
    wait_for(lambda: group_of(c, ns)["spec"]["leaderWorkerTemplate"]["size"] == 2,  # type: ignore[index]
             what="the group size put back")
    wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "LeaderWorkerSetRestored"],
             what="a LeaderWorkerSetRestored Event")
    c.kubectl("delete", "service", "smollm2-group", "-n", ns)
    wait_for(lambda: c.get("v1", "services", ns, "smollm2-group"), what="the headless Service to be recreated")


def test_switching_between_one_and_two_nodes_keeps_one_kind(lws_operator: KopfRunner, crd_cluster: Cluster) -> None:
    """nodes 1 -> 2 deletes the Deployment; 2 -> 1 deletes the LeaderWorkerSet and its headless
    Service; the serving Service stays (its selector follows) and status follows the kind that runs."""
    c, ns = crd_cluster, "switch"
    apply(c, ns, example(resources__gpu=2))
    reconciled(c, ns)
    assert c.get("apps/v1", "deployments", ns, "smollm2") is not None and group_of(c, ns) is None
    service_uid = c.get("v1", "services", ns, "smollm2")["metadata"]["uid"]  # type: ignore[index]

    apply(c, ns, two_nodes())
    multi = reconciled(c, ns)
    assert group_of(c, ns) is not None and c.get("v1", "services", ns, "smollm2-group") is not None
    wait_for(lambda: c.get("apps/v1", "deployments", ns, "smollm2") is None, what="the Deployment to go")
    assert conditions(cbd(c, ns))["Ready"]["reason"] == "ReplicasNotReady"  # the group's, not a missing Deployment
    assert "groups" in conditions(multi)["Ready"]["message"]

    apply(c, ns, example(resources__gpu=2))
    single = reconciled(c, ns)
    assert c.get("apps/v1", "deployments", ns, "smollm2") is not None
    wait_for(lambda: group_of(c, ns) is None and c.get("v1", "services", ns, "smollm2-group") is None,
             what="the LeaderWorkerSet and its headless Service to go")
    assert conditions(single)["Ready"]["message"] == "0/1 pods ready"
    assert single["status"]["selector"] == "app.kubernetes.io/instance=smollm2,app.kubernetes.io/name=cbserve"
    assert c.get("v1", "services", ns, "smollm2")["metadata"]["uid"] == service_uid  # type: ignore[index]


def test_groups_scale_and_autoscale_through_the_cbdeployment(lws_operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "group-scale"
    apply(c, ns, two_nodes(autoscaling={"enabled": True, "maxReplicas": 4}))
    reconciled(c, ns)
    hpa = c.get("autoscaling/v2", "horizontalpodautoscalers", ns, "smollm2")
    assert hpa is not None and hpa["spec"]["scaleTargetRef"] == {"apiVersion": CBD, "kind": "CBDeployment",
                                                                "name": "smollm2"}  # fmt: skip
    c.kubectl("scale", "cbd", "smollm2", "-n", ns, "--replicas=3")
    wait_for(lambda: group_of(c, ns)["spec"]["replicas"] == 3, what="3 groups")  # type: ignore[index]
    scale = c.api(f"/apis/{CBD}/namespaces/{ns}/cbdeployments/smollm2/scale")
    assert scale["status"]["selector"].startswith("app.kubernetes.io/component=server,")  # type: ignore[index]


def test_the_cluster_role_covers_the_groups(crd_cluster: Cluster, tools: Any) -> None:
    """Runs last in this module: every request the operator made for the tests above is granted, and
    every LeaderWorkerSet grant was used (test_operator.py checks the rest)."""
    allowed, made = cluster_role_grants(tools), operator_requests(crd_cluster)
    assert made - allowed == set()
    used = {item for item in allowed if item[1] == "leaderworkersets"} | {("apps", "deployments", "delete"),
                                                                           ("", "services", "delete")}  # fmt: skip
    assert used - made == set()
