"""The model cache (spec.model.cache): a claim and one download Job per model and revision, the
Deployment held at 0 replicas until the Job succeeds, ModelCached in status. The operator runs for
real against the emulated API server; as nothing runs Jobs here, the tests write the Job's status
the way the Job controller would."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from cbserve_operator import spec as spec_module

from .conftest import REPO, Cluster, wait_for
from .test_operator import CACHE_RESOURCES, CBD, apply, cbd, cluster_role_grants, conditions, operator_requests, reconciled

REV = "0123456789abcdef0123456789abcdef01234567"
URI = f"hf://acme/tiny@{REV}"


def manifest(name: str = "tiny", uri: str = URI, replicas: int = 1, **cache: Any) -> dict[str, Any]:
    return {"apiVersion": CBD, "kind": "CBDeployment", "metadata": {"name": name},
            "spec": {"model": {"uri": uri, "cache": {"enabled": True, **cache}}, "replicas": replicas}}  # fmt: skip


def job_name(name: str, uri: str, claim: str) -> str:
    return f"{name}-model-{hashlib.sha256(f'{uri} {claim}'.encode()).hexdigest()[:10]}"


def deployment(c: Cluster, ns: str, name: str) -> dict[str, Any]:
    dep = c.get("apps/v1", "deployments", ns, name)
    assert dep is not None
    return dep


def server(dep: dict[str, Any]) -> dict[str, Any]:
    return dep["spec"]["template"]["spec"]["containers"][0]


def finish_job(c: Cluster, ns: str, name: str, ok: bool = True) -> None:
    """What the Job controller writes when the download pod exits 0, or after the last retry failed."""
    status = ({"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]} if ok else
              {"failed": 4, "conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                            "message": "Job has reached the specified backoff limit"}]})  # fmt: skip
    c.kubectl("patch", "job", name, "-n", ns, "--subresource=status", "--type", "merge",
              "-p", json.dumps({"status": status}))  # fmt: skip


def model_cached(c: Cluster, ns: str, name: str, reason: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        obj = cbd(c, ns, name)
        return obj if conditions(obj).get("ModelCached", {}).get("reason") == reason else None
    return wait_for(check, what=f"ModelCached {reason} on {ns}/{name}")


def test_the_hub_example_downloads_its_model_then_serves_it(operator: KopfRunner, crd_cluster: Cluster) -> None:
    """docs/kubernetes.md's path from nothing: examples/cbdeployment-hf.yaml, no pre-filled claim."""
    c, ns = crd_cluster, "hub-example"
    example = yaml.safe_load((REPO / "examples" / "cbdeployment-hf.yaml").read_text())
    apply(c, ns, example)
    reconciled(c, ns, "smollm2")
    uri = example["spec"]["model"]["uri"]
    name = job_name("smollm2", uri, "smollm2-model-cache")
    job = c.get("batch/v1", "jobs", ns, name)
    assert job is not None and job["spec"]["template"]["spec"]["containers"][0]["command"][:3] == [
        "cbserve", "download", uri]  # fmt: skip
    assert deployment(c, ns, "smollm2")["spec"]["replicas"] == 0
    finish_job(c, ns, name)
    wait_for(lambda: deployment(c, ns, "smollm2")["spec"]["replicas"] == 1, what="the Deployment scaled to 1")
    container = server(deployment(c, ns, "smollm2"))
    assert container["command"][2:4] == ["--model", uri] and container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_a_pinned_model_is_downloaded_once_then_every_replica_serves_it(operator: KopfRunner,
                                                                        crd_cluster: Cluster) -> None:  # fmt: skip
    c, ns = crd_cluster, "cache"
    apply(c, ns, manifest(replicas=2, size="5Gi", storageClassName="fast", accessMode="ReadWriteOnce",
                          hfTokenSecret={"name": "hf", "key": "tok"}))  # fmt: skip
    owner = reconciled(c, ns, "tiny")
    uid = owner["metadata"]["uid"]

    pvc = c.get("v1", "persistentvolumeclaims", ns, "tiny-model-cache")
    assert pvc is not None and pvc["spec"] == {"accessModes": ["ReadWriteOnce"], "storageClassName": "fast",
                                               "resources": {"requests": {"storage": "5Gi"}}}  # fmt: skip
    name = job_name("tiny", URI, "tiny-model-cache")
    job = c.get("batch/v1", "jobs", ns, name)
    assert job is not None
    pod = job["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    download = pod["containers"][0]
    assert download["command"] == ["cbserve", "download", URI, "--to", "/models/hf"]
    env = {e["name"]: e for e in download["env"]}
    assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "tok"}}
    assert download["volumeMounts"][0] == {"name": "model", "mountPath": "/models/hf"}
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "tiny-model-cache"}} in pod["volumes"]
    assert download["resources"]["requests"]["memory"] and pod["restartPolicy"] == "Never"
    service = c.get("v1", "services", ns, "tiny")
    assert service is not None  # the download pod is no endpoint of the Service
    assert not set(service["spec"]["selector"].items()) <= set(job["spec"]["template"]["metadata"]["labels"].items())
    for child in (pvc, job):
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid

    # Held at 0 replicas while the Job runs; the pods will mount the claim read-only and never ask the Hub.
    dep = deployment(c, ns, "tiny")
    assert dep["spec"]["replicas"] == 0
    container = server(dep)
    assert container["command"][2:4] == ["--model", URI]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CBSERVE_MODEL_DIR"] == "/models/hf" and env["HF_HUB_OFFLINE"] == "1" and "HF_TOKEN" not in env
    assert {"name": "model", "mountPath": "/models/hf", "readOnly": True} in container["volumeMounts"]
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "tiny-model-cache", "readOnly": True}
    assert volumes["cache"]["emptyDir"]["sizeLimit"] == "2Gi"  # the weights are on the claim, not in /cache
    # ReadWriteOnce attaches to one node: every server pod (a surge pod too) goes where the others run
    assert dep["spec"]["template"]["spec"]["affinity"] == {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": {"app.kubernetes.io/name": "cbserve", "app.kubernetes.io/instance": "tiny"}},
         "topologyKey": "kubernetes.io/hostname"}]}}  # fmt: skip
    assert container["resources"]["requests"]["memory"] == "2Gi"  # never BestEffort
    status = owner["status"]
    cond = conditions(owner)
    assert status["phase"] == "Pending" and cond["ModelCached"]["status"] == "False"
    assert cond["ModelCached"]["reason"] == "Downloading" and name in cond["ModelCached"]["message"]
    assert cond["Ready"]["reason"] == "ModelNotCached"

    c.kubectl("scale", "cbd", "tiny", "-n", ns, "--replicas=3")  # scaling waits for the download too
    assert reconciled(c, ns, "tiny")["spec"]["replicas"] == 3
    assert deployment(c, ns, "tiny")["spec"]["replicas"] == 0

    finish_job(c, ns, name)
    wait_for(lambda: deployment(c, ns, "tiny")["spec"]["replicas"] == 3, what="the Deployment scaled to 3")
    cached = model_cached(c, ns, "tiny", "Cached")
    assert conditions(cached)["ModelCached"]["status"] == "True"
    assert conditions(cached)["Ready"]["reason"] != "ModelNotCached"

    # A new revision downloads next to the old one, while the pods of the old one keep serving.
    uri2 = "hf://acme/tiny@v2"
    apply(c, ns, manifest(uri=uri2, replicas=3, size="5Gi", storageClassName="fast", accessMode="ReadWriteOnce",
                          hfTokenSecret={"name": "hf", "key": "tok"}))  # fmt: skip
    reconciled(c, ns, "tiny")
    name2 = job_name("tiny", uri2, "tiny-model-cache")
    assert c.get("batch/v1", "jobs", ns, name2) is not None
    wait_for(lambda: c.get("batch/v1", "jobs", ns, name) is None, what="the old Job to be deleted")
    dep = deployment(c, ns, "tiny")
    assert server(dep)["command"][3] == URI and dep["spec"]["replicas"] == 3
    model_cached(c, ns, "tiny", "Downloading")
    finish_job(c, ns, name2)
    wait_for(lambda: server(deployment(c, ns, "tiny"))["command"][3] == uri2, what="the rollout to the new revision")
    model_cached(c, ns, "tiny", "Cached")
    assert [p["metadata"]["name"] for p in c.items("v1", "persistentvolumeclaims", ns)] == ["tiny-model-cache"]


