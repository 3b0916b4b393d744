"""The operator's pure parts: spec parsing and its errors, the engine YAML, the rendered children, the CLI."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from cbserve_operator.__main__ import kopf_args
from cbserve_operator.children import render_children, render_scaled_object
from cbserve_operator.engine_config import engine_settings
from cbserve_operator.settings import seconds_from_env
from cbserve_operator.spec import SpecError, parse_model_uri, parse_spec


def serve_args(command: list[str]) -> Any:
    """The command parsed by `cbserve serve`'s own parser: a flag it does not have fails the test."""
    from engine.cli import build_parser

    assert command[:2] == ["cbserve", "serve"]
    return build_parser().parse_args(command[1:])


def spec(**overrides: Any) -> dict[str, Any]:
    return {"model": {"uri": "/models/tiny"}, **overrides}


@pytest.mark.parametrize(("uri", "scheme", "arg", "claim", "revision"), [
    ("/models/tiny", "local", "/models/tiny", None, None),
    ("pvc://weights/llama/8b", "pvc", "/models/weights/llama/8b", "weights", None),
    ("pvc://weights", "pvc", "/models/weights", "weights", None),
    # the server's loader takes hf:// names itself (engine/hub.py)
    ("hf://HuggingFaceTB/SmolLM2-135M", "hf", "hf://HuggingFaceTB/SmolLM2-135M", None, None),
    ("hf://org/m@0123abc", "hf", "hf://org/m@0123abc", None, "0123abc"),
    ("hf://org/m@refs/pr/1", "hf", "hf://org/m@refs/pr/1", None, "refs/pr/1"),
])
def test_model_uris(uri: str, scheme: str, arg: str, claim: str | None, revision: str | None) -> None:
    source = parse_model_uri(uri)
    assert (source.scheme, source.arg, source.claim, source.revision) == (scheme, arg, claim, revision)


@pytest.mark.parametrize("uri", ["s3://b/m", "models/relative", "hf://noslash", "pvc://UPPER/x", "hf://o/m@",
                                 "hf://o/m@../x", "", None])
def test_bad_model_uris_say_what_is_accepted(uri: Any) -> None:
    with pytest.raises(ValueError, match=r"pvc://claim/path|model.uri is required"):
        parse_model_uri(uri)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SpecError) as info:
        parse_spec("m", spec(replicas="two", engine={"blockSize": 100, "dtype": "int4", "quantization": "q4"},
                             pdb={"minAvailable": 1, "maxUnavailable": 1}, resources={"cpu": "fast"}))
    problems = info.value.problems
    assert "replicas must be int, got 'two'" in problems
    assert "engine.blockSize must be a power of two from 16 to 1024, got 100" in problems
    assert any(p.startswith("engine.dtype must be one of") for p in problems)
    assert "engine.quantization must be one of auto, none, gguf, int8, got 'q4'" in problems
    assert "set pdb.minAvailable or pdb.maxUnavailable, not both" in problems
    assert any(p.startswith("resources.cpu 'fast' is not a Kubernetes quantity") for p in problems)


def test_not_an_object() -> None:
    with pytest.raises(SpecError, match="spec must be an object"):
        parse_spec("m", ["model"])
    with pytest.raises(SpecError, match="engine must be an object"):
        parse_spec("m", spec(engine=5))


def test_scale_to_zero_is_refused_with_the_reason() -> None:
    for keda in (False, True):
        with pytest.raises(SpecError, match="minReplicas must be >= 1, got 0: scale to zero is not offered"):
            parse_spec("m", spec(autoscaling={"enabled": True, "minReplicas": 0, "keda": keda}))


def test_engine_yaml_holds_what_the_spec_gives_by_the_python_names() -> None:
    parsed = parse_spec("m", spec(engine={"blockSize": 64, "numBlocks": 100, "cpuOffloadSpace": 2,
                                          "allowBlockSharing": False, "useCudaGraph": True, "useCudaGraphDecode": False}))
    assert engine_settings(parsed.engine) == {
        "block_size": 64, "num_blocks": 100, "cpu_offload_space": 2.0, "allow_block_sharing": False,
        "use_cuda_graph": [True, False]}
    assert parsed.warnings == ()
    assert engine_settings(parse_spec("m", spec(engine={"useCudaGraph": True})).engine)["use_cuda_graph"] is True
    assert engine_settings(parse_spec("m", spec()).engine) == {}  # the rest: the server's defaults


