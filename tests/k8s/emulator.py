"""kmock's KubernetesEmulator, fixed so Kopf, kubectl and helm's output work against it.

kmock 0.8 as shipped fails real clients in many small ways (see the Kubernetes reference notes).
`Emulator` keeps kmock's server, object store (`emulator.objects`), resource registry
(`emulator.resources`, preloaded with the built-in kinds) and error payloads, and replaces the
request handling with one that behaves like an API server where clients look:

- discovery: `/api` with the `v1` group-version, `/apis`, per-group-version resource lists with
  subresources, `/version` 1.34, `/openapi/v3` for custom resources (what `kubectl explain` reads); CRDs created through the API are served at once (Established);
- objects get uid, resourceVersion (one cluster-wide counter), generation (bumped by spec changes
  only), creationTimestamp; `generateName`; `namespace` from the URL;
- status subresources: the main endpoint ignores `status`, `/status` changes nothing else (and is
  pruned and validated against the CRD's status schema, as the API server does);
  the scale subresource (Scale objects) for Deployments and CRDs that declare it (a custom
  resource's new replicas are judged by its CRD's schema and rules, as the API server does);
- merge, strategic-merge (approximated as merge), JSON-patch (a failed `test` is 422) and
  server-side apply (creates a missing object; YAML bodies parsed) patches; PUT replaces; field
  ownership as server-side apply keeps it: each manager's fields (lists atomic), a conflict (409)
  when an apply changes another manager's field without `force`, fields an apply leaves out that
  its manager applied before removed, updates (patches, PUT, the scale subresource) taking over
  the fields they change;
  a `metadata.resourceVersion` precondition answers 409 Conflict; a no-op write changes nothing;
- lists carry kind, apiVersion and the current resourceVersion; label and field selectors; pages
  (`limit` and `continue`, with `remainingItemCount`); `items_sent` counts the objects each client
  (User-Agent) received in lists and watch events;
- watches are JSON lines (application/json), honour `resourceVersion` (only later events) and
  `timeoutSeconds`; finalizers delay deletion;
- `kubectl get` Tables with the CRD's printer columns (and `-o wide` priority columns);
- deleting an object deletes what it owns (background cascading garbage collection);
- custom resources are pruned, defaulted and validated against their CRD's schema, CEL rules and
  list types (no duplicate keys in an `x-kubernetes-list-type: map` list, nor items in a `set`);
- creates in a terminating namespace, or over a ResourceQuota's object count, are 403s in the API
  server's words (NamespaceLifecycle and ResourceQuota admission; no compute-resource quotas);
  a CRD whose rule's estimated CEL cost is over the per-rule limit is refused (a coarse estimate:
  list macros over lists without maxItems, strings without maxLength).

Still missing by design: controllers (a Deployment never becomes ready and makes no ReplicaSets on
its own: tests patch its status and create what the controller would), admission webhooks, RBAC
enforcement, protobuf.

`EmulatorThread` runs it on 127.0.0.1 in a thread of its own, so synchronous tests, subprocesses
(kubectl) and Kopf (in its own thread) can all talk to it; `hold()` pauses matching requests.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import copy
import datetime
import json
import re
import secrets
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock import KubernetesEmulator, ResourceInfo, resource
from kmock._internal.k8s import KubernetesError

Obj = dict[str, Any]
T = TypeVar("T")
ServerVersion = {"major": "1", "minor": "34", "gitVersion": "v1.34.0", "platform": "linux/amd64"}


def _error(status: int, reason: str, message: str) -> KubernetesError:
    return KubernetesError(status=status, reason=reason, message=message, details={})


_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_DNS1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
# kinds whose names must be DNS-1035 labels (a Service's name is a DNS label of its own)
_DNS1035_KINDS = {"Service"}


def _admit_metadata(kind: str, meta: Obj) -> None:
    """The API server's own checks of a new object's name and label values, in its words (422)."""
    name = meta["name"]
    if kind in _DNS1035_KINDS:
        if len(name) > 63 or not _DNS1035_LABEL.fullmatch(name):
            raise _error(422, "Invalid", f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": a '
                         "DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                         "alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
                         "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')")
    elif len(name) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(name):
        raise _error(422, "Invalid", f'{kind} "{name}" is invalid: metadata.name: Invalid value: "{name}": a '
                     "lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
                     "and must start and end with an alphanumeric character")
    for field in ("labels", "annotations"):
        for key in meta.get(field) or {}:
            prefix, _, part = key.rpartition("/")
            if (len(part) > 63 or not _QUALIFIED_NAME.fullmatch(part)
                    or (prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix)))):  # fmt: skip
                raise _error(422, "Invalid", f'{kind} "{name}" is invalid: metadata.{field}: Invalid value: "{key}": '
                             "name part must consist of alphanumeric characters, '-', '_' or '.', and must start "
                             "and end with an alphanumeric character")
    for key, value in (meta.get("labels") or {}).items():
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            raise _error(422, "Invalid", f'{kind} "{name}" is invalid: metadata.labels: Invalid value: "{value}": '
                         "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' "
                         "or '.', and must start and end with an alphanumeric character, and be at most 63 "
                         "characters")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _age(timestamp: str | None) -> str:
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    seconds = int((datetime.datetime.now(datetime.timezone.utc) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _version_key(version: str) -> tuple[int, int, int]:
    """Kubernetes version priority: GA > beta > alpha, then by number (v2 > v1 > v1beta2)."""
    m = re.match(r"^v(\d+)(?:(alpha|beta)(\d+))?$", version)
    if not m:
        return (-1, 0, 0)
    stability = {"alpha": 0, "beta": 1, None: 2}[m[2]]
    return (stability, int(m[1]), int(m[3] or 0))


def _merge(base: Any, patch: Any, strategic: bool = False) -> Any:
    """RFC 7386 JSON merge patch; `strategic` drops strategic-merge `$` directives first."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(base) if isinstance(base, dict) else {}
    for key, value in patch.items():
        if strategic and key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        else:
            result[key] = _merge(result.get(key), value, strategic)
    return result


FieldPath = tuple[str, ...]
_MISSING = object()
# what server-side apply never records as a manager's field
_UNOWNED = {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace"),
            ("metadata", "resourceVersion"), ("metadata", "uid"), ("metadata", "generation"),
            ("metadata", "creationTimestamp"), ("metadata", "managedFields"), ("metadata", "deletionTimestamp")}


