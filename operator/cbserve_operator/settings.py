"""Kopf settings for the cbserve operator: own persistence keys, server-side label selectors on the
children's watches, chunked initial lists, watch timeouts, quiet event posting."""

from __future__ import annotations

import logging
import os

import kopf

from . import GROUP
from .naming import LABEL_MANAGED_BY, MANAGED_BY

# Every child kind the handlers watch (group, version, plural). Their watches and initial lists carry
# MANAGED_SELECTOR to the API server: the operator never receives anyone else's objects (Kopf's
# `labels=` handler filters act only on what already arrived).
WATCHED_CHILDREN = (
    ("apps", "v1", "deployments"),
    ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
    ("batch", "v1", "jobs"),
    ("", "v1", "configmaps"),
    ("", "v1", "services"),
    ("autoscaling", "v2", "horizontalpodautoscalers"),
    ("policy", "v1", "poddisruptionbudgets"),
    ("keda.sh", "v1alpha1", "scaledobjects"),
    ("monitoring.coreos.com", "v1", "servicemonitors"),
    ("inference.networking.k8s.io", "v1", "inferencepools"),
    ("", "v1", "pods"),  # the server pods: why they do not start (pods.py)
    ("", "v1", "persistentvolumeclaims"),  # the model cache's claim
)
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
# Initial lists come in pages of this many objects (the size client-go's pager uses), so a first list
# of many CBDeployments never has to fit in memory at once.
LIST_CHUNK_SIZE = 500


def seconds_from_env(env: str, default: float) -> float:
    raw = os.environ.get(env)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{env} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{env} must be > 0, got {raw!r}")
    return value


def resync_seconds() -> float:
    """How often every CBDeployment's children are re-applied (CBSERVE_RESYNC_SECONDS, default 600)."""
    return seconds_from_env("CBSERVE_RESYNC_SECONDS", 600)


def configure(settings: kopf.OperatorSettings) -> None:
    # Our own keys under cbserve.io, never the shared kopf.zalando.org defaults.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    # The API server closes a watch after server_timeout; the client gives up a bit later,
    # so a silently dropped connection is noticed instead of hanging forever.
    settings.watching.server_timeout = seconds_from_env("CBSERVE_WATCH_SERVER_TIMEOUT", 300)
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    settings.watching.connect_timeout = seconds_from_env("CBSERVE_WATCH_CONNECT_TIMEOUT", 30)
    settings.watching.reconnect_backoff = 1.0
    for group, version, plural in WATCHED_CHILDREN:
        settings.watching.label_selectors[group, version, plural] = MANAGED_SELECTOR
    settings.watching.chunk_size = LIST_CHUNK_SIZE
    settings.networking.request_timeout = seconds_from_env("CBSERVE_REQUEST_TIMEOUT", 60)
    # Only the Events the handlers post on purpose (and warnings) reach `kubectl describe`.
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 8
