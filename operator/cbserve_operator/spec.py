"""The CBDeployment spec as typed values: defaults applied, every rule the CRD states re-checked.

The API server applies the CRD's defaults and schema, but CEL rules are not enforced everywhere
(and the operator must never crash on what it reads), so `parse_spec` re-checks them and reports
every problem at once in a `SpecError`. The defaults here equal the CRD's (a test checks it).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from . import engine_fields, naming

# what the GPU engine runs (the CRD's spec-level CEL rules say the same, with the same messages)
GPU_BLOCK_MULTIPLE = 256
# A pod's GPUs are one tensor-parallel group: 0 (the CPU engine) or a power of two, as vLLM's and
# KServe's deployments use them; the CRD's maximum is the last.
GPU_COUNTS = (0, 1, 2, 4, 8, 16)
MAX_NODES = 64  # pods of one multi-node group (a LeaderWorkerSet's size); a bound, not a tested scale
# With nodes > 1 the LeaderWorkerSet is <name>-group; its worker StatefulSets <name>-group-<g> and
# their pods' controller-revision-hash label (<statefulset>-<10 characters>) must stay within 63.
MAX_GROUP_NAME = 40
METRICS = ("queue-depth", "kv-cache-usage")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
DEFAULT_TARGETS = {"queue-depth": 5.0, "kv-cache-usage": 0.8}
PROBE_FIELDS = ("initialDelaySeconds", "periodSeconds", "timeoutSeconds", "failureThreshold", "successThreshold")
# the name docs/kubernetes.md's build step gives the engine image (no public registry holds cbserve's images)
DEFAULT_IMAGE = "localhost/cbserve:0.1.0"

_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>/[^\s]*)?$")
_HF_SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_HF = re.compile(rf"^hf://(?P<repo>{_HF_SEGMENT}/{_HF_SEGMENT})(@(?P<revision>{_HF_SEGMENT}(/{_HF_SEGMENT})*))?$")
_LOCAL = re.compile(r"^/[^\s]*$")
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$")
_QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_INTERVAL = re.compile(r"^\d+[smh]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")  # Secret, claim, RuntimeClass names
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_PARALLEL_FLAG = re.compile(rf"^({'|'.join(naming.PARALLEL_FLAGS)})(=|$)")


class SpecError(ValueError):
    """The spec breaks one or more rules; `problems` lists each, field path first."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class ModelCache:
    """hf:// models downloaded once, by a Job, into a volume the pods mount read-only (model_cache.py)."""

    enabled: bool = False
    size: str = "50Gi"  # the claim the operator creates
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteOnce"
    claim_name: str | None = None  # an existing claim instead
    hf_token_secret: tuple[str, str] | None = None  # (Secret name, key): the Job's HF_TOKEN


@dataclass(frozen=True)
class ModelSource:
    """Where the weights come from. `arg` is what `cbserve serve --model` receives."""

    uri: str
    scheme: str  # "local" | "pvc" | "hf"
    arg: str
    claim: str | None = None
    revision: str | None = None  # hf:// only: what follows '@'
    cache: ModelCache = field(default_factory=ModelCache)
    num_key_value_heads: int | None = None  # stated by the user: the tensor-parallel size must divide it


@dataclass(frozen=True)
class Resources:
    gpu: int = 0  # per pod: with more than 1, the pod's tensor-parallel size
    gpu_resource_name: str = "nvidia.com/gpu"
    nodes: int = 1  # pods per replica: above 1, a LeaderWorkerSet group of this size (group.py)
    cpu: str | None = None
    memory: str | None = None
    cache_size: str = "2Gi"  # the /cache emptyDir's limit, requested as ephemeral storage
    shm_size: str = "1Gi"  # GPU pods' in-memory /dev/shm


@dataclass(frozen=True)
class Engine:
    """The setting fields the spec gives, by their engine YAML keys (engine_fields.py); the rest is
    left to the server's defaults."""

    settings: dict[str, Any] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Autoscaling:
    enabled: bool = False
    keda: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    metric: str = "queue-depth"
    target: float = 5.0
    scale_down_delay_seconds: int = 300
    prometheus_address: str = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True)
class Service:
    type: str = "ClusterIP"
    port: int = 8000
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PodTemplate:
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    affinity: dict[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None
    runtime_class_name: str | None = None
    topology_spread_constraints: list[dict[str, Any]] = field(default_factory=list)
    service_account_name: str | None = None
    image_pull_secrets: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)
    volumes: list[dict[str, Any]] = field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    termination_grace_period_seconds: int = 120


