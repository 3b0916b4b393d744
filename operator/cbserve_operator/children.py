"""Everything a CBDeployment owns: ConfigMap, model cache claim, Deployment (or LeaderWorkerSet and its
headless Service), Service, autoscaler, PDB, ServiceMonitor, InferencePool (the download Job apart: it is created
once, model_cache.py)."""

from __future__ import annotations

from typing import Any

from . import GROUP, KIND, VERSION, group, naming
from .engine_config import config_hash, render_engine_yaml
from .model_cache import render_claim
from .spec import CBDeploymentSpec
from .workload import owned_template_fields, render_deployment

METRIC_NAMES = {"queue-depth": "cbserve:num_requests_waiting", "kv-cache-usage": "cbserve:kv_cache_usage_perc"}


def render_config_map(spec: CBDeploymentSpec) -> dict[str, Any]:
    text = render_engine_yaml(spec.engine)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": naming.config_map_name(spec.name, config_hash(text)), "labels": naming.config_labels(spec.name)},
        "immutable": True,
        "data": {naming.CONFIG_FILE: text},
    }


INFERENCE_POOL_API = "inference.networking.k8s.io/v1"


def server_selector(spec: CBDeploymentSpec) -> dict[str, str]:
    """The labels of the pods that serve HTTP: a multi-node group's leaders only (the workers serve none)."""
    return naming.server_selector_labels(spec.name) if spec.multi_node else naming.selector_labels(spec.name)


def render_service(spec: CBDeploymentSpec) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": spec.name, "labels": naming.common_labels(spec.name)}
    if spec.service.annotations:
        metadata["annotations"] = spec.service.annotations
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "type": spec.service.type,
            "selector": server_selector(spec),
            "ports": [{"name": "http", "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _target_value(spec: CBDeploymentSpec) -> str:
    """A Kubernetes quantity; KV usage is a fraction, so 0.8 becomes 800m."""
    milli = round(spec.autoscaling.target * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def _scale_target(spec: CBDeploymentSpec) -> dict[str, str]:
    # The autoscaler scales the CBDeployment through its scale subresource; the operator
    # carries spec.replicas to the Deployment, so nothing fights over the Deployment's replicas.
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": spec.name}


def render_hpa(spec: CBDeploymentSpec) -> dict[str, Any]:
    auto = spec.autoscaling
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": spec.name, "labels": naming.common_labels(spec.name)},
        "spec": {
            "scaleTargetRef": _scale_target(spec),
            "minReplicas": auto.min_replicas,
            "maxReplicas": auto.max_replicas,
            "metrics": [{
                "type": "Pods",
                "pods": {
                    "metric": {"name": METRIC_NAMES[auto.metric]},
                    "target": {"type": "AverageValue", "averageValue": _target_value(spec)},
                },
            }],
            "behavior": {
                "scaleDown": {
                    "stabilizationWindowSeconds": auto.scale_down_delay_seconds,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                },
                "scaleUp": {
                    "stabilizationWindowSeconds": 0,
                    "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}],
                },
            },
        },
    }


def render_scaled_object(spec: CBDeploymentSpec, namespace: str) -> dict[str, Any]:
    auto = spec.autoscaling
    metric = METRIC_NAMES[auto.metric]
    selector = f'namespace="{namespace}",model_name="{spec.served_name}"'
    # Queue depth is summed (KEDA divides by the replica count); KV usage is averaged per pod.
    aggregate = "sum" if auto.metric == "queue-depth" else "avg"
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": spec.name, "labels": naming.common_labels(spec.name)},
        "spec": {
            "scaleTargetRef": _scale_target(spec),
            "minReplicaCount": auto.min_replicas,
            "maxReplicaCount": auto.max_replicas,
            "cooldownPeriod": auto.scale_down_delay_seconds,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": auto.scale_down_delay_seconds}},
                },
            },
            "triggers": [{
                "type": "prometheus",
                "metadata": {
                    "serverAddress": auto.prometheus_address,
                    "query": f"{aggregate}({metric}{{{selector}}})",
                    "threshold": str(auto.target),
                    **({"activationThreshold": "0"} if auto.metric == "queue-depth" else {}),
                },
            }],
        },
    }


def render_pdb(spec: CBDeploymentSpec) -> dict[str, Any]:
    budget: dict[str, Any]
    if spec.pdb.min_available is not None:
        budget = {"minAvailable": spec.pdb.min_available}
    else:
        budget = {"maxUnavailable": spec.pdb.max_unavailable if spec.pdb.max_unavailable is not None else 1}
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": spec.name, "labels": naming.common_labels(spec.name)},
        "spec": {**budget, "selector": {"matchLabels": naming.selector_labels(spec.name)}},
    }


def render_service_monitor(spec: CBDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {
            "name": spec.name,
            "labels": {**spec.service_monitor.labels, **naming.common_labels(spec.name)},
        },
        "spec": {
            "selector": {"matchLabels": naming.selector_labels(spec.name)},
            "endpoints": [{"port": "http", "path": "/metrics", "interval": spec.service_monitor.interval}],
        },
    }


