"""The model cache: a claim holding hf:// models, and one download Job per model and revision.

The Job runs `cbserve download hf://org/name@revision --to /models/hf` with the server image (the
token, when given, from a Secret as HF_TOKEN); the server pods mount the claim read-only at the same
path and load with HF_HUB_OFFLINE=1, so every replica serves the files that one Job fetched. Until
the Job succeeds the Deployment is held: created with 0 replicas, or left as it is when it exists
(pods of an earlier revision keep serving while a new one downloads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import naming
from .spec import CBDeploymentSpec

DOWNLOAD_CONTAINER = "download"
BACKOFF_LIMIT = 3  # pod failures before the Job fails for good
# The download needs a CPU at most and little memory (files stream to disk); never BestEffort.
DOWNLOAD_REQUESTS = {"cpu": "500m", "memory": "1Gi", "ephemeral-storage": "1Gi"}
TMP_SIZE = "1Gi"


def claim_name(spec: CBDeploymentSpec) -> str:
    return spec.model.cache.claim_name or naming.model_cache_claim(spec.name)


def pins_one_node(spec: CBDeploymentSpec) -> bool:
    """Whether the server pods must share one node: the claim the operator creates is ReadWriteOnce,
    which attaches to one node at a time (a pod elsewhere, a surge pod included, would hang in
    ContainerCreating on Multi-Attach). A group (resources.nodes > 1) is refused that claim."""
    cache = spec.model.cache
    return cache.enabled and cache.claim_name is None and cache.access_mode == "ReadWriteOnce"


def job_name(spec: CBDeploymentSpec) -> str:
    """Named by the model, revision and claim: a change of any of them is a new download."""
    return naming.model_job_name(spec.name, spec.model.uri, claim_name(spec))


def render_claim(spec: CBDeploymentSpec) -> dict[str, Any]:
    """The claim the operator creates when `model.cache.claimName` names none."""
    cache = spec.model.cache
    claim_spec: dict[str, Any] = {"accessModes": [cache.access_mode], "resources": {"requests": {"storage": cache.size}}}
    if cache.storage_class_name is not None:
        claim_spec["storageClassName"] = cache.storage_class_name
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": naming.model_cache_claim(spec.name),
                     "labels": {**naming.common_labels(spec.name), naming.LABEL_COMPONENT: "model-cache"}},
        "spec": claim_spec,
    }


def render_job(spec: CBDeploymentSpec) -> dict[str, Any]:
    """The download Job. Created once and then only read: a Job's pod template cannot change, and its
    name follows the model, revision and claim, so a new revision (or claim) is a new Job."""
    tpl = spec.pod_template
    env: list[dict[str, Any]] = [
        {"name": "HF_HOME", "value": "/tmp/huggingface"},
        {"name": "HF_HUB_DISABLE_PROGRESS_BARS", "value": "1"},
    ]
    if spec.model.cache.hf_token_secret is not None:
        name, key = spec.model.cache.hf_token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    overridden = {e["name"] for e in tpl.env}  # the pods' env (a proxy, HF_ENDPOINT) applies here too
    env = [e for e in env if e["name"] not in overridden] + tpl.env
    container = {
        "name": DOWNLOAD_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["cbserve", "download", spec.model.uri, "--to", naming.MODEL_DIR],
        "env": env,
        "resources": {"requests": dict(DOWNLOAD_REQUESTS)},
        "volumeMounts": [{"name": "model", "mountPath": naming.MODEL_DIR}, {"name": "tmp", "mountPath": "/tmp"}],
        "terminationMessagePolicy": "FallbackToLogsOnError",  # the error line shows in the pod's status
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},  # fmt: skip
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # the download never calls the Kubernetes API
        "containers": [container],
        "volumes": [{"name": "model", "persistentVolumeClaim": {"claimName": claim_name(spec)}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}}],  # fmt: skip
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},  # fmt: skip
    }
    # where the server pods may run, the Job may too (a ReadWriteOnce volume attaches to one node)
    optional = {"nodeSelector": tpl.node_selector, "tolerations": tpl.tolerations, "affinity": tpl.affinity,
                "imagePullSecrets": tpl.image_pull_secrets, "serviceAccountName": tpl.service_account_name}  # fmt: skip
    pod_spec.update({k: v for k, v in optional.items() if v})
    labels = naming.model_job_labels(spec.name)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": job_name(spec), "labels": labels, "annotations": {"cbserve.io/model": spec.model.uri}},
        "spec": {"backoffLimit": BACKOFF_LIMIT, "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
    }


@dataclass(frozen=True)
class CacheState:
    ready: bool
    reason: str  # Cached | Downloading | DownloadFailed
    message: str

    @property
    def failed(self) -> bool:
        return self.reason == "DownloadFailed"


def job_state(spec: CBDeploymentSpec, job: dict[str, Any]) -> CacheState:
    """What the Job's status says about the cache: done, under way, or failed (with the Job's message)."""
    status = job.get("status", {}) or {}
    name, claim = job["metadata"]["name"], claim_name(spec)
    conditions = {c.get("type"): c for c in status.get("conditions", []) or [] if c.get("status") == "True"}
    if "Complete" in conditions or int(status.get("succeeded", 0) or 0) > 0:
        return CacheState(True, "Cached", f"{spec.model.uri} is in the claim {claim} (Job {name})")
    if "Failed" in conditions:
        failed = conditions["Failed"]
        why = ": ".join(part for part in (failed.get("reason"), failed.get("message")) if part)
        return CacheState(False, "DownloadFailed", f"the Job {name} failed: {why or 'no reason given'} (kubectl logs "
                                                   f"job/{name}; delete the Job to try again)")  # fmt: skip
    return CacheState(False, "Downloading", f"the Job {name} is downloading {spec.model.uri} into the claim {claim}")