@dataclass(frozen=True)
class Rollout:
    """How pods are replaced when the spec changes."""

    strategy: str = "RollingUpdate"  # or "Recreate"
    max_surge: int | str = 1
    max_unavailable: int | str = 0


@dataclass(frozen=True)
class Pdb:
    enabled: bool = False
    min_available: int | str | None = None
    max_unavailable: int | str | None = None


@dataclass(frozen=True)
class ServiceMonitor:
    enabled: bool = False
    interval: str = "30s"
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class InferencePool:
    """An InferencePool (Gateway API Inference Extension) over the server pods, routed by the named
    endpoint picker's Service."""
    enabled: bool = False
    picker_name: str = ""
    picker_port: int = 9002
    failure_mode: str = "FailClose"


@dataclass(frozen=True)
class CBDeploymentSpec:
    name: str
    model: ModelSource
    served_name: str
    image: str
    image_pull_policy: str = "IfNotPresent"
    replicas: int = 1
    resources: Resources = field(default_factory=Resources)
    engine: Engine = field(default_factory=Engine)
    autoscaling: Autoscaling = field(default_factory=Autoscaling)
    service: Service = field(default_factory=Service)
    probes: dict[str, dict[str, int]] = field(default_factory=dict)
    pod_template: PodTemplate = field(default_factory=PodTemplate)
    pdb: Pdb = field(default_factory=Pdb)
    rollout: Rollout = field(default_factory=Rollout)
    service_monitor: ServiceMonitor = field(default_factory=ServiceMonitor)
    inference_pool: InferencePool = field(default_factory=InferencePool)
    api_key_secret: tuple[str, str] | None = None  # (Secret name, key): the servers' CBSERVE_API_KEY
    warnings: tuple[str, ...] = ()  # deprecated spellings used: the spec is valid, the user is told

    @property
    def multi_node(self) -> bool:
        """Each replica is a group of `resources.nodes` pods (a LeaderWorkerSet), not one pod."""
        return self.resources.nodes > 1

    @property
    def world_size(self) -> int:
        """The tensor-parallel size: every GPU of a replica, across its pods (1 on the CPU)."""
        return max(self.resources.gpu, 1) * self.resources.nodes


def parse_model_uri(uri: Any) -> ModelSource:
    """Split a model URI into how the pod gets it; ValueError explains a bad one."""
    if not isinstance(uri, str) or not uri:
        raise ValueError("model.uri is required: /path, pvc://claim/path or hf://org/name[@revision]")
    if m := _PVC.match(uri):
        claim, path = m["claim"], (m["path"] or "/").rstrip("/")
        return ModelSource(uri, "pvc", f"/models/{claim}{path}", claim)
    if m := _HF.match(uri):
        return ModelSource(uri, "hf", uri, revision=m["revision"])
    if _LOCAL.match(uri):
        return ModelSource(uri, "local", uri)
    raise ValueError(
        f"model.uri {uri!r} is not /absolute/path, pvc://claim/path (claim a DNS label) or hf://org/name[@revision]"
    )


ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany")


RWO_MANY_PODS = ("model.cache with more than one pod (replicas > 1, or autoscaling up to more) needs "
                 "model.cache.accessMode set: ReadWriteMany (a storage class that offers it: EFS, Filestore, Azure "
                 "Files, CephFS, NFS) for pods on any node, or ReadWriteOnce to keep every pod on the one node the "
                 "volume attaches to (EBS, PD and Azure Disk attach to one node; a pod elsewhere would hang in "
                 "ContainerCreating)")
RWO_GROUP = ("model.cache with resources.nodes > 1 needs model.cache.accessMode: ReadWriteMany: a group's pods run "
             "on several nodes, and a ReadWriteOnce volume attaches to one")


def many_pods(replicas: int, autoscaling: "Autoscaling") -> bool:
    """Whether the Deployment may run more than one pod."""
    return replicas > 1 or (autoscaling.enabled and autoscaling.max_replicas > 1)


