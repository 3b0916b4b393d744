"""Names, labels and paths shared by everything the operator creates."""

from __future__ import annotations

import hashlib

MANAGED_BY = "cbserve-operator"
FIELD_MANAGER = "cbserve-operator"

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = "cbserve.io/cbdeployment"  # the owning CBDeployment's name, for status mirroring

ANNOTATION_CONFIG_HASH = "cbserve.io/config-hash"
# on the pod template: a digest of the fields the operator owns there (see workload.render_digest)
ANNOTATION_RENDER = "cbserve.io/render"
# on the Deployment: the pod template the operator applied (zlib, base64) and the spec revision it was for
ANNOTATION_TEMPLATE = "cbserve.io/applied-template"
ANNOTATION_TEMPLATE_FOR = "cbserve.io/applied-template-for"
ANNOTATION_USED_AT = "cbserve.io/used-at-generation"  # on engine ConfigMaps: the owner's generation that last applied it

CONTAINER_NAME = "server"
PORT = 8000
CONFIG_DIR = "/etc/cbserve"
CONFIG_FILE = "engine.yaml"
CACHE_DIR = "/cache"
MODEL_DIR = "/models/hf"  # the model cache's claim, in the server pods (read-only) and the download Job
PRE_STOP_SLEEP_SECONDS = 5  # the pod keeps serving this long after leaving endpoints, before SIGTERM
REVISION_HISTORY = 5  # old ReplicaSets a Deployment keeps; as many old engine ConfigMaps are kept
# the engine flags parallel.py sets from resources.gpu and resources.nodes (engine.extraArgs may not)
PARALLEL_FLAGS = ("--tensor-parallel-size", "--nnodes", "--node-rank", "--dist-addr", "--dist-port")


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


def server_selector_labels(name: str) -> dict[str, str]:
    """The pods that serve HTTP: all of a Deployment's, only the leaders of a LeaderWorkerSet's groups."""
    return {**selector_labels(name), LABEL_COMPONENT: "server"}


def selector_string(name: str, servers_only: bool = False) -> str:
    labels = server_selector_labels(name) if servers_only else selector_labels(name)
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def group_name(name: str) -> str:
    """The LeaderWorkerSet of a multi-node CBDeployment, and its headless Service: not `name`, which
    the serving Service holds (LeaderWorkerSet would take that Service for its own headless one)."""
    return f"{name}-group"


def config_map_name(name: str, config_hash: str) -> str:
    """Engine ConfigMaps are immutable and named by their content: a pod keeps the knobs it started
    with, and a rollback finds the old ones in place."""
    return f"{name}-engine-{config_hash[:10]}"


def config_labels(name: str) -> dict[str, str]:
    """An engine ConfigMap's labels: the owner's, with its own component (for garbage collection)."""
    return {**common_labels(name), LABEL_COMPONENT: "engine-config"}


def service_url(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc:{port}"


def model_cache_claim(name: str) -> str:
    """The PersistentVolumeClaim the operator creates for `model.cache`."""
    return f"{name}-model-cache"


def model_job_name(name: str, uri: str, claim: str) -> str:
    """The download Job of one model and revision into one claim: `<name>-model-<hash10>`, the name cut to
    keep it within 63 characters (the Job controller puts it in a label value of its pods)."""
    digest = hashlib.sha256(f"{uri} {claim}".encode()).hexdigest()[:10]
    return f"{name[:46].rstrip('-')}-model-{digest}"


def model_job_labels(name: str) -> dict[str, str]:
    """A download Job's labels, and its pod's: never the Service's selector (app.kubernetes.io/instance),
    so the download pod is no endpoint."""
    return {LABEL_NAME: "cbserve", LABEL_COMPONENT: "model-download", LABEL_MANAGED_BY: MANAGED_BY, LABEL_OWNER: name}
