"""The operator, run for real (KopfRunner) against the emulated API server, driven with real kubectl."""

from __future__ import annotations

import copy
import hashlib
import json
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from cbserve_operator import spec as spec_module

from .conftest import REPO, Cluster, install_inference_pool, wait_for

CBD = "cbserve.io/v1alpha1"
EXAMPLE = REPO / "examples" / "cbdeployment.yaml"


def example(**spec_changes: Any) -> dict[str, Any]:
    manifest = yaml.safe_load(EXAMPLE.read_text())
    for path, value in spec_changes.items():
        node = manifest["spec"]
        keys = path.split("__")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
    return manifest


def apply(cluster: Cluster, namespace: str, manifest: dict[str, Any] | Path) -> None:
    text = manifest.read_text() if isinstance(manifest, Path) else yaml.safe_dump(manifest)
    cluster.kubectl("apply", "--validate=false", "-n", namespace, "-f", "-", input=text)


def cbd(cluster: Cluster, namespace: str, name: str = "smollm2") -> dict[str, Any]:
    obj = cluster.get(CBD, "cbdeployments", namespace, name)
    assert obj is not None
    return obj


def reconciled(cluster: Cluster, namespace: str, name: str = "smollm2") -> dict[str, Any]:
    """Wait until the operator has reconciled the CBDeployment's current generation."""
    def done() -> dict[str, Any] | None:
        obj = cbd(cluster, namespace, name)
        status = obj.get("status", {})
        return obj if status.get("observedGeneration") == obj["metadata"]["generation"] and status.get("phase") else None
    return wait_for(done, timeout=30, what=f"{namespace}/{name} to be reconciled")


def conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}


def children(cluster: Cluster, namespace: str) -> dict[str, list[dict[str, Any]]]:
    return {
        "configmaps": cluster.items("v1", "configmaps", namespace),
        "services": cluster.items("v1", "services", namespace),
        "deployments": cluster.items("apps/v1", "deployments", namespace),
    }


def test_apply_example_creates_owned_children_with_the_knobs(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "apply"
    apply(c, ns, EXAMPLE)
    owner = reconciled(c, ns)

    (cm,) = wait_for(lambda: c.items("v1", "configmaps", ns), what="the ConfigMap")
    assert cm["immutable"] is True and cm["metadata"]["name"].startswith("smollm2-engine-")
    engine = yaml.safe_load(cm["data"]["engine.yaml"])
    assert engine == {"block_size": 256, "max_memory_percent": 0.9}  # what the example sets; the rest: defaults

    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    svc = c.get("v1", "services", ns, "smollm2")
    assert dep is not None and svc is not None
    pod = dep["spec"]["template"]
    container = pod["spec"]["containers"][0]
    assert container["command"] == [
        "cbserve", "serve", "--model", "/models/models/SmolLM2-135M-Instruct",
        "--served-model-name", "smollm2", "--port", "8000", "--config", "/etc/cbserve/engine.yaml",
        "--drain-timeout", "105",  # the 120 s grace less the 5 s preStop sleep and a 10 s margin
        "--device", "cuda"]  # the example asks for a GPU
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["startupProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["startupProbe"]["periodSeconds"] * container["startupProbe"]["failureThreshold"] >= 1800
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["automountServiceAccountToken"] is False  # the server never calls the Kubernetes API
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    # the GPU pod is never BestEffort, and its in-memory /dev/shm is bounded
    assert container["resources"]["requests"]["memory"] == "2Gi" and container["resources"]["requests"]["cpu"] == "1"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    digest = hashlib.sha256(cm["data"]["engine.yaml"].encode()).hexdigest()[:16]
    assert "emptyDir" in volumes["cache"] and volumes["config"]["configMap"]["name"] == f"smollm2-engine-{digest[:10]}"
    assert pod["metadata"]["annotations"]["cbserve.io/config-hash"] == digest
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["port"] == 8000

    for child in (cm, dep, svc):
        (ref,) = child["metadata"]["ownerReferences"]
        assert ref["uid"] == owner["metadata"]["uid"] and ref["kind"] == "CBDeployment"
        assert ref["controller"] is True and ref["blockOwnerDeletion"] is True

    status = owner["status"]
    assert status["phase"] == "Pending"  # no pod has become ready: nothing runs pods here
    assert status["selector"] == "app.kubernetes.io/instance=smollm2,app.kubernetes.io/name=cbserve"
    assert status["url"] == f"http://smollm2.{ns}.svc:8000"
    assert conditions(owner)["ConfigValid"]["status"] == "True"
    # Kopf's bookkeeping lives under cbserve.io, not the shared kopf.zalando.org prefix. Kopf patches it
    # after the handler returns, so it may land after the status the handler wrote: wait for it.
    def handled() -> dict[str, Any] | None:
        annotations = cbd(c, ns, "smollm2")["metadata"].get("annotations", {})
        return annotations if "cbserve.io/last-handled-configuration" in annotations else None

    annotations = wait_for(handled, what="Kopf's last-handled annotation")
    assert not [k for k in annotations if "kopf.zalando.org" in k]
    # No finalizer: deleting a CBDeployment never waits for the operator; garbage collection does it.
    assert owner["metadata"].get("finalizers", []) == []


def test_the_cpu_example_runs_the_embedded_model_on_the_cpu(operator: KopfRunner, crd_cluster: Cluster) -> None:
    """examples/cbdeployment-cpu.yaml (what scripts/cluster_check.sh applies): no GPU asked for or
    mounted, the model the cpu image carries, the image the example names, and its small requests."""
    c, ns = crd_cluster, "cpu-example"
    apply(c, ns, REPO / "examples" / "cbdeployment-cpu.yaml")
    reconciled(c, ns, "smollm2-cpu")
    dep = wait_for(lambda: c.get("apps/v1", "deployments", ns, "smollm2-cpu"), what="the Deployment")
    pod = dep["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["cbserve", "serve"]
    assert command[command.index("--model") + 1] == "/opt/models/smollm2-135m-instruct"
    assert command[command.index("--device") + 1] == "cpu"
    assert command[command.index("--served-model-name") + 1] == "smollm2-cpu"
    assert container["image"] == "localhost/cbserve-cpu:0.1.0"
    resources = container["resources"]
    assert not any("gpu" in key for part in resources.values() for key in part)
    assert resources["requests"]["cpu"] == "1" and resources["requests"]["memory"] == "3Gi"
    assert "dshm" not in {v["name"] for v in pod["spec"]["volumes"]}  # no GPU, no /dev/shm volume
    (cm,) = wait_for(lambda: c.items("v1", "configmaps", ns), what="the ConfigMap")
    assert yaml.safe_load(cm["data"]["engine.yaml"]) == {"dtype": "float32", "cpu_kv_cache_space": 0.5,
                                                         "max_queue_size": 64}


def test_editing_knobs_rolls_pods_and_replicas_scale(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "edit"
    apply(c, ns, EXAMPLE)
    first = reconciled(c, ns)
    old_hash = c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["template"]["metadata"]["annotations"]["cbserve.io/config-hash"]  # type: ignore[index]

    apply(c, ns, example(engine__blockSize=512))  # an edit of the manifest, re-applied
    second = reconciled(c, ns)
    assert second["metadata"]["generation"] == first["metadata"]["generation"] + 1
    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    new_hash = dep["spec"]["template"]["metadata"]["annotations"]["cbserve.io/config-hash"]  # type: ignore[index]
    assert new_hash != old_hash and second["status"]["configHash"] == new_hash
    # A new immutable ConfigMap; the old one stays for the old pods (a restart keeps its knobs)
    new_cm = c.get("v1", "configmaps", ns, f"smollm2-engine-{new_hash[:10]}")
    assert yaml.safe_load(new_cm["data"]["engine.yaml"])["block_size"] == 512  # type: ignore[index]
    old_cm = c.get("v1", "configmaps", ns, f"smollm2-engine-{old_hash[:10]}")
    assert yaml.safe_load(old_cm["data"]["engine.yaml"])["block_size"] == 256  # type: ignore[index]
    edit = c.kubectl("patch", "configmap", f"smollm2-engine-{old_hash[:10]}", "-n", ns, "--type", "merge",
                     "-p", '{"data": {"engine.yaml": "block_size: 64"}}', check=False)
    assert edit.returncode != 0 and "field is immutable when `immutable` is set" in edit.stderr

    c.kubectl("patch", "cbd", "smollm2", "-n", ns, "--type", "merge", "-p", '{"spec": {"replicas": 3}}')
    third = reconciled(c, ns)
    assert third["status"]["observedGeneration"] == second["metadata"]["generation"] + 1
    assert c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["replicas"] == 3  # type: ignore[index]

    # The scale subresource: what `kubectl scale` and an HPA use.
    c.kubectl("scale", "cbd", "smollm2", "-n", ns, "--replicas=2")
    wait_for(lambda: c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["replicas"] == 2,  # type: ignore[index]
             what="kubectl scale to reach the Deployment")
    assert reconciled(c, ns)["status"]["observedGeneration"] == third["metadata"]["generation"] + 1

    found = children(c, ns)
    assert [len(found[k]) for k in ("configmaps", "services", "deployments")] == [2, 1, 1]


def test_a_rollback_finds_the_old_knobs_and_old_configs_are_collected(operator: KopfRunner,
                                                                      crd_cluster: Cluster) -> None:
    """Re-applying an earlier spec points the Deployment at its ConfigMap again, the same bytes; of
    the configs the spec no longer uses, the 5 used most recently stay (as many revisions as the
    Deployment keeps old ReplicaSets of) and the others are deleted."""
    c, ns = crd_cluster, "rollback"

    def mounted() -> str:
        dep = c.get("apps/v1", "deployments", ns, "smollm2")
        volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}  # type: ignore[index]
        return volumes["config"]["configMap"]["name"]

    apply(c, ns, EXAMPLE)
    reconciled(c, ns)
    first = mounted()
    apply(c, ns, example(engine__blockSize=512))
    reconciled(c, ns)
    assert mounted() != first
    apply(c, ns, EXAMPLE)  # roll back
    reconciled(c, ns)
    assert mounted() == first and len(c.items("v1", "configmaps", ns)) == 2
    for blocks in (100, 200, 300, 400, 500):
        apply(c, ns, example(engine__numBlocks=blocks))
        reconciled(c, ns)
    names = {cm["metadata"]["name"] for cm in c.items("v1", "configmaps", ns)}
    assert len(names) == 6 and mounted() in names  # the current one and the newest 5 others
    assert first in names  # used again by the rollback, after the 512 one, which went
    assert all(cm["metadata"]["ownerReferences"][0]["name"] == "smollm2" for cm in c.items("v1", "configmaps", ns))


def _record_revision(c: Cluster, ns: str, revision: int) -> None:
    """What the Deployment controller does on a rollout, which the emulator has not: a ReplicaSet
    with the Deployment's pod template (plus pod-template-hash), controlled by it and numbered by
    the revision annotation, which the Deployment carries too. `kubectl rollout undo` reads these."""
    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    assert dep is not None
    template = copy.deepcopy(dep["spec"]["template"])
    pod_hash = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]
    template["metadata"]["labels"]["pod-template-hash"] = pod_hash
    selector = {**dep["spec"]["selector"]["matchLabels"], "pod-template-hash": pod_hash}
    rs = {"apiVersion": "apps/v1", "kind": "ReplicaSet",
          "metadata": {"name": f"smollm2-{pod_hash}", "namespace": ns, "labels": selector,
                       "annotations": {"deployment.kubernetes.io/revision": str(revision)},
                       "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "smollm2",
                                            "uid": dep["metadata"]["uid"], "controller": True}]},
          "spec": {"replicas": 0, "selector": {"matchLabels": selector}, "template": template}}  # fmt: skip
    c.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(rs))
    c.kubectl("annotate", "--overwrite", "deployment", "smollm2", "-n", ns,
              f"deployment.kubernetes.io/revision={revision}")


