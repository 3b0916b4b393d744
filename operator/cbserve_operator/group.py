"""A multi-node CBDeployment (`resources.nodes` > 1): a LeaderWorkerSet of groups and their headless Service.

Each replica is one group of `nodes` pods with `gpu` GPUs each, one engine of world size gpu x nodes
(parallel.py). The leader (rank 0) is the Deployment's server pod: `cbserve serve`, probes, the
serving Service's endpoint. The workers run `cbserve worker` with the same model and engine ConfigMap
and serve no HTTP. LeaderWorkerSet (kubernetes-sigs/lws) creates the pods, gives each the group's
leader address and its index, and recreates a whole group when one of its pods restarts.

The headless Service is the operator's, rendered as LeaderWorkerSet would render its own (the
LeaderWorkerSet's name, its pods' set-name label, not-ready addresses published: the workers join the
leader before it is ready). LeaderWorkerSet creates one only where the name is free, so it finds this
one; `$(LWS_LEADER_ADDRESS)` (<set>-<group>.<set>.<namespace>) resolves through it.
"""

from __future__ import annotations

from typing import Any

from . import naming, parallel
from .spec import CBDeploymentSpec
from .workload import pod_template, server_container, server_env

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
LABEL_SET_NAME = "leaderworkerset.sigs.k8s.io/name"  # on every pod of a LeaderWorkerSet
RESTART_POLICY = "RecreateGroupOnPodRestart"  # a pod that restarts takes its whole group with it
# Workers are created with their leader, not once it is ready: it is ready only after they joined.
STARTUP_POLICY = "LeaderCreated"


def worker_command(spec: CBDeploymentSpec) -> list[str]:
    """`cbserve worker`: the model and engine settings of the leader's `cbserve serve`, no HTTP flags."""
    return [
        "cbserve", "worker",
        "--model", spec.model.arg,
        "--config", f"{naming.CONFIG_DIR}/{naming.CONFIG_FILE}",
        "--device", "cuda",
        *parallel.worker_flags(spec),
    ]


def _leader_container(spec: CBDeploymentSpec) -> dict[str, Any]:
    container = server_container(spec)
    container["ports"].append({"name": "dist", "containerPort": parallel.DIST_PORT, "protocol": "TCP"})
    return container


def _worker_container(spec: CBDeploymentSpec) -> dict[str, Any]:
    """The server's container without what serving needs: no port, probes or preStop sleep, no API key.
    A worker exits non-zero when its group breaks; the restart recreates the group."""
    container = server_container(spec)
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        del container[key]
    container["command"] = worker_command(spec)
    container["env"] = server_env(spec, api_key=False)
    return container


def _rollout(spec: CBDeploymentSpec) -> dict[str, Any]:
    """spec.rollout in groups; LeaderWorkerSet has no Recreate: every group down at once stands for it."""
    rollout = spec.rollout
    surge, unavailable = (0, "100%") if rollout.strategy == "Recreate" else (rollout.max_surge, rollout.max_unavailable)
    return {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxSurge": surge, "maxUnavailable": unavailable}}


def render_group(spec: CBDeploymentSpec, config_hash: str, replicas: int | None = None) -> dict[str, Any]:
    """The LeaderWorkerSet: `replicas` groups (the spec's unless given: 0 while the model cache is filled)."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": naming.group_name(spec.name), "labels": naming.common_labels(spec.name)},
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "startupPolicy": STARTUP_POLICY,
            "rolloutStrategy": _rollout(spec),
            "leaderWorkerTemplate": {
                "size": spec.resources.nodes,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": pod_template(spec, config_hash, _leader_container(spec)),
                "workerTemplate": pod_template(spec, config_hash, _worker_container(spec), component="worker"),
            },
        },
    }


def render_group_service(spec: CBDeploymentSpec) -> dict[str, Any]:
    """The headless Service the group's pods find their leader through (see the module's docstring)."""
    name = naming.group_name(spec.name)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": {**naming.common_labels(spec.name), naming.LABEL_COMPONENT: "group"}},
        "spec": {"clusterIP": "None", "selector": {LABEL_SET_NAME: name}, "publishNotReadyAddresses": True},
    }


def leader_template(group: dict[str, Any]) -> dict[str, Any]:
    """A LeaderWorkerSet's leader pod template (its engine config hash, image and command are the server's)."""
    return ((group.get("spec", {}) or {}).get("leaderWorkerTemplate", {}) or {}).get("leaderTemplate", {}) or {}