def _check_cache_access(r: "_Reader", data: dict[str, Any], cache: ModelCache, replicas: int,
                        autoscaling: "Autoscaling", nodes: int) -> None:  # fmt: skip
    """A claim the operator creates for pods on several nodes: ReadWriteMany, or ReadWriteOnce by choice."""
    if not cache.enabled or cache.claim_name is not None:
        return  # an existing claim's access mode is its owner's business
    if nodes > 1:
        r.check(cache.access_mode == "ReadWriteMany", RWO_GROUP)
    else:
        r.check("accessMode" in data or not many_pods(replicas, autoscaling), RWO_MANY_PODS)


def _parse_cache(r: "_Reader", data: dict[str, Any], model: ModelSource | None) -> ModelCache:
    """model.cache: the rules the CRD states on `spec.model`, again (an old object, no CEL)."""
    claim_name = r.get(data, "model.cache.claimName", (str,))
    cache = ModelCache(
        enabled=r.get(data, "model.cache.enabled", (bool,), False),
        size=_size(r, data, "model.cache.size") or ModelCache.size,
        storage_class_name=r.get(data, "model.cache.storageClassName", (str,)),
        access_mode=r.get(data, "model.cache.accessMode", (str,), ModelCache.access_mode),
        claim_name=claim_name,
        hf_token_secret=_secret_ref(r, data, "model.cache.hfTokenSecret", "token"),
    )
    r.check(cache.access_mode in ACCESS_MODES, f"model.cache.accessMode must be one of {ACCESS_MODES} (the Job writes "
            f"and the pods read the same claim), got {cache.access_mode!r}")
    r.check(claim_name is None or (bool(_DNS1123_SUBDOMAIN.match(claim_name)) and len(claim_name) <= 253),
            f"model.cache.claimName must name a PersistentVolumeClaim (a DNS subdomain), got {claim_name!r}")
    r.check(claim_name is None or not {"size", "storageClassName", "accessMode"} & set(data),
            "model.cache.claimName names an existing claim: size, storageClassName and accessMode are for the "
            "claim the operator creates")
    if cache.enabled and model is not None:
        r.check(model.scheme == "hf", "model.cache is for hf:// models (a pvc:// or local model is on a volume already)")
        r.check(model.scheme != "hf" or model.revision is not None,
                f"model.cache needs a pinned model.uri, hf://org/name@revision (a commit id, tag or branch), got "
                f"{model.uri!r}: the Job downloads that revision once and every replica loads the same files")
    return cache


