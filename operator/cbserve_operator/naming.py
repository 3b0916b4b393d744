"""Names, labels and paths shared by everything the operator creates."""

from __future__ import annotations

MANAGED_BY = "cbserve-operator"
FIELD_MANAGER = "cbserve-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = "cbserve.io/cbdeployment"  # the owning CBDeployment's name, for status mirroring

ANNOTATION_CONFIG_HASH = "cbserve.io/config-hash"
ANNOTATION_USED_AT = "cbserve.io/used-at-generation"  # on engine ConfigMaps: the owner's generation that last applied it

CONTAINER_NAME = "server"
PORT = 8000
CONFIG_DIR = "/etc/cbserve"
CONFIG_FILE = "engine.yaml"
CACHE_DIR = "/cache"
PRE_STOP_SLEEP_SECONDS = 5  # the pod keeps serving this long after leaving endpoints, before SIGTERM
REVISION_HISTORY = 5  # old ReplicaSets a Deployment keeps; as many old engine ConfigMaps are kept


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's selector: stable for the life of the CBDeployment."""
    return {LABEL_NAME: "cbserve", LABEL_INSTANCE: name}


def common_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        LABEL_COMPONENT: "server",
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_OWNER: name,
    }


def selector_string(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def config_map_name(name: str, config_hash: str) -> str:
    """Engine ConfigMaps are immutable and named by their content: a pod keeps the knobs it started
    with, and a rollback finds the old ones in place."""
    return f"{name}-engine-{config_hash[:10]}"


def config_labels(name: str) -> dict[str, str]:
    """An engine ConfigMap's labels: the owner's, with its own component (for garbage collection)."""
    return {**common_labels(name), LABEL_COMPONENT: "engine-config"}


def service_url(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc:{port}"