def _fields(obj: Any, prefix: FieldPath = ()) -> dict[FieldPath, Any]:
    """The leaf fields of an object, by path: maps are walked, lists are one field (atomic), as
    server-side apply sees them without the schema's list keys."""
    if isinstance(obj, dict) and obj:
        out: dict[FieldPath, Any] = {}
        for key, value in obj.items():
            path = (*prefix, key)
            if path not in _UNOWNED:
                out.update(_fields(value, path))
        return out
    return {prefix: obj} if prefix else {}


def _at(obj: Any, path: FieldPath) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _overlaps(a: FieldPath, b: FieldPath) -> bool:
    return a[: len(b)] == b or b[: len(a)] == a


def _remove_field(obj: Obj, path: FieldPath) -> None:
    """Remove a field, and the maps it leaves empty."""
    chain = [obj]
    for key in path[:-1]:
        nxt = chain[-1].get(key)
        if not isinstance(nxt, dict):
            return
        chain.append(nxt)
    chain[-1].pop(path[-1], None)
    for parent, key in zip(reversed(chain[:-1]), reversed(path[:-1])):
        if parent.get(key) == {}:
            del parent[key]


def _manager(params: dict[str, str], agent: str) -> str:
    """The field manager of a write: `fieldManager`, else the User-Agent up to its first '/'."""
    return params.get("fieldManager") or agent.split("/")[0] or "unknown"


def _jsonpath(obj: Obj, path: str) -> Any:
    """The dotted subset of JSONPath printer columns use: `.spec.model.uri`."""
    value: Any = obj
    for part in path.strip().lstrip(".").split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _default(schema: Obj, value: Any) -> Any:
    """Prune the fields a structural schema does not know (unless it preserves unknown fields) and
    fill in its defaults, as the API server does for custom resources."""
    if isinstance(value, dict):
        known = schema.get("properties")
        if known is not None and not schema.get("x-kubernetes-preserve-unknown-fields") \
                and "additionalProperties" not in schema:  # fmt: skip
            for key in [k for k in value if k not in known]:
                del value[key]
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(sub, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_default(schema["items"], item) for item in value]
    return value


def _openapi_to_jsonschema(schema: Any) -> Any:
    """An OpenAPI v3 CRD schema as JSON Schema: Kubernetes' extensions dropped, int-or-string kept."""
    if isinstance(schema, dict):
        out = {k: _openapi_to_jsonschema(v) for k, v in schema.items()
               if not k.startswith("x-kubernetes-") and k not in ("default", "description", "nullable")}
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if out.get(exclusive) is True:  # OpenAPI 3.0's boolean form; JSON Schema takes the bound
                out[exclusive] = out.pop(bound)
            elif out.get(exclusive) is False:
                del out[exclusive]
        if schema.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
        return out
    if isinstance(schema, list):
        return [_openapi_to_jsonschema(v) for v in schema]
    return schema


def _cel_problems(schema: Obj, value: Any, path: str) -> list[str]:
    """Evaluate every `x-kubernetes-validations` rule of a structural schema over `value`, as the API
    server does (`self` is the value at the rule's node; absent optional fields are not checked)."""
    import cel  # common-expression-language: CEL, as Kubernetes evaluates it (cel-go), from Rust

    problems = []
    for rule in schema.get("x-kubernetes-validations") or []:
        try:
            ok = cel.evaluate(rule["rule"], {"self": value})
        except Exception as e:  # noqa: BLE001 - a rule that cannot evaluate is the rule's failure
            problems.append(f"{path}: Invalid value: the rule {rule['rule']!r} failed to evaluate: {e}")
            continue
        if ok is not True:
            problems.append(f"{path}: Invalid value: \"object\": {rule.get('message') or rule['rule']}")
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key in value:
                problems += _cel_problems(sub, value[key], f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            problems += _cel_problems(schema["items"], item, f"{path}[{i}]")
    return problems


_MAX_REQUEST_BYTES = 3 * 1024 * 1024  # the API server's request size limit, which bounds what CEL may be handed
_RULE_COST_LIMIT = 10_000_000  # apiextensions' StaticEstimatedCostLimit, per rule
_STRING_COST_FACTOR = 0.1  # CEL's cost of traversing one character
_LIST_MACRO = re.compile(r"\bself\.(all|exists|exists_one|map|filter)\(\s*(\w+)\s*,")


def _rule_cost(schema: Obj, rule: str) -> float:
    """A coarse upper estimate of a rule's CEL cost, the part the API server's estimator makes decisive:
    a macro over the list at the rule's node costs, per item, a few steps plus a traversal of each
    string of the item it reads; the list holds maxItems items, or without it as many as fit in a
    request (3 MiB over the smallest item: 2 bytes); a string without maxLength may be a request long."""
    m = _LIST_MACRO.search(rule)
    if m is None or schema.get("type") != "array":
        return 0.0
    items = schema.get("items") or {}
    smallest = 1 if items.get("type") in ("integer", "number", "boolean") else 2
    count = schema.get("maxItems", _MAX_REQUEST_BYTES // (smallest + 1))
    var = m[2]
    strings = [items] if items.get("type") == "string" and re.search(rf"\b{var}\b", rule) else []
    strings += [sub for key, sub in (items.get("properties") or {}).items()
                if sub.get("type") == "string" and re.search(rf"\b{var}\.{key}\b", rule)]  # fmt: skip
    return count * (10 + sum(_STRING_COST_FACTOR * s.get("maxLength", _MAX_REQUEST_BYTES) for s in strings))


def _cost_problems(schema: Any, path: str) -> list[str]:
    """Every rule of a CRD version's schema whose estimated cost is over the per-rule limit, in the API
    server's words (it refuses such a CRD, at create and update)."""
    if not isinstance(schema, dict):
        return []
    problems = []
    for i, rule in enumerate(schema.get("x-kubernetes-validations") or []):
        cost = _rule_cost(schema, rule.get("rule", ""))
        if cost > _RULE_COST_LIMIT:
            problems.append(f"{path}.x-kubernetes-validations[{i}].rule: Forbidden: estimated rule cost exceeds "
                            f"budget by factor of {cost / _RULE_COST_LIMIT:.1f}x (try simplifying the rule, or adding "
                            "maxItems, maxProperties, and maxLength where arrays, maps, and strings are declared)")
    for key, sub in (schema.get("properties") or {}).items():
        problems += _cost_problems(sub, f"{path}.properties[{key}]")
    if isinstance(schema.get("items"), dict):
        problems += _cost_problems(schema["items"], f"{path}.items")
    return problems


def _list_problems(schema: Obj, value: Any, path: str) -> list[str]:
    """What the API server refuses by `x-kubernetes-list-type` (the `x-kubernetes-map-type` and `atomic`
    lists only steer server-side apply's merging): two items of a `map` list with the same
    `x-kubernetes-list-map-keys`, or two equal items of a `set`."""
    problems: list[str] = []
    if isinstance(value, dict):
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = (schema.get("properties") or {}).get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                problems += _list_problems(sub, item, f"{path}.{key}")
    elif isinstance(value, list):
        kind, seen = schema.get("x-kubernetes-list-type"), []
        for i, item in enumerate(value):
            if kind == "map" and isinstance(item, dict):
                key = {k: item.get(k) for k in schema.get("x-kubernetes-list-map-keys") or []}
            elif kind == "set":
                key = item
            else:
                key = None
            if key is not None and key in seen:
                problems.append(f"{path}[{i}]: Duplicate value: {json.dumps(key, sort_keys=True)}")
            seen.append(key)
            if isinstance(schema.get("items"), dict):
                problems += _list_problems(schema["items"], item, f"{path}[{i}]")
    return problems


def _match_labels(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in re.split(r",(?![^()]*\))", selector))):
        if m := re.match(r"^([^!=\s]+)\s*(==|=|!=)\s*(.*)$", term):
            key, op, value = m[1], m[2], m[3]
            if (labels.get(key) == value) != (op != "!="):
                return False
        elif m := re.match(r"^(\S+)\s+(in|notin)\s+\((.*)\)$", term):
            values = {v.strip() for v in m[3].split(",")}
            if (labels.get(m[1]) in values) != (m[2] == "in"):
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _match_fields(obj: Obj, selector: str) -> bool:
    meta = obj.get("metadata", {})
    for term in filter(None, selector.split(",")):
        key, op, value = re.match(r"^([^!=]+)(==|=|!=)(.*)$", term).groups()  # type: ignore[union-attr]
        actual = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}.get(key)
        if actual is None and key not in ("metadata.name", "metadata.namespace"):
            actual = _jsonpath(obj, key)
        if (str(actual) == value) != (op != "!="):
            return False
    return True