def _config_hash(c: Cluster, ns: str) -> str:
    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    return dep["spec"]["template"]["metadata"]["annotations"]["cbserve.io/config-hash"]  # type: ignore[index]


def test_kubectl_rollout_undo_brings_the_old_knobs_back_until_the_spec_changes(operator: KopfRunner,
                                                                                crd_cluster: Cluster) -> None:
    """`kubectl rollout undo` restores the earlier revision's pod template, which mounts its own
    (immutable, kept) engine ConfigMap: the operator recognises one of its own renders, keeps it
    (RolledBack condition, status.rolledBack, an Event), keeps it through a reconcile of the same
    spec, and rolls forward at the next spec change. An edit of the template is drift all the same."""
    c, ns = crd_cluster, "undo"
    apply(c, ns, EXAMPLE)
    reconciled(c, ns)
    first = _config_hash(c, ns)
    _record_revision(c, ns, 1)
    apply(c, ns, example(engine__blockSize=512))
    reconciled(c, ns)
    second = _config_hash(c, ns)
    assert second != first
    _record_revision(c, ns, 2)

    out = c.kubectl("rollout", "undo", "deployment/smollm2", "-n", ns).stdout
    assert "rolled back" in out
    obj = wait_for(lambda: (o := cbd(c, ns)).get("status", {}).get("rolledBack") and o, what="status.rolledBack")
    assert obj["status"]["rolledBack"]["configHash"] == first
    assert conditions(obj)["RolledBack"]["status"] == "True" and first in conditions(obj)["RolledBack"]["message"]
    wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "RolloutUndone"],
             what="a RolloutUndone Event")
    assert _config_hash(c, ns) == first  # the old knobs, from the old ConfigMap, still there
    assert c.get("v1", "configmaps", ns, f"smollm2-engine-{first[:10]}") is not None
    assert not [e for e in c.items("v1", "events", ns) if e.get("reason") == "DeploymentRestored"]

    # A reconcile of the same generation (a label edit; an operator restart runs the same path) keeps it.
    c.kubectl("label", "cbdeployment", "smollm2", "-n", ns, "team=serving")
    wait_for(lambda: cbd(c, ns)["metadata"].get("labels", {}).get("team") == "serving", what="the label")
    reconciled(c, ns)
    assert _config_hash(c, ns) == first and conditions(cbd(c, ns))["RolledBack"]["status"] == "True"

    # An autoscaler's replicas (through the scale subresource, which bumps the generation) keep it:
    # the undo holds through the incident it was made for.
    generation = cbd(c, ns)["metadata"]["generation"]
    c.kubectl("scale", "cbd", "smollm2", "-n", ns, "--replicas=3")
    wait_for(lambda: c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["replicas"] == 3,  # type: ignore[index]
             what="3 replicas")
    obj = reconciled(c, ns)
    assert obj["metadata"]["generation"] > generation
    assert _config_hash(c, ns) == first and conditions(obj)["RolledBack"]["status"] == "True"
    assert obj["status"]["rolledBack"]["generation"] == obj["metadata"]["generation"]

    # The next spec change rolls forward and clears the rollback.
    apply(c, ns, example(engine__blockSize=512, replicas=3, podTemplate__labels={"tier": "gold"}))
    obj = reconciled(c, ns)
    assert _config_hash(c, ns) == second
    assert "rolledBack" not in obj["status"] and "RolledBack" not in conditions(obj)

    # An edit of the template (not one of the operator's renders) is drift: put back.
    c.kubectl("set", "image", "deployment/smollm2", "-n", ns, "server=example.org/other:1")
    wait_for(lambda: c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["template"]["spec"]  # type: ignore[index]
             ["containers"][0]["image"] != "example.org/other:1", what="the image to be restored")