class _Reader:
    """Reads typed fields out of nested dicts, collecting problems instead of stopping at the first."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def section(self, data: dict[str, Any], key: str) -> dict[str, Any]:
        value = data.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.problems.append(f"{key} must be an object, got {type(value).__name__}")
            return {}
        return value

    def get(self, data: dict[str, Any], path: str, kinds: tuple[type, ...], default: Any = None) -> Any:
        value = data.get(path.rsplit(".", 1)[-1], default)
        if value is None:
            return default
        if isinstance(value, bool) and bool not in kinds:
            self.problems.append(f"{path} must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
            return default
        if not isinstance(value, kinds):
            self.problems.append(f"{path} must be {'/'.join(k.__name__ for k in kinds)}, got {value!r}")
            return default
        return value

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.problems.append(message)


_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_RESOURCE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[a-z0-9]([-a-z0-9_.]*[a-z0-9])?$")
_COUNT_OR_PERCENT = "an integer >= 0 or a percentage like 50%"
# the operator's own volumes and mount paths in the server pod (workload.py)
RESERVED_VOLUMES = ("config", "cache", "tmp", "dshm", "model")
RESERVED_MOUNTS = ("/dev/shm", "/etc/cbserve", "/cache", "/tmp")
MAX_POD_LIST_ITEMS = 64  # the CRD's maxItems of podTemplate.volumes and volumeMounts (bounds its CEL rules' cost)


def parse_spec(name: str, spec: Any, default_image: str = DEFAULT_IMAGE) -> CBDeploymentSpec:
    """Validate and type a CBDeployment's spec; raise SpecError listing every problem. Besides the
    CRD's rules (checked again: a cluster without CEL, or an object older than a rule), the ones the
    API server would apply to the children, so that a spec is refused rather than its children."""
    r = _Reader()
    if not isinstance(spec, dict):
        raise SpecError(["spec must be an object"])
    r.check(bool(_DNS1035.match(name)) and len(name) <= 63,
            f"metadata.name {name!r} must be a DNS-1035 label of at most 63 characters (lower case letters, digits "
            "and '-', starting with a letter): it names the Service and labels the pods")

    model_data = r.section(spec, "model")
    model: ModelSource | None = None
    try:
        model = parse_model_uri(model_data.get("uri"))
    except ValueError as e:
        r.problems.append(str(e))
    cache = _parse_cache(r, r.section(model_data, "cache"), model)
    heads = r.get(model_data, "model.numKeyValueHeads", (int,))
    r.check(heads is None or heads >= 1, f"model.numKeyValueHeads must be >= 1, got {heads}")
    if model is not None:
        model = dataclasses.replace(model, cache=cache, num_key_value_heads=heads)
    served_name = r.get(model_data, "model.servedName", (str,), name)
    r.check(bool(_SERVED_NAME.match(served_name)), f"model.servedName {served_name!r} has characters a model name cannot")

    image = r.get(spec, "image", (str,), default_image) or default_image
    pull = r.get(spec, "imagePullPolicy", (str,), "IfNotPresent")
    r.check(pull in PULL_POLICIES, f"imagePullPolicy must be one of {PULL_POLICIES}, got {pull!r}")
    replicas = r.get(spec, "replicas", (int,), 1)
    r.check(replicas >= 0, f"replicas must be >= 0, got {replicas}")

    res = r.section(spec, "resources")
    resources = Resources(
        gpu=r.get(res, "resources.gpu", (int,), 0),
        gpu_resource_name=r.get(res, "resources.gpuResourceName", (str,), "nvidia.com/gpu"),
        cpu=_quantity(r, res, "resources.cpu"),
        memory=_quantity(r, res, "resources.memory"),
        # what /cache holds: an hf:// model the pod downloads itself, else compiled kernels and the like
        cache_size=_size(r, res, "resources.cacheSize") or ("50Gi" if model and model.scheme == "hf"
                                                            and not cache.enabled else "2Gi"),
        shm_size=_size(r, res, "resources.shmSize") or "1Gi",
        nodes=r.get(res, "resources.nodes", (int,), 1),
    )
    r.check(bool(_RESOURCE_NAME.match(resources.gpu_resource_name)) and len(resources.gpu_resource_name) <= 253,
            f"resources.gpuResourceName must be an extended resource name such as nvidia.com/gpu, "
            f"got {resources.gpu_resource_name!r}")
    r.check("kubernetes.io/" not in resources.gpu_resource_name and not resources.gpu_resource_name.startswith("requests."),
            "resources.gpuResourceName must be an extended resource name: the API server keeps names in the "
            "kubernetes.io domains and those starting with requests. for its own")

    warnings: list[str] = []
    engine = _parse_engine(r, r.section(spec, "engine"), warnings)
    _check_gpu_engine(r, resources.gpu, engine)
    _check_parallel(r, name, resources, heads)
    autoscaling = _parse_autoscaling(r, r.section(spec, "autoscaling"))
    cache_data: dict[str, Any] = model_data["cache"] if isinstance(model_data.get("cache"), dict) else {}
    _check_cache_access(r, cache_data, cache, replicas, autoscaling, resources.nodes)

    svc = r.section(spec, "service")
    service = Service(
        type=r.get(svc, "service.type", (str,), "ClusterIP"),
        port=r.get(svc, "service.port", (int,), 8000),
        annotations=dict(r.get(svc, "service.annotations", (dict,), {})),
    )
    r.check(service.type in SERVICE_TYPES, f"service.type must be one of {SERVICE_TYPES}, got {service.type!r}")
    r.check(1 <= service.port <= 65535, f"service.port must be in [1, 65535], got {service.port}")

    probes: dict[str, dict[str, int]] = {}
    probe_data = r.section(spec, "probes")
    for kind in ("startup", "readiness", "liveness"):
        overrides = r.get(probe_data, f"probes.{kind}", (dict,), {})
        for key, value in overrides.items():
            r.check(key in PROBE_FIELDS, f"probes.{kind}.{key} is not one of {PROBE_FIELDS}")
            r.check(isinstance(value, int) and not isinstance(value, bool) and value >= 0,
                    f"probes.{kind}.{key} must be a non-negative integer, got {value!r}")
        probes[kind] = {k: v for k, v in overrides.items() if k in PROBE_FIELDS}
        if kind in ("startup", "liveness"):
            r.check(overrides.get("successThreshold", 1) == 1,
                    f"probes.{kind}.successThreshold must be 1 (the API server allows no other)")

    pod_template = _parse_pod_template(r, r.section(spec, "podTemplate"))

    pdb_data = r.section(spec, "pdb")
    pdb = Pdb(
        enabled=r.get(pdb_data, "pdb.enabled", (bool,), False),
        min_available=r.get(pdb_data, "pdb.minAvailable", (int, str)),
        max_unavailable=r.get(pdb_data, "pdb.maxUnavailable", (int, str)),
    )
    r.check(pdb.min_available is None or pdb.max_unavailable is None,
            "set pdb.minAvailable or pdb.maxUnavailable, not both")
    for key, value in (("minAvailable", pdb.min_available), ("maxUnavailable", pdb.max_unavailable)):
        r.check(value is None or (isinstance(value, int) and value >= 0)
                or (isinstance(value, str) and bool(_PERCENT.match(value))),
                f"pdb.{key} must be {_COUNT_OR_PERCENT}, got {value!r}")

    rollout = _parse_rollout(r, r.section(spec, "rollout"),
                             no_spare=resources.gpu > 0 and (replicas > 1 or resources.nodes > 1))

    sm = r.section(spec, "serviceMonitor")
    service_monitor = ServiceMonitor(
        enabled=r.get(sm, "serviceMonitor.enabled", (bool,), False),
        interval=r.get(sm, "serviceMonitor.interval", (str,), "30s"),
        labels=dict(r.get(sm, "serviceMonitor.labels", (dict,), {})),
    )
    r.check(bool(_INTERVAL.match(service_monitor.interval)),
            f"serviceMonitor.interval must look like 30s, 1m or 1h, got {service_monitor.interval!r}")

    pool = r.section(r.section(spec, "routing"), "inferencePool")
    picker = r.section(pool, "endpointPicker")
    inference_pool = InferencePool(
        enabled=r.get(pool, "routing.inferencePool.enabled", (bool,), False),
        picker_name=r.get(picker, "routing.inferencePool.endpointPicker.name", (str,), ""),
        picker_port=r.get(picker, "routing.inferencePool.endpointPicker.port", (int,), 9002),
        failure_mode=r.get(picker, "routing.inferencePool.endpointPicker.failureMode", (str,), "FailClose"),
    )
    r.check(not inference_pool.enabled or bool(inference_pool.picker_name),
            "routing.inferencePool.endpointPicker.name is required when routing.inferencePool.enabled is true")
    r.check(1 <= inference_pool.picker_port <= 65535,
            f"routing.inferencePool.endpointPicker.port must be 1..65535, got {inference_pool.picker_port}")
    r.check(inference_pool.failure_mode in ("FailOpen", "FailClose"),
            f"routing.inferencePool.endpointPicker.failureMode must be FailOpen or FailClose, "
            f"got {inference_pool.failure_mode!r}")

    api_key_secret = _secret_ref(r, spec, "apiKeySecret", "api-key")

    if r.problems or model is None:
        raise SpecError(r.problems)

    return CBDeploymentSpec(
        name=name, model=model, served_name=served_name, image=image, image_pull_policy=pull,
        replicas=replicas, resources=resources, engine=engine, autoscaling=autoscaling,
        service=service, probes=probes, pod_template=pod_template, pdb=pdb, rollout=rollout,
        service_monitor=service_monitor, inference_pool=inference_pool, api_key_secret=api_key_secret, warnings=tuple(warnings),
    )


def _secret_ref(r: _Reader, data: dict[str, Any], path: str, default_key: str) -> tuple[str, str] | None:
    """{name, key} of a Secret's data key, as (name, key); None when `path` is absent."""
    field_name = path.rsplit(".", 1)[-1]
    if field_name not in data:
        return None
    secret = r.section(data, field_name)
    secret_name = r.get(secret, f"{path}.name", (str,), "")
    secret_key = r.get(secret, f"{path}.key", (str,), default_key)
    r.check(bool(_DNS1123_SUBDOMAIN.match(secret_name)) and len(secret_name) <= 253,
            f"{path}.name must name a Secret (a DNS subdomain), got {secret_name!r}")
    r.check(bool(_SECRET_KEY.match(secret_key)) and len(secret_key) <= 253,
            f"{path}.key must be a Secret data key, got {secret_key!r}")
    return secret_name, secret_key


