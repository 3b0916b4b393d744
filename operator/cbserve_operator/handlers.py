"""The Kopf handlers: one level-based reconcile of a CBDeployment, and status mirrored from its Deployment
(or LeaderWorkerSet, with resources.nodes > 1)."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from . import GROUP, KIND, PLURAL, VERSION, group, model_cache, naming, revision
from .children import in_sync, render_children, served_template, workload_ref
from .kube import ApiError, Kube
from .settings import configure, resync_seconds
from .spec import DEFAULT_IMAGE, CBDeploymentSpec, SpecError, parse_spec
from .pods import Problem, first_problem
from .status import condition, headline, merge_conditions, rollout_status
from .workload import owned_template_fields, render_digest

DEPLOYMENT, GROUP_KIND = "Deployment", group.KIND
kopf_logger = logging.getLogger(__name__)
MANAGED = {naming.LABEL_MANAGED_BY: naming.MANAGED_BY}  # what every child is labelled with (client-side filter too)

API_VERSION = f"{GROUP}/{VERSION}"
# Optional children whose API may be missing from a cluster (no KEDA, no Prometheus operator).
OPTIONAL_APIS = {"keda.sh/v1alpha1", "monitoring.coreos.com/v1", "inference.networking.k8s.io/v1"}


def default_image() -> str:
    return os.environ.get("CBSERVE_SERVER_IMAGE") or DEFAULT_IMAGE


def server_image(raw_spec: Mapping[str, Any], status: Mapping[str, Any], generation: int | None) -> str:
    """The image a spec without `image` runs: the one recorded in status when this revision of the
    spec was first reconciled, else the operator's default now. An operator upgrade with a new
    default restarts no server until its own spec changes (replicas aside)."""
    recorded = status.get("defaultImage") or {}
    if recorded.get("image") and revision.same_revision(recorded, raw_spec, generation):
        return str(recorded["image"])
    return default_image()


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings)
    memo.kube = Kube.from_environment()
    memo.known = set()  # (namespace, name) of every CBDeployment reconciled: what the resync visits
    memo.resync_stop = threading.Event()
    memo.resync = threading.Thread(target=_resync_loop, name="cbserve-resync", daemon=True,
                                   args=(memo.kube, memo.known, memo.resync_stop, resync_seconds()))  # fmt: skip
    memo.resync.start()


@kopf.on.cleanup()
def cleanup(memo: kopf.Memo, **_: Any) -> None:
    memo.resync_stop.set()
    memo.resync.join(30)


def _resync_loop(kube: Kube, known: set[tuple[str, str]], stop: threading.Event, every: float) -> None:
    """Every `every` seconds, resync each known CBDeployment (no Kopf timer: that would put a finalizer
    on every CBDeployment). What the events missed, and repairs that failed, are put right by then."""
    while not stop.wait(every):
        for namespace, name in sorted(known.copy()):  # handlers add to it meanwhile
            if stop.is_set():
                return
            try:
                if not resync(kube, namespace, name):
                    known.discard((namespace, name))
            except Exception as e:  # noqa: BLE001 - one object's failure must not end the loop; the next round retries
                kopf_logger.warning(f"resync of {namespace}/{name} failed: {e}")


def resync(kube: Kube, namespace: str, name: str) -> bool:
    """Repair the workload and re-apply every other child of one CBDeployment (server-side apply: no
    change, no write), then mirror its status. False when the CBDeployment is gone."""
    if kube.get(API_VERSION, KIND, namespace, name) is None:
        return False
    settled = _settled_spec(kube, namespace, name)
    if settled is None:
        return True  # a reconcile is due or under way, or the spec is invalid: it says so itself
    cr, spec = settled
    api_version, kind, workload_name = workload_ref(spec)
    workload = _repair_drift(kube, namespace, name, kind, kube.get(api_version, kind, namespace, workload_name),
                             kopf_logger)  # fmt: skip
    wanted, _ = render_children(spec, namespace, model_cached=_model_cached(kube, spec, namespace))
    for child in wanted:
        if child["kind"] == kind:
            continue  # the workload: repaired above, rollback and model cache taken into account
        _stamp(child, cr)
        try:
            kube.apply(child)
        except ApiError as e:
            if not (e.status == 404 and child["apiVersion"] in OPTIONAL_APIS):
                kopf_logger.warning(f"resync of {namespace}/{name}: the {child['kind']} {child['metadata']['name']}: {e}")
    _mirror_status(kube, namespace, name, kind, workload, kopf_logger)
    return True


@kopf.on.probe(id="apiserver")
def apiserver_reachable(memo: kopf.Memo, **_: Any) -> str:
    """Liveness: the operator can still talk to the API server."""
    return str(memo.kube.request("GET", "/version").get("gitVersion", "unknown"))


# Answers worth retrying: conflicts, throttling, timeouts, the server's own failures, and 403
# Forbidden (an exceeded ResourceQuota, a missing RoleBinding, a terminating namespace: each can go
# away with no change of the spec). Any other 4xx (422 Invalid, 400) says the same thing again until
# the spec changes.
RETRYABLE = {403, 408, 409, 429}
MAX_RETRY_DELAY = 300


class ChildRefused(Exception):
    """The API server refused a child for good (a 4xx other than RETRYABLE)."""


class ChildForbidden(kopf.TemporaryError):
    """A 403 for a child: retried with backoff, and said in status meanwhile (`reason`, `message`)."""

    def __init__(self, reason: str, message: str, delay: float) -> None:
        super().__init__(message, delay=delay)
        self.reason = reason
        self.message = message


def forbidden_reason(message: str) -> str:
    """Why the API server answered 403, from its message: QuotaExceeded, NamespaceTerminating or Forbidden
    (authorization: the operator's Role or ClusterRole lacks the verb)."""
    if "exceeded quota" in message:
        return "QuotaExceeded"
    if "being terminated" in message:
        return "NamespaceTerminating"
    return "Forbidden"


def _retry_delay(retry: int) -> int:
    """5 s, doubling with each retry, at most 5 minutes."""
    return min(MAX_RETRY_DELAY, 5 * 2 ** min(retry, 10))


NO_GROUP_API = (f"resources.nodes > 1 needs the LeaderWorkerSet API ({group.API_VERSION}, kubernetes-sigs/lws) in "
                "the cluster, and it is not installed: install it, then change the CBDeployment (or restart the "
                "operator) to try again")


def _failed(what: str, e: ApiError, retry: int) -> Exception:
    if 400 <= e.status < 500 and e.status not in RETRYABLE:
        return ChildRefused(f"the API server refused {what}: {e.message}")
    if e.status == 403:
        delay = _retry_delay(retry)
        return ChildForbidden(forbidden_reason(e.message), f"the API server forbade {what} (403; retrying in "
                              f"{delay} s, and on every change): {e.message}", delay)  # fmt: skip
    return kopf.TemporaryError(f"{what}: {e}", delay=_retry_delay(retry))


def _apply_children(kube: Kube, body: Mapping[str, Any], spec: CBDeploymentSpec, namespace: str, retry: int = 0,
                    keep_template: dict[str, Any] | None = None,
                    ) -> tuple[dict[str, Any] | None, list[str], model_cache.CacheState | None]:  # fmt: skip
    """Apply every wanted child, delete unwanted ones; (the Deployment or LeaderWorkerSet as it is,
    warnings, the model cache's state when enabled). With the cache, the download Job is created first if
    missing; until it succeeds a new workload gets 0 replicas and an existing one is left alone.
    `keep_template`: a pod template the Deployment keeps instead of the rendered one (a rollout undo),
    and its ConfigMap.
    A refusal for good raises ChildRefused; anything worth retrying, kopf.TemporaryError with backoff."""
    cache = None
    if spec.model.cache.enabled:
        try:
            cache = _ensure_model_job(kube, body, spec, namespace)
        except ApiError as e:
            raise _failed(f"the Job {model_cache.job_name(spec)}", e, retry) from e
    wanted, unwanted = render_children(spec, namespace, model_cached=cache is None or cache.ready)
    api_version, kind, name = workload_ref(spec)
    deployment = None
    warnings: list[str] = []
    for obj in wanted:
        _stamp(obj, body)
        if obj["kind"] == DEPLOYMENT:
            if keep_template is not None:
                obj["spec"]["template"] = keep_template
            _record_template(obj, body)
        try:
            if obj["kind"] == kind and cache is not None and not cache.ready:
                deployment = kube.get(api_version, kind, namespace, name)
                if deployment is not None:
                    continue  # pods of an earlier revision keep serving until this one is cached
            applied = kube.apply(obj)
        except ApiError as e:
            if e.status == 404 and obj["apiVersion"] in OPTIONAL_APIS:
                warnings.append(f"{obj['kind']} skipped: the {obj['apiVersion']} API is not installed")
                continue
            if e.status == 404 and obj["kind"] == GROUP_KIND:
                raise ChildRefused(NO_GROUP_API) from e
            raise _failed(f"the {obj['kind']} {obj['metadata']['name']}", e, retry) from e
        if obj["kind"] == kind:
            deployment = applied
    for unwanted_api, unwanted_kind, unwanted_name in unwanted:
        try:
            kube.delete(unwanted_api, unwanted_kind, namespace, unwanted_name)
        except ApiError as e:
            raise _failed(f"deleting the {unwanted_kind} {unwanted_name}", e, retry) from e
    current = {next(o["metadata"]["name"] for o in wanted if o["kind"] == "ConfigMap")}
    if keep_template is not None:
        current.add(_config_map_of(spec.name, keep_template))
    try:
        _collect_old_configs(kube, namespace, spec.name, current)
        _collect_old_jobs(kube, namespace, spec.name, model_cache.job_name(spec) if cache is not None else None)
    except ApiError as e:
        raise _failed(f"cleaning up old ConfigMaps and Jobs of {spec.name}", e, retry) from e
    return deployment, warnings, cache


def _record_template(deployment: dict[str, Any], owner: Mapping[str, Any]) -> None:
    """Annotate the Deployment (not its pods) with the pod template applied and the spec revision it is
    for: a later operator, whose rendering may differ, keeps it while the spec does (_recorded_template)."""
    annotations = deployment["metadata"].setdefault("annotations", {})
    annotations[naming.ANNOTATION_TEMPLATE] = revision.pack(deployment["spec"]["template"])
    annotations[naming.ANNOTATION_TEMPLATE_FOR] = json.dumps(revision.stamp(
        owner.get("spec", {}) or {}, (owner.get("metadata", {}) or {}).get("generation")), sort_keys=True)


def _recorded_template(deployment: dict[str, Any] | None, raw_spec: Mapping[str, Any],
                       generation: int | None) -> dict[str, Any] | None:  # fmt: skip
    """The pod template the Deployment was last applied with, when that was for this revision of the spec
    (replicas aside): what it keeps, whatever this operator would render now. An operator upgrade that
    renders differently (a new flag, a new pod field) so restarts no server until its own spec changes;
    an edit of the template by hand is drift from this template and is put back to it."""
    annotations = ((deployment or {}).get("metadata", {}) or {}).get("annotations", {}) or {}
    stamp, packed = annotations.get(naming.ANNOTATION_TEMPLATE_FOR), annotations.get(naming.ANNOTATION_TEMPLATE)
    if not stamp or not packed:
        return None
    try:
        recorded = json.loads(stamp)
    except ValueError:
        return None
    if not isinstance(recorded, dict) or not revision.same_revision(recorded, raw_spec, generation):
        return None
    return revision.unpack(packed)


def _ensure_model_job(kube: Kube, body: Mapping[str, Any], spec: CBDeploymentSpec,
                      namespace: str) -> model_cache.CacheState:  # fmt: skip
    """Create the download Job if it is missing (only then: its pod template cannot change), and say
    what its status means for the cache."""
    job = kube.get("batch/v1", "Job", namespace, model_cache.job_name(spec))
    if job is None:
        job = model_cache.render_job(spec)
        _stamp(job, body)
        job = kube.apply(job)
    return model_cache.job_state(spec, job)


def _model_cached(kube: Kube, spec: CBDeploymentSpec, namespace: str) -> bool:
    """Whether the Deployment may run its replicas: no cache, or its Job succeeded (nothing is created)."""
    if not spec.model.cache.enabled:
        return True
    job = kube.get("batch/v1", "Job", namespace, model_cache.job_name(spec))
    return job is not None and model_cache.job_state(spec, job).ready


def _collect_old_jobs(kube: Kube, namespace: str, name: str, current: str | None) -> None:
    """Delete the download Jobs of earlier models or revisions (their files stay on the claim), or all of
    them when the cache is off."""
    selector = ",".join(f"{k}={v}" for k, v in naming.model_job_labels(name).items())
    for job in kube.list("batch/v1", "Job", namespace, selector):
        if job["metadata"]["name"] != current:
            kube.delete("batch/v1", "Job", namespace, job["metadata"]["name"])


def _stamp(obj: dict[str, Any], owner: Mapping[str, Any]) -> None:
    """What every child carries besides its rendering: the owner reference, and on engine
    ConfigMaps the owner generation that last applied it (old configs are collected by it)."""
    kopf.adopt(obj, owner=owner)
    if obj["kind"] == "ConfigMap":
        obj["metadata"].setdefault("annotations", {})[naming.ANNOTATION_USED_AT] = str(
            owner.get("metadata", {}).get("generation", 0))


def _collect_old_configs(kube: Kube, namespace: str, name: str, current: set[str]) -> None:
    """Delete the engine ConfigMaps beyond the REVISION_HISTORY most recently used old ones: those are
    what the Deployment's old ReplicaSets (it keeps as many revisions) may still mount. `current`: in use."""
    selector = ",".join(f"{k}={v}" for k, v in naming.config_labels(name).items())
    old = [cm for cm in kube.list("v1", "ConfigMap", namespace, selector) if cm["metadata"]["name"] not in current]

    def last_used(cm: dict[str, Any]) -> tuple[int, str]:
        used = (cm["metadata"].get("annotations") or {}).get(naming.ANNOTATION_USED_AT, "0")
        return int(used) if used.isdigit() else 0, cm["metadata"].get("creationTimestamp", "")

    old.sort(key=last_used, reverse=True)
    for cm in old[naming.REVISION_HISTORY :]:
        kube.delete("v1", "ConfigMap", namespace, cm["metadata"]["name"])


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
def reconcile(body: kopf.Body, spec: kopf.Spec, name: str, namespace: str, meta: kopf.Meta,
              status: kopf.Status, memo: kopf.Memo, retry: int = 0, **_: Any) -> None:
    """Make the children match the spec. Idempotent: every child is server-side applied by name."""
    memo.known.add((namespace, name))
    _reconcile(memo.kube, body, dict(spec), name, namespace, meta.get("generation"), dict(status), retry)


def write_status(kube: Kube, namespace: str, name: str,
                 update: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any] | None:  # fmt: skip
    """The one way the operator writes a CBDeployment's status: read it, compute the change from the
    object as it is now (`update`; None: nothing to write), and merge-patch the status with that
    resourceVersion, so a write computed from an older object is refused (409) and computed again.
    Returns the object the change was computed from, or None when there was none to make."""
    for _attempt in range(8):
        cr = kube.get(API_VERSION, KIND, namespace, name)
        if cr is None:
            return None
        change = update(cr)
        current = cr.get("status", {}) or {}
        if not change or all(current.get(k) == v for k, v in change.items()):
            return None  # nothing would change (a None value: the field is absent already)
        try:
            kube.patch_status(API_VERSION, KIND, namespace, name, change,
                              resource_version=cr["metadata"].get("resourceVersion"))
            return cr
        except ApiError as e:
            if e.status != 409:
                raise
    raise kopf.TemporaryError(f"the CBDeployment {namespace}/{name} kept changing while its status was written",
                              delay=1)  # fmt: skip


def _conditions_of(cr: dict[str, Any]) -> list[dict[str, Any]]:
    return list((cr.get("status", {}) or {}).get("conditions", []) or [])


def _write_reconciled(kube: Kube, namespace: str, name: str, fields: dict[str, Any],
                      conditions: list[dict[str, Any]], drop: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """A reconcile's status: `fields`, and `conditions` merged into the current ones less `drop`."""
    def update(cr: dict[str, Any]) -> dict[str, Any]:
        merged = merge_conditions([c for c in _conditions_of(cr) if c.get("type") not in drop], conditions)
        return {**fields, "conditions": merged, **headline(merged)}

    write_status(kube, namespace, name, update)


def _reconcile(kube: Kube, body: kopf.Body, raw_spec: dict[str, Any], name: str, namespace: str,
               generation: int | None, status: dict[str, Any], retry: int = 0) -> None:
    old_conditions = list(status.get("conditions", []) or [])
    fields: dict[str, Any] = {"observedGeneration": generation}
    drop: set[str] = set()

    def failed(reason: str, message: str, ready_message: str) -> None:
        """Not a crash or retry loop: the old children keep serving until the spec changes; the
        user sees why, once, in status and an Event."""
        kopf.warn(body, reason=reason, message=message)
        _write_reconciled(kube, namespace, name, {**fields, "phase": "Failed"}, [
            condition("ConfigValid", False, reason, message, generation),
            condition("Ready", False, reason, ready_message, generation),
        ], drop)

    image = server_image(raw_spec, status, generation)
    try:
        spec = parse_spec(name, raw_spec, image)
    except SpecError as e:
        return failed("InvalidSpec", str(e), "the spec is invalid; see ConfigValid")
    for message in spec.warnings:
        kopf.warn(body, reason="DeprecatedField", message=message)
    rolled_back = None if spec.multi_node else _recorded_rollback(kube, namespace, name, status, raw_spec, generation)
    if rolled_back is None:  # a new spec rolls forward: no rollback to keep or report
        drop.add("RolledBack")
        if status.get("rolledBack"):
            fields["rolledBack"] = None
    else:  # kept through this revision (a replicas change too): stamped with it
        fields["rolledBack"] = {**status["rolledBack"], **revision.stamp(raw_spec, generation)}
    keep = rolled_back
    if keep is None and not spec.multi_node:
        keep = _recorded_template(kube.get("apps/v1", DEPLOYMENT, namespace, name), raw_spec, generation)
    try:
        deployment, warnings, cache = _apply_children(kube, body, spec, namespace, retry, keep_template=keep)
    except ChildRefused as e:
        return failed("ChildRefused", str(e), "the API server refused a child; see ConfigValid")
    except ChildForbidden as e:  # not the spec's fault: said in status, retried with backoff
        kopf.warn(body, reason=e.reason, message=e.message)
        phase = status.get("phase")
        _write_reconciled(kube, namespace, name, {
            **fields, "phase": "Pending" if phase in (None, "Pending", "Failed") else phase}, [
            condition("ConfigValid", True, "Valid", "the spec is valid", generation),
            condition("Ready", False, e.reason, e.message, generation),
            condition("Progressing", True, e.reason, e.message, generation),
        ], drop)  # fmt: skip
        raise
    for message in warnings:
        kopf.warn(body, reason="OptionalChildSkipped", message=message)
    phase, counts, rollout = rollout_status(deployment, spec.replicas, generation, workload_ref(spec)[1],
                                            _pods_problem(kube, namespace, name, deployment))  # fmt: skip
    valid_message = "; ".join(warnings) or "the spec is valid"
    if cache is None:  # no cache (any more): no ModelCached condition
        drop.add("ModelCached")
    else:
        rollout.append(condition("ModelCached", cache.ready, cache.reason, cache.message, generation))
        if not cache.ready:
            phase = "Failed" if cache.failed else "Pending"
            rollout = [condition("Ready", False, "ModelNotCached", "waiting for the model cache; see ModelCached",
                                 generation) if c["type"] == "Ready" else c for c in rollout]  # fmt: skip
        before: dict[str, Any] = next((c for c in old_conditions if c.get("type") == "ModelCached"), {})
        if cache.failed and before.get("reason") != "DownloadFailed":
            kopf.warn(body, reason="ModelDownloadFailed", message=cache.message)
    fields.update({
        "phase": phase,
        **counts,
        "selector": naming.selector_string(name, servers_only=spec.multi_node),  # what an HPA averages over
        "url": naming.service_url(name, namespace, spec.service.port),
        "configHash": owned_template_fields(served_template(deployment or {}))[0],
        "defaultImage": None if raw_spec.get("image") else {"image": image, **revision.stamp(raw_spec, generation)},
    })
    _write_reconciled(kube, namespace, name, fields,
                      [condition("ConfigValid", True, "Valid", valid_message, generation), *rollout], drop)


def _pods_problem(kube: Kube, namespace: str, owner: str, workload: dict[str, Any] | None) -> Problem | None:
    """Why the owner's pods do not start (pods.py), from the workload and the pods as they are."""
    if workload is None:
        return None
    try:
        pods = kube.list("v1", "Pod", namespace,
                         f"{naming.selector_string(owner)},{naming.LABEL_MANAGED_BY}={naming.MANAGED_BY}")
    except ApiError as e:  # the rollout's own status still says what it can
        kopf_logger.warning(f"listing the pods of {namespace}/{owner}: {e}")
        return None
    return first_problem(workload, pods)


@kopf.on.event("apps", "v1", "deployments", labels={naming.LABEL_MANAGED_BY: naming.MANAGED_BY})
@kopf.on.event("leaderworkerset.x-k8s.io", "v1", "leaderworkersets",  # watched once LWS's CRD exists
               labels={naming.LABEL_MANAGED_BY: naming.MANAGED_BY})
def mirror_deployment(body: kopf.Body, namespace: str, labels: kopf.Labels, type: str | None,
                      memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """Carry the Deployment's (or LeaderWorkerSet's) rollout into its CBDeployment's status (phase,
    counts, conditions), after putting it back if it was deleted or edited."""
    owner = labels.get(naming.LABEL_OWNER)
    if not owner or type is None:  # type None: the initial listing, already covered by resume
        return
    kube: Kube = memo.kube
    # The event may be stale by now; what counts is the workload as it is.
    api_version, kind = body["apiVersion"], body["kind"]
    workload = kube.get(api_version, kind, namespace, body["metadata"]["name"])
    workload = _repair_drift(kube, namespace, owner, kind, workload, logger)
    _mirror_status(kube, namespace, owner, kind, workload, logger)


@kopf.on.event("", "v1", "pods", labels=MANAGED)
def pod_changed(namespace: str, labels: kopf.Labels, type: str | None, memo: kopf.Memo, logger: kopf.Logger,
                **_: Any) -> None:  # fmt: skip
    """A server pod changed (scheduled or not, pulling, crashing, ready): mirror its workload again, so
    status says why pods do not start within one event (pods.py)."""
    owner = labels.get(naming.LABEL_OWNER)
    if not owner or type is None or labels.get(naming.LABEL_COMPONENT) not in ("server", "worker"):
        return  # the initial listing (resume covers it), or a download Job's pod
    kube: Kube = memo.kube
    cr = kube.get(API_VERSION, KIND, namespace, owner)
    if cr is None:
        return
    kind, name = (GROUP_KIND, naming.group_name(owner)) if _multi_node(cr) else (DEPLOYMENT, owner)
    api_version = group.API_VERSION if kind == GROUP_KIND else "apps/v1"
    _mirror_status(kube, namespace, owner, kind, kube.get(api_version, kind, namespace, name), logger)


def _multi_node(cr: dict[str, Any]) -> bool:
    """Whether the CBDeployment asks for groups of pods (read without parsing: the spec may be invalid)."""
    nodes = (((cr.get("spec", {}) or {}).get("resources", {}) or {}).get("nodes", 1))
    return isinstance(nodes, int) and nodes > 1


def _mirror_status(kube: Kube, namespace: str, owner: str, kind: str, deployment: dict[str, Any] | None,
                   logger: kopf.Logger) -> None:  # fmt: skip
    """Patch the CBDeployment's status from `deployment` (a Deployment or LeaderWorkerSet, `kind`)
    through write_status; nothing when the owner's spec runs the other kind."""
    problem = _pods_problem(kube, namespace, owner, deployment)
    outcome: dict[str, Any] = {}

    def update(cr: dict[str, Any]) -> dict[str, Any] | None:
        if _multi_node(cr) != (kind == GROUP_KIND):
            return None
        if deployment is not None and not _owned_by(deployment, cr):
            return None
        status = cr.get("status", {}) or {}
        desired = int((cr.get("spec", {}) or {}).get("replicas", 1))
        phase, counts, rollout = rollout_status(deployment, desired, status.get("observedGeneration"), kind, problem)
        new_status: dict[str, Any] = {**counts}
        # an invalid spec, or a model not cached yet, decides the phase and Ready: not the Deployment
        held = [c for c in _conditions_of(cr) if c.get("type") in ("ConfigValid", "ModelCached")
                and c.get("status") == "False"]  # fmt: skip
        if not held:
            new_status["phase"] = phase
            new_status["conditions"] = merge_conditions(_conditions_of(cr), rollout)
            new_status.update(headline(new_status["conditions"]))
        outcome.update(before=status.get("phase"), after=new_status.get("phase"), rollout=rollout)
        return new_status

    try:
        cr = write_status(kube, namespace, owner, update)
    except kopf.TemporaryError as e:
        logger.warning(f"gave up mirroring {namespace}/{owner}: {e}")
        return
    if cr is not None and outcome.get("after") == "Degraded" and outcome.get("before") != "Degraded":
        kopf.warn(cr, reason="RolloutStuck",
                  message=next(c["message"] for c in outcome["rollout"] if c["type"] == "Degraded"))


def _settled_spec(kube: Kube, namespace: str, owner: str) -> tuple[dict[str, Any], CBDeploymentSpec] | None:
    """The owner and its parsed spec, when a repair makes sense: the owner exists and is not being
    deleted, its current generation is reconciled (else that reconcile applies the spec anyway),
    and its spec is valid (else there is nothing to put back; the status says why)."""
    cr = kube.get(API_VERSION, KIND, namespace, owner)
    if cr is None or cr["metadata"].get("deletionTimestamp"):
        return None
    if (cr.get("status", {}) or {}).get("observedGeneration") != cr["metadata"].get("generation"):
        return None
    raw_spec, status = cr.get("spec", {}) or {}, cr.get("status", {}) or {}
    try:
        return cr, parse_spec(owner, raw_spec, server_image(raw_spec, status, cr["metadata"].get("generation")))
    except SpecError:
        return None


def _repair_drift(kube: Kube, namespace: str, owner: str, kind: str, deployment: dict[str, Any] | None,
                  logger: kopf.Logger) -> dict[str, Any] | None:  # fmt: skip
    """Put back a deleted Deployment (or LeaderWorkerSet, `kind`), or one with any field the operator
    renders edited (replicas, image, command, config hash, a group's size, resources, env, probes,
    tolerations, securityContext...); one of the layout the spec no longer runs is left to go.

    Level-based without a timer (a Kopf timer would add a finalizer to every CBDeployment): the
    workload's own events tell when it drifted from what the current spec renders.
    Returns the workload as it is afterwards.
    """
    settled = _settled_spec(kube, namespace, owner)
    if settled is None:
        return deployment
    cr, spec = settled
    if workload_ref(spec)[1] != kind:
        return deployment  # the other layout's, deleted by the reconcile that switched
    cached = _model_cached(kube, spec, namespace)
    if deployment is not None and not cached:
        return deployment  # held as it is until the model is cached (the reconcile says so in status)
    wanted, _ = render_children(spec, namespace, model_cached=cached)
    desired = next(o for o in wanted if o["kind"] == kind)
    kept = None
    if kind == DEPLOYMENT:
        kept = _recorded_template(deployment, cr.get("spec", {}) or {}, cr["metadata"].get("generation"))
        if kept is not None:
            desired["spec"]["template"] = kept
    if deployment is not None and in_sync(deployment, desired):
        return deployment
    if kind == DEPLOYMENT and deployment is not None and _earlier_render(kube, namespace, owner, deployment, desired):
        return _keep_rollback(kube, namespace, cr, spec, deployment, desired["spec"]["replicas"], logger)
    what = "deleted" if deployment is None else "changed outside its CBDeployment"
    logger.info(f"the {kind} of {namespace}/{owner} was {what}; restoring it")
    try:
        restored, _, _ = _apply_children(kube, cr, spec, namespace, keep_template=kept)
    except (ChildRefused, ChildForbidden) as e:  # the reconcile of this spec meets the same and says so in status
        logger.warning(str(e))
        return deployment
    reason = f"{kind}Recreated" if deployment is None else f"{kind}Restored"
    kopf.warn(cr, reason=reason, message=f"the {kind} was {what}; the operator restored it")
    return restored


def _config_map_of(owner: str, template: dict[str, Any]) -> str:
    return naming.config_map_name(owner, owned_template_fields(template)[0] or "")


def _earlier_render(kube: Kube, namespace: str, owner: str, deployment: dict[str, Any],
                    desired: dict[str, Any]) -> bool:  # fmt: skip
    """Whether the Deployment's pod template is one of the operator's earlier renders, untouched
    (what `kubectl rollout undo` puts back), whose engine ConfigMap is still there to mount."""
    template = deployment["spec"]["template"]
    digest = ((template.get("metadata", {}) or {}).get("annotations", {}) or {}).get(naming.ANNOTATION_RENDER)
    if digest is None or digest != render_digest(template):
        return False  # not ours, or edited since it was rendered (kubectl set image): drift
    if digest == desired["spec"]["template"]["metadata"]["annotations"][naming.ANNOTATION_RENDER]:
        return False  # the current render: something else drifted (replicas)
    return kube.get("v1", "ConfigMap", namespace, _config_map_of(owner, template)) is not None


def _recorded_rollback(kube: Kube, namespace: str, name: str, status: dict[str, Any], raw_spec: dict[str, Any],
                       generation: int | None) -> dict[str, Any] | None:  # fmt: skip
    """The pod template to keep when status records a rollout undo of this revision of the spec (an
    operator restart or a label edit re-runs the reconcile; an autoscaler's replicas bump the
    generation but change no more: the rollback stays); else None."""
    recorded = status.get("rolledBack") or {}
    if not revision.same_revision(recorded, raw_spec, generation):
        return None
    deployment = kube.get("apps/v1", "Deployment", namespace, name)
    template = (deployment or {}).get("spec", {}).get("template")
    if template is None or render_digest(template) != recorded.get("render"):
        return None
    return template


def _keep_rollback(kube: Kube, namespace: str, cr: dict[str, Any], spec: CBDeploymentSpec,
                   deployment: dict[str, Any], replicas: int, logger: kopf.Logger) -> dict[str, Any] | None:  # fmt: skip
    """Leave the rolled-back pod template in place (the rest of the Deployment, `replicas` included,
    stays the spec's), and say so in status until the next change of the spec."""
    template = deployment["spec"]["template"]
    digest = render_digest(template)
    owner, generation = cr["metadata"]["name"], cr["metadata"].get("generation")
    status = cr.get("status", {}) or {}
    recorded = status.get("rolledBack") or {}
    known = recorded.get("render") == digest and revision.same_revision(recorded, cr.get("spec", {}) or {}, generation)
    if known and deployment["spec"].get("replicas") == replicas:
        return deployment  # already kept and reported: the pods of the undo rolling out
    try:
        kept, _, _ = _apply_children(kube, cr, spec, namespace, keep_template=template)
    except (ChildRefused, kopf.TemporaryError) as e:
        logger.warning(f"keeping the rollback of {namespace}/{owner}: {e}")
        return deployment
    if known:
        return kept
    config_hash = owned_template_fields(template)[0]
    message = (f"kubectl rollout undo brought back an earlier revision (engine config {config_hash}); the "
               f"operator keeps it until the CBDeployment's spec changes")
    rolled = {**revision.stamp(cr.get("spec", {}) or {}, generation), "configHash": config_hash, "render": digest}
    undone = condition("RolledBack", True, "RolloutUndone", message, generation)
    write_status(kube, namespace, owner, lambda now: {
        "rolledBack": rolled, "conditions": merge_conditions(_conditions_of(now), [undone])})
    kopf.warn(cr, reason="RolloutUndone", message=message)
    logger.info(f"{namespace}/{owner}: {message}")
    return kept



def _changed_childs_owner(kube: Kube, namespace: str, labels: kopf.Labels, type: str | None) -> Any:
    """For a child's MODIFIED or DELETED event: its owner CBDeployment and parsed spec, once that
    spec is settled; None for other events, children of no owner, or an owner not settled yet."""
    owner = labels.get(naming.LABEL_OWNER)
    if not owner or type not in ("MODIFIED", "DELETED"):
        return None
    return _settled_spec(kube, namespace, owner)


@kopf.on.event("batch", "v1", "jobs", labels=MANAGED)
def model_job_changed(body: kopf.Body, namespace: str, labels: kopf.Labels, type: str | None, memo: kopf.Memo,
                      logger: kopf.Logger, **_: Any) -> None:  # fmt: skip
    """The current download Job finished, failed or was deleted: reconcile its owner again (its
    Deployment gets its replicas, ModelCached follows; a deleted Job is created again)."""
    kube: Kube = memo.kube
    settled = _changed_childs_owner(kube, namespace, labels, type)
    if settled is None:
        return
    cr, spec = settled
    owner = cr["metadata"]["name"]
    if not spec.model.cache.enabled or body["metadata"]["name"] != model_cache.job_name(spec):
        return  # a Job of an earlier revision
    try:
        _reconcile(kube, cr, dict(cr.get("spec", {})), owner, namespace, cr["metadata"].get("generation"),
                   dict(cr.get("status", {}) or {}))  # fmt: skip
    except (kopf.TemporaryError, ApiError) as e:  # the next event, or the next reconcile, tries again
        logger.warning(f"reconciling {namespace}/{owner} after its Job changed: {e}")


@kopf.on.event("", "v1", "configmaps", labels=MANAGED)
@kopf.on.event("", "v1", "services", labels=MANAGED)
@kopf.on.event("", "v1", "persistentvolumeclaims", labels=MANAGED)  # the model cache's claim
@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels=MANAGED)
@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=MANAGED)
@kopf.on.event("keda.sh", "v1alpha1", "scaledobjects", labels=MANAGED)  # watched once KEDA's CRD exists
@kopf.on.event("monitoring.coreos.com", "v1", "servicemonitors", labels=MANAGED)  # and the Prometheus operator's
@kopf.on.event("inference.networking.k8s.io", "v1", "inferencepools", labels=MANAGED)  # and the inference extension's
def repair_child(body: kopf.Body, namespace: str, labels: kopf.Labels, type: str | None, memo: kopf.Memo,
                 logger: kopf.Logger, **_: Any) -> None:
    """A child deleted or edited by hand goes back to what the spec renders, on its own event.
    Server-side apply of the rendered object: fields the operator owns are put back, a write that
    changes nothing changes nothing (no new event, no loop), fields others set are left alone."""
    kube: Kube = memo.kube
    settled = _changed_childs_owner(kube, namespace, labels, type)
    if settled is None:
        return
    cr, spec = settled
    kind, name = body["kind"], body["metadata"]["name"]
    wanted, _ = render_children(spec, namespace)
    desired = next((o for o in wanted if o["kind"] == kind and o["metadata"]["name"] == name), None)
    if desired is None:
        return  # not wanted any more (an old ConfigMap, an autoscaler turned off): nothing to put back
    _stamp(desired, cr)
    try:
        kube.apply(desired)
    except ApiError as e:
        logger.warning(f"restoring the {kind} {name}: {e}")
        return
    if type == "DELETED":
        kopf.warn(cr, reason="ChildRecreated", message=f"the {kind} {name} was deleted; the operator recreated it")


def _owned_by(child: dict[str, Any], owner: dict[str, Any]) -> bool:
    uid = owner.get("metadata", {}).get("uid")
    refs = child.get("metadata", {}).get("ownerReferences", []) or []
    return any(ref.get("uid") == uid for ref in refs) if uid else True
