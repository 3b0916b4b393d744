"""The Helm chart with the real helm, kubectl and kubernetes-validate (Kubernetes 1.34 schemas, offline)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cbserve_operator.children import render_children
from cbserve_operator.model_cache import render_job
from cbserve_operator.spec import DEFAULT_IMAGE, parse_spec

from .conftest import CHART, CRD_FILE, INFERENCE_POOL_CRD_FILE, LWS_CRD_FILE, REPO, Cluster, Tools

CBD = "cbserve.io/v1alpha1"

KUBERNETES_VERSION = "1.34.0"
VALIDATE = [str(Path(sys.executable).parent / "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION]


def helm(tools: Tools, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(tools.helm), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def template(tools: Tools, *values: str) -> str:
    return helm(tools, "template", "cbserve", str(CHART), "--namespace", "cbserve-system", "--include-crds",
                *values).stdout


def validate(tmp_path: Path, documents: str) -> subprocess.CompletedProcess[str]:
    manifest = tmp_path / "manifest.yaml"
    manifest.write_text(documents)
    return subprocess.run([*VALIDATE, str(manifest)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("values", [[], ["--set", "example.enabled=true", "--set", "operator.watchNamespaces={ml,dev}"]])
def test_helm_lint_strict(tools: Tools, values: list[str]) -> None:
    out = helm(tools, "lint", "--strict", str(CHART), *values).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out


def test_rendered_chart_is_valid_for_kubernetes_1_34(tools: Tools, tmp_path: Path) -> None:
    rendered = template(tools, "--set", "example.enabled=true")
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["CBDeployment", "ClusterRole", "ClusterRole", "ClusterRole", "ClusterRoleBinding",
                     "CustomResourceDefinition", "CustomResourceDefinition", "CustomResourceDefinition",
                     "Deployment", "Pod", "ServiceAccount"]  # the Pod: helm test's
    builtin = "---\n".join(yaml.safe_dump(d) for d in docs if d["kind"] != "CBDeployment")
    proc = validate(tmp_path, builtin)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("passed for resource") == 10
    # The custom resource is checked against the CRD's own schema.
    (example,) = [d for d in docs if d["kind"] == "CBDeployment"]
    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(schema).validate(example)


def test_users_roles_aggregate_into_admin_edit_and_view(tools: Tools) -> None:
    """Namespace editors manage CBDeployments through the built-in roles (aggregation); viewers read
    them; `rbac.aggregate=false` leaves the built-in roles alone."""
    roles = {d["metadata"]["name"]: d for d in yaml.safe_load_all(template(tools)) if d and d["kind"] == "ClusterRole"}
    edit, view = roles["cbserve-operator-edit"], roles["cbserve-operator-view"]
    assert {k: v for k, v in edit["metadata"]["labels"].items() if k.startswith("rbac.")} == {
        "rbac.authorization.k8s.io/aggregate-to-admin": "true", "rbac.authorization.k8s.io/aggregate-to-edit": "true"}
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    edit_verbs = {(r, v) for rule in edit["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert {("cbdeployments", "create"), ("cbdeployments", "delete"), ("cbdeployments/scale", "update")} <= edit_verbs
    view_verbs = {v for rule in view["rules"] for v in rule["verbs"]}
    assert view_verbs == {"get", "list", "watch"}
    plain = [d for d in yaml.safe_load_all(template(tools, "--set", "rbac.aggregate=false")) if d and d["kind"] == "ClusterRole"]
    assert len(plain) == 1


def test_operator_deployment_runs_the_wrapper_hardened(tools: Tools) -> None:
    docs = [d for d in yaml.safe_load_all(template(tools, "--set", "operator.watchNamespaces={ml}")) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-m", "cbserve_operator"]
    assert container["args"][:3] == ["--standalone", "--namespace=ml", "--liveness=http://0.0.0.0:8080/healthz"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_default_server_image_is_the_operators_default(tools: Tools) -> None:
    """What the chart tells the operator to run when a CBDeployment names no image is the image the
    operator itself defaults to (tests/test_dockerfile.py checks that image's contract)."""
    docs = [d for d in yaml.safe_load_all(template(tools)) if d]
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CBSERVE_SERVER_IMAGE"] == DEFAULT_IMAGE


def test_values_schema_rejects_bad_values(tools: Tools) -> None:
    proc = helm(tools, "template", "x", str(CHART), "--set", "liveness.port=80", check=False)
    assert proc.returncode != 0 and "/liveness/port" in proc.stderr
    proc = helm(tools, "template", "x", str(CHART), "--set", "operator.watchNamespaces={Bad_NS}", check=False)
    assert proc.returncode != 0 and "watchNamespaces" in proc.stderr
    proc = helm(tools, "template", "x", str(CHART), "--set", "typo=1", check=False)
    assert proc.returncode != 0 and "typo" in proc.stderr
    proc = helm(tools, "template", "x", str(CHART), "--set", "resources.limits.memory=banana", check=False)
    assert proc.returncode != 0 and "/resources/limits/memory" in proc.stderr
    proc = helm(tools, "template", "x", str(CHART), "--set", "operator.extraArgs={--peering=x}", check=False)
    assert proc.returncode != 0 and "/operator/extraArgs/0" in proc.stderr  # the chart sets peering itself
    for good in ("resources.limits.memory=512Mi", "resources.requests.cpu=250m", "resources.requests.cpu=1",
                 "operator.extraArgs={--verbose}"):
        assert helm(tools, "template", "x", str(CHART), "--set", good, check=False).returncode == 0, good


def test_notes_tell_the_next_command(tools: Tools) -> None:
    out = helm(tools, "install", "--dry-run=client", "cbserve", str(CHART), "--namespace", "cbserve-system").stdout
    assert "kubectl get cbd -w" in out and "rollout status deployment/cbserve-operator" in out
    assert "--set test.cbdeployment=<name>" in out  # how to get a helm test
    named = helm(tools, "install", "--dry-run=client", "cbserve", str(CHART), "--namespace", "cbserve-system",
                 "--set", "example.enabled=true").stdout  # fmt: skip
    assert "helm test cbserve -n cbserve-system" in named


def test_operator_children_are_valid_for_kubernetes_1_34(tmp_path: Path) -> None:
    full = yaml.safe_load((REPO / "examples" / "cbdeployment-full.yaml").read_text())
    spec = parse_spec("llama-8b", full["spec"])
    objs, _ = render_children(spec, "default")
    (pool,) = [o for o in objs if o["kind"] == "InferencePool"]
    pool_schema = yaml.safe_load(INFERENCE_POOL_CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(pool_schema).validate(pool)  # the inference extension's published schema
    builtin = [o for o in objs if o["apiVersion"] not in ("monitoring.coreos.com/v1", "keda.sh/v1alpha1",
                                                          "inference.networking.k8s.io/v1")]
    builtin.append(render_job(spec))  # the model cache's download Job
    proc = validate(tmp_path, "---\n".join(yaml.safe_dump(o) for o in builtin))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = ["ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "HorizontalPodAutoscaler",
             "PodDisruptionBudget", "Job"]
    assert proc.stdout.count("passed for resource") == len(builtin) and [o["kind"] for o in builtin] == kinds


def test_a_groups_children_are_valid_for_kubernetes_1_34_and_leaderworkerset(tmp_path: Path) -> None:
    """resources.nodes > 1: the built-in children pass kubernetes-validate, the LeaderWorkerSet passes
    LWS's published schema, and its leader and worker pod templates pass as 1.34 PodTemplates."""
    full = yaml.safe_load((REPO / "examples" / "cbdeployment-full.yaml").read_text())
    full["spec"]["resources"].update(gpu=4, nodes=2)
    objs, _ = render_children(parse_spec("llama-8b", full["spec"]), "default")
    (group,) = [o for o in objs if o["kind"] == "LeaderWorkerSet"]
    lws_schema = yaml.safe_load(LWS_CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    jsonschema.Draft4Validator(lws_schema).validate(group)
    templates = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"llama-8b-{role}"},
                  "template": group["spec"]["leaderWorkerTemplate"][f"{role}Template"]} for role in ("leader", "worker")]
    builtin = [o for o in objs if o["apiVersion"] in ("v1", "autoscaling/v2", "policy/v1")] + templates
    proc = validate(tmp_path, "---\n".join(yaml.safe_dump(o) for o in builtin))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kinds = ["ConfigMap", "PersistentVolumeClaim", "Service", "Service", "HorizontalPodAutoscaler",
             "PodDisruptionBudget", "PodTemplate", "PodTemplate"]
    assert proc.stdout.count("passed for resource") == len(builtin) and [o["kind"] for o in builtin] == kinds