def _quantity(r: _Reader, data: dict[str, Any], path: str) -> str | None:
    value = r.get(data, path, (int, float, str))
    if value is None:
        return None
    r.check(bool(_QUANTITY.match(str(value))), f"{path} {value!r} is not a Kubernetes quantity (e.g. 4, 500m, 16Gi)")
    return str(value)


_SIZE = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def _size(r: _Reader, data: dict[str, Any], path: str) -> str | None:
    """A storage size: a quantity in bytes with a binary or decimal suffix (e.g. 20Gi, 500M)."""
    value = r.get(data, path, (int, str))
    if value is None:
        return None
    r.check(bool(_SIZE.match(str(value))), f"{path} {value!r} is not a size such as 20Gi or 500M")
    return str(value)


def _parse_engine(r: _Reader, e: dict[str, Any], warnings: list[str]) -> Engine:
    """Each field by its rule from the settings table (engine_fields.py); an older spelling is taken
    with a warning, both spellings at once is a problem. use_cuda_graph's halves become its pair."""
    settings: dict[str, Any] = {}
    graph_parts: list[Any] = [None, None]
    for f in engine_fields.FIELDS:
        given = [name for name in (f["crd"], *f["deprecated"]) if e.get(name) is not None]
        if not given:
            continue
        warnings += [f"engine.{old} is deprecated: use engine.{f['crd']}" for old in given if old != f["crd"]]
        if len(given) > 1:
            r.problems.append(f"engine.{given[0]} and engine.{given[1]} are the same setting: give one")
            continue
        try:
            value = engine_fields.check_value(f["rule"], f"engine.{given[0]}", e[given[0]])
        except ValueError as exc:
            r.problems.append(str(exc))
            continue
        if "part" in f:
            graph_parts[f["part"]] = value
        else:
            settings[f["key"]] = value
    if graph_parts != [None, None]:  # a half given: the pair, the other half from useCudaGraph
        base = bool(settings.get("use_cuda_graph"))
        settings["use_cuda_graph"] = [base if part is None else part for part in graph_parts]
    extra_args = r.get(e, "engine.extraArgs", (list,), [])
    r.check(all(isinstance(a, str) for a in extra_args), "engine.extraArgs must be a list of strings")
    taken = [a for a in extra_args if isinstance(a, str) and _PARALLEL_FLAG.match(a)]
    r.check(not taken, f"engine.extraArgs cannot set {', '.join(naming.PARALLEL_FLAGS[:-1])} or "
                       f"{naming.PARALLEL_FLAGS[-1]}: the operator sets them from resources.gpu and resources.nodes, "
                       f"got {', '.join(taken)}")
    return Engine(settings=settings, extra_args=tuple(extra_args))