def _patch_deployment_status(c: Cluster, ns: str, status: dict[str, Any]) -> None:
    c.kubectl("patch", "deployment", "smollm2", "-n", ns, "--subresource=status", "--type", "merge",
              "-p", json.dumps({"status": status}))


def test_ready_deployment_makes_the_cbdeployment_ready(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "ready"
    apply(c, ns, example(replicas=2))
    reconciled(c, ns)
    generation = c.get("apps/v1", "deployments", ns, "smollm2")["metadata"]["generation"]  # type: ignore[index]

    _patch_deployment_status(c, ns, {"observedGeneration": generation, "replicas": 2, "updatedReplicas": 2,
                                     "readyReplicas": 1, "availableReplicas": 1})
    wait_for(lambda: cbd(c, ns)["status"].get("readyReplicas") == 1, what="readyReplicas 1")
    assert cbd(c, ns)["status"]["phase"] == "Progressing"

    _patch_deployment_status(c, ns, {"readyReplicas": 2, "availableReplicas": 2})
    ready = wait_for(lambda: (o := cbd(c, ns))["status"].get("phase") == "Ready" and o, what="phase Ready")
    assert ready["status"]["readyReplicas"] == 2 and ready["status"]["replicas"] == 2
    cond = conditions(ready)
    assert cond["Ready"]["status"] == "True" and cond["Ready"]["reason"] == "AllReplicasReady"
    assert cond["Ready"]["observedGeneration"] == ready["metadata"]["generation"]
    assert cond["Progressing"]["status"] == "False" and cond["Degraded"]["status"] == "False"

    table = c.kubectl("get", "cbd", "-n", ns).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "PHASE", "REASON", "AGE"]
    assert table[1].split()[:5] == ["smollm2", "pvc://models/SmolLM2-135M-Instruct", "2", "2", "Ready"]
    wide = c.kubectl("get", "cbdeployments.cbserve.io", "-n", ns, "-o", "wide").stdout
    assert f"http://smollm2.{ns}.svc:8000" in wide
    assert "smollm2" in c.kubectl("get", "all", "-n", ns).stdout  # category `all`

    # A stuck rollout: Degraded, and an Event says so.
    _patch_deployment_status(c, ns, {"readyReplicas": 1, "conditions": [{
        "type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
        "message": 'ReplicaSet "smollm2-abc" has timed out progressing.'}]})
    degraded = wait_for(lambda: (o := cbd(c, ns))["status"].get("phase") == "Degraded" and o, what="phase Degraded")
    assert conditions(degraded)["Degraded"]["reason"] == "ProgressDeadlineExceeded"
    events = wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "RolloutStuck"],
                      what="a RolloutStuck Event")
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == "smollm2"


def _server_pod(c: Cluster, ns: str, name: str) -> None:
    """A server pod as the Deployment's ReplicaSet would create it (the emulator runs no controllers)."""
    labels = {"app.kubernetes.io/name": "cbserve", "app.kubernetes.io/instance": "smollm2",
              "app.kubernetes.io/component": "server", "app.kubernetes.io/managed-by": "cbserve-operator",
              "cbserve.io/cbdeployment": "smollm2", "pod-template-hash": "abc"}  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": ns, "labels": labels},
           "spec": {"containers": [{"name": "server", "image": "localhost/cbserve:0.1.0"}]}}  # fmt: skip
    c.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(pod))


def _pod_status(c: Cluster, ns: str, name: str, status: dict[str, Any]) -> None:
    c.kubectl("patch", "pod", name, "-n", ns, "--subresource=status", "--type", "merge",
              "-p", json.dumps({"status": status}))


def _waiting(reason: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"conditions": [{"type": "PodScheduled", "status": "True"}], "containerStatuses": [{
        "name": "server", "ready": False, "restartCount": 3, "image": "localhost/cbserve:0.1.0", "imageID": "",
        "state": {"waiting": {"reason": reason, "message": message}}, **extra}]}  # fmt: skip


