"""From a CBDeployment to the server's settings: the operator's engine YAML and command line, read by
the server's own parser and loader, give back the values the manifest set."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cbserve_operator import engine_fields
from cbserve_operator.children import render_children
from cbserve_operator.spec import parse_spec
from engine.cli import build_parser
from engine.server.settings import DEFAULT_SERVER_QUEUE, load_settings

from .conftest import CHART, REPO

MANIFESTS = {
    "examples/cbdeployment.yaml": lambda: yaml.safe_load((REPO / "examples" / "cbdeployment.yaml").read_text()),
    "examples/cbdeployment-full.yaml": lambda: yaml.safe_load((REPO / "examples" / "cbdeployment-full.yaml").read_text()),
    "the chart's example": lambda: {"metadata": {"name": "smollm2"},
                                    "spec": yaml.safe_load((CHART / "values.yaml").read_text())["example"]["spec"]},
}


def served_settings(manifest: dict[str, Any], tmp_path: Path) -> Any:
    """What `cbserve serve` makes of the pod the operator renders: its command line, through the real
    parser (a flag serve does not have fails here), with the ConfigMap's engine.yaml as --config."""
    parsed = parse_spec(manifest["metadata"]["name"], manifest["spec"])
    objs, _ = render_children(parsed, "ns")
    config_map = next(o for o in objs if o["kind"] == "ConfigMap")
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    config = tmp_path / "engine.yaml"
    config.write_text(config_map["data"]["engine.yaml"])
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["cbserve", "serve"]
    args = vars(build_parser().parse_args(command[1:]))
    assert args["config"] == "/etc/cbserve/engine.yaml"
    return load_settings({**args, "config": str(config)}, environ={}, queue_default=DEFAULT_SERVER_QUEUE)


def given_by_the_manifest(engine: dict[str, Any]) -> dict[str, Any]:
    """The manifest's spec.engine settings by their YAML keys (use_cuda_graph's halves as its pair)."""
    out: dict[str, Any] = {}
    parts: list[Any] = [None, None]
    for f in engine_fields.FIELDS:
        for name in (f["crd"], *f["deprecated"]):
            if name in engine:
                if "part" in f:
                    parts[f["part"]] = engine[name]
                else:
                    out[f["key"]] = engine[name]
    if parts != [None, None]:
        base = bool(out.get("use_cuda_graph"))
        out["use_cuda_graph"] = tuple(base if p is None else p for p in parts)
    return out


@pytest.mark.parametrize("name", list(MANIFESTS))
def test_the_server_reads_back_what_the_manifest_sets(name: str, tmp_path: Path) -> None:
    manifest = MANIFESTS[name]()
    settings = served_settings(manifest, tmp_path)
    wanted = given_by_the_manifest(manifest["spec"].get("engine", {}))
    assert wanted, "the example sets engine settings"
    for key, value in wanted.items():
        got = getattr(settings.engine, key) if hasattr(settings.engine, key) else getattr(settings, key)
        assert got == value, (key, got, value)
    gpu = manifest["spec"].get("resources", {}).get("gpu", 0)
    assert settings.device == ("cuda" if gpu else "cpu")


def test_a_setting_left_out_takes_the_servers_default(tmp_path: Path) -> None:
    """The operator writes no defaults of its own: an empty spec.engine serves as `cbserve serve` alone."""
    settings = served_settings({"metadata": {"name": "m"}, "spec": {"model": {"uri": "/models/m"}}}, tmp_path)
    alone = load_settings(vars(build_parser().parse_args(["serve"])), environ={}, queue_default=DEFAULT_SERVER_QUEUE)
    assert settings.engine == alone.engine and settings.dtype == alone.dtype == "auto"
    assert settings.device == "cpu"  # no GPU asked for


def expand(command: list[str], env: dict[str, str]) -> list[str]:
    """`$(VAR)` in a container's command, as the kubelet expands it from the container's environment."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), arg) for arg in command]


def test_a_groups_commands_are_the_engines(tmp_path: Path) -> None:
    """resources.nodes: 2 with 2 GPUs each: the leader's `cbserve serve` and the worker's `cbserve worker`,
    with the variables LeaderWorkerSet puts in the pods (LWS_WORKER_INDEX 1 on the first worker), read by
    the engine's own parser and loader: one engine of 4 ranks over 2 hosts, meeting at the leader, with
    the same engine settings from the one ConfigMap."""
    manifest = yaml.safe_load((REPO / "examples" / "cbdeployment-full.yaml").read_text())
    manifest["spec"]["resources"].update(gpu=2, nodes=2)
    objs, _ = render_children(parse_spec("llama-8b", manifest["spec"]), "ns")
    config = tmp_path / "engine.yaml"
    config.write_text(next(o for o in objs if o["kind"] == "ConfigMap")["data"]["engine.yaml"])
    templates = next(o for o in objs if o["kind"] == "LeaderWorkerSet")["spec"]["leaderWorkerTemplate"]
    address = "llama-8b-group-0.llama-8b-group.ns"
    read = {}
    for role, index in (("leader", "0"), ("worker", "1")):
        command = templates[f"{role}Template"]["spec"]["containers"][0]["command"]
        args = vars(build_parser().parse_args(expand(command, {"LWS_LEADER_ADDRESS": address,
                                                                "LWS_WORKER_INDEX": index})[1:]))  # fmt: skip
        assert (args["nnodes"], args["dist_addr"], args["dist_port"]) == (2, address, 29500)
        read[role] = (args, load_settings({**args, "config": str(config)}, environ={},
                                          queue_default=DEFAULT_SERVER_QUEUE))  # fmt: skip
    assert read["worker"][0]["node_rank"] == 1 and "node_rank" not in read["leader"][0]  # the leader is rank 0
    for args, settings in read.values():
        assert settings.engine.tensor_parallel_size == 4 and settings.device == "cuda"
    assert read["worker"][1].engine == read["leader"][1].engine


def test_a_pods_gpus_are_the_engines_tensor_parallel_size(tmp_path: Path) -> None:
    manifest = yaml.safe_load((REPO / "examples" / "cbdeployment.yaml").read_text())
    manifest["spec"]["resources"]["gpu"] = 4
    settings = served_settings(manifest, tmp_path)
    assert settings.engine.tensor_parallel_size == 4 and settings.device == "cuda"