def _check_parallel(r: _Reader, name: str, res: Resources, heads: int | None) -> None:
    """The tensor-parallel layout, refused as the CRD's CEL rules refuse it (same messages)."""
    r.check(res.gpu in GPU_COUNTS, "resources.gpu must be 0, 1, 2, 4, 8 or 16: the GPUs of a pod form one "
                                   f"tensor-parallel group, whose size is a power of two, got {res.gpu}")
    r.check(1 <= res.nodes <= MAX_NODES, f"resources.nodes must be in [1, {MAX_NODES}], got {res.nodes}")
    r.check(res.nodes <= 1 or res.gpu >= 1,
            "resources.nodes above 1 needs resources.gpu >= 1: a multi-node group runs the CUDA engine "
            f"(torch.distributed over NCCL), the CPU engine one pod, got {res.nodes} nodes without a GPU")
    world = max(res.gpu, 1) * max(res.nodes, 1)
    r.check(heads is None or heads < 1 or heads % world == 0,
            "model.numKeyValueHeads must be divisible by the tensor-parallel size, resources.gpu x "
            f"resources.nodes: each GPU holds whole KV heads, got {heads} heads for {world} GPUs")
    r.check(res.nodes <= 1 or len(name) <= MAX_GROUP_NAME,
            f"metadata.name must be at most {MAX_GROUP_NAME} characters when resources.nodes > 1: the "
            "LeaderWorkerSet <name>-group names StatefulSets and pods that add -<group>-<worker> and a "
            f"revision hash within Kubernetes' 63-character limit, got {len(name)}")