def test_status_says_why_pods_do_not_start(operator: KopfRunner, crd_cluster: Cluster) -> None:
    """The pods' own status, not the Deployment's 35-minute deadline: unschedulable with the scheduler's
    message, an image that cannot be pulled, a crash loop, a quota the ReplicaSet meets; in the Ready
    condition, status.reason and message, and `kubectl get cbd`'s REASON column, on the pod's event."""
    c, ns = crd_cluster, "why"
    apply(c, ns, example())
    reconciled(c, ns)
    _server_pod(c, ns, "smollm2-abc-1")

    def why(reason: str) -> dict[str, Any]:
        return wait_for(lambda: o if (o := cbd(c, ns))["status"].get("reason") == reason else None,
                        what=f"status.reason {reason}")  # fmt: skip

    _pod_status(c, ns, "smollm2-abc-1", {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."}]})
    obj = why("Unschedulable")
    assert "pod smollm2-abc-1: 0/4 nodes are available: 4 Insufficient nvidia.com/gpu." in obj["status"]["message"]
    ready, progressing = conditions(obj)["Ready"], conditions(obj)["Progressing"]
    assert ready["status"] == "False" and ready["reason"] == "Unschedulable" and "Insufficient" in ready["message"]
    assert progressing["reason"] == "Unschedulable"
    table = c.kubectl("get", "cbd", "-n", ns).stdout.splitlines()
    assert table[0].split()[5] == "REASON" and table[1].split()[5] == "Unschedulable"
    assert "4 Insufficient nvidia.com/gpu" in c.kubectl("get", "cbd", "-n", ns, "-o", "wide").stdout

    _pod_status(c, ns, "smollm2-abc-1", _waiting("ImagePullBackOff", 'Back-off pulling image "localhost/cbserve:0.1.0"'))
    assert 'container server: Back-off pulling image' in why("ImagePullBackOff")["status"]["message"]

    _pod_status(c, ns, "smollm2-abc-1", _waiting("CrashLoopBackOff", "back-off 5m0s restarting failed container",
                                                 lastState={"terminated": {"exitCode": 1, "reason": "Error"}}))
    assert "last exit code 1 (Error)" in why("CrashLoopBackOff")["status"]["message"]

    quota = ('pods "smollm2-abc-2" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, '
             "used: requests.nvidia.com/gpu=4, limited: requests.nvidia.com/gpu=4")
    _patch_deployment_status(c, ns, {"conditions": [{"type": "ReplicaFailure", "status": "True",
                                                     "reason": "FailedCreate", "message": quota}]})  # fmt: skip
    assert why("QuotaExceeded")["status"]["message"].endswith(quota)

    # All well: the reason goes.
    generation = c.get("apps/v1", "deployments", ns, "smollm2")["metadata"]["generation"]  # type: ignore[index]
    _pod_status(c, ns, "smollm2-abc-1", {"phase": "Running", "containerStatuses": [{
        "name": "server", "ready": True, "restartCount": 3, "image": "localhost/cbserve:0.1.0", "imageID": "",
        "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})  # fmt: skip
    _patch_deployment_status(c, ns, {"observedGeneration": generation, "replicas": 1, "updatedReplicas": 1,
                                     "readyReplicas": 1, "conditions": []})  # fmt: skip
    ready = wait_for(lambda: o if (o := cbd(c, ns))["status"].get("phase") == "Ready" else None, what="phase Ready")
    assert "reason" not in ready["status"] and "message" not in ready["status"]


def test_invalid_spec_is_a_condition_and_an_event_not_a_crash(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "invalid"
    bad = example(engine__blockSize=24, engine__maxMemoryPercent=1.5,
                  autoscaling={"enabled": True, "minReplicas": 5, "maxReplicas": 2})
    # The API server refuses it by the CRD's schema and CEL rules...
    refused = c.kubectl("apply", "--validate=false", "-n", ns, "-f", "-", input=yaml.safe_dump(bad), check=False)
    assert refused.returncode != 0
    for words in ("spec.engine.blockSize: 24 is not one of", "spec.engine.maxMemoryPercent: 1.5 is greater than",
                  "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"):
        assert words in refused.stderr, refused.stderr
    # ...but one without CEL (before 1.25), or an object stored before a rule existed, lets it
    # through; the operator must not.
    assert c.server.emulator is not None
    c.server.emulator.validate_custom_resources = False
    try:
        apply(c, ns, bad)
    finally:
        c.server.emulator.validate_custom_resources = True
    failed = reconciled(c, ns)
    assert failed["status"]["phase"] == "Failed"
    valid = conditions(failed)["ConfigValid"]
    assert valid["status"] == "False" and valid["reason"] == "InvalidSpec"
    assert valid["observedGeneration"] == failed["metadata"]["generation"]
    for fragment in ("engine.blockSize must be a power of two from 16 to 1024, got 24",
                     "engine.maxMemoryPercent must be in (0, 1], got 1.5",
                     "autoscaling.minReplicas (5) must not exceed autoscaling.maxReplicas (2)"):
        assert fragment in valid["message"]
    events = wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "InvalidSpec"],
                      what="an InvalidSpec Event")
    assert events[0]["type"] == "Warning" and "blockSize" in events[0]["message"]
    assert c.get("apps/v1", "deployments", ns, "smollm2") is None

    # Fixing the spec recovers without a restart.
    apply(c, ns, example())
    fixed = reconciled(c, ns)
    assert conditions(fixed)["ConfigValid"]["status"] == "True"
    assert c.get("apps/v1", "deployments", ns, "smollm2") is not None


def test_a_group_without_the_leaderworkerset_api_says_to_install_it(operator: KopfRunner,
                                                                    crd_cluster: Cluster) -> None:  # fmt: skip
    """resources.nodes > 1 where LWS's CRD is not installed: status says what is missing, once."""
    c, ns = crd_cluster, "no-lws"
    apply(c, ns, example(resources__gpu=2, resources__nodes=2))
    failed = reconciled(c, ns)
    valid = conditions(failed)["ConfigValid"]
    assert failed["status"]["phase"] == "Failed" and valid["reason"] == "ChildRefused"
    assert valid["message"] == ("resources.nodes > 1 needs the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1, "
                                "kubernetes-sigs/lws) in the cluster, and it is not installed: install it, then "
                                "change the CBDeployment (or restart the operator) to try again")  # fmt: skip


def test_an_older_spelling_still_works_and_an_event_names_the_new_one(operator: KopfRunner,
                                                                      crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "deprecated"
    apply(c, ns, example(engine__prefixCaching=False))
    obj = reconciled(c, ns)
    assert conditions(obj)["ConfigValid"]["status"] == "True"
    (cm,) = wait_for(lambda: c.items("v1", "configmaps", ns), what="the ConfigMap")
    assert yaml.safe_load(cm["data"]["engine.yaml"])["allow_block_sharing"] is False
    events = wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "DeprecatedField"],
                      what="a DeprecatedField Event")
    assert events[0]["type"] == "Warning"
    assert events[0]["message"] == "engine.prefixCaching is deprecated: use engine.allowBlockSharing"


def test_a_child_the_api_server_refuses_is_a_condition_not_a_retry_loop(operator: KopfRunner,
                                                                        crd_cluster: Cluster) -> None:
    """A Service annotation key the API server does not take (no rule of the CRD or the operator
    knows of it): the 422 is permanent, so it lands in status and an Event, with no retries."""
    c, ns = crd_cluster, "refused"
    manifest = example(service={"annotations": {"bad key!": "x"}})
    manifest["metadata"]["name"] = "llama-8b"
    mark = c.server.mark()
    apply(c, ns, manifest)
    failed = reconciled(c, ns, "llama-8b")
    assert failed["status"]["phase"] == "Failed"
    valid = conditions(failed)["ConfigValid"]
    assert valid["status"] == "False" and valid["reason"] == "ChildRefused"
    assert "the API server refused the Service llama-8b" in valid["message"] and '"bad key!"' in valid["message"]
    assert conditions(failed)["Ready"]["status"] == "False"
    assert valid["observedGeneration"] == failed["metadata"]["generation"]
    events = wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "ChildRefused"],
                      what="a ChildRefused Event")
    assert events[0]["type"] == "Warning"
    # Kopf keeps a retried handler's progress ("delayed", "retries") in annotations under cbserve.io/
    annotations = failed["metadata"].get("annotations", {})
    assert not any('"delayed"' in v or '"retries"' in v for v in annotations.values()), annotations
    assert len(c.server.requests_since(mark, "PATCH", rf"/namespaces/{ns}/services/llama-8b")) == 1


def test_a_forbidden_child_is_retried_and_said_in_status(operator: KopfRunner, crd_cluster: Cluster) -> None:
    """A 403 (here an exceeded ResourceQuota) is not the spec's fault and can go away by itself: the
    reason is in Ready and Progressing, ConfigValid stays True, and the operator retries with backoff
    until it passes, with no edit of the spec."""
    c, ns = crd_cluster, "quota"
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-services", "namespace": ns},
             "spec": {"hard": {"services": "0"}}}  # fmt: skip
    c.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(quota))
    apply(c, ns, EXAMPLE)
    obj = wait_for(lambda: o if conditions(o := cbd(c, ns)).get("Ready", {}).get("reason") == "QuotaExceeded" else None,
                   what="Ready False with reason QuotaExceeded")  # fmt: skip
    ready = conditions(obj)["Ready"]
    assert ready["status"] == "False" and "exceeded quota: no-services" in ready["message"], ready
    assert conditions(obj)["Progressing"]["reason"] == "QuotaExceeded"
    assert conditions(obj)["ConfigValid"]["status"] == "True"
    assert obj["status"]["phase"] == "Pending"
    wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "QuotaExceeded"],
             what="a QuotaExceeded Event")
    assert c.get("v1", "services", ns, "smollm2") is None

    c.kubectl("delete", "resourcequota", "no-services", "-n", ns)
    wait_for(lambda: c.get("v1", "services", ns, "smollm2"), what="the Service, at the next retry")
    obj = wait_for(lambda: o if conditions(o := cbd(c, ns))["Ready"]["reason"] != "QuotaExceeded" else None,
                   what="the reason gone")  # fmt: skip
    assert conditions(obj)["ConfigValid"]["status"] == "True"