@dataclass
class Gate:
    """Holds requests whose method and path match until released (optionally failing them)."""

    method: str
    path: re.Pattern[str]
    arrived: threading.Event = field(default_factory=threading.Event)
    _released: threading.Event = field(default_factory=threading.Event)
    fail_status: int | None = None

    def release(self, fail_status: int | None = None) -> None:
        self.fail_status = fail_status
        self._released.set()


@dataclass(frozen=True)
class Target:
    """A parsed resource URL."""

    res: resource
    namespace: str | None
    name: str | None
    subresource: str | None


@attrs.define(kw_only=True)
class Emulator(KubernetesEmulator):
    _rv: int = attrs.field(default=0, init=False)
    _log: list[tuple[int, resource, str, Obj]] = attrs.field(factory=list, init=False)
    _changed: asyncio.Condition | None = attrs.field(default=None, init=False)
    _crds: dict[resource, Obj] = attrs.field(factory=dict, init=False)
    gates: list[Gate] = attrs.field(factory=list, init=False)
    _closing: bool = attrs.field(default=False, init=False)
    # (method, path?query, User-Agent) of every request, for assertions
    journal: list[tuple[str, str, str]] = attrs.field(factory=list, init=False)
    validate_custom_resources: bool = attrs.field(default=True, init=False)
    # objects sent to each User-Agent, in list items and watch events: what a client had to take in
    items_sent: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    # (User-Agent, plural, whether it carried a resourceVersion precondition) of every status write
    status_writes: list[tuple[str, str, bool]] = attrs.field(factory=list, init=False)
    # server-side apply's field ownership: per object, the fields of each manager
    _owners: dict[tuple[resource, str | None, str], dict[str, set[FieldPath]]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        for ns in ("default", "kube-system"):
            self._store_new(resource("", "v1", "namespaces"), None, {"apiVersion": "v1", "kind": "Namespace",
                                                                     "metadata": {"name": ns}})

    # ---- plumbing ------------------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        if self._changed is None:
            self._changed = asyncio.Condition()
        body = await raw.read()
        self.journal.append((raw.method, raw.path_qs, raw.headers.get("User-Agent", "")))
        try:
            for gate in list(self.gates):
                if gate.method == raw.method and gate.path.search(raw.path_qs):
                    self.gates.remove(gate)
                    gate.arrived.set()
                    await asyncio.to_thread(gate._released.wait, 120)
                    if gate.fail_status is not None:
                        raise _error(gate.fail_status, "ServiceUnavailable", "held by the test and failed")
            return await self._dispatch(raw, body)
        except KubernetesError as e:
            return await self._render_error(e)

    def _check_owner_permission(self, meta: Obj, namespace: str | None, agent: str) -> None:
        """The OwnerReferencesPermissionEnforcement admission plugin (OpenShift enables it): setting
        blockOwnerDeletion needs `update` on the owner's finalizers. The emulator has no RBAC, so it
        records the check in the journal, where the chart's ClusterRole test finds it."""
        for ref in meta.get("ownerReferences") or []:
            if not ref.get("blockOwnerDeletion"):
                continue
            group, _, version = ref["apiVersion"].rpartition("/")
            res = next((r for r, info in self.resources.items() if info.kind == ref["kind"] and r.group == group
                        and r.version == version), None)  # fmt: skip
            if res is not None and namespace is not None:
                prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
                path = f"{prefix}/namespaces/{namespace}/{res.plural}/{ref['name']}/finalizers"
                self.journal.append(("PUT", path, agent))

    # the ResourceQuota object counts of the core kinds that have a name of their own (besides count/...)
    _LEGACY_COUNTS = {"configmaps", "services", "secrets", "persistentvolumeclaims", "pods",
                      "replicationcontrollers", "resourcequotas"}

    def _admit_namespace(self, res: resource, namespace: str, name: str) -> None:
        """The NamespaceLifecycle and ResourceQuota admission plugins, for a create: 403 in a terminating
        namespace, and 403 when an object count of a ResourceQuota in the namespace (`count/<plural>.<group>`,
        `count/<plural>` or a core kind's own name) would go over its hard limit, in the API server's words."""
        ns = self._live(resource("", "v1", "namespaces"), None, namespace)
        if ns is not None and (ns["metadata"].get("deletionTimestamp") or (ns.get("status") or {}).get("phase") == "Terminating"):
            raise _error(403, "Forbidden", f'{res.plural} "{name}" is forbidden: unable to create new content in '
                         f"namespace {namespace} because it is being terminated")
        keys = {f"count/{res.plural}.{res.group}" if res.group else f"count/{res.plural}"}
        if not res.group and res.plural in self._LEGACY_COUNTS:
            keys.add(res.plural)
        for quota in self._items(resource("", "v1", "resourcequotas"), namespace):
            hard = (quota.get("spec") or {}).get("hard") or {}
            for key in sorted(keys & set(hard)):
                used = sum(1 for _ in self._items(res, namespace))
                if used + 1 > int(hard[key]):
                    raise _error(403, "Forbidden", f'{res.plural} "{name}" is forbidden: exceeded quota: '
                                 f"{quota['metadata']['name']}, requested: {key}=1, used: {key}={used}, "
                                 f"limited: {key}={hard[key]}")

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    async def _emit(self, res: resource, type_: str, obj: Obj) -> None:
        assert self._changed is not None
        self._log.append((int(obj["metadata"]["resourceVersion"]), res, type_, copy.deepcopy(obj)))
        async with self._changed:
            self._changed.notify_all()

    def _info(self, res: resource) -> ResourceInfo:
        if res not in self.resources:
            raise _error(404, "NotFound", f"the server could not find the requested resource ({res.plural})")
        return self.resources[res]

    def _live(self, res: resource, namespace: str | None, name: str) -> Obj | None:
        key = (res, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def _items(self, res: resource, namespace: str | None) -> Iterator[Obj]:
        for (r, ns, _), obj in list(self.objects.items()):
            if r == res and (namespace is None or ns == namespace) and not obj.deleted:
                yield obj.raw

    async def close_watches(self) -> None:
        """End every open watch stream (before the server shuts down)."""
        self._closing = True
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    # ---- routing -------------------------------------------------------------------------------

    async def _dispatch(self, raw: aiohttp.web.BaseRequest, body: bytes) -> aiohttp.web.StreamResponse:
        parts = [p for p in raw.path.split("/") if p]
        method = raw.method
        json_ = aiohttp.web.json_response
        if method == "GET":
            if parts == ["version"]:
                return json_(ServerVersion)
            if parts[:2] == ["openapi", "v3"]:
                return json_(self._openapi_v3(parts[2:]))
            if parts == ["api"]:
                return json_({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": raw.host}]})
            if parts == ["apis"]:
                return json_(self._group_list())
            if len(parts) == 2 and parts[0] == "apis":
                return json_(self._group(parts[1]))
            if parts in (["api", "v1"],) or (len(parts) == 3 and parts[0] == "apis"):
                group, version = ("", "v1") if parts[0] == "api" else (parts[1], parts[2])
                return json_(self._resource_list(group, version))
        if parts[:1] not in (["api"], ["apis"]) or len(parts) < 3:
            raise _error(404, "NotFound", f"the server could not find the requested resource ({raw.path})")
        target = self._parse_target(parts)
        info = self._info(target.res)
        params = dict(raw.query)

        if target.name is None:
            if method == "GET" and params.get("watch") in ("true", "1"):
                return await self._watch(raw, target, params)
            if method == "GET":
                listed = self._list(target, params)
                self.items_sent[raw.headers.get("User-Agent", "")] += len(listed["items"])
                return self._respond(raw, target, listed)
            if method == "POST":
                data = self._decode(raw, body)
                agent = raw.headers.get("User-Agent", "")
                obj = await self._create(target, data, info, agent, _manager(params, agent))
                return json_(obj, status=201)
            raise _error(405, "MethodNotAllowed", f"{method} on a collection")

        if method == "GET" and params.get("watch") in ("true", "1"):
            params["fieldSelector"] = f"metadata.name={target.name}"
            return await self._watch(raw, Target(target.res, target.namespace, None, None), params)
        if method == "GET":
            obj = self._get(target)
            return self._respond(raw, target, self._scale_of(target, obj) if target.subresource == "scale" else obj)
        if method == "DELETE":
            return json_(await self._delete(target))
        if method in ("PATCH", "PUT"):
            data = self._decode(raw, body)
            content_type = raw.headers.get("Content-Type", "application/json").split(";")[0]
            existed = self._live(target.res, target.namespace, target.name) is not None
            obj = await self._write(target, info, method, content_type, data, raw.headers.get("User-Agent", ""), params)
            return json_(obj, status=200 if existed or target.subresource else 201)  # an apply that created: 201
        raise _error(405, "MethodNotAllowed", f"{method} on an object")

    def _parse_target(self, parts: list[str]) -> Target:
        if parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        else:
            if len(parts) < 4:
                raise _error(404, "NotFound", "the server could not find the requested resource")
            group, version, rest = parts[1], parts[2], parts[3:]
        if rest[0] == "namespaces" and len(rest) >= 3:
            namespace, plural, rest = rest[1], rest[2], rest[3:]
        else:
            namespace, plural, rest = None, rest[0], rest[1:]
        name = rest[0] if rest else None
        sub = "/".join(rest[1:]) or None
        return Target(resource(group, version, plural), namespace, name, sub)

    def _decode(self, raw: aiohttp.web.BaseRequest, body: bytes) -> Any:
        if not body:
            return {}
        try:
            if "yaml" in raw.headers.get("Content-Type", ""):
                return yaml.safe_load(body)
            return json.loads(body)
        except (ValueError, yaml.YAMLError) as e:
            raise _error(400, "BadRequest", f"the body is not valid JSON/YAML: {e}") from e

    def _respond(self, raw: aiohttp.web.BaseRequest, target: Target, payload: Obj) -> aiohttp.web.StreamResponse:
        if "as=Table" in raw.headers.get("Accept", "") and target.subresource is None:
            items = payload["items"] if "items" in payload else [payload]
            return aiohttp.web.json_response(self._table(target.res, items, payload["metadata"]))
        return aiohttp.web.json_response(payload)

    # ---- discovery -----------------------------------------------------------------------------

    def _versions_of(self, group: str) -> list[str]:
        versions = {r.version for r in self.resources if r.group == group and r.version}
        return sorted(versions, key=_version_key, reverse=True)

    def _group(self, group: str) -> Obj:
        versions = self._versions_of(group)
        if not versions:
            raise _error(404, "NotFound", f"the server could not find the requested resource (group {group})")
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"apiVersion": "v1", "kind": "APIGroup", "name": group, "versions": entries,
                "preferredVersion": entries[0]}

    def _group_list(self) -> Obj:
        groups = sorted({r.group for r in self.resources if r.group})
        return {"apiVersion": "v1", "kind": "APIGroupList", "groups": [self._group(g) for g in groups]}

    def _resource_list(self, group: str, version: str) -> Obj:
        entries = []
        for res in self.resources:
            if res.group != group or res.version != version:
                continue
            info = self.resources[res]
            entry = {
                "name": res.plural, "singularName": info.singular or "", "namespaced": bool(info.namespaced),
                "kind": info.kind or res.plural, "verbs": sorted(info.verbs),
            }
            if info.shortnames:
                entry["shortNames"] = sorted(info.shortnames)
            if info.categories:
                entry["categories"] = sorted(info.categories)
            entries.append(entry)
            for sub in sorted(info.subresources):
                kind = "Scale" if sub == "scale" else info.kind
                entries.append({"name": f"{res.plural}/{sub}", "singularName": "", "kind": kind,
                                "namespaced": bool(info.namespaced), "verbs": ["get", "patch", "update"]})
        if not entries:
            raise _error(404, "NotFound", f"the server could not find the requested resource ({group}/{version})")
        group_version = f"{group}/{version}" if group else version
        return {"apiVersion": "v1", "kind": "APIResourceList", "groupVersion": group_version, "resources": entries}

    def _openapi_v3(self, rest: list[str]) -> Obj:
        """OpenAPI v3 for custom resources, what `kubectl explain` reads: the index of group-versions,
        and one document per group-version with each kind's schema (its descriptions included). The
        built-in kinds have none here."""
        group_versions = sorted({(r.group, r.version) for r in self._crds})
        if not rest:
            return {"paths": {f"apis/{g}/{v}": {"serverRelativeURL": f"/openapi/v3/apis/{g}/{v}?hash=0"}
                              for g, v in group_versions}}  # fmt: skip
        if len(rest) != 3 or rest[0] != "apis" or (rest[1], rest[2]) not in group_versions:
            raise _error(404, "NotFound", f"the server could not find the requested resource (openapi/v3/{'/'.join(rest)})")
        group, version = rest[1], rest[2]
        schemas, paths = {}, {}
        for res, crd in self._crds.items():
            if (res.group, res.version) == (group, version):
                kind = crd["names"]["kind"]
                gvk = {"group": group, "kind": kind, "version": version}
                name = f"{'.'.join(reversed(group.split('.')))}.{version}.{kind}"
                schema = copy.deepcopy(crd["version"].get("schema", {}).get("openAPIV3Schema", {}))
                schema["x-kubernetes-group-version-kind"] = [gvk]
                schemas[name] = schema
                scope = "namespaces/{namespace}/" if self.resources[res].namespaced else ""
                paths[f"/apis/{group}/{version}/{scope}{res.plural}/{{name}}"] = {"get": {
                    "x-kubernetes-action": "get", "x-kubernetes-group-version-kind": gvk,
                    "responses": {"200": {"description": "OK", "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{name}"}}}}}}}  # fmt: skip
        return {"openapi": "3.0.0", "info": {"title": "Kubernetes CRD Swagger", "version": "v0.1.0"},
                "paths": paths, "components": {"schemas": schemas}}

    def _register_crd(self, crd: Obj) -> None:
        spec = crd["spec"]
        names = spec["names"]
        problems = [p for i, version in enumerate(spec.get("versions", [])) for p in _cost_problems(
            (version.get("schema") or {}).get("openAPIV3Schema"), f"spec.versions[{i}].schema.openAPIV3Schema")]
        if problems:
            raise _error(422, "Invalid", f'CustomResourceDefinition.apiextensions.k8s.io "{crd["metadata"]["name"]}" '
                                         f"is invalid: [{', '.join(problems)}]")
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            res = resource(spec["group"], version["name"], names["plural"])
            subresources = set(version.get("subresources", {}) or {})
            self.resources[res] = ResourceInfo(
                kind=names["kind"], singular=names.get("singular", names["kind"].lower()),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs={"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"},
                shortnames=set(names.get("shortNames", [])), categories=set(names.get("categories", [])),
                subresources=subresources,
            )
            self._crds[res] = {"version": version, "names": names}
        if crd.get("status", {}).get("conditions"):
            return
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in spec.get("versions", []) if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": _now()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "lastTransitionTime": _now()},
            ],
        }

    def _validate_custom(self, res: resource, obj: Obj, part: str = "spec") -> None:
        """A custom resource against its CRD's schema and CEL rules: 422 with every problem, in the
        API server's words. `part` is what the write changed: "spec" (the main endpoint: everything
        but status) or "status" (the status subresource, which the API server also validates
        against the schema: an enum value it does not list is refused). `validate_custom_resources =
        False` stands for a cluster without CEL (before 1.25) or an object stored before a rule existed."""
        crd = self._crds.get(res)
        schema = (crd or {}).get("version", {}).get("schema", {}).get("openAPIV3Schema")
        if not schema or not self.validate_custom_resources:
            return
        judged = ("status",) if part == "status" else tuple(
            k for k in (schema.get("properties") or {}) if k not in ("metadata", "apiVersion", "kind", "status"))
        problems = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                    for e in self._validator(crd, part, judged).iter_errors(obj)]
        for key in judged:
            if key in obj:
                problems += _list_problems((schema.get("properties") or {}).get(key, {}), obj[key], key)
        if part != "status":
            problems += _cel_problems({k: v for k, v in schema.items() if k != "properties"},
                                      {"metadata": {"name": obj["metadata"]["name"]}, **obj}, "<root>")  # fmt: skip
        for key in ("spec",) if part != "status" else ("status",):
            if key in obj:
                problems += _cel_problems((schema.get("properties") or {}).get(key, {}), obj[key], key)
        if problems:
            raise _error(422, "Invalid", f'{crd["names"]["kind"]}.{res.group} "{obj["metadata"]["name"]}" is '
                                         f"invalid: [{', '.join(problems)}]")

    @staticmethod
    def _validator(crd: Obj, part: str, judged: tuple[str, ...]) -> Any:
        """The JSON Schema validator of a CRD's `judged` top-level fields, built once per CRD version (a
        LeaderWorkerSet's schema, two pod templates, is 1.3 MB)."""
        import jsonschema

        cache = crd.setdefault("validators", {})
        if part not in cache:
            schema = crd["version"]["schema"]["openAPIV3Schema"]
            cache[part] = jsonschema.Draft7Validator(_openapi_to_jsonschema({
                "type": "object", "properties": {k: v for k, v in (schema.get("properties") or {}).items()
                                                 if k in judged}}))  # fmt: skip
        return cache[part]

    def _apply_defaults(self, res: resource, obj: Obj, part: str = "spec") -> None:
        crd = self._crds.get(res)
        schema = (crd or {}).get("version", {}).get("schema", {}).get("openAPIV3Schema")
        if schema:
            for key in (part,):
                if isinstance(obj.get(key), dict):
                    obj[key] = _default(schema.get("properties", {}).get(key, {}), copy.deepcopy(obj[key]))

    # ---- reads ---------------------------------------------------------------------------------

    def _get(self, target: Target) -> Obj:
        assert target.name is not None
        obj = self._live(target.res, target.namespace, target.name)
        if obj is None:
            raise _error(404, "NotFound", f'{target.res.plural} "{target.name}" not found')
        return obj

    def _selected(self, target: Target, params: dict[str, str]) -> list[Obj]:
        labels, fields = params.get("labelSelector", ""), params.get("fieldSelector", "")
        return [o for o in self._items(target.res, target.namespace)
                if _match_labels(o.get("metadata", {}).get("labels", {}) or {}, labels)
                and _match_fields(o, fields)]

    def _list(self, target: Target, params: dict[str, str]) -> Obj:
        """A list, in pages when the client sends `limit` (ordered by namespace and name, as etcd's keys
        are): `metadata.continue` names where the next page starts and carries the first page's
        resourceVersion, which every page reports; `remainingItemCount` counts what is left. A token
        that is not one of ours is a 400, as on the API server. (The API server serves every page from
        the first page's snapshot; the emulator serves the objects as they are now.)"""
        info = self._info(target.res)
        api_version = f"{target.res.group}/{target.res.version}" if target.res.group else target.res.version
        items = self._selected(target, params)
        meta: Obj = {"resourceVersion": str(self._rv)}
        limit = params.get("limit", "")
        if not limit.isdigit() and limit:
            raise _error(400, "BadRequest", f"limit: Invalid value: {limit!r}")
        if limit and int(limit) > 0:
            items.sort(key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))
            after: tuple[str, str] | None = None
            if params.get("continue"):
                try:
                    token = json.loads(base64.urlsafe_b64decode(params["continue"]))
                    after, meta["resourceVersion"] = (token["ns"], token["name"]), token["rv"]
                except (ValueError, KeyError, TypeError) as e:
                    raise _error(400, "BadRequest", "continue key is not valid") from e
                items = [o for o in items if (o["metadata"].get("namespace") or "", o["metadata"]["name"]) > after]
            page, rest = items[: int(limit)], len(items) - int(limit)
            if rest > 0:
                last = page[-1]["metadata"]
                meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                    {"rv": meta["resourceVersion"], "ns": last.get("namespace") or "", "name": last["name"]}).encode()).decode()
                meta["remainingItemCount"] = rest
            items = page
        return {"apiVersion": api_version, "kind": f"{info.kind}List", "metadata": meta, "items": items}

    def _table(self, res: resource, items: list[Obj], list_meta: Obj) -> Obj:
        columns: list[Obj] = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                               "description": "Name of the object"}]
        paths: list[tuple[str, str]] = []
        crd = self._crds.get(res)
        printer = (crd or {}).get("version", {}).get("additionalPrinterColumns")
        if printer is None:
            printer = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        for col in printer:
            columns.append({"name": col["name"], "type": col["type"], "format": col.get("format", ""),
                            "priority": col.get("priority", 0), "description": col.get("description", "")})
            paths.append((col["jsonPath"], col["type"]))
        rows = []
        for obj in items:
            cells: list[Any] = [obj["metadata"]["name"]]
            for path, type_ in paths:
                value = _jsonpath(obj, path)
                cells.append(_age(value) if type_ == "date" else ("<none>" if value is None else value))
            rows.append({"cells": cells, "object": obj})
        return {"apiVersion": "meta.k8s.io/v1", "kind": "Table",
                "metadata": {"resourceVersion": list_meta.get("resourceVersion", str(self._rv))},
                "columnDefinitions": columns, "rows": rows}

    def _scale_paths(self, res: resource) -> tuple[str, str, str | None]:
        crd = self._crds.get(res)
        if crd is not None:
            scale = crd["version"].get("subresources", {}).get("scale")
            if not scale:
                raise _error(404, "NotFound", f"{res.plural} has no scale subresource")
            return scale["specReplicasPath"], scale["statusReplicasPath"], scale.get("labelSelectorPath")
        return ".spec.replicas", ".status.replicas", None

    def _scale_of(self, target: Target, obj: Obj) -> Obj:
        spec_path, status_path, selector_path = self._scale_paths(target.res)
        meta = obj["metadata"]
        selector = _jsonpath(obj, selector_path) if selector_path else ",".join(
            f"{k}={v}" for k, v in sorted((_jsonpath(obj, ".spec.selector.matchLabels") or {}).items()))
        status: Obj = {"replicas": _jsonpath(obj, status_path) or 0}
        if selector:
            status["selector"] = selector
        return {"apiVersion": "autoscaling/v1", "kind": "Scale",
                "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                  "creationTimestamp") if k in meta},
                "spec": {"replicas": _jsonpath(obj, spec_path) or 0}, "status": status}

    async def _watch(self, raw: aiohttp.web.BaseRequest, target: Target, params: dict[str, str]) -> aiohttp.web.StreamResponse:
        assert self._changed is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(params.get("timeoutSeconds") or 1800)
        since = params.get("resourceVersion") or "0"
        position = 0
        if since == "0":  # no version: synthetic ADDED events for everything there is now
            for obj in self._selected(target, params):
                self.items_sent[raw.headers.get("User-Agent", "")] += 1
                await response.write(json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n")
            position = len(self._log)
        else:
            while position < len(self._log) and self._log[position][0] <= int(since):
                position += 1
        labels, fields = params.get("labelSelector", ""), params.get("fieldSelector", "")
        try:
            while loop.time() < deadline and not self._closing:
                if raw.transport is None or raw.transport.is_closing():
                    break  # the client went away
                while position < len(self._log):
                    _, res, type_, obj = self._log[position]
                    position += 1
                    ns = obj["metadata"].get("namespace")
                    if res != target.res or (target.namespace is not None and ns != target.namespace):
                        continue
                    if not (_match_labels(obj["metadata"].get("labels", {}) or {}, labels) and _match_fields(obj, fields)):
                        continue
                    self.items_sent[raw.headers.get("User-Agent", "")] += 1
                    await response.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")
                async with self._changed:
                    if position >= len(self._log):
                        try:
                            # Wake up now and then to notice a client that disconnected.
                            await asyncio.wait_for(self._changed.wait(), timeout=min(1.0, max(0.0, deadline - loop.time())))
                        except TimeoutError:
                            pass
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        await response.write_eof()
        return response

    # ---- writes --------------------------------------------------------------------------------

    def _store_new(self, res: resource, namespace: str | None, data: Obj) -> Obj:
        obj = copy.deepcopy(data)
        meta = obj.setdefault("metadata", {})
        if namespace is not None:
            meta["namespace"] = namespace
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), generation=1, creationTimestamp=_now())
        meta.pop("managedFields", None)
        self.objects[res, namespace, meta["name"]] = obj
        return obj

    async def _create(self, target: Target, data: Any, info: ResourceInfo, agent: str = "", manager: str = "") -> Obj:
        if not isinstance(data, dict):
            raise _error(400, "BadRequest", "the body must be an object")
        meta = data.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise _error(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        _admit_metadata(info.kind, meta)
        self._check_owner_permission(meta, target.namespace or meta.get("namespace"), agent)
        if info.namespaced and target.namespace is None and not meta.get("namespace"):
            raise _error(400, "BadRequest", "a namespaced object needs a namespace")
        namespace = (target.namespace or meta.get("namespace")) if info.namespaced else None
        if meta.get("namespace") and target.namespace and meta["namespace"] != target.namespace:
            raise _error(400, "BadRequest", "the namespace of the object does not match the URL")
        if self._live(target.res, namespace, meta["name"]) is not None:
            raise _error(409, "AlreadyExists", f'{target.res.plural} "{meta["name"]}" already exists')
        if namespace is not None:
            self._admit_namespace(target.res, namespace, meta["name"])
        api_version = f"{target.res.group}/{target.res.version}" if target.res.group else target.res.version
        data.setdefault("apiVersion", api_version)
        data.setdefault("kind", info.kind)
        if "status" in info.subresources:
            data.pop("status", None)
        self._apply_defaults(target.res, data)
        self._validate_custom(target.res, data)
        if target.res == resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._register_crd(data)
        obj = self._store_new(target.res, namespace, data)
        self._owners[target.res, namespace, obj["metadata"]["name"]] = {manager or "unknown": set(_fields(
            {k: v for k, v in obj.items() if k != "status"}))}
        await self._emit(target.res, "ADDED", obj)
        return obj

    async def _write(self, target: Target, info: ResourceInfo, method: str, content_type: str, data: Any,
                     agent: str = "", params: dict[str, str] | None = None) -> Obj:
        assert target.name is not None
        params = params or {}
        manager = _manager(params, agent)
        applying = content_type == "application/apply-patch+yaml"
        if applying and not params.get("fieldManager"):
            raise _error(422, "Invalid", "fieldManager: Required value: is required for apply patch")
        old = self._live(target.res, target.namespace, target.name)
        if old is None:
            if applying and target.subresource is None:
                data.setdefault("metadata", {})["name"] = target.name
                return await self._create(target, data, info, agent, manager)
            raise _error(404, "NotFound", f'{target.res.plural} "{target.name}" not found')

        if target.subresource == "scale":
            return await self._write_scale(target, old, method, content_type, data, manager)

        precondition = None
        if method == "PUT":
            new = copy.deepcopy(data)
            precondition = new.get("metadata", {}).get("resourceVersion")
            new.setdefault("metadata", {})
            for key in ("uid", "creationTimestamp", "generation", "namespace", "name"):
                if key in old["metadata"]:
                    new["metadata"][key] = old["metadata"][key]
        elif content_type == "application/json-patch+json":
            try:
                new = jsonpatch.apply_patch(old, data, in_place=False)
            except jsonpatch.JsonPatchTestFailed as e:
                raise _error(422, "Invalid", f"the JSON patch test failed: {e}") from e
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as e:
                raise _error(422, "Invalid", f"the JSON patch cannot be applied: {e}") from e
        elif applying:
            if not isinstance(data, dict):
                raise _error(400, "BadRequest", "an apply patch must be an object")
            precondition = (data.get("metadata") or {}).get("resourceVersion")
            new = self._apply(target, old, data, manager, params.get("force") == "true")
        elif content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json",
                              "application/json"):
            if not isinstance(data, dict):
                raise _error(400, "BadRequest", "a merge patch must be an object")
            precondition = (data.get("metadata") or {}).get("resourceVersion")
            strategic = content_type == "application/strategic-merge-patch+json"
            new = _merge(old, data, strategic=strategic)
        else:
            raise _error(415, "UnsupportedMediaType", f"unsupported patch type {content_type}")
        if target.subresource == "status":
            self.status_writes.append((agent, target.res.plural, precondition is not None))
        if precondition is not None and str(precondition) != old["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", f'the object has been modified; {target.res.plural} "{target.name}"')

        has_status = "status" in info.subresources
        if target.subresource == "status":
            new = {**old, "status": new.get("status")} if new.get("status") is not None else \
                {k: v for k, v in old.items() if k != "status"}
        elif has_status:
            new = {**{k: v for k, v in new.items() if k != "status"},
                   **({"status": old["status"]} if "status" in old else {})}
        new["metadata"] = {**new.get("metadata", {}), "resourceVersion": old["metadata"]["resourceVersion"],
                           "uid": old["metadata"]["uid"], "generation": old["metadata"]["generation"]}
        new["metadata"].pop("managedFields", None)
        if old.get("immutable") and info.kind in ("ConfigMap", "Secret") and any(
                new.get(k) != old.get(k) for k in ("data", "binaryData", "immutable")):  # fmt: skip
            raise _error(422, "Invalid", f'{info.kind} "{target.name}" is invalid: data: Forbidden: field is '
                         "immutable when `immutable` is set")
        if target.subresource is None:
            self._apply_defaults(target.res, new)
            if new.get("spec") != old.get("spec"):  # ratcheting (1.30+): an unchanged spec is not re-judged
                self._validate_custom(target.res, new)
        elif target.subresource == "status":
            self._apply_defaults(target.res, new, "status")  # unknown status fields are pruned too
            if new.get("status") != old.get("status"):
                self._validate_custom(target.res, new, "status")
        if target.res == resource("apiextensions.k8s.io", "v1", "customresourcedefinitions"):
            self._register_crd(new)
        if new == old:
            return old  # a no-op write: no new resourceVersion, no event
        if not applying:
            self._take_fields(target, old, new, manager)
        return await self._commit(target, old, new)

    def _apply(self, target: Target, old: Obj, config: Obj, manager: str, force: bool) -> Obj:
        """Server-side apply of `config` by `manager`: a field it sets to another value than the one another
        manager owns is a conflict (409, unless `force`, which takes the field over); fields it applied
        before and leaves out now are removed, unless another manager owns them too; it then owns exactly
        the fields of `config`. Lists are atomic (without the built-in kinds' schemas, no list keys)."""
        owners = self._owners.setdefault((target.res, target.namespace, target.name or ""), {})
        wanted = {p: v for p, v in _fields(config).items() if p[0] != "status"}
        conflicts = sorted({(other, path) for path, value in wanted.items() if _at(old, path) != value
                            for other, fields in owners.items() if other != manager
                            and any(_overlaps(path, f) for f in fields)})  # fmt: skip
        if conflicts and not force:
            listed = "\n".join(f'- conflict with "{other}": .{".".join(path)}' for other, path in conflicts)
            raise _error(409, "Conflict", f"Apply failed with {len(conflicts)} conflict{'s' if len(conflicts) > 1 else ''}:"
                                          f"\n{listed}")
        for other, path in conflicts:  # forced: the field changes hands
            owners[other] = {f for f in owners[other] if not _overlaps(f, path)}
        new = _merge(old, config)
        kept = set().union(*(f for other, f in owners.items() if other != manager))
        for gone in owners.get(manager, set()) - set(wanted):
            if not any(_overlaps(gone, f) for f in kept | set(wanted)):
                _remove_field(new, gone)
        owners[manager] = set(wanted)
        return new

    def _take_fields(self, target: Target, old: Obj, new: Obj, manager: str) -> None:
        """An update (not an apply): the fields it changed are `manager`'s from now on, no one else's."""
        before, after = _fields(old), _fields(new)
        changed = {p for p in before.keys() | after.keys() if before.get(p, _MISSING) != after.get(p, _MISSING)}
        owners = self._owners.setdefault((target.res, target.namespace, target.name or ""), {})
        for other in list(owners):
            if other != manager:
                owners[other] = {f for f in owners[other] if not any(_overlaps(f, p) for p in changed)}
        owners.setdefault(manager, set()).update(p for p in changed if p in after)

    async def _write_scale(self, target: Target, old: Obj, method: str, content_type: str, data: Any,
                           manager: str = "unknown") -> Obj:
        scale = self._scale_of(target, old)
        if method == "PUT":
            new_scale = data
        elif content_type == "application/json-patch+json":
            new_scale = jsonpatch.apply_patch(scale, data, in_place=False)
        else:
            new_scale = _merge(scale, data)
        replicas = (new_scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise _error(422, "Invalid", "spec.replicas must be a non-negative integer")
        spec_path = self._scale_paths(target.res)[0]
        new = copy.deepcopy(old)
        node = new
        keys = spec_path.lstrip(".").split(".")
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = replicas
        if new != old:
            self._validate_custom(target.res, new)  # the whole object is judged, CEL rules included
            self._take_fields(target, old, new, manager)
            new = await self._commit(target, old, new)
        return self._scale_of(target, new)

    async def _commit(self, target: Target, old: Obj, new: Obj) -> Obj:
        assert target.name is not None
        def essence(o: Obj) -> Obj:
            return {k: v for k, v in o.items() if k not in ("metadata", "status")}
        if essence(new) != essence(old):
            new["metadata"]["generation"] = old["metadata"]["generation"] + 1
        new["metadata"]["resourceVersion"] = self._next_rv()
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self.objects[target.res, target.namespace, target.name].delete()
            await self._emit(target.res, "DELETED", new)
            return new
        self.objects[target.res, target.namespace, target.name].history.append(new)
        await self._emit(target.res, "MODIFIED", new)
        return new

    async def _delete(self, target: Target) -> Obj:
        old = self._get(target)
        if old["metadata"].get("finalizers"):
            if old["metadata"].get("deletionTimestamp"):
                return old
            new = copy.deepcopy(old)
            new["metadata"]["deletionTimestamp"] = _now()
            return await self._commit(target, old, new)
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        assert target.name is not None
        self.objects[target.res, target.namespace, target.name].delete()
        await self._emit(target.res, "DELETED", gone)
        await self._collect_garbage(gone["metadata"]["uid"])
        return gone

    async def _collect_garbage(self, owner_uid: str) -> None:
        """Background cascading deletion: delete what the deleted object owned (and so on down)."""
        for (res, namespace, name), obj in list(self.objects.items()):
            if obj.deleted:
                continue
            refs = obj.raw.get("metadata", {}).get("ownerReferences") or []
            if any(ref.get("uid") == owner_uid for ref in refs):
                await self._delete(Target(res, namespace, name, None))


class EmulatorThread:
    """Runs an `Emulator` on 127.0.0.1 (free port) in a daemon thread with its own event loop."""

    def __init__(self) -> None:
        self.emulator: Emulator | None = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)

    def __enter__(self) -> "EmulatorThread":
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the emulator did not start in 30 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # surfaced to the test thread by __enter__
            self._error = e
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with Emulator() as emulator, kmock.Server(emulator, host="127.0.0.1") as server:
            self.emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()
            await emulator.close_watches()

    def call(self, fn: Callable[["Emulator"], T]) -> T:
        """Run `fn(emulator)` on the emulator's own event loop (between requests) and return its result."""
        assert self._loop is not None and self.emulator is not None
        emulator = self.emulator

        async def run() -> T:
            return fn(emulator)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(300)

    def hold(self, method: str, path_pattern: str) -> Gate:
        """Pause the next request matching `method` and `path_pattern` until `gate.release()`."""
        assert self.emulator is not None
        gate = Gate(method, re.compile(path_pattern))
        self.emulator.gates.append(gate)
        return gate

    def requests_since(self, mark: int, method: str, path_pattern: str) -> list[str]:
        """Paths of the requests with `method` matching `path_pattern` received after `mark` requests."""
        assert self.emulator is not None
        pattern = re.compile(path_pattern)
        return [p for m, p, _ in self.emulator.journal[mark:] if m == method and pattern.search(p)]

    def mark(self) -> int:
        assert self.emulator is not None
        return len(self.emulator.journal)

    def kubeconfig(self, namespace: str = "default") -> str:
        return yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": namespace}}],
        })
