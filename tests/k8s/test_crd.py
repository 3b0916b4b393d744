"""The CRD's openAPIV3Schema as the API server would apply it (jsonschema; CEL checked by the operator)."""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonschema
import pytest
import yaml

from cbserve_operator import spec as spec_module
from cbserve_operator import status as status_module

from .conftest import CRD_FILE, REPO, Cluster

CRD = yaml.safe_load(CRD_FILE.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
# OpenAPI v3.0 schemas use draft-4 semantics (boolean exclusiveMinimum).
VALIDATOR = jsonschema.Draft4Validator(SCHEMA)


def errors(obj: dict[str, Any]) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(obj))


def minimal() -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / "cbdeployment.yaml").read_text())


@pytest.mark.parametrize("name", ["cbdeployment.yaml", "cbdeployment-hf.yaml", "cbdeployment-full.yaml", "cbdeployment-cpu.yaml"])
def test_examples_are_valid(name: str) -> None:
    assert errors(yaml.safe_load((REPO / "examples" / name).read_text())) == []


def _leaf_paths(node: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    props = node.get("properties")
    if not props or node.get("type", "object") != "object":
        return [path]
    return [leaf for key, child in props.items() for leaf in _leaf_paths(child, (*path, key))]


def test_the_full_example_names_every_field() -> None:
    """Every spec field but the older spellings is set in examples/cbdeployment-full.yaml, or, where it is
    an alternative to one that is set (claimName to size, minAvailable to maxUnavailable), commented out."""
    from engine.settings_table import crd_fields

    text = (REPO / "examples" / "cbdeployment-full.yaml").read_text()
    spec = yaml.safe_load(text)["spec"]
    commented = set(re.findall(r"#\s*([A-Za-z][A-Za-z0-9]*):", text))
    older = {old for f in crd_fields() for old in f["deprecated"]}
    missing = []
    for path in _leaf_paths(SCHEMA["properties"]["spec"]):
        if path[0] == "engine" and path[-1] in older:
            continue
        node: Any = spec
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None and path[-1] not in commented:
            missing.append(".".join(path))
    assert missing == []


@pytest.mark.parametrize(("path", "value", "where"), [
    (("engine", "blockSize"), 24, "spec.engine.blockSize"),
    (("engine", "blockSize"), 2048, "spec.engine.blockSize"),
    (("engine", "maxMemoryPercent"), 1.5, "spec.engine.maxMemoryPercent"),
    (("engine", "maxMemoryPercent"), 0, "spec.engine.maxMemoryPercent"),
    (("engine", "schedulerType"), "lifo", "spec.engine.schedulerType"),
    (("engine", "dtype"), "float8", "spec.engine.dtype"),
    (("model", "uri"), "s3://bucket/model", "spec.model.uri"),
    (("model", "uri"), "pvc://Bad_Claim/x", "spec.model.uri"),
    (("model", "uri"), "hf://just-a-name", "spec.model.uri"),
    (("replicas",), -1, "spec.replicas"),
    (("resources", "gpu"), "1", "spec.resources.gpu"),
    (("resources", "memory"), "lots", "spec.resources.memory"),
    (("autoscaling", "metric"), "cpu", "spec.autoscaling.metric"),
    (("service", "port"), 70000, "spec.service.port"),
])
def test_schema_rejects_bad_values(path: tuple[str, ...], value: Any, where: str) -> None:
    obj = minimal()
    node = obj["spec"]
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    found = errors(obj)
    assert found and all(e.startswith(where) for e in found), found


def test_missing_model_is_rejected() -> None:
    obj = minimal()
    del obj["spec"]["model"]
    assert errors(obj) == ["spec: 'model' is a required property"]


def test_min_above_max_replicas_is_a_cel_rule() -> None:
    """jsonschema cannot express it; the CRD carries the CEL rule and the operator enforces it too."""
    obj = minimal()
    obj["spec"]["autoscaling"] = {"enabled": True, "minReplicas": 5, "maxReplicas": 2}
    assert errors(obj) == []
    rules = SCHEMA["properties"]["spec"]["properties"]["autoscaling"]["x-kubernetes-validations"]
    assert {"rule": "self.minReplicas <= self.maxReplicas",
            "message": "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"} in rules
    with pytest.raises(spec_module.SpecError, match=r"minReplicas \(5\) must not exceed"):
        spec_module.parse_spec("x", obj["spec"])


def test_names_columns_and_subresources() -> None:
    names = CRD["spec"]["names"]
    assert CRD["metadata"]["name"] == "cbdeployments.cbserve.io" and VERSION["name"] == "v1alpha1"
    assert names["shortNames"] == ["cbd"] and "all" in names["categories"]
    columns = {c["name"]: c for c in VERSION["additionalPrinterColumns"]}
    assert list(columns) == ["Model", "Replicas", "Ready", "Phase", "Reason", "Age", "URL", "Message"]
    assert columns["URL"]["priority"] == 1 and columns["Phase"]["jsonPath"] == ".status.phase"
    assert columns["Reason"]["jsonPath"] == ".status.reason" and columns["Message"]["priority"] == 1
    assert VERSION["subresources"]["status"] == {}
    assert VERSION["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}


def test_status_schema_keeps_what_the_operator_writes() -> None:
    status = SCHEMA["properties"]["status"]["properties"]
    assert status["phase"]["enum"] == ["Pending", "Progressing", "Ready", "Degraded", "Failed"]
    assert set(status) >= {"phase", "replicas", "readyReplicas", "selector", "url", "observedGeneration",
                           "conditions", "configHash", "updatedReplicas", "rolledBack"}
    cond = status["conditions"]["items"]["properties"]
    assert tuple(cond["type"]["enum"]) == status_module.CONDITION_TYPES  # every condition the operator writes
    assert {"observedGeneration", "reason", "message", "lastTransitionTime"} <= set(cond)


def _schema_defaults(schema: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, sub in (schema.get("properties") or {}).items():
        if "default" in sub and sub["default"] != {}:
            out[prefix + key] = sub["default"]
        out.update(_schema_defaults(sub, f"{prefix}{key}."))
    return out


def test_operator_defaults_equal_the_crd_defaults() -> None:
    """An API server without defaulting (or an old object) must behave exactly like a defaulted one."""
    crd_defaults = _schema_defaults(SCHEMA["properties"]["spec"])
    sparse = spec_module.parse_spec("m", {"model": {"uri": "/models/m"}})
    defaulted_spec: dict[str, Any] = {"model": {"uri": "/models/m"}}
    for path, value in crd_defaults.items():
        node = defaulted_spec
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = copy.deepcopy(value)
    assert spec_module.parse_spec("m", defaulted_spec) == sparse
    assert len(crd_defaults) >= 15
    # engine settings have one default, the server's: a field left out is left out of the engine YAML
    assert not [path for path in crd_defaults if path.startswith("engine.")]


def _nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path, schema)]
    for key, sub in (schema.get("properties") or {}).items():
        out += _nodes(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        out += _nodes(schema["items"], f"{path}[]")
    return out


def test_schema_is_structural_and_defaults_are_valid() -> None:
    """What the API server demands of a CRD schema, checked offline: a real cluster refuses otherwise."""
    for path, node in _nodes(SCHEMA):
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], path
        else:
            assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        if "default" in node:
            jsonschema.Draft4Validator(node).validate(node["default"])
        if node.get("x-kubernetes-list-type") == "map":
            assert set(node["x-kubernetes-list-map-keys"]) <= set(node["items"]["required"]), path
        for rule in node.get("x-kubernetes-validations", []):
            assert rule["rule"] and rule["message"], path


def test_the_docs_field_table_is_the_crds() -> None:
    """docs/kubernetes.md's table of every field and its validation is generated from the CRD."""
    import subprocess
    import sys

    check = subprocess.run([sys.executable, str(REPO / "scripts" / "crd_fields.py"), "--check"],
                           capture_output=True, text=True)  # fmt: skip
    assert check.returncode == 0, check.stderr


def _properties(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found = []
    for key, sub in (node.get("properties") or {}).items():
        found += [(f"{path}.{key}", sub), *_properties(sub, f"{path}.{key}")]
    if isinstance(node.get("items"), dict):
        found += _properties(node["items"], f"{path}[]")
    return found


def test_every_property_has_a_description() -> None:
    """What `kubectl explain cbdeployment.spec...` prints for each field."""
    for version in CRD["spec"]["versions"]:
        properties = _properties(version["schema"]["openAPIV3Schema"])
        assert len(properties) > 130
        assert [p for p, sub in properties if not str(sub.get("description") or "").strip()] == []


def test_kubectl_explain_prints_the_descriptions(crd_cluster: Cluster) -> None:
    """`kubectl explain` reads the CRD's OpenAPI v3 from the API server (the emulator serves it)."""
    out = crd_cluster.kubectl("explain", "cbdeployment.spec.replicas").stdout
    assert "Server pods (with resources.nodes > 1, groups of pods)" in out
    out = crd_cluster.kubectl("explain", "cbd.spec.model.cache.accessMode").stdout
    assert "FIELD: accessMode" in out
    assert crd_cluster.kubectl("explain", "cbd.status.reason").stdout.count("While not Ready") == 1
