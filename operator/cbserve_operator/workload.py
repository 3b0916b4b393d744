"""The Deployment that runs `cbserve serve`: probes sized for model load, hardened pods, drain on SIGTERM.

Its server container and pod template are the leader's in a multi-node group too (group.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from typing import Any

from . import naming, parallel
from .model_cache import claim_name, pins_one_node
from .spec import CBDeploymentSpec

# Model load can take many minutes (download, weights to GPU, CUDA graph capture):
# the startup probe allows 10s x 180 = 30 minutes before liveness takes over.
DEFAULT_PROBES: dict[str, dict[str, int]] = {
    "startup": {"periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 180},
    "readiness": {"periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
    "liveness": {"periodSeconds": 10, "timeoutSeconds": 10, "failureThreshold": 6},
}
PROBE_PATHS = {"startup": "/ready", "readiness": "/ready", "liveness": "/health"}
RUN_AS_USER = 1000
# Seconds the pod keeps serving after being removed from endpoints, before SIGTERM starts the drain.
PRE_STOP_SLEEP_SECONDS = naming.PRE_STOP_SLEEP_SECONDS
# Seconds of the grace period kept back after the drain: uvicorn's 5 s to cut what is left, the
# engine stopping, the process exiting, before the kubelet's SIGKILL.
DRAIN_MARGIN_SECONDS = 10


def drain_timeout(spec: CBDeploymentSpec) -> int:
    """The server's drain budget: the pod's grace period, less the preStop sleep and the margin."""
    grace = spec.pod_template.termination_grace_period_seconds
    return max(1, grace - PRE_STOP_SLEEP_SECONDS - DRAIN_MARGIN_SECONDS)


def server_command(spec: CBDeploymentSpec) -> list[str]:
    return [
        "cbserve", "serve",
        "--model", spec.model.arg,
        "--served-model-name", spec.served_name,
        "--port", str(naming.PORT),
        "--config", f"{naming.CONFIG_DIR}/{naming.CONFIG_FILE}",
        "--drain-timeout", str(drain_timeout(spec)),
        "--device", "cuda" if spec.resources.gpu > 0 else "cpu",
        *parallel.serve_flags(spec),
        *spec.engine.extra_args,  # last: a flag given here wins
    ]


def _probe(kind: str, overrides: dict[str, int]) -> dict[str, Any]:
    return {
        "httpGet": {"path": PROBE_PATHS[kind], "port": "http"},
        **DEFAULT_PROBES[kind],
        **overrides,
    }


# Requested when the spec names none, so that a server pod is never BestEffort (the first evicted):
# a CPU and enough memory to load a small model; nothing is limited by a guess.
DEFAULT_CPU, DEFAULT_MEMORY = "1", "2Gi"
TMP_SIZE = "1Gi"


def _resources(spec: CBDeploymentSpec) -> dict[str, Any]:
    res = spec.resources
    requests: dict[str, Any] = {"cpu": res.cpu or DEFAULT_CPU, "memory": res.memory or DEFAULT_MEMORY,
                                "ephemeral-storage": _sum_quantities(res.cache_size, TMP_SIZE)}  # fmt: skip
    limits: dict[str, Any] = {}
    if res.memory is not None:
        limits["memory"] = res.memory
    if res.gpu:
        requests[res.gpu_resource_name] = str(res.gpu)
        limits[res.gpu_resource_name] = str(res.gpu)
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}  # fmt: skip


def _sum_quantities(*quantities: str) -> str:
    """Two storage quantities added, in Mi (rounded up): what the pod's volumes may fill."""
    total = 0.0
    for q in quantities:
        number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q)).groups()  # type: ignore[union-attr]
        total += float(number) * _UNITS[unit]
    return f"{math.ceil(total / 2**20)}Mi"