def render_inference_pool(spec: CBDeploymentSpec) -> dict[str, Any]:
    """The Gateway API Inference Extension's pool of the server pods (their HTTP port, not the Service's):
    a Gateway's HTTPRoute sends to it, and the endpoint picker named chooses a pod per request by the
    `vllm:*` queue and KV-cache metrics the servers expose."""
    pool = spec.inference_pool
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": spec.name, "labels": naming.common_labels(spec.name)},
        "spec": {
            "selector": {"matchLabels": server_selector(spec)},
            "targetPorts": [{"number": naming.PORT}],
            "endpointPickerRef": {
                "kind": "Service",
                "name": pool.picker_name,
                "port": {"number": pool.picker_port},
                "failureMode": pool.failure_mode,
            },
        },
    }


def workload_ref(spec: CBDeploymentSpec) -> tuple[str, str, str]:
    """(apiVersion, kind, name) of what runs the pods: a Deployment, or a LeaderWorkerSet for nodes > 1."""
    if spec.multi_node:
        return group.API_VERSION, group.KIND, naming.group_name(spec.name)
    return "apps/v1", "Deployment", spec.name


def served_template(workload: dict[str, Any]) -> dict[str, Any]:
    """The pod template of the servers: a Deployment's, a LeaderWorkerSet's leaders'."""
    if workload.get("kind") == group.KIND:
        return group.leader_template(workload)
    return (workload.get("spec", {}) or {}).get("template", {}) or {}


def fingerprint(workload: dict[str, Any]) -> tuple[Any, ...]:
    """The fields the operator owns that matter most: replicas, and each template's config hash, image
    and command (a LeaderWorkerSet's group size and workers too)."""
    spec = workload.get("spec", {}) or {}
    if workload.get("kind") != group.KIND:
        return (spec.get("replicas"), *owned_template_fields(served_template(workload)))
    lwt = spec.get("leaderWorkerTemplate", {}) or {}
    return (spec.get("replicas"), lwt.get("size"), lwt.get("restartPolicy"),
            *owned_template_fields(lwt.get("leaderTemplate", {}) or {}),
            *owned_template_fields(lwt.get("workerTemplate", {}) or {}))  # fmt: skip


def _quantity(value: Any) -> Any:
    """A resource quantity's value (the API server writes `0.5` back as `500m`), else the value itself."""
    from kubernetes.utils.quantity import parse_quantity

    try:
        return parse_quantity(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else value
    except ValueError:
        return value


def covers(live: Any, wanted: Any) -> bool:
    """Whether `live` holds everything `wanted` (a rendering) sets: maps compared on the rendered keys
    (what the API server defaults, or others add, is left alone), lists item by item, quantities by
    value."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(covers(live.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(covers, live, wanted))
    return live == wanted or (live is not None and _quantity(live) == _quantity(wanted))


def in_sync(workload: dict[str, Any], desired: dict[str, Any]) -> bool:
    """Whether a Deployment or LeaderWorkerSet still is what the operator rendered: its fingerprint, and
    every field of the rendered spec (resources, env, probes, tolerations, securityContext... edited by
    hand, they are drift)."""
    return fingerprint(workload) == fingerprint(desired) and covers(workload.get("spec"), desired.get("spec"))


def render_children(spec: CBDeploymentSpec, namespace: str, model_cached: bool = True,
                    ) -> tuple[list[dict[str, Any]], list[tuple[str, str, str]]]:  # fmt: skip
    """(objects to apply, (apiVersion, kind, name) of children to remove) for one CBDeployment: the
    optional ones turned off, and the other layout's workload. Until the model cache holds the model
    (`model_cached` False), the Deployment or LeaderWorkerSet has 0 replicas."""
    config_map = render_config_map(spec)
    digest = config_hash(config_map["data"][naming.CONFIG_FILE])
    cache = spec.model.cache
    claim = [render_claim(spec)] if cache.enabled and cache.claim_name is None else []
    replicas = None if model_cached else 0
    remove: list[tuple[str, str, str]] = []
    if spec.multi_node:  # the headless Service first: LeaderWorkerSet then finds it and makes none
        workload = [group.render_group_service(spec), group.render_group(spec, digest, replicas=replicas)]
        remove.append(("apps/v1", "Deployment", spec.name))
    else:
        workload = [render_deployment(spec, digest, replicas=replicas)]
        remove += [(group.API_VERSION, group.KIND, naming.group_name(spec.name)),
                   ("v1", "Service", naming.group_name(spec.name))]  # fmt: skip
    apply = [config_map, *claim, *workload, render_service(spec)]
    if not claim:
        remove.append(("v1", "PersistentVolumeClaim", naming.model_cache_claim(spec.name)))
    optional = [
        (spec.autoscaling.enabled and not spec.autoscaling.keda, lambda: render_hpa(spec),
         ("autoscaling/v2", "HorizontalPodAutoscaler")),
        (spec.autoscaling.enabled and spec.autoscaling.keda, lambda: render_scaled_object(spec, namespace),
         ("keda.sh/v1alpha1", "ScaledObject")),
        (spec.pdb.enabled, lambda: render_pdb(spec), ("policy/v1", "PodDisruptionBudget")),
        (spec.service_monitor.enabled, lambda: render_service_monitor(spec),
         ("monitoring.coreos.com/v1", "ServiceMonitor")),
        (spec.inference_pool.enabled, lambda: render_inference_pool(spec), (INFERENCE_POOL_API, "InferencePool")),
    ]
    for wanted, render, (api_version, kind) in optional:
        if wanted:
            apply.append(render())
        else:
            remove.append((api_version, kind, spec.name))
    return apply, remove