def _check_gpu_engine(r: _Reader, gpu: int, engine: Engine) -> None:
    """What the GPU engine cannot run, refused as the CRD's CEL rules refuse it (same messages)."""
    if gpu <= 0:
        return
    block = engine.settings.get("block_size")
    r.check(block is None or block % GPU_BLOCK_MULTIPLE == 0,
            f"engine.blockSize must be a multiple of 256 when resources.gpu > 0: flash-attn's paged kernels "
            f"take blocks of 256 tokens, got {block}")
    r.check(engine.settings.get("dtype") != "float32",
            "engine.dtype float32 is refused when resources.gpu > 0: flash-attn runs float16 and bfloat16 "
            "only (auto picks bfloat16, or float16 where the GPU has no bfloat16)")


def _parse_autoscaling(r: _Reader, a: dict[str, Any]) -> Autoscaling:
    metric = r.get(a, "autoscaling.metric", (str,), "queue-depth")
    r.check(metric in METRICS, f"autoscaling.metric must be one of {METRICS}, got {metric!r}")
    auto = Autoscaling(
        enabled=r.get(a, "autoscaling.enabled", (bool,), False),
        keda=r.get(a, "autoscaling.keda", (bool,), False),
        min_replicas=r.get(a, "autoscaling.minReplicas", (int,), 1),
        max_replicas=r.get(a, "autoscaling.maxReplicas", (int,), 4),
        metric=metric,
        target=float(r.get(a, "autoscaling.target", (int, float), DEFAULT_TARGETS.get(metric, 5.0))),
        scale_down_delay_seconds=r.get(a, "autoscaling.scaleDownDelaySeconds", (int,), 300),
        prometheus_address=r.get(a, "autoscaling.prometheusAddress", (str,), Autoscaling.prometheus_address),
    )
    r.check(auto.min_replicas >= 1, f"autoscaling.minReplicas must be >= 1, got {auto.min_replicas}: scale to zero "
            "is not offered (the metrics that would wake a pod come from the pods, so at zero pods nothing would "
            "ever start one again)")
    r.check(auto.max_replicas >= 1, f"autoscaling.maxReplicas must be >= 1, got {auto.max_replicas}")
    r.check(auto.min_replicas <= auto.max_replicas,
            f"autoscaling.minReplicas ({auto.min_replicas}) must not exceed autoscaling.maxReplicas ({auto.max_replicas})")
    r.check(auto.target > 0, f"autoscaling.target must be > 0, got {auto.target}")
    r.check(0 <= auto.scale_down_delay_seconds <= 3600,
            f"autoscaling.scaleDownDelaySeconds must be in [0, 3600], got {auto.scale_down_delay_seconds}")
    return auto


_PERCENT = re.compile(r"^(100|[1-9]?\d)%$")
ROLLOUT_STRATEGIES = ("RollingUpdate", "Recreate")


def _parse_rollout(r: _Reader, data: dict[str, Any], no_spare: bool) -> Rollout:
    """RollingUpdate by default. A new pod loads its model before an old one leaves (maxSurge 1,
    maxUnavailable 0), so one replica keeps serving through a rollout; on a GPU that surge pod needs
    a spare GPU, and without one it waits Pending while the old pod serves. `no_spare`: GPU pods of
    more than one replica, or groups: one down at a time and none extra (maxSurge 0, maxUnavailable
    1), since the others serve meanwhile and a full GPU pool has no room for a surge pod or group.
    An unset maxUnavailable is 1 when maxSurge is 0, else 0."""
    strategy = r.get(data, "rollout.strategy", (str,), "RollingUpdate")
    r.check(strategy in ROLLOUT_STRATEGIES, f"rollout.strategy must be one of {ROLLOUT_STRATEGIES}, got {strategy!r}")
    surge = r.get(data, "rollout.maxSurge", (int, str), 0 if no_spare else 1)
    unavailable = r.get(data, "rollout.maxUnavailable", (int, str), 1 if surge in (0, "0%") else 0)
    for key, value in (("maxSurge", surge), ("maxUnavailable", unavailable)):
        r.check((isinstance(value, int) and value >= 0) or (isinstance(value, str) and bool(_PERCENT.match(value))),
                f"rollout.{key} must be an integer >= 0 or a percentage like 25%, got {value!r}")
    if strategy == "Recreate":
        r.check("maxSurge" not in data and "maxUnavailable" not in data,
                "rollout.maxSurge and rollout.maxUnavailable apply to RollingUpdate only, not Recreate")
    else:
        r.check(surge not in (0, "0%") or unavailable not in (0, "0%"),
                "rollout.maxSurge and rollout.maxUnavailable cannot both be 0: no pod could ever be replaced "
                "(unset, maxSurge is 0 for GPU pods of more than one replica or groups, else 1)")
    return Rollout(strategy, surge, unavailable)