def test_a_deleted_deployment_comes_back(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "drift"
    apply(c, ns, EXAMPLE)
    reconciled(c, ns)
    old = c.get("apps/v1", "deployments", ns, "smollm2")
    assert old is not None
    c.kubectl("delete", "deployment", "smollm2", "-n", ns)
    new = wait_for(lambda: (d := c.get("apps/v1", "deployments", ns, "smollm2")) and
                   d["metadata"]["uid"] != old["metadata"]["uid"] and d, what="the Deployment to be recreated")
    assert new["spec"] == old["spec"]
    assert new["metadata"]["ownerReferences"] == old["metadata"]["ownerReferences"]
    wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "DeploymentRecreated"],
             what="a DeploymentRecreated Event")

    # An edit behind the operator's back is undone too.
    c.kubectl("patch", "deployment", "smollm2", "-n", ns, "--type", "merge", "-p", '{"spec": {"replicas": 7}}')
    wait_for(lambda: c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["replicas"] == 1,  # type: ignore[index]
             what="the operator to restore replicas 1")
    wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "DeploymentRestored"],
             what="a DeploymentRestored Event")

    # Any field the operator renders, edited by hand, is drift: resources, env, probes, tolerations,
    # securityContext. What the API server or others add (an annotation of kubectl rollout restart) stays.
    def container() -> dict[str, Any]:
        return c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["template"]["spec"]["containers"][0]  # type: ignore[index]

    rendered = container()
    edits = [
        ["set", "env", "deployment/smollm2", "FOO=bar"],
        ["set", "resources", "deployment/smollm2", "--limits=memory=64Gi"],
        ["patch", "deployment", "smollm2", "--type", "json", "-p", json.dumps([
            {"op": "replace", "path": "/spec/template/spec/containers/0/readinessProbe/periodSeconds", "value": 99}])],
        ["patch", "deployment", "smollm2", "--type", "json", "-p", json.dumps([
            {"op": "replace", "path": "/spec/template/spec/containers/0/securityContext/readOnlyRootFilesystem",
             "value": False}])],
    ]
    for edit in edits:
        c.kubectl(*edit, "-n", ns)
        wait_for(lambda: container() == rendered, what=f"the operator to undo `kubectl {' '.join(edit[:3])}`")
    gpu_taint = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    apply(c, ns, example(podTemplate__tolerations=gpu_taint))
    reconciled(c, ns)
    c.kubectl("patch", "deployment", "smollm2", "-n", ns, "--type", "merge", "-p", json.dumps(
        {"spec": {"template": {"spec": {"tolerations": [{"key": "x", "operator": "Exists"}]}}}}))
    wait_for(lambda: c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["template"]["spec"]  # type: ignore[index]
             ["tolerations"] == gpu_taint, what="the tolerations edit undone")
    mark = c.server.mark()
    c.kubectl("patch", "deployment", "smollm2", "-n", ns, "--type", "merge", "-p", json.dumps(
        {"spec": {"template": {"metadata": {"annotations": {"kubectl.kubernetes.io/restartedAt": "now"}}}}}))
    # Kopf handles one object's events in order: once a later status change is mirrored, that edit was seen.
    _patch_deployment_status(c, ns, {"readyReplicas": 0, "replicas": 3})
    wait_for(lambda: cbd(c, ns)["status"].get("replicas") == 3, what="the later event mirrored")
    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    assert dep["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] == "now"  # type: ignore[index]
    assert not c.server.requests_since(mark, "PATCH", rf"/namespaces/{ns}/deployments/smollm2\?.*cbserve-operator")


def test_every_other_child_deleted_or_edited_comes_back(operator: KopfRunner, crd_cluster: Cluster) -> None:
    """ConfigMap, Service, HPA and PDB: each deleted comes back (same spec, a ChildRecreated Event),
    each edited in a field the operator sets goes back, on its own event, with no spec change."""
    c, ns = crd_cluster, "drift-all"
    apply(c, ns, example(autoscaling={"enabled": True, "maxReplicas": 3}, pdb={"enabled": True}))
    reconciled(c, ns)
    dep = c.get("apps/v1", "deployments", ns, "smollm2")
    config = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")  # type: ignore[index]
    cm_name = config["configMap"]["name"]
    kinds = [("v1", "configmaps", "configmap", cm_name), ("v1", "services", "service", "smollm2"),
             ("autoscaling/v2", "horizontalpodautoscalers", "hpa", "smollm2"),
             ("policy/v1", "poddisruptionbudgets", "pdb", "smollm2")]
    for api, plural, short, name in kinds:
        old = c.get(api, plural, ns, name)
        assert old is not None, plural
        c.kubectl("delete", short, name, "-n", ns)
        new = wait_for(lambda: (o := c.get(api, plural, ns, name)) and o["metadata"]["uid"] != old["metadata"]["uid"]
                       and o, what=f"the {plural} to be recreated")  # fmt: skip
        for key in ("spec", "data"):
            assert new.get(key) == old.get(key), plural
        assert new["metadata"]["ownerReferences"] == old["metadata"]["ownerReferences"]
    recreated = wait_for(lambda: {e["message"].split()[1] for e in c.items("v1", "events", ns)
                                  if e.get("reason") == "ChildRecreated"} >= {"ConfigMap", "Service",
                                  "HorizontalPodAutoscaler", "PodDisruptionBudget"}, what="ChildRecreated Events")  # fmt: skip
    assert recreated
    for api, plural, short, patch, path, want in [
        ("v1", "services", "service", {"spec": {"ports": [{"name": "http", "port": 9999, "targetPort": "http",
                                                            "protocol": "TCP"}]}}, ("spec", "ports", 0, "port"), 8000),
        ("autoscaling/v2", "horizontalpodautoscalers", "hpa", {"spec": {"maxReplicas": 9}}, ("spec", "maxReplicas"), 3),
        ("policy/v1", "poddisruptionbudgets", "pdb", {"spec": {"maxUnavailable": 5}}, ("spec", "maxUnavailable"), 1),
    ]:  # fmt: skip
        c.kubectl("patch", short, "smollm2", "-n", ns, "--type", "merge", "-p", json.dumps(patch))

        def value(api=api, plural=plural, path=path) -> Any:
            node: Any = c.get(api, plural, ns, "smollm2")
            for key in path:
                node = node[key]
            return node

        wait_for(lambda want=want, value=value: value() == want, what=f"the {plural} edit to be undone")


def test_deleting_the_cbdeployment_deletes_its_children(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "delete"
    apply(c, ns, EXAMPLE)
    reconciled(c, ns)
    assert [len(v) for v in children(c, ns).values()] == [1, 1, 1]
    c.kubectl("delete", "cbd", "smollm2", "-n", ns, "--wait=true", "--timeout=30s")
    assert c.get(CBD, "cbdeployments", ns, "smollm2") is None  # no finalizer held it
    wait_for(lambda: [len(v) for v in children(c, ns).values()] == [0, 0, 0],
             what="garbage collection of the owned children")


def test_an_inference_pool_follows_the_spec_and_its_published_crd(operator: KopfRunner, crd_cluster: Cluster) -> None:
    """spec.routing.inferencePool: skipped with a reason without the inference extension's API; with its
    published CRD installed, an InferencePool the API server accepts (defaulted by that schema), over the
    server pods' labels and port, naming the picker; put back when deleted; deleted when turned off."""
    c, ns = crd_cluster, "routing"
    routing = {"inferencePool": {"enabled": True, "endpointPicker": {"name": "smollm2-epp"}}}
    apply(c, ns, example(routing=routing))
    obj = reconciled(c, ns)
    assert conditions(obj)["ConfigValid"]["status"] == "True"
    assert ("InferencePool skipped: the inference.networking.k8s.io/v1 API is not installed"
            in conditions(obj)["ConfigValid"]["message"])

    install_inference_pool(c)
    routing["inferencePool"]["endpointPicker"]["failureMode"] = "FailOpen"
    apply(c, ns, example(routing=routing))
    obj = reconciled(c, ns)
    assert conditions(obj)["ConfigValid"]["message"] == "the spec is valid"
    pool = c.get("inference.networking.k8s.io/v1", "inferencepools", ns, "smollm2")
    service = c.get("v1", "services", ns, "smollm2")
    assert pool is not None and service is not None
    assert pool["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    assert pool["spec"]["selector"] == {"matchLabels": service["spec"]["selector"]}
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    # group "" is the published schema's default: the emulator judged the object by that CRD
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "smollm2-epp",
                                                 "port": {"number": 9002}, "failureMode": "FailOpen"}
    template = c.get("apps/v1", "deployments", ns, "smollm2")["spec"]["template"]  # type: ignore[index]
    assert pool["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in template["spec"]["containers"][0]["ports"]

    c.kubectl("delete", "inferencepools.inference.networking.k8s.io", "smollm2", "-n", ns)
    wait_for(lambda: (o := c.get("inference.networking.k8s.io/v1", "inferencepools", ns, "smollm2"))
             and o["metadata"]["uid"] != pool["metadata"]["uid"], what="the InferencePool to be recreated")

    apply(c, ns, example(routing={"inferencePool": {"enabled": False}}))
    reconciled(c, ns)
    wait_for(lambda: c.get("inference.networking.k8s.io/v1", "inferencepools", ns, "smollm2") is None,
             what="the InferencePool to be deleted")


def test_optional_children_follow_the_spec(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "optional"
    full = yaml.safe_load((REPO / "examples" / "cbdeployment-full.yaml").read_text())
    full["metadata"].pop("namespace")
    apply(c, ns, full)
    reconciled(c, ns, "llama-8b")
    hpa = c.get("autoscaling/v2", "horizontalpodautoscalers", ns, "llama-8b")
    pdb = c.get("policy/v1", "poddisruptionbudgets", ns, "llama-8b")
    assert hpa is not None and pdb is not None
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": CBD, "kind": "CBDeployment", "name": "llama-8b"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "cbserve:num_requests_waiting"
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 300
    # No Prometheus operator CRD here: the ServiceMonitor is skipped with a reason, not a failure.
    obj = cbd(c, ns, "llama-8b")
    assert conditions(obj)["ConfigValid"]["status"] == "True"
    assert "ServiceMonitor skipped" in conditions(obj)["ConfigValid"]["message"]

    turned_off = copy.deepcopy(full)
    turned_off["spec"]["autoscaling"]["enabled"] = False
    turned_off["spec"]["pdb"]["enabled"] = False
    apply(c, ns, turned_off)
    reconciled(c, ns, "llama-8b")
    assert c.get("autoscaling/v2", "horizontalpodautoscalers", ns, "llama-8b") is None
    assert c.get("policy/v1", "poddisruptionbudgets", ns, "llama-8b") is None

    # With KEDA, the Prometheus operator and the inference extension installed, the ScaledObject,
    # ServiceMonitor and InferencePool appear.
    install_inference_pool(c)
    for group, kind, plural in (("keda.sh", "ScaledObject", "scaledobjects"),
                                ("monitoring.coreos.com", "ServiceMonitor", "servicemonitors")):
        c.kubectl("apply", "--server-side", "--validate=false", "-f", "-", input=yaml.safe_dump(
            _minimal_crd(group, "v1alpha1" if group == "keda.sh" else "v1", kind, plural)))
    keda = copy.deepcopy(full)
    keda["spec"]["autoscaling"].update(keda=True, minReplicas=1)
    apply(c, ns, keda)
    obj = reconciled(c, ns, "llama-8b")
    assert conditions(obj)["ConfigValid"]["message"] == "the spec is valid"
    scaled = c.get("keda.sh/v1alpha1", "scaledobjects", ns, "llama-8b")
    assert scaled is not None and scaled["spec"]["minReplicaCount"] == 1
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "CBDeployment"
    assert scaled["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    monitor = c.get("monitoring.coreos.com/v1", "servicemonitors", ns, "llama-8b")
    assert monitor is not None and monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # deleted by hand, each comes back on its own event (no spec change), as the core children do
    for api, plural, old in (("keda.sh/v1alpha1", "scaledobjects", scaled), ("monitoring.coreos.com/v1", "servicemonitors", monitor)):
        c.kubectl("delete", f"{plural}.{api.split('/')[0]}", "llama-8b", "-n", ns)
        new = wait_for(lambda api=api, plural=plural, old=old: (o := c.get(api, plural, ns, "llama-8b"))
                       and o["metadata"]["uid"] != old["metadata"]["uid"] and o, what=f"the {plural} to be recreated")  # fmt: skip
        assert new["spec"] == old["spec"]


def _minimal_crd(group: str, version: str, kind: str, plural: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {"group": group, "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                 "versions": [{"name": version, "served": True, "storage": True, "schema": {
                     "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


def test_liveness_endpoint_reports_the_probe(crd_cluster: Cluster) -> None:
    from .conftest import operator_running

    with operator_running(crd_cluster) as (_runner, port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["apiserver"] == "v1.34.0"



CACHE_RESOURCES = {("batch", "jobs"), ("", "persistentvolumeclaims")}
# what only multi-node groups use (test_multinode.py checks them against its own requests)
GROUP_GRANTS = {("apps", "deployments", "delete")}


def cluster_role_grants(tools: Any) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) the chart's operator ClusterRole grants, as rendered by helm."""
    import subprocess

    rendered = subprocess.run([str(tools.helm), "template", "t", str(REPO / "charts" / "cbserve")],
                              capture_output=True, text=True, check=True).stdout
    (role,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ClusterRole"
               and not any(k.startswith("rbac.authorization.k8s.io/aggregate") for k in d["metadata"]["labels"])]
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}  # fmt: skip


def operator_requests(cluster: Cluster) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) of every request the operator made to `cluster`'s API server."""
    assert cluster.server.emulator is not None
    return {need for method, path, agent in cluster.server.emulator.journal
            if agent.startswith(("kopf/", "cbserve-operator")) for need in _rbac_request(method, path)}  # fmt: skip


def _rbac_request(method: str, path_qs: str) -> list[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], verb) an API server's authorizer would check for a request."""
    path, _, query = path_qs.partition("?")
    parts = [p for p in path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) > 2:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) > 3:
        group, rest = parts[1], parts[3:]
    else:
        return []  # discovery and /version: non-resource URLs every authenticated user may read
    if rest and rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, "/".join(rest[2:])
    if sub:
        resource = f"{resource}/{sub}"
    if method == "GET":
        verbs = ["watch" if "watch=true" in query else "get" if name else "list"]
    elif method == "PATCH":
        verbs = ["patch", "create"] if "fieldManager=" in query else ["patch"]  # apply may create
    else:
        verbs = [{"POST": "create", "PUT": "update", "DELETE": "delete"}[method]]
    return [(group, resource, verb) for verb in verbs]


def test_every_status_write_of_the_operator_is_guarded_by_its_resource_version(crd_cluster: Cluster) -> None:
    """One way to write status (handlers.write_status): computed from the object as read, and refused
    (409, computed again) if the object moved on since, so a stale Ready cannot win. Runs after the
    tests above, over every status write they made the operator do."""
    assert crd_cluster.server.emulator is not None
    writes = [w for w in crd_cluster.server.emulator.status_writes if w[0].startswith(("kopf/", "cbserve-operator"))]
    assert len([w for w in writes if w[1] == "cbdeployments"]) > 50
    assert [w for w in writes if not w[2]] == []


def test_cluster_role_covers_every_request_the_operator_made(crd_cluster: Cluster, tools: Any) -> None:
    """Runs last in this module: checks the chart's ClusterRole against all the operator did above."""
    allowed = cluster_role_grants(tools)
    assert not any("*" in item for item in allowed)
    made = operator_requests(crd_cluster)
    assert ("cbserve.io", "cbdeployments/status", "patch") in made
    assert ("autoscaling", "horizontalpodautoscalers", "delete") in made
    assert made - allowed == set()
    # Nothing granted that the operator never needs (KEDA and the Prometheus operator are absent here;
    # test_model_cache.py checks the model cache's grants against what its tests make the operator do).
    unused = {item for item in allowed - made if item[0] not in ("keda.sh", "monitoring.coreos.com",
              "leaderworkerset.x-k8s.io") and item[:2] not in CACHE_RESOURCES and item not in GROUP_GRANTS}  # fmt: skip
    assert unused == set(), unused


REFUSED_SPECS = [  # (name, spec changes, words of the CRD's message, words of the operator's message)
    ("llama-3.1-8b", {}, "must be a DNS-1035 label", "must be a DNS-1035 label"),
    ("a" * 64, {}, "must be a DNS-1035 label", "must be a DNS-1035 label"),
    ("probes", {"probes": {"liveness": {"successThreshold": 2}}}, "probes.liveness.successThreshold must be 1",
     "probes.liveness.successThreshold must be 1"),
    ("grace", {"podTemplate": {"terminationGracePeriodSeconds": 5}}, "terminationGracePeriodSeconds",
     "must be above the 5 s preStop sleep"),
    ("pdb", {"pdb": {"enabled": True, "minAvailable": "lots"}}, "pdb.minAvailable must be an integer >= 0",
     "pdb.minAvailable must be an integer >= 0"),
    ("gpu", {"resources": {"gpuResourceName": "GPUs please"}}, "gpuResourceName", "extended resource name"),
    ("volumes", {"podTemplate": {"volumes": [{"name": "cache", "emptyDir": {}}]}}, "the operator's own volume names",
     "the operator's own volume names"),
    ("rollout", {"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}}, "cannot both be 0", "cannot both be 0"),
    # maxSurge left to its default, 0 for GPU pods of more than one replica (or groups)
    ("gpu-unavail0", {"replicas": 2, "resources": {"gpu": 1}, "rollout": {"maxUnavailable": 0}}, "cannot both be 0",
     "cannot both be 0"),
    ("group-unavail0", {"resources": {"gpu": 1, "nodes": 2}, "rollout": {"maxUnavailable": "0%"}}, "cannot both be 0",
     "cannot both be 0"),
    ("k8s-io-gpu", {"resources": {"gpu": 1, "gpuResourceName": "kubernetes.io/gpu"}},
     "the API server keeps names in the kubernetes.io domains", "the API server keeps names in the kubernetes.io"),
    ("runtime", {"podTemplate": {"runtimeClassName": "Nvidia GPU"}}, "podTemplate.runtimeClassName",
     "podTemplate.runtimeClassName must be a DNS-1123 subdomain"),
    ("spread", {"podTemplate": {"topologySpreadConstraints": [{"maxSkew": 0, "topologyKey": "zone",
                                                               "whenUnsatisfiable": "DoNotSchedule"}]}},
     "maxSkew: 0 is less than the minimum of 1", "needs maxSkew >= 1"),
    # what the GPU engine cannot run (the example asks for one GPU)
    ("three-gpus", {"resources": {"gpu": 3}}, "resources.gpu must be 0, 1, 2, 4, 8 or 16: the GPUs of a pod form "
     "one tensor-parallel group", "resources.gpu must be 0, 1, 2, 4, 8 or 16: the GPUs of a pod form one"),
    ("gpu-blocks", {"engine": {"blockSize": 128}}, "engine.blockSize must be a multiple of 256 when resources.gpu > 0",
     "engine.blockSize must be a multiple of 256 when resources.gpu > 0"),
    ("gpu-float32", {"engine": {"dtype": "float32"}}, "engine.dtype float32 is refused when resources.gpu > 0",
     "engine.dtype float32 is refused when resources.gpu > 0"),
    ("mounts", {"podTemplate": {"volumes": [{"name": "shm", "emptyDir": {}}],
                                "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}},
     "the operator's own mount paths", "the operator's own mount paths"),
    # tensor parallel: a pod's GPUs, a group's pods (test_multinode.py renders them)
    ("many-gpus", {"resources": {"gpu": 32}}, "spec.resources.gpu: 32 is greater than the maximum of 16",
     "resources.gpu must be 0, 1, 2, 4, 8 or 16"),
    ("cpu-group", {"resources": {"gpu": 0, "nodes": 2}}, "resources.nodes above 1 needs resources.gpu >= 1",
     "resources.nodes above 1 needs resources.gpu >= 1"),
    ("no-nodes", {"resources": {"gpu": 1, "nodes": 0}}, "spec.resources.nodes: 0 is less than the minimum of 1",
     "resources.nodes must be in [1, 64]"),
    ("heads", {"model": {"uri": "/m", "numKeyValueHeads": 8}, "resources": {"gpu": 4, "nodes": 4}},
     "model.numKeyValueHeads must be divisible by the tensor-parallel size",
     "model.numKeyValueHeads must be divisible by the tensor-parallel size"),
    ("a" * 41, {"resources": {"gpu": 1, "nodes": 2}}, "metadata.name must be at most 40 characters when "
     "resources.nodes > 1", "metadata.name must be at most 40 characters when resources.nodes > 1"),
    ("tp-flags", {"engine": {"extraArgs": ["--nnodes", "3"]}}, "engine.extraArgs cannot set --tensor-parallel-size",
     "engine.extraArgs cannot set --tensor-parallel-size"),
]


@pytest.mark.parametrize(("name", "changes", "crd_words", "operator_words"), REFUSED_SPECS, ids=[r[0][:12] for r in REFUSED_SPECS])
def test_the_crd_and_the_operator_refuse_what_the_children_would_be_refused_for(
        crd_cluster: Cluster, name: str, changes: dict[str, Any], crd_words: str, operator_words: str) -> None:  # fmt: skip
    """Each spec here is one the API server takes for a CBDeployment but would refuse for a child (a
    Service name, a probe, a PDB, a resource name, a volume). The CRD's CEL rules and schema, as the
    emulator evaluates them, refuse it at `kubectl apply`; the operator refuses it too (a cluster
    without CEL, or an object older than the rule)."""
    manifest = example()
    manifest["metadata"]["name"] = name
    manifest["spec"].update(changes)
    refused = crd_cluster.kubectl("apply", "--validate=false", "-n", "refusals", "-f", "-",
                                  input=yaml.safe_dump(manifest), check=False)  # fmt: skip
    assert refused.returncode != 0 and crd_words in refused.stderr, refused.stderr
    with pytest.raises(spec_module.SpecError, match=re.escape(operator_words)):
        spec_module.parse_spec(name, manifest["spec"])


@pytest.mark.parametrize(("name", "changes"), [
    ("gpu-512-bf16", {"engine": {"blockSize": 512, "dtype": "bfloat16"}}),
    ("gpu-defaults", {"engine": {}}),
    ("cpu-16-f32", {"resources": {"gpu": 0}, "engine": {"blockSize": 16, "dtype": "float32"}}),
    ("cpu-defaults", {"resources": {}, "engine": {}}),
    # tensor-parallel layouts: the KV heads split evenly, or no count given (the engine checks at start-up)
    ("tp-eight", {"model": {"uri": "/m", "numKeyValueHeads": 8}, "resources": {"gpu": 8}}),
    ("tp-sixteen", {"resources": {"gpu": 16}}),
    ("tp-two-by-two", {"model": {"uri": "/m", "numKeyValueHeads": 8}, "resources": {"gpu": 2, "nodes": 2}}),
    ("tp-three-nodes", {"model": {"uri": "/m", "numKeyValueHeads": 6}, "resources": {"gpu": 1, "nodes": 3}}),
    ("cpu-any-heads", {"model": {"uri": "/m", "numKeyValueHeads": 5}, "resources": {"gpu": 0}, "engine": {}}),
    ("a" * 40, {"resources": {"gpu": 1, "nodes": 2}}),
    # one rollout value given as 0, the other's default not 0
    ("gpu-surge0", {"resources": {"gpu": 1}, "rollout": {"maxSurge": 0}}),
    ("cpu-surge0", {"resources": {"gpu": 0}, "rollout": {"maxSurge": "0%"}}),
    ("cpu-unavail0", {"resources": {"gpu": 0}, "rollout": {"maxUnavailable": 0}}),
    ("gpu1-unavail0", {"resources": {"gpu": 1}, "rollout": {"maxUnavailable": 0}}),
    ("recreate", {"rollout": {"strategy": "Recreate"}}),
    ("amd-gpu", {"resources": {"gpu": 1, "gpuResourceName": "amd.com/gpu"}}),
])
def test_the_crd_accepts_what_the_engine_runs(crd_cluster: Cluster, name: str, changes: dict[str, Any]) -> None:
    """The GPU rules' other side: a multiple of 256 and a half-precision dtype on a GPU, anything on the
    CPU; tensor-parallel sizes that divide the KV heads."""
    manifest = example()
    manifest["metadata"]["name"] = name
    manifest["spec"].update(changes)
    applied = crd_cluster.kubectl("apply", "--validate=false", "-n", "accepted", "-f", "-",
                                  input=yaml.safe_dump(manifest), check=False)  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    spec_module.parse_spec(name, manifest["spec"])


def test_status_writes_are_judged_by_the_crds_status_schema(crd_cluster: Cluster) -> None:
    """The API server validates and prunes a status write against the CRD's status schema, as it
    does the spec: a condition type the enum does not list is refused (422), an unknown field is
    dropped (test_crd.py checks that the enum lists every condition the operator writes)."""
    c, ns = crd_cluster, "status-schema"
    apply(c, ns, EXAMPLE)
    path = f"/apis/{CBD}/namespaces/{ns}/cbdeployments/smollm2/status"

    def patch(status: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        return c.kubectl("patch", "cbdeployment", "smollm2", "-n", ns, "--subresource=status", "--type", "merge",
                         "-p", json.dumps({"status": status}), check=False)  # fmt: skip

    refused = patch({"conditions": [{"type": "Sleepy", "status": "True"}]})
    assert refused.returncode != 0 and "Sleepy" in refused.stderr, refused.stderr
    assert patch({"madeUp": 1}).returncode == 0
    assert "madeUp" not in c.api(path)["status"]  # type: ignore[index]