def test_helm_template_applies_to_the_cluster(tools: Tools, cluster: Cluster) -> None:
    rendered = template(tools)
    out = cluster.kubectl("apply", "--server-side", "--validate=false", "-f", "-", input=rendered).stdout
    for line in ("customresourcedefinition.apiextensions.k8s.io/cbdeployments.cbserve.io serverside-applied",
                 "serviceaccount/cbserve-operator serverside-applied",
                 "clusterrole.rbac.authorization.k8s.io/cbserve-operator serverside-applied",
                 "clusterrole.rbac.authorization.k8s.io/cbserve-operator-edit serverside-applied",
                 "clusterrole.rbac.authorization.k8s.io/cbserve-operator-view serverside-applied",
                 "clusterrolebinding.rbac.authorization.k8s.io/cbserve-operator serverside-applied",
                 "deployment.apps/cbserve-operator serverside-applied"):
        assert line in out
    dep: Any = cluster.get("apps/v1", "deployments", "cbserve-system", "cbserve-operator")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "cbserve-operator"
    # The CRD is served at once: the example applies and lists under its short name.
    cluster.kubectl("apply", "--validate=false", "-n", "cbserve-system", "-f", str(REPO / "examples" / "cbdeployment.yaml"))
    assert "smollm2" in cluster.kubectl("get", "cbd", "-n", "cbserve-system").stdout
    # Applying the same output again changes nothing.
    again = cluster.kubectl("apply", "--server-side", "--validate=false", "-f", "-", input=rendered).stdout
    assert again.count("serverside-applied") == 9
    assert cluster.get("apps/v1", "deployments", "cbserve-system", "cbserve-operator")["metadata"]["resourceVersion"] \
        == dep["metadata"]["resourceVersion"]