def _parse_pod_template(r: _Reader, p: dict[str, Any]) -> PodTemplate:
    tpl = PodTemplate(
        labels=dict(r.get(p, "podTemplate.labels", (dict,), {})),
        annotations=dict(r.get(p, "podTemplate.annotations", (dict,), {})),
        node_selector=dict(r.get(p, "podTemplate.nodeSelector", (dict,), {})),
        tolerations=list(r.get(p, "podTemplate.tolerations", (list,), [])),
        affinity=dict(r.get(p, "podTemplate.affinity", (dict,), {})),
        priority_class_name=r.get(p, "podTemplate.priorityClassName", (str,)),
        runtime_class_name=r.get(p, "podTemplate.runtimeClassName", (str,)),
        topology_spread_constraints=list(r.get(p, "podTemplate.topologySpreadConstraints", (list,), [])),
        service_account_name=r.get(p, "podTemplate.serviceAccountName", (str,)),
        image_pull_secrets=list(r.get(p, "podTemplate.imagePullSecrets", (list,), [])),
        env=list(r.get(p, "podTemplate.env", (list,), [])),
        volumes=list(r.get(p, "podTemplate.volumes", (list,), [])),
        volume_mounts=list(r.get(p, "podTemplate.volumeMounts", (list,), [])),
        termination_grace_period_seconds=r.get(p, "podTemplate.terminationGracePeriodSeconds", (int,), 120),
    )
    for path, items in (("podTemplate.volumes", tpl.volumes), ("podTemplate.volumeMounts", tpl.volume_mounts)):
        r.check(len(items) <= MAX_POD_LIST_ITEMS, f"{path} may have at most {MAX_POD_LIST_ITEMS} items")
    for path, items in (("podTemplate.env", tpl.env), ("podTemplate.volumes", tpl.volumes),
                        ("podTemplate.volumeMounts", tpl.volume_mounts)):
        r.check(all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items),
                f"every item of {path} needs a name")
    r.check(tpl.runtime_class_name is None or (bool(_DNS1123_SUBDOMAIN.match(tpl.runtime_class_name))
                                               and len(tpl.runtime_class_name) <= 253),
            f"podTemplate.runtimeClassName must be a DNS-1123 subdomain, got {tpl.runtime_class_name!r}")
    for i, c in enumerate(tpl.topology_spread_constraints):
        where = f"podTemplate.topologySpreadConstraints[{i}]"
        r.check(isinstance(c, dict) and isinstance(c.get("maxSkew"), int) and not isinstance(c.get("maxSkew"), bool)
                and c["maxSkew"] >= 1 and isinstance(c.get("topologyKey"), str) and bool(c["topologyKey"])
                and c.get("whenUnsatisfiable") in ("DoNotSchedule", "ScheduleAnyway"),
                f"{where} needs maxSkew >= 1, a topologyKey and whenUnsatisfiable DoNotSchedule or ScheduleAnyway")
    taken = sorted({v["name"] for v in tpl.volumes if isinstance(v, dict)} & set(RESERVED_VOLUMES))
    r.check(not taken, f"podTemplate.volumes: {', '.join(RESERVED_VOLUMES)} are the operator's own volume names "
                       f"(got {', '.join(taken)})")
    paths = [m.get("mountPath") for m in tpl.volume_mounts if isinstance(m, dict)]
    clashes = [p for p in paths if isinstance(p, str) and (p in RESERVED_MOUNTS or p.startswith("/models/"))]
    r.check(not clashes, f"podTemplate.volumeMounts: {', '.join(RESERVED_MOUNTS)} and /models/ are the operator's "
                         f"own mount paths (got {', '.join(clashes)})")
    r.check(tpl.termination_grace_period_seconds > naming.PRE_STOP_SLEEP_SECONDS,
            f"podTemplate.terminationGracePeriodSeconds must be above the {naming.PRE_STOP_SLEEP_SECONDS} s preStop "
            f"sleep (the kubelet would kill the pod before it drains), got {tpl.termination_grace_period_seconds}")
    return tpl
