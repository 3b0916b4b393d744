"""A small synchronous Kubernetes API client: server-side apply, get, delete, status patch.

Built on urllib3 with the credentials `kubernetes.config` finds (in-cluster service account,
else $KUBECONFIG / ~/.kube/config), so it does not depend on one generation of the generated client.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

import urllib3
from kubernetes import config as kube_config
from kubernetes.client import Configuration

from .naming import FIELD_MANAGER

PLURALS = {
    "ConfigMap": "configmaps",
    "Pod": "pods",
    "Service": "services",
    "Event": "events",
    "Deployment": "deployments",
    "HorizontalPodAutoscaler": "horizontalpodautoscalers",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "ScaledObject": "scaledobjects",
    "ServiceMonitor": "servicemonitors",
    "InferencePool": "inferencepools",
    "CBDeployment": "cbdeployments",
    "PersistentVolumeClaim": "persistentvolumeclaims",
    "Job": "jobs",
    "LeaderWorkerSet": "leaderworkersets",
}


class ApiError(Exception):
    """A non-2xx answer; `status` is the HTTP code, `reason` Kubernetes' reason (NotFound, Conflict...)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def load_configuration() -> Configuration:
    """In-cluster credentials when running in a pod, else the kubeconfig."""
    cfg = Configuration()
    try:
        kube_config.load_incluster_config(client_configuration=cfg)
    except kube_config.ConfigException:
        kube_config.load_kube_config(client_configuration=cfg)
    return cfg


def object_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                subresource: str | None = None) -> str:
    if kind not in PLURALS:
        raise ValueError(f"kind {kind!r} is not one the operator manages")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{PLURALS[kind]}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


class Kube:
    def __init__(self, cfg: Configuration, timeout: float = 30.0) -> None:
        self._cfg = cfg
        self._timeout = timeout
        pool_args: dict[str, Any] = {"num_pools": 4, "maxsize": 8}
        if cfg.host.startswith("https"):
            pool_args.update(cert_reqs="CERT_REQUIRED" if cfg.verify_ssl else "CERT_NONE",
                             ca_certs=cfg.ssl_ca_cert, cert_file=cfg.cert_file, key_file=cfg.key_file)
        self._http = urllib3.PoolManager(**pool_args)

    @classmethod
    def from_environment(cls) -> "Kube":
        return cls(load_configuration())

    def _headers(self, content_type: str | None) -> dict[str, str]:
        if self._cfg.refresh_api_key_hook is not None:
            self._cfg.refresh_api_key_hook(self._cfg)
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
        token = self._cfg.get_api_key_with_prefix("authorization")
        if token:
            headers["Authorization"] = token
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                query: dict[str, str] | None = None) -> dict[str, Any]:
        url = self._cfg.host.rstrip("/") + path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body).encode()
        resp = self._http.request(method, url, body=data, headers=self._headers(content_type),
                                  timeout=self._timeout, retries=False)
        try:
            payload = json.loads(resp.data) if resp.data else {}
        except ValueError:
            payload = {"message": resp.data[:500].decode(errors="replace")}
        if resp.status >= 400:
            raise ApiError(resp.status, str(payload.get("reason", "")), str(payload.get("message", "")))
        return payload

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", object_path(api_version, kind, namespace, name))
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        path = object_path(api_version, kind, namespace)
        return list(self.request("GET", path, query={"labelSelector": label_selector}).get("items") or [])

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply: creates or updates the object; the same call twice changes nothing."""
        meta = obj["metadata"]
        path = object_path(obj["apiVersion"], obj["kind"], meta.get("namespace"), meta["name"])
        return self.request("PATCH", path, body=obj, content_type="application/apply-patch+yaml",
                            query={"fieldManager": FIELD_MANAGER, "force": "true"})

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        """Delete if present, and what it owns after it (a Job's pods); False when the object (or its whole
        API, e.g. no KEDA) is absent."""
        try:
            self.request("DELETE", object_path(api_version, kind, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"},
                         content_type="application/json")
            return True
        except ApiError as e:
            if e.status == 404:
                return False
            raise

    def patch_status(self, api_version: str, kind: str, namespace: str, name: str,
                     status: dict[str, Any], resource_version: str | None = None) -> dict[str, Any]:
        """Merge-patch the status subresource; with `resource_version`, 409 if the object moved on."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return self.request("PATCH", object_path(api_version, kind, namespace, name, "status"),
                            body=body, content_type="application/merge-patch+json")