def _strategy(spec: CBDeploymentSpec) -> dict[str, Any]:
    rollout = spec.rollout
    if rollout.strategy == "Recreate":
        return {"type": "Recreate"}
    return {"type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": rollout.max_surge, "maxUnavailable": rollout.max_unavailable}}


def _volumes(spec: CBDeploymentSpec, config_hash: str) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": naming.config_map_name(spec.name, config_hash)}},
        {"name": "cache", "emptyDir": {"sizeLimit": spec.resources.cache_size}},
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
    ]
    if spec.resources.gpu:
        # NCCL and PyTorch use /dev/shm; the container default of 64 MiB is too small.
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}})
    if spec.model.scheme == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": spec.model.claim, "readOnly": True}})
    elif spec.model.cache.enabled:  # what the download Job wrote, read-only
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim_name(spec), "readOnly": True}})
    return volumes + spec.pod_template.volumes


def volume_mounts(spec: CBDeploymentSpec) -> list[dict[str, Any]]:
    """Where the container sees the pod's volumes (`_volumes`)."""
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": naming.CONFIG_DIR, "readOnly": True},
        {"name": "cache", "mountPath": naming.CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    if spec.resources.gpu:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if spec.model.scheme == "pvc":
        mounts.append({"name": "model", "mountPath": f"/models/{spec.model.claim}", "readOnly": True})
    elif spec.model.cache.enabled:
        mounts.append({"name": "model", "mountPath": naming.MODEL_DIR, "readOnly": True})
    return mounts + spec.pod_template.volume_mounts


def server_env(spec: CBDeploymentSpec, api_key: bool = True) -> list[dict[str, Any]]:
    """The server's environment: caches under /cache, where the model is, the API key (`api_key`)."""
    cache = naming.CACHE_DIR
    env = [
        {"name": "HF_HOME", "value": f"{cache}/huggingface"},
        {"name": "XDG_CACHE_HOME", "value": cache},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": f"{cache}/inductor"},
        {"name": "TRITON_CACHE_DIR", "value": f"{cache}/triton"},
    ]
    if spec.model.scheme == "hf":  # cached: the download Job's folder, never the Hub; else the pod downloads
        env.append({"name": "CBSERVE_MODEL_DIR",
                    "value": naming.MODEL_DIR if spec.model.cache.enabled else f"{cache}/models"})
    if spec.model.scheme != "hf" or spec.model.cache.enabled:
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
    if api_key and spec.api_key_secret is not None:  # clients then need the key; the probes use open paths
        name, key = spec.api_key_secret
        env.append({"name": "CBSERVE_API_KEY", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    overridden = {e["name"] for e in spec.pod_template.env}
    return [e for e in env if e["name"] not in overridden] + spec.pod_template.env


def owned_template_fields(template: dict[str, Any]) -> tuple[Any, ...]:
    """What the operator decides in a pod template and nobody else writes (the API server fills in
    defaults elsewhere): the engine config's hash, the server's image and command."""
    annotations = (template.get("metadata", {}) or {}).get("annotations", {}) or {}
    containers = (template.get("spec", {}) or {}).get("containers", []) or [{}]
    return (annotations.get(naming.ANNOTATION_CONFIG_HASH), containers[0].get("image"),
            tuple(containers[0].get("command", []) or []))


def render_digest(template: dict[str, Any]) -> str:
    """The digest a rendered pod template carries (`cbserve.io/render`). A template whose owned
    fields still give its own digest is one of the operator's renders, untouched: what
    `kubectl rollout undo` brings back. An edit (`kubectl set image`) leaves the digest behind."""
    return hashlib.sha256(json.dumps(owned_template_fields(template)).encode()).hexdigest()[:16]


def server_container(spec: CBDeploymentSpec) -> dict[str, Any]:
    """The `cbserve serve` container: the Deployment's, and a multi-node group's leader's."""
    return {
        "name": naming.CONTAINER_NAME,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": server_command(spec),
        "ports": [{"name": "http", "containerPort": naming.PORT, "protocol": "TCP"}],
        "env": server_env(spec),
        "resources": _resources(spec),
        "volumeMounts": volume_mounts(spec),
        "startupProbe": _probe("startup", spec.probes.get("startup", {})),
        "readinessProbe": _probe("readiness", spec.probes.get("readiness", {})),
        "livenessProbe": _probe("liveness", spec.probes.get("liveness", {})),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _affinity(spec: CBDeploymentSpec) -> dict[str, Any] | None:
    """podTemplate.affinity, plus, on a ReadWriteOnce model cache, a required pod affinity to the node
    the other server pods run on (the first pod matches its own term and goes anywhere)."""
    affinity = copy.deepcopy(spec.pod_template.affinity) or {}
    if pins_one_node(spec):
        required = affinity.setdefault("podAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
        required.append({"labelSelector": {"matchLabels": naming.selector_labels(spec.name)},
                         "topologyKey": "kubernetes.io/hostname"})  # fmt: skip
    return affinity or None


def pod_template(spec: CBDeploymentSpec, config_hash: str, container: dict[str, Any],
                 component: str = "server") -> dict[str, Any]:  # fmt: skip
    """A hardened pod template around `container`, mounting the engine ConfigMap of `config_hash`;
    `component` labels it (a group's workers are `worker`). A server pod is scraped for /metrics."""
    tpl = spec.pod_template
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": _volumes(spec, config_hash),
        "terminationGracePeriodSeconds": tpl.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # the server never calls the Kubernetes API
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUN_AS_USER,
            "runAsGroup": RUN_AS_USER,
            "fsGroup": RUN_AS_USER,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    spread = [c if "labelSelector" in c else {**c, "labelSelector": {"matchLabels": naming.selector_labels(spec.name)}}
              for c in tpl.topology_spread_constraints]  # fmt: skip
    optional = {
        "nodeSelector": tpl.node_selector,
        "tolerations": tpl.tolerations,
        "affinity": _affinity(spec),
        "topologySpreadConstraints": spread,
        "priorityClassName": tpl.priority_class_name,
        "runtimeClassName": tpl.runtime_class_name,
        "serviceAccountName": tpl.service_account_name,
        "imagePullSecrets": tpl.image_pull_secrets,
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    annotations = {**tpl.annotations, naming.ANNOTATION_CONFIG_HASH: config_hash}
    if component == "server":
        annotations.update({"prometheus.io/scrape": "true", "prometheus.io/port": str(naming.PORT),
                            "prometheus.io/path": "/metrics"})  # fmt: skip
    labels = {**tpl.labels, **naming.common_labels(spec.name), naming.LABEL_COMPONENT: component}
    return {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec}


def render_deployment(spec: CBDeploymentSpec, config_hash: str, replicas: int | None = None) -> dict[str, Any]:
    """The apps/v1 Deployment for `spec`; `config_hash` annotates the pod template; `replicas`, when given,
    instead of the spec's (0 while the model cache is filled)."""
    template = pod_template(spec, config_hash, server_container(spec))
    template["metadata"]["annotations"][naming.ANNOTATION_RENDER] = render_digest(template)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": spec.name, "labels": naming.common_labels(spec.name)},
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "revisionHistoryLimit": naming.REVISION_HISTORY,
            "selector": {"matchLabels": naming.selector_labels(spec.name)},
            "strategy": _strategy(spec),
            "progressDeadlineSeconds": _progress_deadline(spec),
            "template": template,
        },
    }


def _progress_deadline(spec: CBDeploymentSpec) -> int:
    """A rollout is stuck once a new pod had its whole startup budget and a margin."""
    startup = {**DEFAULT_PROBES["startup"], **spec.probes.get("startup", {})}
    budget = startup.get("initialDelaySeconds", 0) + startup["periodSeconds"] * startup["failureThreshold"]
    return budget + 300