def test_older_spellings_are_taken_with_a_warning_and_not_both_at_once() -> None:
    old = parse_spec("m", spec(engine={"prefixCaching": False, "cpuOffloadGiB": 8, "cudaGraphs": True,
                                       "cudaGraphsVarlen": False}))
    new = parse_spec("m", spec(engine={"allowBlockSharing": False, "cpuOffloadSpace": 8, "useCudaGraph": True,
                                       "useCudaGraphVarlen": False}))
    assert engine_settings(old.engine) == engine_settings(new.engine) == {
        "allow_block_sharing": False, "cpu_offload_space": 8.0, "use_cuda_graph": [False, True]}
    assert old.warnings == ("engine.prefixCaching is deprecated: use engine.allowBlockSharing",
                            "engine.cpuOffloadGiB is deprecated: use engine.cpuOffloadSpace",
                            "engine.cudaGraphs is deprecated: use engine.useCudaGraph",
                            "engine.cudaGraphsVarlen is deprecated: use engine.useCudaGraphVarlen")
    with pytest.raises(SpecError, match="engine.allowBlockSharing and engine.prefixCaching are the same setting"):
        parse_spec("m", spec(engine={"allowBlockSharing": True, "prefixCaching": True}))
    with pytest.raises(SpecError, match=r"engine.cpuOffloadGiB must be a number >= 0, got -1"):
        parse_spec("m", spec(engine={"cpuOffloadGiB": -1}))


def test_extra_args_go_on_the_command_line_and_hf_models_may_download() -> None:
    parsed = parse_spec("m", spec(model={"uri": "hf://org/model", "servedName": "chat"},
                                  engine={"extraArgs": ["--max-batch-tokens", "4096"]}))
    objs, _ = render_children(parsed, "ns")
    container = objs[1]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][-2:] == ["--max-batch-tokens", "4096"]
    assert serve_args(container["command"]).max_batch_tokens == 4096  # a flag `cbserve serve` has
    assert container["command"][2:6] == ["--model", "hf://org/model", "--served-model-name", "chat"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "HF_HUB_OFFLINE" not in env and env["CBSERVE_MODEL_DIR"] == "/cache/models"  # the pod downloads


def test_keda_scaled_object_queries_the_served_model() -> None:
    parsed = parse_spec("m", spec(model={"uri": "/m", "servedName": "chat"},
                                  autoscaling={"enabled": True, "keda": True, "metric": "kv-cache-usage"}))
    objs, removed = render_children(parsed, "prod")
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service", "ScaledObject"]
    assert ("autoscaling/v2", "HorizontalPodAutoscaler", "m") in removed
    trigger = render_scaled_object(parsed, "prod")["spec"]["triggers"][0]["metadata"]
    assert trigger["query"] == 'avg(cbserve:kv_cache_usage_perc{namespace="prod",model_name="chat"})'
    assert trigger["threshold"] == "0.8"


def test_hpa_on_kv_usage_uses_a_milli_quantity() -> None:
    parsed = parse_spec("m", spec(autoscaling={"enabled": True, "metric": "kv-cache-usage", "target": 0.75}))
    hpa = render_children(parsed, "ns")[0][-1]
    assert hpa["spec"]["metrics"][0]["pods"] == {
        "metric": {"name": "cbserve:kv_cache_usage_perc"}, "target": {"type": "AverageValue", "averageValue": "750m"}}


def test_probe_overrides_and_progress_deadline() -> None:
    parsed = parse_spec("m", spec(probes={"startup": {"failureThreshold": 360}, "liveness": {"periodSeconds": 30}}))
    dep = render_children(parsed, "ns")[0][1]
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["startupProbe"]["failureThreshold"] == 360 and container["startupProbe"]["periodSeconds"] == 10
    assert container["livenessProbe"]["periodSeconds"] == 30
    assert dep["spec"]["progressDeadlineSeconds"] == 3600 + 300
    with pytest.raises(SpecError, match="probes.startup.bogus is not one of"):
        parse_spec("m", spec(probes={"startup": {"bogus": 1}}))


def test_pod_template_extras_reach_the_pod() -> None:
    tpl = {"nodeSelector": {"gpu": "l4"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
           "priorityClassName": "high", "env": [{"name": "HF_HOME", "value": "/data"}],
           "volumes": [{"name": "data", "emptyDir": {}}], "volumeMounts": [{"name": "data", "mountPath": "/data"}]}
    pod = render_children(parse_spec("m", spec(podTemplate=tpl)), "ns")[0][1]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "l4"} and pod["priorityClassName"] == "high"
    env = pod["containers"][0]["env"]
    assert [e for e in env if e["name"] == "HF_HOME"] == [{"name": "HF_HOME", "value": "/data"}]
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]