def test_a_crd_upgrade_keeps_the_new_fields_with_the_documented_step(cluster: Cluster) -> None:
    """Helm installs crds/ once and never upgrades them. With last release's CRD (here: today's
    without `spec.rollout`) the API server prunes the new field; after the documented step
    (`kubectl apply --server-side --force-conflicts -f charts/cbserve/crds/`) it stays."""
    old = yaml.safe_load(CRD_FILE.read_text())
    del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["rollout"]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--validate=false", "-f", "-", input=yaml.safe_dump(old))
    manifest = yaml.safe_load((REPO / "examples" / "cbdeployment.yaml").read_text())
    manifest["metadata"]["name"] = "upgrade"
    manifest["spec"]["rollout"] = {"strategy": "Recreate"}
    cluster.kubectl("apply", "--validate=false", "-n", "upgrade", "-f", "-", input=yaml.safe_dump(manifest))
    assert "rollout" not in cluster.get(CBD, "cbdeployments", "upgrade", "upgrade")["spec"]  # type: ignore[index]

    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--validate=false", "-f", str(CHART / "crds"))
    cluster.kubectl("apply", "--validate=false", "-n", "upgrade", "-f", "-", input=yaml.safe_dump(manifest))
    assert cluster.get(CBD, "cbdeployments", "upgrade", "upgrade")["spec"]["rollout"] == {"strategy": "Recreate"}  # type: ignore[index]


def _chat_test_pod(tools: Tools, *values: str) -> dict[str, Any] | None:
    docs = [d for d in yaml.safe_load_all(template(tools, *values)) if d]
    pods = [d for d in docs if d["kind"] == "Pod"]
    return pods[0] if pods else None


def test_helm_test_sends_a_chat_request_and_checks_the_answer(tools: Tools, tmp_path: Path) -> None:
    """`helm test`'s pod, as the chart renders it, run here against a real `cbserve serve` (a small test
    model) in place of the in-cluster Service: it passes on a chat completion with text in it."""
    from engine.testing import save_test_model
    from tests.server.conftest import Server

    assert _chat_test_pod(tools) is None  # no example, no target: no test
    pod = _chat_test_pod(tools, "--set", "example.enabled=true")
    assert pod is not None and pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["automountServiceAccountToken"] is False and pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env == {"CHAT_URL": "http://smollm2.cbserve-system.svc:8000/v1/chat/completions", "CHAT_MODEL": "smollm2"}
    other = _chat_test_pod(tools, "--set", "test.cbdeployment=llama", "--set", "test.namespace=ml",
                           "--set", "test.port=9000", "--set", "test.model=meta/llama")  # fmt: skip
    assert other is not None and {e["name"]: e["value"] for e in other["spec"]["containers"][0]["env"]} == {
        "CHAT_URL": "http://llama.ml.svc:9000/v1/chat/completions", "CHAT_MODEL": "meta/llama"}

    model = save_test_model(tmp_path / "tiny-llama", "llama")
    server = Server(model, tmp_path, {"block_size": 16, "num_blocks": 256}, ["--served-model-name", "smollm2"])
    try:
        command = container["command"]
        assert command[:2] == ["python", "-c"]
        run = subprocess.run([sys.executable, "-c", command[2]], capture_output=True, text=True, timeout=120,
                             env={**env, "CHAT_URL": server.url + "/v1/chat/completions"})  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert '"model": "smollm2"' in run.stdout
        wrong = subprocess.run([sys.executable, "-c", command[2]], capture_output=True, text=True, timeout=120,
                               env={**env, "CHAT_URL": server.url + "/v1/nothing"})  # fmt: skip
        assert wrong.returncode != 0
    finally:
        assert server.stop() == 0