def test_a_failed_download_is_a_condition_with_the_jobs_message(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "cache-fails"
    apply(c, ns, manifest(name="broken", replicas=1))
    reconciled(c, ns, "broken")
    name = job_name("broken", URI, "broken-model-cache")
    old = c.get("batch/v1", "jobs", ns, name)
    assert old is not None

    finish_job(c, ns, name, ok=False)
    failed = model_cached(c, ns, "broken", "DownloadFailed")
    cond = conditions(failed)["ModelCached"]
    assert cond["status"] == "False"
    assert f"the Job {name} failed: BackoffLimitExceeded: Job has reached the specified backoff limit" in cond["message"]
    assert failed["status"]["phase"] == "Failed" and conditions(failed)["Ready"]["status"] == "False"
    events = wait_for(lambda: [e for e in c.items("v1", "events", ns) if e.get("reason") == "ModelDownloadFailed"],
                      what="a ModelDownloadFailed Event")  # fmt: skip
    assert events[0]["type"] == "Warning" and "BackoffLimitExceeded" in events[0]["message"]
    assert deployment(c, ns, "broken")["spec"]["replicas"] == 0

    # Deleting the failed Job (after fixing the cause) tries again.
    c.kubectl("delete", "job", name, "-n", ns)
    wait_for(lambda: (j := c.get("batch/v1", "jobs", ns, name)) and j["metadata"]["uid"] != old["metadata"]["uid"],
             what="a new Job")  # fmt: skip
    assert model_cached(c, ns, "broken", "Downloading")["status"]["phase"] == "Pending"


def test_an_existing_claim_and_turning_the_cache_off(operator: KopfRunner, crd_cluster: Cluster) -> None:
    c, ns = crd_cluster, "cache-claim"
    apply(c, ns, manifest(name="shared", replicas=1))
    reconciled(c, ns, "shared")
    assert c.get("v1", "persistentvolumeclaims", ns, "shared-model-cache") is not None

    # Another claim: the operator's own goes, and the model is downloaded into the new one.
    apply(c, ns, manifest(name="shared", replicas=1, claimName="models-rwx"))
    reconciled(c, ns, "shared")
    wait_for(lambda: c.get("v1", "persistentvolumeclaims", ns, "shared-model-cache") is None,
             what="the operator's claim to be deleted")  # fmt: skip
    name = job_name("shared", URI, "models-rwx")
    job = c.get("batch/v1", "jobs", ns, name)
    assert job is not None
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models-rwx"}} in job["spec"]["template"]["spec"]["volumes"]
    assert [j["metadata"]["name"] for j in c.items("batch/v1", "jobs", ns)] == [name]
    finish_job(c, ns, name)
    wait_for(lambda: deployment(c, ns, "shared")["spec"]["replicas"] == 1, what="the Deployment scaled to 1")
    volumes = {v["name"]: v for v in deployment(c, ns, "shared")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models-rwx", "readOnly": True}

    # Off: the Jobs go, the pods download the model themselves again, ModelCached is no more.
    off = manifest(name="shared", replicas=1)
    off["spec"]["model"]["cache"] = {"enabled": False}
    apply(c, ns, off)
    done = reconciled(c, ns, "shared")
    assert "ModelCached" not in conditions(done)
    wait_for(lambda: not c.items("batch/v1", "jobs", ns), what="the Jobs to be deleted")
    dep = deployment(c, ns, "shared")
    env = {e["name"]: e.get("value") for e in server(dep)["env"]}
    assert env["CBSERVE_MODEL_DIR"] == "/cache/models" and "HF_HUB_OFFLINE" not in env
    assert "model" not in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}


REFUSED = [  # (id, model, words in both the CRD's and the operator's message)
    ("unpinned", {"uri": "hf://acme/tiny", "cache": {"enabled": True}}, "model.cache needs a pinned model.uri"),
    ("not-hf", {"uri": "pvc://models/tiny", "cache": {"enabled": True}}, "model.cache is for hf:// models"),
    ("claim-and-size", {"uri": URI, "cache": {"enabled": True, "claimName": "x", "size": "1Gi"}},
     "model.cache.claimName names an existing claim"),
]


@pytest.mark.parametrize(("case", "model", "words"), REFUSED, ids=[r[0] for r in REFUSED])
def test_the_crd_and_the_operator_refuse_a_cache_they_cannot_fill(crd_cluster: Cluster, case: str,
                                                                   model: dict[str, Any], words: str) -> None:  # fmt: skip
    """An unpinned model is refused, not resolved: the operator would have to ask the Hub, and the
    revision would still be whatever the Job found. Without the cache an unpinned model is accepted."""
    body = {"apiVersion": CBD, "kind": "CBDeployment", "metadata": {"name": case}, "spec": {"model": model}}
    refused = crd_cluster.kubectl("apply", "--validate=false", "-n", "cache-refusals", "-f", "-",
                                  input=yaml.safe_dump(body), check=False)  # fmt: skip
    assert refused.returncode != 0 and words in refused.stderr, refused.stderr
    with pytest.raises(spec_module.SpecError, match=re.escape(words)):
        spec_module.parse_spec(case, body["spec"])
    uncached = copy.deepcopy(body)
    uncached["spec"]["model"]["cache"]["enabled"] = False
    if case != "claim-and-size":
        crd_cluster.kubectl("apply", "--validate=false", "-n", "cache-refusals", "-f", "-",
                            input=yaml.safe_dump(uncached))  # fmt: skip


def test_an_unpinned_model_stored_without_validation_is_an_invalid_spec(operator: KopfRunner,
                                                                        crd_cluster: Cluster) -> None:  # fmt: skip
    c, ns = crd_cluster, "cache-unpinned"
    assert c.server.emulator is not None
    c.server.emulator.validate_custom_resources = False  # a cluster without CEL, or an object older than the rule
    try:
        apply(c, ns, manifest(name="loose", uri="hf://acme/tiny"))
    finally:
        c.server.emulator.validate_custom_resources = True
    failed = reconciled(c, ns, "loose")
    valid = conditions(failed)["ConfigValid"]
    assert failed["status"]["phase"] == "Failed" and valid["reason"] == "InvalidSpec"
    assert "model.cache needs a pinned model.uri, hf://org/name@revision" in valid["message"]
    assert not c.items("batch/v1", "jobs", ns) and not c.items("v1", "persistentvolumeclaims", ns)
    assert c.get("apps/v1", "deployments", ns, "loose") is None


def test_more_than_one_pod_on_the_default_read_write_once_cache_needs_a_choice(operator: KopfRunner,
                                                                               crd_cluster: Cluster) -> None:  # fmt: skip
    """The claim's default, ReadWriteOnce, attaches to one node: more pods need accessMode set, to
    ReadWriteMany or to ReadWriteOnce on purpose (all pods on one node). Refused at apply, at
    `kubectl scale`, and by the operator; a group is refused ReadWriteOnce at all."""
    c, ns = crd_cluster, "cache-rwo"
    apply(c, ns, manifest(name="one"))
    assert reconciled(c, ns, "one")["status"]["phase"] == "Pending"
    scaled = c.kubectl("scale", "cbd", "one", "-n", ns, "--replicas=2", check=False)
    assert scaled.returncode != 0 and "needs model.cache.accessMode set" in scaled.stderr, scaled.stderr
    autoscaled = manifest(name="one")
    autoscaled["spec"]["autoscaling"] = {"enabled": True, "maxReplicas": 3}
    refused = c.kubectl("apply", "--validate=false", "-n", ns, "-f", "-", input=yaml.safe_dump(autoscaled), check=False)
    assert refused.returncode != 0 and "needs model.cache.accessMode set" in refused.stderr
    with pytest.raises(spec_module.SpecError, match="needs model.cache.accessMode set"):
        spec_module.parse_spec("one", autoscaled["spec"])
    for mode in ("ReadWriteMany", "ReadWriteOnce"):
        apply(c, ns, manifest(name=f"two-{mode.lower()}", replicas=2, accessMode=mode))
        reconciled(c, ns, f"two-{mode.lower()}")
        dep = deployment(c, ns, f"two-{mode.lower()}")
        assert ("affinity" in dep["spec"]["template"]["spec"]) == (mode == "ReadWriteOnce")
    group = manifest(name="group", accessMode="ReadWriteOnce")
    group["spec"]["resources"] = {"gpu": 1, "nodes": 2}
    with pytest.raises(spec_module.SpecError, match="resources.nodes > 1 needs model.cache.accessMode: ReadWriteMany"):
        spec_module.parse_spec("group", group["spec"])
    refused = c.kubectl("apply", "--validate=false", "-n", ns, "-f", "-", input=yaml.safe_dump(group), check=False)
    assert refused.returncode != 0 and "a group's pods run on several nodes" in refused.stderr


def test_a_deleted_model_cache_claim_comes_back(operator: KopfRunner, crd_cluster: Cluster) -> None:
    """The claim is watched like the other children (on a real cluster its deletion waits for the pods
    that mount it to go, pvc-protection; then it is created again, and the Job fills it again)."""
    c, ns = crd_cluster, "cache-claim"
    apply(c, ns, manifest(name="kept"))
    reconciled(c, ns, "kept")
    old = c.get("v1", "persistentvolumeclaims", ns, "kept-model-cache")
    assert old is not None
    c.kubectl("delete", "pvc", "kept-model-cache", "-n", ns)
    new = wait_for(lambda: (p := c.get("v1", "persistentvolumeclaims", ns, "kept-model-cache")) and
                   p["metadata"]["uid"] != old["metadata"]["uid"] and p, what="the claim to be recreated")  # fmt: skip
    assert new["spec"] == old["spec"]


def test_rendering_a_long_name_keeps_the_job_name_a_label_value() -> None:
    name = "m" * 63
    parsed = spec_module.parse_spec(name, manifest(name=name)["spec"])
    from cbserve_operator.model_cache import job_name as render_job_name

    assert len(render_job_name(parsed)) <= 63 and render_job_name(parsed).startswith("m" * 46 + "-model-")


def test_the_cluster_role_covers_the_model_cache(crd_cluster: Cluster, tools: Any) -> None:
    """Runs last in this module: every request above is granted, and every model cache grant was used."""
    allowed, made = cluster_role_grants(tools), operator_requests(crd_cluster)
    assert made - allowed == set()
    assert {item for item in allowed if item[:2] in CACHE_RESOURCES} - made == set()