def test_runtime_class_and_topology_spread_reach_the_pod() -> None:
    """A constraint without a labelSelector spreads this CBDeployment's pods (its own selector)."""
    zones = {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "ScheduleAnyway"}
    chosen = {**zones, "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"team": "a"}}}
    tpl = {"runtimeClassName": "nvidia", "topologySpreadConstraints": [zones, chosen]}
    pod = render_children(parse_spec("m", spec(podTemplate=tpl)), "ns")[0][1]["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["topologySpreadConstraints"] == [
        {**zones, "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "cbserve", "app.kubernetes.io/instance": "m"}}},
        chosen]
    with pytest.raises(SpecError, match="podTemplate.runtimeClassName must be a DNS-1123 subdomain"):
        parse_spec("m", spec(podTemplate={"runtimeClassName": "a" * 254}))  # the CRD's maxLength too
    plain = render_children(parse_spec("m", spec()), "ns")[0][1]["spec"]["template"]["spec"]
    assert "runtimeClassName" not in plain and "topologySpreadConstraints" not in plain


def test_python_m_cbserve_operator_builds_the_kopf_command_line() -> None:
    assert kopf_args([]) == ["run", "-m", "cbserve_operator.handlers", "--standalone", "--all-namespaces",
                             "--liveness", "http://0.0.0.0:8080/healthz"]
    custom = kopf_args(["--namespace", "ml", "--liveness=http://0.0.0.0:9000/healthz", "--verbose"])
    assert custom == ["run", "-m", "cbserve_operator.handlers", "--standalone",
                      "--namespace", "ml", "--liveness=http://0.0.0.0:9000/healthz", "--verbose"]


def test_timeouts_from_the_environment_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_WATCH_SERVER_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CBSERVE_WATCH_SERVER_TIMEOUT must be a number of seconds"):
        seconds_from_env("CBSERVE_WATCH_SERVER_TIMEOUT", 300)
    monkeypatch.setenv("CBSERVE_WATCH_SERVER_TIMEOUT", "120")
    assert seconds_from_env("CBSERVE_WATCH_SERVER_TIMEOUT", 300) == 120.0


def test_full_example_renders_every_optional_child() -> None:
    from .conftest import REPO

    full = yaml.safe_load((REPO / "examples" / "cbdeployment-full.yaml").read_text())
    objs, removed = render_children(parse_spec("llama-8b", full["spec"]), "default")
    assert [o["kind"] for o in objs] == ["ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
                                         "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor",
                                         "InferencePool"]
    # one pod per replica: no LeaderWorkerSet, nor its headless Service
    assert removed == [("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llama-8b-group"),
                       ("v1", "Service", "llama-8b-group"), ("keda.sh/v1alpha1", "ScaledObject", "llama-8b")]


def test_an_inference_pool_selects_the_server_pods_and_names_the_picker() -> None:
    routing = {"inferencePool": {"enabled": True, "endpointPicker": {"name": "m-epp"}}}
    objs, removed = render_children(parse_spec("m", spec(routing=routing)), "ns")
    pool = next(o for o in objs if o["kind"] == "InferencePool")
    service = next(o for o in objs if o["kind"] == "Service")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "m"
    assert pool["spec"] == {
        "selector": {"matchLabels": service["spec"]["selector"]},
        "targetPorts": [{"number": 8000}],  # the pods' port: the Gateway sends to pods, not to the Service
        "endpointPickerRef": {"kind": "Service", "name": "m-epp", "port": {"number": 9002}, "failureMode": "FailClose"},
    }
    # a multi-node group: its leaders only, as the Service
    group_objs, _ = render_children(parse_spec("m", spec(routing=routing, resources={"gpu": 1, "nodes": 2})), "ns")
    group_pool = next(o for o in group_objs if o["kind"] == "InferencePool")
    assert group_pool["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "server"
    _, removed = render_children(parse_spec("m", spec()), "ns")
    assert ("inference.networking.k8s.io/v1", "InferencePool", "m") in removed


def test_the_docs_inference_pool_is_what_the_operator_renders() -> None:
    """docs/kubernetes.md's routing example: its CBDeployment renders the InferencePool shown under it."""
    import re

    from .conftest import REPO

    text = (REPO / "docs" / "kubernetes.md").read_text()
    section = text[text.index("## Routing by queue and KV cache: InferencePool"):]
    cbd, shown, gateway, route = yaml.safe_load_all(re.search(r"```yaml\n(.*?)```", section, re.S)[1])  # type: ignore[index]
    objs, _ = render_children(parse_spec(cbd["metadata"]["name"], cbd["spec"]), cbd["metadata"]["namespace"])
    pool = next(o for o in objs if o["kind"] == "InferencePool")
    assert (pool["apiVersion"], pool["metadata"]["name"], pool["spec"]) == (shown["apiVersion"], shown["metadata"]["name"], shown["spec"])
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}]
    assert route["spec"]["parentRefs"] == [{"name": gateway["metadata"]["name"]}]


@pytest.mark.parametrize(("routing", "problem"), [
    ({"inferencePool": {"enabled": True}}, "routing.inferencePool.endpointPicker.name is required"),
    ({"inferencePool": {"enabled": True, "endpointPicker": {"name": "e", "port": 0}}},
     "routing.inferencePool.endpointPicker.port must be 1..65535"),
    ({"inferencePool": {"enabled": True, "endpointPicker": {"name": "e", "failureMode": "Open"}}},
     "routing.inferencePool.endpointPicker.failureMode must be FailOpen or FailClose"),
])
def test_a_bad_inference_pool_is_refused(routing: dict, problem: str) -> None:
    with pytest.raises(SpecError, match=problem):
        parse_spec("m", spec(routing=routing))


def test_an_api_key_secret_reaches_the_server_as_cbserve_api_key() -> None:
    parsed = parse_spec("m", spec(apiKeySecret={"name": "cbserve-keys"}))
    container = render_children(parsed, "ns")[0][1]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["CBSERVE_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "cbserve-keys", "key": "api-key"}}
    probes = [container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    assert set(probes) <= {"/ready", "/health"}  # paths the server leaves open to the kubelet
    plain = render_children(parse_spec("m", spec()), "ns")[0][1]["spec"]["template"]["spec"]["containers"][0]
    assert "CBSERVE_API_KEY" not in {e["name"] for e in plain["env"]}
    with pytest.raises(SpecError) as err:
        parse_spec("m", spec(apiKeySecret={"name": "Bad_Name", "key": "a key"}))
    assert "apiKeySecret.name" in str(err.value) and "apiKeySecret.key" in str(err.value)


def test_the_drain_budget_follows_the_grace_period() -> None:
    """The server drains for the grace period less the 5 s preStop sleep and a 10 s margin; a flag in
    extraArgs wins; a grace period the preStop sleep would use up is refused."""
    def command(**tpl: Any) -> list[str]:
        parsed = parse_spec("m", spec(podTemplate=tpl, **({"engine": {"extraArgs": ["--drain-timeout", "7"]}}
                                                          if tpl.pop("override", False) else {})))  # fmt: skip
        return render_children(parsed, "ns")[0][1]["spec"]["template"]["spec"]["containers"][0]["command"]

    def drain(cmd: list[str]) -> str:
        return cmd[len(cmd) - 1 - cmd[::-1].index("--drain-timeout") + 1]  # the last one: argparse's pick

    assert drain(command(terminationGracePeriodSeconds=600)) == "585"
    assert drain(command()) == "105"
    assert drain(command(terminationGracePeriodSeconds=12)) == "1"
    assert drain(command(terminationGracePeriodSeconds=600, override=True)) == "7"
    assert serve_args(command(terminationGracePeriodSeconds=600, override=True)).drain_timeout == 7
    with pytest.raises(SpecError, match="must be above the 5 s preStop sleep"):
        parse_spec("m", spec(podTemplate={"terminationGracePeriodSeconds": 5}))


def test_rollout_strategy_keeps_one_replica_serving_and_needs_no_spare_gpu_with_more() -> None:
    def strategy(**overrides: Any) -> dict[str, Any]:
        return render_children(parse_spec("m", spec(**overrides)), "ns")[0][1]["spec"]["strategy"]

    surge = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    one_down = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert strategy() == surge
    assert strategy(replicas=3) == surge
    assert strategy(resources={"gpu": 1}) == surge  # one GPU replica: its surge pod loads while it serves
    assert strategy(replicas=2, resources={"gpu": 1}) == one_down  # the other serves; no spare GPU needed
    assert strategy(resources={"gpu": 1}, rollout={"maxSurge": 0}) == one_down  # no spare GPU: down for the load
    assert strategy(resources={"gpu": 1}, rollout={"strategy": "Recreate"}) == {"type": "Recreate"}
    assert strategy(rollout={"maxSurge": "25%", "maxUnavailable": "25%"})["rollingUpdate"] == {
        "maxSurge": "25%", "maxUnavailable": "25%"}
    for bad, words in [({"strategy": "BlueGreen"}, "rollout.strategy must be one of"),
                       ({"maxSurge": 0, "maxUnavailable": 0}, "cannot both be 0"),
                       ({"maxSurge": "150%"}, "a percentage like 25%"),
                       ({"strategy": "Recreate", "maxSurge": 1}, "RollingUpdate only")]:
        with pytest.raises(SpecError, match=words):
            parse_spec("m", spec(rollout=bad))


def test_pods_are_never_best_effort_and_their_volumes_are_sized() -> None:
    """No requests in the spec still requests a CPU, memory and the ephemeral storage the volumes may
    fill (cache + tmp), so the pod is Burstable, not BestEffort; the emptyDirs have size limits."""
    def pod(**overrides: Any) -> dict[str, Any]:
        return render_children(parse_spec("m", spec(**overrides)), "ns")[0][1]["spec"]["template"]["spec"]

    plain = pod()
    assert plain["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "2Gi", "ephemeral-storage": "3072Mi"}}
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in plain["volumes"] if "emptyDir" in v}
    assert sizes == {"cache": "2Gi", "tmp": "1Gi"}
    hf = pod(model={"uri": "hf://org/model"}, resources={"gpu": 1, "shmSize": "4Gi"})
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in hf["volumes"] if "emptyDir" in v}
    assert sizes == {"cache": "50Gi", "tmp": "1Gi", "dshm": "4Gi"}  # downloads need room; shm sized
    assert hf["containers"][0]["resources"]["requests"]["ephemeral-storage"] == f"{51 * 1024}Mi"
    with pytest.raises(SpecError, match="resources.cacheSize '2e9' is not a size"):
        parse_spec("m", spec(resources={"cacheSize": "2e9"}))


def test_the_device_follows_the_gpu_request() -> None:
    def command(**resources: Any) -> list[str]:
        parsed = parse_spec("m", spec(resources=resources))
        return render_children(parsed, "ns")[0][1]["spec"]["template"]["spec"]["containers"][0]["command"]

    assert serve_args(command(gpu=1)).device == "cuda"
    assert serve_args(command(gpu=0)).device == "cpu"
    assert serve_args(command()).device == "cpu"
    assert command(gpu=1)[-2:] == ["--device", "cuda"]  # before extraArgs: a --device there wins


@pytest.mark.parametrize(("resources", "engine", "words"), [
    ({"gpu": 3}, {}, "resources.gpu must be 0, 1, 2, 4, 8 or 16: the GPUs of a pod form one tensor-parallel group, "
                     "whose size is a power of two, got 3"),
    ({"gpu": 0, "nodes": 2}, {}, "resources.nodes above 1 needs resources.gpu >= 1"),
    ({"gpu": 2, "nodes": 65}, {}, "resources.nodes must be in [1, 64], got 65"),
    ({"gpu": 2}, {"extraArgs": ["--tensor-parallel-size=4"]}, "engine.extraArgs cannot set --tensor-parallel-size, "
     "--nnodes, --node-rank, --dist-addr or --dist-port: the operator sets them from resources.gpu and resources.nodes, "
     "got --tensor-parallel-size=4"),
    ({"gpu": 1}, {"blockSize": 128}, "engine.blockSize must be a multiple of 256 when resources.gpu > 0: flash-attn's "
                                     "paged kernels take blocks of 256 tokens, got 128"),
    ({"gpu": 1}, {"dtype": "float32"}, "engine.dtype float32 is refused when resources.gpu > 0: flash-attn runs "
                                       "float16 and bfloat16 only"),
])
def test_the_operator_refuses_what_the_gpu_engine_cannot_run(resources: dict, engine: dict, words: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec("m", spec(resources=resources, engine=engine))
    assert any(p.startswith(words) for p in err.value.problems), err.value.problems


def test_a_pods_gpus_are_its_tensor_parallel_size() -> None:
    def command(**resources: Any) -> list[str]:
        objs = render_children(parse_spec("m", spec(resources=resources, engine={"extraArgs": ["--seed", "1"]})), "ns")[0]
        (dep,) = [o for o in objs if o["kind"] == "Deployment"]
        return dep["spec"]["template"]["spec"]["containers"][0]["command"]

    assert command(gpu=4)[-6:] == ["--device", "cuda", "--tensor-parallel-size", "4", "--seed", "1"]
    assert "--tensor-parallel-size" not in command(gpu=1) and "--tensor-parallel-size" not in command(gpu=0)
    assert parse_spec("m", spec(resources={"gpu": 8})).world_size == 8
    assert parse_spec("m", spec(resources={"gpu": 4, "nodes": 2})).world_size == 8
    assert parse_spec("m", spec(resources={"gpu": 1, "nodes": 2})).world_size == 2


@pytest.mark.parametrize(("gpu", "nodes", "heads", "ok"), [
    (4, 1, 8, True), (8, 1, 8, True), (16, 1, 8, False), (2, 2, 8, True), (4, 4, 8, False), (1, 3, 6, True),
    (1, 4, 6, False), (0, 1, 5, True),  # the CPU engine: one rank, any count
])
def test_the_kv_heads_a_spec_states_must_split_evenly(gpu: int, nodes: int, heads: int, ok: bool) -> None:
    given = spec(model={"uri": "/m", "numKeyValueHeads": heads}, resources={"gpu": gpu, "nodes": nodes})
    if ok:
        assert parse_spec("m", given).model.num_key_value_heads == heads
        return
    with pytest.raises(SpecError, match=rf"model.numKeyValueHeads must be divisible by the tensor-parallel size, "
                                        rf"resources.gpu x resources.nodes: each GPU holds whole KV heads, got {heads} "
                                        rf"heads for {max(gpu, 1) * nodes} GPUs"):  # fmt: skip
        parse_spec("m", given)


def test_a_multi_node_name_leaves_room_for_the_groups_pod_names() -> None:
    parse_spec("a" * 40, spec(resources={"gpu": 1, "nodes": 2}))
    parse_spec("a" * 63, spec(resources={"gpu": 1}))  # one pod per replica: the usual 63
    with pytest.raises(SpecError, match="metadata.name must be at most 40 characters when resources.nodes > 1"):
        parse_spec("a" * 41, spec(resources={"gpu": 1, "nodes": 2}))


@pytest.mark.parametrize(("resources", "engine"), [
    ({"gpu": 1}, {"blockSize": 512, "dtype": "bfloat16"}),
    ({"gpu": 1}, {"dtype": "float16"}),
    ({"gpu": 1}, {}),
    ({"gpu": 0}, {"blockSize": 16, "dtype": "float32"}),
    ({}, {"blockSize": 64}),
])
def test_what_the_engine_runs_is_accepted(resources: dict, engine: dict) -> None:
    assert parse_spec("m", spec(resources=resources, engine=engine)).engine.settings == {
        {"blockSize": "block_size", "dtype": "dtype"}[k]: v for k, v in engine.items()}
